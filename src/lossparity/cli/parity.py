"""CLI glue of the parity tools: ``modes``, ``compare``, ``gap`` (printing and exit codes live here)."""

from __future__ import annotations

import argparse

from ..losses.modes import MODE_INFO

__all__ = ["cmd_modes", "cmd_compare"]


def cmd_modes(args: argparse.Namespace) -> int:
    from ..parity.presets import modes_translation_requested, preset_table, run_modes_translation

    if modes_translation_requested(args):
        return run_modes_translation(args)
    print("| mode | objective J | matches |")
    print("|---|---|---|")
    for mode, (formula, who) in MODE_INFO.items():
        print(f"| `{mode}` | `{formula}` | {who} |")
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


def cmd_compare(args: argparse.Namespace) -> int:
    from ..parity.compare import run_compare

    return run_compare(args)
