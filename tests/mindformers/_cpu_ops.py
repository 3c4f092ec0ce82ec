"""Test-only CPU stand-ins: the ``mindspore.mint`` functions that MindFormers' code paths under test call and that
have no CPU kernel in MindSpore 2.10 ("The kernel X unregistered"), rebound to the older ``ops`` equivalents that
do, and MindFormers' indexer-tracker clearing (an in-place zero without a CPU kernel). :func:`enable` rebinds them
in this process (tests only; the library never imports this module)."""

from __future__ import annotations

from typing import Any

import mindspore as ms
from mindspore import mint, ops

_SAVED: dict[str, Any] = {}


def _zeros_like(x: Any, *, dtype: Any = None) -> Any:
    return ops.zeros(tuple(x.shape), dtype or x.dtype)


def _ones_like(x: Any, *, dtype: Any = None) -> Any:
    return ops.ones(tuple(x.shape), dtype or x.dtype)


def _sum(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    out = ops.sum(x.astype(ms.float32) if x.dtype == ms.bool_ else x, dim, keepdim)
    return out.astype(dtype) if dtype is not None else out


def _scatter_add(x: Any, dim: int, index: Any, src: Any) -> Any:
    return ops.tensor_scatter_elements(x, index, src, axis=dim, reduction="add")


STAND_INS = {"zeros_like": _zeros_like, "ones_like": _ones_like, "sum": _sum, "scatter_add": _scatter_add}


def _clear_indexer_losses_tracker() -> None:
    # MindFormers' version zeroes each slot with Tensor.zero_ (InplaceZero: no CPU kernel); same effect
    from mindformers.pynative.transformers.experimental_attention_variant import utils  # noqa: PLC0415

    tracker = utils.get_indexer_loss_tracker()
    if "values" in tracker:
        tracker["values"] = ops.zeros(tuple(tracker["values"].shape), tracker["values"].dtype)


def enable() -> None:
    """Rebind the stand-ins on ``mindspore.mint`` and MindFormers' tracker clearing (idempotent)."""
    from mindformers.pynative.transformers.experimental_attention_variant import utils  # noqa: PLC0415

    for name, fn in STAND_INS.items():
        _SAVED.setdefault(name, getattr(mint, name))
        setattr(mint, name, fn)
    ms.Tensor.clone = lambda self: self.copy()  # process_mtp_loss: labels.clone() (Clone: no CPU kernel)
    utils.clear_indexer_losses_tracker = _clear_indexer_losses_tracker
