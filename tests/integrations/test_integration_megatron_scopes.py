"""MoETerms' ``sequence`` aux scope (Megatron's ``seq_aux_loss``: each row's own Switch term, averaged over the
rows of the global batch) and MTP depth 2, under context parallelism (CP2: every row cut into zig-zag shards,
each row's top-k counts all-reduced over its shards), on the real megatron-core ``GPTModel`` (2 MoE layers
+ MTP depth 2, float64, CPU gloo; _megatron_gpt_workers).

Expected values: the objective written out by hand on the whole global batch in one forward
(``naive_reference``: per-row Switch terms and the depth-k rolled labels and masks in plain loops), within
the 1e-6 float32 floor of Megatron's cross-entropy, every parameter and every log, both steps, every rank.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from _megatron_gpt_workers import run_layout  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402

TOL = 1e-6
CASES = [("per_sample", "sequence", False, None), ("per_token", "global_lagged", True, None)]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.slow
def test_sequence_scope_and_mtp_depth_2_under_cp2_give_the_objective():
    pairs = sorted({c[:2] for c in CASES})
    naive = spawn(run_layout, 1, 1, [], 8, 2, 2, pairs, False, 1, 1, "random", 2, timeout_s=600)[0]["naive"]
    cp2 = spawn(run_layout, 2, 1, CASES, 8, 2, 2, (), False, 2, 1, "random", 2, timeout_s=600)
    for case in CASES:
        for step, (want_logs, want_grads) in enumerate(naive[case[:2]]):
            assert {"mtp_1_loss", "mtp_2_loss"} <= set(want_logs)
            for rank, res in enumerate(cp2):
                logs, grads, _ = res[case][step]
                worst = max(_rel(grads[n], want_grads[n]) for n in want_grads)
                print(f"measured: CP2 MTP depth 2 {case} step {step} rank {rank}: worst gradient rel diff {worst:.1e}")
                assert worst <= TOL, (case, step, rank, worst)
                assert logs == cp2[0][case][step][0]
                for key, want in want_logs.items():
                    assert logs[key] == pytest.approx(want, rel=TOL, abs=0), (case, step, key)
