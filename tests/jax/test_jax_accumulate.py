"""Gradient accumulation over lax.scan: K microbatches give the objective, gradients and logs of K = 1
and of a naive whole-batch formula, for every mode (semantics §3)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossparity.jax as lj

N, S, H, V = 8, 12, 6, 11
L_FIXED = 12


def _setup(seed: int, dtype, batch):
    _, mask, seg = batch(seed, rows=N, seq=S)
    rng = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(rng.normal(size=(V, H)), dtype),
        "out": jnp.asarray(rng.normal(size=(V, H)) / 2, dtype),
    }
    inputs = rng.integers(0, V, size=(N, S))
    labels = np.where(mask > 0, rng.integers(0, V, size=(N, S)), -100)
    data = {"inputs": jnp.asarray(inputs), "labels": jnp.asarray(labels)}
    return params, data, jnp.asarray(mask, dtype), jnp.asarray(seg)


def loss_fn(params, mb):
    """A one-layer language model's per-token cross-entropy (plain log-softmax: cheap to compile)."""
    hidden = jnp.tanh(params["emb"][mb["inputs"]])
    logp = jax.nn.log_softmax(hidden @ params["out"].T, axis=-1)
    labels = mb["labels"]
    picked = jnp.take_along_axis(logp, jnp.where(labels >= 0, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(labels >= 0, -picked, 0.0)


def naive_objective(mode, loss, w, seg, b):
    """The semantics §1 formulas written out directly (documents by a one-hot selection of every id)."""
    s, n = (loss * w).sum(-1), w.sum(-1)
    if mode == "per_token":
        return s.sum() / jnp.maximum(n.sum(), 1)
    if mode == "per_sample":
        return jnp.mean(s / jnp.maximum(n, 1))
    if mode == "per_microbatch":
        return jnp.mean(s.reshape(-1, b).sum(-1) / jnp.maximum(n.reshape(-1, b).sum(-1), 1))
    if mode == "sample_sum":
        return s.mean()
    if mode == "sample_sum_norm":
        return s.sum() / (s.shape[0] * L_FIXED)
    # documents: for every id d, the positions of row i with seg == d (an [N, S, ids] selection)
    sel = seg[..., None] == jnp.arange(1, seg.shape[-1] + 1)
    s_doc = jnp.einsum("ns,nsd->nd", loss * w, sel)
    n_doc = jnp.einsum("ns,nsd->nd", w, sel)
    present = sel.any(axis=1)
    return jnp.where(present, s_doc / jnp.maximum(n_doc, 1), 0).sum() / present.sum()


@functools.partial(jax.jit, static_argnames=("b", "modes"))
def _reference(params, data, mask, seg, *, b=1, modes=lj.MODES):
    """Naive value and gradient of every mode on the whole batch (one compiled program)."""
    out = {}
    for mode in modes:
        out[mode] = jax.value_and_grad(lambda p, m=mode: naive_objective(m, loss_fn(p, data), mask, seg, b))(params)
    return out


# One compiled program per K for all modes: compiling dominates the run time of these tests.
@functools.partial(jax.jit, static_argnames=("k", "modes", "microbatch_size", "normalization"))
def _accumulate(params, data, mask, seg, *, k, modes=lj.MODES, microbatch_size=1, normalization="precount"):
    return {
        mode: lj.accumulate_gradients(
            loss_fn,
            params,
            lj.split_microbatches(data, k),
            mode=mode,
            mask=lj.split_microbatches(mask, k),
            segment_ids=lj.split_microbatches(seg, k),
            microbatch_size=microbatch_size,
            fixed_length=L_FIXED,
            normalization=normalization,
        )
        for mode in modes
    }


def _assert_tree_close(got, want, rtol):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.abs(g - w).max() <= rtol * max(np.abs(w).max(), 1e-30), np.abs(g - w).max()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_ga_k_equals_naive_whole_batch_float64(k, batch):
    params, data, mask, seg = _setup(0, jnp.float64, batch)
    ref = _reference(params, data, mask, seg)
    tokens = float(mask.sum())
    lm = float((loss_fn(params, data) * mask).sum() / tokens)
    ndocs = len({(i, d) for i, row in enumerate(np.asarray(seg)) for d in row if d})
    for mode, (j, grads, logs) in _accumulate(params, data, mask, seg, k=k).items():
        want_j, want_g = ref[mode]
        assert float(j) == pytest.approx(float(want_j), rel=1e-12), mode
        _assert_tree_close(grads, want_g, 1e-12)
        assert float(logs["objective"]) == float(j)
        assert logs["lm_loss"].get() == pytest.approx(lm, rel=1e-12)
        assert int(logs["tokens"]) == tokens and int(logs["samples"]) == N and int(logs["documents"]) == ndocs
        assert int(logs["microbatches"]) == (N if mode == "per_microbatch" else k)


def test_ga_k_equals_k1_float32(batch):
    params, data, mask, seg = _setup(1, jnp.float32, batch)
    base = _accumulate(params, data, mask, seg, k=1)
    for k in (8,):  # every K is checked in float64 above; float32 checks the extreme split
        for mode, (j, grads, logs) in _accumulate(params, data, mask, seg, k=k).items():
            j1, g1, logs1 = base[mode]
            assert j.dtype == jnp.float32
            assert float(j) == pytest.approx(float(j1), rel=1e-5), (mode, k)
            _assert_tree_close(grads, g1, 1e-5)
            assert logs["lm_loss"].get() == pytest.approx(logs1["lm_loss"].get(), rel=1e-5)


def test_deferred_normalization_equals_naive(batch):
    params, data, mask, seg = _setup(0, jnp.float64, batch)
    ref = _reference(params, data, mask, seg)  # same shapes as above: the compiled program is reused
    deferred = _accumulate(params, data, mask, seg, k=4, modes=("per_token", "per_document"), normalization="deferred")
    for mode, (j, grads, _) in deferred.items():
        assert float(j) == pytest.approx(float(ref[mode][0]), rel=1e-12)
        _assert_tree_close(grads, ref[mode][1], 1e-12)


def test_per_microbatch_group_of_the_scan_microbatch(batch):
    # microbatch_size = b = N/K: a scan microbatch is one per_microbatch group (Megatron =False, D = 1).
    params, data, mask, seg = _setup(3, jnp.float64, batch)
    want_j, want_g = _reference(params, data, mask, seg, b=N // 4, modes=("per_microbatch",))["per_microbatch"]
    j, grads, logs = _accumulate(params, data, mask, seg, k=4, modes=("per_microbatch",), microbatch_size=N // 4)[
        "per_microbatch"
    ]
    assert float(j) == pytest.approx(float(want_j), rel=1e-12) and int(logs["microbatches"]) == 4
    _assert_tree_close(grads, want_g, 1e-12)


def test_empty_step_is_zero_and_lm_loss_missing(batch):
    params, data, mask, seg = _setup(4, jnp.float64, batch)
    data = dict(data, labels=jnp.full((N, S), -100))
    j, grads, logs = _accumulate(params, data, jnp.zeros_like(mask), seg, k=2, modes=("per_token",))["per_token"]
    assert float(j) == 0.0 and not any(np.asarray(g).any() for g in jax.tree_util.tree_leaves(grads))
    assert logs["lm_loss"].get() is None and lj.host_logs(logs)["lm_loss"] is None


def test_accumulate_bad_input(batch):
    params, data, mask, seg = _setup(5, jnp.float64, batch)
    mb = lj.split_microbatches(data, 2)
    m2 = lj.split_microbatches(mask, 2)
    with pytest.raises(ValueError, match="microbatch_size=3"):
        lj.accumulate_gradients(loss_fn, params, mb, mode="per_microbatch", mask=m2, microbatch_size=3)
    with pytest.raises(ValueError, match=r"mask must be \[K, b, S\]"):
        lj.accumulate_gradients(loss_fn, params, mb, mode="per_token", mask=mask)
    with pytest.raises(ValueError, match="leading axis K=4"):
        lj.accumulate_gradients(loss_fn, params, mb, mode="per_token", mask=lj.split_microbatches(mask, 4))
    with pytest.raises(ValueError, match="needs segment_ids"):
        lj.accumulate_gradients(loss_fn, params, mb, mode="per_document", mask=m2)
    with pytest.raises(ValueError, match="unknown normalization 'lazy'"):
        lj.accumulate_gradients(loss_fn, params, mb, mode="per_token", mask=m2, normalization="lazy")
    with pytest.raises(ValueError, match="num_microbatches=3 does not divide"):
        lj.split_microbatches(data, 3)
    with pytest.raises(ValueError, match=r"loss_fn must return floating per-token losses of shape \(4, 12\)"):
        lj.accumulate_gradients(lambda p, b: loss_fn(p, b)[:, :5], params, mb, mode="per_token", mask=m2)


def test_bf16_params_accumulate_in_float32():
    # K=8 microbatches of one token: gradient shares 1 and 7 × 2^-8, each exact in bf16. A bf16 running
    # sum stays at 1.0 (1 + 2^-8 rounds back to 1); a float32 sum rounded once gives bf16(1 + 7·2^-8).
    x = jnp.asarray([[8.0]] + [[2.0**-5]] * 7, jnp.float32)
    exact = 1 + 7 * 2.0**-8
    _, grads, _ = lj.accumulate_gradients(
        lambda p, mb: p["w"].astype(jnp.float32) * mb,
        {"w": jnp.asarray(1.0, jnp.bfloat16)},
        lj.split_microbatches(x, 8),
        mode="per_token",
        mask=jnp.ones((8, 1, 1)),
    )
    assert grads["w"].dtype == jnp.bfloat16
    assert float(grads["w"]) == float(jnp.asarray(exact, jnp.bfloat16)) == 1.03125
