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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..losses.logchannel import ratio_or_none
from ..losses.modes import DENOMINATOR_KEY as _DEN_KEY
from ..losses.modes import MODES, check_mode, numerator, unit_count_map
from ..losses.mtp import mtp_denominators, mtp_numerator, mtp_scale, roll_mask
from ..losses.stats import check_inputs, count_documents, rows_documents, sample_stats
from ..losses.token_weights import mtp_token_weights, token_weights
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
from .collectives import all_reduce_coalesced
from .groups import ParallelGroups, resolve_groups
from .parallel_dims import ParallelDims
from .protocol import (
    DeviceChecks,
    Layout,
    ProtocolError,
    StepState,
    fingerprint_mismatch,
    fingerprint_slots,
    fingerprint_values,
)

__all__ = ["Accountant", "ProtocolError", "StepState", "NORMALIZATIONS", "GRAD_REDUCTIONS"]

_UNIT_COUNTS = ("tokens", "samples", "documents", "microbatches")
# Fixed length of the pre-count buffer: ranks must reduce buffers of one length even when their
# configurations differ, so that the fingerprint can report the difference (a length mismatch aborts).
_COUNT_CAPACITY = 256
# Fingerprint fields that legitimately differ between pipeline stages (MoE layers per chunk, extra counts)
_STAGE_FIELDS = ("moe", "counts")
_MB_CODE = 4096  # device-check location code: microbatch * _MB_CODE + sub-location (MTP depth, MoE layer)

# Built-in value checks: name -> (exception, message); the location is appended.
_CHECKS: dict[str, tuple[type[Exception], str]] = {
    "lm_nonfinite": (FloatingPointError, "lm_loss: per_token_loss has NaN/Inf where the mask is 1"),
    "lm_mask": (
        ValueError,
        "lm_loss: mask differs from the one begin_step counted for this microbatch "
        "({expected} tokens): pass the same masks (0/1), in the same order",
    ),
    "lm_segments": (ValueError, "lm_loss: segment_ids differ from the ones given to begin_step for this microbatch"),
    "mtp_nonfinite": (FloatingPointError, "mtp_loss: losses have NaN/Inf where the mask is 1"),
    "mtp_mask": (
        ValueError,
        "mtp_loss: masks must be 0/1 and hold the tokens begin_step counted for this "
        "depth (roll the main mask with roll_mtp)",
    ),
}


def _shaped_like(counts: Tensor | None, mask: object) -> Tensor | None:
    """A unit-count map in the shape of ``mask`` (``[S]`` masks of one row), when the sizes agree; else as
    it is (the shape check of the token weights then names the mismatch)."""
    if counts is None or not isinstance(mask, Tensor) or counts.shape == mask.shape:
        return counts
    return counts.reshape(mask.shape) if counts.numel() == mask.numel() else counts


def _is_averaging_engine(model: object) -> bool:
    """DDP and FSDP (1 and 2) divide gradients by the data-parallel size."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule  # FSDP2, torch >= 2.6

        if isinstance(model, FSDPModule):
            return True
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return isinstance(model, FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        return False


def _unique_grads(
    model: nn.Module | Iterable[Tensor] | None, fill_missing: bool = False, skip: set[int] | None = None
) -> list[Tensor]:
    """Gradients of the distinct parameters (except those whose ``id`` is in ``skip``); with
    ``fill_missing``, parameters that require grad but got none (e.g. an expert that received no token on
    this rank) get zeros, so that every rank reduces a buffer of the same layout."""
    if model is None:
        return []
    params = model.parameters() if isinstance(model, nn.Module) else model
    seen: set[int] = set(skip or ())
    grads = []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad is None:
            if not (fill_missing and p.requires_grad):
                continue
            p.grad = torch.zeros_like(p)
        g = p.grad
        # DTensor gradients (tensor parallel, FSDP2): scale/reduce the local shard in place.
        grads.append(g.to_local() if hasattr(g, "to_local") else g)
    return grads


def _as_2d(x: Tensor) -> Tensor:
    return x if x.dim() == 2 else x.unsqueeze(0)


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_weight(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_mask_arg(name: str, mask: object, loss: Tensor) -> Tensor:
    """Type and device of a mask given with a loss (no value scan: those are device flags)."""
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(mask).__name__} (convert lists and NumPy "
            "arrays with torch.as_tensor)"
        )
    if mask.device != loss.device:
        raise ValueError(f"{name} is on {mask.device} but the losses are on {loss.device}: move it to {loss.device}")
    return mask


def _same_storage(a: object, b: Tensor) -> bool:
    """``a`` and ``b`` view the same elements (the same tensor, or an identical view of it): no sync."""
    if a is b:
        return True
    return (
        isinstance(a, Tensor)
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def _reduce_and_scale(grads: list[Tensor], group: ProcessGroup | None, factor: float) -> None:
    """``g ← factor · Σ_group g`` in place for every ``g`` of ``grads`` (one all-reduce of their
    concatenation; no collective when ``group`` is ``None``)."""
    all_reduce_coalesced(grads, group)
    if factor != 1.0 and grads:
        torch._foreach_mul_(grads, factor)


class Accountant:
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
        self.groups: ParallelGroups = resolve_groups(group, mesh, sequence_parallel=sequence_parallel, dims=dims)
        self.device = torch.device(device) if device is not None else self._default_device()
        self.mtp_weight = 1.0
        self._metrics: dict[str, tuple[str, bool]] = {}  # declared metric -> (reduce, per_rank)
        self._checks: dict[str, tuple[type[Exception], str, str]] = {
            k: (e, m, "MTP depth" if k.startswith("mtp") else "") for k, (e, m) in _CHECKS.items()
        }
        self._step_ends: dict[str, bool] = {}  # registered step ends -> done this step
        self._fingerprint_extra: dict[str, object] = {}
        self.step_index = 0  # number of begin_step calls: lets companions cache per-step reads
        self.state = StepState.IDLE
        self._log_layout = Layout()  # the reduced buffer's named states, laid out at begin_step
        self._mb = 0
        self._n_mbs = 0
        self._mtp_done = True

    # ------------------------------------------------------------------ setup
    def _default_device(self) -> torch.device:
        g = self.groups.log_group
        if g is not None and dist.get_backend(g) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _require_idle(self, what: str) -> None:
        if self.state is not StepState.IDLE:
            raise ProtocolError(f"{what} must be called outside a step: expected {self.expected_call()}")

    def declare_metric(self, name: str, reduce: str = "ratio", *, per_rank: bool = False) -> None:
        """Declare an auxiliary log metric: ``reduce="ratio"`` reports ``Σ num / Σ den`` (``None`` when
        ``Σ den = 0``), ``reduce="sum"`` reports ``Σ num``, sums over all ranks and microbatches.
        ``per_rank=True``: every tensor-parallel rank records distinct tokens (sequence parallelism), so
        its values are summed over TP too; by default TP ranks hold copies and only the first counts.

        Must be called identically on every rank, outside a step (it fixes the layout of the logging
        collective, part of the fingerprint checked at ``begin_step``); a rank that has nothing to record
        still takes part with zeros (semantics §6). Declaring a declared name again keeps it.
        """
        self._require_idle(f"declare_metric({name!r})")
        if reduce not in ("ratio", "sum"):
            raise ValueError(f"declare_metric: reduce must be 'ratio' or 'sum', got {reduce!r}")
        old = self._metrics.get(name, (reduce, False))
        self._metrics[name] = (old[0], old[1] or per_rank)

    def register_check(self, name: str, error: type[Exception], message: str, sub: str = "") -> None:
        """Register a device-side value check reported by ``logs()`` (see :meth:`flag`): ``message`` is the
        error text, ``sub`` names the sub-location of the code (e.g. ``"layer"``). Outside a step."""
        if self._checks.get(name) == (error, message, sub):
            return  # registered already (e.g. by another pipeline chunk's MoEAccounting)
        self._require_idle(f"register_check({name!r})")
        self._checks[name] = (error, message, sub)

    def register_step_end(self, name: str, fingerprint: object = None) -> None:
        """Register a companion call ``name`` (e.g. ``"MoEAccounting.end_step(routers)"``) that must run
        every step between ``finish_step`` and ``logs()``; it reports with :meth:`step_end_done`.
        ``fingerprint``: its configuration, compared over the ranks at ``begin_step``."""
        self._require_idle(f"register_step_end({name!r})")
        if name in self._step_ends:
            raise ValueError(f"step end {name!r} is already registered")
        self._step_ends[name] = False
        self._fingerprint_extra[f"step_end:{name}"] = fingerprint

    @property
    def registered_step_ends(self) -> tuple[str, ...]:
        """Names given to :meth:`register_step_end`, in order."""
        return tuple(self._step_ends)

    def documents_of(self, segment_ids: Tensor) -> tuple[Tensor, int]:
        """``rows_documents(segment_ids)`` of a microbatch: numbered at ``begin_step`` (mode ``per_document``)
        when ``segment_ids`` is a tensor given there, else numbered now (one host sync)."""
        for seg, info in zip(getattr(self, "_segs", ()), getattr(self, "_mb_info", ())):
            if info["documents"] is not None and _same_storage(seg, segment_ids):
                return info["documents"]
        return rows_documents(segment_ids)

    def step_end_done(self, name: str) -> None:
        """Report that the registered step end ``name`` ran for this step (after ``finish_step``)."""
        if self.state is not StepState.FINISHED:
            raise ProtocolError(f"{name} called before finish_step: expected {self.expected_call()}")
        if self._step_ends[name]:
            raise ProtocolError(f"{name} called twice in one step: expected {self.expected_call()}")
        self._step_ends[name] = True

    @property
    def finished(self) -> bool:
        """True between ``finish_step`` and ``logs`` (gradients of the step are final)."""
        return self.state is StepState.FINISHED

    @property
    def where(self) -> str:
        """``rank r, microbatch m`` of the current call (for messages)."""
        return f"rank {self.groups.token_rank()}, microbatch {self._mb}"

    def expected_call(self) -> str:
        """The call the protocol expects next (as the ProtocolError messages name it), e.g. ``"logs()"``."""
        if self.state is StepState.IDLE:
            return "begin_step(masks)"
        if self.state is StepState.MICROBATCHES:
            if self._mb < self._n_mbs and self.groups.loss_stage:
                return f"lm_loss(...) for microbatch {self._mb} of {self._n_mbs}"
            return "finish_step(model)"
        pending = [n for n, done in self._step_ends.items() if not done]
        return pending[0] if pending else "logs()"

    # ------------------------------------------------------------------ step
    def _fingerprint(self, count_names: Sequence[str]) -> list[float]:
        self._fp_fields = self._fingerprint_fields(count_names)
        return fingerprint_values(self._fp_fields)

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
            "log_metrics": (tuple(self._metrics.items()), tuple(self._checks)),
            "moe": tuple(sorted((k, repr(v)) for k, v in self._fingerprint_extra.items())),
        }

    def _world_fingerprint(self) -> list[float]:
        """The fields every rank of the logging collective must share, whatever its pipeline stage or
        context/tensor shard (the MoE and count fields may differ by stage: not compared there)."""
        same = {k: v for k, v in self._fp_fields.items() if k not in _STAGE_FIELDS}
        return fingerprint_values(same)

    def _count_layout(self, extra: Sequence[str]) -> Layout:
        lay = Layout()
        lay.add("fingerprint", fingerprint_slots())
        lay.add("error")
        for name in _UNIT_COUNTS:
            lay.add(name)
        lay.add("mtp_tokens", self.mtp_depths)
        for name in extra:
            lay.add(f"extra:{name}")
        if lay.size > _COUNT_CAPACITY:
            raise ValueError(
                f"too many counts ({lay.size} > {_COUNT_CAPACITY}): mtp_depths={self.mtp_depths}, "
                f"{len(extra)} extra_counts"
            )
        lay.add("pad", _COUNT_CAPACITY - lay.size)
        return lay

    def _count_microbatch(self, counts: Tensor, lay: Layout, i: int, w: object, seg: object) -> None:
        """Validate microbatch ``i``'s mask (and segment ids) and add its counts (host syncs allowed here)."""
        where = f"rank {self.groups.token_rank()}, microbatch {i}"
        for name, x in (("masks", w), ("segment_ids", seg)):
            if x is not None and not isinstance(x, Tensor):
                raise TypeError(
                    f"{name}[{i}] must be a torch.Tensor, got {type(x).__name__} ({where}): convert "
                    "lists and NumPy arrays with torch.as_tensor"
                )
        w2 = _as_2d(w)  # type: ignore[arg-type]
        seg2 = None if seg is None else _as_2d(seg)  # type: ignore[arg-type]
        check_inputs(w2.to(torch.float32), w2, seg2, where=where, check_finite=False)
        docs = None
        if seg2 is not None and self.mode == "per_document":
            docs = rows_documents(seg2)
            if bool(((docs[0] < 0) & (w2 > 0)).any()):
                raise ValueError(
                    f"masks[{i}] has loss-bearing tokens at segment_ids == 0 (padding); they "
                    f"belong to no document ({where})"
                )
        ndoc = docs[1] if docs is not None else (count_documents(seg2) if seg2 is not None else 0)
        ntok = w2.sum().to(torch.float64)
        depth_tokens = [float(roll_mask(w2, seg2, k).sum()) for k in range(1, self.mtp_depths + 1)]
        self._mb_info.append(
            {"tokens": int(ntok.item()), "docs": ndoc, "documents": docs, "depth_tokens": depth_tokens}
        )
        counts[lay.sl("tokens")] += ntok
        counts[lay.sl("samples")] += w2.shape[0]
        counts[lay.sl("microbatches")] += 1
        counts[lay.sl("documents")] += ndoc
        if self.mtp_depths:
            counts[lay.sl("mtp_tokens")] += torch.tensor(depth_tokens, dtype=torch.float64, device=counts.device)

    def _local_counts(
        self, masks: object, segment_ids: object, mtp_weight: float | None, extra_counts: object
    ) -> tuple[Tensor, Layout, Exception | None, list, list]:
        """The pre-count buffer of this rank (and its masks and segment ids as lists); an exception is
        returned (and flagged in the buffer) so that every rank still enters the collective and its peers
        report it (semantics §7)."""
        lay = self._count_layout([])
        counts = lay.zeros(self.device)
        self._mb_info: list[dict] = []
        mask_list: list = []
        segs: list = []
        try:
            mask_list = list(masks)  # type: ignore[call-overload]
            segs = self._check_begin_args(mask_list, segment_ids, mtp_weight)  # type: ignore[arg-type]
            extra = dict(extra_counts or {})  # type: ignore[call-overload]
            lay = self._count_layout(list(extra))
            counts = lay.zeros(self.device)
            for name, value in extra.items():
                counts[lay.sl(f"extra:{name}")] = float(value)
            for i, (w, seg) in enumerate(zip(mask_list, segs)):
                self._count_microbatch(counts, lay, i, w, seg)
        except Exception as e:  # noqa: BLE001 - any failure must reach the peers as a flag, not a hang
            counts[lay.sl("error")] = 1.0
            counts[lay.sl("fingerprint")] = torch.tensor(self._fingerprint(lay.names()), dtype=torch.float64)
            return counts, lay, e, mask_list, segs
        counts[lay.sl("fingerprint")] = torch.tensor(self._fingerprint(lay.names()), dtype=torch.float64)
        return counts, lay, None, mask_list, segs

    def _check_begin_args(self, masks: list, segment_ids: Sequence | None, mtp_weight: float | None) -> list:
        if not masks:
            raise ValueError("begin_step needs the masks of at least one microbatch (masks is empty)")
        segs = list(segment_ids) if segment_ids is not None else [None] * len(masks)
        if len(segs) != len(masks):
            raise ValueError(f"segment_ids has {len(segs)} entries but masks has {len(masks)}")
        if self.mode == "per_document" and any(s is None for s in segs):
            raise ValueError("mode 'per_document' needs segment_ids for every microbatch in begin_step")
        if mtp_weight is not None:
            self.mtp_weight = _check_weight("mtp_weight", mtp_weight)
        return segs

    def begin_step(
        self,
        masks: Sequence[Tensor],
        segment_ids: Sequence[Tensor | None] | None = None,
        *,
        mtp_weight: float | None = None,
        extra_counts: Mapping[str, float] | None = None,
    ) -> None:
        """Start a step: pre-count the normalizers of every microbatch of this rank and sum them over
        the token group in one all-reduce (``precount``), or only remember the local counts (``deferred``).

        ``masks`` are this rank's microbatch loss masks ``[b, S]`` of whole rows (with context parallelism:
        the rows before sharding, identical on the CP peers) in the order ``lm_loss`` will see them;
        ``segment_ids`` (packed rows) likewise, needed by ``per_document`` and by MTP rolling within
        documents. ``mtp_weight`` is the MTP ``λ`` of this step. ``extra_counts`` are further local
        counts (e.g. the router's non-padding tokens) summed in the same all-reduce; read them back
        with :meth:`global_count`. Their names must be the same on every rank. The same all-reduce
        carries a fingerprint of the configuration: ranks built differently stop with an error naming
        the differing field.
        """
        if self.state is not StepState.IDLE:
            raise ProtocolError(f"begin_step called before the previous step ended: expected {self.expected_call()}")
        counts, lay, error, masks, segs = self._local_counts(masks, segment_ids, mtp_weight, extra_counts)
        if self.normalization == "precount":  # deferred has no collective here: errors stay local
            # Whole rows: context-parallel peers count the same rows, so the sum runs over DP only.
            self._all_reduce(counts, self.groups.dp_group)
        self._read_counts(counts, lay, error, reduced=self.normalization == "precount")
        self._counts_layout, self._counts = lay, counts
        self._extra_names = [n[len("extra:") :] for n in lay.names() if n.startswith("extra:")]
        self.step_index += 1
        self._masks, self._segs = masks, segs
        self._unit_maps: dict[tuple[int, int], Tensor | None] = {}
        self._n_mbs, self._mb, self._mtp_done = len(masks), 0, True
        layout = self._make_log_layout()
        if not self._log_layout.names() or layout.names() != self._log_layout.names():
            self._sum_index: dict[tuple[str, ...], Tensor] = {}
        self._log_layout = layout
        self._acc = layout.zeros(self.device)
        self._acc[layout.sl("world_fingerprint")] = torch.tensor(
            self._world_fingerprint(), dtype=torch.float64, device=self.device
        )
        self._device_checks = DeviceChecks(list(self._checks))
        self._step_ends = dict.fromkeys(self._step_ends, False)
        self._grad_factor: float | None = None
        self.state = StepState.MICROBATCHES

    def _read_counts(self, counts: Tensor, lay: Layout, error: Exception | None, *, reduced: bool) -> None:
        """Host copy of the (reduced) counts: the step's one read; raise on any rank's error or mismatch."""
        values = counts.tolist()
        if error is not None:
            raise error
        flagged = values[lay.sl("error")][0]
        if flagged > 0:
            raise RuntimeError(
                f"{int(flagged)} other rank(s) reported invalid input in begin_step (see their "
                f"error); rank {self.groups.token_rank()} stops too"
            )
        n = self.groups.dp_size if reduced and self.groups.dp_group is not None else 1
        self._raise_fingerprint(
            values[lay.sl("fingerprint")],
            n,
            f"{n} data-parallel ranks",
            self.groups.token_rank(),
            "Accountant and MoEAccounting with the same arguments and declare the same metrics",
        )
        self._host_counts = {name: values[lay.sl(name)] for name in lay.names() if name not in ("pad",)}

    def _make_log_layout(self) -> Layout:
        lay = Layout()
        for name in ("S", "Ntok", "samples", "documents", "microbatches", "lm_num"):
            lay.add(name)
        for k in range(1, self.mtp_depths + 1):
            lay.add(f"mtp_{k}", 4)  # S_k, Ntok_k, Σ local means, numerator
        lay.add("mtp_pooled_num")
        for name, (_, per_rank) in self._metrics.items():
            lay.add(f"metric:{name}", 2, local=per_rank)
        lay.add("objective")  # added contributions, replicated over TP
        lay.add("objective_local", local=True)  # added contributions distinct per TP rank
        lay.add("checks", len(self._checks), local=True)
        # Every rank's (not only the data-parallel peers') layout-independent settings, compared at logs()
        lay.add("world_fingerprint", fingerprint_slots(), local=True)
        return lay

    def global_count(self, name: str) -> float:
        """A count of this step: ``tokens``, ``samples``, ``documents``, ``microbatches``, ``mtp_<k>_tokens``
        or an ``extra_counts`` name, summed over the token group (``precount``; local in ``deferred``
        until ``finish_step``). A host number: no synchronization."""
        self._require_step("global_count")
        c = self._host_counts
        if name in _UNIT_COUNTS:
            return c[name][0]
        if name.startswith("mtp_") and name.endswith("_tokens") and name[4:-7].isdigit():
            k = int(name[4:-7])
            if 1 <= k <= self.mtp_depths:
                return c["mtp_tokens"][k - 1]
        if f"extra:{name}" in c:
            return c[f"extra:{name}"][0]
        raise KeyError(f"unknown count {name!r}; extra counts of this step: {self._extra_names}")

    @property
    def num_microbatches(self) -> int:
        """``D·K`` of this step (pre-counted)."""
        return int(self.global_count("microbatches"))

    def _all_reduce(self, t: Tensor, group: ProcessGroup | None) -> None:
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    def _denominator(self, key: str) -> float:
        return max(self._host_counts[key][0], 1.0)

    def _unit_counts(self, mb: int, depth: int, columns: Tensor | None, *, whole: bool = False) -> Tensor | None:
        """Whole-row unit counts of microbatch ``mb`` (depth 0 = main loss) restricted to ``columns``;
        ``None`` without context parallelism (local counts are then the whole-row counts) unless ``whole``
        (the map of the rows given to ``begin_step``: the token weights take it instead of numbering the
        documents again, which would read them to the host every microbatch)."""
        if columns is None and not whole:
            return None
        if mb >= len(self._masks):
            return None  # more microbatches than counted: the accounting call that follows names it
        key = (mb, depth)
        if key not in self._unit_maps:
            w, seg = _as_2d(self._masks[mb]), self._segs[mb]
            if depth:
                w = roll_mask(w, seg, depth)
            # the documents numbered at begin_step: no host sync here (per microbatch)
            self._unit_maps[key] = unit_count_map(self.mode, w, seg, documents=self._mb_info[mb]["documents"])
        full = self._unit_maps[key]
        if full is None or columns is None:
            return full
        return full[:, columns]

    def _check_columns(self, columns: Tensor | None) -> None:
        if self.groups.cp_size > 1 and columns is None:
            raise ValueError(
                f"context parallelism (cp={self.groups.cp_size}) needs columns= (the positions of the whole rows "
                f"this shard holds) in lm_loss/mtp_loss ({self.where})"
            )

    def flag(self, check: str, bad: Tensor, sub: Tensor | int = 0, *, microbatch: int | None = None) -> None:
        """Record a failed value check on the device (no host sync); ``logs()`` raises it on every rank,
        naming this rank, the microbatch (default: the last one ``lm_loss`` saw) and ``sub`` (e.g. the
        layer: a tensor of the shape of ``bad`` gives one sub-location per element). ``bad`` is a bool
        tensor (bad where true) or a floating tensor (bad where not finite, tested once per step)."""
        self._require_step(f"flag({check!r})")
        mb = max(self._mb - 1, 0) if microbatch is None else microbatch
        self._device_checks.flag(check, bad, sub, float(mb * _MB_CODE))

    def _flag_mask(self, check: str, w: Tensor, expected: Tensor, code: float) -> None:
        self._device_checks.flag(check, w != expected.to(w.device, w.dtype), code)

    def _flag_nonfinite(self, check: str, sample_sums: Tensor, code: float) -> None:
        """NaN/Inf where the mask is 1 shows in the per-sample masked sums ``s_i`` (computed anyway for the
        logs): ``s - s`` is NaN exactly there. Two kernels on ``[b]``."""
        if self.check_finite:
            self._device_checks.flag(check, (sample_sums - sample_sums) != 0, code)

    @staticmethod
    def _expected(columns: Tensor | None, rows: Tensor | None) -> Tensor | None:
        """Rows given to begin_step, restricted to this shard's ``columns``."""
        if rows is None:
            return None
        full = _as_2d(rows)
        return full if columns is None else full[:, columns]

    def _lm_inputs(
        self, per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.state is not StepState.MICROBATCHES or self._mb >= self._n_mbs:
            got = "only " if self.state is StepState.MICROBATCHES else ""
            raise ProtocolError(
                f"lm_loss called for microbatch {self._mb} but begin_step received {got}{self._n_mbs} masks "
                f"(rank {self.groups.token_rank()}): expected {self.expected_call()}"
                if self.state is StepState.MICROBATCHES
                else f"lm_loss called outside the microbatches of a step: expected {self.expected_call()}"
            )
        if not isinstance(per_token_loss, Tensor):
            raise TypeError(f"per_token_loss must be a torch.Tensor, got {type(per_token_loss).__name__}")
        _check_mask_arg("mask", mask, per_token_loss)
        loss, w = _as_2d(per_token_loss), _as_2d(mask)
        seg = None if segment_ids is None else _as_2d(segment_ids)
        check_inputs(
            loss,
            w,
            seg if seg is None or seg.device == loss.device else None,
            where=self.where,
            check_finite=False,
            check_mask_values=False,
            check_segment_values=False,
        )
        return loss, w, seg

    def lm_loss(
        self, per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor | None = None, *, columns: Tensor | None = None
    ) -> Tensor:
        """This microbatch's share of the language-model objective; call once per microbatch, in order.

        ``precount``: returns ``numerator(mb) / denominator`` so that the shares of all microbatches and
        ranks sum to ``J`` (semantics §1, §3). ``deferred``: returns the raw ``numerator(mb)``; ``finish_step``
        divides the gradients. ``per_token_loss`` and ``mask`` are ``[b, S]``; with context parallelism they
        are this rank's shard and ``columns`` (``[S_shard]``) are its positions in the whole rows. The mask
        (and segment ids) must be those given to ``begin_step``, the loss finite where the mask is 1:
        both are checked on the device and reported by ``logs()``.
        """
        loss, w, seg = self._lm_inputs(per_token_loss, mask, segment_ids)
        self._check_columns(columns)
        mb, code = self._mb, float(self._mb * _MB_CODE)
        expected = self._expected(columns, self._masks[mb])
        assert expected is not None  # begin_step's masks are tensors
        self._flag_mask("lm_mask", w, expected, code)
        full_seg = self._expected(columns, self._segs[mb])
        if seg is not None and full_seg is not None:
            self._flag_mask("lm_segments", seg, full_seg, code)
        docs = self._mb_info[mb]["documents"] if columns is None else None
        num = numerator(
            self.mode,
            loss,
            w,
            segment_ids=seg if full_seg is None else full_seg,
            fixed_length=self.fixed_length,
            unit_counts=self._unit_counts(mb, 0, columns),
            documents=docs,
        )
        s, n = sample_stats(loss.detach(), w)
        self._flag_nonfinite("lm_nonfinite", s, code)
        acc, lay = self._acc, self._log_layout
        acc[lay.sl("S")] += s.sum().to(torch.float64)
        acc[lay.sl("Ntok")] += n.sum().to(torch.float64)
        if self.groups.cp_rank == 0:  # units are counted once, by the first shard of the rows
            acc[lay.sl("samples")] += w.shape[0]
            acc[lay.sl("documents")] += self._mb_info[mb]["docs"]
            acc[lay.sl("microbatches")] += 1
        acc[lay.sl("lm_num")] += num.detach().to(torch.float64)
        self._mb += 1
        self._mtp_done = False
        if self.normalization == "deferred":
            return num
        return num / self._denominator(_DEN_KEY[self.mode])

    def _mtp_denominators(self) -> list[float]:
        """Per-depth denominators (precount) of the MTP term (semantics §4, :func:`mtp_denominators`)."""
        return mtp_denominators(
            self.mode, self.mtp_convention, self._denominator(_DEN_KEY[self.mode]), self._host_counts["mtp_tokens"]
        )

    def _mtp_inputs(
        self, losses: Sequence[Tensor], masks: Sequence[Tensor], segment_ids: Tensor | None
    ) -> tuple[list[Tensor], list[Tensor], Tensor | None]:
        if self.state is not StepState.MICROBATCHES or self._mb == 0 or self._mtp_done:
            what = "twice for one microbatch" if self._mtp_done and self._mb else "before lm_loss"
            if self.state is not StepState.MICROBATCHES:
                what = "outside the microbatches of a step"
            raise ProtocolError(f"mtp_loss called {what} ({self.where}): expected {self.expected_call()}")
        if self.mtp_depths == 0:
            raise ValueError("mtp_loss called but the accountant was built with mtp_depths=0")
        if len(losses) != self.mtp_depths or len(masks) != self.mtp_depths:
            raise ValueError(
                f"mtp_loss needs {self.mtp_depths} losses and masks (one per depth), got {len(losses)} and "
                f"{len(masks)} ({self.where})"
            )
        where = f"rank {self.groups.token_rank()}, microbatch {self._mb - 1}"
        for k, (x, w) in enumerate(zip(losses, masks), start=1):
            if not isinstance(x, Tensor):
                raise TypeError(f"losses[{k - 1}] must be a torch.Tensor, got {type(x).__name__} ({where})")
            _check_mask_arg(f"masks[{k - 1}]", w, x)
        ls = [_as_2d(x) for x in losses]
        ws = [_as_2d(x) for x in masks]
        seg = None if segment_ids is None else _as_2d(segment_ids)
        for k, (x, w) in enumerate(zip(ls, ws), start=1):
            check_inputs(
                x,
                w,
                seg,
                where=f"{where}, MTP depth {k}",
                check_finite=False,
                check_mask_values=False,
                check_segment_values=False,
            )
        return ls, ws, seg

    def _mtp_numerators(
        self, mb: int, losses: list[Tensor], masks: list[Tensor], seg: Tensor | None, columns: Tensor | None
    ) -> list[Tensor]:
        if columns is not None and self.mtp_convention == "pooled" and self.mode != "per_token":
            raise ValueError(
                "mtp_convention='pooled' with a per-unit mode is not supported under context "
                "parallelism (its units pool several depths)"
            )
        if columns is not None and self.mtp_convention != "pooled":
            return [
                numerator(
                    self.mode,
                    x,
                    w,
                    segment_ids=seg,
                    fixed_length=self.fixed_length,
                    unit_counts=self._unit_counts(mb, k, columns),
                )
                for k, (x, w) in enumerate(zip(losses, masks), start=1)
            ]
        docs = self._mb_info[mb]["documents"] if columns is None else None
        return mtp_numerator(
            self.mode,
            losses,
            masks,
            convention=self.mtp_convention,
            segment_ids=seg,
            fixed_length=self.fixed_length,
            documents=docs,
        )

    def mtp_loss(
        self,
        losses: Sequence[Tensor],
        masks: Sequence[Tensor],
        segment_ids: Tensor | None = None,
        *,
        columns: Tensor | None = None,
    ) -> Tensor:
        """This microbatch's share of the MTP objective term ``λ·(1/Dm)·Σ_k J_k`` (or the pooled form).

        ``losses[k-1]``/``masks[k-1]`` are depth ``k``'s per-token losses and rolled masks (see
        :func:`lossparity.losses.mtp.roll_mtp`). Call once per microbatch, after ``lm_loss`` of the same
        microbatch. With context parallelism, ``losses``/``masks`` are this shard's columns (``columns``) of
        the depth masks rolled on whole rows (rolling crosses shard boundaries exactly).
        """
        losses, masks, seg = self._mtp_inputs(losses, masks, segment_ids)
        self._check_columns(columns)
        mb = self._mb - 1
        code = float(mb * _MB_CODE)
        for k, w in enumerate(masks, start=1):
            bad = (w != 0) & (w != 1)
            if columns is None:
                bad = bad | (w.sum() != self._mb_info[mb]["depth_tokens"][k - 1])
            self._device_checks.flag("mtp_mask", bad, code + k)
        nums = self._mtp_numerators(mb, losses, masks, seg, columns)
        self._mtp_done = True
        self._log_mtp(losses, masks, nums, code)
        scale = mtp_scale(self.mtp_weight, self.mtp_convention, self.mtp_depths)
        if self.normalization == "deferred":
            return scale * torch.stack(nums).sum()
        # nums holds one tensor per depth (mtp_depths >= 1 here), so the sum is a tensor
        return cast(Tensor, scale * sum(num / den for num, den in zip(nums, self._mtp_denominators())))

    def _log_mtp(self, losses: list[Tensor], masks: list[Tensor], nums: list[Tensor], code: float) -> None:
        acc, lay = self._acc, self._log_layout
        for k, (x, w) in enumerate(zip(losses, masks), start=1):
            s, n = sample_stats(x.detach(), w)
            self._flag_nonfinite("mtp_nonfinite", s, code + k)
            s_sum, n_sum = s.sum().to(torch.float64), n.sum().to(torch.float64)
            slot = acc[lay.sl(f"mtp_{k}")]
            slot[0] += s_sum
            slot[1] += n_sum
            slot[2] += s_sum / n_sum.clamp(min=1)
            if self.mtp_convention != "pooled":
                slot[3] += nums[k - 1].detach().to(torch.float64)
        if self.mtp_convention == "pooled":
            acc[lay.sl("mtp_pooled_num")] += nums[0].detach().to(torch.float64)

    # ------------------------------------------------------------------ fused head (weights known up front)
    def token_weights(
        self, mask: Tensor, segment_ids: Tensor | None = None, *, columns: Tensor | None = None
    ) -> Tensor:
        """Per-token weights ``w`` of the next microbatch's main loss (the one the next ``lm_loss`` or
        ``add_lm_share`` accounts): ``Σ w·l`` equals the value ``lm_loss(l, mask, ...)`` returns for any
        ``l`` (``precount``: the share ``numerator / denominator``; ``deferred``: the raw numerator).
        Float64, shape of ``mask``; see :mod:`lossparity.losses.token_weights`."""
        self._require_step("token_weights")
        self._check_columns(columns)
        den = 1.0 if self.normalization == "deferred" else self._denominator(_DEN_KEY[self.mode])
        return token_weights(
            self.mode,
            mask,
            segment_ids=segment_ids,
            fixed_length=self.fixed_length,
            unit_counts=_shaped_like(self._unit_counts(self._mb, 0, columns, whole=True), mask),
            denominator=den,
        )

    def mtp_token_weights(
        self, masks: Sequence[Tensor], segment_ids: Tensor | None = None, *, columns: Tensor | None = None
    ) -> list[Tensor]:
        """Per-depth weights of the next microbatch's MTP term (call before its ``add_lm_share``):
        ``Σ_k Σ w_k·l_k`` equals the value ``mtp_loss(losses, masks, ...)`` returns (λ, ``1/Dm`` and the
        convention's denominators included)."""
        self._require_step("mtp_token_weights")
        if self.mtp_depths == 0 or len(masks) != self.mtp_depths:
            raise ValueError(
                f"mtp_token_weights needs {self.mtp_depths} masks (one per MTP depth), got {len(masks)} ({self.where})"
            )
        self._check_columns(columns)
        pooled = self.mtp_convention == "pooled"
        dens = [1.0] * self.mtp_depths if self.normalization == "deferred" else self._mtp_denominators()
        counts = (
            None
            if pooled
            else [
                _shaped_like(self._unit_counts(self._mb, k, columns, whole=True), m)
                for k, m in zip(range(1, self.mtp_depths + 1), masks)
            ]
        )
        return mtp_token_weights(
            self.mode,
            masks,
            convention=self.mtp_convention,
            segment_ids=segment_ids,
            fixed_length=self.fixed_length,
            unit_counts=counts,
            denominators=dens,
            scale=self.mtp_weight / (1 if pooled else self.mtp_depths),
        )

    def add_lm_share(
        self,
        share: Tensor,
        per_token_loss: Tensor,
        mask: Tensor,
        segment_ids: Tensor | None = None,
        *,
        columns: Tensor | None = None,
    ) -> Tensor:
        """Account a main-loss share computed outside (``Σ token_weights·l``, e.g. by the fused head) and
        return it for backward: the detached per-token losses feed the logs exactly as ``lm_loss`` would."""
        self.lm_loss(per_token_loss.detach(), mask, segment_ids, columns=columns)
        return share

    def add_mtp_share(
        self,
        share: Tensor,
        losses: Sequence[Tensor],
        masks: Sequence[Tensor],
        segment_ids: Tensor | None = None,
        *,
        columns: Tensor | None = None,
    ) -> Tensor:
        """As :meth:`add_lm_share` for the MTP term (``Σ_k Σ mtp_token_weights_k·l_k``); after ``add_lm_share``."""
        self.mtp_loss([x.detach() for x in losses], masks, segment_ids, columns=columns)
        return share

    def record(self, name: str, num: Tensor | float, den: Tensor | float = 1.0) -> None:
        """Add ``num``/``den`` to the declared log metric ``name`` (reported as ``Σ num / Σ den``)."""
        self._require_step("record")
        if name not in self._metrics:
            raise KeyError(f"metric {name!r} was not declared; declared: {list(self._metrics)}")
        slot = self._acc[self._log_layout.sl(f"metric:{name}")]
        slot[0] += torch.as_tensor(num, dtype=torch.float64).detach().to(self.device)
        slot[1] += torch.as_tensor(den, dtype=torch.float64).detach().to(self.device)

    def record_sums(self, names: Sequence[str], nums: Tensor) -> None:
        """``record(names[i], nums[i])`` for declared ``"sum"`` metrics, in one kernel (``nums [n]``)."""
        self._require_step("record_sums")
        key = tuple(names)
        if key not in self._sum_index:
            for name in names:
                if self._metrics.get(name, ("", False))[0] != "sum":
                    raise KeyError(f"metric {name!r} was not declared with reduce='sum'")
            pos = [self._log_layout.sl(f"metric:{n}").start for n in names]
            self._sum_index[key] = torch.tensor(pos, dtype=torch.long, device=self.device)
        self._acc.index_add_(0, self._sum_index[key], nums.detach().to(self.device, torch.float64))

    def record_many(self, slots: Sequence[str], values: Tensor) -> None:
        """Add ``values[i]`` to log slot ``slots[i]`` in one kernel (``values [n]``, any float dtype).

        Slots: ``"num:<metric>"`` / ``"den:<metric>"`` (a declared metric's numerator / denominator, as
        :meth:`record` adds them), ``"objective"`` / ``"objective_local"`` (as :meth:`add_objective`)."""
        self._require_step("record_many")
        if len(slots) != values.numel():
            raise ValueError(f"record_many: {len(slots)} slots for {values.numel()} values")
        key = ("record_many", *slots)
        if key not in self._sum_index:
            pos = []
            for slot in slots:
                part, _, name = slot.partition(":")
                if slot in ("objective", "objective_local"):
                    pos.append(self._log_layout.sl(slot).start)
                elif part in ("num", "den") and name in self._metrics:
                    pos.append(self._log_layout.sl(f"metric:{name}").start + (part == "den"))
                else:
                    raise KeyError(f"record_many: unknown slot {slot!r}; declared metrics: {list(self._metrics)}")
            self._sum_index[key] = torch.tensor(pos, dtype=torch.long, device=self.device)
        self._acc.index_add_(0, self._sum_index[key], values.detach().reshape(-1).to(self.device, torch.float64))

    def add_objective(self, value: Tensor | float, *, per_rank: bool = False) -> None:
        """Add an already-normalized objective contribution (e.g. an auxiliary loss share) to the logged
        ``objective``; summed over ranks and microbatches (``per_rank``: see :meth:`declare_metric`)."""
        self._require_step("add_objective")
        name = "objective_local" if per_rank else "objective"
        self._acc[self._log_layout.sl(name)] += torch.as_tensor(value, dtype=torch.float64).detach().to(self.device)

    def _require_step(self, what: str) -> None:
        if self.state is StepState.IDLE:
            raise ProtocolError(f"{what} called outside a step: expected {self.expected_call()}")

    # ------------------------------------------------------------------ gradients
    def _resolve_reduction(self, model: object) -> str:
        """``grad_reduction``, with ``auto`` resolved from the engine of ``model``: ``mean`` for averaging
        engines (DDP, FSDP), ``allreduce`` for a plain module over several gradient ranks, else ``sum``."""
        reduction = self.grad_reduction
        if reduction == "auto":
            if model is not None and _is_averaging_engine(model):
                return "mean"
            return "allreduce" if model is not None and self.groups.grad_size > 1 else "sum"
        return reduction

    def finish_step(
        self, model: nn.Module | Iterable[Tensor] | None = None, *, expert_params: Iterable[Tensor] = ()
    ) -> float:
        """Scale (and, for plain modules, reduce) the gradients so that they are those of ``J``.

        Checks that every pre-counted microbatch was seen. ``deferred``: all-reduces the step's
        denominator over the data-parallel group and divides all gradients by it. Averaging engines
        (DDP, FSDP, over DP × CP) get a factor ``D·C``; ``grad_reduction="allreduce"`` (or ``auto`` with a
        plain module and ``D·C > 1``) sums the gradients over DP × CP. Returns the factor applied.

        ``expert_params``: expert shards under expert parallelism (``model/expert_parallel.py``). Their
        local gradients are already summed over the expert-parallel ranks (the all-to-all backward); they
        are summed over the expert-data-parallel group only, ``g_e ← Σ_{edp} g_e``, get the ``deferred``
        factor but never the engine's ``D·C`` (the engine must not see them), and are left out of
        ``model``'s reduction.
        """
        if self.state is not StepState.MICROBATCHES:
            what = "twice in one step" if self.state is StepState.FINISHED else "outside a step"
            raise ProtocolError(f"finish_step called {what}: expected {self.expected_call()}")
        if self._mb != self._n_mbs and self.groups.loss_stage:
            raise ProtocolError(
                f"begin_step received {self._n_mbs} masks but lm_loss was called for {self._mb} microbatches "
                f"(rank {self.groups.token_rank()}): expected {self.expected_call()}"
            )
        reduction = self._resolve_reduction(model)
        deferred = 1.0
        if self.normalization == "deferred":
            self._counts[self._counts_layout.sl("error")] = 0.0
            self._all_reduce(self._counts, self.groups.dp_group)
            self._read_counts(self._counts, self._counts_layout, None, reduced=True)
            deferred = 1.0 / self._denominator(_DEN_KEY[self.mode])
        factor = (float(self.groups.grad_size) if reduction == "mean" else 1.0) * deferred
        self.state = StepState.FINISHED
        self._grad_factor = factor
        experts = list(expert_params)
        group = self.groups.grad_group if reduction == "allreduce" else None
        if group is not None or factor != 1.0:  # else nothing to touch: skip the walk over the parameters
            skip = {id(p) for p in experts}
            grads = _unique_grads(model, fill_missing=reduction == "allreduce", skip=skip)
            _reduce_and_scale(grads, group, factor)
        if experts:
            _reduce_and_scale(_unique_grads(experts, fill_missing=True), self.groups.edp_group, deferred)
        return factor

    # ------------------------------------------------------------------ logs
    def _raise_checks(self, reduced: list[float]) -> None:
        """Raise the step's failed value checks on every rank: this rank's own, else its peers' count."""
        if not any(reduced):
            return
        mine = self._device_checks.first()
        for name, code in mine.items():
            error, message, sub = self._checks[name]
            mb, rest = divmod(int(code), _MB_CODE)
            loc = f"rank {self.groups.token_rank()}, microbatch {mb}" + (f", {sub} {rest}" if sub else "")
            expected = self._mb_info[mb]["tokens"] if mb < len(self._mb_info) else "?"
            raise error(f"{message.format(expected=expected)} ({loc})")
        names = [n for n, v in zip(self._checks, reduced) if v]
        raise RuntimeError(
            f"{int(max(reduced))} other rank(s) reported invalid values in this step "
            f"({', '.join(names)}; see their error); rank {self.groups.token_rank()} stops too"
        )

    def _check_logs_order(self) -> None:
        if self.state is not StepState.FINISHED or not all(self._step_ends.values()):
            if self.state is StepState.MICROBATCHES and self._mb != self._n_mbs and self.groups.loss_stage:
                raise ProtocolError(
                    f"logs() called after {self._mb} of {self._n_mbs} microbatches "
                    f"(rank {self.groups.token_rank()}): expected {self.expected_call()}"
                )
            raise ProtocolError(f"logs() called too early: expected {self.expected_call()}")

    def _check_world_fingerprint(self, reduced: list[float]) -> None:
        """Raise on every rank when ranks of the logging collective (context, tensor or pipeline peers, which
        the pre-count does not compare) were built with different settings."""
        g = self.groups.log_group
        n = 1 if g is None else dist.get_world_size(g)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._raise_fingerprint(
            reduced, n, f"{n} ranks of the logging collective", rank, "Accountant with the same arguments"
        )

    def _raise_fingerprint(self, reduced: Sequence[float], n: int, who: str, rank: int, fix: str) -> None:
        """ValueError naming the fields whose fingerprints differ over the ``n`` ranks (none: nothing)."""
        bad = fingerprint_mismatch(reduced, n) if n > 1 else []
        if bad:
            mine = ", ".join(f"{f}={self._fp_fields.get(f, '...')!r}" for f in bad)
            raise ValueError(
                f"the accounting configuration differs between the {who} in {', '.join(bad)} (rank {rank} "
                f"has {mine}): build every rank's {fix}"
            )

    def _reduce_logs(self) -> list[float]:
        lay = self._log_layout
        buf = self._acc
        buf[lay.sl("checks")] = self._device_checks.counts(self.device)
        if not self.groups.log_owner:
            # tensor-parallel replicas hold copies of the owner's numbers, except per-rank states
            keep = buf.clone()
            buf.zero_()
            for name in lay.local:
                buf[lay.sl(name)] = keep[lay.sl(name)]
        self._all_reduce(buf, self.groups.log_group)
        return buf.tolist()

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
        v = self._reduce_logs()
        self.state = StepState.IDLE
        lay = self._log_layout
        self._check_world_fingerprint(v[lay.sl("world_fingerprint")])
        self._raise_checks(v[lay.sl("checks")])
        get = {name: v[lay.sl(name)] for name in lay.names()}
        S, ntok, nsamp, ndoc, nmb, lm_num = (
            get[n][0] for n in ("S", "Ntok", "samples", "documents", "microbatches", "lm_num")
        )
        out: dict[str, float | None] = {
            "lm_loss": ratio_or_none(S, ntok),
            "tokens": ntok,
            "samples": nsamp,
            "microbatches": nmb,
        }
        if ndoc:
            out["documents"] = ndoc
        counts = {"tokens": ntok, "samples": nsamp, "microbatches": nmb, "documents": ndoc}
        main_den = max(counts[_DEN_KEY[self.mode]], 1.0)
        lm_term = objective = lm_num / main_den
        if self.mtp_depths:
            objective += self._mtp_logs(get, out, main_den, nmb)
        for name, (reduce, _) in self._metrics.items():
            num, den = get[f"metric:{name}"]
            out[name] = num if reduce == "sum" else ratio_or_none(num, den)
        added = get["objective"][0] + get["objective_local"][0]
        objective += added
        out["objective"] = objective
        if self.mtp_depths or added or self.mode != "per_token":
            # J's parts, so that a reader sees what the objective is made of (semantics §2)
            out["objective_lm"] = lm_term
            out["objective_aux"] = added
        return out

    def _mtp_logs(
        self, get: dict[str, list[float]], out: dict[str, float | None], main_den: float, nmb: float
    ) -> float:
        """Per-depth MTP logs into ``out``; returns ``λ·term`` of the objective (semantics §4)."""
        depth = [get[f"mtp_{k}"] for k in range(1, self.mtp_depths + 1)]
        for k, (s_k, n_k, means_k, _) in enumerate(depth, start=1):
            token_mean = self.mtp_log_estimator == "token_mean"
            out[f"mtp_{k}_loss"] = ratio_or_none(s_k, n_k) if token_mean else means_k / max(nmb, 1.0)
            out[f"mtp_{k}_tokens"] = n_k
        dens = mtp_denominators(self.mode, self.mtp_convention, main_den, [d[1] for d in depth])
        if self.mtp_convention == "pooled":
            term = get["mtp_pooled_num"][0] / dens[0]
        else:
            term = 0.0
            for d, den in zip(depth, dens):
                term += d[3] / den
            term /= self.mtp_depths
        out["mtp_weight"] = self.mtp_weight
        out["objective_mtp"] = term  # J's MTP part before λ
        return self.mtp_weight * term


assert set(_DEN_KEY) == set(MODES)
