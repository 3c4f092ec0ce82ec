"""One description of a parallel layout: sizes, one ``DeviceMesh``, and the groups every loss number
is reduced over (docs/semantics.md §3, §5, §6).

The layout is ``pp × dp × cp × tp`` ranks (outermost to innermost: the ranks of one tensor-parallel
group are neighbours, those of one pipeline stage are a contiguous block). Expert parallelism does not
add ranks: its ``ep`` ranks are carved out of the ``dp × cp`` ranks, whose flattened index
``f = dp_rank·cp + cp_rank`` is split as ``f = edp_rank·ep + ep_rank`` (expert-data-parallel outer,
expert-parallel inner).

Groups are *roles* (``None`` where the role spans one rank, so that every collective is skipped):

============== ====================================================================================
``token_group`` ranks holding distinct tokens of the step: ``dp × cp``, and ``× tp`` under sequence
                parallelism (a TP rank then holds its own slice of the sequence). Router histograms,
                MoE sums and the log sums are reduced over it.
``row_group``   ranks holding pieces of the *same* rows: ``cp`` (``× tp`` under SP). Per-microbatch
                and per-sequence token sets span exactly this group.
``grad_group``  ranks holding replicas of the non-expert parameters, whose gradients are summed:
                ``dp × cp`` (TP ranks hold shards, not replicas; SP-partial gradients of replicated
                parameters are summed over ``tp_group`` separately).
``ep_group``    the expert-parallel ranks (routed experts are sharded over them).
``edp_group``   the expert-data-parallel ranks: replicas of one expert shard, ``dp·cp/ep`` ranks.
``log_group``   every rank: the step's single logging collective.
``dp_group``, ``cp_group``, ``tp_group``, ``pp_group``: the mesh dimensions themselves.
============== ====================================================================================

All groups are created eagerly by :meth:`ParallelDims.build_mesh` (creating a process group is a
collective over the world: creating them lazily, on first use, would hang when ranks use different
roles). Library users who already hold a ``DeviceMesh`` adopt it with :meth:`ParallelDims.from_mesh`, or a
single data-parallel process group with :meth:`ParallelDims.from_group`: every consumer (the trainer, the
accountant, the MoE accounting) then reads the layout from this one object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..options import ENGINES, Engine, check_option

__all__ = ["ParallelDims", "MESH_DIMS"]

MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost -> innermost
_FLAGS = {"dp": "--dp", "cp": "--cp", "tp": "--tp", "pp": "--pp", "ep": "--ep"}


@dataclass
class ParallelDims:
    """Sizes of a parallel layout (``dp·cp·tp·pp`` = world size; ``ep`` divides ``dp·cp``), the flags
    ``sp`` (sequence parallelism, needs ``tp > 1``), ``pp_virtual`` (chunks per pipeline rank) and the
    gradient ``engine``. :meth:`validate` checks them without side effects; :meth:`build_mesh` creates
    the mesh and every derived group (module docstring) on every rank."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    pp_virtual: int = 1
    engine: Engine = "ddp"
    _mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _ep_mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _adopted: bool = field(default=False, init=False, repr=False, compare=False)
    _groups: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _coord: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        """``dp · cp · tp · pp``: the number of ranks of the layout."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size ``dp·cp/ep`` (replicas of one expert shard)."""
        return self.dp * self.cp // self.ep

    @property
    def token_size(self) -> int:
        """Number of ranks holding distinct tokens: ``dp·cp`` (``·tp`` under sequence parallelism)."""
        return self.dp * self.cp * (self.tp if self.sp else 1)

    @property
    def grad_size(self) -> int:
        """Replicas of a non-expert parameter: ``dp·cp`` (the factor an averaging engine divides by)."""
        return self.dp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism is on (``sp`` with ``tp > 1``): TP ranks hold distinct tokens."""
        return self.sp and self.tp > 1

    # The accounting code's names for the sizes (``acc.groups.dp_size``...), the same numbers.
    dp_size = property(lambda self: self.dp, doc="``dp``.")
    cp_size = property(lambda self: self.cp, doc="``cp``.")
    tp_size = property(lambda self: self.tp, doc="``tp``.")
    pp_size = property(lambda self: self.pp, doc="``pp``.")
    ep_size = property(lambda self: self.ep, doc="``ep``.")

    @property
    def grad_engine(self) -> Engine:
        """The engine that actually reduces gradients: ``plain`` (the accountant sums them) under tensor,
        pipeline or expert parallelism, where parameters are DTensor shards, stage-local, or reduced over
        two different groups (experts over ``edp``, the rest over ``dp × cp``); else ``engine``."""
        return "plain" if self.tp > 1 or self.pp > 1 or self.ep > 1 else self.engine

    def describe(self) -> str:
        """A short name of the layout, e.g. ``dp=2 cp=2 tp=2+sp pp=1 ep=1``."""
        tp = f"{self.tp}+sp" if self.sp else str(self.tp)
        v = f"x{self.pp_virtual}" if self.pp_virtual > 1 else ""
        return f"dp={self.dp} cp={self.cp} tp={tp} pp={self.pp}{v} ep={self.ep} engine={self.engine}"

    # ------------------------------------------------------------------ validation
    def validate(self, world_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the flags of the first inconsistency; never changes ``self``.

        Checks: every size is an int >= 1; ``dp·cp·tp·pp == world_size`` (when given); ``ep`` divides
        ``dp·cp``; ``sp`` needs ``tp > 1``; ``pp_virtual > 1`` needs ``pp > 1``; the engine is known and
        ``fsdp`` is not combined with ``cp``, ``tp``, ``pp`` or ``ep``.
        """
        for name in ("dp", "cp", "tp", "pp", "ep", "pp_virtual"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"{_FLAGS.get(name, '--' + name.replace('_', '-'))} must be an integer >= 1, got {value!r}"
                )
        check_option("engine", self.engine, ENGINES)
        if world_size is not None and self.world_size != world_size:
            raise ValueError(
                f"--dp × --cp × --tp × --pp = {self.dp}×{self.cp}×{self.tp}×{self.pp} = "
                f"{self.world_size}, but the world size is {world_size}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"--ep={self.ep} must divide --dp × --cp = {self.dp}×{self.cp} = {self.dp * self.cp}: "
                "expert-parallel ranks are carved out of the data- and context-parallel ranks"
            )
        if self.sp and self.tp < 2:
            raise ValueError(f"--sp (sequence parallelism) needs --tp > 1, got --tp={self.tp}")
        if self.pp_virtual > 1 and self.pp < 2:
            raise ValueError(
                f"--pp-virtual={self.pp_virtual} (interleaved pipeline) needs --pp > 1, got --pp={self.pp}"
            )
        if self.engine == "fsdp" and (self.cp > 1 or self.tp > 1 or self.pp > 1 or self.ep > 1):
            raise ValueError(
                f"--engine fsdp is supported with --dp only (got --cp={self.cp}, --tp={self.tp}, "
                f"--pp={self.pp}, --ep={self.ep})"
            )

    # ------------------------------------------------------------------ mesh
    @property
    def mesh(self) -> Any:
        """The world ``DeviceMesh`` (dims ``pp, dp, cp, tp`` of size > 1, in that order), or ``None`` for
        one process. Built by :meth:`build_mesh`."""
        return self._mesh

    @property
    def built(self) -> bool:
        """True once :meth:`build_mesh` ran (always true-ish for one process: no groups are needed)."""
        return self._mesh is not None or self._adopted or self.world_size == 1

    def build_mesh(self, device_type: str = "cpu") -> Any:
        """Validate against the world size, create the mesh and every derived group (a collective on
        every rank: call it on all ranks, once). Returns the mesh (``None`` for one process)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.validate(world)
        if self._mesh is not None or world == 1:
            return self._mesh
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(d for d in MESH_DIMS if getattr(self, d) > 1)
        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in names), mesh_dim_names=names)
        self._adopt(mesh)
        return mesh

    @classmethod
    def from_mesh(cls, mesh: Any, *, sp: bool = False) -> ParallelDims:
        """The built layout of an existing ``DeviceMesh`` whose dimension names are a subset of ``dp, cp,
        tp, pp`` (in any order; a missing one has size 1) and whose size is the world size: the groups are
        the mesh's own dimensions and their flattenings. ``sp``: sequence parallelism over ``tp``. A
        collective on every rank, like :meth:`build_mesh`."""
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in MESH_DIMS]
        if unknown or not names:
            raise ValueError(f"mesh dimension names must be a subset of {('dp', 'cp', 'tp', 'pp')}, got {names}")
        sizes = {n: mesh.size(names.index(n)) for n in names}
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"mesh sizes {dict(zip(names, mesh.mesh.shape))} multiply to {mesh.size()}, "
                f"but the world size is {dist.get_world_size()}"
            )
        dims = cls(**sizes, sp=sp)
        dims.validate(dist.get_world_size())
        dims._adopt(mesh)
        return dims

    @classmethod
    def from_group(cls, group: Any = None) -> ParallelDims:
        """The layout of one data-parallel process group (``None``: the world group when
        ``torch.distributed`` is initialized, else one process): every role is that group."""
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        size = 1 if group is None else dist.get_world_size(group)
        dims = cls(dp=size)
        g = group if size > 1 else None
        dims._groups = {d: None for d in MESH_DIMS} | {"dp": g, "token": g, "row": None, "grad": g, "log": g}
        dims._groups |= {"ep": None, "edp": g}
        dims._coord = {d: 0 for d in MESH_DIMS} | {"dp": 0 if g is None else dist.get_rank(g)}
        dims._adopted = True
        return dims

    def _adopt(self, mesh: Any) -> None:
        """Take ``mesh`` as this layout's mesh and create every derived group from it (on every rank)."""
        names = tuple(mesh.mesh_dim_names)
        coord = dict(zip(names, mesh.get_coordinate() or []))
        self._coord = {d: coord.get(d, 0) for d in MESH_DIMS}
        groups: dict[str, Any] = {d: mesh.get_group(d) if d in names else None for d in MESH_DIMS}
        groups["token"] = self._sub(mesh, ("dp", "cp", "tp") if self.sp else ("dp", "cp"))
        groups["row"] = self._sub(mesh, ("cp", "tp") if self.sp else ("cp",))
        groups["grad"] = self._sub(mesh, ("dp", "cp"))
        groups["log"] = dist.group.WORLD
        groups["ep"], groups["edp"] = self._expert_groups(mesh)
        self._groups = groups
        self._mesh = mesh

    def _sub(self, mesh: Any, dims: tuple[str, ...]) -> Any:
        """The group of ``dims`` (those of size > 1, in mesh order; flattened when several)."""
        names = tuple(mesh.mesh_dim_names)
        present = tuple(d for d in names if d in dims and getattr(self, d) > 1)  # slicing needs mesh order
        if not present:
            return None
        if len(present) == 1:
            return mesh.get_group(present[0])
        if present == names:
            return dist.group.WORLD
        return mesh[present]._flatten("_".join(present)).get_group()

    def _expert_groups(self, mesh: Any) -> tuple[Any, Any]:
        """``(ep_group, edp_group)``: the ``dp × cp`` ranks of this rank's (pp, tp) coordinates split as
        ``edp × ep`` (ep inner). Without ``ep`` the expert-data-parallel group is ``dp × cp``."""
        if self.ep == 1:
            return None, self._sub(mesh, ("dp", "cp"))
        dpcp = tuple(d for d in ("dp", "cp") if getattr(self, d) > 1)
        flat = mesh[dpcp[0]] if len(dpcp) == 1 else mesh[dpcp]._flatten("dp_cp")
        split = flat._unflatten(0, (self.edp, self.ep), ("edp", "ep"))
        self._ep_mesh = split["ep"]  # the expert layers' mesh: built here once, used by the trainer
        ep_group = split.get_group("ep")
        edp_group = split.get_group("edp") if self.edp > 1 else None
        return ep_group, edp_group

    # ------------------------------------------------------------------ groups
    def _group(self, role: str) -> Any:
        if not self.built:
            raise RuntimeError(f"ParallelDims.{role}_group: call build_mesh() first (on every rank)")
        return self._groups.get(role)

    @property
    def token_group(self) -> Any:
        """Ranks holding distinct tokens: ``dp × cp`` (``× tp`` under SP); ``None`` if one rank."""
        return self._group("token")

    @property
    def row_group(self) -> Any:
        """Ranks holding pieces of the same rows: ``cp`` (``× tp`` under SP); ``None`` if one rank."""
        return self._group("row")

    @property
    def grad_group(self) -> Any:
        """Replicas of the non-expert parameters (``dp × cp``), whose gradients are summed."""
        return self._group("grad")

    @property
    def ep_group(self) -> Any:
        """Expert-parallel ranks (``None`` without expert parallelism)."""
        return self._group("ep")

    @property
    def edp_group(self) -> Any:
        """Expert-data-parallel ranks (``dp·cp/ep`` replicas of this rank's expert shard)."""
        return self._group("edp")

    @property
    def log_group(self) -> Any:
        """Every rank of the layout (the logging collective)."""
        return self._group("log")

    @property
    def dp_group(self) -> Any:
        """The data-parallel dimension (ranks holding distinct rows)."""
        return self._group("dp")

    @property
    def cp_group(self) -> Any:
        """The context-parallel dimension."""
        return self._group("cp")

    @property
    def tp_group(self) -> Any:
        """The tensor-parallel dimension."""
        return self._group("tp")

    @property
    def pp_group(self) -> Any:
        """The pipeline dimension."""
        return self._group("pp")

    @property
    def ep_mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` (dimension ``ep``) of the expert-parallel ranks, made once by
        :meth:`build_mesh`; ``None`` without expert parallelism."""
        return self._ep_mesh

    def submesh(self, dim: str) -> Any:
        """The 1-D ``DeviceMesh`` of ``dim`` (e.g. ``"tp"`` for tensor-parallel styles); ``None`` when the
        dimension has size 1."""
        if getattr(self, dim) == 1 or self._mesh is None:
            return None
        return self._mesh[dim]

    # ------------------------------------------------------------------ ranks
    def rank_in(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (``pp``, ``dp``, ``cp``, ``tp``, ``ep`` or ``edp``)."""
        if dim in ("ep", "edp"):
            flat = self.rank_in("dp") * self.cp + self.rank_in("cp")
            return flat % self.ep if dim == "ep" else flat // self.ep
        if dim not in MESH_DIMS:
            raise ValueError(f"unknown dimension {dim!r}; valid: {', '.join(MESH_DIMS + ('ep', 'edp'))}")
        return self._coord.get(dim, 0)

    @property
    def dp_rank(self) -> int:
        """Data-parallel coordinate (selects the rows of the step)."""
        return self.rank_in("dp")

    @property
    def cp_rank(self) -> int:
        """Context-parallel coordinate (selects the columns of the rows)."""
        return self.rank_in("cp")

    @property
    def tp_rank(self) -> int:
        """Tensor-parallel coordinate."""
        return self.rank_in("tp")

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.rank_in("pp")

    @property
    def ep_rank(self) -> int:
        """Expert-parallel coordinate (which expert shard this rank holds)."""
        return self.rank_in("ep")

    def token_rank(self) -> int:
        """This rank's index in the token group (0 in a single process)."""
        g = self.token_group
        return 0 if g is None else dist.get_rank(g)

    @property
    def log_owner(self) -> bool:
        """True on the first TP rank: TP replicas hold copies of the owner's (non-per-rank) log values."""
        return self.tp_rank == 0

    @property
    def loss_stage(self) -> bool:
        """True on the last pipeline stage (the one computing the losses)."""
        return self.pp_rank == self.pp - 1
