"""Gradients of the MoE auxiliary shares, formed in the forward pass and handed to the router records.

The load-balancing term ``A = Σ_e K_e·Σ_x p[x,e]`` is linear in the scores once the counts are fixed
(``∂A/∂p[x,e] = K_e``, :func:`lossparity.losses.moe.switch_load_balancing_weights`) and the z-loss gradient
is ``2·lse·softmax`` (:func:`lossparity.losses.moe.router_z_loss_sums_and_grad`): a microbatch's share is
computed without an autograd graph, and :class:`ShareWithGrad` attaches it to the records' ``probs`` and
``logits`` with a backward that only multiplies the precomputed gradients by its incoming gradient
(a trivial backward, like the fused cross-entropy's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["GradPlan", "ShareWithGrad", "token_sum"]


def token_sum(x: Tensor, vf: Tensor) -> Tensor:
    """``Σ_t vf[t]·x[..., t, e]`` over the token dim (second to last) of ``x [..., T, E]``: one batched
    ``vf @ x`` (``vf [T]``, or per-sequence ``[b, S]`` against ``x [L, b, S, E]``)."""
    return torch.matmul(vf.unsqueeze(-2), x).squeeze(-2)


def _as(g: Tensor, like: Tensor) -> Tensor:
    return g if g.dtype == like.dtype else g.to(like.dtype)


class GradPlan:
    """Gradients of one microbatch's auxiliary share w.r.t. the router records, formed in the forward.

    Scores: ``∂share/∂p[l,x,e] = coef[l, X(x), e] · tokens[x]`` (kept factorized, ``coef [L, E]`` for one
    token set or ``[L, G, E]`` for sets given by rows or an index); logits: ``z_grad [L, T, E]``."""

    def __init__(self) -> None:
        self.p_coef: Tensor | None = None
        self.tokens: Tensor | None = None
        self.rows: tuple[int, int] | None = None
        self.index: Tensor | None = None
        self.z_grad: Tensor | None = None

    def set_scores(
        self,
        weights: Tensor,
        layer_scale: Tensor,
        tokens: Tensor,
        *,
        rows: tuple[int, int] | None = None,
        index: Tensor | None = None,
    ) -> None:
        """``coef = weights · layer_scale[l]`` (``weights [L, E]`` or ``[L, G, E]``); ``tokens`` ``[T]`` (or
        ``[b, S]`` with ``rows``: set = row), ``index [T]``: the set of every token."""
        self.p_coef = weights * layer_scale.view(-1, *([1] * (weights.dim() - 1)))
        self.tokens, self.rows, self.index = tokens, rows, index

    def score_grads(self, g: Tensor) -> Tensor | None:
        """``g · ∂share/∂p`` as one ``[L, T, E]`` tensor (None without a load-balancing term)."""
        if self.p_coef is None or self.tokens is None:
            return None
        c = self.p_coef * _as(g, self.p_coef)
        if self.rows is not None:  # [L, b, E] x [b, S] -> [L, b·S, E]
            return (c.unsqueeze(2) * self.tokens.unsqueeze(-1)).flatten(1, 2)
        if self.index is not None:
            return c.index_select(1, self.index) * self.tokens.unsqueeze(-1)
        return c.unsqueeze(1) * self.tokens.unsqueeze(-1)

    def grads(self, g: Tensor) -> list[Tensor]:
        """The gradients of ``g·share`` for the inputs in order: the ``L`` scores, then the ``L`` logits."""
        out: list[Tensor] = []
        gp = self.score_grads(g)
        if gp is not None:
            out.extend(gp.unbind(0))
        if self.z_grad is not None:
            out.extend((self.z_grad * _as(g, self.z_grad)).unbind(0))
        return out


class ShareWithGrad(torch.autograd.Function):
    """``share`` (computed without a graph) attached to the router records: its backward returns the
    gradients of the :class:`GradPlan` times the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, share: Tensor, plan: GradPlan, *inputs: Tensor) -> Tensor:  # noqa: ARG004
        ctx.plan = plan
        return share.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.plan.grads(g))
