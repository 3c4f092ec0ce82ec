"""Issue 17 defects 1-6 of the JAX port: each test failed before the fix.

Expected values are hand-worked or computed with float64 NumPy next to the assertion, never by the code
under test. ``lpj.checked`` runs the same value checks under ``jit`` through ``jax.experimental.checkify``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossparity.jax as lj
from lossparity.jax import mtp as jmtp

# one row of 6 tokens, two documents (ids 1, 2) and a padding tail (id 0)
ROW_LOSS = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
ROW_MASK = np.array([1, 1, 0, 1, 1, 0])
ROW_SEG = np.array([1, 1, 1, 2, 2, 0])


# -- defect 1: per_document on a 1-D row ---------------------------------------------------------------


def test_per_document_accepts_a_1d_row_like_every_other_mode():
    loss, mask, seg = jnp.asarray(ROW_LOSS), jnp.asarray(ROW_MASK), jnp.asarray(ROW_SEG)
    want = ((1 + 2) / 2 + (4 + 5) / 2) / 2  # two documents, each its own token mean
    assert float(lj.objective("per_document", loss, mask, segment_ids=seg)) == pytest.approx(want, abs=1e-15)
    assert float(lj.numerator("per_document", loss, mask, segment_ids=seg)) == pytest.approx(2 * want, abs=1e-15)
    s, n, present = lj.document_stats(loss, mask, seg)
    assert np.asarray(s)[np.asarray(present)].tolist() == [3.0, 9.0]
    assert int(lj.count_normalizers(mask, seg).documents) == 2


# -- defects 2 and 3: NaN is checked, at loss-bearing tokens only --------------------------------------


def test_nan_at_a_loss_bearing_token_raises_in_every_public_function():
    loss, mask = jnp.asarray(ROW_LOSS).at[3].set(jnp.nan), jnp.asarray(ROW_MASK)
    seg = jnp.asarray(ROW_SEG)
    msg = r"per_token_loss has NaN/Inf \(nan\) at loss-bearing index \[3\]"
    for mode in lj.MODES:
        with pytest.raises(FloatingPointError, match=msg):
            lj.objective(mode, loss, mask, segment_ids=seg, microbatch_size=1, fixed_length=6)
    with pytest.raises(FloatingPointError, match=msg):
        lj.lm_loss(loss, mask)
    with pytest.raises(FloatingPointError, match=msg):
        lj.numerator("per_token", loss, mask)
    with pytest.raises(FloatingPointError, match=msg):
        lj.sample_stats(loss, mask)
    with pytest.raises(FloatingPointError, match=msg + r" \(MTP depth 1\)"):
        lj.mtp_objective("per_token", [loss], [mask], mask)


def test_inf_at_a_masked_position_is_valid_input():
    loss = jnp.asarray(ROW_LOSS).at[2].set(jnp.inf).at[5].set(jnp.nan)  # both positions have mask 0
    mask, seg = jnp.asarray(ROW_MASK), jnp.asarray(ROW_SEG)
    lj.check_inputs(loss, mask, seg)  # the README's eager check accepts it
    assert float(lj.objective("per_token", loss, mask)) == pytest.approx((1 + 2 + 4 + 5) / 4, abs=1e-15)
    assert float(lj.lm_loss(loss, mask).value) == pytest.approx(3.0, abs=1e-15)
    with pytest.raises(FloatingPointError, match=r"loss-bearing index \[0, 1\] \(rank 0, microbatch 2\)"):
        lj.check_inputs(loss[None].at[0, 1].set(jnp.inf), mask[None], where="rank 0, microbatch 2")


# -- defect 4: under jit, invalid values raise through checkify or poison the result -------------------


def _per_token(loss, mask):
    return lj.objective("per_token", loss, mask)


def _per_document(loss, mask, seg):
    return lj.objective("per_document", loss, mask, segment_ids=seg, num_segments=2)


def test_fractional_mask_under_jit_raises_when_checked_and_is_nan_otherwise():
    loss, mask = jnp.asarray(ROW_LOSS), jnp.asarray(ROW_MASK, jnp.float64).at[1].set(0.5)
    eager_msg = r"mask values must be 0 or 1, found 0.5 at index \[1\]"
    with pytest.raises(ValueError, match=eager_msg):
        _per_token(loss, mask)
    err, _ = jax.jit(lj.checked(_per_token))(loss, mask)
    with pytest.raises(ValueError, match=eager_msg):  # the eager exception, from the compiled program
        lj.throw(err)
    with pytest.raises(Exception, match=eager_msg):  # checkify's own JaxRuntimeError, same text
        err.throw()
    # without checks a traced program cannot raise: the value is NaN, never a plausible number
    value, grad = jax.jit(jax.value_and_grad(_per_token))(loss, mask)
    assert np.isnan(float(value)) and np.isnan(np.asarray(grad)[np.asarray(ROW_MASK) != 0]).all()
    err, value = jax.jit(lj.checked(_per_token))(loss, jnp.asarray(ROW_MASK))  # valid input: no error
    assert lj.throw(err) is None
    assert float(value) == pytest.approx(3.0, abs=1e-15)


def test_segment_ids_out_of_range_under_jit():
    loss, mask, seg = jnp.asarray(ROW_LOSS), jnp.asarray(ROW_MASK), jnp.asarray(ROW_SEG).at[4].set(3)
    msg = r"segment_ids must lie in \[0, num_segments=2\] \(0 = padding\), found 3 at index \[4\]"
    with pytest.raises(ValueError, match=msg):
        _per_document(loss, mask, seg)
    err, _ = jax.jit(lj.checked(_per_document))(loss, mask, seg)
    with pytest.raises(ValueError, match=msg):
        lj.throw(err)
    assert np.isnan(float(jax.jit(_per_document)(loss, mask, seg)))
    padded = jnp.asarray(ROW_SEG).at[1].set(0)  # a loss-bearing token in padding
    err, _ = jax.jit(lj.checked(_per_document))(loss, mask, padded)
    with pytest.raises(ValueError, match=r"loss-bearing token at segment_ids == 0 \(padding\) at index \[1\]"):
        lj.throw(err)
    assert np.isnan(float(jax.jit(_per_document)(loss, mask, padded)))


def test_nan_in_scan_names_the_microbatch():
    # 4 rows in 2 microbatches; row 3 (microbatch 1, row 1) has a NaN loss at a loss-bearing token
    x = jnp.asarray(np.arange(16.0).reshape(4, 4)).at[3, 2].set(jnp.nan)
    mask = jnp.ones((4, 4))

    def loss_fn(p, mb):
        return p * mb

    def step(p):
        return lj.accumulate_gradients(loss_fn, p, x, mode="per_token", mask=mask, num_microbatches=2)

    msg = r"per_token_loss has NaN/Inf \(nan\) at loss-bearing index \[1, 2\] \(microbatch 1\)"
    with pytest.raises(FloatingPointError, match=msg):
        step(jnp.asarray(1.0))
    err, _ = jax.jit(lj.checked(step))(jnp.asarray(1.0))
    with pytest.raises(FloatingPointError, match=msg):
        lj.throw(err)


# -- defect 5: one per_microbatch rule -----------------------------------------------------------------


def test_per_microbatch_group_size_rule():
    loss = jnp.asarray(np.arange(1.0, 9.0).reshape(4, 2))
    mask = jnp.asarray([[1, 1], [1, 0], [0, 0], [1, 1]])
    # whole-step functions cannot guess the microbatch: they need microbatch_size
    with pytest.raises(ValueError, match="per_microbatch.*needs microbatch_size"):
        lj.objective("per_microbatch", loss, mask)
    with pytest.raises(ValueError, match="per_microbatch.*needs microbatch_size"):
        lj.mtp_objective("per_microbatch", [loss], [mask], mask)
    with pytest.raises(ValueError, match="per_microbatch.*needs microbatch_size"):
        lj.accumulate_gradients(
            lambda p, mb: p * mb, jnp.asarray(1.0), loss, mode="per_microbatch", mask=mask, num_microbatches=2
        )
    # one-microbatch functions: None means the input is one microbatch, the same as microbatch_size = rows
    whole = (1 + 2 + 3 + 7 + 8) / 5
    assert float(lj.numerator("per_microbatch", loss, mask)) == pytest.approx(whole, abs=1e-15)
    assert float(lj.numerator("per_microbatch", loss, mask, microbatch_size=4)) == pytest.approx(whole, abs=1e-15)
    assert int(lj.count_normalizers(mask).microbatches) == int(lj.count_normalizers(mask, microbatch_size=4)[3]) == 1
    # and the pieces add up to the objective for an explicit size
    halves = ((1 + 2 + 3) / 3 + (7 + 8) / 2) / 2
    norms = lj.count_normalizers(mask, microbatch_size=2)
    num = lj.numerator("per_microbatch", loss, mask, microbatch_size=2)
    assert float(num / lj.denominator("per_microbatch", norms)) == pytest.approx(halves, abs=1e-15)
    assert float(lj.objective("per_microbatch", loss, mask, microbatch_size=2)) == pytest.approx(halves, abs=1e-15)


# -- defect 6 ------------------------------------------------------------------------------------------


def test_missing_lm_loss_is_not_a_number_in_the_logs():
    loss, empty = jnp.ones((2, 3)), jnp.zeros((2, 3))
    lm = lj.lm_loss(loss, empty)
    assert lm.get() is None and not bool(lm.valid)  # eager read: None, like the PyTorch port
    assert np.isfinite(float(lm.value))  # NaN-free inside traced code
    j, _, logs = jax.jit(
        lambda p: lj.accumulate_gradients(
            lambda q, mb: q * mb, p, loss, mode="per_token", mask=empty, num_microbatches=2
        )
    )(jnp.asarray(1.0))
    host = lj.host_logs(logs)
    assert host["lm_loss"] is None  # missing, as the PyTorch accountant's logs() reports it at Ntok = 0
    assert host["tokens"] == 0 and host["objective"] == 0.0 and float(j) == 0.0
    full = lj.host_logs(
        lj.accumulate_gradients(
            lambda q, mb: q * mb, jnp.asarray(1.0), loss, mode="per_token", mask=jnp.ones((2, 3)), num_microbatches=2
        )[2]
    )
    assert full["lm_loss"] == 1.0 and isinstance(full["lm_loss"], float)
    with pytest.raises(TypeError):
        float(logs["lm_loss"])  # a logger that writes every key cannot record a fake 0.0


def test_mtp_main_convention_equals_own_outside_per_token():
    # 'main' divides per_token depths by the main loss's token count; every other mode's denominator
    # (N, Ndoc, D*K) does not depend on the mask, so 'main' is 'own' there (documented, checked here).
    rng = np.random.default_rng(3)
    main = rng.integers(0, 2, size=(4, 6)).astype(np.float64)
    seg = np.array([[1, 1, 1, 2, 2, 2]] * 4)
    x = [jnp.asarray(rng.uniform(size=(4, 6))) for _ in range(2)]
    ws = [jmtp.roll_mask(jnp.asarray(main), jnp.asarray(seg), k) for k in (1, 2)]
    for mode in lj.MODES:
        kw = dict(segment_ids=jnp.asarray(seg), microbatch_size=2, fixed_length=6)
        own = lj.mtp_objective(mode, x, ws, jnp.asarray(main), convention="own", **kw)
        mn = lj.mtp_objective(mode, x, ws, jnp.asarray(main), convention="main", **kw)
        if mode == "per_token":
            want = np.mean([float((np.asarray(a) * np.asarray(w)).sum()) / main.sum() for a, w in zip(x, ws)])
            assert float(mn) == pytest.approx(want, rel=1e-14)
        else:
            assert float(mn) == float(own), mode


def test_denominator_rejects_fixed_length_it_would_ignore():
    norms = lj.count_normalizers(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="denominator takes no fixed_length.*numerator"):
        lj.denominator("sample_sum_norm", norms, fixed_length=3)
    assert int(lj.denominator("sample_sum_norm", norms)) == 2


def test_numpy_and_jax_scalar_z_loss_coeff_accepted():
    h, w, y = jnp.ones((3, 2)), jnp.asarray([[0.1, 0.2], [0.3, -0.1]]), jnp.asarray([0, 1, 1])
    want = lj.chunked_cross_entropy(h, w, y, z_loss_coeff=0.25)
    for coeff in (jnp.float32(0.25), np.float64(0.25), jnp.asarray(0.25)):
        np.testing.assert_array_equal(
            np.asarray(lj.chunked_cross_entropy(h, w, y, z_loss_coeff=coeff)), np.asarray(want)
        )
    with pytest.raises(TypeError, match="z_loss_coeff must be a concrete number.*traced"):
        jax.jit(lambda c: lj.chunked_cross_entropy(h, w, y, z_loss_coeff=c))(0.25)


def test_accumulate_splits_mask_with_the_batch_or_checks_the_split():
    x = jnp.asarray(np.arange(12.0).reshape(4, 3))
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    want = (0 + 1 + 3 + 9 + 10 + 11) / 6  # per_token of p * x at p = 1
    j, grads, _ = lj.accumulate_gradients(
        lambda p, mb: p * mb, jnp.asarray(1.0), x, mode="per_token", mask=mask, num_microbatches=2
    )
    assert float(j) == pytest.approx(want, abs=1e-15) and float(grads) == pytest.approx(want, abs=1e-15)
    # pre-split input: every leaf must be cut into the same [K, b] blocks as the mask
    with pytest.raises(ValueError, match=r"rows per microbatch.*b=2.*shape \(2, 1, 6\)"):
        lj.accumulate_gradients(
            lambda p, mb: p * mb.reshape(2, 3),
            jnp.asarray(1.0),
            x.reshape(2, 1, 6),
            mode="per_token",
            mask=lj.split_microbatches(mask, 2),
        )
    with pytest.raises(ValueError, match="num_microbatches.*already split"):
        lj.accumulate_gradients(
            lambda p, mb: p * mb,
            jnp.asarray(1.0),
            x,
            mode="per_token",
            mask=lj.split_microbatches(mask, 2),
            num_microbatches=2,
        )


def test_option_spellings_shared_with_pytorch():
    from lossparity import options

    assert lj.MODES == tuple(m for m in options.MODES if m not in ("token_sum", "per_group"))
    assert lj.CONVENTIONS == options.MTP_CONVENTIONS
    x, mask = jnp.ones((2, 3)), jnp.ones((2, 3))
    out = {}
    for norm in ("precount", "precounted", "deferred"):
        out[norm] = lj.accumulate_gradients(
            lambda p, mb: p * mb,
            jnp.asarray(2.0),
            x,
            mode="per_token",
            mask=mask,
            num_microbatches=2,
            normalization=norm,
        )[0]
    assert {float(v) for v in out.values()} == {2.0}
    logs = {
        est: jmtp.mtp_log_losses([x], [mask], estimator=est, microbatch_size=1)[0].get()
        for est in ("token_mean", "global", "microbatch_mean", "megatron")
    }
    assert set(logs.values()) == {1.0}
    with pytest.raises(ValueError, match="unknown normalization 'lazy'; valid: precount, deferred"):
        lj.accumulate_gradients(
            lambda p, mb: p * mb,
            jnp.asarray(2.0),
            x,
            mode="per_token",
            mask=mask,
            num_microbatches=2,
            normalization="lazy",
        )


def test_moe_padding_mask_values_checked_eagerly_and_under_jit():
    logits = jnp.zeros((3, 4))
    pad = jnp.asarray([0, 2, 1])
    msg = r"keep_mask values must be 0 or 1 \(True = keep\), found 2 at index \[1\]"
    with pytest.raises(ValueError, match=msg):
        lj.router_z_loss(logits, 1.0, keep_mask=pad)
    err, _ = jax.jit(lj.checked(lambda m: lj.router_z_loss(logits, 1.0, keep_mask=m)))(pad)
    with pytest.raises(ValueError, match=msg):
        lj.throw(err)
