"""Real multi-process data parallelism (gloo on 127.0.0.1): D x K layouts against the float64 reference."""

from __future__ import annotations

import pytest
from _dist_workers import bad_mask_on_rank1, count_collectives, run_layout
from _models import TinyLM, global_batch
from _models import reference as _reference

import lossparity as lp
from lossparity.distributed.launch import spawn

pytestmark = pytest.mark.slow
N_ROWS = 16


def reference(mode: str, b: int):
    return _reference(mode, b, N_ROWS)


@pytest.mark.parametrize("world", [2, 4])
def test_dp_by_ga_matches_single_process_float64(world):
    ks = [1, 2, 4]
    modes = [m for m in lp.MODES if m != "per_group"]  # per_group: the RLAccountant (tests/test_rl_modes.py)
    configs = [(m, e, n) for m in modes for e in ("plain", "ddp") for n in ("precount", "deferred")]
    results = spawn(run_layout, world, N_ROWS, ks, configs, timeout_s=60)
    checked = 0
    for (mode, engine, norm, K), _ in results[0].items():
        b = N_ROWS // world // K
        J, gref, lm = reference(mode, b if mode == "per_microbatch" else 1)
        returned_total = sum(r[(mode, engine, norm, K)][2] for r in results)
        for rank, r in enumerate(results):
            grads, logs, _ = r[(mode, engine, norm, K)]
            where = (mode, engine, norm, K, rank)
            assert logs["objective"] == pytest.approx(J, rel=1e-10, abs=1e-12), where
            assert logs["lm_loss"] == pytest.approx(lm, rel=1e-10), where
            assert logs["samples"] == N_ROWS and logs["microbatches"] == world * K, where
            for name, g in grads.items():
                err = float((g - gref[name]).abs().max() / gref[name].abs().max())
                assert err <= 1e-10, (where, name, err)
            checked += 1
        if norm == "precount":
            # the returned shares sum to J over all ranks and microbatches
            assert returned_total == pytest.approx(J, rel=1e-10, abs=1e-12), (mode, engine, K)
    assert checked == len(configs) * len(ks) * world


def test_one_precount_and_one_log_collective_per_step():
    calls = spawn(count_collectives, 2, timeout_s=60)
    # begin_step (normalizers) + logs (every scalar): nothing per microbatch
    assert [len(c) for c in calls] == [2, 2]


def test_bad_input_on_one_rank_raises_on_all_ranks_without_hang():
    msgs = spawn(bad_mask_on_rank1, 2, timeout_s=30)
    assert "other rank(s) reported invalid input" in msgs[0]
    assert "mask values must be 0 or 1" in msgs[1] and "rank 1, microbatch 1" in msgs[1]


def test_fsdp2_fully_shard_gradients_match_reference():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 fully_shard")
    from _dist_workers import run_fsdp

    modes = ["per_token", "per_sample"]
    results = spawn(run_fsdp, 2, 8, modes, timeout_s=60)
    tokens, labels, mask, seg = global_batch(8)
    for mode in modes:
        model = TinyLM()
        J = lp.objective(mode, model(tokens, labels), mask)
        J.backward()
        for rank, r in enumerate(results):
            grads, logs, factor = r[mode]
            assert factor == 2.0  # FSDP averages over D=2
            assert logs["objective"] == pytest.approx(float(J.detach()), rel=1e-10)
            for name, p in model.named_parameters():
                err = float((grads[name] - p.grad).abs().max() / p.grad.abs().max())
                assert err <= 1e-10, (mode, rank, name, err)
