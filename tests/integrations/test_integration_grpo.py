"""``class GRPO(LossParityGRPOMixin, trl.GRPOTrainer)`` (docs/rl.md): the update is the exact objective of the
chosen mode for the policy, KL and entropy terms at GA 1, 2 and 4 (global batch 8, 2 prompts × 4 completions,
the same completions by a deterministic rollout_func, empty rows by mask_truncated_completions), against a naive
float64 evaluation of semantics §9 on the step's rows; and TRL's native loss types against their presets."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402
from _grpo_common import StepParams, naive_objective, rel_update_diff, run_grpo  # noqa: E402

BETA, ENTROPY = 0.04, 0.1


def _check_against_naive(out_dir, run, terms, lr=1.0):
    """The first step's update (−lr·∇J) and logged objective against the naive float64 J of its rows."""
    before, _, logs, trainer = run
    J, grad = naive_objective(out_dir, trainer._test_rows, terms)
    after1 = trainer._test_params[0]
    upd = torch.cat([(after1[k] - before[k]).flatten() for k in before])
    ref = torch.cat([(-lr * grad[k]).float().flatten() for k in before])
    g_rel = float((upd - ref).abs().max() / ref.abs().max())
    o_rel = abs(logs[0]["objective"] - J) / abs(J)
    return g_rel, o_rel, J


def _run(tmp_path, b, ga, mode=None, steps=2, spg=None, mixin=True, **over):
    kw = {"beta": BETA, "entropy_coef": ENTROPY, "mask_truncated_completions": True, **over}
    return run_grpo(str(tmp_path), b, ga, mixin=mixin, steps=steps, spg=spg, lp={"lossparity_mode": mode}, **kw)


@pytest.mark.parametrize("mode", ["per_token", "per_sample", "sample_sum_norm", "per_group"])
def test_drop_in_is_layout_invariant_and_exact(tmp_path, mode):
    runs = [_run(tmp_path, 8 // ga, ga, mode) for ga in (1, 2, 4)]
    diffs = [rel_update_diff(runs[0], r) for r in runs[1:]]
    assert max(diffs) <= 1e-6, diffs
    terms = {"policy": (mode, 1.0), "kl": (mode, BETA), "entropy": (mode, -ENTROPY)}
    worst = [_check_against_naive(tmp_path, r, terms) for r in runs]
    assert max(w[0] for w in worst) <= 1e-5, worst  # float32 model against the float64 reference
    assert max(w[1] for w in worst) <= 1e-6, worst
    print(f"measured: GRPO drop-in {mode}: updates GA2/GA4 vs GA1 {diffs[0]:.1e}/{diffs[1]:.1e} (2 steps); "
          f"step-1 update vs naive float64 {max(w[0] for w in worst):.1e}, objective {max(w[1] for w in worst):.1e}")
