"""The accountant: exact, layout-invariant loss accounting inside a training loop (semantics §2, §3).

One optimizer step::

    acc.begin_step(masks)                 # pre-count normalizers: one all-reduce
    for mb in microbatches:
        loss = acc.lm_loss(per_token_loss, mask)  # this microbatch's exact share of J
        (loss + acc.mtp_loss(...)).backward()
    acc.finish_step(model)                # engine-dependent gradient scaling
    optimizer.step()
    logs = acc.logs()                     # every logged scalar of the step, one all-reduce

Two mechanisms make the objective layout-invariant (semantics §3). ``normalization="precount"`` (default):
the global denominators are counted from the masks before the first forward, and each microbatch
back-propagates ``numerator / denominator``. ``normalization="deferred"`` (Megatron
``calculate_per_token_loss=True``): raw numerators are back-propagated, the denominator is summed
as microbatches pass, and ``finish_step`` divides every gradient by it. In both, gradients must be
*summed* over data-parallel ranks: ``finish_step`` multiplies by ``D`` when the engine averages (DDP,
FSDP), or all-reduces them itself for a plain module.

The log channel is independent of the mode: per step ``lm_loss = S / Ntok``, ``objective = J``,
``tokens``, ``samples``, MTP per-depth losses and any declared auxiliary metric, all reduced in one
collective (torchmetrics style: state, update, one synchronised reduction, compute).

The protocol is a state machine (:class:`~lossparity.distributed.protocol.StepState`): a call that the
current state does not expect raises :class:`~lossparity.distributed.protocol.ProtocolError` naming the
expected call. Companions that must act between ``finish_step`` and ``logs`` (``MoEAccounting.end_step``)
register with :meth:`Accountant.register_step_end`; ``logs()`` refuses to run before them. Nothing in
``lm_loss``/``mtp_loss`` synchronizes with the host: denominators are host numbers read once at
``begin_step``, value checks (NaN/Inf, masks) are device flags reported by ``logs()`` (semantics §7).

Layout of the code, one concern per file around one per-step state object (``_Step``, replaced whole at
``begin_step``): the pre-count (:mod:`~lossparity.distributed.precount`), the log channel's declared metrics
and step buffer (:mod:`~lossparity.distributed.log_metrics`), the gradient scaling
(:mod:`~lossparity.distributed.grad_scaling`), the per-microbatch calls (:mod:`~lossparity.distributed.shares`:
a microbatch's share of ``J``, or its token weights for a fused head); this file holds the step's begin and end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..losses.modes import DENOMINATOR_KEY as _DEN_KEY
from ..losses.modes import MODES, check_mode
from ..losses.stats import rows_documents
from ..options import (
    GRAD_REDUCTIONS,
    MTP_CONVENTIONS,
    MTP_LOG_ESTIMATORS,
    NORMALIZATIONS,
    GradReduction,
    Mode,
    MTPConvention,
    MTPLogEstimator,
    Normalization,
    check_option,
)
from .grad_scaling import is_averaging_engine, reduce_and_scale, unique_grads
from .log_metrics import StepLogs
from .objective import Objective
from .parallel_dims import ParallelDims
from .precount import PreCount
from .protocol import ProtocolError, StepState, fingerprint_values, raise_fingerprint
from .shares import MicrobatchShares
from .step_protocol import StepRecord

__all__ = ["Accountant", "ProtocolError", "StepState", "NORMALIZATIONS", "GRAD_REDUCTIONS"]

# Fingerprint fields that legitimately differ between pipeline stages (MoE layers per chunk, extra counts)
_STAGE_FIELDS = ("moe", "counts")


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_weight(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _layout(
    group: ProcessGroup | None, mesh: DeviceMesh | None, sequence_parallel: bool, dims: ParallelDims | None
) -> ParallelDims:
    """The accountant's layout: ``dims`` (built), else adopted from ``mesh`` or from the data-parallel
    ``group`` (default: the world group when initialized, else one process)."""
    if sum(x is not None for x in (group, mesh, dims)) > 1:
        raise ValueError("pass at most one of group=, mesh= and dims=")
    if dims is not None:
        if not dims.built:
            raise RuntimeError("Accountant(dims=...): call dims.build_mesh() on every rank first")
        return dims
    if mesh is not None:
        return ParallelDims.from_mesh(mesh, sp=sequence_parallel)
    return ParallelDims.from_group(group)


class Accountant(MicrobatchShares):
    """Exact loss accounting for one training loop (see the module docstring for the protocol).

    Args:
        mode: normalization mode of the language-model objective (semantics §1), one of :data:`MODES`.
        group: data-parallel process group (``None``: the default group if initialized, else single
            process). Mutually exclusive with ``mesh``.
        mesh: ``DeviceMesh`` with named dimensions among ``dp, cp, tp, pp``.
        dims: a built :class:`~lossparity.distributed.parallel_dims.ParallelDims` (the layout object of the
            trainer); exclusive with ``group`` and ``mesh``; carries ``sequence_parallel`` itself.
        normalization: ``"precount"`` (default) or ``"deferred"`` (semantics §3).
        grad_reduction: how gradients are reduced over data-parallel ranks: ``"auto"`` (detect DDP/FSDP
            from the module given to ``finish_step``, else all-reduce plain modules), ``"mean"`` (the
            engine averages: multiply by ``D``), ``"sum"`` (already summed, or one process),
            ``"allreduce"`` (``finish_step`` sums the gradients itself).
        fixed_length: the ``L`` of ``sample_sum_norm``.
        mtp_depths: number of MTP depths ``Dm`` (0: no MTP); their masks are pre-counted by rolling.
        mtp_convention: ``own`` | ``main`` | ``pooled`` (semantics §4).
        mtp_log_estimator: ``"token_mean"`` (``S_k/Ntok_k``, default) or ``"microbatch_mean"``
            (Megatron: mean over microbatches and ranks of local means).
        check_finite: report NaN/Inf losses at ``logs()``, naming rank and microbatch (device flags: no
            host synchronization per microbatch).
    """

    def __init__(
        self,
        mode: Mode = "per_token",
        group: ProcessGroup | None = None,
        *,
        mesh: DeviceMesh | None = None,
        sequence_parallel: bool = False,
        dims: ParallelDims | None = None,
        normalization: Normalization = "precount",
        grad_reduction: GradReduction = "auto",
        fixed_length: int | None = None,
        mtp_depths: int = 0,
        mtp_convention: MTPConvention = "own",
        mtp_log_estimator: MTPLogEstimator = "token_mean",
        check_finite: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        self.mode: Mode = check_mode(mode)  # type: ignore[assignment]
        self.normalization = check_option("normalization", normalization, NORMALIZATIONS)
        self.grad_reduction = check_option("grad_reduction", grad_reduction, GRAD_REDUCTIONS)
        self.mtp_convention = check_option("mtp_convention", mtp_convention, MTP_CONVENTIONS)
        self.mtp_log_estimator = check_option("mtp_log_estimator", mtp_log_estimator, MTP_LOG_ESTIMATORS)
        self.mtp_depths = _check_int("mtp_depths", mtp_depths, 0)
        if mode == "per_group" and self.normalization == "deferred":
            # n_g spans microbatches and ranks: every share divides by it before the backward
            raise ValueError("mode 'per_group' needs normalization='precount' (its group counts span ranks)")
        if mode == "per_group" and mtp_depths and self.mtp_convention == "pooled":
            raise ValueError("mode 'per_group' is not combined with mtp_convention='pooled' (use 'own' or 'main')")
        if mode == "sample_sum_norm" and fixed_length is None:
            raise ValueError(f"mode 'sample_sum_norm' needs fixed_length > 0, got fixed_length={fixed_length}")
        if fixed_length is not None:
            _check_int("fixed_length (the L of sample_sum_norm, > 0)", fixed_length, 1)
        if self.normalization == "deferred" and mtp_depths and mode == "per_token" and mtp_convention != "main":
            # One division of all gradients by one count cannot give each depth its own count.
            raise ValueError(
                "normalization='deferred' with mode 'per_token' divides every gradient by the main token "
                f"count, so it needs mtp_convention='main' (got {mtp_convention!r})"
            )
        self.fixed_length = fixed_length
        self.check_finite = bool(check_finite)
        self.objective = Objective(
            self.mode,
            self.normalization,
            fixed_length,
            self.mtp_depths,
            self.mtp_convention,
            self.mtp_log_estimator,
            self.check_finite,
        )
        super().__init__(_layout(group, mesh, sequence_parallel, dims), self.mtp_depths)
        self.groups: ParallelDims  # the one layout object (``dims``, or adopted from ``mesh``/``group``)
        self.device = torch.device(device) if device is not None else self._default_device()

    def _default_device(self) -> torch.device:
        g = self.groups.log_group
        if g is not None and dist.get_backend(g) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ registrations (outside a step)

    # ------------------------------------------------------------------ where the protocol stands

    # ------------------------------------------------------------------ begin_step: the pre-count
    def _fingerprint_fields(self, count_names: Sequence[str]) -> dict[str, object]:
        """What must be equal on every data-parallel rank (compared by the pre-count all-reduce)."""
        return {
            "mode": self.mode,
            "normalization": self.normalization,
            "grad_reduction": self.grad_reduction,
            "fixed_length": self.fixed_length,
            "mtp_depths": self.mtp_depths,
            "mtp_convention": self.mtp_convention,
            "mtp_log_estimator": self.mtp_log_estimator,
            "mtp_weight": self.mtp_weight,
            "counts": tuple(count_names),
            "log_metrics": self._registry.fingerprint(),
            "moe": tuple(sorted((k, repr(v)) for k, v in self._fingerprint_extra.items())),
        }

    def begin_step(
        self,
        masks: Sequence[Tensor],
        segment_ids: Sequence[Tensor | None] | None = None,
        *,
        mtp_weight: float | None = None,
        extra_counts: Mapping[str, float] | None = None,
        group_ids: Sequence[Tensor] | None = None,
        num_groups: int | None = None,
    ) -> None:
        """Start a step: pre-count the normalizers of every microbatch of this rank and sum them over
        the data-parallel group in one all-reduce (``precount``), or only remember the local counts
        (``deferred``).

        ``masks`` are this rank's microbatch loss masks ``[b, S]`` of whole rows (with context parallelism:
        the rows before sharding, identical on the CP peers) in the order ``lm_loss`` will see them;
        ``segment_ids`` (packed rows) likewise, needed by ``per_document`` and by MTP rolling within
        documents. ``mtp_weight`` is the MTP ``λ`` of this step (default: the previous step's). ``extra_counts``
        are further local counts (e.g. the router's non-padding tokens) summed in the same all-reduce; read
        them back with :meth:`global_count`. Their names must be the same on every rank. The same
        all-reduce carries a fingerprint of the configuration: ranks built differently stop with an error
        naming the differing field.

        ``per_group`` (and only it) needs ``group_ids``, one integer ``[b]`` tensor per microbatch giving each
        row's group in ``[0, num_groups)``, ``num_groups`` equal on every rank: the same all-reduce sums each
        group's rows and its tokens ``n_g`` (at the main loss and every MTP depth) over the data-parallel ranks,
        so a group may span microbatches and ranks; ``Ngrp`` is the number of ids holding at least one row.
        """
        if self.state is not StepState.IDLE:
            raise ProtocolError(f"begin_step called before the previous step ended: expected {self.expected_call()}")
        weight = self.mtp_weight
        bad_weight: Exception | None = None
        try:
            weight = weight if mtp_weight is None else _check_weight("mtp_weight", mtp_weight)
        except ValueError as e:  # reported after the collective, as every invalid input (semantics §7)
            bad_weight = e
        rank = self.groups.token_rank()

        def fields(names: tuple[str, ...]) -> dict[str, object]:
            return {**self._fingerprint_fields(names), "mtp_weight": weight}

        pre, error = PreCount.count_local(
            self.mode,
            self.mtp_depths,
            self.device,
            rank,
            masks,
            segment_ids,
            extra_counts,
            fields,
            group_ids,
            num_groups,
        )
        if bad_weight is not None and error is None:
            error = bad_weight
            pre.buffer[pre.slots.sl("error")] = 1.0
        reduced = self.normalization == "precount"  # deferred has no collective here: errors stay local
        if reduced:  # whole rows: context-parallel peers count the same rows, so the sum runs over DP only
            self._all_reduce(pre.buffer, self.groups.dp_group)
        peers = self.groups.dp_size if reduced and self.groups.dp_group is not None else 1
        pre.read(error, peers, rank, raise_fingerprint)
        world_fp = fingerprint_values({k: v for k, v in pre.fp_fields.items() if k not in _STAGE_FIELDS})
        self._step = StepRecord(
            index=self._step.index + 1,
            state=StepState.MICROBATCHES,
            mtp_weight=weight,
            pre=pre,
            logs=StepLogs(self._registry, self.mtp_depths, self.device, world_fp),
        )

    def global_count(self, name: str) -> float:
        """A count of this step: ``tokens``, ``samples``, ``documents``, ``microbatches``, ``mtp_<k>_tokens``
        or an ``extra_counts`` name, summed over the data-parallel group (``precount``; local in
        ``deferred`` until ``finish_step``). A host number: no synchronization."""
        self._require_step("global_count")
        return self._step.counts().global_count(name)

    @property
    def num_microbatches(self) -> int:
        """``D·K`` of this step (pre-counted)."""
        return int(self.global_count("microbatches"))

    def documents_of(self, segment_ids: Tensor) -> tuple[Tensor, int]:
        """``rows_documents(segment_ids)`` of a microbatch: numbered at ``begin_step`` (mode ``per_document``)
        when ``segment_ids`` is a tensor given there, else numbered now (one host sync)."""
        found = None if self._step.pre is None else self._step.pre.documents_of(segment_ids)
        return rows_documents(segment_ids) if found is None else found

    def _all_reduce(self, t: Tensor, group: ProcessGroup | None) -> None:
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    def _mtp_denominators(self) -> list[float]:
        """Per-depth denominators of this step's MTP term (semantics §4); 1 when deferred."""
        return self.objective.mtp_denominators(self._step.counts())

    # ------------------------------------------------------------------ the log channel's one entry point

    # ------------------------------------------------------------------ finish_step: the gradients
    def _resolve_reduction(self, model: object) -> str:
        """``grad_reduction``, with ``auto`` resolved from the engine of ``model``: ``mean`` for averaging
        engines (DDP, FSDP), ``allreduce`` for a plain module over several gradient ranks, else ``sum``."""
        reduction = self.grad_reduction
        if reduction == "auto":
            if model is not None and is_averaging_engine(model):
                return "mean"
            return "allreduce" if model is not None and self.groups.grad_size > 1 else "sum"
        return reduction

    def finish_step(
        self, model: nn.Module | Iterable[Tensor] | None = None, *, expert_params: Iterable[Tensor] = ()
    ) -> float:
        """Scale (and, for plain modules, reduce) the gradients so that they are those of ``J``.

        Checks that every pre-counted microbatch was seen (by ``lm_loss``, and by ``mtp_loss`` when
        ``mtp_depths > 0``). ``deferred``: all-reduces the step's denominator over the data-parallel group
        and divides all gradients by it. Averaging engines (DDP, FSDP, over DP × CP) get a factor ``D·C``;
        ``grad_reduction="allreduce"`` (or ``auto`` with a plain module and ``D·C > 1``) sums the gradients
        over DP × CP. Returns the factor applied.

        ``expert_params``: expert shards under expert parallelism (``model/expert_parallel.py``). Their
        local gradients are already summed over the expert-parallel ranks (the all-to-all backward); they
        are summed over the expert-data-parallel group only, ``g_e ← Σ_{edp} g_e``, get the ``deferred``
        factor but never the engine's ``D·C`` (the engine must not see them), and are left out of
        ``model``'s reduction.
        """
        if self.state is not StepState.MICROBATCHES:
            what = "twice in one step" if self.state is StepState.FINISHED else "outside a step"
            raise ProtocolError(f"finish_step called {what}: expected {self.expected_call()}")
        self._check_microbatches_done("finish_step")
        reduction = self._resolve_reduction(model)
        deferred = 1.0
        if self.normalization == "deferred":
            pre = self._step.counts()
            pre.buffer[pre.slots.sl("error")] = 0.0
            self._all_reduce(pre.buffer, self.groups.dp_group)
            pre.read(None, self.groups.dp_size if self.groups.dp_group is not None else 1, 0, raise_fingerprint)
            deferred = 1.0 / pre.denominator(_DEN_KEY[self.mode])
        factor = (float(self.groups.grad_size) if reduction == "mean" else 1.0) * deferred
        self._step.state = StepState.FINISHED
        self._step.grad_factor = factor
        experts = list(expert_params)
        group = self.groups.grad_group if reduction == "allreduce" else None
        if group is not None or factor != 1.0:  # else nothing to touch: skip the walk over the parameters
            skip = {id(p) for p in experts}
            grads = unique_grads(model, fill_missing=reduction == "allreduce", skip=skip)
            reduce_and_scale(grads, group, factor)
        if experts:
            reduce_and_scale(unique_grads(experts, fill_missing=True), self.groups.edp_group, deferred)
        return factor

    # ------------------------------------------------------------------ logs: the one logging collective

    def logs(self) -> dict[str, float | None]:
        """All log-channel scalars of the step, reduced over every rank in one collective (semantics §2).

        ``lm_loss = S/Ntok`` (``None`` when ``Ntok = 0``), ``objective = J`` (language model plus MTP plus
        added auxiliary contributions), ``tokens``, ``samples``, ``microbatches``, ``documents`` (packed),
        ``mtp_<k>_loss`` and every declared metric; when ``J`` is more than ``lm_loss`` (MTP, added terms or
        another mode than ``per_token``) also its parts, ``J = objective_lm + mtp_weight·objective_mtp +
        objective_aux`` (the mode's LM term, the MTP term before ``λ``, the added MoE/indexer terms). Ends the
        step. Raises the step's failed value checks
        (NaN/Inf losses, masks that differ from ``begin_step``'s) on every rank, naming rank and microbatch.
        """
        self._check_logs_order()
        step = self._step
        buf = step.buffer()
        v = buf.reduced(self.groups.log_owner, lambda t: self._all_reduce(t, self.groups.log_group))
        step.state = StepState.IDLE
        get = {name: v[buf.slots.sl(name)] for name in buf.slots.names()}
        g = self.groups.log_group
        n = 1 if g is None else dist.get_world_size(g)
        rank = dist.get_rank() if dist.is_initialized() else 0
        # Every rank of the logging collective (context, tensor, pipeline peers too) compares its settings.
        world = {k: v for k, v in step.counts().fp_fields.items() if k not in _STAGE_FIELDS}
        fix = "Accountant with the same arguments"
        raise_fingerprint(world, get["world_fingerprint"], n, f"{n} ranks of the logging collective", rank, fix)
        counted = step.counts().microbatches
        buf.raise_checks(
            get["checks"], self.groups.token_rank(), lambda mb: counted[mb].tokens if mb < len(counted) else "?"
        )
        groups = self._step.pre.host.get("groups", [0.0])[0] if self._step.pre is not None else 0.0
        return self.objective.log_values(get, buf.metric_values(v), self.mtp_weight, groups)


assert set(_DEN_KEY) == set(MODES)
