"""Normalization modes of the language-model objective in JAX (semantics §1, §3).

Same decomposition and names as the PyTorch ``lossparity.losses.modes``: every mode is
``J = Σ_mb numerator(mb) / denominator``, a per-microbatch numerator from that microbatch's own sample
or document statistics and one global denominator that is pre-counted from the masks.

| mode             | numerator of one microbatch         | denominator   |
|------------------|-------------------------------------|---------------|
| per_token        | Σ_i s_i                             | max(Ntok, 1)  |
| per_sample       | Σ_i s_i / max(n_i, 1)               | N             |
| per_microbatch   | Σ_mb' s_mb' / max(n_mb', 1)         | D·K           |
| per_document     | Σ_j s_j / max(n_j, 1)               | Ndoc          |
| sample_sum       | Σ_i s_i                             | N             |
| sample_sum_norm  | Σ_i s_i / L                         | N             |

(``mb'``: the microbatches of ``microbatch_size`` rows inside the numerator's input; by default the
whole input is one microbatch, as in PyTorch.) All functions are pure and ``jit``-able on global
arrays; ``mode``, ``num_segments``, ``microbatch_size`` and ``fixed_length`` are static Python values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._checks import check_mode_name, check_positive_int
from .stats import _as_2d, check_inputs, document_count, document_stats, sample_stats

__all__ = [
    "MODES",
    "Normalizers",
    "check_mode",
    "count_normalizers",
    "numerator",
    "denominator",
    "objective",
]

MODES: tuple[str, ...] = (
    "per_token",
    "per_sample",
    "per_microbatch",
    "per_document",
    "sample_sum",
    "sample_sum_norm",
)

_DENOMINATOR_KEY = {
    "per_token": "tokens",
    "per_sample": "samples",
    "per_microbatch": "microbatches",
    "per_document": "documents",
    "sample_sum": "samples",
    "sample_sum_norm": "samples",
}


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`MODES`, else raise ``ValueError`` listing the valid ones."""
    return check_mode_name(mode, MODES)


class Normalizers(NamedTuple):
    """Global counts of one optimizer step (a pytree of integer scalars, so it passes through ``jit``).

    ``tokens = Ntok = Σ_i n_i``, ``samples = N``, ``documents = Ndoc`` (0 without segment ids),
    ``microbatches = D·K`` (the number of ``per_microbatch`` groups). ``a + b`` adds field by field.
    """

    tokens: jax.Array
    samples: jax.Array
    documents: jax.Array
    microbatches: jax.Array

    def __add__(self, other: Normalizers) -> Normalizers:  # type: ignore[override]
        return Normalizers(*(a + b for a, b in zip(self, other)))


def _check_microbatch_size(microbatch_size: int | None, rows: int) -> None:
    check_positive_int("microbatch_size", microbatch_size, allow_none=True)
    if microbatch_size is not None and rows % microbatch_size:
        raise ValueError(f"microbatch_size={microbatch_size} does not divide the {rows} rows of the batch")


def count_normalizers(
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    num_segments: int | None = None,
    microbatch_size: int | None = None,
) -> Normalizers:
    """Normalizers of a ``[B, S]`` batch: ``tokens = Σ w``, ``samples = B``, ``documents = Ndoc`` (0
    without ``segment_ids``) and ``microbatches = B / microbatch_size`` (1 when ``microbatch_size`` is
    None: the whole batch is one microbatch, as in the PyTorch ``count_normalizers``)."""
    w = _as_2d(mask)
    rows = int(w.shape[0])
    _check_microbatch_size(microbatch_size, rows)
    tokens = jnp.sum(w != 0)
    one = jnp.ones((), tokens.dtype)
    docs = (
        jnp.zeros((), tokens.dtype)
        if segment_ids is None
        else document_count(segment_ids, num_segments=num_segments).astype(tokens.dtype)
    )
    mbs = 1 if microbatch_size is None else rows // microbatch_size
    return Normalizers(tokens, one * rows, docs, one * mbs)


def denominator(mode: str, norms: Normalizers, fixed_length: int | None = None) -> jax.Array:
    """The global denominator of ``mode`` (module table): ``max(count, 1)`` of ``Ntok``, ``N``, ``Ndoc``
    or ``D·K``; the ``max`` only turns an empty count into 1 so that an empty batch gives ``J = 0``.
    ``fixed_length`` is accepted for symmetry with :func:`numerator` (``sample_sum_norm`` divides by
    ``L`` in the numerator)."""
    check_mode(mode)
    return jnp.maximum(jnp.asarray(getattr(norms, _DENOMINATOR_KEY[mode])), 1)


def _check_fixed_length(fixed_length: int | None) -> int:
    if isinstance(fixed_length, bool) or not isinstance(fixed_length, (int, float)) or fixed_length <= 0:
        raise ValueError(
            f"mode 'sample_sum_norm' needs fixed_length > 0 (the L of Dr. GRPO), got {fixed_length!r}"
        )
    return fixed_length


def _per_microbatch_sum(s: jax.Array, n: jax.Array, microbatch_size: int | None) -> jax.Array:
    b = s.shape[0] if microbatch_size is None else microbatch_size
    s_mb = s.reshape(-1, b).sum(axis=-1)
    n_mb = n.reshape(-1, b).sum(axis=-1)
    return (s_mb / jnp.maximum(n_mb, 1)).sum()


def numerator(
    mode: str,
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    fixed_length: int | None = None,
    microbatch_size: int | None = None,
) -> jax.Array:
    """The numerator of ``mode`` for one microbatch (module table); differentiable w.r.t. the loss.

    ``per_token_loss`` and ``mask`` are ``[b, S]``. ``per_document`` needs ``segment_ids`` (ids in
    ``[0, num_segments]``, default ``S``); ``sample_sum_norm`` needs ``fixed_length`` (the ``L`` of Dr.
    GRPO, divided here so that every denominator is a plain count). ``per_microbatch`` sums the local
    means of consecutive groups of ``microbatch_size`` rows (default: the whole input is one group).
    """
    check_mode(mode)
    # segment ids matter (and are validated) only where documents are counted
    seg = segment_ids if mode == "per_document" else None
    check_inputs(per_token_loss, mask, seg, num_segments=num_segments, check_finite=False)
    if mode == "per_document":
        if segment_ids is None:
            raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
        s, n, _ = document_stats(per_token_loss, mask, segment_ids, num_segments=num_segments)
        return (s / jnp.maximum(n, 1)).sum()
    s, n = sample_stats(per_token_loss, mask)
    if mode in ("per_token", "sample_sum"):
        return s.sum()
    if mode == "per_sample":
        return (s / jnp.maximum(n, 1)).sum()
    if mode == "per_microbatch":
        _check_microbatch_size(microbatch_size, s.shape[0])
        return _per_microbatch_sum(s, n, microbatch_size)
    return s.sum() / _check_fixed_length(fixed_length)


def objective(
    mode: str,
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    microbatch_size: int | None = None,
    fixed_length: int | None = None,
) -> jax.Array:
    """The objective ``J`` of semantics §1 on a whole global batch ``[N, S]``, straight from the formula.

    ``per_token``: ``S / max(Ntok, 1)``, computed as one reduction ``Σ(w·l) / max(Σ w, 1)`` so that it is
    bit-identical to the usual ``sum(xent·mask) / sum(mask)``. ``per_sample``: ``(1/N) Σ_i s_i/max(n_i,1)``.
    ``per_microbatch``: consecutive blocks of ``microbatch_size`` rows (required; rank ``d``, microbatch
    ``k`` = block ``d·K + k``), ``(1/(D·K)) Σ_mb s_mb/max(n_mb,1)``. ``per_document``:
    ``(1/max(Ndoc,1)) Σ_j s_j/max(n_j,1)``. ``sample_sum``: ``(1/N) Σ_i s_i``. ``sample_sum_norm``:
    ``S/(N·L)`` with ``L = fixed_length``.
    """
    check_mode(mode)
    seg = segment_ids if mode == "per_document" else None
    check_inputs(per_token_loss, mask, seg, num_segments=num_segments, check_finite=False)
    loss, w = _as_2d(per_token_loss), _as_2d(mask)
    rows = loss.shape[0]
    if mode == "per_token":
        wf = w.astype(loss.dtype)
        return jnp.sum(jnp.where(wf > 0, loss, jnp.zeros_like(loss))) / jnp.maximum(jnp.sum(wf), 1)
    if mode == "per_microbatch":
        if microbatch_size is None:
            raise ValueError(f"mode 'per_microbatch' needs microbatch_size dividing the {rows} rows, got None")
        _check_microbatch_size(microbatch_size, rows)
        s, n = sample_stats(loss, w)
        return _per_microbatch_sum(s, n, microbatch_size) / (rows // microbatch_size)
    if mode == "per_document":
        if segment_ids is None:
            raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
        s, n, present = document_stats(loss, w, segment_ids, num_segments=num_segments)
        return (s / jnp.maximum(n, 1)).sum() / jnp.maximum(present.sum(), 1)
    num = numerator(mode, loss, w, fixed_length=fixed_length)
    return num / max(rows, 1)
