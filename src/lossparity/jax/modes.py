"""Normalization modes of the language-model objective in JAX (docs/semantics.md §1, §3).

Same decomposition and names as the PyTorch ``lossparity.losses.modes``: every mode is
``J = Σ_mb numerator(mb) / denominator``, a per-microbatch numerator from that microbatch's own sample
or document statistics and one global denominator that is pre-counted from the masks.

The modes (unit, reduction, count, empty-unit rule) and the definition of a document come from the
torch-free table :mod:`lossparity.losses.mode_table`, shared with the PyTorch port, the integrations and
the log tools; ``per_microbatch``'s numerator here sums ``s_mb' / max(n_mb', 1)`` over the microbatches
``mb'`` of ``microbatch_size`` rows inside its input.

All functions are pure and ``jit``-able on global arrays; ``mode``, ``num_segments``, ``microbatch_size``
and ``fixed_length`` are static Python values; mode names come from ``lossparity.options``.

One rule for ``per_microbatch``'s group size: the one-microbatch functions (:func:`numerator`,
:func:`count_normalizers`) read ``microbatch_size=None`` as "the input is one microbatch", as the
PyTorch ones do; the whole-step functions (:func:`objective`, ``accumulate_gradients``,
``mtp_objective``, ``mtp_log_losses``) need it explicitly, since they see several microbatches and
cannot know how the step was cut (e.g. a scan microbatch of ``b`` rows spread over ``D`` devices holds
``D`` Megatron microbatches of ``b/D`` rows).

Loss-bearing tokens are those with ``mask != 0``; inputs are validated as in ``check_inputs`` (value
checks: eagerly, or under ``checked``; see ``_checks``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..losses.mode_table import MODE_TABLE, check_fixed_length, check_no_fixed_length, mode_spec, reduce_units
from ..options import MODES as _ALL_MODES
from ..options import Mode, check_option
from ._checks import check_positive_int, poison
from .stats import _as_2d, _masked_sums, count_documents, document_sums, prepare, resolve_num_segments

__all__ = [
    "MODES",
    "Normalizers",
    "check_mode",
    "count_normalizers",
    "numerator",
    "denominator",
    "objective",
    "share",
]

# The RL modes of the shared table (token_sum, per_group) are not in the JAX port yet: refused by name.
RL_ONLY_MODES: tuple[Mode, ...] = ("token_sum", "per_group")
MODES: tuple[Mode, ...] = tuple(m for m in _ALL_MODES if m not in RL_ONLY_MODES)  # type: ignore[no-redef]

_DENOMINATOR_KEY: dict[str, str] = {m: spec.count for m, spec in MODE_TABLE.items()}


def check_mode(mode: str) -> Mode:
    """Return ``mode`` if it is one of :data:`MODES` (``lossparity.options`` less :data:`RL_ONLY_MODES`),
    else raise ``ValueError`` listing the valid ones (naming the PyTorch home of an RL-only mode)."""
    if mode in RL_ONLY_MODES:
        raise ValueError(
            f"mode {mode!r} is not in the JAX port (PyTorch only: lossparity.losses.modes, lossparity.rl); "
            f"valid JAX modes: {', '.join(MODES)}"
        )
    return check_option("mode", mode, MODES)


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


def require_microbatch_size(microbatch_size: int | None, rows: int, what: str) -> int:
    """The group size of ``per_microbatch`` in a whole-step function (``what``): it must be given, since
    the function sees several microbatches and cannot know how they were cut."""
    if microbatch_size is None:
        raise ValueError(
            f"mode 'per_microbatch' in {what} needs microbatch_size (the rows of one microbatch on one "
            f"rank, dividing the {rows} rows); only the one-microbatch functions numerator and "
            "count_normalizers default to 'the input is one microbatch'"
        )
    _check_microbatch_size(microbatch_size, rows)
    return microbatch_size


def count_normalizers(
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    num_segments: int | None = None,
    microbatch_size: int | None = None,
) -> Normalizers:
    """Normalizers of a ``[B, S]`` batch: ``tokens = #{mask != 0}``, ``samples = B``, ``documents = Ndoc``
    (0 without ``segment_ids``) and ``microbatches = B / microbatch_size``; ``microbatch_size=None``
    means the input is one microbatch (``microbatches = 1``, as the PyTorch ``count_normalizers``)."""
    w = _as_2d(mask)
    rows = int(w.shape[0])
    _check_microbatch_size(microbatch_size, rows)
    tokens = jnp.sum(w != 0)
    one = jnp.ones((), tokens.dtype)
    docs = (
        jnp.zeros((), tokens.dtype)
        if segment_ids is None
        else count_documents(segment_ids, num_segments=num_segments).astype(tokens.dtype)
    )
    mbs = 1 if microbatch_size is None else rows // microbatch_size
    return Normalizers(tokens, one * rows, docs, one * mbs)


def denominator(mode: str, norms: Normalizers, fixed_length: int | None = None) -> jax.Array:
    """The global denominator of ``mode`` (module table): ``max(count, 1)`` of ``Ntok``, ``N``, ``Ndoc``
    or ``D·K``; the ``max`` only turns an empty count into 1 so that an empty batch gives ``J = 0``.
    ``sample_sum_norm``'s ``L`` is divided in :func:`numerator`, so its denominator is ``N``: passing
    ``fixed_length`` here raises instead of being silently ignored, as in the PyTorch port."""
    check_mode(mode)
    check_no_fixed_length(fixed_length)
    return jnp.maximum(jnp.asarray(getattr(norms, _DENOMINATOR_KEY[mode])), 1)


def unit_sum(
    mode: str,
    loss: jax.Array,
    bearing: jax.Array,
    seg: jax.Array | None,
    bad: jax.Array | None,
    *,
    num_segments: int | None,
    fixed_length: int | None,
    microbatch_size: int | None,
) -> jax.Array:
    """The numerator of ``mode`` from validated ``[B, S]`` inputs (``bearing = mask != 0``, ``bad`` the
    traced poison flag or None): ``Σ_units s_u / max(n_u, 1)``, or the plain or ``L``-scaled sum."""
    spec = mode_spec(mode)
    if spec.unit == "document":
        if seg is None:
            raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
        s, n, _ = document_sums(loss, bearing, seg, resolve_num_segments(seg, num_segments))
    else:
        s, n = _masked_sums(loss, bearing)
        if spec.unit == "microbatch":
            # the callers pass a validated size: this only narrows the type (and names a missing size)
            size = require_microbatch_size(microbatch_size, int(s.shape[0]), "unit_sum")
            s, n = s.reshape(-1, size).sum(axis=-1), n.reshape(-1, size).sum(axis=-1)
    if spec.reduction == "sum_over_length":
        check_fixed_length(fixed_length)
    return reduce_units(mode, poison(s, bad) if not spec.per_unit else s, poison(n, bad), fixed_length=fixed_length)


def numerator(
    mode: str,
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    fixed_length: int | None = None,
    microbatch_size: int | None = None,
    where: str = "",
    check_finite: bool = True,
) -> jax.Array:
    """The numerator of ``mode`` for one microbatch (module table); differentiable w.r.t. the loss.

    ``per_token_loss`` and ``mask`` are ``[b, S]`` (or ``[S]``). ``per_document`` needs ``segment_ids``
    (ids in ``[0, num_segments]``, default ``S``); ``sample_sum_norm`` needs ``fixed_length`` (the ``L``
    of Dr. GRPO, divided here so that every denominator is a plain count). ``per_microbatch`` sums the
    local means of consecutive groups of ``microbatch_size`` rows; ``None`` means the input is one
    microbatch. Inputs are validated as in ``check_inputs`` (``where`` ends every message; ``check_finite``
    as there).
    """
    mode = check_mode(mode)
    seg = segment_ids if mode == "per_document" else None  # ids matter (and are checked) only here
    loss, bearing, seg2, bad = prepare(
        per_token_loss, mask, seg, num_segments=num_segments, where=where, check_finite=check_finite
    )
    if mode == "per_document" and segment_ids is None:
        raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
    rows = int(loss.shape[0])
    if mode == "per_microbatch":
        _check_microbatch_size(microbatch_size, rows)
    return unit_sum(
        mode,
        loss,
        bearing,
        seg2,
        bad,
        num_segments=num_segments,
        fixed_length=fixed_length,
        microbatch_size=microbatch_size or rows,
    )


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
    """The objective ``J`` of docs/semantics.md §1 on a whole global batch ``[N, S]``, from the formula.

    ``per_token``: ``S / max(Ntok, 1)``, computed as one reduction ``Σ(w·l) / max(Σ w, 1)``, the same
    formula as the usual ``sum(xent·mask) / sum(mask)``; equal to it up to rounding, not guaranteed
    bit-identical (XLA picks the summation order per program: in float32 the two can differ in the last
    bit). ``per_sample``: ``(1/N) Σ_i s_i/max(n_i,1)``.
    ``per_microbatch``: consecutive blocks of ``microbatch_size`` rows (required; rank ``d``, microbatch
    ``k`` = block ``d·K + k``), ``(1/(D·K)) Σ_mb s_mb/max(n_mb,1)``. ``per_document``:
    ``(1/max(Ndoc,1)) Σ_j s_j/max(n_j,1)``. ``sample_sum``: ``(1/N) Σ_i s_i``. ``sample_sum_norm``:
    ``S/(N·L)`` with ``L = fixed_length``. Inputs are validated as in ``check_inputs``.
    """
    mode = check_mode(mode)
    seg = segment_ids if mode == "per_document" else None
    loss, bearing, seg2, bad = prepare(per_token_loss, mask, seg, num_segments=num_segments)
    rows = int(loss.shape[0])
    if mode == "per_token":
        wf = bearing.astype(loss.dtype)
        return jnp.sum(jnp.where(bearing, loss, jnp.zeros_like(loss))) / poison(jnp.maximum(jnp.sum(wf), 1), bad)
    if mode == "per_document" and segment_ids is None:
        raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
    size = require_microbatch_size(microbatch_size, rows, "objective") if mode == "per_microbatch" else rows
    num = unit_sum(
        mode, loss, bearing, seg2, bad, num_segments=num_segments, fixed_length=fixed_length, microbatch_size=size
    )
    if mode == "per_document":
        assert seg2 is not None  # prepare returns the segment ids it was given (checked above)
        return num / jnp.maximum(count_documents(seg2, num_segments=num_segments), 1)
    return num / (rows // size if mode == "per_microbatch" else max(rows, 1))


def share(
    mode: str,
    per_token_loss: jax.Array,
    mask: jax.Array,
    norms: Normalizers,
    *,
    segment_ids: jax.Array | None = None,
    num_segments: int | None = None,
    fixed_length: int | None = None,
    microbatch_size: int | None = None,
) -> jax.Array:
    """One microbatch's share of the step objective: ``numerator(mb) / denominator(mode, norms)``.

    ``norms`` are the step's global :class:`Normalizers` (``count_normalizers`` of every microbatch's
    masks, summed, or of the whole batch), counted once before the microbatch loop, so a gradient
    accumulation loop that sees one microbatch at a time (MaxText's ``lax.scan``) gets
    ``J = Σ_mb share(mb)`` and ``∇J = Σ_mb ∇share(mb)`` without holding the whole batch:
    ``per_sample``: ``Σ_{i∈mb} s_i/max(n_i,1) / N``; ``per_document``: ``Σ_{j∈mb} s_j/max(n_j,1) / max(Ndoc,1)``;
    ``per_token``: ``Σ_{t∈mb} l_t / max(Ntok,1)``. Arguments as in :func:`numerator`.
    """
    num = numerator(
        mode,
        per_token_loss,
        mask,
        segment_ids=segment_ids,
        num_segments=num_segments,
        fixed_length=fixed_length,
        microbatch_size=microbatch_size,
    )
    return num / denominator(mode, norms).astype(num.dtype)
