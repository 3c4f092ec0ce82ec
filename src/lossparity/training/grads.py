"""Gradient helpers of the reference trainer: one coalesced all-reduce and one gradient-norm clipping,
shared by the plain and the pipeline step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.collectives import all_reduce_coalesced

__all__ = ["all_reduce_coalesced", "clip_grad_norm", "sum_replicated_grads_over_tp", "total_grad_norm"]


def total_grad_norm(grads: Sequence[Tensor], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Global L2 norm ``sqrt(Σ_g ||g||²)`` in float64 of ``grads`` (plain tensors and DTensor shards; the
    DTensor part is reduced over its mesh by ``torch.nn.utils.get_total_norm``), summed over the pipeline
    ranks ``pp_group`` when given (each rank passes the gradients it owns, a shared parameter once)."""
    sq = torch.zeros((), dtype=torch.float64)
    # DTensor and plain gradients cannot share one kernel, nor can DTensors of different placements or of
    # different meshes (tensor-parallel and expert-parallel shards are both Shard(0), on different meshes).
    from torch.distributed.tensor import DTensor

    parts: dict[object, list[Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
        parts.setdefault(key, []).append(g)
    for part in parts.values():
        norm = torch.nn.utils.get_total_norm([g.to(torch.float64) for g in part], foreach=False)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        sq = sq + norm.cpu().pow(2)
    if pp_group is not None:
        dev = grads[0].device if grads else torch.device("cpu")
        sq = sq.to(dev)
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt().cpu()


def clip_grad_norm(
    params: Sequence[torch.nn.Parameter],
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None = None,
    norm_params: Sequence[torch.nn.Parameter] | None = None,
) -> float:
    """Clip the gradients of ``params`` by the global norm ``n`` of :func:`total_grad_norm` over
    ``norm_params`` (default ``params``): ``g ← g · min(1, max_norm/(n + 1e-6))`` (``max_norm <= 0``: no
    clipping, ``torch.nn.utils.clip_grads_with_norm_``). Returns ``n`` (one host sync per step)."""
    counted = params if norm_params is None else norm_params
    norm = total_grad_norm([p.grad for p in counted if p.grad is not None], pp_group)
    with_grad = [p for p in params if p.grad is not None]
    if max_norm > 0 and with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm, foreach=False)
    return float(norm)


def sum_replicated_grads_over_tp(params: Sequence[torch.nn.Parameter], tp_group: dist.ProcessGroup | None) -> None:
    """Sequence parallelism: parameters that stay replicated over TP (norms, routers, embedding, MTP
    projections; the router as a replicated DTensor) saw only this TP rank's slice of the sequence, so
    their gradients are summed over TP (one all-reduce); TP-sharded parameters already have their full
    gradients."""
    grads = [
        g.to_local() if hasattr(g, "to_local") else g
        for g in (p.grad for p in params if p.grad is not None)
        if not hasattr(g, "placements") or all(pl.is_replicate() for pl in g.placements)
    ]
    all_reduce_coalesced(grads, tp_group)
