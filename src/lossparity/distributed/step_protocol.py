"""The accountant's step protocol and log-channel entry points (docs/semantics.md §2, §6, §7).

:class:`StepProtocol` is the part of :class:`~lossparity.distributed.accountant.Accountant` that does not
compute losses: the per-step state object (:class:`StepRecord`, replaced whole at ``begin_step``), the
state machine ``IDLE --begin_step--> MICROBATCHES --finish_step--> FINISHED --logs--> IDLE`` and the
messages naming the expected call, the registrations made outside a step (metrics, value checks,
companions' step ends), and ``record``/``flag``, the entry points of the step's log buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .log_metrics import MB_CODE, MetricRegistry, StepLogs
from .precount import PreCount
from .protocol import ProtocolError, StepState

__all__ = ["StepProtocol", "StepRecord"]

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


@dataclass
class StepRecord:
    """Everything one step changes, replaced whole at ``begin_step``: nothing of a step leaks into the next
    except what the caller asked to keep (``index`` counts steps, ``mtp_weight`` stays until given again)."""

    index: int = 0
    state: StepState = StepState.IDLE
    mtp_weight: float = 1.0
    pre: PreCount | None = None
    logs: StepLogs | None = None
    mb: int = 0  # microbatches lm_loss has accounted
    mtp_seen: list[bool] = field(default_factory=list)  # per accounted microbatch: mtp_loss was called
    ends_done: set[str] = field(default_factory=set)
    grad_factor: float | None = None

    @property
    def n_mbs(self) -> int:
        return 0 if self.pre is None else len(self.pre.masks)

    def counts(self) -> PreCount:
        assert self.pre is not None, "inside a step"
        return self.pre

    def buffer(self) -> StepLogs:
        assert self.logs is not None, "inside a step"
        return self.logs


class StepProtocol:
    """Protocol state, registrations and the log-channel entry points of an accountant (see the module
    docstring). ``groups`` gives the rank in messages and whether this pipeline stage computes the loss."""

    def __init__(self, groups: Any, mtp_depths: int) -> None:
        self.groups = groups
        self.mtp_depths = mtp_depths
        checks = {k: (e, m, "MTP depth" if k.startswith("mtp") else "") for k, (e, m) in _CHECKS.items()}
        self._registry = MetricRegistry(checks)
        self._step_ends: list[str] = []  # registered companions that must run between finish_step and logs
        self._fingerprint_extra: dict[str, object] = {}
        self._step = StepRecord()

    def _require_idle(self, what: str) -> None:
        if self.state is not StepState.IDLE:
            raise ProtocolError(f"{what} must be called outside a step: expected {self.expected_call()}")

    def declare_metric(self, name: str, reduce: str = "ratio", *, per_rank: bool = False) -> None:
        """Declare an auxiliary log metric and its reduction (torchmetrics' ``add_state``): ``"ratio"``
        reports ``Σ num / Σ den`` (``None`` when ``Σ den = 0``), ``"sum"`` reports ``Σ num``, sums over all
        ranks and microbatches. ``per_rank=True``: every tensor-parallel rank records distinct tokens
        (sequence parallelism), so its values are summed over TP too; by default TP ranks hold copies and
        only the first counts.

        Must be called identically on every rank, outside a step (it fixes the layout of the logging
        collective, part of the fingerprint checked at ``begin_step``); a rank that has nothing to record
        still takes part with zeros (semantics §6). Declaring a declared name again with the same reduction
        keeps it; with another reduction it raises :class:`ProtocolError`.
        """
        self._require_idle(f"declare_metric({name!r})")
        self._registry.declare(name, reduce, per_rank)

    def register_check(self, name: str, error: type[Exception], message: str, sub: str = "") -> None:
        """Register a device-side value check reported by ``logs()`` (see :meth:`flag`): ``message`` is the
        error text, ``sub`` names the sub-location of the code (e.g. ``"layer"``). Outside a step."""
        if self._registry.checks.get(name) == (error, message, sub):
            return  # registered already (e.g. by another pipeline chunk's MoEAccounting)
        self._require_idle(f"register_check({name!r})")
        self._registry.checks[name] = (error, message, sub)

    def register_step_end(self, name: str, fingerprint: object = None) -> None:
        """Register a companion call ``name`` (e.g. ``"MoEAccounting.end_step(routers)"``) that must run
        every step between ``finish_step`` and ``logs()``; it reports with :meth:`step_end_done`.
        ``fingerprint``: its configuration, compared over the ranks at ``begin_step``."""
        self._require_idle(f"register_step_end({name!r})")
        if name in self._step_ends:
            raise ValueError(f"step end {name!r} is already registered")
        self._step_ends.append(name)
        self._fingerprint_extra[f"step_end:{name}"] = fingerprint

    @property
    def registered_step_ends(self) -> tuple[str, ...]:
        """Names given to :meth:`register_step_end`, in order."""
        return tuple(self._step_ends)

    def step_end_done(self, name: str) -> None:
        """Report that the registered step end ``name`` ran for this step (after ``finish_step``)."""
        if self.state is not StepState.FINISHED:
            raise ProtocolError(f"{name} called before finish_step: expected {self.expected_call()}")
        if name in self._step.ends_done:
            raise ProtocolError(f"{name} called twice in one step: expected {self.expected_call()}")
        self._step.ends_done.add(name)

    @property
    def state(self) -> StepState:
        """Where the step protocol stands."""
        return self._step.state

    @property
    def step_index(self) -> int:
        """Number of ``begin_step`` calls: lets companions cache per-step reads."""
        return self._step.index

    @property
    def mtp_weight(self) -> float:
        """The MTP ``λ`` of the current (or last) step: the last one given to ``begin_step``, else 1."""
        return self._step.mtp_weight

    @property
    def finished(self) -> bool:
        """True between ``finish_step`` and ``logs`` (gradients of the step are final)."""
        return self.state is StepState.FINISHED

    @property
    def where(self) -> str:
        """``rank r, microbatch m`` of the current call (for messages)."""
        return f"rank {self.groups.token_rank()}, microbatch {self._step.mb}"

    def _missing_mtp(self) -> int | None:
        """The first accounted microbatch whose ``mtp_loss`` was not called (``None``: none missing)."""
        missing = [i for i, seen in enumerate(self._step.mtp_seen) if not seen]
        return missing[0] if self.mtp_depths and missing else None

    def expected_call(self) -> str:
        """The call the protocol expects next (as the ProtocolError messages name it), e.g. ``"logs()"``."""
        step = self._step
        if step.state is StepState.IDLE:
            return "begin_step(masks)"
        if step.state is StepState.MICROBATCHES:
            missing = self._missing_mtp()
            if missing is not None:
                return f"mtp_loss(...) for microbatch {missing}"
            if step.mb < step.n_mbs and self.groups.loss_stage:
                return f"lm_loss(...) for microbatch {step.mb} of {step.n_mbs}"
            return "finish_step(model)"
        pending = [n for n in self._step_ends if n not in step.ends_done]
        return pending[0] if pending else "logs()"

    def _require_step(self, what: str) -> None:
        if self.state is StepState.IDLE:
            raise ProtocolError(f"{what} called outside a step: expected {self.expected_call()}")

    def flag(self, check: str, bad: Tensor, sub: Tensor | int = 0, *, microbatch: int | None = None) -> None:
        """Record a failed value check on the device (no host sync); ``logs()`` raises it on every rank,
        naming this rank, the microbatch (default: the last one ``lm_loss`` saw) and ``sub`` (e.g. the
        layer: a tensor of the shape of ``bad`` gives one sub-location per element). ``bad`` is a bool
        tensor (bad where true) or a floating tensor (bad where not finite, tested once per step)."""
        self._require_step(f"flag({check!r})")
        mb = max(self._step.mb - 1, 0) if microbatch is None else microbatch
        self._step.buffer().checks.flag(check, bad, sub, float(mb * MB_CODE))

    def record(self, name: str | Sequence[str], num: Tensor | float, den: Tensor | float | None = None) -> None:
        """Add to declared log metrics (semantics §2): ``record(name, num[, den])`` for one metric, or
        ``record(names, nums[, dens])`` with ``[n]`` tensors for ``n`` metrics in one kernel. A ``"ratio"``
        metric adds ``num`` to ``Σ num`` and ``den`` (default 1) to ``Σ den``; a ``"sum"`` metric adds ``num``
        (a ``den`` is an error). The built-in ``"objective"`` (and ``"objective_local"``, distinct per
        tensor-parallel rank) adds an already-normalized objective contribution, e.g. an auxiliary loss
        share, to the logged ``objective``. Detached; no host synchronization."""
        self._require_step("record")
        names = (name,) if isinstance(name, str) else tuple(name)
        values = torch.as_tensor(num, dtype=torch.float64).reshape(-1)
        dens = None if den is None else torch.as_tensor(den, dtype=torch.float64).reshape(-1)
        if values.numel() != len(names) or (dens is not None and dens.numel() != len(names)):
            raise ValueError(
                f"record: {len(names)} metric(s) for {values.numel()} value(s)"
                + ("" if dens is None else f" and {dens.numel()} denominator(s)")
            )
        self._step.buffer().record(names, values, dens)

    def record_sums(self, names: Sequence[str], nums: Tensor) -> None:
        """Deprecated alias of ``record(names, nums)`` (kept for callers written before ``record`` took lists)."""
        self.record(names, nums)

    def record_many(self, slots: Sequence[str], values: Tensor) -> None:
        """Deprecated: ``values[i]`` into log slot ``slots[i]`` (``"num:<metric>"``, ``"den:<metric>"``,
        ``"objective"``, ``"objective_local"``) in one kernel; new code calls :meth:`record`."""
        self._require_step("record_many")
        self._step.buffer().add_slots(slots, values)

    def add_objective(self, value: Tensor | float, *, per_rank: bool = False) -> None:
        """Deprecated alias of ``record("objective_local" if per_rank else "objective", value)``."""
        self.record("objective_local" if per_rank else "objective", value)

    def _check_microbatches_done(self, call: str) -> None:
        """Every pre-counted microbatch went through ``lm_loss`` (and ``mtp_loss`` when ``mtp_depths > 0``)."""
        step = self._step
        if step.mb != step.n_mbs and self.groups.loss_stage:
            raise ProtocolError(
                f"{call}: begin_step received {step.n_mbs} masks but lm_loss was called for {step.mb} "
                f"microbatches (rank {self.groups.token_rank()}): expected {self.expected_call()}"
            )
        missing = self._missing_mtp()
        if missing is not None:
            raise ProtocolError(
                f"{call}: mtp_loss was not called for microbatch {missing} (rank {self.groups.token_rank()}) "
                f"although the accountant has mtp_depths={self.mtp_depths}: expected {self.expected_call()}"
            )

    def _check_logs_order(self) -> None:
        if self.state is not StepState.FINISHED or set(self._step_ends) - self._step.ends_done:
            if self.state is StepState.MICROBATCHES:
                self._check_microbatches_done("logs()")
            raise ProtocolError(f"logs() called too early: expected {self.expected_call()}")
