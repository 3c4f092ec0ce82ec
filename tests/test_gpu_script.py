"""The prepared GPU benchmark (benchmarks/gpu.py) parses, imports without a GPU or its optional peers,
and refuses to run without CUDA; its method table includes the fused path."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_parses_and_names_every_method():
    source = (ROOT / "benchmarks" / "gpu.py").read_text()
    ast.parse(source)
    for name in ('"fused"', "liger_flce", '"cce"', "fused_linear_cross_entropy"):
        assert name in source


def test_gpu_script_imports_and_refuses_without_cuda(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("benchmarks.gpu", None)
    from benchmarks import gpu

    h, w = torch.zeros(4, 8, requires_grad=True), torch.zeros(16, 8, requires_grad=True)
    peers = gpu._peers(h, w, torch.zeros(4, dtype=torch.long), torch.ones(4))  # only packages that import
    assert set(peers) <= {"liger_flce", "cce"}
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal path is not reachable")
    with pytest.raises(SystemExit, match="CUDA"):
        gpu.main(["--out", str(tmp_path)])
