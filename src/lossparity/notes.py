"""Operational notes of a run (a checkpoint skipped on resume, metrics lines dropped, temporaries removed).

The library reports them through a ``notify`` callable: by default :func:`warn_note` (a ``UserWarning``,
for API users who filter or record warnings); the ``lossparity`` CLI passes one that prints each note as
one line on stderr (``lossparity train: note: ...``), which no warning filter hides.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

__all__ = ["Notify", "warn_note"]

Notify = Callable[[str], None]


def warn_note(text: str) -> None:
    """The default ``notify``: ``warnings.warn(text)`` (``UserWarning``)."""
    warnings.warn(text, UserWarning, stacklevel=3)
