"""``class GRPO(LossParityGRPOMixin, trl.GRPOTrainer)`` (docs/rl.md): the update is the exact objective of the
chosen mode for the policy, KL and entropy terms at GA 1, 2 and 4 (global batch 8, 2 prompts × 4 completions,
the same completions by a deterministic rollout_func, empty rows by mask_truncated_completions), against a naive
float64 evaluation of semantics §9 on the step's rows; and TRL's native loss types against their presets."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402
from _grpo_common import naive_objective, rel_update_diff, run_grpo  # noqa: E402

BETA, ENTROPY = 0.04, 0.1


def _check_against_naive(out_dir, run, terms, rows=None, lr=1.0):
    """The first step's update (−lr·∇J) and logged objective (and policy term) against the naive float64 J of
    its rows (default: the first generation batch)."""
    before, _, logs, trainer = run
    J, grad, values = naive_objective(out_dir, rows or trainer._test_rows, terms)
    after1 = trainer._test_params[0]
    upd = torch.cat([(after1[k] - before[k]).flatten() for k in before])
    ref = torch.cat([(-lr * grad[k]).float().flatten() for k in before])
    g_rel = float((upd - ref).abs().max() / ref.abs().max())
    o_rel = abs(logs[0]["objective"] - J) / abs(J) if "objective" in logs[0] else float("nan")
    if "lossparity/policy" in logs[0]:  # the policy term's log: its value may be ~0 (advantages sum to 0)
        o_rel = max(o_rel, abs(logs[0]["lossparity/policy"] - values["policy"]) / max(abs(J), 1e-30))
    return g_rel, o_rel, J


def _run(tmp_path, b, ga, mode=None, steps=2, spg=None, mixin=True, lp=None, **over):
    kw = {"beta": BETA, "entropy_coef": ENTROPY, "mask_truncated_completions": True, **over}
    lp = {"lossparity_mode": mode, **(lp or {})}
    return run_grpo(str(tmp_path), b, ga, mixin=mixin, steps=steps, spg=spg, lp=lp, **kw)


@pytest.mark.parametrize("mode", ["per_token", "per_sample", "sample_sum_norm", "per_group"])
def test_drop_in_is_layout_invariant_and_exact(tmp_path, mode):
    runs = [_run(tmp_path, 8 // ga, ga, mode) for ga in (1, 2, 4)]
    diffs = [rel_update_diff(runs[0], r) for r in runs[1:]]
    assert max(diffs) <= 1e-6, diffs
    terms = {"policy": (mode, 1.0), "kl": (mode, BETA), "entropy": (mode, -ENTROPY)}
    worst = [_check_against_naive(tmp_path, r, terms) for r in runs]
    assert max(w[0] for w in worst) <= 1e-5, worst  # float32 model against the float64 reference
    assert max(w[1] for w in worst) <= 1e-6, worst
    print(
        f"measured: GRPO drop-in {mode}: updates GA2/GA4 vs GA1 {diffs[0]:.1e}/{diffs[1]:.1e} (2 steps); "
        f"step-1 update vs naive float64 {max(w[0] for w in worst):.1e}, objective {max(w[1] for w in worst):.1e}"
    )


def test_drop_in_counts_the_steps_own_tokens_with_spg(tmp_path):
    """steps_per_generation = 2·GA: one generation batch feeds two steps; the first step divides by its own
    token count (count_scope="step"), not by the generation batch's mean step count as TRL's dapo does."""
    run = _run(tmp_path, 2, 2, "per_token", steps=1, spg=4)
    trainer = run[3]
    rows = trainer._buffered_inputs[0:2]  # the micro-batches of step 1 (TRL's shuffled split)
    terms = {"policy": ("per_token", 1.0), "kl": ("per_token", BETA), "entropy": ("per_token", -ENTROPY)}
    g_rel, o_rel, _ = _check_against_naive(tmp_path, run, terms, rows=rows)
    assert g_rel <= 1e-5 and o_rel <= 1e-6, (g_rel, o_rel)
    native = _run(tmp_path, 2, 2, steps=1, spg=4, mixin=False, loss_type="dapo", beta=0.0, entropy_coef=0.0)
    n_rel, _, _ = _check_against_naive(tmp_path, native, {"policy": ("per_token", 1.0)}, rows=rows)
    step = sum(float(r["completion_mask"].sum()) for r in rows)
    gen = sum(float(r["completion_mask"].sum()) for r in trainer._buffered_inputs)
    print(
        f"measured: spg=2·GA per_token: drop-in vs naive (step's own {step:.0f} tokens) {g_rel:.1e}, objective "
        f"{o_rel:.1e}; TRL dapo (divides by {gen / 2:.1f}) vs the same naive {n_rel:.1e}"
    )
    # count_scope="generation": the step's share of the generation batch's J, i.e. its own J × Ntok_step / Ntok_gen
    g = _run(tmp_path, 2, 2, "per_token", steps=1, spg=4, lp={"count_scope": "generation"})
    J, grad, _ = naive_objective(str(tmp_path), rows, terms)
    upd = torch.cat([(g[3]._test_params[0][k] - g[0][k]).flatten() for k in g[0]])
    ref = torch.cat([(-grad[k] * step / gen).float().flatten() for k in g[0]])
    gen_rel = float((upd - ref).abs().max() / ref.abs().max())
    assert gen_rel <= 1e-5 and abs(g[2][0]["objective"] - J * step / gen) <= 1e-6 * abs(J * step / gen), gen_rel
    print(f"measured: spg=2·GA count_scope=generation: step 1 vs naive J·{step:.0f}/{gen:.0f}: {gen_rel:.1e}")


def test_native_bnpo_is_its_preset(tmp_path):
    """TRL's own bnpo (no drop-in) at GA 2: its update is ∇ of the trl-grpo:bnpo preset's objective (policy and KL
    per_microbatch, entropy per_microbatch), computed naively on the micro-batches TRL split."""
    from lossparity.parity.presets import resolve_preset

    p = resolve_preset("trl-grpo:bnpo")
    run = _run(tmp_path, 4, 2, steps=1, mixin=False, loss_type="bnpo")
    rows = run[3]._buffered_inputs
    terms = {"policy": (p.terms["policy"], 1.0), "kl": (p.terms["kl"], BETA), "entropy": (p.terms["entropy"], -ENTROPY)}
    g_rel, _, _ = _check_against_naive(tmp_path, run, terms, rows=rows)
    assert g_rel <= 1e-6, g_rel
    print(f"measured: TRL 1.16 bnpo GA 2 update vs the trl-grpo:bnpo preset's objective: {g_rel:.1e}")


@pytest.mark.slow
def test_drop_in_two_processes_equal_one(tmp_path):
    """2 gloo processes × batch 4 (torchrun) against 1 process × batch 8, per_group with KL and entropy, 2 steps:
    the groups are split over the processes (each holds one prompt's 4 completions)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from lossparity.distributed.launch import free_port

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[1] / "src"), str(here)]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(here / "_grpo_common.py"),
        str(tmp_path / "d2"),
        "per_group",
        "4",
        "1",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    d2 = torch.load(tmp_path / "d2.pt")
    one = _run(tmp_path, 8, 1, "per_group")
    diff = rel_update_diff(one, (d2["before"], d2["after"]))
    assert diff <= 1e-6, diff
    assert abs(d2["logs"][0]["objective"] - one[2][0]["objective"]) <= 1e-6 * abs(one[2][0]["objective"])
    print(f"measured: GRPO drop-in per_group D2×b4 vs D1×b8, 2 steps: update {diff:.1e}")
