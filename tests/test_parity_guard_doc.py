"""docs/parity-guard.md: its python blocks run as written (in order, in one namespace, in a fresh folder), and
every line of the output shown after a block is in what the block really prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "parity-guard.md"
BLOCK = re.compile(r"```(python|text)\n(.*?)```", re.S)


def _python_blocks() -> list[tuple[str, str | None]]:
    """``(code, shown output or None)`` of every python block, the output being the text block right after it
    (only prose between them)."""
    text = DOC.read_text()
    found = list(BLOCK.finditer(text))
    out = []
    for i, m in enumerate(found):
        if m.group(1) != "python":
            continue
        nxt = found[i + 1] if i + 1 < len(found) else None
        between = text[m.end() : nxt.start()] if nxt else ""
        shown = nxt.group(2) if nxt and nxt.group(1) == "text" and "```" not in between else None
        out.append((m.group(2), shown))
    return out


def test_python_blocks_run_and_print_what_the_page_shows(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError)
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks()
    assert len(blocks) == 4
    ns: dict = {}
    for i, (code, shown) in enumerate(blocks):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            exec(compile(code, f"parity-guard.md block {i + 1}", "exec"), ns)
        printed = buf.getvalue().splitlines()
        for line in (shown or "").splitlines():
            if line.strip():
                assert line in printed, (i + 1, line, printed)
    assert ns["raised"].state.global_step == 4 and ns["same"].state.global_step == 6
