"""Errors shared by the subcommands of the ``lossparity`` command line."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad command-line input: reported on stderr with exit code 2."""
