"""Small collective helpers shared by the accountant and the trainer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_reduce_coalesced"]


def all_reduce_coalesced(tensors: Sequence[Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum ``tensors`` over ``group`` in place with one all-reduce of their concatenation (skipped when
    ``group`` is ``None`` or there is nothing to reduce)."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
