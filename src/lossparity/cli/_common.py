"""Errors and log loading shared by the subcommands of the ``lossparity`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..parity.readers import Run

__all__ = ["UsageError", "report_input_error", "load_run"]


class UsageError(Exception):
    """Bad command-line input: reported on stderr with exit code 2."""


def report_input_error(tool: str, args: argparse.Namespace, kind: str, e: BaseException) -> int:
    """Report an input error: one line on stderr (and a JSON object with ``--json``); exit code 2."""
    text = str(e).replace("\r", "\\r").replace("\n", "\\n")  # one line, whatever a file name holds
    print(f"lossparity {tool}: {kind}: {text}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": str(e), "exit_code": 2}))
    return 2


def load_run(args: argparse.Namespace, role: str) -> Run:
    """Read the log of ``role`` (``ref``/``cand``) with the name maps, step base and batch size given on
    the command line."""
    from ..parity.names import parse_name_map
    from ..parity.readers import read_log

    shared_map = parse_name_map(args.name_map)
    own_map = parse_name_map(getattr(args, f"{role}_name_map"))
    run = read_log(
        getattr(args, role), fmt=getattr(args, f"{role}_format") or args.fmt, name_map={**shared_map, **own_map} or None
    )
    base = getattr(args, f"{role}_step_base")
    if base is not None:
        run.step_base = base
    gbs = getattr(args, f"{role}_gbs")
    return run.with_constant_batch_size(gbs) if gbs is not None else run
