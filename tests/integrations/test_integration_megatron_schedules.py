"""MoETerms + LossFunc under megatron-core's pipelined schedules (_megatron_pp_workers): PP2
(``forward_backward_pipelining_without_interleaving``), PP2×VPP2 (the interleaved schedule), DP2×PP2 and
TP2+SP×PP2, on a 4-MoE-layer + MTP model with tied embeddings, float64, CPU gloo.

Expected values: the objective of docs/semantics.md §4-§5 written out by hand on the whole global batch in
one forward of the one-stage model (``naive_reference``); every parameter's gradient (router weights, the MTP
block and the shared embedding on both stages that hold it) and every log within 1e-6 relative (the float32
floor of Megatron's cross-entropy) on every rank. Aux-loss-free expert biases: bit-identical on every stage
and chunk to the one-rank run's after two steps.

CI runs a representative subset; ``LOSSPARITY_MEGATRON_FULL=1`` runs the whole matrix (per_token and
per_sample × calculate_per_token_loss True and False × both scopes on every layout;
scripts/megatron_matrix.sh).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from _megatron_pp_workers import BIAS_CASE, run_pipelines  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402

TOL = 1e-6
FULL = os.environ.get("LOSSPARITY_MEGATRON_FULL") == "1"
ALL = [
    (m, sc, pt, None) for m in ("per_token", "per_sample") for sc in ("global_lagged", "microbatch") for pt in (1, 0)
]
ALL = [(m, sc, bool(pt), k) for m, sc, pt, k in ALL]
# (tp, cp, pp, vpp) and the cases CI runs on each (the full matrix: every case everywhere)
LAYOUTS = {
    "PP2": ((1, 1, 2, None), [("per_sample", "global_lagged", False, None)]),
    "PP2×VPP2": (
        (1, 1, 2, 2),
        [("per_token", "microbatch", True, None), ("per_sample", "global_lagged", False, None), BIAS_CASE],
    ),
    "DP2×PP2": ((1, 1, 2, None), [("per_token", "global_lagged", False, None)]),
    "TP2+SP×PP2": ((2, 1, 2, None), [("per_sample", "microbatch", True, None), BIAS_CASE]),
}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _cases(name):
    cases = LAYOUTS[name][1]
    return [*ALL, BIAS_CASE] if FULL else cases


def _check(results, naive, name):
    """Asserts every case of the layout; under ``-s`` prints, after the per-rank ``measured:`` lines, one
    ``table row:`` per case (the worst gradient difference over both steps and every rank), in the order and
    format of docs/megatron.md's table (scripts/megatron_matrix.sh joins both releases' rows into it)."""
    rows = []
    for case in (c for c in _cases(name) if c != BIAS_CASE):
        case_worst = 0.0
        for step, (want_logs, want_grads) in enumerate(naive[case[:2]]):
            # every parameter on every rank holding it (the stages hold parts; the embedding is on both ends)
            assert set().union(*(res[case][step][1] for res in results)) == set(want_grads), (name, case)
            for rank, res in enumerate(results):
                logs, grads, _ = res[case][step]
                worst = max(_rel(grads[n], want_grads[n]) for n in grads)
                print(f"measured: {name} {case} step {step} rank {rank}: worst gradient rel diff {worst:.1e}")
                assert worst <= TOL, (name, case, step, rank, worst)
                assert logs == results[0][case][step][0]  # identical on every rank
                for key, want in want_logs.items():
                    assert logs[key] == pytest.approx(want, rel=TOL, abs=0), (name, case, step, key)
                assert set(logs) == set(want_logs) | {"max_vio"}
                case_worst = max(case_worst, worst)
        rows.append(f"table row: | {name} | {case[0]} | {case[1]} | {case[2]} | {case_worst:.1e} |")
    print("\n".join(sorted(rows)))


def _check_bias(results, ref, name):
    """The expert biases of every router on every stage and chunk equal the one-rank run's bit for bit."""
    want = ref[BIAS_CASE][-1][2]
    assert len(want) == 5 and all(b.abs().max() > 0 for b in want.values())  # 4 MoE layers + MTP, moved
    held = set()
    for rank, res in enumerate(results):
        biases = res[BIAS_CASE][-1][2]
        held |= set(biases)
        for key, b in biases.items():
            assert torch.equal(b, want[key]), (name, rank, key)
    assert held == set(want), name


@pytest.mark.slow
def test_pipelined_schedules_give_the_objective_gradients_and_logs():
    pairs = sorted({c[:2] for name in LAYOUTS for c in _cases(name) if c != BIAS_CASE})
    one = spawn(run_pipelines, 1, [(1, 1, 1, None, [BIAS_CASE], {"naive": pairs})], timeout_s=600)[0][0]
    naive = one["naive"]
    two = spawn(
        run_pipelines,
        2,
        [(*LAYOUTS[n][0], _cases(n), {"split_error": n == "PP2"}) for n in ("PP2", "PP2×VPP2")],
        timeout_s=900,
    )
    four = spawn(run_pipelines, 4, [(*LAYOUTS[n][0], _cases(n)) for n in ("DP2×PP2", "TP2+SP×PP2")], timeout_s=900)
    for i, name in enumerate(("PP2", "PP2×VPP2")):
        _check([r[i] for r in two], naive, name)
    for i, name in enumerate(("DP2×PP2", "TP2+SP×PP2")):
        _check([r[i] for r in four], naive, name)
    for name, results in (("PP2×VPP2", [r[1] for r in two]), ("TP2+SP×PP2", [r[1] for r in four])):
        _check_bias(results, one, name)
    for rank, res in enumerate(two):  # the same error on every rank, from the config alone
        assert res[0]["split_error"].startswith(
            "ValueError: config.num_layers=4 cannot be split into pipeline_model_parallel_size=2 × "
            "virtual_pipeline_model_parallel_size=3 = 6 model chunks"
        ), rank
