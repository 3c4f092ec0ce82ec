"""JAX statistics, modes, log channel and gap against the PyTorch modules and hand-worked values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import lossparity.jax as lj
from lossparity.jax.gap import estimator_gap
from lossparity.jax.stats import count_documents
from lossparity.losses import gap as tgap
from lossparity.losses import modes as tmodes
from lossparity.losses import stats as tstats

TOL = {np.float32: 1e-6, np.float64: 1e-12}
KW = dict(microbatch_size=2, fixed_length=16)


def close(got, want, rtol):
    """Max-norm relative closeness: ``max|got - want| <= rtol · max(max|want|, tiny)``."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-30)
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert err <= rtol * scale, f"max abs err {err:.3e} > {rtol:.0e} x {scale:.3e}"


def _torch_objective_and_grad(mode, loss, mask, seg, dtype):
    tl = torch.tensor(loss, dtype=dtype, requires_grad=True)
    j = tmodes.objective(mode, tl, torch.tensor(mask, dtype=dtype), segment_ids=torch.tensor(seg), **KW)
    j.backward()
    return j.detach().numpy(), tl.grad.numpy()


@jax.jit
def _all_objectives_and_grads(loss, mask, seg):
    # every mode in one compiled program: compiling, not running, dominates these tests
    return {
        mode: jax.value_and_grad(lambda x, m=mode: lj.objective(m, x, mask, segment_ids=seg, **KW))(loss)
        for mode in lj.MODES
    }


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_objective_and_grad_match_torch(dtype, batch):
    loss, mask, seg = batch(1)
    loss = loss.astype(dtype)
    tdt = torch.float32 if dtype == np.float32 else torch.float64
    got = _all_objectives_and_grads(jnp.asarray(loss), jnp.asarray(mask, dtype), jnp.asarray(seg))
    for mode in lj.MODES:
        want_j, want_g = _torch_objective_and_grad(mode, loss, mask, seg, tdt)
        got_j, got_g = got[mode]
        assert got_j.dtype == dtype and got_g.dtype == dtype
        close(got_j, want_j, TOL[dtype])
        close(got_g, want_g, TOL[dtype])


@pytest.mark.parametrize("mode", lj.MODES)
def test_numerator_denominator_match_torch(mode, batch):
    loss, mask, seg = batch(2)
    t = [torch.tensor(x) for x in (loss, mask, seg)]
    want_num = tmodes.numerator(mode, t[0], t[1], segment_ids=t[2], fixed_length=16)
    want_norms = tmodes.count_normalizers(t[1], t[2])
    want_den = tmodes.denominator(mode, want_norms)
    a = [jnp.asarray(x) for x in (loss, mask, seg)]
    got_num = lj.numerator(mode, a[0], a[1], segment_ids=a[2], fixed_length=16)
    norms = lj.count_normalizers(a[1], a[2])
    assert [int(x) for x in norms] == [want_norms.tokens, want_norms.samples, want_norms.documents, 1]
    close(got_num, float(want_num), 1e-12)
    assert float(lj.denominator(mode, norms)) == want_den


def test_sample_and_document_stats_match_torch(batch):
    loss, mask, seg = batch(3)
    ts, tn = tstats.sample_stats(torch.tensor(loss), torch.tensor(mask))
    s, n = lj.sample_stats(jnp.asarray(loss), jnp.asarray(mask))
    close(s, ts.numpy(), 1e-12)
    np.testing.assert_array_equal(np.asarray(n), tn.numpy())
    tds, tdn = tstats.document_stats(torch.tensor(loss), torch.tensor(mask), torch.tensor(seg))
    ds, dn, present = jax.jit(lj.document_stats)(jnp.asarray(loss), jnp.asarray(mask), jnp.asarray(seg))
    present = np.asarray(present)
    assert present.sum() == tds.numel() == int(count_documents(jnp.asarray(seg)))
    close(np.asarray(ds)[present], tds.numpy(), 1e-12)  # same order: row, then id
    np.testing.assert_array_equal(np.asarray(dn)[present], tdn.numpy())
    assert not np.asarray(ds)[~present].any() and not np.asarray(dn)[~present].any()


def test_document_stats_non_contiguous_ids_and_num_segments():
    # ids need not be contiguous or start at 1; a document is a run of equal non-zero ids in a row, so
    # row 0 [5, 2, 5, pad] holds 3 documents [1], [2], [3] (the two 5s are separate runs); ids must lie
    # in [0, num_segments]: id 5 needs num_segments >= 5.
    loss = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = jnp.ones((2, 4))
    seg = jnp.asarray([[5, 2, 5, 0], [3, 3, 3, 3]])
    with pytest.raises(ValueError, match="num_segments=4"):
        lj.document_stats(loss, mask.at[0, 3].set(0), seg)
    s, n, present = lj.document_stats(loss, mask.at[0, 3].set(0), seg, num_segments=5)
    assert np.asarray(s)[np.asarray(present)].tolist() == [1.0, 2.0, 3.0, 26.0]
    assert np.asarray(n)[np.asarray(present)].tolist() == [1.0, 1.0, 1.0, 4.0]


# RFC-0032 test plan, case 1: hand-worked per-sample mean with a zero-token sample.
#   row 0: l=[1,2,3], w=[1,1,1] -> 6/3 = 2
#   row 1: l=[4,9,9], w=[1,0,0] -> 4/1 = 4
#   row 2: all padding          -> 0 (and still counts: N = 4)
#   row 3: l=[.5,1.5,7], w=[1,1,0] -> 2/2 = 1
HAND_LOSS = [[1, 2, 3], [4, 9, 9], [5, 5, 5], [0.5, 1.5, 7]]
HAND_MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
HAND_SEG = [[1, 1, 2], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
HAND = {
    "per_token": 12 / 6,
    "per_sample": (2 + 4 + 0 + 1) / 4,
    "per_microbatch": ((6 + 4) / 4 + (0 + 2) / 2) / 2,  # b = 2
    "per_document": (3 / 2 + 3 / 1 + 4 / 1 + 0 + 2 / 2) / 5,  # (row 2, id 1) has no token but counts
    "sample_sum": 12 / 4,
    "sample_sum_norm": 12 / (4 * 3),  # L = 3
}


@pytest.mark.parametrize("mode", lj.MODES)
def test_hand_worked_example(mode):
    got = lj.objective(
        mode,
        jnp.asarray(HAND_LOSS, jnp.float64),
        jnp.asarray(HAND_MASK),
        segment_ids=jnp.asarray(HAND_SEG),
        microbatch_size=2,
        fixed_length=3,
    )
    assert float(got) == pytest.approx(HAND[mode], abs=1e-15)


def test_zero_token_batch_gives_zero_not_nan():
    loss = jnp.full((3, 4), 2.0)
    seg = jnp.zeros((3, 4), jnp.int32)

    @jax.jit
    def every_mode(x, mask):
        kw = dict(segment_ids=seg, microbatch_size=1, fixed_length=4)
        return {m: jax.value_and_grad(lambda y, m=m: lj.objective(m, y, mask, **kw))(x) for m in lj.MODES}

    for mode, (j, g) in every_mode(loss, jnp.zeros((3, 4))).items():
        assert float(j) == 0.0 and not np.asarray(g).any(), mode
    value, valid = lj.lm_loss(loss, jnp.zeros((3, 4)))
    assert float(value) == 0.0 and not bool(valid)


def test_masked_inf_does_not_leak():
    loss = jnp.asarray([[1.0, jnp.inf], [2.0, 3.0]])
    mask = jnp.asarray([[1, 0], [1, 1]])
    kw = dict(segment_ids=jnp.ones((2, 2), jnp.int32), microbatch_size=1, fixed_length=2)
    got = jax.jit(
        lambda x: {m: jax.value_and_grad(lambda y, m=m: lj.objective(m, y, mask, **kw))(x) for m in lj.MODES}
    )(loss)
    for mode, (j, g) in got.items():
        assert np.isfinite(float(j)) and np.isfinite(np.asarray(g)).all(), mode


def test_per_token_path_is_bitwise_the_plain_token_mean(batch):
    # RFC-0032 regression case: the per_token objective is exactly sum(xent * mask) / sum(mask).
    for dtype in (np.float32, np.float64):
        loss, mask, _ = batch(4, rows=16, seq=64)
        xent, w = jnp.asarray(loss, dtype), jnp.asarray(mask, dtype)
        ref = jax.jit(lambda x, m: jnp.sum(x * m) / jnp.sum(m))(xent, w)
        got = jax.jit(lambda x, m: lj.objective("per_token", x, m))(xent, w)
        assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes()
        assert lj.objective("per_token", xent, w).tobytes() == (jnp.sum(xent * w) / jnp.sum(w)).tobytes()


def test_directionality_and_gap_identity(batch):
    # RFC-0032 case 2: when longer samples have higher loss, per_sample < per_token, and the gap is
    # Cov(n, l) / mean(n) (both sides computed independently, and checked against a naive formula).
    loss, mask, _ = batch(5, long_high=True)
    s = (loss * mask).sum(-1)
    n = mask.sum(-1)
    l = s / np.maximum(n, 1)
    naive_cov = np.mean((n - n.mean()) * (l - l.mean())) / n.mean()
    per_token = float(lj.objective("per_token", jnp.asarray(loss), jnp.asarray(mask)))
    per_sample = float(lj.objective("per_sample", jnp.asarray(loss), jnp.asarray(mask)))
    assert per_sample < per_token
    g = jax.jit(estimator_gap)(*lj.sample_stats(jnp.asarray(loss), jnp.asarray(mask)))
    assert float(g.per_token) == pytest.approx(per_token, rel=1e-12)
    assert float(g.per_sample) == pytest.approx(per_sample, rel=1e-12)
    assert float(g.gap) == pytest.approx(float(g.cov_term), rel=1e-10)
    assert float(g.cov_term) == pytest.approx(naive_cov, rel=1e-12)
    tg = tgap.estimator_gap(torch.tensor(s), torch.tensor(n))
    for name in ("per_token", "per_sample", "gap", "cov", "mean_count", "cov_term"):
        assert float(getattr(g, name)) == pytest.approx(getattr(tg, name), rel=1e-12, abs=1e-15), name


def test_lm_loss_log_channel_is_token_mean_for_every_mode(batch):
    loss, mask, _ = batch(6)
    value, valid = jax.jit(lj.lm_loss)(jnp.asarray(loss), jnp.asarray(mask))
    assert bool(valid)
    assert float(value) == pytest.approx((loss * mask).sum() / mask.sum(), rel=1e-12)
    v, ok = lj.ratio_or_missing(jnp.asarray(3.0), jnp.asarray(0))
    assert float(v) == 0.0 and not bool(ok)


def test_per_microbatch_numerator_groups():
    loss, mask = jnp.asarray(HAND_LOSS, jnp.float64), jnp.asarray(HAND_MASK)
    whole = lj.numerator("per_microbatch", loss, mask)  # the input is one microbatch: 12 / 6
    groups = lj.numerator("per_microbatch", loss, mask, microbatch_size=2)  # 10/4 + 2/2
    assert float(whole) == pytest.approx(2.0, abs=1e-15)
    assert float(groups) == pytest.approx(3.5, abs=1e-15)
    norms = lj.count_normalizers(mask, microbatch_size=2)
    assert int(norms.microbatches) == 2
    both = jax.jit(lambda a, b: a + b)(norms, lj.count_normalizers(mask[:2]))  # a pytree, added field-wise
    assert [int(x) for x in both] == [6 + 4, 4 + 2, 0, 2 + 1]


def test_bad_input_raises_clear_errors():
    loss, mask = jnp.ones((2, 3)), jnp.ones((2, 3))
    with pytest.raises(ValueError, match="unknown mode 'per_row'.*per_token"):
        lj.objective("per_row", loss, mask)
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\)"):
        lj.objective("per_token", loss, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"mask values must be 0 or 1, found 2.0 at index \[0, 0\]"):
        lj.objective("per_token", loss, mask.at[0, 0].set(2))
    with pytest.raises(ValueError, match="needs segment_ids"):
        lj.objective("per_document", loss, mask)
    with pytest.raises(ValueError, match="microbatch_size"):
        lj.objective("per_microbatch", loss, mask, microbatch_size=3)
    with pytest.raises(ValueError, match="fixed_length"):
        lj.objective("sample_sum_norm", loss, mask)
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        lj.objective("per_document", loss, mask, segment_ids=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="segment_ids == 0"):
        lj.document_stats(loss, mask, jnp.asarray([[1, 1, 0], [1, 1, 1]]))
    nan_msg = r"NaN/Inf \(nan\) at loss-bearing index \[1, 2\] \(rank 0, microbatch 1\)"
    with pytest.raises(FloatingPointError, match=nan_msg):
        lj.check_inputs(loss.at[1, 2].set(jnp.nan), mask, where="rank 0, microbatch 1")
    with pytest.raises(TypeError, match="per_token_loss must be floating point"):
        lj.sample_stats(jnp.ones((2, 3), jnp.int32), mask)


def test_modes_match_torch_names():
    assert lj.MODES == tuple(m for m in tmodes.MODES if m not in ("token_sum", "per_group"))


@pytest.mark.parametrize("mode", ["token_sum", "per_group"])
def test_rl_modes_are_refused_by_name(mode):
    with pytest.raises(ValueError, match=f"mode {mode!r} is not in the JAX port.*lossparity.rl"):
        lj.objective(mode, jnp.ones((2, 3)), jnp.ones((2, 3)))
