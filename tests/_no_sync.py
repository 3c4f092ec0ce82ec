"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: every Tensor -> host conversion fails."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def no_host_sync():
    """Fail on every Tensor -> host conversion (CPU stand-in for torch.cuda.set_sync_debug_mode)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def make(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"host synchronization: Tensor.{name}")

        return fail

    try:
        for n in names:
            setattr(torch.Tensor, n, make(n))
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
