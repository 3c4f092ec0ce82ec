"""JAX MoE auxiliary losses against naive NumPy formulas (semantics §5) and the PyTorch ``losses.moe``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from lossparity.jax import moe as jmoe
from lossparity.losses import moe as tmoe

E, K, T = 8, 2, 24


def _logits(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(T, E)).astype(np.float32)


def test_switch_load_balancing_matches_naive_and_torch():
    logits = _logits(0)
    pad = np.zeros(T, dtype=bool)
    pad[-5:] = True
    # naive float64: softmax, plain top-k counts of non-padding tokens, A = α E/(k T²) Σ_e c_e Σ_x p[x,e]
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :K]
    c = np.zeros(E)
    for x in range(T):
        if not pad[x]:
            c[top[x]] += 1
    tt = int((~pad).sum())
    want = 0.01 * E / (K * tt**2) * (c * np.where(pad[:, None], 0, p).sum(0)).sum()

    def loss(lg):
        probs = jmoe.router_probs(lg)
        counts = jmoe.tokens_per_expert(jmoe.topk_routing_map(probs, K), keep_mask=~jnp.asarray(pad))
        return jmoe.switch_load_balancing_loss(probs, counts, tt, K, E, 0.01, keep_mask=~jnp.asarray(pad)), counts

    (got, counts), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(counts), c)
    assert got.dtype == jnp.float32
    assert float(got) == pytest.approx(want, rel=1e-6)

    tl = torch.tensor(logits, requires_grad=True)
    tp = tmoe.router_probs(tl)
    tpad = torch.tensor(pad)
    tc = tmoe.tokens_per_expert(tmoe.topk_routing_map(tp, K), keep_mask=~tpad)
    tval = tmoe.switch_load_balancing_loss(tp, tc, tt, K, E, 0.01, keep_mask=~tpad)
    tval.backward()
    assert float(got) == pytest.approx(tval.item(), rel=1e-6)
    np.testing.assert_allclose(np.asarray(grad), tl.grad.numpy(), rtol=1e-5, atol=1e-6 * np.abs(tl.grad.numpy()).max())


def test_switch_is_coeff_at_perfect_balance_and_counts_carry_no_gradient():
    probs = jnp.full((T, E), 1.0 / E)
    counts = jnp.full((E,), T * K // E)
    assert float(jmoe.switch_load_balancing_loss(probs, counts, T, K, E, 0.5)) == pytest.approx(0.5, rel=1e-6)
    g = jax.grad(lambda c: jmoe.switch_load_balancing_loss(probs, c, T, K, E, 0.5))(counts.astype(jnp.float32))
    assert not np.asarray(g).any()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_router_probs_match_torch(score_function):
    logits = _logits(1)
    got = jmoe.router_probs(jnp.asarray(logits), score_function)
    want = tmoe.router_probs(torch.tensor(logits), score_function).numpy()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)


def test_router_z_loss_matches_naive_and_torch():
    logits = _logits(2) * 3
    pad = np.arange(T) % 5 == 0
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    want = 1e-3 * np.mean(lse[~pad] ** 2)
    logits_nan = logits.copy()
    logits_nan[pad] = np.nan  # padding rows never reach the value or the gradient
    got, grad = jax.value_and_grad(lambda x: jmoe.router_z_loss(x, 1e-3, keep_mask=~jnp.asarray(pad)))(
        jnp.asarray(logits_nan)
    )
    assert float(got) == pytest.approx(want, rel=1e-6)
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[pad].any()
    tl = torch.tensor(logits, requires_grad=True)
    tval = tmoe.router_z_loss(tl, 1e-3, keep_mask=~torch.tensor(pad))
    tval.backward()
    assert float(got) == pytest.approx(tval.item(), rel=1e-6)
    np.testing.assert_allclose(np.asarray(grad), tl.grad.numpy(), rtol=1e-5, atol=1e-9)
    s, n = jmoe.router_z_loss_sum(jnp.asarray(logits))
    assert int(n) == T and float(s) == pytest.approx((lse**2).sum(), rel=1e-6)
    assert float(jmoe.router_z_loss(jnp.asarray(logits), 1.0, keep_mask=jnp.zeros(T, bool))) == 0.0


@pytest.mark.parametrize("zero_mean", [False, True])
def test_expert_bias_update_matches_naive_and_torch(zero_mean):
    counts = np.array([[5, 1, 3, 3], [0, 0, 8, 4]])
    bias = np.array([[0.1, -0.2, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    delta = 0.01 * np.sign(counts.mean(-1, keepdims=True) - counts)
    if zero_mean:
        delta = delta - delta.mean(-1, keepdims=True)
    got = jmoe.expert_bias_update(jnp.asarray(counts), jnp.asarray(bias), 0.01, zero_mean)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), bias + delta, rtol=1e-6, atol=1e-7)
    want = tmoe.expert_bias_update(torch.tensor(counts), torch.tensor(bias), 0.01, zero_mean)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6, atol=1e-8)


def test_sequence_loss_and_max_violation_match_torch():
    logits = _logits(3).reshape(3, 8, E)
    pad = np.zeros((3, 8), dtype=bool)
    pad[1, 5:] = True
    pad[2] = True  # an all-padding sequence contributes 0 and still counts
    probs = jmoe.router_probs(jnp.asarray(logits))
    rmap = jmoe.topk_routing_map(probs, K)
    got, n = jmoe.sequence_load_balancing_loss(
        probs, rmap, topk=K, num_experts=E, coeff=0.1, keep_mask=~jnp.asarray(pad)
    )
    tp = tmoe.router_probs(torch.tensor(logits))
    want, tn = tmoe.sequence_load_balancing_loss(
        tp, tmoe.topk_routing_map(tp, K), topk=K, num_experts=E, coeff=0.1, keep_mask=~torch.tensor(pad)
    )
    assert int(n) == int(tn) == 3
    assert float(got) == pytest.approx(want.item(), rel=1e-6)
    counts = np.array([[4, 4, 4, 4], [8, 0, 4, 4], [0, 0, 0, 0]])
    vio = jmoe.max_violation(jnp.asarray(counts))
    np.testing.assert_allclose(np.asarray(vio), [0.0, 1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(np.asarray(vio), tmoe.max_violation(torch.tensor(counts)).numpy(), atol=1e-7)


def test_moe_bad_input():
    probs = jnp.full((4, E), 1.0 / E)
    with pytest.raises(ValueError, match=r"tokens_per_expert must have shape \(8,\)"):
        jmoe.switch_load_balancing_loss(probs, jnp.ones(7), 4, K, E, 0.1)
    with pytest.raises(ValueError, match="topk must be in 1..num_experts=8, got 9"):
        jmoe.switch_load_balancing_loss(probs, jnp.ones(E), 4, 9, E, 0.1)
    with pytest.raises(ValueError, match="total_num_tokens must be a finite number > 0"):
        jmoe.switch_load_balancing_loss(probs, jnp.ones(E), 0, K, E, 0.1)
    with pytest.raises(ValueError, match="coeff must be a finite number >= 0"):
        jmoe.router_z_loss(probs, -1.0)
    with pytest.raises(ValueError, match=r"keep_mask shape \(3,\)"):
        jmoe.router_z_loss(probs, 1.0, keep_mask=jnp.zeros(3, bool))
    with pytest.warns(DeprecationWarning, match="router_z_loss: padding_mask .*keep_mask=~padding_mask"):
        old = jmoe.router_z_loss(probs, 1.0, jnp.arange(4) == 1)
    assert float(old) == float(jmoe.router_z_loss(probs, 1.0, keep_mask=jnp.arange(4) != 1))
    with pytest.raises(ValueError, match="not both"):
        jmoe.tokens_per_expert(probs > 0, jnp.zeros(4, bool), keep_mask=jnp.ones(4, bool))
    with pytest.raises(ValueError, match="expert_bias shape"):
        jmoe.expert_bias_update(jnp.ones(E), jnp.zeros(E - 1), 0.1)
    with pytest.raises(ValueError, match="unknown score_function 'relu'"):
        jmoe.router_probs(probs, "relu")
