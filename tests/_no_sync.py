"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: every operation that reads device data back
to the host fails.

Two layers. A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten operator, however it
was reached (a method, a function, boolean indexing, autograd's backward): it fails on the operators whose
result or output size depends on the tensor's values, which on a GPU wait for the device (:data:`SYNC_OPS`,
plus indexing with a boolean mask and ``repeat_interleave`` without ``output_size``). The conversions that copy
data out without an aten operator (``tolist``, ``numpy``, ``__array__``) are patched on ``torch.Tensor``.
On a CUDA machine the driver's own check is turned on as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operators that read values back: a Python scalar (item, bool(), int(), float(), torch.equal, is_nonzero) or
# an output whose size is data-dependent (nonzero and what decomposes to it: argwhere, where(cond),
# masked_select, unique, bincount).
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.nonzero.out,
    aten.nonzero_numpy.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten.masked_select.out,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default,
    aten.bincount.default,
}
# Indexing operators that synchronize when an index is a boolean (or uint8) mask (nonzero inside the kernel).
MASK_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
REPEAT_OPS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
HOST_METHODS = ("tolist", "numpy", "__array__")


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


class HostSyncError(AssertionError):
    """An operation that reads device data back to the host ran inside :func:`no_host_sync`."""


class _SyncGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if func in SYNC_OPS:
            raise HostSyncError(f"host synchronization: {name}")
        if func in MASK_INDEX_OPS and len(args) > 1 and any(_is_mask(i) for i in args[1] or ()):
            raise HostSyncError(f"host synchronization: {name} with a boolean mask index")
        if func in REPEAT_OPS and kwargs.get("output_size") is None:  # output_size is keyword-only
            raise HostSyncError(f"host synchronization: {name} without output_size")
        return func(*args, **kwargs)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Fail on every operation that reads device data back to the host (see the module docstring)."""
    saved = {n: getattr(torch.Tensor, n) for n in HOST_METHODS}

    def make(name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise HostSyncError(f"host synchronization: Tensor.{name}")

        return fail

    try:
        for n in HOST_METHODS:
            setattr(torch.Tensor, n, make(n))
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("error")
        with _SyncGuard():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
