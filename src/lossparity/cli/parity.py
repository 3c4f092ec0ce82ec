"""CLI glue of the log tools: ``modes``, ``compare``, ``gap`` (argparse, printing and exit codes live here).

Nothing here imports torch: the log tools start in well under a second and run where torch is not
installed. NumPy is imported only by the commands that compute (``compare``, ``gap``), not by ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..options import ALIGNS, MISSING_STEPS, MODE_INFO
from ..parity.readers import FORMAT_ALIASES, FORMATS
from ._common import load_run as _load
from ._common import report_input_error as _error

if TYPE_CHECKING:  # NumPy-based types, imported by the commands that use them
    from ..parity.compare import CompareResult
    from ..parity.gap import GapReport

__all__ = ["add_compare_arguments", "add_gap_arguments", "cmd_compare", "cmd_gap", "cmd_modes", "positive_int"]


# --------------------------------------------------------------------------------------------------
# argument types


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """argparse type: an integer ``>= low`` and below 2**53 (exact as float64 and int64); anything else is an
    error naming the text."""

    def parse(text: str) -> int:
        try:
            v = int(text) if len(text) < 64 else low - 1  # never Python's int-digits error
        except ValueError:
            v = low - 1
        if not low <= v < 2**53:
            raise argparse.ArgumentTypeError(f"expected {what} below 2**53, got {text[:80]!r}")
        return v

    return parse


positive_int = _int_at_least(1, "a positive integer")  # argparse type: an integer >= 1


def _step_base(text: str) -> int:
    """argparse type of ``--ref-step-base``/``--cand-step-base``: an integer of magnitude below 2**53 (steps
    are exact as float64 and int64)."""
    try:
        v = int(text)
    except ValueError:
        v = 2**53
    if abs(v) >= 2**53:
        raise argparse.ArgumentTypeError(f"expected an integer of magnitude below 2**53, got {text!r}")
    return v


_non_negative_int = _int_at_least(0, "an integer >= 0")


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return v


def _log_format(text: str) -> str:
    """argparse type: a log format name or alias (:data:`FORMATS`, :data:`FORMAT_ALIASES`); an unknown name is
    an error listing the valid names once."""
    key = text.strip().lower()
    key = FORMAT_ALIASES.get(key, key)
    if key not in FORMATS:
        raise argparse.ArgumentTypeError(f"unknown log format {text!r}; valid: {', '.join(FORMATS)}")
    return key


def _parse_window(text: str) -> tuple[float | None, float | None]:
    sep = ":" if ":" in text else ","
    lo, s, hi = text.partition(sep)
    if not s:
        raise argparse.ArgumentTypeError(f"--window: expected START:END (a side may be empty), got {text!r}")
    try:
        return (float(lo) if lo.strip() else None, float(hi) if hi.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window: START and END must be numbers, got {text!r}") from None


# --------------------------------------------------------------------------------------------------
# modes


def cmd_modes(args: argparse.Namespace) -> int:
    """``lossparity modes``: the mode table, the preset table, the self-check (``--no-check`` skips it, and
    with it torch); ``--from/--to`` translate between framework presets."""
    from ..parity.presets import preset_table

    if args.from_preset or args.to_framework or args.show_presets:
        return _modes_translation(args)
    print("| mode | objective J | matches |")
    print("|---|---|---|")
    for name, (formula, who) in MODE_INFO.items():
        print(f"| `{name}` | `{formula}` | {who} |")
    print("\nframework presets (`--preset` of `lossparity train`, `--from/--to` of this command):\n")
    print(preset_table())
    if args.no_check:
        return 0
    from ..selfcheck import run_selfcheck

    print("\nself-check: every mode through the Accountant (K=4, b=2) vs a naive float64 formula")
    rows = run_selfcheck()
    print("| mode | accountant | naive | result |")
    print("|---|---|---|---|")
    for mode, got, ref, ok in rows:
        print(f"| {mode} | {got:.15g} | {ref:.15g} | {'PASS' if ok else 'FAIL'} |")
    return 0 if all(r[3] for r in rows) else 1


def add_modes_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--no-check``, ``--from SRC``, ``--to TGT``, ``--microbatch-size b`` and ``--presets``."""
    from ..parity.presets import FRAMEWORKS

    parser.add_argument("--no-check", action="store_true", help="only print the table")
    parser.add_argument(
        "--from",
        dest="from_preset",
        default=None,
        metavar="SRC",
        help="source preset, e.g. megatron:calculate_per_token_loss=false",
    )
    parser.add_argument(
        "--to",
        dest="to_framework",
        default=None,
        metavar="TGT",
        help=f"target framework ({', '.join(FRAMEWORKS)}) or preset spec",
    )
    parser.add_argument(
        "--microbatch-size",
        dest="microbatch_size",
        type=positive_int,
        default=None,
        metavar="b",
        help="the source's micro-batch size (decides per_microbatch vs per_sample)",
    )
    parser.add_argument(
        "--presets", dest="show_presets", action="store_true", help="print the framework preset table (Markdown)"
    )


def _modes_translation(args: argparse.Namespace) -> int:
    """Exit code: 0 = exact translation (or only the table), 1 = approximate (warnings), 2 = bad input."""
    from ..parity.presets import preset_table, resolve_preset, translate

    src, tgt = args.from_preset, args.to_framework
    if args.show_presets:
        print(preset_table())
        if not (src or tgt):
            return 0
        print()
    if not (src and tgt):
        print("lossparity modes: error: --from SRC and --to TGT go together", file=sys.stderr)
        return 2
    try:
        tr = translate(resolve_preset(src), tgt, args.microbatch_size)
    except ValueError as e:
        print(f"lossparity modes: error: {e}", file=sys.stderr)
        return 2
    print(tr.format())
    return 0 if tr.exact else 1


# --------------------------------------------------------------------------------------------------
# compare


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` command's arguments: positionals ``ref`` and ``cand`` and the options.

    Options: ``--format/--ref-format/--cand-format``, ``--name-map/--ref-name-map/--cand-name-map``,
    ``--metrics``, ``--tol``, ``--window START:END``, ``--smooth N``, ``--megatron-rule``,
    ``--missing-steps span|all|ignore`` (``--require-all-steps`` = ``all``), ``--align step|samples``,
    ``--ref-gbs/--cand-gbs``, ``--ref-step-base/--cand-step-base``, ``--report DIR``, ``--json``.
    """
    parser.add_argument("ref", help="reference log (file or TensorBoard directory)")
    parser.add_argument("cand", help="candidate log (file or TensorBoard directory)")
    parser.add_argument(
        "--format",
        dest="fmt",
        type=_log_format,
        metavar="FORMAT",
        help=f"format of both logs (default: detect): {', '.join(FORMATS)}",
    )
    parser.add_argument("--ref-format", type=_log_format, metavar="FORMAT", help="format of the reference log")
    parser.add_argument("--cand-format", type=_log_format, metavar="FORMAT", help="format of the candidate log")
    parser.add_argument("--name-map", default="", help="raw=canonical,... for both logs")
    parser.add_argument("--ref-name-map", default="", help="raw=canonical,... for the reference log")
    parser.add_argument("--cand-name-map", default="", help="raw=canonical,... for the candidate log")
    parser.add_argument("--metrics", default=None, help="comma-separated metrics (default: shared canonical)")
    parser.add_argument("--tol", default="", help="e.g. lm_loss=1e-3,mtp_1_loss=rel:1e-3,grad_norm=abs:0.01")
    parser.add_argument("--window", type=_parse_window, default=None, help="START:END, inclusive")
    parser.add_argument("--smooth", type=positive_int, default=1, help="trailing moving-average width")
    parser.add_argument(
        "--megatron-rule",
        action="store_true",
        help="allow min(max(n//100,1),50) failing points of n (Megatron functional tests)",
    )
    parser.add_argument(
        "--missing-steps",
        choices=MISSING_STEPS,
        default="span",
        help="span (default): fail when the candidate starts later or stops earlier than the "
        "reference; all: fail on any reference step the candidate lacks; ignore: only report",
    )
    parser.add_argument(
        "--require-all-steps",
        dest="missing_steps",
        action="store_const",
        const="all",
        help="same as --missing-steps all",
    )
    parser.add_argument("--align", choices=ALIGNS, default="step")
    parser.add_argument(
        "--ref-gbs",
        type=positive_int,
        default=None,
        help="reference global batch size (consumed samples for --align samples)",
    )
    parser.add_argument("--cand-gbs", type=positive_int, default=None, help="candidate global batch size")
    parser.add_argument("--ref-step-base", type=_step_base, default=None, help="reference's first step number")
    parser.add_argument("--cand-step-base", type=_step_base, default=None, help="candidate's first step number")
    parser.add_argument("--report", default=None, metavar="DIR", help="write summary.md and plots to DIR")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    from .follow import add_follow_arguments  # --follow, --until, --idle, --poll (cli/follow.py)

    add_follow_arguments(parser)


def cmd_compare(args: argparse.Namespace) -> int:
    """Run ``compare`` from parsed arguments; return the exit code.

    0 = parity, 1 = a metric violates its tolerance or the missing-steps rule, 2 = input error
    (unreadable or unparseable log, bad option, unknown ``--tol``/``--metrics`` name, no shared metric, no
    overlapping steps). Prints a table, or with ``--json`` a JSON object (``{"error": ..., "exit_code": 2}``
    on input errors); errors go to stderr. With ``--report DIR`` writes ``summary.md`` and one PNG per
    metric (a note on stderr when matplotlib is missing and plots are skipped), and for a failing comparison
    ``parity_report.md``/``.json`` with its first violation (as the live guard writes them).
    """
    from ..parity.compare import compare_runs
    from ..parity.readers import LogParseError
    from ..parity.report import format_text, write_report

    if getattr(args, "follow", False) or getattr(args, "until", None) is not None:
        from .follow import cmd_follow  # (which refuses --until without --follow)

        return cmd_follow(args)

    try:
        ref, cand = _load(args, "ref"), _load(args, "cand")
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
        result = compare_runs(
            ref,
            cand,
            tolerances=args.tol or None,
            metrics=metrics,
            window=args.window,
            smooth=args.smooth,
            megatron_rule=args.megatron_rule,
            align=args.align,
            missing_steps=args.missing_steps,
        )
    except FileNotFoundError as e:
        return _error("compare", args, "error", e)
    except (OSError, ImportError, ValueError) as e:  # LogParseError and CompareInputError are ValueErrors
        return _error("compare", args, "log error" if isinstance(e, (LogParseError, OSError)) else "input error", e)
    if args.report:
        try:
            files = write_report(result, args.report)
        except OSError as e:
            return _error("compare", args, "cannot write the report", e)
        plots = f" and {len(files.plots)} plot(s)" if files.plots else ""
        print(f"lossparity compare: report written to {files.summary}{plots}", file=sys.stderr)
        if files.plots_skipped:
            print(f"lossparity compare: note: plots skipped: {files.plots_skipped}", file=sys.stderr)
        _write_violation(result, args.report)  # parity_report.md/.json, as the live guard writes them
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_text(result))
    return 0 if result.passed else 1


def _write_violation(result: CompareResult, out_dir: str) -> None:
    """The first violation of a failing comparison as ``parity_report.md``/``.json`` (nothing when it passes)."""
    from ..parity.violation import violation_from_result, write_violation_report

    v = violation_from_result(result)
    if v is not None:
        write_violation_report(
            v, out_dir, ref_source=result.ref.source, cand_source=result.cand.source, on_violation="report"
        )


# --------------------------------------------------------------------------------------------------
# gap


def add_gap_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``gap`` command's arguments: positional ``source`` (run directory, dump directory or
    ``.npz``) and ``--microbatch-size``, ``--fixed-length``, ``--bootstrap``, ``--seed``, ``--ci``,
    ``--every``, ``--json``, ``--plot``, ``--compare-drift A B``, ``--drift-metric``, ``--log-format``."""
    parser.add_argument("source", help="run directory (with samples/), dump directory, or .npz file")
    parser.add_argument(
        "--microbatch-size", type=positive_int, default=None, help="b for per_microbatch (default: the dump's meta)"
    )
    parser.add_argument(
        "--fixed-length",
        type=positive_int,
        default=None,
        help="L for sample_sum_norm (default: the dump's fixed_length, else its seq_len)",
    )
    parser.add_argument("--bootstrap", type=_non_negative_int, default=1000, help="bootstrap replicates (0: none)")
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the bootstrap's numpy Generator")
    parser.add_argument("--ci", type=_probability, default=0.95, help="confidence level of the intervals")
    parser.add_argument("--every", type=positive_int, default=1, help="summarize blocks of K steps")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--plot", default=None, metavar="PATH.png", help="write the per-step gap plot")
    parser.add_argument(
        "--compare-drift",
        nargs=2,
        default=None,
        metavar=("A_LOG", "B_LOG"),
        help="two training logs (A: per_token run, B: per_sample run): is A−B the estimator gap?",
    )
    parser.add_argument("--drift-metric", default="objective", help="logged metric compared by --compare-drift")
    parser.add_argument(
        "--log-format",
        type=_log_format,
        metavar="FORMAT",
        default=None,
        help=f"format of both drift logs (default: detect): {', '.join(FORMATS)}",
    )


def _run_log_last_step(dump_dir: str) -> int | None:
    """The last step of the run's ``metrics.jsonl`` next to a dump directory (``RUN/samples`` -> ``RUN``), if
    any (read with the log readers' bounds; a step is below 2**53)."""
    from ..parity.readers import read_log

    for d in (os.path.dirname(os.path.abspath(dump_dir)), dump_dir):
        log = os.path.join(d, "metrics.jsonl")
        if os.path.lexists(log):
            run = read_log(log, fmt="jsonl")
            return max((s for series in run.metrics.values() for s in series.keys()), default=None)
    return None


def _gap_report(args: argparse.Namespace) -> GapReport:
    from ..parity.gap import compare_drift, compute_gap, missing_steps
    from ..parity.readers import read_log
    from ..parity.sample_dump import find_dump, read_sample_dump, read_sample_meta

    path = find_dump(args.source)
    meta = read_sample_meta(path)  # its numbers checked: integers below 2**53, sizes >= 1
    notes: list[str] = []
    samples = read_sample_dump(path, notes)
    m = meta or {}
    b = args.microbatch_size if args.microbatch_size is not None else m.get("microbatch_size")
    L = args.fixed_length if args.fixed_length is not None else (m.get("fixed_length") or m.get("seq_len"))
    report = compute_gap(
        samples,
        microbatch_size=b,
        fixed_length=L,
        bootstrap=args.bootstrap,
        seed=args.seed,
        ci=args.ci,
        source=path,
        meta=meta,
    )
    report.notes[:0] = notes
    log_last = None if path.endswith(".npz") else _run_log_last_step(path)
    last = max(max(samples), log_last if log_last is not None else -(2**53))
    first = m["step_base"] if m.get("step_base") is not None else min(samples)
    report.missing = missing_steps(samples, first, last)  # ranges: never the steps of a huge gap one by one
    if args.compare_drift:
        a_log, b_log = args.compare_drift
        run_a, run_b = read_log(a_log, fmt=args.log_format), read_log(b_log, fmt=args.log_format)
        report.drift = compare_drift(report, run_a, run_b, metric=args.drift_metric)
    return report


def cmd_gap(args: argparse.Namespace) -> int:
    """Run ``gap`` from parsed arguments; return the exit code.

    0 = report printed (and, with ``--compare-drift``, the drift is explained by the estimator gap);
    1 = a check failed: the dump lacks steps (between its first step and the last step of the dump or of
    the run's ``metrics.jsonl``; the message names the missing ranges) or the drift is not explained;
    2 = bad input (no or unreadable dump, unreadable log, bad option).
    """
    from ..parity.gap import format_ranges, format_table, missing_count, plot_gap

    if args.compare_drift and args.bootstrap == 0:
        return _error(
            "gap", args, "input error", ValueError("--compare-drift needs the bootstrap interval: use --bootstrap > 0")
        )
    try:
        report = _gap_report(args)
    except (OSError, ValueError) as e:  # SampleDumpError and LogParseError are ValueErrors
        return _error("gap", args, "input error", e)
    if args.plot:
        try:
            plot_gap(report, args.plot)
        except (OSError, ImportError) as e:
            return _error("gap", args, "cannot write the plot", e)
    print(json.dumps(report.to_dict(args.every), indent=2) if args.json else format_table(report, args.every))
    if report.missing:
        print(
            f"lossparity gap: error: the dump lacks step(s) {format_ranges(report.missing)} "
            f"({missing_count(report.missing)} in all: a crash lost them, or "
            "the dump was not written for every step): the report covers only the steps present",
            file=sys.stderr,
        )
        return 1
    return 1 if report.drift is not None and not report.drift.explained else 0
