"""Atomic checkpoints and exact resume.

A checkpoint is one file ``step_<n>.pt`` written to a temporary name in the same directory, flushed
and fsync'ed, then renamed over (``os.replace`` is atomic on POSIX): a crash mid-write leaves the
previous checkpoint intact and never a truncated file under a final name. ``latest`` (a text file
holding the file name) is replaced the same way after the checkpoint itself. Which checkpoints are kept
and which one a resume loads (by step number, the newest intact one) is decided in ``training/rundir.py``.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import numpy as np
import torch

from .rundir import load_newest_intact, rotate_checkpoints, sharded_checkpoint_intact

__all__ = [
    "atomic_save",
    "save_checkpoint",
    "load_latest",
    "save_sharded_checkpoint",
    "load_sharded_latest",
    "rng_state",
    "set_rng_state",
]


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` through a temporary file + fsync + rename, so ``path`` is either the old
    file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_text(text: str, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(directory: str, step: int, state: dict[str, Any], keep: int = 2) -> str:
    """Write ``state`` as the checkpoint of ``step`` (number of completed steps), point ``latest`` at it
    and delete all but the ``keep`` newest checkpoints. Returns the file path."""
    os.makedirs(directory, exist_ok=True)
    name = f"step_{step:08d}.pt"
    path = os.path.join(directory, name)
    atomic_save(state, path)
    _atomic_text(name, os.path.join(directory, "latest"))
    rotate_checkpoints(directory, keep, step)
    return path


def load_latest(directory: str) -> dict[str, Any] | None:
    """The state of the newest intact checkpoint in ``directory`` (by step number; a corrupt or empty one
    falls back to the previous one with a warning, see ``training/rundir.py``), or ``None`` when there is
    none."""
    found = load_newest_intact(directory, lambda p: torch.load(p, map_location="cpu", weights_only=False))
    return None if found is None else found[1]


def rng_state() -> dict[str, Any]:
    """Every RNG state a training step may touch (Python, NumPy, torch CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_sharded_checkpoint(
    directory: str,
    step: int,
    model: Any,
    optimizer: Any,
    extra: dict[str, Any],
    *,
    keep: int = 2,
    state: dict[str, Any] | None = None,
) -> str:
    """Sharded checkpoint (FSDP2 / tensor-parallel DTensors, pipeline stages) with
    ``torch.distributed.checkpoint``: every rank writes its shards into ``.tmp-step_<n>/``, then its own
    ``extra_rank<r>.pt`` (RNG states, step); after a barrier rank 0 renames the folder to ``step_<n>/``
    (atomic), points ``latest`` at it and deletes all but the ``keep`` newest checkpoints. A crash before
    the rename leaves the previous checkpoint as the newest. ``state``: the (FQN-keyed) state to write
    instead of ``get_state_dict(model, optimizer)`` (the trainer passes a layout-independent one, see
    ``Trainer.distributed_state``)."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = f"step_{step:08d}"
    tmp = os.path.join(directory, f".tmp-{name}")
    final = os.path.join(directory, name)
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    if state is None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=tmp)
    atomic_save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_text(name, os.path.join(directory, "latest"))
        rotate_checkpoints(directory, keep, step)
    dist.barrier()
    return final


def load_sharded_latest(
    directory: str, model: Any, optimizer: Any, *, state: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """Restore the newest :func:`save_sharded_checkpoint` into ``model``/``optimizer`` (resharding as
    ``torch.distributed.checkpoint`` does) and return this rank's ``extra`` (rank 0's when the checkpoint
    was written by fewer ranks); ``None`` without one. ``state``: load into this state dict in place
    instead (its keys and shapes say what to read; the caller applies it)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def intact(p: Any) -> Any:  # raises when ``p`` is not a complete sharded checkpoint
        sharded_checkpoint_intact(p)
        return p

    found = load_newest_intact(directory, intact)
    if found is None:
        return None
    path = found[1]
    if state is not None:
        dcp.load(state, checkpoint_id=path)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
    if not os.path.exists(extra):  # resumed into a layout with more ranks than the one that saved
        extra = os.path.join(path, "extra_rank0.pt")
    return torch.load(extra, map_location="cpu", weights_only=False)
