"""The ``lossparity`` command line: ``modes``, ``train``, ``verify``, ``compare``, ``gap``.

Exit codes: 0 success / parity, 1 a check failed (FAIL in a table, parity violation), 2 bad input.
Each subcommand's glue lives in its own module (``train``: trainer and verify; ``parity``: the log tools),
so that the log tools never import torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..options import LOSS_IMPLS
from ._common import UsageError
from .parity import cmd_compare, cmd_modes
from .train import add_train_args, cmd_train, cmd_verify

__all__ = ["main", "build_parser", "UsageError"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="lossparity", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("modes", help="print the normalization modes and run the built-in self-check")
    m.add_argument("--no-check", action="store_true", help="only print the table")
    from ..parity.gap import add_gap_arguments, run_gap
    from ..parity.presets import add_modes_translation_arguments

    add_modes_translation_arguments(m)
    m.set_defaults(func=cmd_modes)

    g = sub.add_parser("gap", help="every mode per step from a --dump-samples run; per_token - per_sample gap")
    add_gap_arguments(g)
    g.set_defaults(func=run_gap)

    t = sub.add_parser("train", help="train the reference MoE+MTP model (JSONL metrics, checkpoints)")
    add_train_args(t)
    t.set_defaults(func=cmd_train)

    v = sub.add_parser("verify", help="prove layout invariance of objective, logs, gradients, parameters")
    v.add_argument("--quick", action="store_true", help="5 layouts, 2 steps (CI)")
    v.add_argument("--full", action="store_true", help="every layout for 5 steps (by hand; the default runs 3)")
    v.add_argument("--steps", type=int, default=0, help="steps per run (default 3, --quick 2, --full 5)")
    v.add_argument("--modes", default="", help="comma-separated modes (default: all)")
    v.add_argument("--aux-scope", default="global_lagged", help="MoE aux-loss scope of the runs")
    v.add_argument("--loss-impl", default="fused", choices=list(LOSS_IMPLS),
                   help="output-layer cross-entropy of the runs (default fused)")
    v.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    v.set_defaults(func=cmd_verify)

    c = sub.add_parser("compare", help="compare two training logs for loss parity")
    from ..parity.compare import add_compare_arguments

    add_compare_arguments(c)
    c.set_defaults(func=cmd_compare)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossparity`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits with 2 on bad usage already
        return int(e.code or 0)
    # Which options were given explicitly (a preset must not override them).
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args._explicit = {k: any(a == "--" + k.replace("_", "-") or a.startswith("--" + k.replace("_", "-") + "=")
                             for a in argv_list) for k in ("mode", "aux_scope", "mtp_convention", "normalization")}
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"lossparity {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
