"""``lossparity --version`` and the one source of the version."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import tomllib
import torch

import lossparity
from lossparity.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_is_written_once_and_pyproject_reads_it():
    tree = ast.parse((ROOT / "src/lossparity/_version.py").read_text())
    written = [n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)]
    assert written == [lossparity.__version__]
    assert re.fullmatch(r"\d+\.\d+\.\d+", lossparity.__version__)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "a second, static version in pyproject.toml"
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lossparity._version.__version__"}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{lossparity.__version__}]" in changelog, "CHANGELOG.md has no section of this version"


def test_version_flag_prints_lossparity_python_and_torch(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert line.startswith(f"lossparity {lossparity.__version__} (python {sys.version.split()[0]}, ")
    # torch's own idea of its version (the line reads the metadata without importing it)
    assert f"torch {torch.__version__}" in line


def test_version_flag_imports_no_framework():
    code = (
        "import sys; from lossparity.cli import main; code = main(['--version']); "
        "heavy = [m for m in ('torch', 'jax', 'transformers', 'megatron') if m in sys.modules]; "
        "print('imported:', heavy); sys.exit(code)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("imported: []"), out.stdout
