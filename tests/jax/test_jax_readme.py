"""The README's MaxText drop-in recipe runs and prints the documented values."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_maxtext_recipe_runs_with_documented_output():
    text = README.read_text()
    section = text[text.index("### Drop-in recipe for a MaxText"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README-maxtext-recipe", "exec"), {})
    lines = out.getvalue().split("\n")
    assert [round(float(x), 6) for x in lines[0].split()] == [2.0, 1.75, 2.375]
    assert round(float(lines[1]), 6) == 2.0
