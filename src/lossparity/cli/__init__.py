"""The ``lossparity`` command line: ``modes``, ``train``, ``verify``, ``audit``, ``compare``, ``gap``,
``convert-checkpoint``.

Exit codes: 0 success / parity, 1 a check failed (FAIL in a table, parity violation), 2 bad input.
Each subcommand's glue lives in its own module (``train``: trainer and verify; ``parity``: the log tools),
imported only for the subcommand that runs, so that the log tools never import torch. Output cut short by
a closed pipe (``lossparity compare ... | head``) ends quietly with exit code 141 (128 + SIGPIPE).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..options import LOSS_IMPLS
from ._common import UsageError
from .audit import add_audit_arguments
from .checkpoint import add_convert_arguments, cmd_convert_checkpoint
from .parity import add_compare_arguments, add_gap_arguments, add_modes_arguments, cmd_compare, cmd_gap, cmd_modes
from .verify_hf import add_verify_hf_arguments
from .version import VersionAction

__all__ = ["main", "build_parser", "UsageError"]

_SIGPIPE_EXIT = 141

# the help text a user reads (plain text: the module docstring is reStructuredText for the API docs)
DESCRIPTION = (
    "Exact, layout-invariant LLM training losses. Commands: modes (the normalization modes), train (the "
    "reference trainer), verify (layout invariance), audit (your own training stack), compare (two training "
    "logs), gap (per-token vs per-sample estimator gap)."
)


def _train_glue(name: str) -> Callable[[argparse.Namespace], Any]:
    """The train/verify command ``name`` of :mod:`.train`, imported when it runs (it pulls in torch)."""

    def run(args: argparse.Namespace) -> Any:
        from . import train

        return getattr(train, name)(args)

    return run


def _verify_glue(args: argparse.Namespace) -> Any:
    """``verify`` of the user's own model (``--hf``/``--model``), else of the tiny reference model."""
    if args.hf is not None or args.model is not None:
        from .verify_hf import cmd_verify_hf

        return cmd_verify_hf(args)
    return _train_glue("cmd_verify")(args)


def _audit_glue(args: argparse.Namespace) -> Any:
    """``audit``: imported when it runs (it pulls in torch)."""
    from .audit import cmd_audit

    return cmd_audit(args)


class _OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line usage error (the CLI's contract: exit 2, one line, no 15-line usage block);
    subcommand parsers are made by the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of every subcommand.

    ``command`` names the subcommand about to run: the ``train`` options (whose vocabularies live in the
    torch-based modules) are added only when it is ``train`` or ``None`` (every parser complete).
    """
    p = _OneLineParser(prog="lossparity", description=DESCRIPTION)
    p.add_argument(
        "--version", action=VersionAction, help="print the versions of lossparity, Python, torch and the frameworks"
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("modes", help="print the normalization modes and run the built-in self-check")
    add_modes_arguments(m)
    m.set_defaults(func=cmd_modes)

    g = sub.add_parser("gap", help="every mode per step from a --dump-samples run; per_token - per_sample gap")
    add_gap_arguments(g)
    g.set_defaults(func=cmd_gap)

    # Unique prefixes of a flag are accepted (argparse's default): the preset logic reads parsed values
    # (None = not given), never argv, so `--norm deferred` wins over a preset like `--normalization deferred`.
    t = sub.add_parser("train", help="train the reference MoE+MTP model (JSONL metrics, checkpoints)")
    if command in (None, "train"):
        from .train import add_train_args

        add_train_args(t)
    t.set_defaults(func=_train_glue("cmd_train"))

    v = sub.add_parser("verify", help="prove layout invariance of objective, logs, gradients, parameters")
    v.add_argument(
        "--quick", action="store_true", help="6 layouts (one composed), 2 steps (CI); about 2.5 min on 2 CPU cores"
    )
    v.add_argument(
        "--full",
        action="store_true",
        help="the default layouts plus 3-D pipeline layouts, 5 steps (by hand; the default runs 3)",
    )
    v.add_argument(
        "--layouts",
        default="",
        metavar="NAME[,NAME...]",
        help="run these layouts instead, named [DnX][CnX][Tn[+SP]X][Pn[xVn]X][EnX][Kn][+recompute][+fsdp] "
        "(e.g. D2xC2xT2+SPxK2+recompute)",
    )
    v.add_argument(
        "--steps", type=int, default=0, help="steps per run (default 3, --quick 2, --full 5; --hf/--model: 2)"
    )
    v.add_argument("--modes", default="", help="comma-separated modes (default: all)")
    v.add_argument("--aux-scope", default="global_lagged", help="MoE aux-loss scope of the runs")
    v.add_argument(
        "--loss-impl",
        default="fused",
        choices=list(LOSS_IMPLS),
        help="output-layer cross-entropy of the runs (default fused)",
    )
    v.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    add_verify_hf_arguments(v)
    v.set_defaults(func=_verify_glue)

    a = sub.add_parser("audit", help="which normalization does YOUR training stack compute, at every layout?")
    add_audit_arguments(a)
    a.set_defaults(func=_audit_glue)

    c = sub.add_parser("compare", help="compare two training logs for loss parity")
    add_compare_arguments(c)
    c.set_defaults(func=cmd_compare)

    k = sub.add_parser("convert-checkpoint", help="rewrite trusted checkpoints of an earlier format as weights-only")
    add_convert_arguments(k)
    k.set_defaults(func=cmd_convert_checkpoint)
    return p


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (its first non-option word), ``None`` when there is none."""
    return next((a for a in argv if not a.startswith("-")), None)


def _quiet_broken_pipe() -> int:
    """The reader closed stdout (``| head``): send what is still buffered nowhere, exit without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return _SIGPIPE_EXIT


def _run(argv_list: list[str]) -> int:
    # "" (no subcommand: top-level help or a usage error) skips the torch-based train options too
    parser = build_parser(_command(argv_list) or "")
    try:
        args = parser.parse_args(argv_list)
    except SystemExit as e:  # argparse exits with 2 on bad usage already (0 after --help)
        return int(e.code or 0)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"lossparity {args.command}: error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossparity`` console script; returns the exit code (141 when stdout was closed)."""
    argv_list = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv_list)
        sys.stdout.flush()  # a closed pipe shows up here when the output fit in the buffer
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
