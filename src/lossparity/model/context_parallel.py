"""Context parallelism (CP) for the reference model: each sequence is split over ``C`` ranks.

Sharding: with ``zigzag=True`` (default, Megatron's load-balanced order) a row of length ``S`` is cut
into ``2C`` chunks and rank ``r`` holds chunks ``r`` and ``2C−1−r``, so every rank gets the same
amount of causal-attention work; ``zigzag=False`` gives rank ``r`` the ``r``-th contiguous slice.

Attention: keys and values of all shards are all-gathered with autograd (:class:`_GatherShards`: its
backward sums each shard's key/value gradients back to the owner; ``torch.distributed.nn.functional``'s
all-gather is not used because its gloo backward addresses subgroup ranks as global ranks), and the
causal + document mask is built from global positions, so every query attends exactly as in the
unsharded row. Every rank holds the whole rows of its data-parallel rank
(inputs are cheap), so MTP inputs and rolled labels are computed on whole rows and then sharded:
rolling across shard boundaries is exact by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..options import check_cp_seq_len

__all__ = ["ContextParallel", "shard_columns"]


class _GatherShards(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; backward: the gradient of this rank's slice summed over the
    group (a reduce-scatter, written as all-reduce + slice so that it also runs on gloo)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:  # noqa: D102
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        ctx.group, ctx.dim, ctx.rank, ctx.size = group, dim, dist.get_rank(group), x.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None


def shard_columns(seq_len: int, cp_size: int, cp_rank: int, zigzag: bool = True) -> Tensor:
    """The positions ``[S/C]`` of a row held by CP rank ``cp_rank`` (see the module docstring)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    check_cp_seq_len(seq_len, cp_size, zigzag)
    parts = 2 * cp_size if zigzag else cp_size
    chunks = torch.arange(seq_len).chunk(parts)
    if zigzag:
        return torch.cat([chunks[cp_rank], chunks[parts - 1 - cp_rank]])
    return chunks[cp_rank]


@dataclass
class ContextParallel:
    """A CP group and its sharding; ``columns(S)`` are this rank's positions, ``all_columns(S)`` the
    positions of all ranks in rank order (the order of all-gathered keys)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    zigzag: bool = True

    def columns(self, seq_len: int) -> Tensor:
        return shard_columns(seq_len, self.size, self.rank, self.zigzag)

    def all_columns(self, seq_len: int) -> Tensor:
        return torch.cat([shard_columns(seq_len, self.size, r, self.zigzag) for r in range(self.size)])

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """All-gather ``x`` along ``dim`` over the CP group, with autograd."""
        return _GatherShards.apply(x, self.group, dim)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, zigzag: bool = True) -> ContextParallel:
        return cls(group, dist.get_world_size(group), dist.get_rank(group), zigzag)
