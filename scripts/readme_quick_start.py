"""Run the README's quick start as written and check its numbers against a naive float64 computation.

Two callers: ``tests/test_readme.py`` (the checkout) and ``./dev.sh wheel`` (the installed wheel, from a
fresh virtual environment: ``python scripts/readme_quick_start.py README.md`` outside the checkout).
Needs only torch and lossparity.
"""

from __future__ import annotations

import pathlib
import re
import sys
from typing import Any

import torch

import lossparity as lp


def quick_start_block(readme: str | pathlib.Path, title: str = "## Quick start") -> str:
    """The first ``python`` block after ``title`` in the README."""
    text = pathlib.Path(readme).read_text()
    section = text[text.index(title) :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    if found is None:
        raise AssertionError(f"{readme}: no python block after {title!r}")
    return found.group(1)


def check_quick_start(readme: str | pathlib.Path) -> dict[str, Any]:
    """Execute the quick start's ``train_step`` on a tiny float64 model (4 rows, 2 microbatches, one empty
    row) and compare its logs with the per-sample mean ``(1/N) Σ s_i / max(n_i, 1)`` and the token mean
    ``S / Ntok`` computed directly; returns the logs. Raises ``AssertionError`` on a difference > 1e-12."""
    ns: dict[str, Any] = {}
    exec(compile(quick_start_block(readme), "README-quick-start", "exec"), ns)
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
    per_sample, token_mean = float((s / n.clamp(min=1)).mean()), float(s.sum() / n.sum())
    assert abs(logs["objective"] - per_sample) < 1e-12, (logs["objective"], per_sample)
    assert abs(logs["lm_loss"] - token_mean) < 1e-12, (logs["lm_loss"], token_mean)
    assert isinstance(ns["acc"], lp.Accountant)  # the snippet used the public API
    return logs


if __name__ == "__main__":
    logs = check_quick_start(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    print(
        f"README quick start: objective {logs['objective']:.12g}, lm_loss {logs['lm_loss']:.12g} "
        f"(naive float64 agrees; lossparity from {pathlib.Path(lp.__file__).parent})"
    )
