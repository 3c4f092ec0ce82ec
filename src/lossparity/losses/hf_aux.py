"""The load-balancing term of the Hugging Face MoE families (transformers' ``load_balancing_loss_func``,
semantics §5), in float64 from the router logits.

transformers concatenates the router logits of all MoE layers (``L`` tensors ``[b·S, E]``), weights every
row by the attention mask and computes ``aux = E · Σ_e (c_e / R) · (P_e / R)``: ``c_e`` the number of
(layer, token) rows whose top-k contains ``e`` (the sum over ``k`` of HF's ``tokens_per_expert``),
``P_e`` the sum of the rows' softmax scores, ``R = L · T`` the non-padding rows. It is the Switch term of
:func:`lossparity.losses.moe.switch_load_balancing_terms` with ``k = 1`` (HF does not divide by the
top-k) and ``coeff = 1``; these functions only gather its sums from HF's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .moe import switch_load_balancing_terms

__all__ = ["hf_router_sums", "hf_load_balancing_loss", "hf_lagged_aux"]


def _row_weights(attention_mask: Tensor | None, rows: int, device: torch.device) -> Tensor:
    if attention_mask is None:
        return torch.ones(rows, dtype=torch.float64, device=device)
    w = attention_mask.reshape(-1).to(device=device, dtype=torch.float64)
    if w.numel() != rows:
        raise ValueError(f"attention_mask: {w.numel()} positions for {rows} router rows per layer")
    return w


def hf_router_sums(
    router_logits: Sequence[Tensor], top_k: int, attention_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(P, c, R)`` of one forward, float64: ``P_e = Σ_{l,x} w_x · softmax(z_l[x])_e`` (differentiable),
    ``c_e = Σ_{l,x} w_x · [e ∈ top-k(z_l[x])]`` (detached) and ``R = L · Σ_x w_x``, with ``z_l`` the
    ``[b·S, E]`` router logits of layer ``l`` and ``w`` the flattened ``attention_mask`` (1 everywhere when
    ``None``), as transformers' ``load_balancing_loss_func`` forms them. No host synchronization."""
    if not router_logits:
        raise ValueError("router_logits: no router logits (run the model with output_router_logits=True)")
    if not 1 <= top_k <= router_logits[0].shape[-1]:
        raise ValueError(f"top_k: must be in 1..{router_logits[0].shape[-1]}, got {top_k}")
    w = _row_weights(attention_mask, router_logits[0].shape[0], router_logits[0].device)
    probs = torch.softmax(torch.cat([z.double() for z in router_logits]), dim=-1)  # [L·b·S, E]
    wl = w.repeat(len(router_logits))
    chosen = torch.topk(probs.detach(), top_k, dim=-1).indices
    counts = torch.zeros(probs.shape[-1], dtype=torch.float64, device=probs.device)
    counts.scatter_add_(0, chosen.reshape(-1), wl.repeat_interleave(top_k))
    return (probs * wl[:, None]).sum(0), counts, wl.sum()


def hf_load_balancing_loss(router_logits: Sequence[Tensor], top_k: int, attention_mask: Tensor | None = None) -> Tensor:
    """transformers' ``load_balancing_loss_func`` in float64: ``E · Σ_e (c_e/R) · (P_e/R)`` over one forward
    (sums of :func:`hf_router_sums`); gradient through the scores only."""
    p, c, r = hf_router_sums(router_logits, top_k, attention_mask)
    return switch_load_balancing_terms(p, c, r, topk=1, num_experts=p.shape[-1], coeff=1.0)


def hf_lagged_aux(prob_sums: Tensor, fractions: Tensor, rows: float | Tensor) -> Tensor:
    """One microbatch's share of the ``global_lagged`` HF term: ``E · Σ_e f_e · P_e / R``, with ``P`` this
    microbatch's score sums (:func:`hf_router_sums`), ``f_e = c_e / R'`` the expert fractions of the previous
    step's whole global batch (``k/E`` each in the first step) and ``R`` the current step's global rows. Summed
    over the step's microbatches (and ranks) it is ``E · Σ_e f_e · P_e^{global} / R``: transformers' formula on
    the global batch with the previous step's fractions."""
    return switch_load_balancing_terms(
        prob_sums, fractions, 1.0, rows, topk=1, num_experts=prob_sums.shape[-1], coeff=1.0
    )
