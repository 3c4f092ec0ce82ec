"""``lossparity --version``: the line a bug report needs.

The versions come from the installed distributions' metadata (:mod:`importlib.metadata`), so no framework
is imported: the line prints in a fraction of a second even where torch or JAX are slow to import.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from collections.abc import Sequence
from typing import Any

from .._version import __version__

__all__ = ["FRAMEWORKS", "version_line", "VersionAction"]

# The distributions lossparity integrates with, in the order printed; those not installed are left out.
FRAMEWORKS: tuple[str, ...] = (
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "megatron-core",
    "torchtitan",
    "jax",
    "jaxlib",
    "maxtext",
)


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_line(frameworks: Sequence[str] = FRAMEWORKS) -> str:
    """``lossparity 0.1.0 (python 3.12.3, linux x86_64; torch 2.13.0+cpu, transformers 5.24.0, ...)``:
    lossparity's version, the interpreter and platform, and the version of each distribution of
    ``frameworks`` that is installed (read from its metadata, never imported)."""
    found = [f"{name} {v}" for name in frameworks if (v := _installed(name)) is not None]
    if "torch" in frameworks and _installed("torch") is None:
        found.insert(0, "torch not installed")  # the log tools run without it; say so rather than omit it
    where = f"python {platform.python_version()}, {sys.platform} {platform.machine()}"
    return f"lossparity {__version__} ({where}; {', '.join(found)})"


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit 0 (computed only when the flag is given)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        print(version_line())
        parser.exit(0)
