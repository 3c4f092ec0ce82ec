"""The ``lossparity`` command line: ``modes``, ``train``, ``verify``, ``compare``, ``gap``, ``bench``.

Exit codes: 0 success / parity, 1 a check failed (FAIL in a table, parity violation), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .losses.modes import MODE_INFO

__all__ = ["main"]


class UsageError(Exception):
    """Bad command-line input: reported on stderr with exit code 2."""


def _cmd_modes(args: argparse.Namespace) -> int:
    print("| mode | objective J | matches |")
    print("|---|---|---|")
    for mode, (formula, who) in MODE_INFO.items():
        print(f"| `{mode}` | `{formula}` | {who} |")
    if args.no_check:
        return 0
    from .selfcheck import run_selfcheck

    print("\nself-check: every mode through the Accountant (K=4, b=2) vs a naive float64 formula")
    rows = run_selfcheck()
    print("| mode | accountant | naive | result |")
    print("|---|---|---|---|")
    for mode, got, ref, ok in rows:
        print(f"| {mode} | {got:.15g} | {ref:.15g} | {'PASS' if ok else 'FAIL'} |")
    return 0 if all(r[3] for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="lossparity", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("modes", help="print the normalization modes and run the built-in self-check")
    m.add_argument("--no-check", action="store_true", help="only print the table")
    m.set_defaults(func=_cmd_modes)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossparity`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits with 2 on bad usage already
        return int(e.code or 0)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"lossparity {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
