"""Vocabulary-tiled chunked cross-entropy and the fused (gradient-in-forward) variant in JAX.

References: optax's ``softmax_cross_entropy_with_integer_labels`` on the full float64 logits (values and
autodiff gradients), a float64 PyTorch autograd formula, and the compiled program's own memory analysis
for the claim that no ``[T, V]`` buffer exists.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossparity.jax as lj

optax = pytest.importorskip("optax")

T, H, V = 37, 8, 29  # T and V are not multiples of the tile sizes below


def _inputs(seed: int, shape=(T,)):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=shape + (H,))
    weight = rng.normal(size=(V, H)) / 2
    labels = rng.integers(0, V, size=shape)
    labels.reshape(-1)[[0, 5, 6]] = -100
    token_weights = rng.uniform(0.1, 2.0, size=shape)  # ragged, as the modes' weights are
    return hidden, weight, labels, token_weights


def _optax_reference(h, w, y, tw, z_coeff):
    """float64 ``Σ tw·l`` over full logits with optax's CE (+ ``z·lse²``), its autodiff grads, and ``l``."""

    def total(hh, ww):
        logits = jnp.einsum("...h,vh->...v", hh, ww, precision=jax.lax.Precision.HIGHEST)
        valid = y != -100
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, y, 0))
        lse = jax.nn.logsumexp(logits, axis=-1)
        loss = jnp.where(valid, ce + z_coeff * lse**2, 0.0)
        return jnp.sum(tw * loss), loss

    (value, loss), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(jnp.asarray(h), jnp.asarray(w))
    return value, loss, grads


def _close(got, want, rtol=1e-12):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(np.abs(want).max(), 1e-30))


def test_vocab_tiled_chunked_ce_matches_optax():
    h, w, y, tw = _inputs(0)
    z_coeff = 1e-2  # z = 0 is the same code path minus one term (the fused test below runs it)
    want_v, want_l, want_g = _optax_reference(h, w, y, tw, z_coeff)

    @jax.jit
    def run(hh, ww):
        out = {}
        for vchunk in (1, 7):  # one row per tile; a padded last tile (one whole tile: test_jax_cross_entropy)
            f = lambda a, b, vc=vchunk: jnp.sum(  # noqa: E731
                jnp.asarray(tw)
                * lj.chunked_cross_entropy(
                    a, b, jnp.asarray(y), chunk_size=8, vocab_chunk_size=vc, z_loss_coeff=z_coeff
                )
            )
            out[vchunk] = jax.value_and_grad(f, argnums=(0, 1))(hh, ww)
        loss = lj.chunked_cross_entropy(hh, ww, jnp.asarray(y), chunk_size=8, vocab_chunk_size=7, z_loss_coeff=z_coeff)
        return out, loss

    out, loss = run(jnp.asarray(h), jnp.asarray(w))
    _close(loss, want_l)
    for value, grads in out.values():
        _close(value, want_v)
        for g, wg in zip(grads, want_g):
            _close(g, wg)


def test_fused_matches_optax_weighted_sum_and_grads():
    h, w, y, tw = _inputs(1)
    for z_coeff in (1e-2,):
        want_v, want_l, (want_dh, want_dw) = _optax_reference(h, w, y, tw, z_coeff)

        def f(a, b, t, z=z_coeff):
            # one vocabulary tile (V = 29): the single-pass path (the multi-tile path: the 3-D test below)
            total, loss = lj.fused_linear_cross_entropy(a, b, jnp.asarray(y), t, chunk_size=8, z_loss_coeff=z)
            return 3.0 * total, loss  # the backward scales the stored gradients by the incoming 3.0

        (value, loss), (dh, dw, dtw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
            jnp.asarray(h), jnp.asarray(w), jnp.asarray(tw)
        )
        _close(value, 3.0 * want_v)
        _close(loss, want_l)
        _close(dh, 3.0 * np.asarray(want_dh))
        _close(dw, 3.0 * np.asarray(want_dw))
        _close(dtw, 3.0 * np.asarray(want_l))  # d(Σ w l)/dw = l, 0 at ignored tokens
    # forward + backward of the fused function hold 3 matmuls (logits, dh, dW), the chunked one 4
    # (its backward recomputes the logits)
    args = (jnp.asarray(h), jnp.asarray(w))
    fused = jax.make_jaxpr(jax.grad(lambda a, b: f(a, b, jnp.asarray(tw))[0], argnums=(0, 1)))(*args)
    chunked = jax.make_jaxpr(
        jax.grad(
            lambda a, b: jnp.sum(jnp.asarray(tw) * lj.chunked_cross_entropy(a, b, jnp.asarray(y), chunk_size=8)),
            argnums=(0, 1),
        )
    )(*args)
    assert (str(fused).count("dot_general"), str(chunked).count("dot_general")) == (3, 4)


def test_fused_3d_input_per_sample_weights_and_detached_losses():
    # [B, S, H] with per_sample weights 1/(N·max(n_i,1)): the weighted sum is the per_sample objective
    h, w, y, _ = _inputs(2, shape=(4, 9))
    n = (y != -100).sum(axis=1)
    tw = np.broadcast_to((1.0 / (4 * np.maximum(n, 1)))[:, None], y.shape).copy()
    want_v, want_l, want_g = _optax_reference(h, w, y, tw, 0.0)

    @jax.jit
    def run(a, b):
        def f(p, q):
            return lj.fused_linear_cross_entropy(
                p, q, jnp.asarray(y), jnp.asarray(tw), chunk_size=8, vocab_chunk_size=5
            )

        (total, loss), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(a, b)
        # the per-token losses are returned detached: differentiating them gives zero, by design
        g_loss = jax.grad(lambda p: f(p, b)[1].sum())(a)
        return total, loss, grads, g_loss

    total, loss, grads, g_loss = run(jnp.asarray(h), jnp.asarray(w))
    per_sample = lj.objective("per_sample", jnp.asarray(want_l), jnp.asarray(y != -100))
    _close(total, want_v)
    _close(total, per_sample)
    _close(loss, want_l)
    for g, wg in zip(grads, want_g):
        _close(g, wg)
    assert not np.asarray(g_loss).any()


def test_fused_dtype_rules_and_bad_input():
    h, w, y, tw = _inputs(3)
    hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    (total, loss), (dh, dw) = jax.value_and_grad(
        lambda a, b: lj.fused_linear_cross_entropy(a, b, jnp.asarray(y), jnp.asarray(tw, jnp.float32)),
        argnums=(0, 1),
        has_aux=True,
    )(hb, wb)
    assert total.dtype == loss.dtype == jnp.float32
    assert dh.dtype == dw.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"token_weights must be a floating-point array of the labels' shape \(37,\)"):
        lj.fused_linear_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), jnp.ones(36))
    with pytest.raises(ValueError, match="vocab_chunk_size must be a positive number of vocabulary rows, got 0"):
        lj.chunked_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), vocab_chunk_size=0)
    bad = jnp.asarray(y).at[4].set(V)
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, {V}\) or equal ignore_index=-100, found {V}"):
        lj.fused_linear_cross_entropy(jnp.asarray(h), jnp.asarray(w), bad, jnp.asarray(tw))
    # under jit an out-of-range label cannot raise without `checked`: the loss is NaN, not a silent number
    traced = jax.jit(lambda lab: lj.chunked_cross_entropy(jnp.asarray(h), jnp.asarray(w), lab))(bad)
    assert np.isnan(np.asarray(traced)).all()
    err, _ = jax.jit(lj.checked(lambda lab: lj.chunked_cross_entropy(jnp.asarray(h), jnp.asarray(w), lab)))(bad)
    with pytest.raises(ValueError, match=rf"found {V} at index \[4\]"):
        lj.throw(err)


def test_compiled_temp_memory_has_no_t_by_v_buffer():
    # XLA's own accounting of the compiled forward+backward: the temporaries of the tiled programs stay
    # far below one [T, V] float32 buffer; the naive program's are at least one (the check can see it).
    t, v, hid = 512, 8192, 16
    tv_bytes = t * v * 4
    h = jax.ShapeDtypeStruct((t, hid), jnp.float32)
    w = jax.ShapeDtypeStruct((v, hid), jnp.float32)
    y = jax.ShapeDtypeStruct((t,), jnp.int32)
    tiles = dict(chunk_size=128, vocab_chunk_size=1024)  # a tile is 1/32 of [T, V]

    def chunked(a, b, lab):
        return jax.grad(lambda p, q: lj.chunked_cross_entropy(p, q, lab, **tiles).sum(), argnums=(0, 1))(a, b)

    def fused(a, b, lab):
        return jax.grad(
            lambda p, q: lj.fused_linear_cross_entropy(p, q, lab, jnp.ones(lab.shape), **tiles)[0], argnums=(0, 1)
        )(a, b)

    def naive(a, b, lab):
        return jax.grad(lambda p, q: lj.naive_cross_entropy(p, q, lab).sum(), argnums=(0, 1))(a, b)

    temp = {
        f.__name__: jax.jit(f).lower(h, w, y).compile().memory_analysis().temp_size_in_bytes
        for f in (chunked, fused, naive)
    }
    assert temp["naive"] >= tv_bytes, temp
    assert temp["chunked"] < tv_bytes / 4 and temp["fused"] < tv_bytes / 4, temp
