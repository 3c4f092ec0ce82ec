"""Expert parallelism (gloo, real all-to-all): the MoE layer's output and every parameter's gradient
equal the single-process float64 layer, including experts (and a whole EP rank) that receive no token,
and under activation recompute (no double counting)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _ep_workers import E, ep_rank, make_layer, reference

from lossparity.distributed.launch import spawn
from lossparity.model.expert_parallel import _check_shardable

pytestmark = pytest.mark.slow

BALANCED = [0.0] * E
NO_EXPERT_3 = [0.0, 0.0, 0.0, -1e3]  # expert 3 (held by EP rank 1) receives no token from any rank
IDLE_RANK_1 = [0.0, 0.0, -1e3, -1e3]  # top-2 always {0, 1}: EP rank 1 receives nothing at all
CASES = [(BALANCED, False), (NO_EXPERT_3, False), (IDLE_RANK_1, False), (BALANCED, True)]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _check(results: list[list[dict]]) -> None:
    for case, (bias, recompute) in enumerate(CASES):
        ref = reference(bias, recompute)
        for rank_out in results:
            got = rank_out[case]
            lo, hi = got["rows"]
            assert _close(got["y"], ref["y"][lo:hi]) <= 1e-12, (case, lo)
            assert got["grads"].keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                if bias is IDLE_RANK_1 and name.startswith("experts.") and g[2:].abs().max() == 0:
                    assert got["grads"][name][2:].abs().max() == 0  # idle experts: exactly zero
                    g, gg = g[:2], got["grads"][name][:2]
                else:
                    gg = got["grads"][name]
                assert _close(gg, g) <= 1e-12, (case, name)
            assert torch.equal(got["counts"], ref["counts"]), case  # router counts: once per token
            assert got["local_w1"][0] == E // 2 and got["placements"] == ["S(0)"]


def test_ep2_matches_single_process():
    _check(spawn(ep_rank, 2, 2, CASES, timeout_s=90))


def test_dp2_x_ep2_matches_single_process():
    # 4 ranks: EP groups {0,1} {2,3}, expert-data-parallel groups {0,2} {1,3}.
    _check(spawn(ep_rank, 4, 2, CASES, timeout_s=120))


def test_zero_token_cases_really_are_empty():
    # The cases above exercise what they claim: the reference dispatches no token to the blocked experts.
    assert reference(NO_EXPERT_3)["counts"][3] == 0 and reference(NO_EXPERT_3)["counts"][:3].min() > 0
    assert reference(IDLE_RANK_1)["counts"][2:].abs().max() == 0


def test_refuses_non_dividing_ep_and_non_experts():
    layer = make_layer([0.0] * E)
    with pytest.raises(ValueError, match="ep=3 must divide the number of routed experts num_experts=4"):
        _check_shardable(layer.experts, SimpleNamespace(ndim=1, size=lambda: 3))
    with pytest.raises(ValueError, match="1-D expert-parallel mesh"):
        _check_shardable(layer.experts, SimpleNamespace(ndim=2, size=lambda: 4))
    with pytest.raises(ValueError, match="lacks"):
        _check_shardable(layer.router, SimpleNamespace(ndim=1, size=lambda: 2))


def test_trainer_shards_experts_and_counts_each_token_once_under_recompute():
    # D2xE2xK2+recompute against the single-process run of the same global batch.
    from _ep_workers import trainer_facts

    single = trainer_facts(0, 1, False)
    out = spawn(trainer_facts, 2, True, timeout_s=120)
    assert single["dispatch"].sum() > 0
    for r in out:
        assert r["placements"] == ["S(0)"] and r["local_experts"] == single["local_experts"] // 2
        assert not r["router_sharded"]  # the router is replicated: EP only moves the expert computation
        # Every expert shard of every MoE layer (main layers and the MTP block) is left to the accountant,
        # which sums it over the expert-data-parallel group (the engine is plain under EP: no DDP averaging).
        assert r["expert_params"] == 3 * len(single["dispatch"])
        assert r["engine"] == "LossForward"
        # Recompute re-runs the all-to-all but counts nothing: dispatch and top-k counts equal one
        # single-process forward of the same global batch.
        assert torch.equal(r["dispatch"], single["dispatch"])
        assert torch.equal(r["lagged"], single["lagged"]) and r["tokens"] == single["tokens"]
        # ... and the step itself (DP sums for the replicated parameters, EDP sums for the experts) is exact.
        for k in ("objective", "lm_loss", "grad_norm", "global_load_balancing_loss", "z_loss", "max_vio"):
            got, want = r["history"][0][k], single["history"][0][k]
            assert abs(got - want) <= 1e-10 * abs(want), (k, got, want)
        for n, want in single["params"].items():
            assert torch.allclose(r["params"][n], want, rtol=1e-10, atol=1e-13), n


def test_ep_trainer_layouts_match_single_process():
    from lossparity.verify.reference import Layout, format_table, run_verify

    # TP x EP: experts replicated over TP (expert TP size 1) and sharded over EP; the gradient norm
    # reduces the TP shards and the EP shards each over their own mesh.
    layouts = (Layout("1x1", 1, 1), Layout("D2xT2xE2xK2", 2, 2, tp=2, ep=2))
    report = run_verify(layouts, ("per_sample",), steps=2, progress=False)
    assert all(r["pass"] for r in report["rows"]), format_table(report)
    # Deferred normalization with the plain engine: the accountant divides the expert shards too, once.
    # (Indexer off: deferred normalization refuses the indexer loss, whose share needs the global query count.)
    layouts = (Layout("D2xE2+plain", 2, 1, ep=2, engine="plain", indexer=False),)
    overrides = {"normalization": "deferred", "mtp_convention": "main", "aux_scope": "none", "z_coeff": 0.0}
    report = run_verify(layouts, ("per_token",), steps=2, progress=False, overrides=overrides)
    assert all(r["pass"] for r in report["rows"]), format_table(report)


def test_trainer_refuses_bad_ep_before_any_state():
    from lossparity.training.trainer import TrainConfig

    with pytest.raises(ValueError, match=r"--ep=3 must divide --dp × --cp = 2×1"):
        TrainConfig(dp=2, ep=3).validate()
    with pytest.raises(ValueError, match="--ep=2 must divide the number of routed experts num_experts=3"):
        TrainConfig(dp=2, ep=2, model_overrides={"num_experts": 3, "topk": 1}).validate()
    with pytest.raises(ValueError, match="--ep=2 is not combined with --sp"):
        TrainConfig(dp=2, tp=2, sp=True, ep=2).validate()
    with pytest.raises(ValueError, match="--ep must be an integer >= 1"):
        TrainConfig(ep=0).validate()


def test_checkpoint_under_ep_resumes_into_a_layout_without_ep(tmp_path):
    from _ep_workers import resume_across_ep

    skip = {"tokens_per_s", "step_time_s"}
    for r in spawn(resume_across_ep, 2, str(tmp_path), timeout_s=180):
        assert len(r["history"]) == 1 and r["history"][0]["step"] == 3
        for k, want in r["ref_history"][0].items():
            got = r["history"][0][k]
            if k not in skip:
                assert got == want or abs(got - want) <= 1e-10 * max(abs(want), 1e-300), (k, got, want)
        assert r["params"].keys() == r["ref_params"].keys()
        for n, want in r["ref_params"].items():
            assert torch.allclose(r["params"][n], want, rtol=1e-10, atol=1e-13), n
        assert all(torch.equal(a, b) for a, b in zip(*r["bias"]))
