"""Mixture-of-experts layer: routed SwiGLU experts (no capacity, no token dropping) + optional shared expert.

Experts are computed by a loop over experts that gathers the expert's tokens with ``index_select`` and
adds the gated outputs back with ``index_add_``. There is no capacity and nothing is dropped, so a
token's output depends only on that token: the layer is invariant to how tokens are batched. It is
also deterministic: within one ``index_add_`` the indices are distinct (a token picks an expert at most
once), so even atomic-add kernels never race, and experts are added in a fixed order.
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

    def forward(self, x: Tensor, gates: Tensor, dispatch_map: Tensor) -> Tensor:
        """``out[t] = Σ_{e: dispatch_map[t, e]} gates[t, e] · expert_e(x[t])`` for ``x [T, dim]``,
        ``gates [T, E]``, ``dispatch_map`` bool ``[T, E]``; ``out`` has ``x``'s dtype."""
        out = torch.zeros_like(x)
        region = self.tp_region
        w1: Tensor = self.w1
        w3: Tensor = self.w3
        w2: Tensor = self.w2
        if region is not None:
            x = region[0](x)
        if hasattr(w1, "to_local"):  # TP-sharded hidden dimension: TP-partial outputs
            w1, w3, w2 = (cast("DTensor", w).to_local() for w in (w1, w3, w2))
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
            yp = self.experts(xg, gg, dg.reshape(-1, E) > 0)
            y = sp_reduce_scatter(yp.view(B, -1, D), mesh, 1)
            if self.shared is not None:
                y = y + self.shared(x)  # sequence-parallel SwiGLU: slice in, slice out
            return y, record
        y = self.experts(flat, gates, record.dispatch_map)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(B, S, D), record
