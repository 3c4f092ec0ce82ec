"""Per-sample and per-document sums and counts in JAX (semantics §0), on global arrays.

Every function here is pure and ``jit``-able and does not care how its inputs are sharded: it sees the
global ``[B, S]`` arrays and reduces along the sequence axis only (per row), so a batch sharded over
rows stays sharded. Documents use a static number of segment slots per row (``num_segments``) instead
of the data-dependent compaction of the PyTorch version, so shapes never depend on values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import check_positive_int, concrete, loc

__all__ = [
    "check_inputs",
    "sample_stats",
    "document_stats",
    "document_count",
    "resolve_num_segments",
]


def _as_2d(x: jax.Array) -> jax.Array:
    return x[None, :] if x.ndim == 1 else x


def check_inputs(
    per_token_loss: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    num_segments: int | None = None,
    where: str = "",
    check_finite: bool = True,
) -> None:
    """Validate a (per-token loss, mask, segment ids) triple, raising a clear error (semantics §7).

    Always (also under ``jit``): ``per_token_loss`` is a floating ``[B, S]`` (or ``[S]``) array, ``mask``
    and ``segment_ids`` (integer) have the same shape. On concrete values only: mask values in {0, 1},
    segment ids in ``[0, num_segments]`` (default ``S``), no loss-bearing token at segment id 0 when
    ``segment_ids`` is given, and (``check_finite``) no NaN/Inf in the loss. ``where`` is appended to
    every message.
    """
    at = loc(where)
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
    w = concrete(mask)
    if w is not None and w.size and not np.all((w == 0) | (w == 1)):
        bad = w[(w != 0) & (w != 1)].ravel()[:3].tolist()
        raise ValueError(f"mask values must be 0 or 1, found {bad}{at}")
    if segment_ids is not None:
        seg = concrete(segment_ids)
        if seg is not None and seg.size:
            m = resolve_num_segments(segment_ids, num_segments)
            if seg.min() < 0 or seg.max() > m:
                raise ValueError(
                    f"segment_ids must lie in [0, num_segments={m}] (0 = padding), found values in "
                    f"[{seg.min()}, {seg.max()}]; pass a larger num_segments{at}"
                )
            if w is not None and np.any((seg == 0) & (w > 0)):
                idx = tuple(int(i) for i in np.argwhere((seg == 0) & (w > 0))[0])
                raise ValueError(
                    f"mask has a loss-bearing token at segment_ids == 0 (padding) at index {idx}; "
                    f"it would belong to no document{at}"
                )
    if check_finite:
        x = concrete(per_token_loss)
        if x is not None and x.size and not np.all(np.isfinite(x)):
            idx = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
            raise FloatingPointError(f"per_token_loss has NaN/Inf at index {idx}{at}")


def sample_stats(per_token_loss: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-sample loss sums and token counts: ``s_i = Σ_t w[i,t]·l[i,t]``, ``n_i = Σ_t w[i,t]``.

    ``per_token_loss`` and ``mask`` are ``[B, S]`` (a 1-D input is one sample). Returns ``(s, n)``, both
    ``[B]`` in the loss dtype (counts exact below 2**24 in float32). Masked positions contribute exactly
    0, also when the loss there is Inf/NaN, because they are selected away rather than multiplied.
    """
    check_inputs(per_token_loss, mask, check_finite=False)
    l2 = _as_2d(per_token_loss)
    w2 = _as_2d(mask).astype(per_token_loss.dtype)
    s = jnp.where(w2 > 0, l2, jnp.zeros_like(l2)).sum(axis=-1)
    return s, w2.sum(axis=-1)


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
    default ``S``): slot ``(i, j)`` is the document with segment id ``j + 1`` in row ``i``.

    A document is a distinct non-zero ``(row, segment_id)`` pair (0 = padding, MaxText's
    ``*_segmentation`` convention); ids must lie in ``[0, M]``. Returns ``(s, n, present)`` with
    ``s[i,j] = Σ_{t: seg=j+1} w·l``, ``n[i,j] = Σ_{t: seg=j+1} w`` and ``present[i,j]`` true when the id
    occurs in the row (a document without loss-bearing tokens still exists and counts in ``Ndoc``).
    ``s[present]`` lists the documents in the order of the PyTorch ``document_stats`` (row, then id).
    Eager calls raise on ids outside ``[0, M]`` and on loss-bearing tokens at id 0; under ``jit`` those
    cannot be detected and such tokens belong to no document (they are dropped).
    """
    check_inputs(per_token_loss, mask, segment_ids, num_segments=num_segments, check_finite=False)
    m = resolve_num_segments(segment_ids, num_segments)
    l2 = _as_2d(per_token_loss)
    w2 = _as_2d(mask).astype(per_token_loss.dtype)
    seg = _as_2d(segment_ids)
    contrib = jnp.where(w2 > 0, l2, jnp.zeros_like(l2))
    s = _segment_sum_rows(contrib, seg, m)
    n = _segment_sum_rows(w2, seg, m)
    present = _segment_sum_rows((seg > 0).astype(jnp.int32), seg, m) > 0
    return s, n, present


def document_count(segment_ids: jax.Array, *, num_segments: int | None = None) -> jax.Array:
    """``Ndoc``: the number of distinct non-zero ``(row, segment_id)`` pairs, as an integer array."""
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids must be an integer array, got {segment_ids.dtype}")
    m = resolve_num_segments(segment_ids, num_segments)
    values = concrete(segment_ids)
    if values is not None and values.size and (values.min() < 0 or values.max() > m):
        raise ValueError(
            f"segment_ids must lie in [0, num_segments={m}] (0 = padding), found values in "
            f"[{values.min()}, {values.max()}]; pass a larger num_segments"
        )
    seg = _as_2d(segment_ids)
    present = _segment_sum_rows((seg > 0).astype(jnp.int32), seg, m) > 0
    return present.sum()
