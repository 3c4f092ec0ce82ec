"""One-time conversion of format-1 checkpoints (pickled objects) to format 2 (weights-only).

Checkpoints written before format 2 hold NumPy arrays and tuples in their RNG states and the configuration
as a dict, which ``torch.load(weights_only=True)`` refuses. :func:`convert_checkpoint` reads such a file
with ``weights_only=False`` — that **unpickles arbitrary objects and may run code**: run it only on files
you trust (your own runs) — and rewrites it atomically in format 2, which every later resume reads with
``weights_only=True``. The command line is ``lossparity convert-checkpoint PATH...``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from ..input_files import open_regular
from .checkpointer import atomic_save
from .format import FORMAT, VERSION, encode_rng_state, validate_rng_state

__all__ = ["convert_checkpoint", "checkpoint_files"]

_FILE_RE = re.compile(r"^(step_\d+\.pt|extra_rank\d+\.pt)$")


def checkpoint_files(path: str) -> list[str]:
    """The checkpoint files under ``path``: the file itself, or every ``step_<n>.pt`` and
    ``step_<n>/extra_rank<r>.pt`` of a checkpoint folder (``OUT``, ``OUT/checkpoints`` or ``step_<n>/``)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return [path]  # a FIFO or a device too: refused, named, when it is read
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or folder")
    found = []
    for root, _dirs, files in os.walk(path):
        found += [os.path.join(root, f) for f in files if _FILE_RE.match(f)]
    return sorted(found)


def _convert_state(old: Any, path: str) -> dict[str, Any]:
    if not isinstance(old, dict) or "step" not in old or "rng" not in old:
        raise ValueError(f"{path}: not a lossparity checkpoint (a dict with 'step' and 'rng')")
    rng = old["rng"]
    new = dict(old)
    new["format"], new["version"] = FORMAT, VERSION
    new["rng"] = encode_rng_state(rng["python"], rng["numpy"], rng["torch"], rng.get("cuda"))
    validate_rng_state(new["rng"], f"{path}: rng")  # never write a checkpoint a resume would refuse
    config = old.get("config", {})
    new["config"] = config if isinstance(config, str) else json.dumps(config, sort_keys=True)
    new.setdefault("mtp_weight", 1.0)
    if "moe" in old:
        moe = dict(old["moe"])
        new["moe"] = {"lagged_counts": moe["lagged_counts"], "lagged_tokens": float(moe["lagged_tokens"])}
    return new


def convert_checkpoint(path: str) -> list[tuple[str, str]]:
    """Rewrite every format-1 checkpoint file under ``path`` (see :func:`checkpoint_files`) in format 2, in
    place and atomically. Reads each file with ``weights_only=False``: **only for files you trust**.
    Returns ``[(file, "converted" | "already format 2")]``; raises ``ValueError`` naming a file that is
    not a readable lossparity checkpoint (empty, truncated, garbage, not a regular file, RNG states of the
    wrong types), in one line."""
    done = []
    for f in checkpoint_files(path):
        try:
            what = _convert_file(f)
        except Exception as e:  # noqa: BLE001 - any unreadable file (truncated, garbage, wrong types) is named
            why = " ".join(str(e).split()).removeprefix(f"{f}: ") or "no message"
            raise ValueError(f"{f}: not a convertible checkpoint ({type(e).__name__}: {why[:400]})") from None
        done.append((f, what))
    return done


def _load(f: str, weights_only: bool) -> Any:
    with open_regular(f, "a checkpoint file (a regular file)") as fh:  # a FIFO would block the load
        return torch.load(fh, map_location="cpu", weights_only=weights_only)


def _convert_file(f: str) -> str:
    try:
        state = _load(f, weights_only=True)
        if isinstance(state, dict) and state.get("format") == FORMAT and state.get("version") == VERSION:
            return "already format 2"
    except Exception:  # noqa: BLE001, S110 - not readable weights-only: format 1, converted below
        pass
    old = _load(f, weights_only=False)  # the user vouched for this file
    atomic_save(_convert_state(old, f), f)
    return "converted"
