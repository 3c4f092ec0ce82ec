"""ParityGuard: step-by-step verdicts with hand-worked expectations, its report, and agreement with `compare` on
every pair of the real logs (the candidate replayed through `update`)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from test_compare import REAL, REAL_DRIFT, needs_real

from lossparity.parity import CompareInputError, Run, compare_runs, read_log
from lossparity.parity.guard import ParityGuard


def ref_run(n: int = 10, **extra: dict[int, float]) -> Run:
    metrics = {"lm_loss": {s: 10.0 / s for s in range(1, n + 1)}, **extra}
    return Run(source="ref.jsonl", format="jsonl", metrics=metrics, raw_names={"lm_loss": "lm loss"})


def test_identical_steps_pass_and_a_3_percent_step_stops(tmp_path):
    g = ParityGuard(ref_run(), report_dir=tmp_path)
    for s in range(1, 4):
        v = g.update(s, {"lm loss": 10.0 / s})
        assert v.ok and not v.stop and len(v.checks) == 1 and v.checks[0].rel_diff == 0.0
    v = g.update(4, {"lm loss": 2.5 * 1.03})
    # hand-worked: |2.575 - 2.5| / 2.5 = 0.03 > rel 2e-4 (the lm_loss default)
    assert v.new and v.stop and not v.ok
    assert v.violation is not None
    assert (v.violation.step, v.violation.metric, v.violation.cand_name) == (4, "lm_loss", "lm loss")
    assert math.isclose(v.violation.rel_diff or 0, 0.03, rel_tol=1e-12)
    assert [p[0] for p in v.violation.tail] == [1, 2, 3, 4]
    later = g.update(5, {"lm loss": 2.0})
    assert later.stop and not later.new and later.violation is v.violation  # the first violation is kept
    data = json.loads((tmp_path / "parity_report.json").read_text())
    assert data["step"] == 4 and data["metric"] == "lm_loss" and data["ref"] == 2.5
    assert math.isclose(data["cand"], 2.575) and math.isclose(data["difference"], 0.075)
    assert data["tolerance"] == {"rel": 2e-4, "abs": 0.0} and len(data["last_steps"]) == 4
    md = (tmp_path / "parity_report.md").read_text()
    assert "step 4" in md and "2.575" in md and "`lm loss`" in md


def test_warn_reports_without_stopping(tmp_path):
    g = ParityGuard(ref_run(), on_violation="warn", report_dir=tmp_path)
    v = g.update(1, {"lm_loss": 11.0})
    assert v.new and not v.stop and (tmp_path / "parity_report.md").exists()


def test_tolerance_override_and_the_loss_objective_pairing():
    # the candidate logs HF's `loss` (objective); the reference has only lm_loss: compare pairs them
    g = ParityGuard(ref_run(), tol="lm_loss=0.05", report_dir=None)
    assert g.update(1, {"loss": 10.0 * 1.04, "epoch": 0.1, "run": "x"}).ok  # 4% < 5%
    v = g.update(2, {"loss": 5.0 * 1.06})
    assert v.stop and v.violation is not None and v.violation.cand_metric == "objective"
    assert g.notes and "paired" in g.notes[0]


def test_megatron_rule_allows_one_failure_in_up_to_199_points():
    g = ParityGuard(ref_run(150), rule="megatron", report_dir=None)
    # min(max(150 // 100, 1), 50) = 1 failing point allowed
    assert g.update(1, {"lm_loss": 99.0}).ok
    assert g.update(2, {"lm_loss": 5.0}).ok
    v = g.update(3, {"lm_loss": 99.0})
    assert v.stop and v.violation is not None and v.violation.step == 3 and v.violation.failures == 2


def test_missing_steps_all_and_span():
    g = ParityGuard(ref_run(), missing_steps="all", report_dir=None)
    g.update(1, {"lm_loss": 10.0})
    v = g.update(3, {"lm_loss": 10.0 / 3})  # reference step 2 was passed over
    assert v.stop and v.violation is not None and v.violation.kind == "missing_steps" and v.violation.step == 2
    span = ParityGuard(ref_run(), report_dir=None)
    for s in range(1, 6):
        assert span.update(s, {"lm_loss": 10.0 / s}).ok
    res = span.finish()  # stopped at 5 of 10: the span rule fails the offline verdict
    assert not res.passed and span.violation is not None and span.violation.kind == "missing_steps"


def test_restart_discards_later_points():
    g = ParityGuard(ref_run(), report_dir=None)
    for s in (1, 2, 3):
        g.update(s, {"lm_loss": 10.0 / s * (1.1 if s == 3 else 1.0)})
    assert g.violation is not None and g.violation.step == 3
    g2 = ParityGuard(ref_run(), on_violation="warn", report_dir=None)
    for s in (1, 2, 3, 2, 3):  # resumed from step 1's checkpoint: steps 2, 3 again
        g2.update(s, {"lm_loss": 10.0 / s})
    assert g2.candidate.restarts == 1 and g2.finish().metrics["lm_loss"].n_compared == 3


def test_smoothing_matches_compare():
    ref = ref_run()
    cand = {s: 10.0 / s * (1.0 + (0.01 if s == 5 else 0.0)) for s in range(1, 11)}
    g = ParityGuard(ref, smooth=3, tol="lm_loss=0.001", report_dir=None)
    for s, v in cand.items():
        g.update(s, {"lm_loss": v})
    offline = compare_runs(ref, Run("c", "jsonl", {"lm_loss": cand}), smooth=3, tolerances="lm_loss=0.001")
    assert g.violation is not None and g.violation.step == offline.metrics["lm_loss"].first_fail_step


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"on_violation": "halt"}, "on_violation"),
        ({"rule": "strict"}, "rule"),
        ({"missing_steps": "some"}, "missing_steps"),
        ({"tol": "lm_los=1e-3"}, "tolerances: 'lm_los'"),
        ({"metrics": ["loss_x"]}, "metrics: 'loss_x'"),
        ({"smooth": 0}, "smooth"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParityGuard(ref_run(), report_dir=None, **kwargs)


def test_bad_updates_are_named_and_change_nothing():
    g = ParityGuard(ref_run(), report_dir=None)
    with pytest.raises(ValueError, match="step"):
        g.update(True, {"lm_loss": 1.0})
    with pytest.raises(ValueError, match=r"values\['lm_loss'\] at step 1"):
        g.update(1, {"lm_loss": "1.0x"})
    assert g.candidate.metrics == {}
    with pytest.raises(CompareInputError, match="no metric of step 1 pairs"):
        g.update(1, {"accuracy": 0.5})


# ---------------------------------------------------------------------------------------------------
# the real logs: replaying a candidate through update gives compare's verdict and first failing step


def _replay(ref: Run, cand: Run) -> tuple[int | None, bool]:
    g = ParityGuard(ref, report_dir=None, step_base=cand.step_base)
    first = None
    for s in cand.steps():
        v = g.update(s, {cand.raw_names.get(m, m): vals[s] for m, vals in cand.metrics.items() if s in vals})
        if v.new and v.violation is not None:
            first = v.violation.step
    return first, g.finish().passed


def _offline(ref: Run, cand: Run) -> tuple[int | None, bool]:
    res = compare_runs(ref, cand)
    fails = [m.first_fail_step for m in res.metrics.values() if m.first_fail_step is not None]
    return min(fails, default=None), res.passed


def _outcome(fn, ref: Run, cand: Run) -> object:
    try:
        return fn(ref, cand)
    except CompareInputError:
        return "input error"


@needs_real
def test_replay_agrees_with_compare_on_every_real_log_pair():
    runs = {name: read_log(REAL / name) for name in sorted(REAL_DRIFT)}
    checked = 0
    for a, b in itertools.product(runs, runs):
        assert _outcome(_replay, runs[a], runs[b]) == _outcome(_offline, runs[a], runs[b]), (a, b)
        checked += 1
    for name, metric in REAL_DRIFT.items():  # and a +3% drift from the middle step, in the drifted metric
        run = runs[name]
        steps = sorted(run.metrics[metric])
        k = steps[len(steps) // 2]
        values = {s: v * (1.03 if s >= k else 1.0) for s, v in run.metrics[metric].items()}
        drifted = Run("drifted", run.format, {metric: values}, step_base=run.step_base, raw_names=run.raw_names)
        g = ParityGuard(run, metrics=[metric], report_dir=None, step_base=run.step_base)
        stops = [s for s in sorted(values) if g.update(s, {run.raw_names.get(metric, metric): values[s]}).new]
        assert stops == [k] and _offline(run, drifted) == (k, False), name
        checked += 1
    assert checked == len(runs) ** 2 + len(runs)
