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
