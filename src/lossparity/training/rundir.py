"""The run folder ``OUT`` as a contract: what a run may find there, what it keeps, what it removes.

Layout: ``OUT/config.json`` (the resolved :class:`TrainConfig` of the run), ``OUT/metrics.jsonl``,
``OUT/tensorboard/``, ``OUT/samples/`` (``--dump-samples``) and ``OUT/checkpoints/`` holding
``step_<n>.pt`` files (single-process or replicated runs) or ``step_<n>/`` folders (sharded runs, written
with ``torch.distributed.checkpoint``) and ``latest`` (the name of the newest one).

Rules (:func:`prepare_run_dir`, on every rank at the start of ``Trainer.fit``):

1. A new run (no ``resume``) into a non-empty folder refuses, unless ``overwrite`` is set: then the
   artifacts above are deleted first (other files are left alone).
2. ``resume`` compares the saved ``config.json`` with the new configuration and refuses, naming the
   fields, any difference of a field that changes the numbers (``numbers`` fields of the config: mode,
   seed, model, data, hyper-parameters, steps). The layout (``dp``, ``ga``, ``engine``...) may change
   (docs/semantics.md §3). ``steps`` may grow: the run is extended with its saved learning-rate schedule
   (:mod:`.extend`).
3. Temporary files of killed writes (``.tmp-*``) in ``OUT``, ``OUT/checkpoints`` and ``OUT/samples`` are
   removed.
4. Checkpoints are ordered by their step number, never by file name (:func:`list_checkpoints`); the
   newest *intact* one is loaded, a corrupt, empty or missing one (or an empty or dangling ``latest``)
   falls back to the previous one with a note (:func:`load_newest_intact`); after each save, those
   beyond the ``keep`` newest and those of steps after the current one (an abandoned history) are
   deleted, files and folders alike (:func:`rotate_checkpoints`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import TypeVar

from ..atomic_io import atomic_write_bytes, remove_stale_temporaries
from .config import TrainConfig, numbers_mismatch
from .notes import Notify, warn_note

__all__ = [
    "RunDirError",
    "CONFIG_FILE",
    "CHECKPOINT_SUBDIR",
    "prepare_run_dir",
    "check_run_dir",
    "read_saved_config",
    "list_checkpoints",
    "rotate_checkpoints",
    "load_newest_intact",
    "sharded_checkpoint_intact",
]

CONFIG_FILE = "config.json"
CHECKPOINT_SUBDIR = "checkpoints"
_ARTIFACTS = ("metrics.jsonl", CONFIG_FILE, CHECKPOINT_SUBDIR, "samples", "tensorboard")
_CHECKPOINT_RE = re.compile(r"^step_(\d+)(\.pt)?$")
T = TypeVar("T")


class RunDirError(ValueError):
    """The run folder does not allow what was asked (names the folder and the way out)."""


def check_run_dir(cfg: TrainConfig) -> None:
    """The read-only checks of rules 1 and 2 (every rank runs them, so every rank raises the same error)."""
    out = cfg.out
    if out is None or not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise RunDirError(f"--out {out} exists and is not a folder")
    entries = sorted(os.listdir(out))
    if entries and not cfg.resume and not cfg.overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise RunDirError(
            f"--out {out} is not empty ({shown}): pass --resume to continue that run, --overwrite to "
            "replace it, or another --out"
        )
    saved = read_saved_config(cfg)
    if saved is not None:
        from .extend import resume_config

        # a longer run keeps the saved schedule; a shorter one or another schedule is refused (extend.py)
        cfg, _ = resume_config(saved, cfg)
        diffs = numbers_mismatch(
            saved, dataclasses.replace(cfg, steps=saved.get("steps", cfg.steps), decay_steps=saved.get("decay_steps"))
        )
        if diffs:
            raise RunDirError(
                f"--resume into {out}: the configuration differs from the saved one in fields that "
                f"change the numbers: {'; '.join(diffs)} (the layout may change; start a new run with "
                "another --out or --overwrite)"
            )


def read_saved_config(cfg: TrainConfig) -> dict | None:
    """The saved ``OUT/config.json`` when ``cfg`` resumes a run that has one, else ``None``; raises
    :class:`RunDirError` when it cannot be read."""
    path = os.path.join(cfg.out, CONFIG_FILE) if cfg.resume and cfg.out else None
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise RunDirError(f"{path}: cannot be read ({e}); --resume needs it to check the configuration") from None
    if not isinstance(saved, dict):
        raise RunDirError(
            f"{path}: not a JSON object of TrainConfig fields; --resume needs it to check the configuration"
        )
    return saved


def prepare_run_dir(
    cfg: TrainConfig, rank: int = 0, barrier: Callable[[], None] | None = None, notify: Notify = warn_note
) -> None:
    """Apply the run-folder rules of the module docstring: every rank checks (:func:`check_run_dir`), then
    rank 0 deletes the old artifacts (``overwrite``) and stale temporaries (a note through ``notify``) and
    writes ``config.json``. ``barrier`` (multi-rank runs) separates the checks, the changes and the rest."""
    check_run_dir(cfg)
    if barrier is not None:
        barrier()
    if rank == 0 and cfg.out is not None:
        os.makedirs(cfg.out, exist_ok=True)
        if cfg.overwrite:
            _remove_artifacts(cfg.out)
        for sub in ("", CHECKPOINT_SUBDIR, "samples"):
            removed = remove_stale_temporaries(os.path.join(cfg.out, sub))
            if removed:
                notify(
                    f"removed temporary files of an interrupted write in "
                    f"{os.path.join(cfg.out, sub)}: {', '.join(removed)}"
                )
        text = json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True) + "\n"
        atomic_write_bytes(os.path.join(cfg.out, CONFIG_FILE), text.encode("utf-8"))
    if barrier is not None:
        barrier()


def _remove_artifacts(out: str) -> None:
    for name in _ARTIFACTS:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)


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
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"{pointer} cannot be read ({e})"
    if not name:
        return f"{pointer} is empty"
    if name != newest:
        return f"{pointer} names {name!r}, the newest checkpoint is {newest!r}"
    return None


def load_newest_intact(ckpt_dir: str, load: Callable[[str], T], notify: Notify = warn_note) -> tuple[int, T] | None:
    """``(step, load(path))`` of the newest checkpoint of ``ckpt_dir`` that ``load`` reads (and validates)
    without an exception, trying them newest step first; a checkpoint that fails (empty, truncated,
    corrupt, pickled objects, contents that do not fit the model) is skipped with a note through
    ``notify`` naming it and the error. ``None`` when there is no checkpoint; raises :class:`RunDirError`
    when there are some and none can be read."""
    found = list_checkpoints(ckpt_dir)
    note = _latest_note(ckpt_dir, found[0][1] if found else None)
    if note:
        notify(f"{note}; using the checkpoints' step numbers instead")
    errors = []
    for step, name in found:
        path = os.path.join(ckpt_dir, name)
        try:
            return step, load(path)
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back to the previous one
            why = str(e).removeprefix(f"{path}: ")  # the path is named once
            errors.append(f"{name}: {type(e).__name__}: {why}")
            notify(f"checkpoint {path} cannot be read ({type(e).__name__}: {why}); falling back to the previous one")
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
        full = os.path.join(path, rel)
        have = os.path.getsize(full) if os.path.isfile(full) else -1
        if have < size:
            raise ValueError(f"{full}: {'missing' if have < 0 else f'{have} bytes'}, the metadata needs {size}")
    extras = [n for n in os.listdir(path) if re.fullmatch(r"extra_rank\d+\.pt", n)]
    if not extras or any(os.path.getsize(os.path.join(path, n)) == 0 for n in extras):
        raise ValueError(f"{path}: extra_rank<r>.pt files missing or empty")
