"""Extending a run: ``lossparity train --resume --steps N`` with ``N`` above the saved run's ``steps``.

The learning-rate schedule of a run is linear warm-up over ``warmup`` steps, then a cosine from ``lr`` to
``min_lr`` that ends at step ``E = decay_steps`` (default ``steps``), with ``min_lr`` held after ``E``
(``trainer._lr_at``). Extending a run keeps the saved ``E``: the steps already taken followed that schedule,
and the added steps continue the same function, i.e. they run at ``min_lr``. The extended run is therefore
the run ``--steps N --decay-steps E`` from the start, which is what its ``config.json`` then records.

This is Megatron-LM's behaviour with ``--use-checkpoint-opt-param-scheduler`` (or a fixed
``--lr-decay-iters``): a larger ``--train-iters`` keeps the checkpoint's decay and holds ``--min-lr`` after
it (without either flag Megatron refuses the changed decay length; ``--override-opt-param-scheduler``
recomputes it). The Hugging Face Trainer instead rebuilds its scheduler for the new ``max_steps`` and
restores only the step counter, so the decay is recomputed over the new total and the learning rate jumps
back up at the resume; lossparity does not do that silently: a longer decay is a new run.

Refused on resume (:class:`~lossparity.checkpoint.folder.RunDirError`, one line, exit 2 from the CLI):
``N`` below the saved ``steps`` (a run is extended, never shortened), another ``lr``, ``min_lr``,
``warmup`` or ``decay_steps`` than the saved run's, and a saved value of these fields that the command line
would refuse (a word, a list, ``NaN``, ``1e400``, a negative step), named with the saved ``config.json``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..checkpoint.folder import RunDirError
from .config import TrainConfig, check_field

__all__ = ["SCHEDULE_FIELDS", "resume_config"]

# The fields that define the learning-rate schedule besides its length.
SCHEDULE_FIELDS = ("lr", "min_lr", "warmup")


def resume_config(saved: dict[str, Any], cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """``(cfg', note)``: ``cfg`` with the saved run's schedule end ``decay_steps`` when it resumes the run
    whose ``config.json`` is ``saved``; ``note`` says how a longer run is extended (``None`` otherwise).
    Raises :class:`RunDirError` for fewer ``steps`` than saved or a changed schedule field."""
    if "steps" not in saved:
        return cfg, None  # not a config.json of a run: the other checks report it
    for name in ("steps", "decay_steps", *SCHEDULE_FIELDS):
        _check_saved(saved, name, cfg)
    saved_steps: int = saved["steps"]
    saved_end: int | None = saved.get("decay_steps")
    end = saved_steps if saved_end is None else saved_end
    where = f"--resume into {cfg.out}"
    if cfg.steps < saved_steps:
        raise RunDirError(
            f"{where}: --steps {cfg.steps} is smaller than the saved run's {saved_steps} steps: a run is "
            "extended, never shortened (start a new run with another --out or --overwrite)"
        )
    changed = [
        f"{name}: {saved[name]!r} -> {getattr(cfg, name)!r}"
        for name in SCHEDULE_FIELDS
        if name in saved and saved[name] != getattr(cfg, name)
    ]
    if cfg.decay_steps is not None and cfg.decay_steps != end:
        changed.append(f"decay_steps: {end} -> {cfg.decay_steps}")
    if changed:
        raise RunDirError(
            f"{where}: the learning-rate schedule differs from the saved run's ({'; '.join(changed)}); the steps "
            "already taken followed the saved one (start a new run with another --out or --overwrite)"
        )
    if cfg.steps == saved_steps:
        return dataclasses.replace(cfg, decay_steps=saved_end), None
    held = (
        f"steps {end + 1}-{cfg.steps} run at min_lr {cfg.min_lr:g}"
        if cfg.steps > end
        else f"the decay ends at step {end} as saved"
    )
    note = (
        f"extending the run in {cfg.out} from {saved_steps} to {cfg.steps} steps: the saved learning-rate "
        f"schedule is kept (warm-up {cfg.warmup}, cosine from lr {cfg.lr:g} to min_lr {cfg.min_lr:g} at step "
        f"{end}, as --decay-steps {end}); {held}"
    )
    return dataclasses.replace(cfg, decay_steps=end), note


def _check_saved(saved: dict[str, Any], name: str, cfg: TrainConfig) -> None:
    """A saved schedule value is checked as the command line checks it (type, finite, range): the file
    comes from elsewhere, and a bad value would otherwise reach the schedule's arithmetic."""
    if name not in saved:
        return
    try:
        check_field(name, saved[name])
    except (TypeError, ValueError) as e:
        path = os.path.join(cfg.out or ".", "config.json")
        text = " ".join(str(e).split())
        raise RunDirError(
            f"{path}: {text if len(text) <= 300 else text[:297] + '...'}; --resume needs the saved run's schedule "
            "(repair the file, or start a new run with another --out or --overwrite)"
        ) from None
