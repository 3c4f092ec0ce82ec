"""JAX chunked cross-entropy (custom_vjp) against a naive float64 formula and the PyTorch version."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from lossparity.jax import chunked_cross_entropy
from lossparity.losses.cross_entropy import chunked_cross_entropy as torch_chunked

T, H, V = 37, 16, 29  # T not a multiple of the chunk sizes below


def _inputs(seed: int, dtype):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(T, H)).astype(dtype)
    weight = (rng.normal(size=(V, H)) / 2).astype(dtype)
    labels = rng.integers(0, V, size=T)
    labels[[0, 5, 6, 36]] = -100
    upstream = rng.normal(size=T).astype(dtype)
    return hidden, weight, labels, upstream


def _naive_torch(h, w, y, g, z_coeff):
    """float64 reference with full logits: ``l = lse - z[y] + λz lse²``, 0 at ignored; autograd grads."""
    th = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    z = th @ tw.T
    lse = torch.logsumexp(z, -1)
    valid = torch.tensor(y != -100)
    target = z.gather(1, torch.tensor(np.where(y != -100, y, 0)).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - target + z_coeff * lse**2, 0.0)
    (loss * torch.tensor(g, dtype=torch.float64)).sum().backward()
    return loss.detach().numpy(), th.grad.numpy(), tw.grad.numpy()


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-6)])
@pytest.mark.parametrize("z_coeff", [0.0, 1e-2])
def test_values_and_grads_match_naive(dtype, rtol, z_coeff):
    h, w, y, g = _inputs(0, dtype)
    want_l, want_dh, want_dw = _naive_torch(h, w, y, g, z_coeff)

    def f(hh, ww):
        loss = chunked_cross_entropy(hh, ww, jnp.asarray(y), chunk_size=8, z_loss_coeff=z_coeff)
        return (loss * jnp.asarray(g)).sum(), loss

    (_, loss), (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(jnp.asarray(h), jnp.asarray(w))
    assert loss.dtype == dtype and dh.dtype == dtype and dw.dtype == dtype
    assert (np.asarray(loss)[y == -100] == 0).all()
    for got, want in ((loss, want_l), (dh, want_dh), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_matches_torch_chunked_cross_entropy(dtype, rtol):
    h, w, y, g = _inputs(1, dtype)
    th = torch.tensor(h, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    # both ports tile the vocabulary the same way here: 7-row tiles, the last one partial (V = 29)
    tl = torch_chunked(th, tw, torch.tensor(y), chunk_size=16, z_loss_coeff=1e-3, vocab_chunk_size=7)
    (tl * torch.tensor(g)).sum().backward()
    loss, vjp = jax.vjp(
        lambda a, b: chunked_cross_entropy(a, b, jnp.asarray(y), chunk_size=16, z_loss_coeff=1e-3, vocab_chunk_size=7),
        jnp.asarray(h),
        jnp.asarray(w),
    )
    dh, dw = vjp(jnp.asarray(g))
    for got, want in ((loss, tl.detach().numpy()), (dh, th.grad.numpy()), (dw, tw.grad.numpy())):
        np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_chunk_size_does_not_change_results_and_3d_input():
    h, w, y, _ = _inputs(2, np.float64)
    ref = chunked_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), chunk_size=T)
    for chunk in (1, None):  # one token per tile; the default tile (larger than T)
        got = chunked_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-13)
    # [B, S, H] is scanned over position chunks of all rows (9 positions in chunks of 8 // 4 = 2, padded):
    # values and gradients must equal the [T, H] path, whose gradients are checked against autograd above.
    y3 = jnp.asarray(y[:36]).reshape(4, 9)
    g3 = jnp.asarray(np.random.default_rng(9).normal(size=(4, 9)))

    def f3(a, b, chunk):
        return (chunked_cross_entropy(a, b, y3, chunk_size=chunk, z_loss_coeff=1e-2) * g3).sum()

    def f2(a, b):
        loss = chunked_cross_entropy(a.reshape(36, H), b, y3.reshape(36), chunk_size=5, z_loss_coeff=1e-2)
        return (loss * g3.reshape(36)).sum()

    h3 = jnp.asarray(h[:36]).reshape(4, 9, H)
    got3 = chunked_cross_entropy(h3, jnp.asarray(w), y3, chunk_size=7)
    assert got3.shape == (4, 9)
    np.testing.assert_allclose(np.asarray(got3).ravel(), np.asarray(ref)[:36], rtol=1e-13)
    want = jax.jit(jax.grad(f2, argnums=(0, 1)))(h3, jnp.asarray(w))
    got = jax.jit(jax.grad(f3, argnums=(0, 1)), static_argnums=2)(h3, jnp.asarray(w), 8)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-14)


def test_bf16_inputs_compute_in_float32():
    h, w, y, _ = _inputs(3, np.float32)
    hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    loss, (dh, dw) = jax.value_and_grad(
        lambda a, b: chunked_cross_entropy(a, b, jnp.asarray(y), chunk_size=8).sum(), argnums=(0, 1)
    )(hb, wb)
    assert loss.dtype == jnp.float32 and dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    want, _, _ = _naive_torch(
        np.asarray(hb.astype(jnp.float32)), np.asarray(wb.astype(jnp.float32)), y, np.ones(T), 0.0
    )
    assert float(loss) == pytest.approx(want.sum(), rel=1e-6)


def test_no_t_by_v_buffer_in_the_compiled_program():
    # With a vocabulary much larger than the chunk, no [T, V]-sized value may appear in the jaxpr.
    t, v, hid = 64, 512, 8
    h = jnp.ones((t, hid))
    w = jnp.ones((v, hid))
    y = jnp.zeros(t, jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: chunked_cross_entropy(a, b, y, chunk_size=8).sum(), argnums=(0, 1)))(
        h, w
    )
    sizes = [
        int(np.prod(var.aval.shape)) for eqn in jaxpr.jaxpr.eqns for var in eqn.outvars if hasattr(var.aval, "shape")
    ]
    assert max(sizes) < t * v, max(sizes)


def test_bad_input():
    h, w = jnp.ones((4, 3)), jnp.ones((5, 3))
    msg = r"labels must lie in \[0, 5\) or equal ignore_index=-100, found 7 at index \[2\]"
    with pytest.raises(ValueError, match=msg):
        chunked_cross_entropy(h, w, jnp.asarray([0, 1, 7, -100]))
    with pytest.raises(ValueError, match=r"weight hidden size 4"):
        chunked_cross_entropy(h, jnp.ones((5, 4)), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"labels shape \(3,\) does not match"):
        chunked_cross_entropy(h, w, jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="labels must be an integer array"):
        chunked_cross_entropy(h, w, jnp.zeros(4))
    with pytest.raises(ValueError, match="chunk_size must be a positive number of tokens, got 0"):
        chunked_cross_entropy(h, w, jnp.zeros(4, jnp.int32), chunk_size=0)
    with pytest.raises(ValueError, match="z_loss_coeff must be a finite number >= 0"):
        chunked_cross_entropy(h, w, jnp.zeros(4, jnp.int32), z_loss_coeff=-1.0)
