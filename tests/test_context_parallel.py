"""Context parallelism in the accountant (semantics §3): rows split by columns over CP ranks, unit counts taken
from whole rows, MTP rolled across shard boundaries; gradients and logs equal the float64 reference."""

from __future__ import annotations

import pytest
from _dist_workers import run_cp_layout
from _models import TinyLM, global_batch

import lossparity as lp
from lossparity.distributed.launch import spawn
from lossparity.losses.mtp import mtp_objective, roll_mtp

pytestmark = pytest.mark.slow
N_ROWS = 8
MODES = ["per_token", "per_sample", "per_microbatch", "per_document", "sample_sum_norm"]


def reference(mode: str, b: int):
    tokens, labels, mask, seg = global_batch(N_ROWS)
    model = TinyLM()
    lab1, w1 = roll_mtp(labels, mask, seg, 1)
    kw = dict(segment_ids=seg, microbatch_size=b, fixed_length=tokens.shape[1])
    J = lp.objective(mode, model(tokens, labels), mask, **kw)
    J = J + mtp_objective(mode, [model(tokens, lab1)], [w1], mask, weight=0.5, **kw)
    J.backward()
    lm = float((model(tokens, labels).detach() * mask).sum() / mask.sum())
    return float(J.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, lm


@pytest.mark.parametrize("dp, cp, zigzag", [(1, 2, True), (2, 2, False)])
def test_cp_matches_reference(dp, cp, zigzag):
    results = spawn(run_cp_layout, dp * cp, dp, cp, N_ROWS, MODES, zigzag, timeout_s=60)
    b = N_ROWS // dp // 2
    for mode in MODES:
        J, gref, lm = reference(mode, b)
        for rank, r in enumerate(results):
            grads, logs = r[mode]
            assert logs["objective"] == pytest.approx(J, rel=1e-10), (mode, rank)
            assert logs["lm_loss"] == pytest.approx(lm, rel=1e-10), (mode, rank)
            assert logs["samples"] == N_ROWS and logs["microbatches"] == dp * 2
            for name, g in grads.items():
                err = float((g - gref[name]).abs().max() / gref[name].abs().max())
                assert err <= 1e-10, (mode, rank, name, err)


def test_model_cp_with_dp_and_recompute_matches_reference():
    # Zig-zag shards of the reference model over cp subgroups {0,1} and {2,3}, DDP over DP x CP, recompute.
    from lossparity.verify.reference import Layout, format_table, run_verify

    layouts = (Layout("1x1", 1, 1, indexer=False), Layout("D2xC2+recompute", 2, 1, True, cp=2, indexer=False))
    report = run_verify(layouts, ("per_sample", "per_document"), steps=2, progress=False)
    assert all(r["pass"] for r in report["rows"]), format_table(report)
