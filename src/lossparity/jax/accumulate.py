"""Gradient accumulation with ``jax.lax.scan`` and pre-counted normalizers (docs/semantics.md §3).

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

from ..options import NORMALIZATIONS, check_option
from ._checks import poison, value_check
from .logchannel import ratio_or_missing
from .modes import Normalizers, check_mode, denominator, require_microbatch_size, unit_sum
from .stats import _static_checks, count_documents, resolve_num_segments

__all__ = ["NORMALIZATIONS", "split_microbatches", "accumulate_gradients"]

_MB_INDEX = "[{}, {}] (microbatch {})"  # row and position inside microbatch k: the order of [K, b, S]
_MB_ORDER = (1, 2, 0)  # the index fields of _MB_INDEX, from a [K, b, S] position


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


def _split_inputs(batch, mask, segment_ids, num_microbatches):
    """``(microbatches, mask, segment_ids)`` cut into ``[K, b, ...]``: by this function when
    ``num_microbatches`` is given (one split for all, so they agree by construction), else checked."""
    if num_microbatches is not None:
        if mask.ndim != 2:
            raise ValueError(
                f"num_microbatches={num_microbatches} splits the unsplit [N, S] batch, but mask is already "
                f"split (shape {tuple(mask.shape)}); pass the [N, S] mask or drop num_microbatches"
            )
        return split_microbatches((batch, mask, segment_ids), num_microbatches)
    if mask.ndim != 3:
        raise ValueError(
            f"mask must be [K, b, S] (K microbatches), got shape {tuple(mask.shape)}; or pass the [N, S] mask "
            "and num_microbatches=K"
        )
    k, b = int(mask.shape[0]), int(mask.shape[1])
    for leaf in jax.tree_util.tree_leaves(batch):
        if leaf.ndim == 0 or leaf.shape[0] != k:
            raise ValueError(
                f"every leaf of microbatches needs the leading axis K={k} of mask, got a leaf of shape "
                f"{tuple(leaf.shape)}"
            )
        if leaf.ndim >= 2 and leaf.shape[1] != b:
            raise ValueError(
                f"every leaf of microbatches must hold the same rows per microbatch as mask (K={k}, b={b}), "
                f"got a leaf of shape {tuple(leaf.shape)}; split them together (num_microbatches=K)"
            )
    return batch, mask, segment_ids


def _check_segment_ids(mode: str, segment_ids, mask) -> None:
    if segment_ids is not None and tuple(segment_ids.shape) != tuple(mask.shape):
        raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} does not match mask shape {tuple(mask.shape)}")
    if mode == "per_document" and segment_ids is None:
        raise ValueError("mode 'per_document' needs segment_ids (packed rows)")


def _step_checks(mask, doc_ids, num_segments) -> list[jax.Array | None]:
    """Value checks of the whole step's ``[K, b, S]`` mask and document ids, naming the microbatch."""
    flags = [
        value_check(
            ValueError,
            "mask values must be 0 or 1, found {}",
            lambda xp, w: (w != 0) & (w != 1),
            (mask,),
            index_text=_MB_INDEX,
            index_order=_MB_ORDER,
        )
    ]
    if doc_ids is not None:
        m = resolve_num_segments(doc_ids, num_segments)
        flags.append(
            value_check(
                ValueError,
                f"segment_ids must lie in [0, num_segments={m}] (0 = padding), found {{}}",
                lambda xp, s: (s < 0) | (s > m),
                (doc_ids,),
                index_text=_MB_INDEX,
                index_order=_MB_ORDER,
            )
        )
        flags.append(
            value_check(
                ValueError,
                "mask has a loss-bearing token at segment_ids == 0 (padding)",
                lambda xp, s, w: (s == 0) & (w != 0),
                (doc_ids, mask),
                shown=None,
                index_text=_MB_INDEX,
                index_order=_MB_ORDER,
            )
        )
    return flags


def _loss_shape(loss_fn, params, microbatches, b: int, s: int):
    first = jax.tree_util.tree_map(lambda x: x[0], microbatches)
    out = jax.eval_shape(loss_fn, params, first)
    if tuple(out.shape) != (b, s) or not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(
            f"loss_fn must return floating per-token losses of shape ({b}, {s}) matching mask, got "
            f"{out.dtype} of shape {tuple(out.shape)}"
        )
    return out.dtype


def _step_normalizers(mask, doc_ids, num_segments, groups: int) -> Normalizers:
    k, b, s = (int(d) for d in mask.shape)
    tokens = jnp.sum(mask != 0)
    one = jnp.ones((), tokens.dtype)
    docs = (
        jnp.zeros((), tokens.dtype)
        if doc_ids is None
        else count_documents(doc_ids.reshape(k * b, s), num_segments=num_segments).astype(tokens.dtype)
    )
    return Normalizers(tokens, one * (k * b), docs, one * groups)


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
    normalization: str = "precount",
    num_microbatches: int | None = None,
) -> tuple[jax.Array, Any, dict[str, Any]]:
    """Objective, gradients and logs of one optimizer step over ``K`` microbatches (``lax.scan``).

    ``loss_fn(params, microbatch)`` returns the per-token losses ``[b, S]`` of one microbatch. Either
    pass the whole step (leaves ``[N, ...]``, ``mask`` and ``segment_ids`` ``[N, S]``) with
    ``num_microbatches=K``, and everything is cut by one :func:`split_microbatches`; or pass them already
    split (leaves ``[K, b, ...]``, ``mask [K, b, S]``), and the leaves are checked to have the mask's
    ``K`` and ``b``. ``per_microbatch`` needs ``microbatch_size`` (the rows of one microbatch on one
    rank; dividing ``b``); ``per_document`` needs ``segment_ids``.

    ``precount`` (default; old spelling ``precounted``): normalizers are counted from all masks before
    the scan and microbatch ``k`` contributes ``∇ numerator_k / denominator``. ``deferred`` (Megatron
    ``calculate_per_token_loss=True`` style): raw numerator gradients are summed and divided once at the
    end. Both give ``J = Σ_k numerator_k / denominator``. Returns ``(J, grads, logs)``; ``logs`` holds
    ``objective``, ``lm_loss`` (global token mean, a ``LogValue``: missing when ``Ntok = 0``; turn the
    logs into numbers with ``host_logs``), ``tokens``, ``samples``, ``documents``, ``microbatches``.
    Gradients of bf16/fp16 parameters are accumulated in float32 and returned in the parameter dtype.
    Value checks as in ``check_inputs``, messages naming the microbatch; a NaN/Inf loss at a
    loss-bearing token raises eagerly and under ``checked``. ``jit``-able with ``loss_fn`` and the
    keyword options static.
    """
    mode = check_mode(mode)
    normalization = check_option("normalization", normalization, NORMALIZATIONS)
    microbatches, mask, segment_ids = _split_inputs(microbatches, mask, segment_ids, num_microbatches)
    k, b, s = (int(d) for d in mask.shape)
    _check_segment_ids(mode, segment_ids, mask)
    group = require_microbatch_size(microbatch_size, b, "accumulate_gradients") if mode == "per_microbatch" else None
    ldt = _loss_shape(loss_fn, params, microbatches, b, s)
    doc_ids = segment_ids if mode == "per_document" else None
    _static_checks(jnp.zeros((1, 1), ldt), mask[0, :1, :1], None, "")
    flags = _step_checks(mask, doc_ids, num_segments)
    norms = _step_normalizers(mask, segment_ids, num_segments, k * (b // group) if group else k)
    den = denominator(mode, norms).astype(ldt)
    total, grads, loss_sum, bad = _scan(
        loss_fn,
        params,
        microbatches,
        mask,
        doc_ids,
        mode,
        ldt,
        den if normalization == "precount" else jnp.ones((), ldt),
        dict(num_segments=num_segments, fixed_length=fixed_length, microbatch_size=group),
    )
    _nonfinite_check(*bad)
    if normalization == "deferred":
        total = total / den
        grads = jax.tree_util.tree_map(lambda x: x / den.astype(x.dtype), grads)
    total = poison(total, *flags)
    grads = jax.tree_util.tree_map(lambda x, p: poison(x, *flags).astype(p.dtype), grads, params)
    return total, grads, _logs(total, loss_sum, norms)


def _logs(total: jax.Array, loss_sum: jax.Array, norms: Normalizers) -> dict[str, Any]:
    """The step's log channel (docs/semantics.md §2): ``lm_loss`` is the global token mean, missing at ``Ntok = 0``."""
    return {
        "objective": total,
        "lm_loss": ratio_or_missing(loss_sum, norms.tokens),
        "tokens": norms.tokens,
        "samples": norms.samples,
        "documents": norms.documents,
        "microbatches": norms.microbatches,
    }


def _scan(loss_fn, params, microbatches, mask, doc_ids, mode, ldt, scale, kw):
    """The ``lax.scan`` over microbatches: summed gradients of ``numerator_k / scale``, the objective,
    the loss sum of the log channel, and per-microbatch maps of non-finite loss-bearing losses."""

    def body(carry, xs):
        grads, total, loss_sum = carry
        mb, w, seg = xs

        def share(p):
            loss = loss_fn(p, mb)
            bearing = w != 0
            # the step's mask and ids were checked before the scan, the loss is checked after it (where the
            # microbatch can be named): the share is formed from the numerator's formula directly
            num = unit_sum(mode, loss, bearing, seg, None, **kw)
            return num / scale, (jnp.where(bearing, loss, jnp.zeros_like(loss)).sum(), loss)

        (value, (s_mb, loss)), g = jax.value_and_grad(share, has_aux=True)(params)
        grads = jax.tree_util.tree_map(lambda a, x: a + x.astype(a.dtype), grads, g)
        nonfinite = (w != 0) & ~jnp.isfinite(loss)
        return (grads, total + value, loss_sum + s_mb), (nonfinite, jnp.where(nonfinite, loss, 0))

    # bf16/fp16 parameters accumulate their gradients in float32 and are cast back once at the end
    init = (
        jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params),
        jnp.zeros((), ldt),
        jnp.zeros((), ldt),
    )
    (grads, total, loss_sum), bad = jax.lax.scan(body, init, (microbatches, mask, doc_ids))
    return total, grads, loss_sum, bad


def _nonfinite_check(nonfinite, values) -> None:
    value_check(
        FloatingPointError,
        "per_token_loss has NaN/Inf ({}) at loss-bearing",
        lambda xp, v, bad: bad,
        (values, nonfinite),
        index_text=_MB_INDEX,
        index_order=(1, 2, 0),
        at=" index ",
    )
