"""MoE auxiliary losses and expert-bias balancing in JAX (docs/semantics.md §5).

Same formulas, names and float32 math as the PyTorch ``lossparity.losses.moe``. The caller chooses the
token set ``X`` by what it passes in; with global (possibly sharded) arrays the natural scope is the
whole global batch. Notation: ``E`` routed experts, top-``k`` routing, ``p[x,e]`` router scores,
``c_e`` tokens whose plain top-k contains ``e``, ``T`` tokens in the scope. ``keep_mask`` is ``True`` at
the tokens that count (every lossparity mask's polarity); the others neither count nor carry probability.
``padding_mask`` (``True`` = padding, Megatron ``z_loss_func``'s polarity) is deprecated: it still works for
one release with a ``DeprecationWarning``; pass ``keep_mask=~padding_mask``. Value checks (e.g.
``total_num_tokens > 0``) run only on concrete values.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import cast

import jax
import jax.numpy as jnp

from ..options import SCORE_FUNCTIONS, check_option, deprecated_padding_mask
from ._checks import concrete, value_check

__all__ = [
    "SCORE_FUNCTIONS",
    "router_probs",
    "topk_routing_map",
    "tokens_per_expert",
    "switch_load_balancing_loss",
    "sequence_load_balancing_loss",
    "router_z_loss_sum",
    "router_z_loss",
    "expert_bias_update",
    "max_violation",
]


# As in Megatron: only matters when every sigmoid of a row underflows (0/0).
_SIGMOID_EPS = 1e-20


def _check_scores(name: str, x, num_experts: int | None = None) -> None:
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name} must be [..., num_experts] with num_experts >= 1, got {tuple(x.shape)}")
    if num_experts is not None and x.shape[-1] != num_experts:
        raise ValueError(f"{name} has {x.shape[-1]} experts (shape {tuple(x.shape)}), num_experts={num_experts}")


def _check_topk(topk: int, num_experts: int) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in 1..num_experts={num_experts}, got {topk}")


def _check_num_experts(num_experts: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")


def _check_nonneg(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _padding(keep_mask, padding_mask, leading: tuple[int, ...], against: str, where: str) -> jax.Array | None:
    """The tokens to drop (``True`` = dropped) from ``keep_mask`` or the deprecated ``padding_mask``."""
    if padding_mask is not None:
        deprecated_padding_mask(where, keep_mask, stacklevel=3)
        return _mask01(padding_mask, leading, against, "padding_mask", "True = padding")
    keep = _mask01(keep_mask, leading, against, "keep_mask", "True = keep")
    return None if keep is None else ~keep


def _mask01(mask, leading: tuple[int, ...], against: str, name: str, meaning: str) -> jax.Array | None:
    if mask is None:
        return None
    padding_mask = mask
    if tuple(padding_mask.shape) != tuple(leading):
        raise ValueError(
            f"{name} shape {tuple(padding_mask.shape)} does not match the token dims {tuple(leading)} of {against}"
        )
    if padding_mask.dtype != jnp.bool_:
        if not jnp.issubdtype(padding_mask.dtype, jnp.integer):
            raise TypeError(f"{name} must be bool or integer 0/1, got dtype {padding_mask.dtype}")
        # eagerly and under `checked`; an unchecked traced program reads any non-zero value as set
        value_check(
            ValueError,
            f"{name} values must be 0 or 1 ({meaning}), found {{}}",
            lambda xp, m: (m != 0) & (m != 1),
            (padding_mask,),
        )
        padding_mask = padding_mask != 0
    return padding_mask


def router_probs(logits: jax.Array, score_function: str = "softmax") -> jax.Array:
    """Router scores ``p[x,e]`` in float32: ``softmax(logits[x])``, or (``sigmoid``, DeepSeek-V3)
    ``s[x,e] / (Σ_e' s[x,e'] + 1e-20)`` with ``s = sigmoid(logits)`` (or, ``sqrtsoftplus``,
    DeepSeek-V4, ``s = sqrt(softplus(logits))``). Shape of ``logits`` (``[..., E]``)."""
    _check_scores("logits", logits)
    score_function = check_option("score_function", score_function, SCORE_FUNCTIONS)
    x = logits.astype(jnp.float32)
    if score_function == "softmax":
        return jax.nn.softmax(x, axis=-1)
    s = jax.nn.sigmoid(x) if score_function == "sigmoid" else jnp.sqrt(jax.nn.softplus(x))
    return s / (s.sum(axis=-1, keepdims=True) + _SIGMOID_EPS)


def topk_routing_map(probs: jax.Array, topk: int) -> jax.Array:
    """Boolean map ``m[x,e] = (e in top-k of p[x,:])`` (the plain top-k that the aux loss counts,
    ignoring expert bias and capacity); same shape as ``probs``. Ties go to the lower expert index."""
    _check_scores("probs", probs)
    _check_topk(topk, probs.shape[-1])
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(probs), topk)
    return jax.nn.one_hot(idx, probs.shape[-1], dtype=jnp.int32).sum(axis=-2) > 0


def tokens_per_expert(
    routing_map: jax.Array, padding_mask: jax.Array | None = None, *, keep_mask: jax.Array | None = None
) -> jax.Array:
    """Counts ``c_e = Σ_{x kept} m[x,e]`` as an integer ``[E]`` array. ``routing_map`` is ``[..., E]`` (bool or
    0/1); ``keep_mask`` (True = the token counts; deprecated: ``padding_mask``) has its leading shape."""
    if routing_map.ndim < 1:
        raise ValueError(f"routing_map must be [..., num_experts], got shape {tuple(routing_map.shape)}")
    pm = _padding(keep_mask, padding_mask, routing_map.shape[:-1], "routing_map", "tokens_per_expert")
    m = routing_map != 0
    if pm is not None:
        m = m & ~pm[..., None]
    return m.reshape(-1, m.shape[-1]).sum(axis=0)


def switch_load_balancing_loss(
    probs: jax.Array,
    tokens_per_expert: jax.Array,
    total_num_tokens,
    topk: int,
    num_experts: int,
    coeff: float,
    *,
    padding_mask: jax.Array | None = None,
    keep_mask: jax.Array | None = None,
) -> jax.Array:
    """Switch load-balancing loss ``A = coeff · E/(k·T²) · Σ_e c_e · Σ_x p[x,e]`` (float32 scalar).

    ``probs [tokens, E]``: scores of the tokens ``x``; ``tokens_per_expert [E]``: the counts ``c_e`` and
    ``total_num_tokens`` the ``T > 0`` of the chosen scope. Exactly ``coeff`` at perfect balance over one
    token set. The gradient flows only through ``probs`` (counts are stop-gradient); rows ``keep_mask`` drops
    (deprecated: ``padding_mask`` True) carry no probability. Same evaluation order as Megatron-LM.
    """
    _check_num_experts(num_experts)
    _check_scores("probs", probs, num_experts)
    if probs.ndim != 2:
        raise ValueError(f"probs must be [tokens, num_experts], got shape {tuple(probs.shape)}")
    if tuple(tokens_per_expert.shape) != (num_experts,):
        raise ValueError(
            f"tokens_per_expert must have shape ({num_experts},) to match num_experts, "
            f"got {tuple(tokens_per_expert.shape)}"
        )
    _check_topk(topk, num_experts)
    _check_nonneg("coeff", coeff)
    t_val = concrete(total_num_tokens)
    if t_val is not None:
        if t_val.size != 1 or t_val.dtype == bool or not math.isfinite(float(t_val)) or float(t_val) <= 0:
            raise ValueError(f"total_num_tokens must be a finite number > 0, got {total_num_tokens!r}")
    pm = _padding(keep_mask, padding_mask, probs.shape[:-1], "probs", "switch_load_balancing_loss")
    p = probs.astype(jnp.float32)
    if pm is not None:
        p = jnp.where(pm[:, None], jnp.zeros_like(p), p)
    c = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)
    scale: float | jax.Array
    if isinstance(total_num_tokens, Real):
        # a Python count: the scale is formed in double precision, as the PyTorch version does.
        # ``numbers.Real`` declares no arithmetic in typeshed; at runtime an int, float or NumPy scalar.
        n_tok = cast(float, total_num_tokens)
        scale = num_experts * float(coeff) / (topk * n_tok * n_tok)
    else:
        t = jax.lax.stop_gradient(jnp.asarray(total_num_tokens)).astype(jnp.float32)
        scale = num_experts * float(coeff) / (topk * t * t)
    return jnp.sum(p.sum(axis=0) * c) * scale


def sequence_load_balancing_loss(
    probs: jax.Array,
    routing_map: jax.Array,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
    padding_mask: jax.Array | None = None,
    keep_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek complementary sequence-wise loss as ``(Σ_j A(X_j), number of sequences)`` for rows as
    sequences: ``probs``, ``routing_map`` ``[N, L, E]``; ``A(X_j) = coeff · E/(k·n_j²) · Σ_e c[j,e] ·
    Σ_{x in j} p[x,e]`` with ``n_j`` the row's non-padding tokens; an empty row gives 0 and still counts.
    The objective term is the first value divided by the second (summed over the whole step first)."""
    _check_num_experts(num_experts)
    _check_scores("probs", probs, num_experts)
    if probs.ndim != 3 or tuple(routing_map.shape) != tuple(probs.shape):
        raise ValueError(
            f"probs and routing_map must both be [N, L, num_experts], got {tuple(probs.shape)} and "
            f"{tuple(routing_map.shape)}"
        )
    _check_topk(topk, num_experts)
    _check_nonneg("coeff", coeff)
    pm = _padding(keep_mask, padding_mask, probs.shape[:-1], "probs", "sequence_load_balancing_loss")
    valid = jnp.ones(probs.shape[:-1], bool) if pm is None else ~pm
    p = jnp.where(valid[..., None], probs.astype(jnp.float32), 0.0)
    c = jax.lax.stop_gradient(((routing_map != 0) & valid[..., None]).sum(axis=1).astype(jnp.float32))
    n = valid.sum(axis=1).astype(jnp.float32)
    safe_n = jnp.where(n > 0, n, 1.0)
    per_seq = (p.sum(axis=1) * c).sum(axis=-1) * (num_experts * float(coeff) / topk) / (safe_n * safe_n)
    per_seq = jnp.where(n > 0, per_seq, 0.0)
    return per_seq.sum(), jnp.asarray(probs.shape[0])


def router_z_loss_sum(
    logits: jax.Array, padding_mask: jax.Array | None = None, *, keep_mask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(Σ_{x kept} logsumexp(logits[x])², number of kept tokens)`` (float32, integer): the building block
    of the invariant z-loss ``β · Σ_x lse² / Ntok_global``. Dropped rows (``keep_mask`` False; deprecated:
    ``padding_mask`` True) are selected away, so a NaN there does not leak into the value or the gradient."""
    _check_scores("logits", logits)
    pm = _padding(keep_mask, padding_mask, logits.shape[:-1], "logits", "router_z_loss_sum")
    x = logits.astype(jnp.float32)
    if pm is not None:
        x = jnp.where(pm[..., None], jnp.zeros_like(x), x)
    lse2 = jnp.square(jax.nn.logsumexp(x, axis=-1))
    if pm is None:
        return lse2.sum(), jnp.asarray(lse2.size)
    return jnp.where(pm, jnp.zeros_like(lse2), lse2).sum(), (~pm).sum()


def router_z_loss(
    logits: jax.Array, coeff: float, padding_mask: jax.Array | None = None, *, keep_mask: jax.Array | None = None
) -> jax.Array:
    """Router z-loss ``coeff · (1/|kept|) · Σ_{kept x} logsumexp(logits[x])²`` (float32 scalar); the mean is
    over the tokens ``keep_mask`` keeps (deprecated: ``padding_mask``, True = padding); none kept gives 0."""
    _check_nonneg("coeff", coeff)
    _check_scores("logits", logits)
    pm = _padding(keep_mask, padding_mask, logits.shape[:-1], "logits", "router_z_loss")
    s, n = router_z_loss_sum(logits, keep_mask=None if pm is None else ~pm)
    return s / jnp.maximum(n, 1).astype(s.dtype) * float(coeff)


def expert_bias_update(
    tokens_per_expert: jax.Array, expert_bias: jax.Array, rate: float, zero_mean: bool = False
) -> jax.Array:
    """New expert bias ``b + Δb`` with ``Δb_e = rate · sign(mean_e'(c) − c_e)`` (float32, no gradient).

    ``tokens_per_expert`` and ``expert_bias`` are ``[E]`` or ``[layers, E]`` (means per layer, over
    experts); ``zero_mean`` (torchtitan) centres the step's update: ``Δb -= mean_e(Δb)``. Counts are the
    step's dispatch counts over every microbatch and every rank holding distinct tokens (docs/semantics.md §5).
    """
    if tokens_per_expert.ndim not in (1, 2) or tokens_per_expert.shape[-1] < 1:
        raise ValueError(f"tokens_per_expert must be [E] or [layers, E], got shape {tuple(tokens_per_expert.shape)}")
    if not jnp.issubdtype(expert_bias.dtype, jnp.floating):
        raise TypeError(f"expert_bias must be a floating-point array, got dtype {expert_bias.dtype}")
    if tuple(expert_bias.shape) != tuple(tokens_per_expert.shape):
        raise ValueError(
            f"expert_bias shape {tuple(expert_bias.shape)} does not match tokens_per_expert shape "
            f"{tuple(tokens_per_expert.shape)}"
        )
    _check_nonneg("rate", rate)
    c = jax.lax.stop_gradient(tokens_per_expert).astype(jnp.float32)
    mean = c.sum(axis=-1, keepdims=True) / c.shape[-1]
    delta = jnp.sign(mean - c) * float(rate)
    if zero_mean:
        delta = delta - delta.mean(axis=-1, keepdims=True)
    return jax.lax.stop_gradient(expert_bias).astype(jnp.float32) + delta


def max_violation(tokens_per_expert: jax.Array) -> jax.Array:
    """Load imbalance ``MaxVio = (max_e c_e − mean_e c) / mean_e c`` per layer (float32; ``[E]`` gives a
    scalar, ``[layers, E]`` gives ``[layers]``); a layer whose counts are all 0 has ``MaxVio = 0``."""
    if tokens_per_expert.ndim not in (1, 2) or tokens_per_expert.shape[-1] < 1:
        raise ValueError(f"tokens_per_expert must be [E] or [layers, E], got shape {tuple(tokens_per_expert.shape)}")
    c = tokens_per_expert.astype(jnp.float32)
    mean = c.mean(axis=-1)
    safe = jnp.where(mean > 0, mean, 1.0)
    return jnp.where(mean > 0, (c.max(axis=-1) - mean) / safe, 0.0)
