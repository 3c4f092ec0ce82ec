"""Gradient scaling and reduction of the accountant's ``finish_step`` (docs/semantics.md §3).

The objective's gradients must be *summed* over the ranks holding replicas of a parameter. An averaging
engine (DDP, FSDP) divides them by the number of replicas, so the accountant multiplies them back; a plain
module's gradients are summed here, in one all-reduce of their concatenation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .collectives import all_reduce_coalesced

__all__ = ["is_averaging_engine", "unique_grads", "reduce_and_scale"]


def is_averaging_engine(model: object) -> bool:
    """DDP and FSDP (1 and 2) divide gradients by the data-parallel size."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule  # FSDP2, torch >= 2.6

        if isinstance(model, FSDPModule):
            return True
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return isinstance(model, FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        return False


def unique_grads(
    model: nn.Module | Iterable[Tensor] | None, fill_missing: bool = False, skip: set[int] | None = None
) -> list[Tensor]:
    """Gradients of the distinct parameters (except those whose ``id`` is in ``skip``); with
    ``fill_missing``, parameters that require grad but got none (e.g. an expert that received no token on
    this rank) get zeros, so that every rank reduces a buffer of the same layout."""
    if model is None:
        return []
    params = model.parameters() if isinstance(model, nn.Module) else model
    seen: set[int] = set(skip or ())
    grads = []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad is None:
            if not (fill_missing and p.requires_grad):
                continue
            p.grad = torch.zeros_like(p)
        g = p.grad
        # DTensor gradients (tensor parallel, FSDP2): scale/reduce the local shard in place.
        grads.append(g.to_local() if hasattr(g, "to_local") else g)
    return grads


def reduce_and_scale(grads: list[Tensor], group: ProcessGroup | None, factor: float) -> None:
    """``g ← factor · Σ_group g`` in place for every ``g`` of ``grads`` (one all-reduce of their
    concatenation; no collective when ``group`` is ``None``)."""
    all_reduce_coalesced(grads, group)
    if factor != 1.0 and grads:
        torch._foreach_mul_(grads, factor)
