"""The run's metrics log ``OUT/metrics.jsonl``: append-only, durable at every checkpoint, exact on resume.

- One JSON object per line and step, appended and flushed to the operating system after every step
  (a killed process loses nothing written); :meth:`MetricsLog.sync` also fsyncs, and the trainer calls
  it before writing each checkpoint, so a checkpoint of step ``s`` implies the lines of steps ``<= s``
  are on disk.
- On resume from the checkpoint of step ``s`` the file is cut to the lines of steps ``<= s``
  (the later ones are recomputed identically) by writing the kept lines to a temporary file and renaming
  it over the old one (:func:`truncate_metrics`): a crash at any moment leaves the old or the new file,
  never a partial one. A torn last line (a kill in the middle of a write) is dropped with a note.

TensorBoard scalars go to ``OUT/tensorboard`` when the package is installed (an event file per start,
read by TensorBoard as one run). A resume from step ``s`` opens its writer with ``purge_step = s + 1``:
TensorBoard then hides the events of steps ``> s`` written before the restart (the abandoned history that
``metrics.jsonl`` drops), so every step shows once, with the recomputed value.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..atomic_io import atomic_write_bytes
from ..input_files import bounded_step, loads_json, read_capped
from ..notes import Notify, warn_note

__all__ = ["METRICS_FILE", "MetricsLog", "truncate_metrics", "check_metrics"]

METRICS_FILE = "metrics.jsonl"


def _parse_lines(path: str, data: bytes) -> tuple[list[tuple[int, bytes]], list[str]]:
    """``[(step, raw line)]`` of a metrics file and the notes about a dropped torn last line. A broken line
    that is not the last raises ``ValueError`` naming ``path:line``."""
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: empty unless the last write was torn
    notes = []
    if tail.strip():
        notes.append(
            f"{path}:{len(lines) + 1}: dropped a torn last line ({len(tail)} bytes without a newline; "
            "the run was killed while writing it)"
        )
    out = []
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = loads_json(raw)
        except ValueError:  # not JSON, or nested too deeply
            obj = None
        step = bounded_step(obj.get("step")) if isinstance(obj, dict) else None
        if step is None or step < 0:
            raise ValueError(
                f"{path}:{lineno}: not a metrics line (a JSON object with an integer 'step' >= 0 below 2**53); "
                "repair or remove the file"
            )
        out.append((step, raw + b"\n"))
    return out, notes


def check_metrics(path: str) -> None:
    """Raise unless ``path`` is a metrics file a resume can continue: a regular file of at most
    :data:`lossparity.input_files.MAX_DOCUMENT_BYTES` (``InputFileError``) whose lines, a torn last one
    aside, are JSON objects with an integer ``step`` (``ValueError`` naming ``path:line``). Reads only."""
    _parse_lines(path, read_capped(path))


def truncate_metrics(path: str, step: int) -> list[str]:
    """Keep the lines of steps ``<= step`` of ``path`` (a torn last line is dropped), replacing the file
    atomically (temporary file + fsync + rename) when anything is dropped; no file: nothing to do.
    Returns notes for the user (dropped lines, torn line)."""
    if not os.path.exists(path):
        return []
    data = read_capped(path)  # a regular file of bounded size (checked before the resume, read again here)
    lines, notes = _parse_lines(path, data)
    kept = [raw for s, raw in lines if s <= step]
    if len(kept) < len(lines):
        notes.append(f"{path}: dropped {len(lines) - len(kept)} line(s) after step {step}, the step resumed from")
    new = b"".join(kept)
    if new != data:
        atomic_write_bytes(path, new)
    return notes


class MetricsLog:
    """Append-only writer of ``OUT/metrics.jsonl`` (schema in docs/reference-trainer.md) plus TensorBoard scalars.

    ``start_step > 0`` (a resume from that step) first truncates the file to the steps ``<= start_step``;
    ``start_step == 0`` starts an empty file (the run-folder checks guarantee no earlier run is there).
    The truncation's notes (dropped lines, a torn last line) go to ``notify``."""

    def __init__(self, out: str, start_step: int, tensorboard: bool, notify: Notify = warn_note) -> None:
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, METRICS_FILE)
        for note in truncate_metrics(self.path, start_step):
            notify(note)
        self.f = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self.tb = _tensorboard(out, start_step) if tensorboard else None

    def write(self, line: dict[str, Any]) -> None:
        """Append one step's line and hand it to the operating system (flush, no fsync)."""
        self.f.write((json.dumps(line, sort_keys=False) + "\n").encode())
        self.f.flush()
        if self.tb:
            for k, v in line.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, line["step"])

    def sync(self) -> None:
        """Make every written line durable (flush + fsync); called before each checkpoint."""
        self.f.flush()
        os.fsync(self.f.fileno())
        if self.tb:
            self.tb.flush()

    def close(self) -> None:
        """Sync and close."""
        if not self.f.closed:
            self.sync()
            self.f.close()
        if self.tb:
            self.tb.close()
            self.tb = None


def _tensorboard(out: str, start_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the earlier events of steps >= it (the restart's abandoned history)
        return SummaryWriter(os.path.join(out, "tensorboard"), purge_step=start_step + 1 if start_step > 0 else None)
    except Exception:  # noqa: BLE001 - tensorboard is optional
        return None
