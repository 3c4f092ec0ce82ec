"""Multi-token prediction (MTP) labels, masks and objective in JAX (docs/semantics.md §4).

Same semantics and names as the PyTorch ``lossparity.losses.mtp``. Depth ``k`` predicts, from position
``t``, the token that the main head predicts from ``t + k``: labels and mask are rolled left by ``k``
within each row and each document of a packed row, the vacated tail masked. Count conventions:

- ``own`` (default, exact): ``λ·(1/Dm)·Σ_k J_k``, ``J_k`` the active mode on depth ``k`` alone. For
  ``per_sample`` every (depth, sample) pair weighs the same: MaxText ``mtp_per_layer_loss_norm=True``.
- ``main`` (DeepSeek-V3 paper, torchtitan, Megatron ``calculate_per_token_loss=True``): as ``own`` but a
  ``per_token`` depth is divided by the main loss's token count ``max(Ntok, 1)``. For every other mode
  ``main`` equals ``own``: their denominators (``N``, ``Ndoc``, ``D·K``) do not depend on the mask, so
  the main loss's and the depth's are the same count.
- ``pooled`` (MaxText): one ``J`` over the depths pooled, no ``1/Dm``; ``per_token``:
  ``λ·Σ_k S_k / max(Σ_k Ntok_k, 1)``; ``per_sample``: ``λ·(1/N) Σ_i Σ_k s_ki / max(Σ_k n_ki, 1)``, i.e.
  MaxText ``mtp_per_layer_loss_norm=False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp

from ..options import MTP_CONVENTIONS, MTP_LOG_ESTIMATORS, MTPConvention, check_option
from ._checks import check_positive_int
from .logchannel import LogValue, ratio_or_missing
from .modes import (
    Normalizers,
    check_mode,
    count_normalizers,
    denominator,
    numerator,
    objective,
    require_microbatch_size,
)
from .stats import _as_2d, check_inputs, document_index, sample_stats

__all__ = [
    "CONVENTIONS",
    "LOG_ESTIMATORS",
    "check_convention",
    "roll_mask",
    "roll_mtp",
    "mtp_numerator",
    "mtp_denominators",
    "mtp_objective",
    "mtp_log_losses",
    "mtp_normalizers",
]

CONVENTIONS = MTP_CONVENTIONS  # ("own", "main", "pooled"), from lossparity.options
LOG_ESTIMATORS = MTP_LOG_ESTIMATORS  # ("token_mean", "microbatch_mean"); old "global"/"megatron" accepted


def check_convention(convention: str) -> MTPConvention:
    """Return ``convention`` if it is one of :data:`CONVENTIONS`, else raise ``ValueError``."""
    return check_option("mtp_convention", convention, MTP_CONVENTIONS)


def _shift_left(x: jax.Array, k: int, fill) -> jax.Array:
    tail = jnp.full(x.shape[:-1] + (min(k, x.shape[-1]),), fill, dtype=x.dtype)
    return jnp.concatenate([x[..., k:], tail], axis=-1)


def _check_depth(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"MTP depth k must be an int >= 0, got {k!r}")
    return k


def roll_mask(mask: jax.Array, segment_ids: jax.Array | None, k: int) -> jax.Array:
    """The depth-``k`` loss mask: ``w_k[i,t] = w[i,t+k]`` when ``t+k`` is inside row ``i`` and (with
    ``segment_ids``) in the same document as ``t`` (the same run of non-zero ids), else 0. ``[B, S]`` or
    ``[S]``; ``k`` is static."""
    _check_depth(k)
    if k == 0:
        return mask
    w = _shift_left(mask, k, 0)
    if segment_ids is not None:
        if tuple(segment_ids.shape) != tuple(mask.shape):
            raise ValueError(
                f"segment_ids shape {tuple(segment_ids.shape)} does not match mask shape {tuple(mask.shape)}"
            )
        doc = document_index(jnp, segment_ids)  # same document = same run of ids (semantics §0)
        same = (_shift_left(doc, k, -1) == doc) & (doc > 0)
        w = jnp.where(same, w, jnp.zeros_like(w))
    return w


def roll_mtp(
    labels: jax.Array, mask: jax.Array, segment_ids: jax.Array | None, k: int, *, ignore_index: int = -100
) -> tuple[jax.Array, jax.Array]:
    """Labels and mask of MTP depth ``k`` (docs/semantics.md §4): both rolled left by ``k`` within each row and each
    document; positions whose rolled mask is 0 get ``ignore_index``. Raises if ``k`` is not smaller than
    the sequence length (the depth would have no position at all)."""
    _check_depth(k)
    if tuple(labels.shape) != tuple(mask.shape):
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match mask shape {tuple(mask.shape)}")
    if k >= labels.shape[-1]:
        raise ValueError(f"MTP depth k={k} must be smaller than the sequence length {labels.shape[-1]}")
    w = roll_mask(mask, segment_ids, k)
    lab = jnp.where(w > 0, _shift_left(labels, k, ignore_index), jnp.full_like(labels, ignore_index))
    return lab, w


def _depths(losses: Sequence[jax.Array] | jax.Array, masks: Sequence[jax.Array] | jax.Array):
    losses, masks = list(losses), list(masks)
    if len(losses) != len(masks) or not losses:
        raise ValueError(
            f"need one mask per MTP depth and at least one depth: {len(losses)} losses, {len(masks)} masks"
        )
    return [_as_2d(x) for x in losses], [_as_2d(w) for w in masks]


def _pool(losses: list[jax.Array], masks: list[jax.Array], segment_ids: jax.Array | None):
    # The depths interleaved along the sequence axis (the copies of a position side by side, as the torch
    # pool_depths): each row, document (a run of ids) and microbatch stays one piece and pools its sums
    # and counts over the depths, which is exactly the pooled convention.
    def interleave(xs: list[jax.Array]) -> jax.Array:
        stacked = jnp.stack(xs, axis=-1)
        return stacked.reshape(*stacked.shape[:-2], -1)

    seg = None if segment_ids is None else jnp.repeat(_as_2d(segment_ids), len(losses), axis=-1)
    return interleave(losses), interleave(masks), seg


def mtp_numerator(
    mode: str,
    losses: Sequence[jax.Array] | jax.Array,
    masks: Sequence[jax.Array] | jax.Array,
    *,
    convention: str = "own",
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    fixed_length: int | None = None,
    microbatch_size: int | None = None,
) -> list[jax.Array]:
    """Per-microbatch numerators of the MTP term, before ``λ`` and the global denominators.

    ``losses[k-1]``, ``masks[k-1]``: depth ``k``'s per-token losses and rolled mask ``[b, S]`` (a list or
    a stacked ``[Dm, b, S]`` array). ``own``/``main``: one :func:`numerator` per depth. ``pooled``: a
    one-element list, the numerator of all depths pooled along the sequence axis (interleaved).
    """
    mode = check_mode(mode)
    convention = check_convention(convention)
    xs, ws = _depths(losses, masks)

    def num(x: jax.Array, w: jax.Array, seg: jax.Array | None) -> jax.Array:
        return numerator(
            mode,
            x,
            w,
            segment_ids=seg,
            num_segments=num_segments,
            fixed_length=fixed_length,
            microbatch_size=microbatch_size,
        )

    if convention == "pooled":
        return [num(*_pool(xs, ws, segment_ids))]
    return [num(x, w, segment_ids) for x, w in zip(xs, ws)]


def mtp_denominators(
    mode: str, convention: str, main_norms: Normalizers, depth_norms: Sequence[Normalizers]
) -> list[jax.Array]:
    """Global denominators matching :func:`mtp_numerator`'s list (docs/semantics.md §4); the arguments in
    the order of the PyTorch ``lossparity.losses.mtp.mtp_denominators(mode, convention, main_denominator,
    depth_tokens)``, which takes the counts already reduced to floats.

    ``main_norms``: the main loss's step normalizers; ``depth_norms[k-1]``: depth ``k``'s (from its rolled
    masks). ``own``: each depth's own :func:`denominator`; ``main``: ``per_token`` uses
    ``max(Ntok_main, 1)``; ``pooled``: one denominator of the depths' normalizers summed (``per_token``:
    ``max(Σ_k Ntok_k, 1)``; counts of rows, documents and microbatches are those of one depth, since
    pooling keeps them). Every other mode divides each depth by the main loss's denominator (its rows,
    documents and microbatches are those of the main loss)."""
    mode = check_mode(mode)
    if not isinstance(convention, str):
        raise TypeError(
            f"convention: mtp_denominators(mode, convention, main_norms, depth_norms) takes the convention "
            f"second (the order of the PyTorch port), got {type(convention).__name__}; the older order was "
            "(mode, depth_norms, main_norms, convention=...)"
        )
    convention = check_convention(convention)
    if not depth_norms:
        raise ValueError("depth_norms must hold one Normalizers per MTP depth, got none")
    if convention == "pooled":
        tokens = cast(jax.Array, sum(nm.tokens for nm in depth_norms))  # an array: depth_norms is non-empty
        pooled = depth_norms[0]._replace(tokens=tokens)
        return [denominator(mode, pooled)]
    if convention == "main" and mode == "per_token":
        return [denominator(mode, main_norms) for _ in depth_norms]
    return [denominator(mode, nm) for nm in depth_norms]


def mtp_objective(
    mode: str,
    losses: Sequence[jax.Array] | jax.Array,
    masks: Sequence[jax.Array] | jax.Array,
    main_mask: jax.Array,
    *,
    weight: float = 1.0,
    convention: str = "own",
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    microbatch_size: int | None = None,
    fixed_length: int | None = None,
) -> jax.Array:
    """The MTP objective term on a whole global batch ``[N, S]`` per depth (module docstring):
    ``λ·(1/Dm)·Σ_k J_k`` (``own``/``main``) or ``λ·J_pooled`` (``pooled``); ``main_mask`` is the main
    loss mask (the ``main`` convention's count); ``λ = weight``."""
    mode = check_mode(mode)
    convention = check_convention(convention)
    xs, ws = _depths(losses, masks)
    seg = segment_ids if mode == "per_document" else None
    for k, (x, w) in enumerate(zip(losses, masks), start=1):  # as given: messages show the caller's indices
        check_inputs(x, w, seg, num_segments=num_segments, where=f"MTP depth {k}")
    if mode == "per_microbatch":
        require_microbatch_size(microbatch_size, int(xs[0].shape[0]), "mtp_objective")

    def obj(x: jax.Array, w: jax.Array, seg: jax.Array | None) -> jax.Array:
        return objective(
            mode,
            x,
            w,
            segment_ids=seg,
            num_segments=num_segments,
            microbatch_size=microbatch_size,
            fixed_length=fixed_length,
        )

    if convention == "pooled":
        return weight * obj(*_pool(xs, ws, segment_ids))
    if convention == "main" and mode == "per_token":
        n_main = jnp.maximum(jnp.sum(_as_2d(main_mask) != 0), 1)
        terms = [sample_stats(x, w)[0].sum() / n_main for x, w in zip(xs, ws)]
    else:
        terms = [obj(x, w, segment_ids) for x, w in zip(xs, ws)]
    # an array: _depths requires at least one depth
    return weight * (cast(jax.Array, sum(terms)) / len(terms))


def mtp_log_losses(
    losses: Sequence[jax.Array] | jax.Array,
    masks: Sequence[jax.Array] | jax.Array,
    *,
    estimator: str = "token_mean",
    microbatch_size: int | None = None,
) -> list[LogValue]:
    """The logged ``mtp_k_loss`` per depth as :class:`LogValue` pairs, not multiplied by ``λ``.

    ``token_mean`` (default; old name ``global``): the depth's token mean ``S_k / Ntok_k`` (missing when
    ``Ntok_k = 0``). ``microbatch_mean`` (old name ``megatron``): the mean over microbatches of
    ``microbatch_size`` rows of local means ``s_{k,mb} / max(n_{k,mb}, 1)`` (Megatron's tracker; always
    valid; ``microbatch_size`` required).
    """
    estimator = check_option("mtp_log_estimator", estimator, MTP_LOG_ESTIMATORS)
    _depths(losses, masks)
    out = []
    for k, (x, w) in enumerate(zip(losses, masks), start=1):
        if estimator == "token_mean":
            check_inputs(x, w, where=f"MTP depth {k}")
            s, n = sample_stats(x, w)
            out.append(ratio_or_missing(s.sum(), n.sum()))
        else:
            check_positive_int("microbatch_size", microbatch_size)
            value = objective("per_microbatch", x, w, microbatch_size=microbatch_size)
            out.append(LogValue(value, jnp.ones((), bool)))
    return out


def mtp_normalizers(
    masks: Sequence[jax.Array] | jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    num_segments: int | None = None,
    microbatch_size: int | None = None,
) -> list[Normalizers]:
    """:func:`count_normalizers` of each depth's rolled mask (for :func:`mtp_denominators`)."""
    return [
        count_normalizers(w, segment_ids, num_segments=num_segments, microbatch_size=microbatch_size) for w in masks
    ]
