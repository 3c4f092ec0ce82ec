"""The README's quick-start snippet runs as written and gives the documented numbers."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _script():
    """``scripts/readme_quick_start.py``: the same check runs from the installed wheel (``./dev.sh wheel``)."""
    spec = importlib.util.spec_from_file_location("readme_quick_start", ROOT / "scripts" / "readme_quick_start.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_start_snippet_runs_and_matches_naive_formula():
    logs = _script().check_quick_start(README)  # asserts objective and lm_loss against float64 formulas
    assert logs["samples"] == 4 and logs["tokens"] == 10  # hand-counted: rows of 6, 1, 0 and 3 loss tokens
