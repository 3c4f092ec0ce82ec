"""Activation recompute (gradient checkpointing) that tells the model when it is being re-run.

A forward re-run by :func:`checkpoint` during backward must record nothing and count nothing (semantics §6):
the re-run executes under a thread-local flag, read with :func:`is_recomputing`. The flag is a depth
counter so nested checkpoints compose; it is thread-local because the autograd engine runs the re-run
on the thread that executes the backward (the caller's on CPU, a device thread on GPU).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint

__all__ = ["checkpoint", "is_recomputing"]

_state = threading.local()


def is_recomputing() -> bool:
    """True exactly while a :func:`checkpoint` region is being re-run for backward on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _recompute_region() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _recompute_region()


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with its activations dropped and recomputed in backward
    (``torch.utils.checkpoint.checkpoint``, non-reentrant, so ``fn`` may return any structure of tensors).
    The first run sees ``is_recomputing() == False``, the backward re-run ``True``."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
