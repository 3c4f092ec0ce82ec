"""Atomic, weights-only checkpoints and exact resume: the :class:`Checkpointer` of the reference trainer.

A single-process checkpoint is one file ``step_<n>.pt`` written through :func:`lossparity.atomic_io.
atomic_write` (temporary file, fsync, rename, fsync of the directory): a crash mid-write leaves the
previous checkpoint intact and never a truncated file under a final name. ``latest`` (a text file holding
the name) is replaced the same way after the checkpoint itself. A multi-rank checkpoint is a
``torch.distributed.checkpoint`` folder ``step_<n>/`` (renamed into place by rank 0 after every rank
wrote) plus one ``extra_rank<r>.pt`` per rank. Which checkpoints are kept and which one a resume loads
(the newest intact one, by step number) is decided in ``checkpoint/folder.py``.

Loading never runs code (``checkpoint/format.py``, ``checkpoint/safe_dcp.py``): every ``.pt`` is
read with ``torch.load(weights_only=True)``, the DCP metadata with an unpickler restricted to its own
classes, and the contents are validated against the model before anything is applied; a checkpoint that
fails is skipped with a note naming it and why, in favour of the previous intact one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..atomic_io import atomic_write, atomic_write_bytes
from ..notes import Notify, warn_note
from .folder import load_failure, load_newest_intact, rotate_checkpoints, sharded_checkpoint_intact
from .format import (
    FORMAT,
    VERSION,
    CheckpointFormatError,
    load_weights_only,
    rng_state,
    set_rng_state,
    validate_extra_state,
    validate_single_state,
)

if TYPE_CHECKING:
    from ..distributed.moe.accounting import MoEAccounting
    from ..training.config import TrainConfig

__all__ = [
    "Checkpointer",
    "keep_fresh_optimizer",
    "CheckpointFormatError",
    "atomic_save",
    "save_checkpoint",
    "load_latest",
    "save_sharded_checkpoint",
    "load_sharded_latest",
    "rng_state",
    "set_rng_state",
]


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` through :func:`lossparity.atomic_io.atomic_write`, so ``path`` is either
    the old file or the complete new one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda f: torch.save(obj, f))


@contextmanager
def keep_fresh_optimizer(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Wrap the *reading* of a state dict (``get_optimizer_state_dict`` / ``get_state_dict`` of
    ``torch.distributed.checkpoint.state_dict``) so that a fresh optimizer (no state yet) stays fresh.
    Those functions first run torch's ``_init_optim_state``: one ``optimizer.step()`` with zero gradients
    and ``lr = 0``. The parameters stay the same, but AdamW's state appears with ``step = 1``, so the run's
    first real step would use the bias correction ``1 - beta^t`` of ``t = 2`` instead of ``t = 1``: a
    multi-rank ``--resume`` that finds no checkpoint yet (a kill before the first one) then differed from
    the uninterrupted run from step 2 on. On exit the state is emptied again when it was empty on entry;
    the state dict already built keeps its tensors (the target a checkpoint is loaded into)."""
    fresh = not optimizer.state
    try:
        yield
    finally:
        if fresh:
            optimizer.state.clear()


def _point_latest(directory: str, name: str) -> None:
    atomic_write_bytes(os.path.join(directory, "latest"), name.encode("utf-8"))


def save_checkpoint(directory: str, step: int, state: dict[str, Any], keep: int = 2) -> str:
    """Write ``state`` (tensors and plain values only) as the checkpoint of ``step`` (number of completed
    steps), point ``latest`` at it and delete all but the ``keep`` newest checkpoints. Returns the path."""
    os.makedirs(directory, exist_ok=True)
    name = f"step_{step:08d}.pt"
    path = os.path.join(directory, name)
    atomic_save(state, path)
    _point_latest(directory, name)
    rotate_checkpoints(directory, keep, step)
    return path


def load_latest(
    directory: str,
    validate: Callable[[Any, str], None] | None = None,
    notify: Notify = warn_note,
    loaded: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """The state of the newest intact checkpoint in ``directory``, read with ``weights_only=True`` and
    checked by ``validate(state, path)`` when given (a corrupt, pickled-object or invalid one falls back to
    the previous one with a note through ``notify``, see ``checkpoint/folder.py``), or ``None`` without one.
    ``loaded`` is called with the path of the checkpoint read."""

    def load(path: str) -> Any:
        state = load_weights_only(path)
        if validate is not None:
            validate(state, path)
        return state

    found = load_newest_intact(directory, load, notify, loaded)
    return None if found is None else found[1]


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
    ``extra_rank<r>.pt`` (RNG states, step: tensors and plain values); after a barrier rank 0 renames the
    folder to ``step_<n>/`` (atomic), points ``latest`` at it and deletes all but the ``keep`` newest
    checkpoints. A crash before the rename leaves the previous checkpoint as the newest. ``state``: the
    (FQN-keyed) state to write instead of ``get_state_dict(model, optimizer)``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..atomic_io import fsync_dir

    name = f"step_{step:08d}"
    tmp = os.path.join(directory, f".tmp-{name}")
    final = os.path.join(directory, name)
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    if state is None:
        with keep_fresh_optimizer(optimizer):
            model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=tmp)
    atomic_save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(directory)
        _point_latest(directory, name)
        rotate_checkpoints(directory, keep, step)
    dist.barrier()
    return final


def _flat_shapes(state: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """``{"model.<fqn>": global shape, ...}``: the keys under which ``torch.distributed.checkpoint`` stores
    the tensors of ``state`` (mapping keys and list positions joined by dots, as its ``flatten_state_dict``
    does; written here because that function is private to torch)."""
    if isinstance(state, Tensor):
        return {prefix: tuple(state.shape)}
    if isinstance(state, Mapping):
        items: Iterable[tuple[object, Any]] = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return {}  # plain values (learning rates, flags) are not tensors of the metadata
    out: dict[str, tuple[int, ...]] = {}
    for key, value in items:
        out.update(_flat_shapes(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _check_sharded(path: str, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's checks of the DCP folder ``path``: complete (sizes), metadata read without code and
    matching ``state``, every ``extra_rank<r>.pt`` weights-only, valid and of one step. Returns the extra
    state this rank uses (its own, or rank 0's when fewer ranks wrote the checkpoint)."""
    import re

    import torch.distributed as dist

    from .safe_dcp import check_metadata, read_metadata_safely

    sharded_checkpoint_intact(path)
    check_metadata(read_metadata_safely(path), _flat_shapes(state), path)
    extras = {}
    for name in sorted(os.listdir(path)):
        if re.fullmatch(r"extra_rank\d+\.pt", name):
            extra_path = os.path.join(path, name)
            extras[name] = load_weights_only(extra_path)
            validate_extra_state(extras[name], extra_path)
    steps = {e["step"] for e in extras.values()}
    if len(steps) != 1:
        raise CheckpointFormatError(f"{path}: the extra_rank<r>.pt files hold different steps {sorted(steps)}")
    mine = extras.get(f"extra_rank{dist.get_rank()}.pt", extras.get("extra_rank0.pt"))
    if mine is None:
        raise CheckpointFormatError(f"{path}: neither extra_rank{dist.get_rank()}.pt nor extra_rank0.pt is there")
    return mine


def _agree(check: Callable[[], Any]) -> Any:
    """Run ``check`` on every rank; all ranks raise when any rank's check raised (the ranks must agree on
    which checkpoint to load, or the load's collectives would hang), naming the first failing rank."""
    import torch.distributed as dist

    local: Exception | None = None
    try:
        result, error = check(), ""
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        local, result, error = e, None, f"{type(e).__name__}: {' '.join(str(e).split())}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # strings of this run's own ranks
    failed = [(r, msg) for r, msg in enumerate(errors) if msg]
    if local is not None:
        raise local
    if failed:
        r, msg = failed[0]
        raise CheckpointFormatError(f"rank {r} refused it: {msg}")
    return result


def load_sharded_latest(
    directory: str,
    model: Any,
    optimizer: Any,
    *,
    state: dict[str, Any] | None = None,
    notify: Notify = warn_note,
    loaded: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """Restore the newest intact :func:`save_sharded_checkpoint` into ``model``/``optimizer`` (resharding as
    ``torch.distributed.checkpoint`` does) and return this rank's validated ``extra`` (rank 0's when the
    checkpoint was written by fewer ranks); ``None`` without one. ``state``: load into this state dict in
    place instead (its keys and shapes say what to read; the caller applies it). Every rank takes the same
    decision (a checkpoint any rank finds invalid is skipped by all, with a note through ``notify``); ``loaded``
    is called with the path of the checkpoint read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .safe_dcp import SafeFileSystemReader

    if state is None:
        with keep_fresh_optimizer(optimizer):  # nothing to load must leave the optimizer untouched
            model_sd, optim_sd = get_state_dict(model, optimizer)
        target: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        target = state

    def load(path: str) -> dict[str, Any]:
        extra = _agree(lambda: _check_sharded(path, target))
        try:
            # collective: every rank's read failure is gathered, and every rank raises the same exception
            dcp.load(target, storage_reader=SafeFileSystemReader(path))
        except CheckpointException as e:  # a BaseException: load_newest_intact would not catch it
            # a shard whose bytes do not load (damaged in place, same size): skipped like a damaged file by
            # every rank together; the fallback's load rewrites every entry (check_metadata: all are there)
            raise CheckpointFormatError(f"{path}: its data does not load ({load_failure(e)})") from None
        return extra

    found = load_newest_intact(directory, load, notify, loaded)
    if found is None:
        return None
    extra = found[1]
    if state is None:
        set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])  # type: ignore[arg-type]
    return extra


class Checkpointer:
    """Saves and restores everything an exact resume of the reference trainer needs: the model (with
    expert biases), the optimizer, the MoE accounting state, the step (the data position: batches are a
    function of the step), the RNG states and the configuration.

    One process: one file of format 2 (``checkpoint/format.py``). Several ranks: a DCP folder in a
    layout-independent form (:meth:`distributed_state`: model and AdamW state by parameter FQN, MoE counts
    by layer id), so any multi-rank layout resumes from any other. ``moes``: the MoE accounting instances
    with their routers (one per pipeline chunk under PP); ``owned``: the FQNs this pipeline rank holds
    (``None``: all); ``notify``: where resume notes go (default a ``UserWarning``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        moes: list[tuple[MoEAccounting, list[Any]]],
        cfg: TrainConfig,
        *,
        world: int = 1,
        owned: set[str] | None = None,
        notify: Notify = warn_note,
    ) -> None:
        self.model, self.optimizer, self.moes, self.cfg = model, optimizer, moes, cfg
        self.world, self.owned, self.notify = world, owned, notify
        self.loaded_path: str | None = None  # the checkpoint the last restore read

    @property
    def sharded(self) -> bool:
        """Multi-rank runs checkpoint through DCP, in the layout-independent form."""
        return self.world > 1

    def _common(self, step: int, mtp_weight: float) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": int(step),
            "rng": rng_state(),
            "config": json.dumps(dataclasses.asdict(self.cfg), sort_keys=True),
            "mtp_weight": float(mtp_weight),
        }

    # ---------------------------------------------------------------- one process
    def state_dict(self, step: int, mtp_weight: float) -> dict[str, Any]:
        """The single-process checkpoint state (format 2: tensors and plain values only)."""
        (moe, _), *rest = self.moes
        assert not rest, "single-process runs have one MoE accounting"
        sd = moe.state_dict()
        return {
            **self._common(step, mtp_weight),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "moe": {"lagged_counts": sd["lagged_counts"], "lagged_tokens": float(sd["lagged_tokens"])},
        }

    def validate(self, state: Any, path: str) -> None:
        """Raise :class:`CheckpointFormatError` unless ``state`` (read from ``path``) fits this model."""
        (moe, _), *_ = self.moes
        template = self.model.state_dict()
        rows, cols = moe.state_dict()["lagged_counts"].shape
        validate_single_state(state, path, template, self.optimizer, (rows, cols))

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Apply a validated :meth:`state_dict`; returns its step."""
        self.validate(state, "state")
        (moe, _), *_ = self.moes
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        moe.load_state_dict(state["moe"])
        set_rng_state(state["rng"])
        return int(state["step"])

    # ---------------------------------------------------------------- several ranks
    def distributed_state(self) -> dict[str, Any]:
        """The checkpoint state of this rank, keyed by layout-independent names: the model and AdamW state
        by parameter FQN (DTensor shards under TP/FSDP, plain tensors otherwise; under PP only what this
        rank owns, the union over ranks is everything), the MoE ``global_lagged`` counts by MoE layer id.
        ``torch.distributed.checkpoint`` re-shards each entry to the loading layout. ``_osd``: the full
        optimizer state dict (its ``state`` is the ``optim`` entry), used to apply a loaded state."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        msd = get_model_state_dict(self.model)
        with keep_fresh_optimizer(self.optimizer):  # a resume without a checkpoint must start fresh
            osd = get_optimizer_state_dict(self.model, self.optimizer)
        if self.owned is not None:
            msd = {k: v for k, v in msd.items() if k in self.owned}
        moe: dict[str, Tensor] = {}
        for acc_moe, routers in self.moes:
            sd = acc_moe.state_dict()
            if len(routers) != sd["lagged_counts"].shape[0]:
                raise ValueError("checkpoints of repeated MTP MoE layers are not supported")
            for r, row in zip(routers, sd["lagged_counts"]):
                moe[f"lagged_counts.layer_{r.layer_id}"] = row.clone()
            moe["lagged_tokens"] = torch.tensor(float(sd["lagged_tokens"]), dtype=torch.float64)
        return {"model": msd, "optim": {"state": osd["state"]}, "moe": moe, "_osd": osd}

    def _apply_distributed_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(self.model, self.optimizer, state["_osd"])  # its "state" was loaded in place
        moe = state["moe"]
        for acc_moe, routers in self.moes:
            if routers:
                rows = torch.stack([moe[f"lagged_counts.layer_{r.layer_id}"] for r in routers])
                acc_moe.load_state_dict({"lagged_counts": rows, "lagged_tokens": float(moe["lagged_tokens"])})

    # ---------------------------------------------------------------- entry points
    def save(self, ckpt_dir: str, step: int, mtp_weight: float) -> str:
        """Write the checkpoint of ``step`` (one file in a single process, else a DCP folder); its path."""
        if self.sharded:
            state = self.distributed_state()
            state.pop("_osd")
            extra = {**self._common(step, mtp_weight), "world": self.world}
            return save_sharded_checkpoint(ckpt_dir, step, self.model, self.optimizer, extra, state=state)
        return save_checkpoint(ckpt_dir, step, self.state_dict(step, mtp_weight))

    def _loaded(self, path: str) -> None:
        self.loaded_path = path

    def restore(self, ckpt_dir: str) -> int | None:
        """Load the newest intact checkpoint of ``ckpt_dir`` (under any multi-rank layout from one of any
        other), skipping invalid ones with a note; returns its step, ``None`` when there is none."""
        if self.sharded:
            state = self.distributed_state()
            osd = state.pop("_osd")
            extra = load_sharded_latest(
                ckpt_dir, self.model, self.optimizer, state=state, notify=self.notify, loaded=self._loaded
            )
            if extra is None:
                return None
            self._apply_distributed_state({**state, "_osd": osd})
            if extra["world"] == self.world:  # RNG states are per rank (unused by the float64 runs)
                set_rng_state(extra["rng"])
            return int(extra["step"])
        single = load_latest(ckpt_dir, self.validate, self.notify, self._loaded)
        if single is None:
            return None
        return self.load_state_dict(single)
