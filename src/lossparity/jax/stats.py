"""Per-sample and per-document sums and counts in JAX (docs/semantics.md §0), on global arrays.

Every function here is pure and ``jit``-able and does not care how its inputs are sharded: it sees the
global ``[B, S]`` arrays and reduces along the sequence axis only (per row), so a batch sharded over
rows stays sharded. Documents use a static number of segment slots per row (``num_segments``) instead
of the data-dependent compaction of the PyTorch version, so shapes never depend on values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._checks import check_positive_int, loc, poison, value_check

__all__ = [
    "check_inputs",
    "sample_stats",
    "document_stats",
    "count_documents",
    "document_count",
    "resolve_num_segments",
    "prepare",
]


def _as_2d(x: jax.Array) -> jax.Array:
    return x[None, :] if x.ndim == 1 else x


def _static_checks(per_token_loss, mask, segment_ids, at: str) -> None:
    for name, x in (("per_token_loss", per_token_loss), ("mask", mask)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}{at}")
    if per_token_loss.ndim not in (1, 2):
        raise ValueError(f"per_token_loss must be [batch, seq] or [seq], got shape {tuple(per_token_loss.shape)}{at}")
    if not jnp.issubdtype(per_token_loss.dtype, jnp.floating):
        raise TypeError(f"per_token_loss must be floating point, got dtype {per_token_loss.dtype}{at}")
    if tuple(mask.shape) != tuple(per_token_loss.shape):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match per_token_loss shape {tuple(per_token_loss.shape)}{at}"
        )
    if jnp.issubdtype(mask.dtype, jnp.complexfloating):
        raise TypeError(f"mask must be real with values in {{0, 1}}, got dtype {mask.dtype}{at}")
    if segment_ids is not None:
        if not hasattr(segment_ids, "dtype") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            dtype = getattr(segment_ids, "dtype", type(segment_ids).__name__)
            raise TypeError(f"segment_ids must be an integer array, got {dtype}{at}")
        if tuple(segment_ids.shape) != tuple(per_token_loss.shape):
            raise ValueError(
                f"segment_ids shape {tuple(segment_ids.shape)} does not match per_token_loss shape "
                f"{tuple(per_token_loss.shape)}{at}"
            )


def document_index(xp, segment_ids):  # noqa: ANN001, ANN201 (NumPy or jax.numpy, as value_check passes)
    """The document number of every position within its row, 1, 2, ... (0 at padding), along the last
    axis: a document is a maximal run of equal non-zero ids (docs/semantics.md §0,
    ``lossparity.losses.mode_table.document_starts``), so ``[1, 1, 2, 2, 1, 1]`` gives ``[1, 1, 2, 2, 3, 3]``."""
    prev = xp.concatenate([xp.zeros_like(segment_ids[..., :1]), segment_ids[..., :-1]], axis=-1)
    starts = (segment_ids != 0) & (segment_ids != prev)
    return xp.where(segment_ids != 0, xp.cumsum(starts, axis=-1), 0)


def _mask_check(mask, where: str) -> jax.Array | None:
    return value_check(
        ValueError, "mask values must be 0 or 1, found {}", lambda xp, w: (w != 0) & (w != 1), (mask,), where=where
    )


def _segment_checks(mask, segment_ids, m: int, where: str) -> tuple[jax.Array | None, ...]:
    in_range = value_check(
        ValueError,
        f"segment_ids must lie in [0, num_segments={m}] (0 = padding), found {{}}",
        lambda xp, s: (s < 0) | (s > m),
        (segment_ids,),
        where=where,
    )
    # padding first: a loss token at id 0 also splits a run, and that is the error to name
    padding = value_check(
        ValueError,
        "mask has a loss-bearing token at segment_ids == 0 (padding)",
        lambda xp, s, w: (s == 0) & (w != 0),
        (segment_ids, mask),
        shown=None,
        where=where,
    )
    runs = value_check(
        ValueError,
        f"segment_ids: a row holds more than num_segments={m} documents (runs of equal non-zero ids); "
        "the first extra one starts",
        lambda xp, s: document_index(xp, s) > m,
        (segment_ids,),
        shown=None,
        where=where,
    )
    return in_range, runs, padding


def _finite_check(per_token_loss, mask, where: str) -> jax.Array | None:
    value_check(
        FloatingPointError,
        "per_token_loss has NaN/Inf ({}) at loss-bearing",
        lambda xp, x, w: (w != 0) & ~xp.isfinite(x),
        (per_token_loss, mask),
        where=where,
        at=" index ",
    )
    return None  # a NaN loss propagates by itself: nothing to poison


def _validate(
    per_token_loss: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    num_segments: int | None = None,
    where: str = "",
    check_finite: bool = True,
) -> tuple[jax.Array | None, ...]:
    """Static checks (raise), then value checks (module ``_checks``); returns the traced "bad" flags."""
    at = loc(where)
    _static_checks(per_token_loss, mask, segment_ids, at)
    flags = [_mask_check(mask, where)]
    if segment_ids is not None:
        flags += _segment_checks(mask, segment_ids, resolve_num_segments(segment_ids, num_segments), where)
    if check_finite:
        _finite_check(per_token_loss, mask, where)
    return tuple(flags)


def prepare(
    per_token_loss: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    num_segments: int | None = None,
    where: str = "",
    check_finite: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """Validate, then return ``(loss, bearing, segment_ids, bad)``, arrays as ``[B, S]``:
    ``bearing = mask != 0`` (bool), the loss poisoned with NaN when an unchecked traced input is
    invalid (``_checks``), and ``bad`` that traced flag (or None) for poisoning counts too."""
    flags = [
        f
        for f in _validate(
            per_token_loss, mask, segment_ids, num_segments=num_segments, where=where, check_finite=check_finite
        )
        if f is not None
    ]
    bad = functools.reduce(jnp.logical_or, flags) if flags else None
    loss = poison(_as_2d(per_token_loss), bad)
    seg = None if segment_ids is None else _as_2d(segment_ids)
    return loss, _as_2d(mask) != 0, seg, bad


def check_inputs(
    per_token_loss: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    num_segments: int | None = None,
    where: str = "",
    check_finite: bool = True,
) -> None:
    """Validate a (per-token loss, mask, segment ids) triple, raising a clear error (docs/semantics.md §7).

    Static (always, also under ``jit``): ``per_token_loss`` is a floating ``[B, S]`` (or ``[S]``) array,
    ``mask`` and ``segment_ids`` (integer) have its shape. Values (eagerly, or under :func:`checked`):
    mask values in {0, 1}; segment ids in ``[0, num_segments]`` (default ``S``) and no loss-bearing token
    (``mask != 0``) at id 0; with ``check_finite``, no NaN/Inf in the loss at a loss-bearing token (a
    masked position may hold anything: it is selected away). Messages name the first offending value
    and its index; ``where`` is appended to every message.
    """
    _validate(per_token_loss, mask, segment_ids, num_segments=num_segments, where=where, check_finite=check_finite)


def _masked_sums(loss: jax.Array, bearing: jax.Array) -> tuple[jax.Array, jax.Array]:
    # selected, not multiplied: a masked Inf/NaN contributes exactly 0 (also to the gradient)
    s = jnp.where(bearing, loss, jnp.zeros_like(loss)).sum(axis=-1)
    return s, bearing.astype(loss.dtype).sum(axis=-1)


def sample_stats(per_token_loss: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-sample loss sums and token counts: ``s_i = Σ_t w[i,t]·l[i,t]``, ``n_i = Σ_t w[i,t]``.

    ``per_token_loss`` and ``mask`` are ``[B, S]`` (a 1-D input is one sample). Returns ``(s, n)``, both
    ``[B]`` in the loss dtype (counts exact below 2**24 in float32). Masked positions contribute exactly
    0, also when the loss there is Inf/NaN, because they are selected away rather than multiplied.
    Inputs are validated as in :func:`check_inputs`.
    """
    loss, bearing, _, bad = prepare(per_token_loss, mask)
    s, n = _masked_sums(loss, bearing)
    return s, poison(n, bad)


def resolve_num_segments(segment_ids: jax.Array, num_segments: int | None) -> int:
    """The static number of document slots per row: ``num_segments`` or, by default, the row length
    ``S`` (a row of ``S`` tokens holds at most ``S`` documents when ids are numbered 1, 2, ...)."""
    check_positive_int("num_segments", num_segments, allow_none=True)
    return int(num_segments) if num_segments is not None else int(segment_ids.shape[-1])


def _segment_sum_rows(x: jax.Array, seg: jax.Array, m: int) -> jax.Array:
    # vmap over rows: each row reduces on its own, so a row-sharded batch stays row-sharded.
    return jax.vmap(lambda xr, sr: jax.ops.segment_sum(xr, sr, num_segments=m + 1))(x, seg)[:, 1:]


def document_stats(
    per_token_loss: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array,
    *,
    num_segments: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-document sums, counts and presence for packed rows, in ``[B, M]`` slots (``M = num_segments``,
    default ``S``): slot ``(i, j)`` is the ``(j+1)``-th document of row ``i``.

    A document is a maximal run of equal non-zero segment ids within a row (0 = padding;
    docs/semantics.md §0): ``[1, 1, 2, 2, 1, 1]`` holds 3. Ids must lie in ``[0, M]`` and a row may hold at
    most ``M`` documents. Returns ``(s, n, present)`` with ``s[i,j] = Σ_{t in doc} w·l``,
    ``n[i,j] = Σ_{t in doc} w`` and ``present[i,j]`` true when row ``i`` has a ``(j+1)``-th document (a
    document without loss-bearing tokens still exists and counts in ``Ndoc``). ``s[present]`` lists the
    documents in the order of the PyTorch ``document_stats`` (row, then position). A 1-D input is one
    row. Ids outside ``[0, M]``, more than ``M`` documents in a row or a loss-bearing token at id 0 raise
    eagerly and under :func:`checked`; in an unchecked traced program they make ``s`` and ``n`` NaN.
    """
    m = resolve_num_segments(segment_ids, num_segments)
    loss, bearing, seg, bad = prepare(per_token_loss, mask, segment_ids, num_segments=m)
    assert seg is not None  # prepare returns the segment ids it was given
    s, n, present = document_sums(loss, bearing, seg, m)
    return poison(s, bad), poison(n, bad), present


def document_sums(
    loss: jax.Array, bearing: jax.Array, seg: jax.Array, m: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`document_stats` of already validated ``[B, S]`` inputs (``bearing`` boolean)."""
    doc = document_index(jnp, seg)
    s = _segment_sum_rows(jnp.where(bearing, loss, jnp.zeros_like(loss)), doc, m)
    n = _segment_sum_rows(bearing.astype(loss.dtype), doc, m)
    present = _segment_sum_rows((doc > 0).astype(jnp.int32), doc, m) > 0
    return s, n, present


def count_documents(segment_ids: jax.Array, *, num_segments: int | None = None) -> jax.Array:
    """``Ndoc``: the number of documents (runs of equal non-zero ids within a row, :func:`document_stats`),
    as an integer array. Ids outside ``[0, num_segments]`` or more than ``num_segments`` documents in a
    row raise eagerly and under :func:`checked`; an unchecked traced program cannot flag them in an
    integer count (documents past the ``num_segments``-th of a row are not counted)."""
    if not hasattr(segment_ids, "dtype") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids must be an integer array, got {getattr(segment_ids, 'dtype', None)}")
    m = resolve_num_segments(segment_ids, num_segments)
    _segment_checks(jnp.zeros(segment_ids.shape, jnp.int32), segment_ids, m, "")
    doc = document_index(jnp, _as_2d(segment_ids))
    starts = (doc > 0) & (doc <= m) & (doc != jnp.pad(doc[:, :-1], ((0, 0), (1, 0))))
    return starts.sum()


document_count = count_documents  # the name before the two ports were aligned (torch: count_documents)
