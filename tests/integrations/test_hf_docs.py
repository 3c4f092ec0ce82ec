"""docs/hf-trainer.md: its python code block runs as written (a real transformers Trainer run)."""

from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("transformers")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "hf-trainer.md"


def test_hf_trainer_doc_block_runs(tmp_path, monkeypatch, capsys):
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs-hf-trainer", "exec"), {})
    assert "'step': 2" in capsys.readouterr().out  # logging_steps=2: the first entry is step 2
