"""Gradient accumulation with ``jax.lax.scan`` and pre-counted normalizers (semantics §3).

Before the scan, the normalizers of the mode (``Ntok``, ``N``, ``Ndoc``, number of ``per_microbatch``
groups) are counted from the masks of all ``K`` microbatches; each microbatch then back-propagates its
exact share ``numerator(mb) / denominator``. The sum over microbatches is the objective of the whole
global batch, so ``K`` microbatches give the same objective, gradients and logs as ``K = 1`` for every
mode (``per_microbatch``: for a fixed ``microbatch_size``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._checks import check_mode_name
from .logchannel import ratio_or_missing
from .modes import Normalizers, check_mode, denominator, numerator
from .stats import check_inputs, document_count, sample_stats

__all__ = ["NORMALIZATIONS", "split_microbatches", "accumulate_gradients"]

NORMALIZATIONS: tuple[str, ...] = ("precounted", "deferred")


def split_microbatches(tree: Any, num_microbatches: int) -> Any:
    """Cut every leaf's leading (row) axis ``N`` into ``[K, N/K, ...]``: microbatch ``k`` holds the
    ``k``-th block of consecutive rows (the layout convention of lossparity)."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches <= 0:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")

    def cut(x):
        if x.ndim == 0 or x.shape[0] % num_microbatches:
            raise ValueError(
                f"num_microbatches={num_microbatches} does not divide the leading axis of a leaf of shape "
                f"{tuple(x.shape)}"
            )
        return x.reshape((num_microbatches, x.shape[0] // num_microbatches) + x.shape[1:])

    return jax.tree_util.tree_map(cut, tree)


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    microbatches: Any,
    *,
    mode: str,
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    microbatch_size: int | None = None,
    fixed_length: int | None = None,
    normalization: str = "precounted",
) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Objective, gradients and logs of one optimizer step over ``K`` microbatches (``lax.scan``).

    ``loss_fn(params, microbatch)`` returns the per-token losses ``[b, S]`` of one microbatch, where
    ``microbatch`` is the ``k``-th slice of the leaves of ``microbatches`` (leading axis ``K``, see
    :func:`split_microbatches`). ``mask`` (and ``segment_ids`` for ``per_document``) are ``[K, b, S]``.
    ``per_microbatch`` uses groups of ``microbatch_size`` rows (default ``b``; must divide ``b``).

    ``precounted`` (default): normalizers are counted from all masks before the scan and microbatch
    ``k`` contributes ``∇ numerator_k / denominator``. ``deferred`` (Megatron
    ``calculate_per_token_loss=True`` style): raw numerator gradients are summed and divided once at the
    end. Both give ``J = Σ_k numerator_k / denominator``. Returns ``(J, grads, logs)`` with ``logs``:
    ``objective``, ``lm_loss`` (global token mean) and ``lm_loss_valid`` (false when ``Ntok = 0``),
    ``tokens``, ``samples``, ``documents``, ``microbatches``. Gradients of bf16/fp16 parameters are
    accumulated in float32 and returned in the parameter dtype. ``jit``-able with ``loss_fn`` and the
    keyword options static.
    """
    check_mode(mode)
    check_mode_name(normalization, NORMALIZATIONS, "normalization")
    if mask.ndim != 3:
        raise ValueError(f"mask must be [K, b, S] (K microbatches), got shape {tuple(mask.shape)}")
    k, b, s = (int(d) for d in mask.shape)
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(mask.shape):
        raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} does not match mask shape {tuple(mask.shape)}")
    if mode == "per_document" and segment_ids is None:
        raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
    group = None
    if mode == "per_microbatch":
        group = b if microbatch_size is None else microbatch_size
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or b % group:
            raise ValueError(
                f"microbatch_size={microbatch_size!r} must be a positive int dividing the {b} rows of a microbatch"
            )
    for leaf in jax.tree_util.tree_leaves(microbatches):
        if leaf.ndim == 0 or leaf.shape[0] != k:
            raise ValueError(
                f"every leaf of microbatches needs the leading axis K={k} of mask, got a leaf of shape "
                f"{tuple(leaf.shape)}"
            )

    first = jax.tree_util.tree_map(lambda x: x[0], microbatches)
    out = jax.eval_shape(loss_fn, params, first)
    if tuple(out.shape) != (b, s) or not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(
            f"loss_fn must return floating per-token losses of shape ({b}, {s}) matching mask, got "
            f"{out.dtype} of shape {tuple(out.shape)}"
        )
    ldt = out.dtype
    # value checks of the whole step's mask and ids, eagerly, before the scan traces them away
    doc_ids = segment_ids if mode == "per_document" else None
    check_inputs(jnp.zeros((k * b, s), ldt), mask.reshape(k * b, s),
                 None if doc_ids is None else doc_ids.reshape(k * b, s),
                 num_segments=num_segments, check_finite=False)

    tokens = jnp.sum(mask != 0)
    one = jnp.ones((), tokens.dtype)
    docs = (
        jnp.zeros((), tokens.dtype)
        if segment_ids is None
        else document_count(segment_ids.reshape(k * b, s), num_segments=num_segments).astype(tokens.dtype)
    )
    groups = k * (b // group) if group is not None else k
    norms = Normalizers(tokens, one * (k * b), docs, one * groups)
    den = denominator(mode, norms).astype(ldt)
    scale = den if normalization == "precounted" else jnp.ones((), ldt)

    def body(carry, xs):
        grads, total, loss_sum = carry
        mb, w, seg = xs

        def share(p):
            loss = loss_fn(p, mb)
            check_inputs(loss, w, check_finite=False)
            num = numerator(mode, loss, w, segment_ids=seg, num_segments=num_segments,
                            fixed_length=fixed_length, microbatch_size=group)
            return num / scale, sample_stats(loss, w)[0].sum()

        (value, s_mb), g = jax.value_and_grad(share, has_aux=True)(params)
        grads = jax.tree_util.tree_map(lambda a, x: a + x.astype(a.dtype), grads, g)
        return (grads, total + value, loss_sum + s_mb), None

    # bf16/fp16 parameters accumulate their gradients in float32 and are cast back once at the end
    acc_dtype = lambda p: jnp.promote_types(p.dtype, jnp.float32)  # noqa: E731
    init = (
        jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, acc_dtype(p)), params),
        jnp.zeros((), ldt),
        jnp.zeros((), ldt),
    )
    (grads, total, loss_sum), _ = jax.lax.scan(body, init, (microbatches, mask, segment_ids))
    if normalization == "deferred":
        total = total / den
        grads = jax.tree_util.tree_map(lambda x: x / den.astype(x.dtype), grads)
    grads = jax.tree_util.tree_map(lambda x, p: x.astype(p.dtype), grads, params)
    lm, lm_valid = ratio_or_missing(loss_sum, tokens)
    logs = {
        "objective": total,
        "lm_loss": lm,
        "lm_loss_valid": lm_valid,
        "tokens": tokens,
        "samples": norms.samples,
        "documents": norms.documents,
        "microbatches": norms.microbatches,
    }
    return total, grads, logs
