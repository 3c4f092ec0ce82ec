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
import shutil
from collections.abc import Callable

from ..atomic_io import atomic_write_bytes, remove_stale_temporaries
from ..checkpoint.folder import (
    RunDirError,
    list_checkpoints,
    load_newest_intact,
    rotate_checkpoints,
    sharded_checkpoint_intact,
)
from ..input_files import InputFileError, check_regular, loads_json, read_capped
from ..notes import Notify, warn_note
from .config import TrainConfig, numbers_mismatch
from .extend import resume_config

__all__ = [
    "RunDirError",
    "CONFIG_FILE",
    "CHECKPOINT_SUBDIR",
    "prepare_run_dir",
    "check_run_dir",
    "read_saved_config",
    "extended_config",
    "list_checkpoints",
    "rotate_checkpoints",
    "load_newest_intact",
    "sharded_checkpoint_intact",
]

CONFIG_FILE = "config.json"
CHECKPOINT_SUBDIR = "checkpoints"
_ARTIFACTS = ("metrics.jsonl", CONFIG_FILE, CHECKPOINT_SUBDIR, "samples", "tensorboard")
_CONFIG_MAX_BYTES = 16 * 1024 * 1024
_FOLDERS = (CHECKPOINT_SUBDIR, "samples", "tensorboard")


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
    if cfg.resume:
        _check_resumable(out)
    saved_path = os.path.join(out, CONFIG_FILE)
    saved = read_saved_config(cfg)
    if saved is not None:
        # a longer run keeps the saved schedule; a shorter one or another schedule is refused (extend.py)
        cfg, _ = resume_config(saved, cfg)
        try:
            diffs = numbers_mismatch(
                saved,
                dataclasses.replace(cfg, steps=saved.get("steps", cfg.steps), decay_steps=saved.get("decay_steps")),
            )
        except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as e:
            raise RunDirError(
                f"{saved_path}: not a run configuration ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
                "--resume needs it to check the configuration"
            ) from None
        if diffs:
            raise RunDirError(
                f"--resume into {out}: the configuration differs from the saved one ({saved_path}) in fields that "
                f"change the numbers: {'; '.join(diffs)} (the layout may change; start a new run with "
                "another --out or --overwrite)"
            )


def _check_resumable(out: str) -> None:
    """Read-only checks of a run folder before a resume changes anything in it: its folders are folders, its
    files regular files, and ``metrics.jsonl`` parses (so a resume never truncates the history of a run it
    then fails to continue)."""
    from .runlog import METRICS_FILE, check_metrics

    for name in _FOLDERS:
        path = os.path.join(out, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise RunDirError(
                f"{path}: expected a folder (the run's {name}), got a file or a dangling link; repair the run "
                "folder or start a new run with another --out"
            )
    samples = os.path.join(out, "samples")
    if os.path.isdir(samples):  # the dump a --dump-samples resume appends to: regular files only (never a FIFO)
        for name in sorted(os.listdir(samples)):
            if name == "samples_meta.json" or (name.startswith("samples_rank") and name.endswith(".bin")):
                try:
                    check_regular(os.path.join(samples, name), "a sample dump file (a regular file)")
                except InputFileError as e:
                    raise RunDirError(f"{e}; repair the run folder or start a new run with another --out") from None
                except OSError as e:  # a link to nothing
                    raise RunDirError(
                        f"{os.path.join(samples, name)}: cannot be opened ({e.strerror}); repair the run folder or "
                        "start a new run with another --out"
                    ) from None
    metrics = os.path.join(out, METRICS_FILE)
    if os.path.lexists(metrics):
        try:
            check_metrics(metrics)
        except InputFileError as e:
            raise RunDirError(f"{e}; repair the run folder or start a new run with another --out") from None
        except ValueError as e:
            raise RunDirError(str(e)) from None


def read_saved_config(cfg: TrainConfig) -> dict | None:
    """The saved ``OUT/config.json`` (a JSON object, read with the caps of :mod:`lossparity.input_files`)
    when ``cfg`` resumes a run that has one, else ``None``; raises :class:`RunDirError` naming the file when
    it cannot be read or is not an object."""
    path = os.path.join(cfg.out, CONFIG_FILE) if cfg.resume and cfg.out else None
    if path is None or not os.path.lexists(path):
        return None
    try:
        saved = loads_json(read_capped(path, _CONFIG_MAX_BYTES))
    except InputFileError as e:
        raise RunDirError(f"{e}; --resume needs it to check the configuration") from None
    except (OSError, ValueError) as e:
        raise RunDirError(
            f"{path}: cannot be read ({' '.join(str(e).split())}); --resume needs it to check the configuration"
        ) from None
    if not isinstance(saved, dict):
        raise RunDirError(
            f"{path}: expected the run configuration (a JSON object), got a JSON {type(saved).__name__}; "
            "--resume needs it to check the configuration"
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


def extended_config(cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """:func:`~lossparity.training.extend.resume_config` against ``OUT/config.json`` when ``cfg`` resumes a
    run that has one, else ``(cfg, None)``. Every rank reads the same file, so every rank gets the same
    configuration."""
    saved = read_saved_config(cfg)
    return (cfg, None) if saved is None else resume_config(saved, cfg)
