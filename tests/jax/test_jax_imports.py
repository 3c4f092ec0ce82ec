"""Import hygiene: ``lossparity.jax`` never imports torch, ``import lossparity`` never imports JAX, and the
JAX code also runs with float64 disabled (JAX's default). Each check runs in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import lossparity

JAX_PKG = Path(lossparity.__file__).parent / "jax"
ALLOWED_ROOTS = {
    "jax",
    "numpy",
    "__future__",
    "collections",
    "contextlib",
    "dataclasses",
    "functools",
    "math",
    "numbers",
    "threading",
    "typing",
}


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_ENABLE_X64")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_jax_modules_import_only_jax_numpy_and_stdlib():
    files = sorted(JAX_PKG.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside lossparity.jax, or the torch-free options and mode table
                    outside = node.level == 2 and node.module in ("options", "losses.mode_table")
                    assert node.level == 1 or outside, f"{path.name}: relative import beyond lossparity.jax"
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= ALLOWED_ROOTS, f"{path.name} imports {roots - ALLOWED_ROOTS}"


def test_lossparity_jax_imports_and_runs_with_torch_blocked():
    # The real package: `lossparity/__init__.py` imports its torch-based names lazily. x64 stays off.
    code = """
import sys
sys.modules["torch"] = None
import jax.numpy as jnp
import lossparity.jax as lj
assert "torch" not in [m.split(".")[0] for m, v in sys.modules.items() if v is not None]
loss = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], jnp.float32)
mask = jnp.asarray([[1, 1, 1], [1, 0, 0]])
j = lj.objective("per_sample", loss, mask)
assert j.dtype == jnp.float32 and abs(float(j) - 3.0) < 1e-6, j
ce = lj.chunked_cross_entropy(jnp.ones((3, 2)), jnp.ones((4, 2)), jnp.asarray([0, 1, -100]))
assert ce.dtype == jnp.float32
print("ok")
"""
    proc = _run(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_import_lossparity_does_not_need_jax():
    proc = _run('import sys; sys.modules["jax"] = None; import lossparity; lossparity.Accountant; print("ok")')
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
