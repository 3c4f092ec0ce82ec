"""Memory-lean output-layer cross-entropy in JAX: per-token losses without materializing ``[T, V]``.

Same semantics as the PyTorch ``lossparity.losses.cross_entropy``. For hidden states ``h [T, H]``,
output weight ``W [V, H]`` and labels ``y [T]``::

    l[t] = lse[t] - z[t, y[t]] + λz · lse[t]²,   z = h @ W.T,   lse[t] = logsumexp_v z[t, v]

and ``l[t] = 0`` where ``y[t] == ignore_index``. The logits are formed in tiles of ``chunk_size``
tokens × ``vocab_chunk_size`` vocabulary rows (``lax.scan`` over token chunks, and inside it over
vocabulary tiles). The forward keeps an online logsumexp across the vocabulary tiles (running max ``m``
and running sum ``Σ exp(z - m)``, rescaled by ``exp(m_old - m_new)`` when the max grows) and picks the
target logit from the tile that holds it. With ``g[t]`` the per-token weight of the gradient and
``P = softmax(z)``::

    dl[t]/dz[t, v] = (1 + 2 λz lse[t]) · P[t, v] - [v == y[t]]
    dh = Σ_tiles dz @ W_tile,   dW_tile = Σ_chunks dzᵀ @ h

Two ways to get the gradients:

- :func:`chunked_cross_entropy` (``custom_vjp``): the forward saves only ``h``, ``W``, ``y``, ``lse``; the
  backward recomputes each tile's logits (4 ``T·V·H`` matmuls in all) for any incoming per-token
  gradient.
- :func:`fused_linear_cross_entropy`: the gradients of ``Σ_t w_t l_t`` for given per-token weights
  ``w_t`` are formed tile by tile during the forward (a second pass over the vocabulary tiles once
  ``lse`` is known, or the same pass when one tile holds the whole vocabulary) and the backward only
  scales them by the incoming scalar. Exact for every mode, whose objective is such a weighted sum.

Peak extra memory: one ``[chunk, vocab_chunk]`` tile plus ``[V, H]`` (the weight gradient). A
``[B, S, H]`` input is scanned over chunks of positions with all ``B`` rows in every tile, which keeps a
row-sharded batch sharded. bf16/fp16/fp32 inputs are computed in float32 (``Precision.HIGHEST``
matmuls), float64 inputs in float64 (``jax_enable_x64``). Labels outside ``[0, V)`` raise eagerly and
under ``checked``; in an unchecked traced program they make the losses NaN.
"""

from __future__ import annotations

import functools
import math
from numbers import Real

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import _TRACER, poison, value_check

__all__ = [
    "TILE_ELEMS",
    "TILE_VOCAB",
    "default_tiling",
    "chunked_cross_entropy",
    "fused_linear_cross_entropy",
    "naive_cross_entropy",
]

# A logits tile holds about TILE_ELEMS values (32 MiB in float32), at most TILE_VOCAB vocabulary rows
# wide: the PyTorch version's choice (near-square tiles keep the matmuls at full speed on a CPU; any tile
# of this size saturates a GPU's).
TILE_ELEMS = 8 * 2**20
TILE_VOCAB = 8192

_HIGHEST = jax.lax.Precision.HIGHEST


def default_tiling(
    vocab_size: int, chunk_size: int | None = None, vocab_chunk_size: int | None = None
) -> tuple[int, int]:
    """``(chunk_size, vocab_chunk_size)`` of a tile, as the PyTorch ``default_tiling``: a given value is
    kept (the vocabulary tile capped at ``V``); with neither given ``vocab_chunk = min(V, 8192)`` and
    ``chunk = TILE_ELEMS // vocab_chunk``; with one given the other is ``max(1, TILE_ELEMS // given)``."""
    if vocab_chunk_size is None:
        vocab_chunk_size = TILE_VOCAB if chunk_size is None else max(1, TILE_ELEMS // chunk_size)
    vocab_chunk_size = min(vocab_chunk_size, int(vocab_size))
    if chunk_size is None:
        chunk_size = max(1, TILE_ELEMS // vocab_chunk_size)
    return chunk_size, vocab_chunk_size


def _compute_dtype(hidden: jax.Array, weight: jax.Array):
    return jnp.float64 if jnp.float64 in (hidden.dtype, weight.dtype) else jnp.float32


def _z_coeff(z_loss_coeff: object) -> float:
    """``z_loss_coeff`` as a Python float: a static option, so a Python, NumPy or concrete JAX scalar."""
    if isinstance(z_loss_coeff, _TRACER):
        raise TypeError(
            "z_loss_coeff must be a concrete number (a static option of the compiled program), got a traced "
            "value; pass a Python float or close over it instead of passing it through jit"
        )
    arr = np.asarray(z_loss_coeff) if isinstance(z_loss_coeff, (Real, np.generic, jax.Array)) else None
    if arr is None or arr.shape != () or arr.dtype.kind not in "fiu":
        raise ValueError(f"z_loss_coeff must be a finite number >= 0, got {z_loss_coeff!r}")
    value = float(arr)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"z_loss_coeff must be a finite number >= 0, got {z_loss_coeff!r}")
    return value


def _check_size(name: str, value: object, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive number of {what}, got {value!r}")


def _check_inputs(hidden, weight, labels, chunk_size, vocab_chunk_size) -> None:
    """Static checks of shapes, dtypes and tile sizes (values: :func:`_label_check`)."""
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
    _check_size("chunk_size", chunk_size, "tokens")
    _check_size("vocab_chunk_size", vocab_chunk_size, "vocabulary rows")


def _label_check(labels, ignore_index: int, vocab: int) -> jax.Array | None:
    return value_check(
        ValueError,
        f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}, found {{}}",
        lambda xp, y: (y != ignore_index) & ((y < 0) | (y >= vocab)),
        (labels,),
    )


# ---- tiles --------------------------------------------------------------------------------------------
# Tokens are laid out as [N, R, H]: the scan runs over chunks of N, and R (the rows of a [B, S, H] input,
# 1 for [T, H]) stays whole in every tile, so that a batch sharded over rows stays sharded.


def _chunks(x: jax.Array, chunk: int, fill) -> jax.Array:
    """``[T, ...]`` -> ``[ceil(T/chunk), chunk, ...]``, the tail padded with ``fill``."""
    pad = -x.shape[0] % chunk
    if pad:
        x = jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)], axis=0)
    return x.reshape((-1, chunk) + x.shape[1:])


def _vocab_tiles(weight: jax.Array, vchunk: int, cdt) -> jax.Array:
    """``W [V, H]`` -> ``[nv, vchunk, H]`` in the compute dtype; padded rows are masked in :func:`_logits`."""
    return _chunks(weight.astype(cdt), vchunk, 0)


def _logits(h: jax.Array, w_tile: jax.Array, v0, vocab: int) -> jax.Array:
    """One ``[c, R, vchunk]`` tile of ``z = h @ W.T``; columns past ``V`` (padding) are ``-inf``."""
    z = jnp.einsum("crh,vh->crv", h, w_tile, precision=_HIGHEST, preferred_element_type=h.dtype)
    cols = v0 + jnp.arange(w_tile.shape[0])
    return jnp.where(cols < vocab, z, -jnp.inf)


def _lse_step(carry, z, y, v0, vchunk: int):
    """One vocabulary tile of the online logsumexp: ``(run_max, run_sum, target)`` updated by ``z``."""
    run_max, run_sum, target = carry
    local = y - v0
    hit = (local >= 0) & (local < vchunk)
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, vchunk - 1)[..., None], axis=-1)[..., 0]
    new_max = jnp.maximum(run_max, z.max(axis=-1))
    # rescale the running sum to the new max (exp(-inf) = 0 on the first tile)
    run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.exp(z - new_max[..., None]).sum(axis=-1)
    return new_max, run_sum, target + jnp.where(hit, picked, 0)


def _online_lse(h: jax.Array, y: jax.Array, w_tiles: jax.Array, vocab: int):
    """``(lse, z[y])`` of one token chunk, scanning the vocabulary tiles with a running max and sum."""
    vchunk = w_tiles.shape[1]
    zero = jnp.zeros(y.shape, h.dtype)
    init = (zero - jnp.inf, zero, zero)
    if w_tiles.shape[0] == 1:  # one tile: no inner loop (a simpler program to compile)
        run_max, run_sum, target = _lse_step(init, _logits(h, w_tiles[0], 0, vocab), y, 0, vchunk)
        return run_max + jnp.log(run_sum), target

    def body(carry, xs):
        w_tile, v0 = xs
        return _lse_step(carry, _logits(h, w_tile, v0, vocab), y, v0, vchunk), None

    starts = jnp.arange(w_tiles.shape[0]) * vchunk
    (run_max, run_sum, target), _ = jax.lax.scan(body, init, (w_tiles, starts))
    return run_max + jnp.log(run_sum), target


def _dz_grads(h, z, y, lse, scale, gy, w_tile, v0):
    """``(dh, dW_tile)`` of one tile from its logits: ``dz = P·scale - [v == y]·gy``, ``P = exp(z - lse)``."""
    p = jnp.exp(z - lse[..., None])
    cols = v0 + jnp.arange(w_tile.shape[0])
    dz = p * scale[..., None] - jnp.where(cols == y[..., None], gy[..., None], 0)
    grad_h = jnp.einsum("crv,vh->crh", dz, w_tile, precision=_HIGHEST, preferred_element_type=h.dtype)
    return grad_h, jnp.einsum("crv,crh->vh", dz, h, precision=_HIGHEST, preferred_element_type=h.dtype)


def _tile_grads(h, y, lse, scale, gy, w_tiles, grad_w, vocab: int):
    """Gradients of one token chunk over all vocabulary tiles; returns ``(dh [c, R, H], grad_w + dW)``
    with ``grad_w`` tiled like ``w_tiles``."""
    vchunk = w_tiles.shape[1]
    if w_tiles.shape[0] == 1:
        grad_h, dw = _dz_grads(h, _logits(h, w_tiles[0], 0, vocab), y, lse, scale, gy, w_tiles[0], 0)
        return grad_h, grad_w + dw[None]

    def body(carry, xs):
        grad_h, grad_w = carry
        w_tile, v0, i = xs
        dh, dw = _dz_grads(h, _logits(h, w_tile, v0, vocab), y, lse, scale, gy, w_tile, v0)
        return (grad_h + dh, grad_w.at[i].add(dw)), None

    nv = w_tiles.shape[0]
    xs = (w_tiles, jnp.arange(nv) * vchunk, jnp.arange(nv))
    (grad_h, grad_w), _ = jax.lax.scan(body, (jnp.zeros(h.shape, h.dtype), grad_w), xs)
    return grad_h, grad_w


def _token_loss(lse, target, valid, z_coeff: float):
    loss = lse - target + (z_coeff * jnp.square(lse) if z_coeff else 0)
    return jnp.where(valid, loss, jnp.zeros_like(loss))


# ---- chunked (custom_vjp with recompute) ---------------------------------------------------------------


def _forward(hidden, weight, labels, ignore_index: int, chunk: int, vchunk: int, z_coeff: float):
    n, vocab = hidden.shape[0], weight.shape[0]
    cdt = _compute_dtype(hidden, weight)
    w_tiles = _vocab_tiles(weight, vchunk, cdt)

    def body(_, xs):
        h, y = xs  # [c, R, H], [c, R]
        lse, target = _online_lse(h.astype(cdt), y, w_tiles, vocab)
        return None, (_token_loss(lse, target, y != ignore_index, z_coeff), lse)

    _, (loss, lse) = jax.lax.scan(body, None, (_chunks(hidden, chunk, 0), _chunks(labels, chunk, ignore_index)))
    rows = hidden.shape[1]
    return loss.reshape(-1, rows)[:n], lse.reshape(-1, rows)[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_ce(hidden, weight, labels, ignore_index: int, chunk: int, vchunk: int, z_coeff: float):
    return _forward(hidden, weight, labels, ignore_index, chunk, vchunk, z_coeff)[0]


def _chunked_ce_fwd(hidden, weight, labels, ignore_index: int, chunk: int, vchunk: int, z_coeff: float):
    loss, lse = _forward(hidden, weight, labels, ignore_index, chunk, vchunk, z_coeff)
    return loss, (hidden, weight, labels, lse)


def _chunked_ce_bwd(ignore_index: int, chunk: int, vchunk: int, z_coeff: float, res, g):
    hidden, weight, labels, lse = res
    n, vocab = hidden.shape[0], weight.shape[0]
    cdt = lse.dtype
    w_tiles = _vocab_tiles(weight, vchunk, cdt)

    def body(grad_w, xs):
        h, y, lse_c, g_c = xs  # [c, R, H], [c, R], [c, R], [c, R]
        g_c = jnp.where(y != ignore_index, g_c.astype(cdt), jnp.zeros_like(lse_c))
        scale = g_c * (1 + 2 * z_coeff * lse_c) if z_coeff else g_c
        return _tile_grads(h.astype(cdt), y, lse_c, scale, g_c, w_tiles, grad_w, vocab)[::-1]

    xs = (_chunks(hidden, chunk, 0), _chunks(labels, chunk, ignore_index), _chunks(lse, chunk, 0), _chunks(g, chunk, 0))
    grad_w, grad_h = jax.lax.scan(body, jnp.zeros(w_tiles.shape, cdt), xs)
    grad_h = grad_h.reshape((-1,) + hidden.shape[1:])[:n].astype(hidden.dtype)
    grad_w = grad_w.reshape(-1, weight.shape[1])[:vocab].astype(weight.dtype)
    return grad_h, grad_w, None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def _layout(hidden: jax.Array, labels: jax.Array, chunk_size: int):
    """``[T, H]`` -> ``[T, 1, H]``; ``[B, S, H]`` -> ``[S, B, H]`` (scan over positions), and the chunk
    of positions holding about ``chunk_size`` tokens."""
    if hidden.ndim == 2:
        h, y = hidden[:, None, :], labels[:, None]
    else:
        h, y = jnp.swapaxes(hidden, 0, 1), jnp.swapaxes(labels, 0, 1)
    return h, y, min(max(1, chunk_size // h.shape[1]), h.shape[0])


def _unlayout(x: jax.Array, ndim: int) -> jax.Array:
    return x[:, 0] if ndim == 2 else jnp.swapaxes(x, 0, 1)


def chunked_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    z_loss_coeff: float = 0.0,
    vocab_chunk_size: int | None = None,
) -> jax.Array:
    """Per-token cross-entropy of the output layer, ``l[t] = lse(z[t]) - z[t, y[t]] + z_loss_coeff ·
    lse(z[t])²`` with ``z = hidden @ weight.T``, and ``l[t] = 0`` where ``labels[t] == ignore_index``,
    never materializing the ``[T, V]`` logits (forward or backward, see the module docstring).

    ``hidden`` is ``[T, H]`` with ``labels [T]`` (returns ``[T]``) or ``[B, S, H]`` with ``labels [B, S]``
    (returns ``[B, S]``); ``weight`` is ``[V, H]``. Tiles of ``chunk_size`` tokens × ``vocab_chunk_size``
    vocabulary rows (:func:`default_tiling`; ``vocab_chunk_size >= V`` tiles tokens only); for
    ``[B, S, H]`` a tile is ``max(1, chunk_size // B)`` positions of every row. ``jit``-able (the options
    are static; ``z_loss_coeff`` may be a Python, NumPy or concrete JAX scalar) and differentiable w.r.t.
    ``hidden`` and ``weight`` for any incoming per-token gradient. Losses are float32 (float64 if an
    input is float64); gradients have their input's dtype.
    """
    z_coeff = _z_coeff(z_loss_coeff)
    _check_inputs(hidden, weight, labels, chunk_size, vocab_chunk_size)
    bad = _label_check(labels, ignore_index, weight.shape[0])
    cdt = _compute_dtype(hidden, weight)
    if labels.size == 0:
        return jnp.zeros(labels.shape, cdt)
    tokens, vchunk = default_tiling(weight.shape[0], chunk_size, vocab_chunk_size)
    h, y, chunk = _layout(hidden, labels, tokens)
    loss = _chunked_ce(h, weight, y, int(ignore_index), int(chunk), int(vchunk), z_coeff)
    return poison(_unlayout(loss, hidden.ndim), bad)


# ---- fused (gradients formed in the forward) ------------------------------------------------------------


def _fused_forward(hidden, weight, labels, token_weights, ignore_index: int, chunk: int, vchunk: int, z_coeff: float):
    """Per-token losses, ``Σ_t w_t l_t`` and its gradients w.r.t. ``hidden`` and ``weight``."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cdt = _compute_dtype(hidden, weight)
    w_tiles = _vocab_tiles(weight, vchunk, cdt)

    def body(grad_w, xs):
        h, y, tw = xs  # [c, R, H], [c, R], [c, R]
        h = h.astype(cdt)
        valid = y != ignore_index
        z = None
        if w_tiles.shape[0] == 1:  # one vocabulary tile: its logits serve the loss and the gradients
            z = _logits(h, w_tiles[0], 0, vocab)
            zero = jnp.zeros(y.shape, cdt)
            run_max, run_sum, target = _lse_step((zero - jnp.inf, zero, zero), z, y, 0, w_tiles.shape[1])
            lse = run_max + jnp.log(run_sum)
        else:
            lse, target = _online_lse(h, y, w_tiles, vocab)
        tw = jnp.where(valid, tw.astype(cdt), jnp.zeros_like(lse))
        scale = tw * (1 + 2 * z_coeff * lse) if z_coeff else tw
        if z is None:
            grad_h, grad_w = _tile_grads(h, y, lse, scale, tw, w_tiles, grad_w, vocab)
        else:
            grad_h, dw = _dz_grads(h, z, y, lse, scale, tw, w_tiles[0], 0)
            grad_w = grad_w + dw[None]
        return grad_w, (_token_loss(lse, target, valid, z_coeff), grad_h)

    xs = (_chunks(hidden, chunk, 0), _chunks(labels, chunk, ignore_index), _chunks(token_weights, chunk, 0))
    grad_w, (loss, grad_h) = jax.lax.scan(body, jnp.zeros(w_tiles.shape, cdt), xs)
    loss = loss.reshape(-1, hidden.shape[1])[:n]
    grad_h = grad_h.reshape((-1,) + hidden.shape[1:])[:n]
    total = jnp.sum(jnp.where(labels != ignore_index, token_weights.astype(cdt) * loss, 0))
    return total, loss, grad_h, grad_w.reshape(-1, weight.shape[1])[:vocab]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused_ce(hidden, weight, labels, token_weights, ignore_index: int, chunk: int, vchunk: int, z_coeff: float):
    total, loss, _, _ = _fused_forward(hidden, weight, labels, token_weights, ignore_index, chunk, vchunk, z_coeff)
    return total, loss


def _fused_ce_fwd(hidden, weight, labels, token_weights, ignore_index: int, chunk: int, vchunk: int, z_coeff: float):
    total, loss, grad_h, grad_w = _fused_forward(
        hidden, weight, labels, token_weights, ignore_index, chunk, vchunk, z_coeff
    )
    tw_like = jnp.zeros((), token_weights.dtype)  # carries the dtype of the token-weight cotangent
    return (total, loss), (grad_h.astype(hidden.dtype), grad_w.astype(weight.dtype), loss, tw_like)


def _fused_ce_bwd(ignore_index: int, chunk: int, vchunk: int, z_coeff: float, res, cotangents):
    grad_h, grad_w, loss, tw_like = res
    g_total, _ = cotangents  # per_token_loss is returned detached (stop_gradient outside): its cotangent is 0
    grad_tw = (g_total * loss).astype(tw_like.dtype)  # d(Σ w_t l_t)/d w_t = l_t (0 at ignored tokens)
    return (g_total.astype(grad_h.dtype) * grad_h, g_total.astype(grad_w.dtype) * grad_w, None, grad_tw)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def fused_linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    token_weights: jax.Array,
    *,
    ignore_index: int = -100,
    z_loss_coeff: float = 0.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(Σ_t w_t · l_t, l)``: the weighted loss sum and the per-token losses of
    :func:`chunked_cross_entropy` (same shapes, tiling, dtypes, z-loss and ``ignore_index`` rules),
    with the gradients of the sum w.r.t. ``hidden`` and ``weight`` formed tile by tile during the
    forward; the backward multiplies them by the incoming scalar (no recompute of the logits).

    ``token_weights`` (``w_t``, shape of ``labels``, floating) carries the mode, e.g. ``1/max(Ntok,1)``
    at loss-bearing tokens for ``per_token`` or ``1/(N·max(n_i,1))`` for ``per_sample``; ignored tokens
    contribute 0 whatever their weight. ``l`` is returned under ``stop_gradient`` (differentiate the
    sum, not ``l``); the gradient w.r.t. ``token_weights`` is ``l``. The gradients are computed for the
    sum as a whole, so the forward costs them even when only ``l`` is used: call
    :func:`chunked_cross_entropy` when no gradient is needed.
    """
    z_coeff = _z_coeff(z_loss_coeff)
    _check_inputs(hidden, weight, labels, chunk_size, vocab_chunk_size)
    if (
        not hasattr(token_weights, "dtype")
        or not jnp.issubdtype(token_weights.dtype, jnp.floating)
        or tuple(token_weights.shape) != tuple(labels.shape)
    ):
        raise ValueError(
            f"token_weights must be a floating-point array of the labels' shape {tuple(labels.shape)}, got "
            f"{getattr(token_weights, 'dtype', type(token_weights).__name__)} of shape "
            f"{tuple(getattr(token_weights, 'shape', ()))}"
        )
    bad = _label_check(labels, ignore_index, weight.shape[0])
    cdt = _compute_dtype(hidden, weight)
    if labels.size == 0:
        return jnp.zeros((), cdt), jnp.zeros(labels.shape, cdt)
    tokens, vchunk = default_tiling(weight.shape[0], chunk_size, vocab_chunk_size)
    h, y, chunk = _layout(hidden, labels, tokens)
    tw = token_weights[:, None] if hidden.ndim == 2 else jnp.swapaxes(token_weights, 0, 1)
    total, loss = _fused_ce(h, weight, y, tw, int(ignore_index), int(chunk), int(vchunk), z_coeff)
    return poison(total, bad), jax.lax.stop_gradient(poison(_unlayout(loss, hidden.ndim), bad))


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
    z_coeff = _z_coeff(z_loss_coeff)
    _check_inputs(hidden, weight, labels, None, None)
    bad = _label_check(labels, ignore_index, weight.shape[0])
    cdt = _compute_dtype(hidden, weight)
    z = jnp.einsum("...h,vh->...v", hidden.astype(cdt), weight.astype(cdt), precision=_HIGHEST)
    lse = jax.nn.logsumexp(z, axis=-1)
    valid = labels != ignore_index
    target = jnp.take_along_axis(z, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return poison(_token_loss(lse, target, valid, z_coeff), bad)
