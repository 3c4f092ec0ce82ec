"""The size limits of docs/architecture.md, checked by `./dev.sh lint`: no library file over 600 lines and
no class over 350 lines (a longer one is two concepts). Prints each offender and exits 1 (also when it
finds no file to check); exits 0 silently."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FILE_LINES = 600
MAX_CLASS_LINES = 350


def offenders(root: Path) -> list[str]:
    """``path: what`` for every file or class of ``root`` over its limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            found.append(f"{path}: {lines} lines (limit {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    found.append(f"{path}: class {node.name} is {size} lines (limit {MAX_CLASS_LINES})")
    return found


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent / "src" / "lossparity"
    if not any(root.rglob("*.py")):  # a moved package or a wrong path would otherwise check nothing and pass
        print(f"check_sizes: no Python file under {root}")
        sys.exit(1)
    bad = offenders(root)
    print("\n".join(bad))
    sys.exit(1 if bad else 0)
