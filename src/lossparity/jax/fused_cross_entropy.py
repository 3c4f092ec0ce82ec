"""Fused linear cross-entropy in JAX: the weighted output-layer loss with its gradients formed in the forward.

Same semantics as the PyTorch ``lossparity.losses.fused_cross_entropy``. For hidden states ``h [T, H]``,
output weight ``W [V, H]``, labels ``y [T]`` and per-token objective weights ``w [T]``::

    J = Σ_t w[t]·l[t],   l[t] = lse[t] - z[t, y[t]] + λz · lse[t]²,   z = h @ W.T

(``l[t] = 0`` where ``y[t] == ignore_index``). A ``jax.custom_vjp`` whose forward runs one ``lax.scan``
over chunks of tokens: per chunk the logits ``z``, ``P = softmax(z)``, ``dz = s·P - w·onehot(y)``
with ``s = w·(1 + 2 λz lse)``, then ``∂J/∂h = dz @ W`` and ``∂J/∂W += dzᵀ @ h`` (accumulated in the scan
carry): 3 matmuls per chunk and no recompute; the residuals are the two gradients and the backward
multiplies them by the incoming cotangent of ``J`` (the cotangent of ``w`` is ``l``). The per-token
losses are returned under ``stop_gradient``. Peak extra memory: one ``[chunk, V]`` tile plus
``[V, H]`` and ``[T, H]``. bf16/fp16/fp32 inputs are computed in float32, float64 inputs in float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .cross_entropy import _check_inputs, _chunks, _compute_dtype, default_chunk_size

__all__ = ["fused_linear_cross_entropy"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _forward(hidden, weight, labels, weights, ignore_index: int, chunk: int, z_coeff: float):
    n, vocab = hidden.shape[0], weight.shape[0]
    cdt = _compute_dtype(hidden, weight)
    w = weight.astype(cdt)

    def body(grad_w, xs):
        h, y, wt = xs  # [c, H], [c], [c]
        h = h.astype(cdt)
        z = jnp.einsum("ch,vh->cv", h, w, precision=_HIGHEST, preferred_element_type=cdt)
        lse = jax.nn.logsumexp(z, axis=-1)
        valid = y != ignore_index
        y0 = jnp.where(valid, y, 0)
        loss = lse - jnp.take_along_axis(z, y0[:, None], axis=-1)[:, 0]
        if z_coeff:
            loss = loss + z_coeff * jnp.square(lse)
        wt = jnp.where(valid, wt.astype(cdt), jnp.zeros_like(lse))
        scale = wt * (1 + 2 * z_coeff * lse) if z_coeff else wt
        dz = jnp.exp(z - lse[:, None]) * scale[:, None] - jax.nn.one_hot(y0, vocab, dtype=cdt) * wt[:, None]
        grad_h = jnp.einsum("cv,vh->ch", dz, w, precision=_HIGHEST, preferred_element_type=cdt)
        grad_w = grad_w + jnp.einsum("cv,ch->vh", dz, h, precision=_HIGHEST, preferred_element_type=cdt)
        return grad_w, (jnp.where(valid, loss, jnp.zeros_like(loss)), grad_h)

    xs = (_chunks(hidden, chunk, 0), _chunks(labels, chunk, ignore_index), _chunks(weights, chunk, 0))
    grad_w, (loss, grad_h) = jax.lax.scan(body, jnp.zeros(w.shape, cdt), xs)
    loss = loss.reshape(-1)[:n]
    total = (weights.astype(cdt) * loss).sum()
    grad_h = grad_h.reshape(-1, hidden.shape[1])[:n].astype(hidden.dtype)
    return (total, loss), (grad_h, grad_w.astype(weight.dtype), loss)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(hidden, weight, labels, weights, ignore_index: int, chunk: int, z_coeff: float):
    return _forward(hidden, weight, labels, weights, ignore_index, chunk, z_coeff)[0]


def _fused_fwd(hidden, weight, labels, weights, ignore_index: int, chunk: int, z_coeff: float):
    out, (grad_h, grad_w, loss) = _forward(hidden, weight, labels, weights, ignore_index, chunk, z_coeff)
    return out, (grad_h, grad_w, loss.astype(weights.dtype))


def _fused_bwd(ignore_index: int, chunk: int, z_coeff: float, res, cts):
    grad_h, grad_w, loss = res
    g = cts[0]  # the per-token losses are under stop_gradient outside: their cotangent is ignored
    return (g.astype(grad_h.dtype) * grad_h, g.astype(grad_w.dtype) * grad_w, None, g.astype(loss.dtype) * loss)


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    token_weights: jax.Array,
    *,
    ignore_index: int = -100,
    z_loss_coeff: float = 0.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(J, l)`` with ``J = Σ_t w[t]·l[t]``, ``l[t] = lse(z[t]) - z[t, y[t]] + z_loss_coeff · lse(z[t])²``,
    ``z = hidden @ weight.T``, ``l[t] = 0`` where ``labels[t] == ignore_index``; the gradients of ``J``
    w.r.t. ``hidden`` and ``weight`` are formed in the forward scan (module docstring) and ``l`` is under
    ``stop_gradient``. ``hidden`` is ``[T, H]`` or ``[B, S, H]`` (flattened to tokens), ``labels`` and
    ``token_weights`` have its leading shape, ``weight`` is ``[V, H]``. Chunks of ``chunk_size`` tokens
    (default :func:`~lossparity.jax.cross_entropy.default_chunk_size`). ``jit``-able (``ignore_index``,
    ``chunk_size``, ``z_loss_coeff`` static). ``J`` and ``l`` are float32 (float64 if an input is
    float64); gradients have their input's dtype."""
    _check_inputs(hidden, weight, labels, ignore_index, chunk_size, z_loss_coeff)
    if not hasattr(token_weights, "dtype") or not jnp.issubdtype(token_weights.dtype, jnp.floating):
        raise TypeError(f"token_weights must be a floating-point array, got "
                        f"{getattr(token_weights, 'dtype', type(token_weights).__name__)}")
    if tuple(token_weights.shape) != tuple(labels.shape):
        raise ValueError(f"token_weights shape {tuple(token_weights.shape)} does not match labels shape "
                         f"{tuple(labels.shape)}")
    cdt = _compute_dtype(hidden, weight)
    if labels.size == 0:
        return jnp.zeros((), cdt), jnp.zeros(labels.shape, cdt)
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk = min(chunk_size or default_chunk_size(weight.shape[0], cdt), h.shape[0])
    total, loss = _fused(h, weight, y, token_weights.reshape(-1).astype(cdt), int(ignore_index), int(chunk),
                         float(z_loss_coeff))
    return total, jax.lax.stop_gradient(loss).reshape(labels.shape)
