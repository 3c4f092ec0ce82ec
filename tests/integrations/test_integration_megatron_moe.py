"""lossparity.integrations.megatron.MoETerms inside real megatron-core training (GPTModel, local spec,
2 MoE layers + MTP depth 1, 4 experts top-2, float64, CPU gloo; bridges in _megatron_gpt_workers).

Expected values: the objective of docs/semantics.md §4-§5 written out by hand on the whole global batch
in one forward and back-propagated once (``naive_reference``: Megatron's own per-token cross-entropy for
the main loss, the MTP cross-entropy, softmax scores, top-k counts, Switch and z terms in plain loops).
The tolerance 1e-6 is the float32 floor of Megatron's cross-entropy (measured ~1.2e-7 here).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from _megatron_gpt_workers import run_layouts  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402

TOL = 1e-6
# (mode, aux_scope, calculate_per_token_loss, recompute)
CASES = [("per_document", "microbatch", False, "full"), ("per_sample", "global_lagged", True, "selective")]
# the python block of docs/megatron.md drives this one (no recompute)
DOC_CASE = ("per_token", "microbatch", True, "doc")
# context parallelism: whole-row counts of rows and documents (zig-zag shards; the documents are cut)
CP_CASES = [("per_sample", "global_lagged", True, "full"), ("per_document", "microbatch", False, "selective")]
PP_CASE = ("per_document", "microbatch", True, "selective")  # pipeline: one MoE layer per stage, MTP last
# sigmoid router with aux-loss-free expert biases (Megatron's own update): compared across layouts
BIAS_CASE = ("per_token", "global_lagged", True, "bias")


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _check(results, naive, layout, cases):
    for case in cases:
        for step, (want_logs, want_grads) in enumerate(naive[case[:2]]):  # naive: by (mode, scope)
            first_logs = results[0][case][step][0]
            # every parameter is compared on every rank holding it (pipeline stages hold parts)
            assert set().union(*(res[case][step][1] for res in results)) == set(want_grads)
            for rank, res in enumerate(results):
                logs, grads, _ = res[case][step]
                worst = max(_rel(grads[n], want_grads[n]) for n in grads)
                print(f"measured: {layout} {case} step {step} rank {rank}: worst gradient rel diff {worst:.1e}")
                assert worst <= TOL, (layout, case, step, rank, worst)
                assert logs == first_logs  # identical on every rank
                for key, want in want_logs.items():
                    assert logs[key] == pytest.approx(want, rel=TOL, abs=0), (layout, case, step, key)
                assert set(logs) == set(want_logs) | {"max_vio"}


def _check_bias(layouts):
    """Expert biases identical on every rank of every layout after two steps (and moved); gradients
    and logs equal across layouts."""
    ref_logs, ref_grads, ref_biases = layouts["DP2"][0][BIAS_CASE][-1]
    assert len(ref_biases) == 3 and all(b.abs().max() > 0 for b in ref_biases)  # 2 MoE layers + MTP
    for layout, results in layouts.items():
        for rank, res in enumerate(results):
            logs, grads, biases = res[BIAS_CASE][-1]
            assert all(torch.equal(b, r) for b, r in zip(biases, ref_biases, strict=True)), (layout, rank)
            worst = max(_rel(grads[n], ref_grads[n]) for n in ref_grads)
            print(f"measured: expert-bias case {layout} rank {rank} vs DP2: worst gradient rel diff {worst:.1e}")
            assert worst <= TOL, (layout, rank, worst)
            for key, want in ref_logs.items():
                assert logs[key] == pytest.approx(want, rel=TOL, abs=1e-12), (layout, key)


@pytest.mark.slow
def test_moe_terms_dp2_tp2_sp_cp2_pp2_give_the_objective_gradients_and_logs():
    # every layout in the same two processes (one start-up); the hand-written objective on rank 0 of DP2
    pairs = sorted({case[:2] for case in [*CASES, DOC_CASE, *CP_CASES, PP_CASE]})
    plan = [
        (1, 1, 1, [*CASES, DOC_CASE, BIAS_CASE], {"naive": pairs, "bad": True}),
        (2, 1, 1, [*CASES, BIAS_CASE]),
        (1, 2, 1, [*CP_CASES, BIAS_CASE], {"bad": True}),
        (1, 1, 2, [PP_CASE]),
    ]
    both = spawn(run_layouts, 2, plan, timeout_s=900)
    dp2, tp2, cp2, pp2 = ([r[i] for r in both] for i in range(4))
    naive = dp2[0]["naive"]
    _check(dp2, naive, "DP2", [*CASES, DOC_CASE])
    _check(tp2, naive, "TP2+SP", CASES)
    _check(pp2, naive, "PP2", [PP_CASE])
    _check(cp2, naive, "CP2", CP_CASES)
    _check_bias({"DP2": dp2, "TP2+SP": tp2, "CP2": cp2})
    for rank in range(2):
        bad = dp2[rank]["bad"]
        assert "model: no MoE layer" in bad[0]
        assert "aux_scope: 'global_running' is not fed by MoETerms: it is Megatron's running mean" in bad[1]
        assert bad[2] is None  # the valid MoETerms
        assert bad[3].startswith("RuntimeError: terms.end_step: MoETerms.begin_step(loss_masks) was not called")
        assert "config: its MoE/MTP coefficients were already taken over" in bad[4]
        assert bad[5].startswith("RuntimeError: router of layer 1: MoETerms.begin_step(loss_masks) was not called")
        bad_cp = cp2[rank]["bad"]
        assert bad_cp[0].startswith("ValueError: loss_masks[0]: under context parallelism (cp=2) begin_step takes")
        assert bad_cp[1].startswith(f"ValueError: output_tensor: shape (2, 16) on context-parallel rank {rank}")
