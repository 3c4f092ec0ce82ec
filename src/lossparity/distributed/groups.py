"""Which process groups a loss number is reduced over (semantics §3, §5, §6).

The semantics never name a process group; this module maps a layout onto groups once, so that the
accountant and the trackers can ask for *roles* instead of hard-coding groups:

- ``token_group``: the ranks that hold distinct tokens of the step: DP × CP, and × TP under sequence
  parallelism. Log sums and router counts are summed over it.
- ``grad_group``: DP × CP, the replicas of the non-expert parameters, whose gradients are summed (TP
  ranks hold shards, not replicas; expert gradients are reduced over ``edp_group``).
- ``dp_group``: the data-parallel ranks (distinct rows). Normalizers are pre-counted over it from the
  *whole rows* of each rank's microbatches (context-parallel peers hold the same rows).
- ``grad_size`` = DP × CP: the factor by which an averaging gradient engine divides gradients.
- ``log_group``: every rank that takes part in the step's single logging collective. With pipeline
  stages or tensor-parallel replicas it is larger than ``token_group``; ranks that only replicate a
  value (TP peers) contribute zeros, see ``log_owner``.

Built from a :class:`~lossparity.distributed.parallel_dims.ParallelDims` (the trainer's single layout
object, which also carries the expert-parallel groups), from a ``DeviceMesh`` with named dimensions
(``dp``, ``cp``, ``tp``, ``pp``; any subset), from a
single process group (taken as the data-parallel group), or from nothing (one process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from .parallel_dims import ParallelDims

__all__ = ["ParallelGroups", "resolve_groups"]

_DIMS = ("dp", "cp", "tp", "pp")


@dataclass(frozen=True)
class ParallelGroups:
    """Resolved groups and sizes of one rank (see module docstring). ``None`` groups mean a single
    process, where every collective is skipped."""

    token_group: ProcessGroup | None
    log_group: ProcessGroup | None
    dp_group: ProcessGroup | None
    dp_size: int
    cp_size: int
    tp_size: int
    pp_size: int
    log_owner: bool
    cp_rank: int = 0
    pp_rank: int = 0
    grad_group: ProcessGroup | None = None
    sequence_parallel: bool = False
    ep_group: ProcessGroup | None = None
    edp_group: ProcessGroup | None = None
    row_group: ProcessGroup | None = None
    tp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    cp_group: ProcessGroup | None = None
    ep_size: int = 1

    @property
    def loss_stage(self) -> bool:
        """True on the pipeline stage that computes the loss (the last one; every rank without PP)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def grad_size(self) -> int:
        """Ranks over which gradients are reduced: DP × CP (context-parallel peers hold the same replica
        and each back-propagates its own shard of the rows)."""
        return self.dp_size * self.cp_size

    @property
    def distributed(self) -> bool:
        """True when any collective has to run."""
        return self.token_group is not None or self.log_group is not None

    def token_rank(self) -> int:
        """This rank's index in the token group (0 in a single process)."""
        return 0 if self.token_group is None else dist.get_rank(self.token_group)


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _from_dims(dims: ParallelDims) -> ParallelGroups:
    """The roles of a built :class:`ParallelDims` (its groups are created by ``build_mesh``)."""
    if not dims.built:
        raise RuntimeError("resolve_groups(dims=...): call dims.build_mesh() on every rank first")
    return ParallelGroups(
        token_group=dims.token_group,
        log_group=dims.log_group,
        dp_group=dims.dp_group,
        dp_size=dims.dp,
        cp_size=dims.cp,
        tp_size=dims.tp,
        pp_size=dims.pp,
        log_owner=dims.log_owner,
        cp_rank=dims.cp_rank,
        pp_rank=dims.pp_rank,
        grad_group=dims.grad_group,
        sequence_parallel=dims.sp and dims.tp > 1,
        ep_group=dims.ep_group,
        edp_group=dims.edp_group,
        row_group=dims.row_group,
        tp_group=dims.tp_group,
        pp_group=dims.pp_group,
        cp_group=dims.cp_group,
        ep_size=dims.ep,
    )


def resolve_groups(
    group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    *,
    sequence_parallel: bool = False,
    dims: ParallelDims | None = None,
) -> ParallelGroups:
    """Resolve ``group`` (a data-parallel process group) or ``mesh`` (a ``DeviceMesh`` whose dimension
    names are a subset of ``dp, cp, tp, pp``) into a :class:`ParallelGroups`. With
    ``sequence_parallel`` the tensor-parallel ranks hold distinct tokens before the router (Megatron SP),
    so the token group (router counts, MoE sums) includes TP; without it TP ranks hold the same tokens
    and TP is left out. Gradients are always reduced over DP × CP only (``grad_group``).

    ``dims`` (a built :class:`ParallelDims`, exclusive with the others) is the preferred entry point:
    every role, the expert-parallel ones included, comes from it.

    With neither, and ``torch.distributed`` initialized, the default (world) group is taken as the
    data-parallel group; with neither and no process group, a single process is assumed.
    """
    if sum(x is not None for x in (group, mesh, dims)) > 1:
        raise ValueError("pass at most one of group=, mesh= and dims=")
    if dims is not None:
        return _from_dims(dims)
    if mesh is None:
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        size = _size(group)
        g = group if size > 1 else None
        return ParallelGroups(g, g, g, size, 1, 1, 1, True, grad_group=g, edp_group=g)
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in _DIMS]
    if unknown or not names:
        raise ValueError(f"mesh dimension names must be a subset of {_DIMS}, got {names}")
    sizes = {n: (mesh.size(names.index(n)) if n in names else 1) for n in _DIMS}
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"mesh sizes {dict(zip(names, mesh.mesh.shape))} multiply to {mesh.size()}, "
            f"but the world size is {dist.get_world_size()}"
        )

    def sub(dims: tuple[str, ...]) -> ProcessGroup | None:
        dims = tuple(d for d in names if d in dims and sizes[d] > 1)  # mesh order: slicing requires it
        if not dims:
            return None
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        return mesh[dims]._flatten().get_group()

    coord: Sequence[int] = mesh.get_coordinate() or []
    tp_rank = coord[names.index("tp")] if "tp" in names else 0
    token = sub(("dp", "cp", "tp") if sequence_parallel else ("dp", "cp"))
    log = sub(("dp", "cp", "tp", "pp"))
    return ParallelGroups(
        token_group=token,
        log_group=log,
        dp_group=sub(("dp",)),
        dp_size=sizes["dp"],
        cp_size=sizes["cp"],
        tp_size=sizes["tp"],
        pp_size=sizes["pp"],
        log_owner=(tp_rank == 0),
        cp_rank=coord[names.index("cp")] if "cp" in names else 0,
        pp_rank=coord[names.index("pp")] if "pp" in names else 0,
        grad_group=sub(("dp", "cp")),
        sequence_parallel=sequence_parallel and sizes["tp"] > 1,
        edp_group=sub(("dp", "cp")),
        row_group=sub(("cp", "tp") if sequence_parallel else ("cp",)),
        tp_group=sub(("tp",)),
        pp_group=sub(("pp",)),
        cp_group=sub(("cp",)),
    )
