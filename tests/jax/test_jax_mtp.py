"""JAX MTP rolling and objective conventions against a naive loop and the PyTorch ``losses.mtp``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import lossparity.jax as lj
from lossparity.jax import mtp as jmtp
from lossparity.losses import mtp as tmtp

DEPTHS = 3


def naive_roll(labels, mask, seg, k, ignore=-100):
    """``w_k[i,t] = w[i,t+k]`` iff ``t+k < S`` and ``seg[i,t+k] == seg[i,t] > 0`` (or no ids); labels alike."""
    out_l = np.full_like(labels, ignore)
    out_w = np.zeros_like(mask)
    rows, length = mask.shape
    for i in range(rows):
        for t in range(length - k):
            same = seg is None or (seg[i, t] > 0 and seg[i, t + k] == seg[i, t])
            if same and mask[i, t + k]:
                out_w[i, t] = mask[i, t + k]
                out_l[i, t] = labels[i, t + k]
    return out_l, out_w


@pytest.mark.parametrize("use_seg", [True, False])
def test_roll_mtp_matches_naive_and_torch(use_seg, batch):
    _, mask, seg = batch(11)
    labels = np.random.default_rng(0).integers(0, 50, size=mask.shape)
    labels = np.where(mask > 0, labels, -100)
    s = seg if use_seg else None
    for k in range(0, 4):
        want_l, want_w = naive_roll(labels, mask, s, k)
        got_l, got_w = jax.jit(lj.roll_mtp, static_argnums=3)(
            jnp.asarray(labels), jnp.asarray(mask), None if s is None else jnp.asarray(s), k
        )
        np.testing.assert_array_equal(np.asarray(got_w), want_w)
        np.testing.assert_array_equal(np.asarray(got_l), want_l)
        tl, tw = tmtp.roll_mtp(torch.tensor(labels), torch.tensor(mask), None if s is None else torch.tensor(s), k)
        np.testing.assert_array_equal(np.asarray(got_w), tw.numpy())
        np.testing.assert_array_equal(np.asarray(got_l), tl.numpy())


def test_roll_mtp_bad_input():
    labels = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="k=4 must be smaller than the sequence length 4"):
        lj.roll_mtp(labels, jnp.ones((2, 4)), None, 4)
    with pytest.raises(ValueError, match="depth k must be an int >= 0"):
        lj.roll_mtp(labels, jnp.ones((2, 4)), None, -1)
    with pytest.raises(ValueError, match=r"labels shape \(2, 4\) does not match mask shape \(2, 3\)"):
        lj.roll_mtp(labels, jnp.ones((2, 3)), None, 1)


def _depth_batch(batch, seed):
    loss0, mask, seg = batch(seed)
    rng = np.random.default_rng(seed + 100)
    losses = [rng.uniform(0.1, 4.0, size=mask.shape) for _ in range(DEPTHS)]
    masks = [np.asarray(jmtp.roll_mask(jnp.asarray(mask), jnp.asarray(seg), k)) for k in range(1, DEPTHS + 1)]
    return losses, masks, mask, seg


KW = dict(microbatch_size=2, fixed_length=16, weight=0.3)


@jax.jit
def _all_mtp_objectives(losses, masks, main_mask, seg):
    # every (mode, convention) in one compiled program: compiling dominates the run time
    return {
        (mode, conv): jax.value_and_grad(
            lambda xs, m=mode, c=conv: lj.mtp_objective(m, xs, masks, main_mask, segment_ids=seg, convention=c, **KW)
        )(losses)
        for mode in lj.MODES
        for conv in lj.CONVENTIONS
    }


def test_mtp_objective_matches_torch(batch):
    losses, masks, main_mask, seg = _depth_batch(batch, 12)
    got = _all_mtp_objectives(
        [jnp.asarray(x) for x in losses], [jnp.asarray(w) for w in masks], jnp.asarray(main_mask), jnp.asarray(seg)
    )
    for (mode, convention), (value, grads) in got.items():
        tl = [torch.tensor(x, requires_grad=True) for x in losses]
        want = tmtp.mtp_objective(
            mode,
            tl,
            [torch.tensor(w) for w in masks],
            torch.tensor(main_mask),
            segment_ids=torch.tensor(seg),
            convention=convention,
            **KW,
        )
        want.backward()
        assert float(value) == pytest.approx(want.item(), rel=1e-12), (mode, convention)
        for g, t in zip(grads, tl):
            np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_mtp_conventions_by_hand():
    # depth 1: s=[3, 1], n=[2, 1]; depth 2: s=[2, 0], n=[1, 0]; main tokens = 5.
    l1 = jnp.asarray([[1.0, 2.0, 9.0], [1.0, 9.0, 9.0]])
    w1 = jnp.asarray([[1, 1, 0], [1, 0, 0]])
    l2 = jnp.asarray([[2.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    w2 = jnp.asarray([[1, 0, 0], [0, 0, 0]])
    main = jnp.asarray([[1, 1, 1], [1, 1, 0]])
    obj = lambda mode, conv: float(lj.mtp_objective(mode, [l1, l2], [w1, w2], main, convention=conv))  # noqa: E731
    assert obj("per_token", "own") == pytest.approx((4 / 3 + 2 / 1) / 2)
    assert obj("per_token", "main") == pytest.approx((4 / 5 + 2 / 5) / 2)
    assert obj("per_token", "pooled") == pytest.approx(6 / 4)
    # per_sample own = mtp_per_layer_loss_norm=True: every (depth, sample) pair weighs the same
    assert obj("per_sample", "own") == pytest.approx(((3 / 2 + 1 / 1) / 2 + (2 / 1 + 0) / 2) / 2)
    # per_sample pooled = mtp_per_layer_loss_norm=False: each sample pools its depths
    assert obj("per_sample", "pooled") == pytest.approx((5 / 3 + 1 / 1) / 2)


@jax.jit
def _decompositions(losses, masks, main_mask, seg):
    """For each (mode, convention): the objective, and Σ over two microbatches of numerator / denominator."""
    out = {}
    depth_norms = jmtp.mtp_normalizers(masks, seg)
    main_norms = lj.count_normalizers(main_mask, seg)
    for mode in ("per_token", "per_sample", "per_document"):
        for conv in lj.CONVENTIONS:
            want = lj.mtp_objective(mode, losses, masks, main_mask, convention=conv, segment_ids=seg)
            dens = jmtp.mtp_denominators(mode, conv, main_norms, depth_norms)
            total = 0.0
            for rows in (slice(0, 3), slice(3, 8)):
                nums = jmtp.mtp_numerator(
                    mode, [x[rows] for x in losses], [w[rows] for w in masks], convention=conv, segment_ids=seg[rows]
                )
                assert len(nums) == len(dens)
                total += sum(n / d for n, d in zip(nums, dens))
            out[(mode, conv)] = (total / (1 if conv == "pooled" else DEPTHS), want)
    return out


def test_mtp_numerators_over_microbatches_sum_to_objective(batch):
    losses, masks, main_mask, seg = _depth_batch(batch, 13)
    got = _decompositions(
        [jnp.asarray(x) for x in losses], [jnp.asarray(w) for w in masks], jnp.asarray(main_mask), jnp.asarray(seg)
    )
    for key, (total, want) in got.items():
        assert float(total) == pytest.approx(float(want), rel=1e-12), key


def test_mtp_log_losses(batch):
    losses, masks, _, _ = _depth_batch(batch, 14)
    got = jmtp.mtp_log_losses([jnp.asarray(x) for x in losses], [jnp.asarray(w) for w in masks])
    meg = jmtp.mtp_log_losses(
        [jnp.asarray(x) for x in losses],
        [jnp.asarray(w) for w in masks],
        estimator="microbatch_mean",
        microbatch_size=2,
    )
    for (value, valid), (mvalue, _), x, w in zip(got, meg, losses, masks):
        assert bool(valid) and float(value) == pytest.approx((x * w).sum() / w.sum(), rel=1e-12)
        local = [(x[i : i + 2] * w[i : i + 2]).sum() / max(w[i : i + 2].sum(), 1) for i in range(0, 8, 2)]
        assert float(mvalue) == pytest.approx(np.mean(local), rel=1e-12)
    ((value, valid),) = jmtp.mtp_log_losses([jnp.ones((2, 2))], [jnp.zeros((2, 2))])
    assert float(value) == 0.0 and not bool(valid)
    with pytest.raises(ValueError, match="unknown mtp_convention 'mean'"):
        lj.mtp_objective("per_token", [jnp.ones((1, 2))], [jnp.ones((1, 2))], jnp.ones((1, 2)), convention="mean")


def test_mtp_denominators_takes_the_argument_order_of_the_torch_port():
    from lossparity.losses.mtp import mtp_denominators as torch_dens

    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]])
    main = lj.count_normalizers(mask)  # Ntok = 5
    depths = [lj.count_normalizers(jnp.asarray([[1, 1, 0, 0], [1, 0, 0, 0]])), lj.count_normalizers(mask * 0)]
    got = [float(d) for d in jmtp.mtp_denominators("per_token", "own", main, depths)]
    assert got == torch_dens("per_token", "own", 5.0, [3.0, 0.0]) == [3.0, 1.0]
    assert [float(d) for d in jmtp.mtp_denominators("per_token", "pooled", main, depths)] == [3.0]
    with pytest.raises(TypeError, match="convention second"):
        jmtp.mtp_denominators("per_token", depths, main, depths)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the old call (mode, depth_norms, main_norms, convention=...)
        jmtp.mtp_denominators("per_token", depths, main, convention="own")  # type: ignore[call-arg]
