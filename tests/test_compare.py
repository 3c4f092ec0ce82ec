"""compare_runs and the compare CLI on synthetic curves with hand-computed expectations."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lossparity.cli.parity import add_compare_arguments, cmd_compare
from lossparity.parity import (
    CompareInputError,
    Run,
    Tolerance,
    compare_runs,
    megatron_allowed_failures,
    moving_average,
    parse_tolerances,
    read_log,
    tolerance_for,
    write_report,
)

LOGS = Path(__file__).parent / "fixtures" / "logs"
STEPS = range(1, 201)


def loss_curve(step: int) -> float:
    return 2.0 + 9.0 * math.exp(-step / 40.0) + 0.01 * math.sin(step)


def make_run(
    metrics: dict[str, dict[int, float]],
    *,
    name: str = "run",
    step_base: int = 1,
    samples: dict[int, float] | None = None,
) -> Run:
    return Run(source=name, format="jsonl", metrics=metrics, consumed_samples=samples or {}, step_base=step_base)


def base_metrics() -> dict[str, dict[int, float]]:
    return {
        "lm_loss": {s: loss_curve(s) for s in STEPS},
        "mtp_1_loss": {s: loss_curve(s) + 0.1 for s in STEPS},
        "tokens": {s: 4096.0 for s in STEPS},
    }


# ---------------------------------------------------------------------------------------------------
# verdicts on synthetic curves


def test_identical_runs_pass():
    res = compare_runs(make_run(base_metrics()), make_run(base_metrics()))
    assert res.passed
    assert list(res.metrics) == ["lm_loss", "mtp_1_loss", "tokens"]
    for m in res.metrics.values():
        assert m.n_compared == 200 and m.n_failed == 0 and m.first_fail_step is None and m.max_rel_diff == 0.0


def test_injected_drift_is_found_at_the_right_step():
    cand = base_metrics()
    # relative drift 1.5e-4 * (s - 135) from step 136: 1.5e-4 passes the 2e-4 default, 3e-4 at 137 fails
    for s in range(136, 201):
        cand["lm_loss"][s] *= 1.0 + 1.5e-4 * (s - 135)
    res = compare_runs(make_run(base_metrics()), make_run(cand))
    lm = res.metrics["lm_loss"]
    assert not res.passed and not lm.passed and res.metrics["mtp_1_loss"].passed
    assert lm.first_fail_step == 137
    assert lm.n_failed == 200 - 137 + 1
    assert lm.worst_step == 200
    assert lm.max_rel_diff == pytest.approx(1.5e-4 * 65, rel=1e-9)
    assert [v.metric for v in res.violations] == ["lm_loss"]


def test_tolerance_is_relative_to_the_reference():
    # |c - r| <= abs + rel * |r|, checked by hand at r = 4.0: rel 2e-4 allows 8e-4
    ref = make_run({"lm_loss": {1: 4.0, 2: 4.0}})
    cand = make_run({"lm_loss": {1: 4.0 + 7.9e-4, 2: 4.0 + 8.1e-4}})
    lm = compare_runs(ref, cand).metrics["lm_loss"]
    assert lm.ok.tolist() == [True, False]
    assert lm.rel_diff[1] == pytest.approx(8.1e-4 / 4.0, rel=1e-9)
    # abs tolerance on tokens: equal integers pass, one token off fails
    ref = make_run({"tokens": {1: 100.0, 2: 100.0}})
    cand = make_run({"tokens": {1: 100.0, 2: 101.0}})
    assert compare_runs(ref, cand).metrics["tokens"].ok.tolist() == [True, False]


def test_nan_handling():
    ref = make_run({"lm_loss": {1: 2.0, 2: math.nan, 3: 2.0, 4: math.inf}})
    cand = make_run({"lm_loss": {1: 2.0, 2: math.nan, 3: math.nan, 4: math.inf}})
    lm = compare_runs(ref, cand).metrics["lm_loss"]
    assert lm.ok.tolist() == [True, True, False, True]  # both NaN agree, one NaN fails
    assert lm.first_fail_step == 3 and lm.worst_step == 3 and math.isinf(lm.max_rel_diff)


def test_zero_reference_value():
    ref = make_run({"load_balancing_loss": {1: 0.0, 2: 0.0}})
    cand = make_run({"load_balancing_loss": {1: 0.0, 2: 1e-9}})
    m = compare_runs(ref, cand).metrics["load_balancing_loss"]
    assert m.ok.tolist() == [True, False] and m.rel_diff[0] == 0.0 and math.isinf(m.rel_diff[1])
    # an absolute tolerance accepts it
    m = compare_runs(ref, cand, tolerances="load_balancing_loss=abs:1e-8").metrics["load_balancing_loss"]
    assert m.passed


def test_megatron_rule_counts():
    # min(max(n // 100, 1), 50) for n > 1, computed by hand
    for n, allowed in [
        (0, 0),
        (1, 0),
        (2, 1),
        (99, 1),
        (100, 1),
        (199, 1),
        (250, 2),
        (4999, 49),
        (5000, 50),
        (10**6, 50),
    ]:
        assert megatron_allowed_failures(n) == allowed, n


@pytest.mark.parametrize(("bad_steps", "with_rule"), [(2, True), (3, False)])
def test_megatron_rule_verdict(bad_steps, with_rule):
    metrics = {"lm_loss": {s: 3.0 for s in range(1, 251)}}  # n = 250 -> 2 failures allowed
    cand = {"lm_loss": dict(metrics["lm_loss"])}
    for s in (10, 20, 30)[:bad_steps]:
        cand["lm_loss"][s] = 3.1
    strict = compare_runs(make_run(metrics), make_run(cand))
    rule = compare_runs(make_run(metrics), make_run(cand), megatron_rule=True)
    assert not strict.passed and strict.metrics["lm_loss"].allowed_failures == 0
    assert rule.metrics["lm_loss"].allowed_failures == 2
    assert rule.passed is with_rule
    assert rule.metrics["lm_loss"].first_fail_step == 10


def test_window():
    cand = base_metrics()
    for s in range(150, 201):
        cand["lm_loss"][s] += 0.01
    assert compare_runs(make_run(base_metrics()), make_run(cand), window=(1, 149)).passed
    res = compare_runs(make_run(base_metrics()), make_run(cand), window=(140, None))
    lm = res.metrics["lm_loss"]
    assert lm.n_compared == 61 and lm.first_fail_step == 150 and lm.steps[0] == 140


def test_moving_average_matches_naive_formula():
    rng = np.random.default_rng(0)
    y = rng.normal(size=57)
    y[20] = np.nan
    for w in (1, 2, 5, 13):
        got = moving_average(y, w)
        for i in range(y.size):
            window = y[max(0, i - w + 1) : i + 1]
            expected = sum(window) / len(window)  # NaN propagates
            if math.isnan(expected):
                assert math.isnan(got[i]), (w, i)
            else:
                assert got[i] == pytest.approx(expected, rel=1e-12, abs=1e-12), (w, i)


def test_smoothing_absorbs_a_single_spike():
    ref = {"lm_loss": {s: 3.0 for s in STEPS}}
    cand = {"lm_loss": {s: 3.0 for s in STEPS}}
    cand["lm_loss"][50] = 3.0 * (1 + 1e-3)  # rel 1e-3 at one step; over 10 steps the mean moves by 1e-4
    assert compare_runs(make_run(ref), make_run(cand)).metrics["lm_loss"].first_fail_step == 50
    smoothed = compare_runs(make_run(ref), make_run(cand), smooth=10).metrics["lm_loss"]
    assert smoothed.passed and smoothed.max_rel_diff == pytest.approx(1e-4, rel=1e-9)


def test_samples_alignment_with_different_batch_sizes():
    # ref: global batch 8, steps 1..20; cand: global batch 16, steps 1..10; loss is a function of samples
    def f(samples: float) -> float:
        return 5.0 - samples / 100.0

    ref = make_run({"lm_loss": {s: f(8 * s) for s in range(1, 21)}}, samples={s: 8.0 * s for s in range(1, 21)})
    cand_values = {s: f(16 * s) for s in range(1, 11)}
    cand = make_run({"lm_loss": cand_values}, samples={s: 16.0 * s for s in range(1, 11)})
    res = compare_runs(ref, cand, align="samples")
    lm = res.metrics["lm_loss"]
    assert res.passed and lm.n_compared == 10
    assert lm.x.tolist() == [16.0 * k for k in range(1, 11)]
    assert lm.steps.tolist() == list(range(2, 21, 2))  # reference steps
    assert lm.only_ref == 10
    cand_values[7] *= 1.01  # candidate step 7 = 112 samples = reference step 14
    lm = compare_runs(ref, make_run({"lm_loss": cand_values}, samples=cand.consumed_samples), align="samples").metrics[
        "lm_loss"
    ]
    assert lm.first_fail_step == 14 and lm.x[~lm.ok].tolist() == [112.0]
    # by step the same runs do not agree at all
    assert not compare_runs(ref, cand).passed


def test_samples_alignment_from_constant_batch_size():
    ref = make_run({"lm_loss": {s: 1.0 / s for s in range(1, 9)}})
    cand = make_run({"lm_loss": {s: 1.0 / (2 * s) for s in range(1, 5)}})
    with pytest.raises(CompareInputError, match="ref run .* has no consumed samples"):
        compare_runs(ref, cand, align="samples")
    res = compare_runs(ref.with_constant_batch_size(4), cand.with_constant_batch_size(8), align="samples")
    assert res.passed and res.metrics["lm_loss"].steps.tolist() == [2, 4, 6, 8]


def test_step_base_alignment_maxtext_vs_megatron():
    values = [3.0, 2.9, 2.8, 2.7]
    megatron = make_run({"lm_loss": {s + 1: v for s, v in enumerate(values)}}, step_base=1)
    maxtext = make_run({"lm_loss": {s: v for s, v in enumerate(values)}}, step_base=0)
    res = compare_runs(megatron, maxtext)
    assert res.passed and res.metrics["lm_loss"].steps.tolist() == [1, 2, 3, 4]
    maxtext.metrics["lm_loss"][2] = 2.0  # MaxText step 2 = Megatron iteration 3
    assert compare_runs(megatron, maxtext).metrics["lm_loss"].first_fail_step == 3


def test_default_metric_selection():
    ref = make_run(
        {
            "lm_loss": {1: 1.0},
            "iteration-time": {1: 0.5},
            "objective": {1: 1.0},
            "mtp_2_loss": {1: 1.0},
            "mtp_1_loss": {1: 1.0},
        }
    )
    cand = make_run({"lm_loss": {1: 1.0}, "iteration-time": {1: 0.9}, "mtp_2_loss": {1: 1.0}, "mtp_1_loss": {1: 1.0}})
    res = compare_runs(ref, cand)
    assert list(res.metrics) == ["lm_loss", "mtp_1_loss", "mtp_2_loss"]
    assert res.not_compared == ["iteration-time"]
    explicit = compare_runs(ref, cand, metrics=["iteration-time"])
    assert list(explicit.metrics) == ["iteration-time"] and not explicit.passed  # default rel 1e-3


def test_metric_without_overlap_is_skipped_by_default():
    ref = make_run({"lm_loss": {1: 1.0, 2: 1.0}, "grad_norm": {1: 1.0}})
    cand = make_run({"lm_loss": {1: 1.0, 2: 1.0}, "grad_norm": {2: 1.0}})
    res = compare_runs(ref, cand)
    assert list(res.metrics) == ["lm_loss"] and "grad_norm" in res.skipped


# ---------------------------------------------------------------------------------------------------
# tolerances


def test_parse_tolerances():
    got = parse_tolerances("lm_loss=1e-3,mtp_1_loss=rel:1e-3,grad_norm=abs:0.01, tokens = rel:1e-6+abs:2")
    assert got == {
        "lm_loss": Tolerance(rel=1e-3),
        "mtp_1_loss": Tolerance(rel=1e-3),
        "grad_norm": Tolerance(abs=0.01),
        "tokens": Tolerance(rel=1e-6, abs=2.0),
    }
    for bad, needle in [
        ("lm_loss", "metric=tolerance"),
        ("lm_loss=x", "'x' is not a number"),
        ("lm_loss=pct:1", "expected"),
        ("lm_loss=-1", ">= 0"),
        ("a=1,a=2", "given twice"),
        ("lm_loss=rel:1+rel:2", "expected"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_tolerances(bad)


def test_tolerance_lookup_defaults_patterns_and_fallback():
    assert tolerance_for("lm_loss") == Tolerance(rel=2e-4)
    assert tolerance_for("mtp_3_loss") == Tolerance(rel=2e-3)
    assert tolerance_for("tokens") == Tolerance(abs=0.5)
    assert tolerance_for("something_else") == Tolerance(rel=1e-3)
    user = parse_tolerances("mtp_*_loss=rel:1e-2,*=abs:1,lm_loss=5e-4")
    assert tolerance_for("mtp_2_loss", user) == Tolerance(rel=1e-2)
    assert tolerance_for("lm_loss", user) == Tolerance(rel=5e-4)
    assert tolerance_for("grad_norm", user) == Tolerance(abs=1.0)  # the user's * beats the defaults
    assert tolerance_for("grad_norm") == Tolerance(rel=1e-2)


def test_tolerance_mapping_forms():
    ref = make_run({"lm_loss": {1: 1.0}})
    cand = make_run({"lm_loss": {1: 1.0005}})
    assert not compare_runs(ref, cand).passed
    for tol in ({"lm_loss": 1e-3}, {"lm_loss": "rel:1e-3"}, {"lm_loss": Tolerance(abs=1e-3)}, "lm_loss=1e-3"):
        assert compare_runs(ref, cand, tolerances=tol).passed, tol


# ---------------------------------------------------------------------------------------------------
# input errors


def test_input_errors():
    run = make_run({"lm_loss": {1: 1.0}})
    with pytest.raises(CompareInputError, match="no shared canonical metric"):
        compare_runs(run, make_run({"grad_norm": {1: 1.0}}))
    with pytest.raises(CompareInputError, match="no overlapping steps"):
        compare_runs(run, make_run({"lm_loss": {5: 1.0}}))
    with pytest.raises(CompareInputError, match="'grad_norm' is not in the ref and cand run"):
        compare_runs(run, run, metrics=["grad_norm"])
    with pytest.raises(CompareInputError, match="smooth"):
        compare_runs(run, run, smooth=0)
    with pytest.raises(CompareInputError, match="align"):
        compare_runs(run, run, align="time")
    with pytest.raises(CompareInputError, match="window: start 5 is after end 2"):
        compare_runs(run, run, window=(5, 2))
    with pytest.raises(CompareInputError, match="tolerances"):
        compare_runs(run, run, tolerances="lm_loss=abc")


# ---------------------------------------------------------------------------------------------------
# CLI and report


def write_jsonl(path: Path, metrics: dict[str, dict[int, float]]) -> Path:
    steps = sorted({s for v in metrics.values() for s in v})
    with path.open("w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, **{k: v[s] for k, v in metrics.items() if s in v}}) + "\n")
    return path


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lossparity compare")
    add_compare_arguments(parser)
    return cmd_compare(parser.parse_args(argv))


def test_no_loss_compared_is_a_violation_naming_each_side(tmp_path, capsys):
    # issue 26 item 1: a candidate with only lr and an unrecognized train_loss used to pass on lr alone
    ref = write_jsonl(tmp_path / "ref.jsonl", {"lm_loss": {1: 2.5, 2: 2.4}, "lr": {1: 0.1, 2: 0.1}})
    cand = write_jsonl(tmp_path / "cand.jsonl", {"train_loss": {1: 2.5, 2: 2.4}, "lr": {1: 0.1, 2: 0.1}})
    assert cli([str(ref), str(cand)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("lossparity compare: VIOLATION") and "PARITY" not in out
    assert "the reference has lm_loss, lr;" in out
    assert "the candidate has lr, train_loss (no lm_loss or objective)" in out
    assert "--name-map train_loss=objective" in out
    assert cli([str(ref), str(cand), "--json"]) == 1
    assert "no loss compared" in json.loads(capsys.readouterr().out)["no_loss"]
    # the hint works: the mapped name is paired with the reference's lm_loss
    assert cli([str(ref), str(cand), "--cand-name-map", "train_loss=objective"]) == 0
    # asking for lr alone is the user's choice: it passes, and the note says no loss was compared
    res = compare_runs(read_log(ref), read_log(cand), metrics=["lr"])
    assert res.passed and any("no loss among the requested metrics" in n for n in res.notes)


def test_metrics_naming_an_array_valued_field_exits_2_naming_its_line(tmp_path, capsys):
    # issue 26 item 2: the array values are skipped when nobody asks; asking for the metric is an input error
    prefix = "2025-04-07 15:34:27,308 - INFO - { Epoch:[  1/  1], "
    log = tmp_path / "mf.log"
    log.write_text(
        prefix
        + "step:[    1/   2], loss: 10.649, lr: 0.0, global_norm: [1 31049]\n"
        + prefix
        + "step:[    2/   2], loss: 10.633, lr: 1e-05, global_norm: 10.57\n"
    )
    assert cli([str(log), str(log)]) == 0
    out = capsys.readouterr().out
    assert "objective" in out and "not one number skipped (first at line 1" in out
    assert cli([str(log), str(log), "--metrics", "grad_norm"]) == 2
    err = capsys.readouterr().err
    assert "'grad_norm'" in err and "mf.log" in err and "line 1: 'global_norm: [1 31049]'" in err


def test_cli_exit_codes_and_json(tmp_path, capsys):
    ref = write_jsonl(tmp_path / "ref.jsonl", base_metrics())
    drift = base_metrics()
    for s in range(120, 201):
        drift["mtp_1_loss"][s] *= 1.01
    cand = write_jsonl(tmp_path / "cand.jsonl", drift)

    assert cli([str(ref), str(ref)]) == 0
    assert "PARITY" in capsys.readouterr().out

    assert cli([str(ref), str(cand), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is False
    assert out["metrics"]["mtp_1_loss"]["first_fail_step"] == 120
    assert out["metrics"]["mtp_1_loss"]["n_failed"] == 81
    assert out["metrics"]["lm_loss"]["passed"] is True

    assert cli([str(ref), str(cand), "--tol", "mtp_1_loss=rel:2e-2"]) == 0
    assert cli([str(ref), str(cand), "--window", ":119"]) == 0
    assert cli([str(ref), str(cand), "--metrics", "lm_loss,tokens"]) == 0
    capsys.readouterr()

    assert cli([str(ref), str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "lm_loss": 2.0}\n{"step": 2, "lm_loss": \n')
    assert cli([str(ref), str(bad), "--json"]) == 2
    captured = capsys.readouterr()
    assert "bad.jsonl:2" in captured.err and json.loads(captured.out)["exit_code"] == 2
    late = write_jsonl(tmp_path / "late.jsonl", {"lm_loss": {1000: 1.0}})
    assert cli([str(ref), str(late)]) == 2
    assert "no overlapping" in capsys.readouterr().err
    assert cli([str(ref), str(cand), "--align", "samples"]) == 2  # no consumed samples in these logs
    assert cli([str(ref), str(cand), "--align", "samples", "--ref-gbs", "8", "--cand-gbs", "8"]) == 1


def test_cli_across_formats_megatron_vs_lossparity(capsys):
    # the fixtures share steps 1 and 2 with equal values; the learning rate differs at step 4
    code = cli(
        [str(LOGS / "megatron_restart.log"), str(LOGS / "lossparity.jsonl"), "--json", "--missing-steps", "ignore"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    assert set(out["metrics"]) == {"lm_loss", "mtp_1_loss", "load_balancing_loss", "grad_norm", "lr"}
    assert out["metrics"]["lm_loss"]["passed"] and out["metrics"]["lm_loss"]["n_compared"] == 2
    # by default the candidate's lm_loss stopping at step 4 (the reference goes on to 8) is a violation
    assert cli([str(LOGS / "megatron_restart.log"), str(LOGS / "lossparity.jsonl"), "--json"]) == 1
    lm = json.loads(capsys.readouterr().out)["metrics"]["lm_loss"]
    assert not lm["passed"] and lm["missing_in_cand"] == "5-8" and "stops at step 4" in lm["missing_violation"]
    assert out["metrics"]["lr"]["first_fail_step"] == 4
    assert out["ref"]["restarts"] == 1 and out["ref"]["skipped_steps"] == [3, 4]


def test_report_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    ref = write_jsonl(tmp_path / "ref.jsonl", base_metrics())
    drift = base_metrics()
    drift["lm_loss"][77] += 0.05
    cand = write_jsonl(tmp_path / "cand.jsonl", drift)
    report = tmp_path / "report"
    assert cli([str(ref), str(cand), "--report", str(report), "--smooth", "3"]) == 1
    summary = (report / "summary.md").read_text()
    assert "VIOLATION" in summary
    for metric in ("lm_loss", "mtp_1_loss", "tokens"):
        assert f"| {metric} |" in summary
        png = report / f"{metric}.png"
        data = png.read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({metric}.png)" in summary
    assert "| 77 |" in summary  # first failing step of lm_loss


def test_report_without_matplotlib(tmp_path, monkeypatch):
    res = compare_runs(make_run(base_metrics()), make_run(base_metrics()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    files = write_report(res, tmp_path / "r")
    assert files.plots == {} and "matplotlib" in (files.plots_skipped or "")
    summary = files.summary.read_text()
    assert "Plots skipped" in summary and "PARITY" in summary
    assert all(f"| {m} |" in summary for m in ("lm_loss", "mtp_1_loss", "tokens"))
    assert not list((tmp_path / "r").glob("*.png"))


# ---------------------------------------------------------------------------------------------------
# issue 15: cross-framework names, missing steps, option names, usability, start-up


def megatron_line(step: int, total: int, loss: float, grad_norm: float) -> str:
    """One Megatron-LM metric line as training.py prints it (7 significant digits, closing '|')."""
    return (
        f" [2026-03-01 10:00:{step:02d}] iteration {step:8d}/{total:8d} | consumed samples: {8 * step:12d} | "
        f"elapsed time per iteration (ms): 1500.0 | learning rate: 1.000000E-04 | global batch size:     8 | "
        f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {grad_norm:.3f} | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |"
    )


def live_megatron_log(path: Path, run: Run, stop: int, total: int, drift_from: int | None = None) -> Path:
    """A Megatron log still being written: the objective and grad norm of ``run`` up to step ``stop`` (the loss
    ×1.03 from ``drift_from`` on), then a last line cut inside its loss number, without a newline."""
    losses = {s: v for s, v in run.metrics["objective"].items() if s <= stop}
    scale = {s: 1.03 if drift_from and s >= drift_from else 1.0 for s in losses}
    lines = [megatron_line(s, total, v * scale[s], run.metrics["grad_norm"][s]) for s, v in sorted(losses.items())]
    nxt = max(losses) + 1
    torn = megatron_line(nxt, total, 9.87654, 1.0)
    path.write_text("training ...\n" + "\n".join(lines) + "\n" + torn[: torn.index("lm loss: ") + 12])
    return path


def test_live_megatron_against_torchtitan_without_flags(tmp_path, capsys):
    # done-when of issue 15: lm loss (Megatron) vs loss (torchtitan) paired by default, the live last line ignored
    titan = read_log(LOGS / "torchtitan.log")
    ref = LOGS / "torchtitan.log"
    cand = live_megatron_log(tmp_path / "megatron.log", titan, 2, 10)
    assert cli([str(ref), str(cand)]) == 0
    out = capsys.readouterr().out
    assert "PARITY" in out and "objective (cand: lm_loss)" in out
    assert "paired the reference's objective ('loss') with the candidate's lm_loss ('lm loss')" in out
    assert "still being written" in out and "last line 4 ignored" in out
    drifted = live_megatron_log(tmp_path / "drift.log", titan, 3, 10, drift_from=2)
    assert cli([str(ref), str(drifted), "--json"]) == 1
    obj = json.loads(capsys.readouterr().out)["metrics"]["objective"]
    assert obj["first_fail_step"] == 2 and obj["cand_metric"] == "lm_loss"


def test_pairing_only_when_each_side_has_one_of_the_two():
    lm = make_run({"lm_loss": {1: 2.0, 2: 1.5}, "mtp_1_loss": {1: 2.1, 2: 1.6}})
    obj = make_run({"objective": {1: 2.0, 2: 1.5}})
    res = compare_runs(lm, obj)
    assert list(res.metrics) == ["lm_loss"] and res.metrics["lm_loss"].cand_metric == "objective"
    assert "mtp_1_loss" in res.notes[0]  # the objective side may include the MTP term: said
    both = make_run({"objective": {1: 2.0, 2: 1.5}, "lm_loss": {1: 2.0, 2: 1.5}})
    assert list(compare_runs(both, obj).metrics) == ["objective"] and not compare_runs(both, obj).notes


def test_total_loss_is_compared_by_default():
    run = read_log(LOGS / "golden_resumed.json")
    res = compare_runs(run, run)
    assert set(res.metrics) == {"lm_loss", "objective"} and "total loss" not in res.not_compared


def ten_steps(stop: int = 10, skip: tuple[int, ...] = ()) -> Run:
    return make_run({"lm_loss": {s: loss_curve(s) for s in range(1, stop + 1) if s not in skip}})


def test_candidate_that_stops_early_is_a_violation_by_default(tmp_path, capsys):
    # defect 8: a candidate that stops at step 6 of 10 gave PARITY
    res = compare_runs(ten_steps(), ten_steps(stop=6))
    lm = res.metrics["lm_loss"]
    assert not res.passed and lm.n_failed == 0 and lm.missing_cand == [7.0, 8.0, 9.0, 10.0]
    assert "stops at step 6, before the reference's last step 10" in (lm.missing_violation or "")
    assert compare_runs(ten_steps(), ten_steps(stop=6), missing_steps="ignore").passed
    assert compare_runs(ten_steps(stop=6), ten_steps()).passed  # a longer candidate is fine
    late = make_run({"lm_loss": {s: loss_curve(s) for s in range(4, 11)}})
    assert "starts at step 4" in (compare_runs(ten_steps(), late).metrics["lm_loss"].missing_violation or "")
    ref = write_jsonl(tmp_path / "ref.jsonl", ten_steps().metrics)
    cand = write_jsonl(tmp_path / "cand.jsonl", ten_steps(stop=6).metrics)
    assert cli([str(ref), str(cand)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION" in out and "4/0" in out and "the candidate lacks 4 reference steps (7-10)" in out


def test_interior_gaps_fail_only_with_require_all_steps():
    gappy = ten_steps(skip=(4, 5))
    assert compare_runs(ten_steps(), gappy).passed  # reported, not failed
    assert compare_runs(ten_steps(), gappy).metrics["lm_loss"].missing_cand == [4.0, 5.0]
    strict = compare_runs(ten_steps(), gappy, missing_steps="all")
    assert not strict.passed and "lacks 2 reference steps (4-5)" in strict.metrics["lm_loss"].missing_violation
    # a candidate that logs every 5 steps is sparser, not truncated
    sparse = make_run({"lm_loss": {s: loss_curve(s) for s in (1, 6)}})
    assert compare_runs(ten_steps(), sparse).passed


def test_unknown_tol_and_metrics_names_are_input_errors(tmp_path, capsys):
    ref = write_jsonl(tmp_path / "ref.jsonl", base_metrics())
    assert cli([str(ref), str(ref), "--tol", "loss=0.05"]) == 2
    err = capsys.readouterr().err
    assert "'loss' matches no compared metric; compared: lm_loss, mtp_1_loss, tokens" in err
    titan = str(LOGS / "torchtitan.log")
    assert cli([titan, titan, "--tol", "loss=0.05"]) == 2
    assert "(the log name 'loss' is 'objective' here)" in capsys.readouterr().err
    assert cli([str(ref), str(ref), "--tol", "mtp_*_loss=0.05,*=1e-3"]) == 0
    capsys.readouterr()
    assert cli([str(ref), str(ref), "--metrics", "loss"]) == 2
    assert "available: ref has lm_loss, mtp_1_loss, tokens" in capsys.readouterr().err


def test_wandb_step_counter_from_zero_meets_hf_steps(tmp_path):
    # defect 9: W&B's Step 0 is the first logged step (step_base 0); an HF-style log numbers it 1
    hf = write_jsonl(tmp_path / "hf.jsonl", {"objective": {1: 2.5, 2: 2.25, 3: 2.125}})
    res = compare_runs(read_log(hf), read_log(LOGS / "wandb_step0.csv"))
    assert res.passed and res.metrics["objective"].n_compared == 3


def test_usability_messages(tmp_path, capsys, monkeypatch):
    # defect 10: the --align samples hint printed a literal '--{role}-gbs'
    with pytest.raises(CompareInputError, match="--ref-gbs"):
        compare_runs(ten_steps(), ten_steps(), align="samples")
    # two HF runs both named trainer_state.json are told apart in summary.md
    for d in ("runA", "runB"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "trainer_state.json").write_text((LOGS / "trainer_state.json").read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = tmp_path / "report"
    assert (
        cli(
            [
                str(tmp_path / "runA" / "trainer_state.json"),
                str(tmp_path / "runB" / "trainer_state.json"),
                "--report",
                str(report),
            ]
        )
        == 0
    )
    summary = (report / "summary.md").read_text()
    assert "`runA/trainer_state.json`" in summary and "`runB/trainer_state.json`" in summary
    assert "plots skipped: matplotlib is not installed" in capsys.readouterr().err


def _lossparity(args: list[str], block: str = "", stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    """Run the ``lossparity`` entry point in a fresh interpreter; ``block`` names modules made unimportable."""
    src = Path(__file__).resolve().parents[1] / "src"
    probe = (
        "import sys\n"
        f"for name in {block.split()!r}: sys.modules[name] = None\n"
        "from lossparity.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "loaded = sorted({m.split('.')[0] for m, v in sys.modules.items() if v is not None})\n"
        "print('LOADED', ' '.join(loaded), file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [sys.executable, "-c", probe, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=120
    )


def test_log_tools_run_with_torch_blocked(tmp_path):
    # defect 11: compare, gap and modes --no-check must not need torch (nor NumPy for --help)
    out = _lossparity(["compare", "--help"], block="torch numpy")
    assert out.returncode == 0 and "--missing-steps" in out.stdout
    out = _lossparity(["compare", str(LOGS / "torchtitan.log"), str(LOGS / "torchtitan.log")], block="torch")
    assert out.returncode == 0 and "PARITY" in out.stdout
    assert "numpy" in out.stderr.split("LOADED")[1].split()  # the comparison itself uses NumPy
    out = _lossparity(["modes", "--no-check"], block="torch numpy")
    assert out.returncode == 0 and "per_token" in out.stdout
    dump = tmp_path / "samples"
    dump.mkdir()
    (dump / "samples_rank0.bin").write_bytes(struct.pack("<8d", 1, 0, 2, 3.0, 1, 1, 4, 2.0))
    out = _lossparity(["gap", str(dump), "--bootstrap", "10"], block="torch")
    assert out.returncode == 0 and "overall" in out.stdout, out.stderr


def test_broken_pipe_ends_quietly(tmp_path):
    ref = write_jsonl(tmp_path / "ref.jsonl", base_metrics())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from lossparity.cli import main; sys.exit(main())",
            "compare",
            str(ref),
            str(ref),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write (what `| head` does once it has its lines)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err  # 128 + SIGPIPE, as a shell reports a producer killed by SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err


# ---------------------------------------------------------------------------------------------------
# the real logs of ../shared/reallogs: a +3% drift is caught at the right step; a garbled number exits 2

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "reallogs"
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="../shared/reallogs is not present in this checkout")

# readable real log -> the metric the drift goes into (grad_norm where the printed loss is 0.000)
REAL_DRIFT = {
    "golden_bert_resume_dev_h100.json": "lm_loss",
    "golden_bert_resume_dev_h100_2nd.json": "lm_loss",
    "golden_gpt_defer_wgrad_dev_a100.json": "lm_loss",
    "golden_gpt_defer_wgrad_lts_a100.json": "lm_loss",
    "golden_gpt_distill_total_loss_dev_h100.json": "objective",
    "golden_gpt_tp1_pp2_fp16_legacy_dev_a100.json": "lm_loss",
    "golden_mixtral_8x7b_dev_h100.json": "lm_loss",
    "golden_mixtral_8x7b_lts_a100.json": "lm_loss",
    "golden_moe_mtp_fp8_dev_h100.json": "lm_loss",
    "golden_nemotron_mtp2_dev_gb200.json": "lm_loss",
    "golden_t5_listform_lts_a100.json": "lm_loss",
    "hf_trainer_state_cpt_seq2seq.json": "objective",
    "hf_trainer_state_tinyllama_sft.json": "objective",
    "llamafactory_trainer_log_mistral_translator.jsonl": "objective",
    "maxtext_deepseek2_16b_docs.log": "objective",
    "maxtext_maxtest_getting_started.log": "objective",
    "megatron_gpt2_345m_4pp.log": "lm_loss",
    "megatron_gpt2_345m_4tp.log": "lm_loss",
    "megatron_lm_fl_qwen3_default0_prefix.log": "lm_loss",
    "megatron_mixtral_issue756_excerpt.log": "lm_loss",
    "megatron_moe_ep1_clean_2024.log": "lm_loss",
    "megatron_moe_ep2_terminal_wrapped.log": "lm_loss",
    "mindformers_llama2_13b_docs.log": "objective",
    "mindformers_llama3_1_8b_skip_docs.log": "grad_norm",
    "torchtitan_llama3_debug_h200_10steps.log": "objective",
    "torchtitan_losscompare_llama3_cuda.txt": "objective",
    "torchtitan_losscompare_llama3_rocm_mi350x.txt": "objective",
    "torchtitan_pr2389_multirank_excerpt.log": "objective",
    "torchtitan_pr3393_excerpt.log": "objective",
    "wandb_export_brisk_pond_train_loss.csv": "objective",
}


@needs_real
@pytest.mark.parametrize("name", sorted(REAL_DRIFT))
def test_real_log_drift_is_caught_at_the_right_step(name):
    run = read_log(REAL / name)
    metric = REAL_DRIFT[name]
    steps = sorted(run.metrics[metric])
    k = steps[len(steps) // 2]
    drifted = Run(
        source="drifted",
        format=run.format,
        step_base=run.step_base,
        metrics={metric: {s: v * (1.03 if s >= k else 1.0) for s, v in run.metrics[metric].items()}},
    )
    assert compare_runs(run, run, metrics=[metric]).passed
    res = compare_runs(run, drifted, metrics=[metric])
    assert not res.passed and res.metrics[metric].first_fail_step == k


@needs_real
def test_real_megatron_log_drift_written_into_the_file(tmp_path):
    # the drift goes into the text itself, so the reader is part of the check
    src = REAL / "megatron_gpt2_345m_4tp.log"

    def bump(m: re.Match[str]) -> str:
        return f"lm loss: {float(m.group(1)) * 1.03:.6E}"

    lines = src.read_text().splitlines(keepends=True)
    out = [
        re.sub(r"lm loss: (\S+)", bump, line) if re.search(r"iteration +(1[1-9]\d\d|2000)/", line) else line
        for line in lines
    ]
    drifted = tmp_path / "drifted.log"
    drifted.write_text("".join(out))
    res = compare_runs(read_log(src), read_log(drifted), metrics=["lm_loss"])
    assert res.metrics["lm_loss"].first_fail_step == 1100 and res.metrics["lm_loss"].n_failed == 10


@needs_real
def test_real_mindformers_docs_log_compares_every_loss_and_rejects_grad_norm(capsys):
    log = str(REAL / "mindformers_llama2_13b_docs.log")
    assert cli([log, log]) == 0
    out = capsys.readouterr().out
    assert re.search(r"objective +rel 0.0002 +5 ", out) and "'global_norm' (grad_norm)" in out
    assert cli([log, log, "--metrics", "grad_norm"]) == 2
    assert "line 1: 'global_norm: [1 31049]'" in capsys.readouterr().err


# format -> a loss number (the middle match in the file): its first decimal digit is replaced by the letter O
GARBLE = {
    "megatron": r"lm loss: +\d+\.(\d)",
    "megatron_golden": r"(?<![\w.\"])\d+\.(\d)",
    "hf_trainer_state": r"\"loss\": \d+\.(\d)",
    "llamafactory": r"\"loss\": \d+\.(\d)",
    "maxtext": r"\bloss: \d+\.(\d)",
    "torchtitan": r"\bloss: +\d+\.(\d)",
    "torchtitan_losses": r"(?m)^\d+ \d+\.(\d)",
    "mindformers": r"\bloss: \d+\.(\d)",
    "csv": r"(?m)^\d+,\d+\.(\d)",
}


@needs_real
@pytest.mark.parametrize("name", sorted(REAL_DRIFT))
def test_real_log_with_a_garbled_number_exits_2(tmp_path, name, capsys):
    fmt = read_log(REAL / name).format
    text = (REAL / name).read_text()
    found = list(re.finditer(GARBLE[fmt], text))
    assert found
    pos = found[len(found) // 2].end() - 1  # a line in the middle: the format is still detected
    bad = tmp_path / name
    bad.write_text(text[:pos] + "O" + text[pos + 1 :])
    assert cli([str(REAL / name), str(bad)]) == 2
    err = capsys.readouterr().err
    assert name in err and ("log error" in err)
    if fmt not in ("megatron_golden", "hf_trainer_state"):  # JSON documents name line and column instead
        assert f"{name}:{text[:pos].count(chr(10)) + 1}:" in err


def test_array_alignment_matches_a_naive_dict_alignment():
    """The array alignment of ``compare_runs`` (steps and sample counts matched with NumPy set operations)
    against a naive dict-based pairing written from the module docstring, on 200 random pairs of runs with
    gaps, restarts of numbering (step bases), windows and shared sample counts."""
    import random

    from lossparity.parity import Run, compare_runs

    rng = random.Random(1)
    for trial in range(200):
        align = "samples" if trial % 3 == 0 else "step"
        base_r, base_c = rng.choice([0, 1]), rng.choice([0, 1])

        def make(base):
            steps = sorted(rng.sample(range(base, base + 60), rng.randint(5, 40)))
            vals = {s: rng.choice([1.0, 2.0]) for s in steps}
            samples = {s: float(8 * (s // rng.choice([1, 2]))) for s in steps if rng.random() < 0.9}
            return Run(source="x", format="jsonl", metrics={"lm_loss": vals}, consumed_samples=samples, step_base=base)

        ref, cand = make(base_r), make(base_c)
        lo = rng.choice([None, 10.0])
        hi = rng.choice([None, 45.0])
        window = None if lo is None and hi is None else (lo, hi)

        def points(run, offset, align=align, lo=lo, hi=hi):
            if align == "step":
                pts = {float(s + offset): (s, v) for s, v in sorted(run.metrics["lm_loss"].items())}
            else:
                pts = {
                    float(run.consumed_samples[s]): (s, v)
                    for s, v in sorted(run.metrics["lm_loss"].items())
                    if s in run.consumed_samples
                }
            return {x: p for x, p in pts.items() if (lo is None or x >= lo) and (hi is None or x <= hi)}

        rp, cp = points(ref, 0), points(cand, base_r - base_c)
        xs = sorted(set(rp) & set(cp))
        if not xs:
            with pytest.raises(CompareInputError):
                compare_runs(ref, cand, align=align, window=window, missing_steps="ignore")
            continue
        m = compare_runs(ref, cand, align=align, window=window, missing_steps="ignore").metrics["lm_loss"]
        assert m.x.tolist() == xs
        assert m.steps.tolist() == [rp[x][0] for x in xs]
        assert m.ref.tolist() == [rp[x][1] for x in xs] and m.cand.tolist() == [cp[x][1] for x in xs]
        assert m.missing_cand == sorted(set(rp) - set(cp)) and m.missing_ref == sorted(set(cp) - set(rp))


def test_no_overlap_names_the_unit_and_not_compared_names_are_cut_at_50():
    """``align="samples"`` without shared sample counts says "sample counts"; a report lists the first 50
    of the shared non-canonical names and how many more."""
    from lossparity.parity import Run, compare_runs
    from lossparity.parity.report import format_text

    a = Run(source="a", format="jsonl", metrics={"lm_loss": {1: 1.0}}, consumed_samples={1: 8.0})
    b = Run(source="b", format="jsonl", metrics={"lm_loss": {1: 1.0}}, consumed_samples={1: 16.0})
    with pytest.raises(CompareInputError, match="no overlapping sample counts"):
        compare_runs(a, b, align="samples")
    extra = {f"m{i:03d}": {1: 0.5} for i in range(120)}
    ref = Run(source="r", format="jsonl", metrics={"lm_loss": {1: 1.0}, **extra})
    text = format_text(compare_runs(ref, ref))
    line = next(ln for ln in text.splitlines() if "not compared" in ln)
    assert "m049" in line and "m050" not in line and "and 70 more" in line
