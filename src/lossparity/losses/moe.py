"""MoE auxiliary losses and expert-bias balancing (semantics §5).

Pure tensor functions, no process groups, float32 math (float64 inputs stay float64, so that the
float64 reference runs of ``verify`` are exact). The caller chooses the token set ``X`` (a
microbatch, a sequence, the whole global batch) by what it passes in: ``probs`` are always the router
scores of the *local* tokens, counts are at the level the scope needs (reduced over ranks by the
caller). Notation: ``E`` routed experts, top-``k`` routing, ``p[x,e]`` router scores, ``c_e`` tokens
whose plain top-k contains ``e``, ``T`` tokens in the scope.

Public path: ``lossparity.moe`` re-exports this module's ``__all__``; import the formulas from there.

Masks: ``keep_mask`` is ``True`` (or 1) at the tokens that count, the convention of every lossparity mask (loss
masks, ``indexer_kl``'s ``mask``); the tokens it drops neither count nor carry probability. The older
``padding_mask`` (``True`` = padding, Megatron ``z_loss_func``'s polarity) is still accepted for one release with a
``DeprecationWarning``: pass ``keep_mask=~padding_mask``. What counts is the caller's choice: Megatron's and
MindFormers' routers count every token the router sees (they ignore the loss mask, and Megatron drops only its
``padding_mask``), so to match them pass the router's padding mask, not the loss mask (docs/moe.md).
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from ..options import SCORE_FUNCTIONS as _SCORE_FUNCTIONS
from ..options import ScoreFunction, check_option, deprecated_padding_mask
from ._checks import check_float_tensor as _check_float_tensor
from ._checks import check_tensor as _check_tensor

__all__ = [
    "SCORE_FUNCTIONS",
    "router_scores",
    "router_probs",
    "switch_load_balancing_weights",
    "switch_load_balancing_terms",
    "router_z_loss_sums",
    "router_z_loss_sums_and_grad",
    "topk_routing_map",
    "tokens_per_expert",
    "switch_load_balancing_loss",
    "sequence_tokens_per_expert",
    "sequence_load_balancing_loss",
    "router_z_loss",
    "router_z_loss_sum",
    "expert_bias_update",
    "max_violation",
]

SCORE_FUNCTIONS: tuple[ScoreFunction, ...] = _SCORE_FUNCTIONS

# Megatron adds this to the sigmoid row sum; it only matters when every sigmoid underflows (0/0).
_SIGMOID_EPS = 1e-20


# ---------------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------------


def _wide(x: Tensor) -> Tensor:
    """``x`` in at least float32 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _check_nonneg(name: str, value: float | Tensor) -> None:
    v = float(value.item()) if isinstance(value, Tensor) else value
    if isinstance(v, bool) or not isinstance(v, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v}")


def _check_topk(topk: int, num_experts: int) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in 1..num_experts={num_experts}, got {topk}")


def _check_num_experts(num_experts: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")


def _token_mask(
    keep_mask: Tensor | None, padding_mask: Tensor | None, leading: torch.Size, against: str, where: str
) -> Tensor | None:
    """The tokens to drop as a bool mask (``True`` = dropped) from ``keep_mask`` (``True`` = keep) or the
    deprecated ``padding_mask`` (``True`` = padding, with a ``DeprecationWarning``); ``None`` when neither."""
    if padding_mask is not None:
        deprecated_padding_mask(where, keep_mask, stacklevel=3)
        return _check_padding_mask(padding_mask, leading, against)
    if keep_mask is None:
        return None
    keep = _check_padding_mask(keep_mask, leading, against, name="keep_mask", meaning="True = keep")
    return None if keep is None else ~keep


def _check_padding_mask(
    padding_mask: Tensor | None,
    leading: torch.Size,
    against: str,
    name: str = "padding_mask",
    meaning: str = "True = padding",
) -> Tensor | None:
    if padding_mask is None:
        return None
    _check_tensor(name, padding_mask)
    if padding_mask.shape != leading:
        raise ValueError(
            f"{name} shape {tuple(padding_mask.shape)} does not match the token dims {tuple(leading)} of {against}"
        )
    if padding_mask.dtype != torch.bool:
        if padding_mask.is_floating_point() or padding_mask.is_complex():
            raise TypeError(f"{name} must be bool or integer 0/1, got dtype {padding_mask.dtype}")
        if padding_mask.numel() and not bool(((padding_mask == 0) | (padding_mask == 1)).all()):
            raise ValueError(f"{name} values must be 0 or 1 ({meaning})")
        padding_mask = padding_mask.bool()
    return padding_mask


def _check_scores(name: str, x: object, num_experts: int | None = None) -> Tensor:
    x = _check_float_tensor(name, x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name} must be [..., num_experts] with num_experts >= 1, got {tuple(x.shape)}")
    if num_experts is not None and x.shape[-1] != num_experts:
        raise ValueError(f"{name} has {x.shape[-1]} experts (shape {tuple(x.shape)}), num_experts={num_experts}")
    return x


# ---------------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------------


def router_scores(logits: Tensor, score_function: ScoreFunction = "softmax") -> tuple[Tensor, Tensor]:
    """``(scores, probs)`` of a router: the one home of the score normalization (semantics §5), used by
    the model's router and by :func:`router_probs`. No validation, no host sync (hot path).

    ``softmax``: ``scores = probs = softmax(logits)``. ``sigmoid`` (DeepSeek-V3): ``scores =
    sigmoid(logits)`` (what expert selection and gates use) and ``probs[x,e] = scores[x,e] /
    (Σ_e' scores[x,e'] + 1e-20)`` (what the auxiliary losses use; the tiny constant, as in Megatron, only
    avoids 0/0 when every sigmoid underflows). ``sqrtsoftplus`` (DeepSeek-V4, Megatron-LM main):
    ``scores = sqrt(softplus(logits)) = sqrt(log(1 + exp(logits)))``, ``probs`` normalized as for ``sigmoid``.
    Computed in the dtype of ``logits``.
    """
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
        return scores, scores
    scores = torch.sigmoid(logits) if score_function == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()
    return scores, scores / (scores.sum(dim=-1, keepdim=True) + _SIGMOID_EPS)


def router_probs(logits: Tensor, score_function: str = "softmax") -> Tensor:
    """Router scores ``p[x,e]`` used by the auxiliary losses, in float32 (float64 stays float64).

    ``softmax``: ``p[x,:] = softmax(logits[x,:])``. ``sigmoid`` (DeepSeek-V3): ``s = sigmoid(logits)``,
    ``p[x,e] = s[x,e] / (Σ_e' s[x,e'] + 1e-20)``; ``sqrtsoftplus`` (DeepSeek-V4) the same with
    ``s = sqrt(softplus(logits))`` (see :func:`router_scores`). ``logits`` is ``[..., E]``;
    the result has the same shape.
    """
    _check_scores("logits", logits)
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    return router_scores(_wide(logits), check_option("score_function", score_function, SCORE_FUNCTIONS))[1]


def topk_routing_map(probs: Tensor, topk: int) -> Tensor:
    """Boolean routing map ``m[x,e] = (e in top-k of p[x,:])``, shape of ``probs`` (``[..., E]``).

    This is the plain top-k of the unbiased scores that the auxiliary loss counts (semantics §5: the aux map
    ignores expert bias and capacity). Ties are broken by ``torch.topk``.
    """
    _check_scores("probs", probs)
    _check_topk(topk, probs.shape[-1])
    idx = torch.topk(probs.detach(), k=topk, dim=-1).indices
    return torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter(-1, idx, True)


def tokens_per_expert(
    routing_map: Tensor, padding_mask: Tensor | None = None, *, keep_mask: Tensor | None = None
) -> Tensor:
    """Expert counts ``c_e = Σ_{x kept} m[x,e]``, as an int64 ``[E]`` tensor.

    ``routing_map`` is ``[..., E]`` (bool or 0/1); ``keep_mask`` (``True`` = the token counts, default all)
    has its leading shape. ``padding_mask`` (``True`` = padding) is the deprecated opposite polarity.
    """
    _check_tensor("routing_map", routing_map)
    if routing_map.dim() < 1:
        raise ValueError(f"routing_map must be [..., num_experts], got shape {tuple(routing_map.shape)}")
    pm = _token_mask(keep_mask, padding_mask, routing_map.shape[:-1], "routing_map", "tokens_per_expert")
    m = routing_map.bool()
    if pm is not None:
        m = m & ~pm.unsqueeze(-1)
    return m.reshape(-1, m.shape[-1]).sum(dim=0, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------
# load-balancing losses
# ---------------------------------------------------------------------------------------------------


def switch_load_balancing_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total_num_tokens: int | float | Tensor,
    topk: int,
    num_experts: int,
    coeff: float,
    *,
    padding_mask: Tensor | None = None,
    keep_mask: Tensor | None = None,
) -> Tensor:
    """Switch load-balancing loss ``A = coeff · E/(k·T²) · Σ_e c_e · Σ_x p[x,e]`` (float32 scalar), the
    ``microbatch`` scope (Megatron and MindFormers ``aux_loss``) when counts and ``T`` are the microbatch's.

    ``probs`` ``[tokens, E]`` are the scores of the local tokens ``x``; ``tokens_per_expert`` ``[E]``
    are the counts ``c_e`` and ``total_num_tokens`` ``T > 0`` the token count, both at the chosen scope
    level (already reduced over ranks by the caller). At perfect balance over one token set the value
    is exactly ``coeff``. Gradient flows only through ``probs`` (counts are detached). Rows that
    ``keep_mask`` drops (``False``) carry no probability (deprecated: ``padding_mask``, ``True`` =
    padding). Numerically equal to Megatron-LM's ``switch_load_balancing_loss_func`` (same evaluation order).
    """
    _check_num_experts(num_experts)
    _check_scores("probs", probs, num_experts)
    if probs.dim() != 2:
        raise ValueError(f"probs must be [tokens, num_experts], got shape {tuple(probs.shape)}")
    _check_tensor("tokens_per_expert", tokens_per_expert)
    if tokens_per_expert.shape != (num_experts,):
        raise ValueError(
            f"tokens_per_expert must have shape ({num_experts},) to match num_experts, "
            f"got {tuple(tokens_per_expert.shape)}"
        )
    _check_topk(topk, num_experts)
    _check_nonneg("coeff", coeff)
    if isinstance(total_num_tokens, Tensor):
        if total_num_tokens.numel() != 1:
            raise ValueError(f"total_num_tokens must be a scalar, got shape {tuple(total_num_tokens.shape)}")
        t_val = float(total_num_tokens.item())
    else:
        t_val = total_num_tokens
    if isinstance(t_val, bool) or not isinstance(t_val, Real) or not math.isfinite(t_val) or t_val <= 0:
        raise ValueError(f"total_num_tokens must be a finite number > 0, got {total_num_tokens!r}")
    pm = _token_mask(keep_mask, padding_mask, probs.shape[:-1], "probs", "switch_load_balancing_loss")
    p = _wide(probs)
    if pm is not None:
        p = torch.where(pm.unsqueeze(-1), torch.zeros_like(p), p)
    c = tokens_per_expert.detach().to(device=p.device, dtype=p.dtype)
    t = total_num_tokens.detach().to(p.device, p.dtype) if isinstance(total_num_tokens, Tensor) else total_num_tokens
    return switch_load_balancing_terms(p.sum(dim=0), c, t, topk=topk, num_experts=num_experts, coeff=coeff)


def switch_load_balancing_weights(
    tokens_per_expert: Tensor,
    count_tokens: Tensor | float,
    prob_tokens: Tensor | float | None = None,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """The Switch load-balancing term as a linear form of the score sums: the one home of the formula
    (semantics §5).

    ``A = coeff · E/k · Σ_e (c_e / T_c) · (P_e / T_p) = Σ_e K_e · P_e`` with ``P_e = Σ_{x in X} p[x,e]``
    (the scores' sums over the token set ``X``) and ``K_e = coeff · E · c_e / (k · T_c · T_p)``: ``c_e`` the
    top-k counts (``tokens_per_expert [..., E]``, detached by the caller), ``T_c``/``T_p`` the token counts
    they are normalized by (``count_tokens``, ``prob_tokens``: numbers or tensors broadcasting to ``[...]``;
    ``prob_tokens`` defaults to ``count_tokens``, giving Switch's ``coeff·E/(k·T²)·Σ_e c_e·P_e``).
    Returns ``K [..., E]``, which is also ``∂A/∂p[x,e]`` for every token ``x`` of the set (the counts are
    constants), so a caller can form the gradient without back-propagating through the sums. A set with
    ``T = 0`` gives ``K = 0`` exactly. No validation, no host sync.
    """
    return tokens_per_expert * _switch_factor(tokens_per_expert, count_tokens, prob_tokens, topk, num_experts, coeff)


def _switch_factor(
    like: Tensor,
    count_tokens: Tensor | float,
    prob_tokens: Tensor | float | None,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor | float:
    """``coeff·E/(k·T_c·T_p)`` (0 for an empty set): a number, or a tensor ``[..., 1]``."""
    if not isinstance(count_tokens, Tensor) and not isinstance(prob_tokens, Tensor):
        t_p = count_tokens if prob_tokens is None else prob_tokens
        den = topk * count_tokens * t_p
        return num_experts * float(coeff) / den if den > 0 else 0.0
    t_c_dev = torch.as_tensor(count_tokens, dtype=like.dtype, device=like.device)
    t_p_dev = t_c_dev if prob_tokens is None else torch.as_tensor(prob_tokens, dtype=like.dtype, device=like.device)
    # An empty set has c = 0 exactly, so clamping its zero denominator to 1e-30 gives 0 without a 0/0 or
    # an overflow (a non-empty set has a denominator >= 1/b², far above it).
    # (in place on the fresh product: the same operations as ``E·coeff / clamp(k·T_c·T_p)``, fewer kernels)
    den_dev = t_c_dev.mul(topk).mul_(t_p_dev).clamp_(min=1e-30)
    return den_dev.reciprocal_().mul_(num_experts * float(coeff)).unsqueeze(-1)


def switch_load_balancing_terms(
    prob_sums: Tensor,
    tokens_per_expert: Tensor,
    count_tokens: Tensor | float,
    prob_tokens: Tensor | float | None = None,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """The Switch load-balancing term of every token set at once (semantics §5):
    ``A = Σ_e K_e · P_e`` with ``K`` = :func:`switch_load_balancing_weights` (same arguments) and
    ``P_e = Σ_{x in X} p[x,e]`` (``prob_sums [..., E]``).

    Megatron's scopes are this term on different token sets: a microbatch, each sequence
    (``[..., sequences, E]``), the global batch with counts from the previous step (``global_lagged``:
    ``T_c`` that step's tokens) or running over microbatches. A set with ``T = 0`` gives exactly 0.
    Returns ``[...]`` (a scalar for ``[E]`` inputs). No validation, no host sync.
    """
    # Megatron's evaluation order: Σ_e P_e·c_e first, then the factor (the same float32 rounding).
    factor = _switch_factor(prob_sums, count_tokens, prob_tokens, topk, num_experts, coeff)
    dot = (prob_sums * tokens_per_expert).sum(dim=-1)
    return dot * (factor.squeeze(-1) if isinstance(factor, Tensor) else factor)


def _flatten_sequences(
    x: Tensor, seq_ids: Tensor | None, num_sequences: int | None, name: str
) -> tuple[Tensor, Tensor, int]:
    """Return ``(x [tokens, E], group id per token [tokens] (-1 = none), number of groups)``."""
    if seq_ids is None:
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be [num_sequences, seq_len, num_experts] (or [seq_len, num_experts]) "
                f"when seq_ids is None, got shape {tuple(x.shape)}"
            )
        n, length = x.shape[0], x.shape[1]
        if num_sequences is not None and num_sequences != n:
            raise ValueError(f"num_sequences={num_sequences} but {name} has {n} rows (shape {tuple(x.shape)})")
        gid = torch.arange(n, device=x.device).repeat_interleave(length)
        return x.reshape(-1, x.shape[-1]), gid, n
    _check_tensor("seq_ids", seq_ids)
    if seq_ids.is_floating_point() or seq_ids.is_complex() or seq_ids.dtype == torch.bool:
        raise TypeError(f"seq_ids must be an integer tensor, got dtype {seq_ids.dtype}")
    if seq_ids.shape != x.shape[:-1]:
        raise ValueError(
            f"seq_ids shape {tuple(seq_ids.shape)} does not match the token dims {tuple(x.shape[:-1])} of {name}"
        )
    gid = seq_ids.reshape(-1).long()
    if gid.numel() and bool((gid < -1).any()):
        raise ValueError(f"seq_ids must be >= -1 (-1 = token of no sequence), found {int(gid.min())}")
    inferred = int(gid.max().item()) + 1 if gid.numel() else 0
    if num_sequences is None:
        num_sequences = inferred
    elif isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < inferred:
        raise ValueError(f"num_sequences must be an int >= max(seq_ids)+1={inferred}, got {num_sequences!r}")
    return x.reshape(-1, x.shape[-1]), gid, num_sequences


def _valid_tokens(
    gid: Tensor, padding_mask: Tensor | None, token_shape: torch.Size, name: str, keep_mask: Tensor | None, where: str
) -> Tensor:
    pm = _token_mask(keep_mask, padding_mask, token_shape, name, where)
    valid = gid >= 0
    return valid if pm is None else valid & ~pm.reshape(-1)


def _sequence_counts(m2: Tensor, gid: Tensor, g: int, valid: Tensor) -> tuple[Tensor, Tensor]:
    idx = gid.clamp(min=0)
    m = (m2.bool() & valid.unsqueeze(-1)).long()
    counts = torch.zeros(g, m2.shape[-1], dtype=torch.int64, device=m2.device).index_add(0, idx, m)
    ntok = torch.zeros(g, dtype=torch.int64, device=m2.device).index_add(0, idx, valid.long())
    return counts, ntok


def sequence_tokens_per_expert(
    routing_map: Tensor,
    seq_ids: Tensor | None = None,
    *,
    padding_mask: Tensor | None = None,
    num_sequences: int | None = None,
    keep_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-sequence counts ``c[j,e] = Σ_{x in seq j} m[x,e]`` and ``n[j] = |seq j|`` (non-padding tokens).

    ``routing_map`` is ``[N, L, E]`` (each row a sequence; ``[L, E]`` is one sequence) or, with
    ``seq_ids``, any ``[..., E]`` whose tokens belong to sequence ``seq_ids[...]`` in
    ``0..num_sequences-1`` (``-1``: no sequence, e.g. padding; per-document ids come from
    ``stats.rows_documents``). ``keep_mask`` (``True`` = the token counts; deprecated: ``padding_mask``,
    ``True`` = padding) has the token shape ``routing_map.shape[:-1]``. Returns int64 ``(c [G, E], n [G])``.
    Sum these over the context-parallel shards of each sequence before passing them to
    ``sequence_load_balancing_loss(counts=...)``.
    """
    _check_tensor("routing_map", routing_map)
    m2, gid, g = _flatten_sequences(routing_map, seq_ids, num_sequences, "routing_map")
    valid = _valid_tokens(
        gid, padding_mask, routing_map.shape[:-1], "routing_map", keep_mask, "sequence_tokens_per_expert"
    )
    return _sequence_counts(m2, gid, g, valid)


def sequence_load_balancing_loss(
    probs: Tensor,
    routing_map: Tensor,
    seq_ids: Tensor | None = None,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
    padding_mask: Tensor | None = None,
    num_sequences: int | None = None,
    counts: tuple[Tensor, Tensor] | None = None,
    keep_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """DeepSeek complementary sequence-wise balance loss, as ``(Σ_j A(X_j), number of sequences)``.

    For each sequence ``j`` with ``n_j`` non-padding tokens: ``A(X_j) = coeff · E/(k·n_j²) · Σ_e c[j,e] ·
    Σ_{x in j} p[x,e]``; a sequence with ``n_j = 0`` contributes 0 and still counts. The objective term is
    the mean over all ``N`` sequences of the global batch: sum both returned values (float32 sum, int64
    count) over microbatches and ranks, then divide. Layout: ``probs``/``routing_map`` ``[N, L, E]`` (rows
    are sequences) or any ``[..., E]`` with ``seq_ids`` (see ``sequence_tokens_per_expert``). ``counts``
    optionally supplies ``(c [G,E], n [G])`` already summed over the shards of each sequence (context
    parallel); ``probs`` is then the local shard only, and the sum over shards of the returned sums is the
    full-sequence loss (count each sequence on one shard only). Gradient flows only through ``probs``.
    ``keep_mask`` (``True`` = the token counts; deprecated: ``padding_mask``) has the token shape.
    The value (the mean) with an explicit ``[S, B]`` or ``[B, S]`` layout is
    :func:`lossparity.losses.aux_scopes.seq_load_balancing_loss`.
    """
    _check_num_experts(num_experts)
    _check_scores("probs", probs, num_experts)
    _check_tensor("routing_map", routing_map)
    if routing_map.shape != probs.shape:
        raise ValueError(
            f"routing_map shape {tuple(routing_map.shape)} does not match probs shape {tuple(probs.shape)}"
        )
    _check_topk(topk, num_experts)
    _check_nonneg("coeff", coeff)
    p2, gid, g = _flatten_sequences(probs, seq_ids, num_sequences, "probs")
    valid = _valid_tokens(gid, padding_mask, probs.shape[:-1], "probs", keep_mask, "sequence_load_balancing_loss")
    if counts is None:
        c, n = _sequence_counts(routing_map.reshape(-1, num_experts), gid, g, valid)
    else:
        if not isinstance(counts, (tuple, list)) or len(counts) != 2:
            raise TypeError("counts must be a pair (tokens_per_sequence_expert [G, E], tokens_per_sequence [G])")
        c = _check_tensor("counts[0]", counts[0])
        n = _check_tensor("counts[1]", counts[1])
        if c.shape != (g, num_experts) or n.shape != (g,):
            raise ValueError(
                f"counts must have shapes ([{g}, {num_experts}], [{g}]) for {g} sequences, "
                f"got ({tuple(c.shape)}, {tuple(n.shape)})"
            )
    zero = torch.zeros((), dtype=_wide(p2).dtype, device=p2.device)
    p = torch.where(valid.unsqueeze(-1), _wide(p2), zero)
    psum = torch.zeros(g, num_experts, dtype=p.dtype, device=p.device).index_add(0, gid.clamp(min=0), p)
    cf = c.detach().to(device=p.device, dtype=p.dtype)
    nf = n.detach().to(device=p.device, dtype=p.dtype)
    per_seq = switch_load_balancing_terms(psum, cf, nf, topk=topk, num_experts=num_experts, coeff=coeff)
    return per_seq.sum(), torch.tensor(g, dtype=torch.int64, device=p.device)


# ---------------------------------------------------------------------------------------------------
# router z-loss
# ---------------------------------------------------------------------------------------------------


def router_z_loss_sum(
    logits: Tensor, padding_mask: Tensor | None = None, *, keep_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(Σ_{x kept} logsumexp(logits[x])², number of kept tokens)``, float32 / int64.

    Building block of the invariant z-loss ``β · Σ_x lse² / Ntok_global``: sum both values over
    microbatches and ranks, then divide. ``logits`` is ``[..., E]``; ``keep_mask`` (``True`` = the token
    counts; deprecated: ``padding_mask``, ``True`` = padding) has its leading shape. Dropped rows never
    enter the graph (a NaN there does not leak).
    """
    _check_scores("logits", logits)
    pm = _token_mask(keep_mask, padding_mask, logits.shape[:-1], "logits", "router_z_loss_sum")
    x = _wide(logits).reshape(-1, logits.shape[-1])
    total = router_z_loss_sums(x, keep_mask=None if pm is None else ~pm.reshape(-1))
    if pm is None:
        return total, torch.tensor(x.shape[0], dtype=torch.int64, device=x.device)
    return total, (~pm).sum(dtype=torch.int64)


def router_z_loss_sums(
    logits: Tensor,
    *,
    padding_mask: Tensor | None = None,
    weights: Tensor | None = None,
    valid: Tensor | None = None,
    keep_mask: Tensor | None = None,
) -> Tensor:
    """``Σ_{x not padding} logsumexp(logits[..., x, :])²`` over the token dim (second to last): the one home
    of the z-loss term (semantics §5), for one layer ``[T, E]`` or stacked layers ``[L, T, E]`` (→ ``[L]``).

    ``keep_mask [T]`` (bool, ``True`` = the token counts, as every lossparity mask) drops the other tokens;
    they never reach the sum (``where``, so a NaN in a dropped row does not leak). ``weights [T]`` (0/1
    floats, 1 = keep) instead multiplies (one matrix-vector product, the training path: dropped rows must
    then be finite). ``padding_mask`` (``True`` = padding) is deprecated (``DeprecationWarning``); ``valid``
    was a short-lived name of ``keep_mask`` and raises. No validation, no host sync.
    """
    if valid is not None:
        raise TypeError("router_z_loss_sums: 'valid' was renamed keep_mask (True = the token counts): pass keep_mask=")
    if padding_mask is not None:
        deprecated_padding_mask("router_z_loss_sums", keep_mask, stacklevel=2)
        keep_mask = ~padding_mask
    lse2 = torch.logsumexp(logits, dim=-1).square()
    if weights is not None:
        return lse2 @ weights
    if keep_mask is not None:
        lse2 = torch.where(keep_mask, lse2, torch.zeros_like(lse2))
    return lse2.sum(dim=-1)


def router_z_loss_sums_and_grad(logits: Tensor, weights: Tensor, grad_scale: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`router_z_loss_sums` of stacked layers with its gradient, for a caller that forms the
    gradient in the forward pass (no autograd graph).

    ``logits [L, T, E]``, ``weights [T]`` (0/1 floats; padding rows must be finite), ``grad_scale [L]``
    (``s_l``). Returns ``(z [L], G [L, T, E])`` with ``z_l = Σ_x w_x·lse_l(x)²`` and
    ``G = ∂(Σ_l s_l·z_l)/∂logits``, i.e. ``G[l,x,e] = 2·s_l·w_x·lse_l(x)·softmax(logits[l,x])_e``.
    No validation, no host sync.
    """
    # logsumexp by hand: its exponentials are the softmax the gradient needs
    top = logits.amax(dim=-1, keepdim=True)
    e = (logits - top).exp_()
    s = e.sum(dim=-1, keepdim=True)
    lse = s.log().add_(top).squeeze(-1)  # [L, T]
    z = lse.square() @ weights  # router_z_loss_sums' formula
    scale = (lse * weights).mul_((2.0 * grad_scale).unsqueeze(-1)).unsqueeze(-1)
    return z, e.mul_(scale.div_(s))


def router_z_loss(
    logits: Tensor, coeff: float, padding_mask: Tensor | None = None, *, keep_mask: Tensor | None = None
) -> Tensor:
    """Router z-loss ``coeff · (1/|kept|) · Σ_{kept x} logsumexp(logits[x])²`` (float32 scalar).

    The mean is over the tokens ``keep_mask`` keeps (default all; deprecated: ``padding_mask``, ``True`` =
    padding); an input with no kept token gives exactly 0. This is Megatron's per-microbatch ``z_loss_func``
    (the parity form); the invariant form uses ``router_z_loss_sum`` with a global count.
    """
    _check_nonneg("coeff", coeff)
    _check_scores("logits", logits)
    pm = _token_mask(keep_mask, padding_mask, logits.shape[:-1], "logits", "router_z_loss")
    s, n = router_z_loss_sum(logits, keep_mask=None if pm is None else ~pm)
    return s / n.clamp(min=1).to(s.dtype) * float(coeff)


# ---------------------------------------------------------------------------------------------------
# aux-loss-free balancing
# ---------------------------------------------------------------------------------------------------


def expert_bias_update(tokens_per_expert: Tensor, expert_bias: Tensor, rate: float, zero_mean: bool = False) -> Tensor:
    """New expert bias ``b + Δb`` with ``Δb_e = rate · sign(mean_e'(c) − c_e)`` (float32, no grad).

    ``tokens_per_expert`` and ``expert_bias`` are ``[E]`` or ``[layers, E]`` (means per layer, over
    experts). With ``zero_mean`` (torchtitan) the step's update is centred: ``Δb -= mean_e(Δb)``.
    Counts must be the step's dispatch counts summed over every microbatch and every rank holding
    distinct tokens (semantics §5). The inputs are not modified.
    """
    _check_tensor("tokens_per_expert", tokens_per_expert)
    _check_float_tensor("expert_bias", expert_bias)
    _check_nonneg("rate", rate)
    if tokens_per_expert.dim() not in (1, 2) or tokens_per_expert.shape[-1] < 1:
        raise ValueError(f"tokens_per_expert must be [E] or [layers, E], got shape {tuple(tokens_per_expert.shape)}")
    if expert_bias.shape != tokens_per_expert.shape:
        raise ValueError(
            f"expert_bias shape {tuple(expert_bias.shape)} does not match tokens_per_expert shape "
            f"{tuple(tokens_per_expert.shape)}"
        )
    with torch.no_grad():
        dtype = torch.float64 if expert_bias.dtype == torch.float64 else torch.float32  # fp32, or fp64 kept
        c = tokens_per_expert.to(device=expert_bias.device, dtype=dtype)
        mean = c.sum(dim=-1, keepdim=True).div_(c.shape[-1])
        delta = (mean - c).sign_().mul_(float(rate))  # fresh tensors: in place saves kernels
        if zero_mean:
            delta = delta - delta.mean(dim=-1, keepdim=True)
        return delta.add_(expert_bias.to(dtype))


def max_violation(tokens_per_expert: Tensor) -> Tensor:
    """Load imbalance ``MaxVio = (max_e c_e − mean_e c) / mean_e c`` per layer (float32).

    ``tokens_per_expert`` ``[E]`` gives a scalar, ``[layers, E]`` gives ``[layers]``. A layer whose
    counts are all 0 has ``MaxVio = 0``.
    """
    _check_tensor("tokens_per_expert", tokens_per_expert)
    if tokens_per_expert.dim() not in (1, 2) or tokens_per_expert.shape[-1] < 1:
        raise ValueError(f"tokens_per_expert must be [E] or [layers, E], got shape {tuple(tokens_per_expert.shape)}")
    with torch.no_grad():
        c = _wide(tokens_per_expert)
        mean = c.mean(dim=-1)
        # counts are >= 0: a layer with mean 0 has max 0, and 0 / (clamped mean) is exactly 0
        return (c.amax(dim=-1) - mean).div_(mean.clamp(min=1e-30))
