"""JAX fused linear cross-entropy (custom_vjp, gradients in the forward) against a naive float64 formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from lossparity.jax import fused_linear_cross_entropy

T, H, V = 37, 16, 29  # T not a multiple of the chunk sizes below


def _inputs(seed: int, dtype):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(T, H)).astype(dtype)
    weight = (rng.normal(size=(V, H)) / 2).astype(dtype)
    labels = rng.integers(0, V, size=T)
    labels[[0, 5, 6, 36]] = -100
    weights = (rng.normal(size=T) * np.linspace(0.1, 10, T)).astype(dtype)  # ragged, signed
    return hidden, weight, labels, weights


def _naive_torch(h, w, y, wt, z_coeff, upstream):
    """float64 autograd of ``upstream · Σ w·l`` with full logits; returns (J, l, dJ/dh, dJ/dW, dJ/dw)."""
    th = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    twt = torch.tensor(wt, dtype=torch.float64, requires_grad=True)
    z = th @ tw.T
    lse = torch.logsumexp(z, -1)
    valid = torch.tensor(y != -100)
    target = z.gather(1, torch.tensor(np.where(y != -100, y, 0)).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - target + z_coeff * lse**2, 0.0)
    total = (loss * twt).sum()
    (upstream * total).backward()
    return [x.detach().numpy() for x in (total, loss, th.grad, tw.grad, twt.grad)]


# (dtype, rtol, z-loss, chunk): a ragged last chunk, one-token chunks, the default chunk (one here)
CASES = [
    (np.float64, 1e-12, 0.0, 8),
    (np.float64, 1e-12, 1e-2, 1),
    (np.float64, 1e-12, 1e-2, None),
    (np.float32, 2e-6, 1e-2, 8),
]


@pytest.mark.parametrize("dtype,rtol,z_coeff,chunk", CASES)
def test_values_and_grads_match_naive(dtype, rtol, z_coeff, chunk):
    h, w, y, wt = _inputs(0, dtype)
    want = _naive_torch(h, w, y, wt, z_coeff, upstream=2.5)

    def f(hh, ww, wwt):
        total, loss = fused_linear_cross_entropy(hh, ww, jnp.asarray(y), wwt, chunk_size=chunk, z_loss_coeff=z_coeff)
        return 2.5 * total, (total, loss)

    grads, (total, loss) = jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(
        jnp.asarray(h), jnp.asarray(w), jnp.asarray(wt)
    )
    assert loss.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == dtype
    assert (np.asarray(loss)[y == -100] == 0).all()
    for got, ref in zip((total, loss, *grads), want):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=rtol, atol=rtol * np.abs(ref).max())


def test_batched_shape_and_per_token_loss_is_not_differentiated():
    h, w, y, wt = _inputs(1, np.float64)
    hb, yb, wtb = h[:36].reshape(4, 9, H), y[:36].reshape(4, 9), wt[:36].reshape(4, 9)
    want = _naive_torch(h[:36], w, y[:36], wt[:36], 0.0, upstream=1.0)
    total, loss = fused_linear_cross_entropy(
        jnp.asarray(hb), jnp.asarray(w), jnp.asarray(yb), jnp.asarray(wtb), chunk_size=5
    )
    assert loss.shape == (4, 9)
    np.testing.assert_allclose(np.asarray(loss).reshape(-1), want[1], rtol=1e-12, atol=1e-12)
    # the per-token losses are under stop_gradient: only J carries gradients
    g = jax.grad(lambda hh: fused_linear_cross_entropy(hh, jnp.asarray(w), jnp.asarray(yb), jnp.asarray(wtb))[1].sum())
    assert not np.asarray(g(jnp.asarray(hb))).any()


def test_bad_token_weights_named():
    h, w, y, wt = _inputs(2, np.float64)
    with pytest.raises(ValueError, match=r"token_weights.*shape \(37,\).*\(5,\)"):
        fused_linear_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), jnp.asarray(wt[:5]))
    with pytest.raises((TypeError, ValueError), match="token_weights must be a floating"):
        fused_linear_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), jnp.asarray(y))
