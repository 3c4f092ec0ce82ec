"""Regression: context parallelism with a context-parallel shard that holds no loss token.

Real megatron-core ``GPTModel`` (2 MoE layers + MTP depth 1, float64, CPU gloo; _megatron_gpt_workers) on
``ragged_batch``: microbatch 0 has every LM and MTP loss token on CP rank 0 (so CP rank 1 holds none of
them), a packed document has no loss token, and another row's tokens all sit on CP rank 1. With
``calculate_per_token_loss=False`` megatron-core 0.16.1 still evaluates its own MTP term, weighted 0 by
``MoETerms``, as ``0 · Σ masked loss / num_tokens`` with ``num_tokens`` the shard's MTP token count: 0/0 on
CP rank 1, NaN in the forward and in every gradient. ``MoETerms`` keeps that term out of the graph.

Expected values: the objective written out by hand on the whole global batch in one forward
(``naive_reference``), as in test_integration_megatron_moe.py, within the 1e-6 float32 floor of Megatron's
cross-entropy.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from _megatron_gpt_workers import ragged_batch, run_layout  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402
from lossparity.integrations.megatron_moe import zigzag_positions  # noqa: E402
from lossparity.losses.mtp import roll_mask  # noqa: E402

TOL = 1e-6
CP2_CASES = [("per_token", "microbatch", False, None), ("per_document", "global_lagged", False, None)]
TPCP_CASES = [("per_sample", "global_lagged", False, None)]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def test_ragged_batch_leaves_a_cp_shard_without_loss_tokens():
    for step in range(2):
        _, _, mask, seg = ragged_batch(step)
        mtp = roll_mask(mask, None, 1)
        for rank, want_empty in ((1, [0, 1]), (0, [2])):
            pos = zigzag_positions(rank, 2, mask.shape[1])
            for row in want_empty:
                assert mask[row, pos].sum() == 0 and mtp[row, pos].sum() == 0, (step, rank, row)
        assert mask[1][seg[1] == 3].sum() == 0 and (seg[1] == 3).any()  # a document without loss tokens


def _check(results, naive, layout, cases):
    for case in cases:
        for step, (want_logs, want_grads) in enumerate(naive[case[:2]]):
            for rank, res in enumerate(results):
                logs, grads, _ = res[case][step]
                assert all(bool(torch.isfinite(g).all()) for g in grads.values()), (layout, case, step, rank)
                worst = max(_rel(grads[n], want_grads[n]) for n in want_grads)
                print(f"measured: ragged {layout} {case} step {step} rank {rank}: worst gradient rel diff {worst:.1e}")
                assert worst <= TOL, (layout, case, step, rank, worst)
                for key, want in want_logs.items():
                    assert logs[key] == pytest.approx(want, rel=TOL, abs=0), (layout, case, step, key)


@pytest.mark.slow
def test_cp2_and_tp2_sp_cp2_with_an_empty_cp_shard_give_the_objective_gradients():
    pairs = sorted({c[:2] for c in CP2_CASES + TPCP_CASES})
    naive = spawn(run_layout, 1, 1, [], 8, 2, 2, pairs, False, 1, 1, "ragged", timeout_s=600)[0]["naive"]
    cp2 = spawn(run_layout, 2, 1, CP2_CASES, 8, 2, 2, (), False, 2, 1, "ragged", timeout_s=600)
    _check(cp2, naive, "CP2", CP2_CASES)
    tpcp = spawn(run_layout, 4, 2, TPCP_CASES, 8, 2, 2, (), False, 2, 1, "ragged", timeout_s=600)
    _check(tpcp, naive, "TP2+SP×CP2", TPCP_CASES)
