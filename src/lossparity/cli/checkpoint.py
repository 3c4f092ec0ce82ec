"""CLI glue of ``lossparity convert-checkpoint``: the one-time conversion of format-1 checkpoints.

Format-1 checkpoints (pickled objects) are refused by ``lossparity train --resume``, which reads
checkpoints with ``torch.load(weights_only=True)`` only. This command rewrites them in format 2 after
reading them with ``weights_only=False``, which can run code hidden in a file: run it only on checkpoints
you trust (see docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_convert_arguments", "cmd_convert_checkpoint"]


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    """``PATH...`` (checkpoint files or folders) and ``--i-trust-these-files``."""
    p.add_argument("paths", nargs="+", metavar="PATH", help="a step_<n>.pt file, a step_<n>/ folder or a run's folder")
    p.add_argument(
        "--i-trust-these-files",
        action="store_true",
        help="required: the old files are unpickled, which runs any code they hold",
    )


def cmd_convert_checkpoint(args: argparse.Namespace) -> int:
    """``lossparity convert-checkpoint``: one line per file (converted / already format 2); exit 2 on a path
    that is missing or not a checkpoint, or without ``--i-trust-these-files``."""
    if not args.i_trust_these_files:
        print(
            "lossparity convert-checkpoint: error: converting unpickles the old files, which runs any code "
            "they hold: pass --i-trust-these-files for checkpoints of your own runs",
            file=sys.stderr,
        )
        return 2
    from ..checkpoint.convert import convert_checkpoint

    code = 0
    for path in args.paths:
        try:
            for f, what in convert_checkpoint(path):
                print(f"{f}: {what}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"lossparity convert-checkpoint: error: {' '.join(str(e).split())}", file=sys.stderr)
            code = 2
    return code
