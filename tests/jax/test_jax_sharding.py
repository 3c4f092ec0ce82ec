"""An 8-device CPU mesh with the batch sharded over rows gives the numbers of the unsharded run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lossparity.jax as lj
from lossparity.jax import mtp as jmtp

ROWS, SEQ, H, V = 16, 16, 8, 13


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, (
        f"expected 8 forced host devices, got {jax.device_count()}: JAX was started before "
        "tests/jax/conftest.py could set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    return Mesh(np.array(jax.devices()), ("data",))


def _close(got, want, rtol=1e-12):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        assert np.abs(g - w).max() <= rtol * max(np.abs(w).max(), 1e-30), np.abs(g - w).max()


@jax.jit
def _everything(loss, mask, seg):
    """Objective and gradient of every mode, the logs, and an MTP term: one compiled program."""
    out = {
        mode: jax.value_and_grad(
            lambda x, m=mode: lj.objective(m, x, mask, segment_ids=seg, microbatch_size=2, fixed_length=SEQ)
        )(loss)
        for mode in lj.MODES
    }
    out["lm_loss"] = lj.lm_loss(loss, mask)
    out["documents"] = lj.document_stats(loss, mask, seg)
    masks = [jmtp.roll_mask(mask, seg, k) for k in (1, 2)]
    out["mtp"] = jax.value_and_grad(
        lambda x: lj.mtp_objective("per_sample", [x, x * 0.5], masks, mask, segment_ids=seg, convention="pooled")
    )(loss)
    return out


def test_modes_logs_and_mtp_sharded_equal_unsharded(mesh, batch):
    loss, mask, seg = (jnp.asarray(x) for x in batch(21, rows=ROWS, seq=SEQ))
    want = _everything(loss, mask, seg)
    rows = NamedSharding(mesh, P("data"))
    sharded = [jax.device_put(x, rows) for x in (loss, mask, seg)]
    assert len(sharded[0].addressable_shards) == 8 and sharded[0].addressable_shards[0].data.shape == (2, SEQ)
    got = _everything(*sharded)
    _close(got, want)


def _loss_fn(params, mb):
    hidden = jnp.tanh(params["emb"][mb["inputs"]])
    return lj.chunked_cross_entropy(hidden, params["out"], mb["labels"], chunk_size=32)


@jax.jit
def _accumulate_some(params, data, mask, seg):
    # the modes themselves were checked sharded above; three denominators (Ntok, N, Ndoc) suffice here
    return {
        mode: lj.accumulate_gradients(
            _loss_fn, params, data, mode=mode, mask=mask, segment_ids=seg, microbatch_size=2, fixed_length=SEQ
        )
        for mode in ("per_token", "per_sample", "per_document")
    }


def test_accumulate_with_chunked_cross_entropy_sharded_equals_unsharded(mesh, batch):
    rng = np.random.default_rng(22)
    _, mask, seg = batch(22, rows=2 * ROWS, seq=SEQ)
    params = {"emb": jnp.asarray(rng.normal(size=(V, H))), "out": jnp.asarray(rng.normal(size=(V, H)) / 2)}
    data = {
        "inputs": jnp.asarray(rng.integers(0, V, size=mask.shape)),
        "labels": jnp.asarray(np.where(mask > 0, rng.integers(0, V, size=mask.shape), -100)),
    }
    k = 2  # microbatches of 16 rows: 2 rows per device
    split = lj.split_microbatches((data, jnp.asarray(mask), jnp.asarray(seg)), k)
    want = _accumulate_some(params, *split)
    rows = NamedSharding(mesh, P(None, "data"))
    sharded = jax.tree_util.tree_map(lambda x: jax.device_put(x, rows), split)
    got = _accumulate_some(params, *sharded)
    _close(got, want)
