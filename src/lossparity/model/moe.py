"""Mixture-of-experts layer: routed SwiGLU experts (no capacity, no token dropping) + optional shared expert.

Dispatch with fixed shapes and no host synchronization (:meth:`GroupedExperts.forward` with ``topk``): every
token has exactly ``k`` experts, so the ``T·k`` (token, expert) pairs are taken from the routing map with
``topk``, sorted by expert (stable ``argsort``), and the per-expert row counts stay on the device
(``dispatch_map.sum(0)`` and their cumulative sum). The three expert matmuls are grouped matmuls over those
offsets (``torch._grouped_mm``: CPU float32/bfloat16, recent GPUs); where it is not available (float64,
other dtypes or devices) the sorted rows are laid out in a zero-padded ``[E, T, dim]`` buffer (a token picks
an expert at most once, so ``T`` rows always suffice) and multiplied with one batched matmul, which costs
``E/k`` times the expert FLOPs but keeps the shapes fixed. The outputs are put back with a permutation
(distinct indices) into ``[T, k, dim]`` and the ``k`` gated slots of a token are added in increasing expert
order: the sums of the previous per-expert ``index_add_`` loop, bit for bit up to the matmul kernels, and
deterministic (no two writes to one row). There is no capacity and nothing is dropped, so a token's output
depends only on that token: the layer is invariant to how tokens are batched.

Without ``topk`` (the expert-parallel path, whose all-to-all needs the split sizes on the host anyway) the
experts are computed by a loop that gathers each expert's tokens with ``nonzero`` and ``index_select`` and
adds the gated outputs with ``index_add_`` (distinct indices within one call, experts in a fixed order).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..options import ScoreFunction
from .mlp import SwiGLU
from .router import Router, RouterRecord
from .sequence_parallel import sp_gather, sp_reduce_scatter

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["GroupedExperts", "MoE"]


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored as stacked weights ``w1, w3 [E, dim, hidden]``, ``w2 [E, hidden, dim]``:
    expert ``e`` maps ``x -> (silu(x w1[e]) ⊙ x w3[e]) w2[e]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        # set by tensor parallelism (model/tensor_parallel.py): the copy-to / reduce-from region functions
        self.tp_region: tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[1]))

    def forward(self, x: Tensor, gates: Tensor, dispatch_map: Tensor, topk: int | None = None) -> Tensor:
        """``out[t] = Σ_{e: dispatch_map[t, e]} gates[t, e] · expert_e(x[t])`` for ``x [T, dim]``,
        ``gates [T, E]``, ``dispatch_map`` bool ``[T, E]``; ``out`` has ``x``'s dtype. ``topk``: the number
        of True entries in every row of ``dispatch_map`` when known (the router's ``k``): the dispatch then
        has fixed shapes and no host synchronization (module docstring)."""
        region = self.tp_region
        w1: Tensor = self.w1
        w3: Tensor = self.w3
        w2: Tensor = self.w2
        if region is not None:
            x = region[0](x)
        if hasattr(w1, "to_local"):  # TP-sharded hidden dimension: TP-partial outputs
            w1, w3, w2 = (cast("DTensor", w).to_local() for w in (w1, w3, w2))
        if topk is not None:
            return _sorted_dispatch(x, gates, dispatch_map, topk, (w1, w3, w2), region)
        out = torch.zeros_like(x)
        # One column per expert held here: E, or E/ep under expert parallelism (model/expert_parallel.py).
        idxs = [dispatch_map[:, e].nonzero().squeeze(1) for e in range(dispatch_map.shape[1])]
        ys = []
        for e, idx in enumerate(idxs):
            xe = x.index_select(0, idx)
            ys.append((F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e])
        if region is not None:
            # One all-reduce of every expert's partial output (sharded hidden dimension), before gating:
            # the gates' gradient then sees full expert outputs, identical on every TP rank.
            ys = list(region[1](torch.cat(ys)).split([len(i) for i in idxs]))
        for e, (idx, ye) in enumerate(zip(idxs, ys)):
            ge = gates[:, e].index_select(0, idx).unsqueeze(1)
            out.index_add_(0, idx, ye.to(out.dtype) * ge.to(out.dtype))
        return out


def _grouped_ok(x: Tensor, w: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands (it exists, dtypes match and are supported)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``torch._grouped_mm``'s backward
    rejects expanded gradients, e.g. that of a plain ``.sum()``)."""

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The matmul dtype of an enabled autocast region (``torch._grouped_mm`` is not on its op lists)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _sorted_dispatch(
    x: Tensor,
    gates: Tensor,
    dispatch_map: Tensor,
    k: int,
    weights: tuple[Tensor, Tensor, Tensor],
    region: tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] | None,
) -> Tensor:
    """:meth:`GroupedExperts.forward` with exactly ``k`` experts per token, fixed shapes, no host read."""
    T, E = dispatch_map.shape
    w1, w3, w2 = weights
    # Each token's k experts in increasing order (topk of the 0/1 map picks its k ones; sorted for the sum order).
    experts = dispatch_map.to(torch.float32).topk(k, dim=1).indices.sort(dim=1).values  # [T, k]
    flat = experts.reshape(-1)  # pair p = t·k + j
    order = torch.argsort(flat, stable=True)  # pairs by expert, tokens in order within an expert
    e_sorted = flat.index_select(0, order)
    counts = dispatch_map.sum(dim=0)  # [E] on the device
    ends = counts.cumsum(0)
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    cast_to = _autocast_dtype(rows)
    if cast_to is not None:
        rows, w1, w3, w2 = (t.to(cast_to) for t in (rows, w1, w3, w2))
    if _grouped_ok(rows, w1):
        offsets = ends.to(torch.int32)

        def mm(r: Tensor, w: Tensor) -> Tensor:
            return _ContiguousGrad.apply(torch._grouped_mm(r, w, offs=offsets))

    else:  # zero-padded [E, T, ·] buffer: a token picks an expert at most once, so T rows suffice
        pos = torch.arange(T * k, device=x.device) - (ends - counts).index_select(0, e_sorted)

        def mm(r: Tensor, w: Tensor) -> Tensor:
            buf = r.new_zeros(E, T, r.shape[1]).index_put((e_sorted, pos), r)
            return torch.bmm(buf, w)[e_sorted, pos]

    y = mm(F.silu(mm(rows, w1)) * mm(rows, w3), w2)
    if region is not None:
        y = region[1](y)  # one all-reduce of every expert's partial output, before gating (as the loop path)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=x.device))
    slots = y.index_select(0, inverse).view(T, k, -1).to(x.dtype) * gates.gather(1, experts).unsqueeze(-1).to(x.dtype)
    out = slots[:, 0]
    for j in range(1, k):  # increasing expert order, as the per-expert index_add_ loop added them
        out = out + slots[:, j]
    return out


class MoE(nn.Module):
    """``y = Σ_e gate_e · expert_e(x) + shared(x)`` with the experts chosen by a :class:`Router`."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        topk: int,
        score_function: ScoreFunction,
        shared_expert: bool,
        layer_id: int,
    ) -> None:
        super().__init__()
        self.router = Router(dim, num_experts, topk, score_function, layer_id)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared = SwiGLU(dim, hidden) if shared_expert else None
        self.sp_mesh: DeviceMesh | None = None  # the TP mesh under sequence parallelism (model/tensor_parallel.py)

    def forward(self, x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, RouterRecord]:
        """Apply the layer to ``x [B, S, dim]``; ``valid [B, S]`` bool marks the non-padding tokens for
        the router's dispatch counts. Returns ``(y [B, S, dim], record)``."""
        B, S, D = x.shape
        flat = x.reshape(B * S, D)
        gates, record = self.router(flat, None if valid is None else valid.reshape(-1))
        mesh = self.sp_mesh
        if mesh is not None:
            # Sequence parallel: this rank routed its slice of the sequence; the TP-sharded experts need
            # every token, so tokens, gates and routing map are gathered and the partial outputs
            # reduce-scattered back to the slices (Megatron's all-gather token dispatcher).
            E = gates.shape[-1]
            xg = sp_gather(x, mesh, 1, partial_grad=True).reshape(-1, D)
            gg = sp_gather(gates.view(B, S, E), mesh, 1, partial_grad=True).reshape(-1, E)
            dg = sp_gather(record.dispatch_map.view(B, S, E).to(gates.dtype), mesh, 1, partial_grad=False)
            yp = self.experts(xg, gg, dg.reshape(-1, E) > 0, self.router.topk)
            y = sp_reduce_scatter(yp.view(B, -1, D), mesh, 1)
            if self.shared is not None:
                y = y + self.shared(x)  # sequence-parallel SwiGLU: slice in, slice out
            return y, record
        y = self.experts(flat, gates, record.dispatch_map, self.router.topk)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(B, S, D), record
