"""The ``checkpoints/`` folder of a run: which checkpoints it holds, which one is loaded, which are kept.

Checkpoints are ``step_<n>.pt`` files (single-process or replicated runs) or ``step_<n>/`` folders (sharded
runs, written with ``torch.distributed.checkpoint``), plus ``latest`` (the name of the newest one). They are
ordered by their step number, never by file name (:func:`list_checkpoints`); the newest *intact* one is
loaded, a corrupt, empty or missing one (or an empty or dangling ``latest``) falls back to the previous one
with a note (:func:`load_newest_intact`); after each save, those beyond the ``keep`` newest and those of
steps after the current one (an abandoned history) are deleted, files and folders alike
(:func:`rotate_checkpoints`). The run folder around it is :mod:`lossparity.training.rundir`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import TypeVar

from ..input_files import InputFileError, check_regular, read_capped
from ..notes import Notify, warn_note

__all__ = [
    "RunDirError",
    "list_checkpoints",
    "rotate_checkpoints",
    "load_newest_intact",
    "sharded_checkpoint_intact",
    "load_failure",
]

_CHECKPOINT_RE = re.compile(r"^step_(\d{1,18})(\.pt)?$")  # a longer number is no step of a run
_LATEST_MAX_BYTES = 4096
T = TypeVar("T")


# sentences of torch's load errors that advise turning the weights-only protection off, or filing an issue
_TORCH_ADVICE = ("weights_only", "Weights only load failed", "documentation of torch.load", "Please file an issue")


def load_failure(e: BaseException) -> str:
    """One line ``"<type>: <what failed>"`` for an exception of a checkpoint load, without torch's advice to
    re-run ``torch.load`` with ``weights_only=False`` (never advice to give a file from elsewhere): only
    the cause torch names after ``WeightsUnpickler error:``, at most 2,000 characters. A failure of
    ``torch.distributed.checkpoint`` (its ``CheckpointException`` holds every failing rank's exception and
    traceback) is said by the first failing rank's exception, ``"rank <r>: <type>: <what failed>"``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) and failures[rank] else failures[rank]
        if isinstance(inner, BaseException):
            return f"rank {rank}: {load_failure(inner)}"
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    kept = [ln for ln in text.splitlines() if ln.strip() and not any(a in ln for a in _TORCH_ADVICE)]
    why = " ".join(" ".join(kept).split())
    why = why if len(why) <= 2000 else why[:1997] + "..."
    return f"{type(e).__name__}: {why}" if why else type(e).__name__


class RunDirError(ValueError):
    """The run folder does not allow what was asked (names the folder and the way out)."""


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """``[(step, name)]`` of the checkpoints (``step_<n>.pt`` files and ``step_<n>/`` folders) in
    ``ckpt_dir``, newest step first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        m = _CHECKPOINT_RE.match(name)
        if m and (m.group(2) is None) == os.path.isdir(os.path.join(ckpt_dir, name)):
            found.append((int(m.group(1)), name))
    return sorted(found, reverse=True)


def rotate_checkpoints(ckpt_dir: str, keep: int, current_step: int) -> list[str]:
    """Delete the checkpoints of steps after ``current_step`` (left by an abandoned later history, e.g.
    a corrupt one skipped on resume) and all but the ``keep`` newest of the others (``keep <= 0``: keep
    all). Returns the deleted names."""
    removed = []
    kept = 0
    for step, name in list_checkpoints(ckpt_dir):
        if step <= current_step and (keep <= 0 or kept < keep):
            kept += 1
            continue
        path = os.path.join(ckpt_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
        removed.append(name)
    return removed


def _latest_note(ckpt_dir: str, newest: str | None) -> str | None:
    """A warning text when ``latest`` is missing, empty or does not name the newest checkpoint."""
    pointer = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(pointer):
        return None if newest is None else f"{pointer} is missing"
    try:  # a regular file of a few bytes: never a device or a FIFO (a read that never ends)
        name = read_capped(pointer, _LATEST_MAX_BYTES).decode("utf-8").strip()
    except InputFileError as e:
        return f"{pointer} cannot be read ({e.reason})"
    except (OSError, UnicodeDecodeError) as e:
        return f"{pointer} cannot be read ({e})"
    if not name:
        return f"{pointer} is empty"
    if name != newest:
        return f"{pointer} names {name!r}, the newest checkpoint is {newest!r}"
    return None


def load_newest_intact(
    ckpt_dir: str,
    load: Callable[[str], T],
    notify: Notify = warn_note,
    loaded: Callable[[str], None] | None = None,
) -> tuple[int, T] | None:
    """``(step, load(path))`` of the newest checkpoint of ``ckpt_dir`` that ``load`` reads (and validates)
    without an exception, trying them newest step first; a checkpoint that fails (empty, truncated,
    corrupt, pickled objects, contents that do not fit the model) is skipped with a note through
    ``notify`` naming it and the error. ``None`` when there is no checkpoint; raises :class:`RunDirError`
    when there are some and none can be read (naming each and why; the last one tried gets no note of its
    own, as nothing is left to fall back to). ``loaded`` is called with the path that was read."""
    found = list_checkpoints(ckpt_dir)
    note = _latest_note(ckpt_dir, found[0][1] if found else None)
    if note:
        notify(f"{note}; using the checkpoints' step numbers instead")
    errors = []
    for i, (step, name) in enumerate(found):
        path = os.path.join(ckpt_dir, name)
        try:
            value = load(path)
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back to the previous one
            # the path is named once, on one line, without torch's advice to load with weights_only=False
            why = load_failure(e).replace(f": {path}: ", ": ", 1)
            errors.append(f"{name}: {why}")
            if i + 1 < len(found):  # the last one's failure is said once, by the error below
                notify(f"checkpoint {path} cannot be read ({why}); falling back to the previous one")
            continue
        if loaded is not None:
            loaded(path)
        return step, value
    if errors:
        raise RunDirError(f"no intact checkpoint in {ckpt_dir}: {'; '.join(errors)}")
    return None


def sharded_checkpoint_intact(path: str) -> None:
    """Raise ``ValueError`` unless the ``torch.distributed.checkpoint`` folder ``path`` is complete: its
    ``.metadata`` loads (without running code: :mod:`.safe_dcp`), every data file it references is at
    least as long as the bytes it points to, and every ``extra_rank<r>.pt`` is a non-empty file. Cheap
    (sizes only), identical on every rank."""
    from .safe_dcp import read_metadata_safely

    meta_path = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_path) or os.path.getsize(meta_path) == 0:
        raise ValueError(f"{meta_path} is missing or empty")
    storage = read_metadata_safely(path).storage_data or {}  # never unpickles code
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        full = os.path.join(path, rel)  # inside ``path``: read_metadata_safely checked every relative_path
        have = os.path.getsize(full) if os.path.isfile(full) else -1
        if have < size:
            raise ValueError(f"{full}: {'missing' if have < 0 else f'{have} bytes'}, the metadata needs {size}")
    extras = [n for n in os.listdir(path) if re.fullmatch(r"extra_rank\d+\.pt", n)]
    for n in extras:
        check_regular(os.path.join(path, n), "a checkpoint file (a regular file)")
    if not extras or any(os.path.getsize(os.path.join(path, n)) == 0 for n in extras):
        raise ValueError(f"{path}: extra_rank<r>.pt files missing or empty")
