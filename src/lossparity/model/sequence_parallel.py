"""Sequence-parallel (Megatron SP) primitives on a 1-D tensor-parallel ``DeviceMesh``: slice, gather and
reduce-scatter along the sequence. No model imports: the layers (attention, indexer, MoE, GPT) and the
tensor-parallel plan all use these, so keeping them here avoids import cycles."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["sp_gather", "sp_reduce_scatter", "sp_shard"]


def sp_shard(x: Tensor, mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """This TP rank's contiguous slice of ``x`` along ``dim`` (sequence parallelism; the gradient of the
    other slices is zero here and is summed over TP with the replicated parameters' gradients)."""
    size = x.shape[dim] // mesh.size()
    return x.narrow(dim, mesh.get_local_rank() * size, size)


def sp_gather(x: Tensor, mesh: DeviceMesh, dim: int = 1, *, partial_grad: bool) -> Tensor:
    """All-gather the sequence shards along ``dim`` (DTensor ``Shard -> Replicate``). ``partial_grad``:
    the consumer computes TP-partial results (sharded weights), so the backward reduce-scatters;
    otherwise the consumer is replicated compute and the backward just takes this rank's slice."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    full = DTensor.from_local(x, mesh, [Shard(dim)]).redistribute(mesh, [Replicate()])
    return full.to_local(grad_placements=[Partial()] if partial_grad else [Replicate()])


def sp_reduce_scatter(x: Tensor, mesh: DeviceMesh, dim: int = 1) -> Tensor:
    """Sum TP-partial ``x`` over the TP ranks and keep this rank's slice along ``dim`` (``Partial ->
    Shard``; backward: all-gather)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    return DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Shard(dim)]).to_local()
