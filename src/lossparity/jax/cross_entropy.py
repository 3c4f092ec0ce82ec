"""Memory-lean output-layer cross-entropy in JAX: per-token losses without materializing ``[T, V]``.

Same semantics as the PyTorch ``lossparity.losses.cross_entropy``. For hidden states ``h [T, H]``,
output weight ``W [V, H]`` and labels ``y [T]``::

    l[t] = lse[t] - z[t, y[t]] + λz · lse[t]²,   z = h @ W.T,   lse[t] = logsumexp_v z[t, v]

and ``l[t] = 0`` where ``y[t] == ignore_index``. A ``jax.custom_vjp`` runs a ``lax.scan`` over chunks
of ``chunk_size`` tokens in the forward (saving only ``h``, ``W``, ``y`` and ``lse``) and another in the
backward, which recomputes each chunk's logits and uses, with ``g[t]`` the incoming gradient and
``P = softmax(z)``::

    dl[t]/dz[t, v] = (1 + 2 λz lse[t]) · P[t, v] - [v == y[t]]
    dh = dz @ W,   dW = Σ_chunks dzᵀ @ h     (dW accumulated in the scan carry)

so the peak extra memory is one ``[chunk, V]`` tile plus ``[V, H]``. A ``[B, S, H]`` input is scanned over
chunks of sequence positions with all ``B`` rows in every tile, which keeps a row-sharded batch sharded.
bf16/fp16/fp32 inputs are computed and accumulated in float32 (``Precision.HIGHEST`` matmuls); float64
inputs in float64 (``jax_enable_x64``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import concrete

__all__ = ["TILE_BYTES", "chunked_cross_entropy", "naive_cross_entropy", "default_chunk_size"]

# One logits tile is about this many bytes (the PyTorch version's choice): large enough for fast
# matmuls, small next to activations.
TILE_BYTES = 32 * 2**20

_HIGHEST = jax.lax.Precision.HIGHEST


def default_chunk_size(vocab_size: int, dtype: jnp.dtype | type = jnp.float32) -> int:
    """Token chunk size whose ``[chunk, vocab_size]`` logits tile of ``dtype`` takes about
    :data:`TILE_BYTES`: ``max(1, TILE_BYTES // (vocab_size · itemsize))`` (64 tokens for ``V = 131072``
    in float32)."""
    return max(1, TILE_BYTES // (max(int(vocab_size), 1) * jnp.dtype(dtype).itemsize))


def _compute_dtype(hidden: jax.Array, weight: jax.Array):
    return jnp.float64 if jnp.float64 in (hidden.dtype, weight.dtype) else jnp.float32


def _check_inputs(hidden, weight, labels, ignore_index: int, chunk_size, z_loss_coeff: float) -> None:
    if not hasattr(hidden, "dtype") or not jnp.issubdtype(hidden.dtype, jnp.floating) or hidden.ndim not in (2, 3):
        raise ValueError(
            f"hidden must be a floating-point [T, H] or [B, S, H] array, got {getattr(hidden, 'dtype', None)} "
            f"of shape {tuple(getattr(hidden, 'shape', ()))}"
        )
    if not hasattr(weight, "dtype") or not jnp.issubdtype(weight.dtype, jnp.floating) or weight.ndim != 2:
        raise ValueError(
            f"weight must be a floating-point [V, H] array, got {getattr(weight, 'dtype', None)} "
            f"of shape {tuple(getattr(weight, 'shape', ()))}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight hidden size {weight.shape[1]} (weight shape {tuple(weight.shape)}) does not match hidden "
            f"size {hidden.shape[-1]} (hidden shape {tuple(hidden.shape)})"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be an integer array, got dtype {getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match the tokens of hidden {tuple(hidden.shape)} "
            f"(expected labels shape {tuple(hidden.shape[:-1])})"
        )
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")
    if isinstance(z_loss_coeff, bool) or not isinstance(z_loss_coeff, (int, float)) or not (
        math.isfinite(z_loss_coeff) and z_loss_coeff >= 0
    ):
        raise ValueError(f"z_loss_coeff must be a finite number >= 0, got {z_loss_coeff!r}")
    y = concrete(labels)
    vocab = weight.shape[0]
    if y is not None:
        bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
                f"labels{list(pos)} = {int(y[pos])}"
            )


def _chunks(x: jax.Array, chunk: int, fill) -> jax.Array:
    """``[T, ...]`` -> ``[ceil(T/chunk), chunk, ...]``, the tail padded with ``fill``."""
    t = x.shape[0]
    pad = -t % chunk
    if pad:
        x = jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)], axis=0)
    return x.reshape((-1, chunk) + x.shape[1:])


# Internally the tokens are laid out as [N, R, H]: the scan runs over chunks of N, and R (the rows of a
# [B, S, H] input, 1 for [T, H]) stays whole in every tile, so a batch sharded over rows stays sharded.


def _forward(hidden, weight, labels, ignore_index: int, chunk: int, z_coeff: float):
    n = hidden.shape[0]
    cdt = _compute_dtype(hidden, weight)
    w = weight.astype(cdt)

    def body(_, xs):
        h, y = xs  # [c, R, H], [c, R]
        z = jnp.einsum("crh,vh->crv", h.astype(cdt), w, precision=_HIGHEST, preferred_element_type=cdt)
        lse = jax.nn.logsumexp(z, axis=-1)
        valid = y != ignore_index
        target = jnp.take_along_axis(z, jnp.where(valid, y, 0)[..., None], axis=-1)[..., 0]
        loss = lse - target
        if z_coeff:
            loss = loss + z_coeff * jnp.square(lse)
        return None, (jnp.where(valid, loss, jnp.zeros_like(loss)), lse)

    _, (loss, lse) = jax.lax.scan(body, None, (_chunks(hidden, chunk, 0), _chunks(labels, chunk, ignore_index)))
    rows = hidden.shape[1]
    return loss.reshape(-1, rows)[:n], lse.reshape(-1, rows)[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_ce(hidden, weight, labels, ignore_index: int, chunk: int, z_coeff: float):
    return _forward(hidden, weight, labels, ignore_index, chunk, z_coeff)[0]


def _chunked_ce_fwd(hidden, weight, labels, ignore_index: int, chunk: int, z_coeff: float):
    loss, lse = _forward(hidden, weight, labels, ignore_index, chunk, z_coeff)
    return loss, (hidden, weight, labels, lse)


def _chunked_ce_bwd(ignore_index: int, chunk: int, z_coeff: float, res, g):
    hidden, weight, labels, lse = res
    n, vocab = hidden.shape[0], weight.shape[0]
    cdt = lse.dtype
    w = weight.astype(cdt)

    def body(grad_w, xs):
        h, y, lse_c, g_c = xs  # [c, R, H], [c, R], [c, R], [c, R]
        h = h.astype(cdt)
        z = jnp.einsum("crh,vh->crv", h, w, precision=_HIGHEST, preferred_element_type=cdt)
        p = jnp.exp(z - lse_c[..., None])
        valid = y != ignore_index
        g_c = jnp.where(valid, g_c.astype(cdt), jnp.zeros_like(lse_c))
        scale = g_c * (1 + 2 * z_coeff * lse_c) if z_coeff else g_c
        dz = p * scale[..., None] - jax.nn.one_hot(jnp.where(valid, y, 0), vocab, dtype=cdt) * g_c[..., None]
        grad_h = jnp.einsum("crv,vh->crh", dz, w, precision=_HIGHEST, preferred_element_type=cdt)
        grad_w = grad_w + jnp.einsum("crv,crh->vh", dz, h, precision=_HIGHEST, preferred_element_type=cdt)
        return grad_w, grad_h

    xs = (
        _chunks(hidden, chunk, 0),
        _chunks(labels, chunk, ignore_index),
        _chunks(lse, chunk, 0),
        _chunks(g, chunk, 0),
    )
    grad_w, grad_h = jax.lax.scan(body, jnp.zeros(w.shape, cdt), xs)
    grad_h = grad_h.reshape((-1,) + hidden.shape[1:])[:n].astype(hidden.dtype)
    return grad_h, grad_w.astype(weight.dtype), None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def chunked_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    z_loss_coeff: float = 0.0,
) -> jax.Array:
    """Per-token cross-entropy of the output layer, ``l[t] = lse(z[t]) - z[t, y[t]] + z_loss_coeff ·
    lse(z[t])²`` with ``z = hidden @ weight.T``, and ``l[t] = 0`` where ``labels[t] == ignore_index``,
    never materializing the ``[T, V]`` logits (forward or backward, see the module docstring).

    ``hidden`` is ``[T, H]`` with ``labels [T]`` (returns ``[T]``) or ``[B, S, H]`` with ``labels [B, S]``
    (returns ``[B, S]``); ``weight`` is ``[V, H]``. A tile holds about ``chunk_size`` tokens (default
    :func:`default_chunk_size`); for ``[B, S, H]`` a tile is ``max(1, chunk_size // B)`` positions of every
    row, so a batch sharded over rows stays sharded inside the scan. ``jit``-able (``ignore_index``,
    ``chunk_size``, ``z_loss_coeff`` are static) and differentiable w.r.t. ``hidden`` and ``weight``.
    Losses are float32 (float64 if an input is float64); gradients have their input's dtype. Labels
    outside ``[0, V)`` raise on concrete inputs.
    """
    _check_inputs(hidden, weight, labels, ignore_index, chunk_size, z_loss_coeff)
    cdt = _compute_dtype(hidden, weight)
    if labels.size == 0:
        return jnp.zeros(labels.shape, cdt)
    tokens = chunk_size or default_chunk_size(weight.shape[0], cdt)
    if hidden.ndim == 2:
        h, y = hidden[:, None, :], labels[:, None]
    else:
        h, y = jnp.swapaxes(hidden, 0, 1), jnp.swapaxes(labels, 0, 1)  # [S, B, H]: scan over positions
    chunk = min(max(1, tokens // h.shape[1]), h.shape[0])
    loss = _chunked_ce(h, weight, y, int(ignore_index), int(chunk), float(z_loss_coeff))
    return loss[:, 0] if hidden.ndim == 2 else jnp.swapaxes(loss, 0, 1)


def naive_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int = -100,
    z_loss_coeff: float = 0.0,
) -> jax.Array:
    """Reference per-token cross-entropy that materializes the ``[T, V]`` logits (same shapes, dtypes and
    semantics as :func:`chunked_cross_entropy`); differentiated by plain autodiff. For benchmarks."""
    _check_inputs(hidden, weight, labels, ignore_index, None, z_loss_coeff)
    cdt = _compute_dtype(hidden, weight)
    z = jnp.einsum("...h,vh->...v", hidden.astype(cdt), weight.astype(cdt), precision=_HIGHEST)
    lse = jax.nn.logsumexp(z, axis=-1)
    valid = labels != ignore_index
    target = jnp.take_along_axis(z, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    loss = lse - target + (z_loss_coeff * jnp.square(lse) if z_loss_coeff else 0)
    return jnp.where(valid, loss, jnp.zeros_like(loss))
