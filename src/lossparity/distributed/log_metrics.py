"""The accountant's log channel (docs/semantics.md §2, §6): declared metrics and one buffer per step.

torchmetrics' ``add_state(name, default, dist_reduce_fx)`` is the model: a metric declares its state
and how it is reduced once, outside the steps (:class:`MetricRegistry`); every step lays out one
float64 buffer from the declarations (:class:`StepLogs`), ``record`` adds to it without a host
synchronization, and ``logs()`` reduces the whole buffer in one collective and computes the values.

Reductions (:data:`REDUCTIONS`): ``"ratio"`` keeps ``(Σ num, Σ den)`` and reports ``Σ num / Σ den``
(``None`` when ``Σ den = 0``; a record without ``den`` counts 1); ``"sum"`` keeps ``Σ num``. Both are
summed over every microbatch and rank (a metric's tensor-parallel replicas count once unless it is
declared ``per_rank``). Declaring a name again with another reduction is a
:class:`~lossparity.distributed.protocol.ProtocolError`: the two declarations would disagree about what the
number means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .protocol import BufferSlots, DeviceChecks, ProtocolError, fingerprint_slots

MB_CODE = 4096  # device-check location code: microbatch * MB_CODE + sub-location (MTP depth, MoE layer)

__all__ = ["MB_CODE", "REDUCTIONS", "Metric", "MetricRegistry", "StepLogs", "OBJECTIVE_METRICS"]

REDUCTIONS = ("ratio", "sum")
# Built-in "sum" metrics holding already-normalized objective contributions (auxiliary shares): the
# replicated one (TP replicas hold copies) and the per-rank one (distinct per TP rank, e.g. under SP).
OBJECTIVE_METRICS = ("objective", "objective_local")
# Built-in states of the language-model and MTP terms (see StepLogs.__init__)
_LM_STATES = ("S", "Ntok", "samples", "documents", "microbatches", "lm_num")


@dataclass(frozen=True)
class Metric:
    """A declared log metric: its reduction (``"ratio"`` or ``"sum"``) and whether every
    tensor-parallel rank holds distinct values (``per_rank``)."""

    reduce: str
    per_rank: bool = False


class MetricRegistry:
    """The metrics and value checks declared for the run (changed only outside a step)."""

    def __init__(self, checks: dict[str, tuple[type[Exception], str, str]]) -> None:
        self.metrics: dict[str, Metric] = {}
        self.checks = dict(checks)  # name -> (exception, message, sub-location name)

    def declare(self, name: str, reduce: str, per_rank: bool) -> None:
        """Declare ``name`` with its reduction; again with the same reduction keeps it (``per_rank`` widens)."""
        if reduce not in REDUCTIONS:
            raise ValueError(f"declare_metric: reduce must be 'ratio' or 'sum', got {reduce!r}")
        if name in OBJECTIVE_METRICS:
            raise ValueError(f"declare_metric: {name!r} is a built-in metric (record objective shares into it)")
        old = self.metrics.get(name)
        if old is not None and old.reduce != reduce:
            raise ProtocolError(
                f"declare_metric({name!r}, {reduce!r}): {name!r} is already declared with reduce={old.reduce!r}; "
                "one name has one reduction (declare another name)"
            )
        self.metrics[name] = Metric(reduce, per_rank or (old is not None and old.per_rank))

    def reduction(self, name: str) -> str:
        """The reduction of a declared (or built-in objective) metric; ``KeyError`` naming the declared ones."""
        if name in OBJECTIVE_METRICS:
            return "sum"
        if name not in self.metrics:
            raise KeyError(f"metric {name!r} was not declared; declared: {list(self.metrics)}")
        return self.metrics[name].reduce

    def fingerprint(self) -> tuple:
        """What must agree over the ranks (the buffer layout depends on it)."""
        return (tuple((n, (m.reduce, m.per_rank)) for n, m in self.metrics.items()), tuple(self.checks))


class StepLogs:
    """One step's log buffer: named states laid out from the registry, the device-side value checks.

    Built at ``begin_step`` and dropped at ``logs()``; every add is a device kernel, never a host read."""

    def __init__(self, registry: MetricRegistry, mtp_depths: int, device: torch.device, world_fp: list[float]) -> None:
        slots = BufferSlots()
        for name in _LM_STATES:
            slots.add(name)
        for k in range(1, mtp_depths + 1):
            slots.add(f"mtp_{k}", 4)  # S_k, Ntok_k, Σ local means, numerator
        slots.add("mtp_pooled_num")
        for name, metric in registry.metrics.items():
            slots.add(f"metric:{name}", 2, local=metric.per_rank)
        slots.add("objective")  # added contributions, replicated over TP
        slots.add("objective_local", local=True)  # added contributions distinct per TP rank
        slots.add("checks", len(registry.checks), local=True)
        # Every rank's (not only the data-parallel peers') layout-independent settings, compared at logs()
        slots.add("world_fingerprint", fingerprint_slots(), local=True)
        self.registry = registry
        self.slots = slots
        self.device = device
        self.values = slots.zeros(device)
        self.values[slots.sl("world_fingerprint")] = torch.tensor(world_fp, dtype=torch.float64, device=device)
        self.checks = DeviceChecks(list(registry.checks))
        self._index: dict[tuple, tuple[Tensor, Tensor | None]] = {}

    def add(self, name: str, value: Tensor | float, offset: int = 0) -> None:
        """``state[name][offset] += value`` (built-in states)."""
        sl = self.slots.sl(name)
        self.values[sl.start + offset] += torch.as_tensor(value, dtype=torch.float64).detach().to(self.device)

    def _positions(self, names: tuple[str, ...], with_den: bool) -> tuple[Tensor, Tensor | None]:
        """Buffer positions of the numerators (and, for ratio metrics, the denominators) of ``names``."""
        key = (names, with_den)
        if key not in self._index:
            reduces = [self.registry.reduction(n) for n in names]
            if with_den and "sum" in reduces:
                bad = names[reduces.index("sum")]
                raise ValueError(f"record: den given for {bad!r}, a metric declared with reduce='sum'")
            nums = [self._start(n) for n in names]
            dens = [self._start(n) + 1 for n, r in zip(names, reduces) if r == "ratio"]
            dev = self.device
            den_pos = torch.tensor(dens, dtype=torch.long, device=dev) if dens else None
            self._index[key] = (torch.tensor(nums, dtype=torch.long, device=dev), den_pos)
        return self._index[key]

    def _start(self, name: str) -> int:
        return self.slots.sl(name if name in OBJECTIVE_METRICS else f"metric:{name}").start

    def record(self, names: tuple[str, ...], num: Tensor, den: Tensor | None) -> None:
        """Add ``num[i]`` (and ``den[i]``, default 1 for ratio metrics) to metric ``names[i]`` in one kernel
        (two with denominators)."""
        num_pos, den_pos = self._positions(names, den is not None)
        self.values.index_add_(0, num_pos, num.detach().reshape(-1).to(self.device, torch.float64))
        if den is not None:
            assert den_pos is not None
            self.values.index_add_(0, den_pos, den.detach().reshape(-1).to(self.device, torch.float64))
        elif den_pos is not None and den_pos.numel():
            self.values.index_add_(0, den_pos, torch.ones(den_pos.numel(), dtype=torch.float64, device=self.device))

    def add_slots(self, slots: Sequence[str], values: Tensor) -> None:
        """``values[i]`` into ``"num:<metric>"``, ``"den:<metric>"`` or a built-in objective metric (one kernel)."""
        if len(slots) != values.numel():
            raise ValueError(f"record_many: {len(slots)} slots for {values.numel()} values")
        key = ("slots", *slots)
        if key not in self._index:
            pos = []
            for slot in slots:
                part, _, name = slot.partition(":")
                if slot in OBJECTIVE_METRICS:
                    pos.append(self._start(slot))
                elif part in ("num", "den") and name in self.registry.metrics:
                    pos.append(self._start(name) + (part == "den"))
                else:
                    raise KeyError(
                        f"record_many: unknown slot {slot!r}; declared metrics: {list(self.registry.metrics)}"
                    )
            self._index[key] = (torch.tensor(pos, dtype=torch.long, device=self.device), None)
        self.values.index_add_(0, self._index[key][0], values.detach().reshape(-1).to(self.device, torch.float64))

    def reduced(self, log_owner: bool, all_reduce: Callable[[Tensor], None]) -> list[float]:
        """The buffer summed over the logging collective (``all_reduce(buffer)`` in place), as host numbers:
        the step's one read. Tensor-parallel replicas contribute zeros except for their per-rank states."""
        slots, buf = self.slots, self.values
        buf[slots.sl("checks")] = self.checks.counts(self.device)
        if not log_owner:
            keep = buf.clone()
            buf.zero_()
            for name in slots.local:
                buf[slots.sl(name)] = keep[slots.sl(name)]
        all_reduce(buf)
        return buf.tolist()

    def raise_checks(self, reduced: list[float], rank: int, expected_tokens: Callable[[int], object]) -> None:
        """Raise the step's failed value checks (``reduced``: the per-check counts over the ranks) on every
        rank: this rank's own first failure naming rank, microbatch and sub-location, else its peers' count.
        ``expected_tokens(mb)``: the pre-counted tokens of microbatch ``mb`` (for the mask message)."""
        if not any(reduced):
            return
        for name, code in self.checks.first().items():
            error, message, sub = self.registry.checks[name]
            mb, rest = divmod(int(code), MB_CODE)
            loc = f"rank {rank}, microbatch {mb}" + (f", {sub} {rest}" if sub else "")
            raise error(f"{message.format(expected=expected_tokens(mb))} ({loc})")
        names = [n for n, v in zip(self.registry.checks, reduced) if v]
        raise RuntimeError(
            f"{int(max(reduced))} other rank(s) reported invalid values in this step "
            f"({', '.join(names)}; see their error); rank {rank} stops too"
        )

    def metric_values(self, v: list[float]) -> dict[str, float | None]:
        """Every declared metric's value from the reduced buffer ``v``."""
        out: dict[str, float | None] = {}
        for name, metric in self.registry.metrics.items():
            num, den = v[self.slots.sl(f"metric:{name}")]
            out[name] = num if metric.reduce == "sum" else (None if den == 0 else num / den)
        return out
