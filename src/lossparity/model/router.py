"""Top-k MoE router with aux-loss-free expert bias (DeepSeek-V3) and per-forward routing records.

Three routing views of one forward (semantics §5):

- ``probs``: the scores the auxiliary losses use: ``softmax(logits)``, or ``sigmoid(logits)`` divided by
  its row sum (plus 1e-20): :func:`lossparity.losses.moe.router_scores`, the function the losses use;
- ``topk_map``: plain top-k of ``probs``, ignoring the expert bias (the aux-loss map ``c_e``);
- ``dispatch_map``: top-k of ``scores + expert_bias`` (``scores`` = softmax, or the raw sigmoid): the
  experts that actually process the token.

The bias only selects experts; the gate weights are the unbiased ``scores`` at the dispatched experts
(:func:`lossparity.losses.router.gate_weights`). By default, for ``sigmoid``/``sqrtsoftplus`` they are
renormalized over the ``k`` selected experts (DeepSeek-V3/V4). For ``softmax`` they are the full-softmax
probabilities, NOT renormalized over the selected experts (DeepSeek-V2, torchtitan ``route_norm=False``):
renormalizing would make top-1 routing blind to the LM-loss gradient. ``norm_topk_prob`` and
``scaling_factor`` set both independently of the score function (Megatron, MindFormers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses.moe import router_scores
from ..losses.router import gate_weights, topk_routing
from ..options import SCORE_FUNCTIONS, ScoreFunction, check_option
from .recompute import is_recomputing

__all__ = ["RouterRecord", "Router", "topk_map"]


@dataclass
class RouterRecord:
    """Routing of one MoE layer in one forward. ``layer_id`` is its router's :attr:`Router.layer_id`: the
    main layer index, or ``n_layers + k - 1`` for the MoE of MTP depth ``k``. ``logits``/``probs``
    ``[tokens, E]`` are in ``max(param dtype, float32)`` and carry gradients; ``topk_map``/``dispatch_map``
    are bool ``[tokens, E]``. Tokens are the ``B·S`` positions in row-major order, padding included."""

    layer_id: int
    logits: Tensor
    probs: Tensor
    topk_map: Tensor
    dispatch_map: Tensor


def topk_map(scores: Tensor, k: int) -> Tensor:
    """Boolean ``[T, E]`` map with exactly ``k`` True per row, at the ``k`` largest entries of ``scores``."""
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


class Router(nn.Module):
    """Linear router ``logits = x W_r^T`` (``W_r [E, dim]``) with top-``k`` selection.

    Buffers: ``expert_bias`` (float32 ``[E]``, used only for selection; updated by the trainer) and
    ``tokens_per_expert`` (float64 ``[E]``, dispatch counts accumulated over forwards for aux-loss-free
    balancing, reset by :meth:`reset_counts`).
    """

    # registered buffers (declared for the type checker; ``register_buffer`` creates them)
    expert_bias: Tensor
    tokens_per_expert: Tensor

    def __init__(
        self,
        dim: int,
        num_experts: int,
        topk: int,
        score_function: ScoreFunction,
        layer_id: int,
        *,
        norm_topk_prob: bool | None = None,
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        score_function = check_option("score_function", score_function, SCORE_FUNCTIONS)
        self.num_experts, self.topk, self.layer_id = num_experts, topk, layer_id
        self.score_function = score_function
        # renormalize the gates over the selected experts: by default for sigmoid/sqrtsoftplus only
        self.norm_topk_prob = score_function != "softmax" if norm_topk_prob is None else bool(norm_topk_prob)
        self.scaling_factor = float(scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(dim))
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float64))

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Router:
        # ``model.to(dtype)`` casts every floating buffer; the counts must stay exact float64 and the
        # bias at least float32 whatever the parameters' dtype.
        counts, bias = self.tokens_per_expert, self.expert_bias
        super()._apply(fn, recurse)
        if self.tokens_per_expert.dtype != torch.float64:
            self.tokens_per_expert = counts.to(self.tokens_per_expert.device, torch.float64)
        if self.expert_bias.dtype not in (torch.float32, torch.float64):
            self.expert_bias = bias.to(self.expert_bias.device, torch.float32)
        return self

    def reset_counts(self) -> None:
        """Zero ``tokens_per_expert`` (once per optimizer step, after the bias update)."""
        self.tokens_per_expert.zero_()

    def forward(self, x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, RouterRecord]:
        """Route ``x [T, dim]``. Returns ``(gates [T, E], record)``: ``gates`` is 0 outside
        ``dispatch_map`` and ``scaling_factor`` × the unbiased score (normalized over the selected experts with
        ``norm_topk_prob``, by default for sigmoid and sqrtsoftplus) inside.

        Side effect: when autograd is enabled and this is not an activation-recompute re-run,
        ``tokens_per_expert += Σ_t dispatch_map[t] · valid[t]`` (``valid [T]`` bool, all True if None), so
        evaluation under ``no_grad`` and recompute never count."""
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            # Under tensor parallelism the weight is a replicated DTensor (NoParallel): use the local copy.
            weight = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
            logits = F.linear(x.to(dtype), weight.to(dtype))
            scores, probs = router_scores(logits, self.score_function)  # the aux losses' normalization
            plain = topk_map(probs.detach(), self.topk)
            _, dispatch = topk_routing(scores, self.topk, expert_bias=self.expert_bias.to(dtype))
            # eps 0: the historical division by the plain sum (bit for bit the former gates)
            gates = gate_weights(
                scores, dispatch, normalize=self.norm_topk_prob, scaling_factor=self.scaling_factor, eps=0.0
            )
        if torch.is_grad_enabled() and not is_recomputing():
            with torch.no_grad():
                used = dispatch if valid is None else dispatch & valid.reshape(-1, 1)
                self.tokens_per_expert += used.sum(dim=0).to(self.tokens_per_expert.dtype)
        return gates, RouterRecord(self.layer_id, logits, probs, plain, dispatch)
