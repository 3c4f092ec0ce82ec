"""The README's quick-start snippet runs as written and gives the documented numbers."""

from __future__ import annotations

import pathlib

from _scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _script():
    """``scripts/readme_quick_start.py``: the same check runs from the installed wheel (``./dev.sh wheel``)."""
    return load_script("readme_quick_start")


def test_quick_start_snippet_runs_and_matches_naive_formula():
    logs = _script().check_quick_start(README)  # asserts objective and lm_loss against float64 formulas
    assert logs["samples"] == 4 and logs["tokens"] == 10  # hand-counted: rows of 6, 1, 0 and 3 loss tokens


def test_first_screen_shows_install_version_and_reference():
    import lossparity

    screen = "\n".join(README.read_text().split("\n")[:30])
    assert 'pip install ".[hf]"' in screen
    assert f"lossparity --version    # lossparity {lossparity.__version__} (" in screen
    assert "./dev.sh docs" in screen and "API reference" in screen
    assert f"dist/lossparity-{lossparity.__version__}-py3-none-any.whl" in screen  # the name ./dev.sh wheel builds
