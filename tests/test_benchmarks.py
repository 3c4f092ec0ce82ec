"""The benchmark suite runs in its --quick form and writes its JSON (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_quick_suite_prints_tables_and_writes_json(tmp_path):
    # the checkout's own sources, also where an installed lossparity points elsewhere (a worktree)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each JSON names the machine and holds its measurements (the keys each benchmark writes)
    results = {"cross_entropy": ("figures", "targets"), "accountant": ("overhead", "scaling"), "moe_aux": ("cases",)}
    for name, keys in results.items():
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert data["machine"], name
        assert all(data[k] for k in keys), (name, {k: data.get(k) for k in keys})
    assert "| preset | mode |" in proc.stdout  # the accountant's overhead table
    acc = json.loads((tmp_path / "accountant.json").read_text())
    # the accountant's own collectives per step: the pre-count and the logging all-reduce
    assert acc["overhead"]["tiny/collectives"]["count"] == 2


def test_hf_loss_benchmark_quick(tmp_path):
    # benchmarks/bench_hf_loss.py --quick: a fresh subprocess per (method, shape), its table and JSON.
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    out = tmp_path / "hf_loss.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_hf_loss",
        "--quick",
        "--methods",
        "hf,lossparity",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"hf", "lossparity"} and all("skipped" not in r for r in results.values()), results
    assert "| 2×64×512 | lossparity |" in proc.stdout
