"""The command line's text for people (issue 28): help without markup or repository paths, a compare console
that fits a screen on every pair of real logs, ranges instead of lists, the report's path, readable plots, and
error messages that read naturally."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from lossparity.cli import build_parser, main
from lossparity.parity import Run, compare_runs
from lossparity.parity.compare import describe_points, step_ranges
from lossparity.parity.report import format_text, metric_figure

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "reallogs"
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason="../shared/reallogs is not present in this checkout")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["", *subcommands()])
def test_help_has_no_markup_and_no_repository_paths(command):
    code, out, _ = run_cli([command, "--help"] if command else ["--help"])
    assert code == 0 and out.startswith("usage: lossparity")
    for bad in ("``", ":func:", ":class:", "docs/", ".md §", "§"):
        assert bad not in out, f"{bad!r} in the help of {command or 'lossparity'}"


def test_every_subcommand_is_covered():
    assert subcommands() == ["audit", "compare", "convert-checkpoint", "gap", "modes", "train", "verify"]


def test_verify_quick_help_gives_its_expected_time():
    _, out, _ = run_cli(["verify", "--help"])
    assert "about 2.5 min on 2 CPU cores" in " ".join(out.split())


# ---------------------------------------------------------------------------------------------------
# ranges instead of lists


def test_step_ranges_join_runs_and_progressions():
    assert step_ranges([3, 7, 8, 9, 10, 14]) == "3, 7-10, 14"  # as before for consecutive steps
    every15 = [*range(15, 1500, 15), *range(1515, 2791, 15)]  # 1500 absent: two progressions
    assert step_ranges(every15) == "15-1485 every 15, 1515-2790 every 15"
    assert step_ranges([500, 1000, 2000, 2500, 3000]) == "500, 1000, 2000-3000 every 500"
    assert step_ranges([1, 4, 9, 16, 25, 36], limit=4) == "1, 4, 9, ... (2 more), 36"
    assert describe_points(every15) == "185 steps (15-1485 every 15, 1515-2790 every 15)"
    assert describe_points([6], "reference step") == "1 reference step (6)"


def _run(name: str, steps, value=lambda s: 10.0 / s, skipped=()) -> Run:
    metrics = {"lm_loss": {s: value(s) for s in steps}, "lr": {s: 1e-4 * s for s in steps}}
    return Run(source=name, format="jsonl", metrics=metrics, skipped_steps=set(skipped))


def test_compare_console_gives_counts_and_ranges_once_for_all_metrics():
    ref, cand = _run("ref", range(500, 5001, 500)), _run("cand", range(15, 2791, 15))
    text = format_text(compare_runs(ref, cand))
    lines = text.splitlines()
    assert (
        "  lm_loss, lr: the candidate lacks 9 reference steps (500, 1000, 2000-5000 every 500); "
        "the reference lacks 185 candidate steps (15-1485 every 15, 1515-2790 every 15)"
    ) in lines
    assert sum(line.startswith("  lm_loss, lr:") for line in lines) == 2  # the missing points, the span failure
    assert "not compared: 5 reference steps (3000-5000 every 500)" in text


def test_compare_names_the_skipped_steps_that_decide_the_verdict():
    # the candidate skipped an iteration at step 30 that the reference did not: its lr lags from there on
    steps = range(10, 101, 10)
    ref = _run("ref", steps, skipped=[10])
    cand = _run("cand", steps, skipped=[10, 30])
    cand.metrics["lr"] = {s: 1e-4 * (s if s < 30 else s - 1) for s in steps}
    text = format_text(compare_runs(ref, cand))
    assert "steps flagged skipped/NaN by the logs: 10 (both logs), 30 (candidate only)" in text
    assert "  lr: its first failure, step 30, is flagged skipped/NaN (candidate only)" in text
    assert "lm_loss:" not in text.split("steps flagged")[1]  # lm_loss passes: nothing to explain
    # the lr schedule lags one step later: the failure follows the step only the candidate skipped
    cand.metrics["lr"] = {s: 1e-4 * (s if s < 40 else s - 1) for s in steps}
    text = format_text(compare_runs(ref, cand))
    assert "  lr: fails from step 40, after step 30 that only one log flags as skipped/NaN (candidate only)" in text
    from lossparity.parity.report import summary_markdown

    assert "- lr: fails from step 40, after step 30" in summary_markdown(compare_runs(ref, cand), {}, "test")
    # a reference format that never reports skipped iterations (no flag at all) explains nothing
    ref.skipped_steps = set()
    assert "fails from step 40, after" not in format_text(compare_runs(ref, cand))


def test_notes_that_differ_only_in_their_line_are_joined():
    run = _run("ref", range(1, 5))
    run.notes = [f"line {n}: a metric line hard-wrapped by the terminal was joined" for n in (1, 9, 11, 13)]
    text = format_text(compare_runs(run, run))
    assert "  note (ref): lines 1, 9-13 every 2: a metric line hard-wrapped by the terminal was joined" in text


def test_report_path_is_printed(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step": s, "lm_loss": 2.0 / s}) + "\n" for s in range(1, 4)))
    code, out, err = run_cli(["compare", str(log), str(log), "--report", str(tmp_path / "rep")])
    assert code == 0 and "PARITY" in out
    assert f"lossparity compare: report written to {tmp_path / 'rep' / 'summary.md'} and 1 plot(s)" in err


def test_plot_draws_markers_and_a_visible_band_for_one_point():
    pytest.importorskip("matplotlib")
    ref, cand = _run("ref", [7]), _run("cand", [7], value=lambda s: 10.0 / s * (1 + 3e-6))
    m = compare_runs(ref, cand, tolerances="lr=1e-5,lm_loss=1e-5").metrics["lm_loss"]
    fig = metric_figure(m, "step", 1)
    top, bottom = fig.axes[:2]
    assert all(line.get_marker() not in (None, "None", "") for line in top.get_lines())  # a point is visible
    assert bottom.get_yscale() == "symlog"  # the 1e-5 band is the axis' linear part: visible at any scale
    band = [c for c in bottom.collections if c.get_label() == "tolerance"][0]
    xs = band.get_paths()[0].vertices[:, 0]
    assert np.ptp(xs) > 0  # a single point's band has a width


def test_missing_log_and_unknown_format_read_naturally(tmp_path):
    code, _, err = run_cli(["compare", str(tmp_path / "nope.log"), str(tmp_path / "nope.log")])
    assert code == 2 and err.strip() == f"lossparity compare: error: the log {tmp_path / 'nope.log'} does not exist"
    with pytest.raises(SystemExit):
        build_parser("compare").parse_args(["compare", "a", "b", "--format", "foo"])
    code, _, err = run_cli(["compare", "a", "b", "--format", "foo"])
    assert code == 2 and err.count("megatron_golden") == 1 and "unknown log format 'foo'" in err


def test_gap_without_a_dump_names_the_flag_that_writes_one(tmp_path):
    code, _, err = run_cli(["gap", str(tmp_path)])
    assert code == 2 and "lossparity train --dump-samples" in err


# ---------------------------------------------------------------------------------------------------
# every pair of real logs fits a screen


@needs_real
def test_compare_console_fits_a_screen_on_every_pair_of_real_logs():
    # 31 inputs, 961 ordered pairs (each log with itself too): about 4 s on one core
    names = sorted(p.name for p in REAL.iterdir() if p.name != "SOURCES.md")
    assert len(names) > 20
    too_long = []
    for a, b in itertools.product(names, names):
        code, out, err = run_cli(["compare", str(REAL / a), str(REAL / b)])
        text = out + err
        if len(text.splitlines()) > 40 or len(text) > 3000:
            too_long.append((a, b, len(text.splitlines()), len(text)))
        assert code in (0, 1, 2) and "Traceback" not in text
    assert not too_long


# ---------------------------------------------------------------------------------------------------
# verify: a legend after the table


def test_verify_prints_a_legend_of_its_columns_and_references(monkeypatch):
    import lossparity.verify.reference as verify

    diffs = {c: 0.0 for c in ("objective", "lm_loss", "logs", "grad_norm", "params", "bias")}
    rows = [
        {"layout": "D2", "mode": "per_token", "reference": "1x1", "diffs": diffs, "pass": True},
        {"layout": "D2", "mode": "per_microbatch", "reference": "K=4", "diffs": diffs, "pass": True},
        {"layout": "C2", "mode": "per_token", "reference": "1x1/no-indexer", "diffs": diffs, "pass": True},
    ]
    report = {"rows": rows, "tolerance": 1e-10, "wall_s": 1.0, "steps": 2, "layout_wall_s": {}, "config": {}}
    monkeypatch.setattr(verify, "run_verify", lambda *a, **k: report)  # the table's text, not the runs
    code, out, _ = run_cli(["verify", "--layouts", "D2"])
    assert code == 0
    legend = " ".join(out.split("PASS (tolerance")[1].split())
    assert "logs = every other logged metric" in legend and "PASS: every cell <= 1e-10" in legend
    assert "vs: 1x1 = the same model in one process without gradient accumulation" in legend
    assert "K=4 = one process accumulating that many microbatches of the layout's microbatch size" in legend
    assert "/no-indexer" in legend


# ---------------------------------------------------------------------------------------------------
# the documentation page of this output runs as written


def test_cli_output_page_code_blocks_run(capsys):
    import re

    page = Path(__file__).resolve().parents[1] / "docs" / "cli-output.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"cli-output.md block {i}", "exec"), {})
    out = capsys.readouterr().out
    assert "FAIL: no loss compared: the reference has lm_loss, lr; the candidate has lr, train_loss" in out


@pytest.mark.parametrize("module", ["lossparity", "lossparity.cli"])
def test_python_dash_m_runs_the_command(module):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", module, "modes", "--no-check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("| mode | objective J |")
