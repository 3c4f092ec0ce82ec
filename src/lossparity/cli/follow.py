"""CLI glue of ``lossparity compare REF CAND --follow``: follow a growing candidate log step by step.

Prints one line per newly compared step, then the outcome. Exit codes: 0 parity (the candidate covered the
reference, or reached ``--until``), 1 the first violation (its step, metric, values and tolerance on the
last line; ``--report DIR`` writes ``parity_report.md``/``.json``), 2 bad input, or no verdict: the
candidate stopped growing for ``--idle`` seconds.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_follow_arguments", "cmd_follow"]

_NOT_WITH_FOLLOW = (("window", "--window"), ("ref_gbs", "--ref-gbs"), ("cand_gbs", "--cand-gbs"))


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def add_follow_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--follow``, ``--until STEP``, ``--idle SECONDS`` and ``--poll SECONDS`` to ``compare``."""
    parser.add_argument(
        "--follow",
        action="store_true",
        help="CAND is still being written: compare each new step as it appears, stop at the first violation",
    )
    parser.add_argument("--until", type=int, default=None, metavar="STEP", help="with --follow: stop at this step")
    parser.add_argument(
        "--idle",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="with --follow: give up after this long without growth (default 300)",
    )
    parser.add_argument(
        "--poll", type=_seconds, default=1.0, metavar="SECONDS", help="with --follow: check interval (default 1)"
    )


def _say(text: str) -> None:
    print(text, flush=True)


def cmd_follow(args: argparse.Namespace) -> int:
    """``compare --follow`` (module docstring); returns the exit code."""
    from ..parity.follow import follow_log
    from ..parity.guard import ParityGuard
    from ..parity.names import parse_name_map
    from ..parity.readers import LogParseError, Run
    from ._common import load_run as _load
    from ._common import report_input_error as _error

    if not args.follow:
        return _error("compare", args, "input error", ValueError("--until needs --follow"))
    for attr, flag in _NOT_WITH_FOLLOW:
        if getattr(args, attr, None) is not None:
            return _error("compare", args, "input error", ValueError(f"{flag} is not supported with --follow"))
    if args.align != "step":
        return _error("compare", args, "input error", ValueError("--follow compares by step (no --align samples)"))
    try:
        ref = _load(args, "ref")
        cand_map = {**parse_name_map(args.name_map), **parse_name_map(args.cand_name_map)} or None
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None

        def make_guard(first: Run) -> ParityGuard:
            return ParityGuard(
                ref,
                metrics=metrics,
                tol=args.tol or None,
                rule="megatron" if args.megatron_rule else None,
                missing_steps=args.missing_steps,
                smooth=args.smooth,
                name_map=cand_map,
                step_base=first.step_base if args.cand_step_base is None else args.cand_step_base,
                report_dir=args.report,
                source=args.cand,
            )

        out = follow_log(
            args.cand,
            make_guard,
            fmt=args.cand_format or args.fmt,
            name_map=cand_map,
            poll=args.poll,
            idle=args.idle,
            until=args.until,
            on_verdict=None if args.json else lambda v: _say(v.line()),
        )
    except (OSError, ValueError) as e:  # LogParseError and CompareInputError are ValueErrors
        return _error("compare", args, "log error" if isinstance(e, (LogParseError, OSError)) else "input error", e)
    if out.outcome == "stalled":
        print(f"lossparity compare: error: {out.message}", file=sys.stderr)
        if args.json:
            print(json.dumps({"outcome": "stalled", "last_step": out.last_step, "exit_code": 2}))
        return 2
    v = out.guard.violation if out.guard is not None else None
    if args.json:
        payload = {"outcome": out.outcome, "last_step": out.last_step, "violation": v.to_dict() if v else None}
        print(json.dumps(payload, indent=2))
    elif v is not None:
        _say(f"VIOLATION: first at step {v.step} ({v.metric})")
        if out.guard is not None and out.guard.report_files:
            _say(f"report: {out.guard.report_files[0]}")
    else:
        _say(f"PARITY: followed to step {out.last_step}, every compared point within tolerance")
    return 1 if v is not None else 0
