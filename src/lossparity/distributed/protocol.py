"""Building blocks of the accountant's step protocol (docs/semantics.md §2, §6, §7).

- :class:`ProtocolError` and :class:`StepState`: the one state machine of a step
  (``IDLE --begin_step--> MICROBATCHES --finish_step--> FINISHED --logs--> IDLE``).
- :class:`BufferSlots`: named slots of a float64 buffer reduced in one collective (the ``add_state`` idea of
  torchmetrics: a metric registers its state by name, the buffer is laid out from the registrations).
- :func:`fingerprint_slots` / :func:`fingerprint_mismatch`: a configuration fingerprint carried by a SUM
  all-reduce. Every field contributes ``h`` and ``h²`` for two small hashes ``h``; after the reduction over
  ``n`` ranks, ``n·Σh² = (Σh)²`` holds exactly (integers below 2⁵³) iff every rank has the same ``h``
  (Cauchy-Schwarz), so every rank reaches the same verdict and can name the differing field.
- :class:`DeviceChecks`: value checks (NaN/Inf, mask mismatches) recorded on the device without a host
  synchronization and read once per step, at the logging collective.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "ProtocolError",
    "StepState",
    "BufferSlots",
    "DeviceChecks",
    "fingerprint_slots",
    "fingerprint_mismatch",
    "raise_fingerprint",
    "FINGERPRINT_FIELDS",
]


class ProtocolError(RuntimeError):
    """A call out of the step protocol's order (a repeated call, or a call its state does not expect).

    The message names the call that was expected next."""


class StepState(enum.Enum):
    """Where an :class:`~lossparity.distributed.accountant.Accountant` stands in its step."""

    IDLE = "idle"  # expects begin_step
    MICROBATCHES = "microbatches"  # expects lm_loss (then mtp_loss) per microbatch, then finish_step
    FINISHED = "finished"  # expects the registered step ends (MoEAccounting.end_step), then logs()


class BufferSlots:
    """Named slots of one flat float64 buffer (reduced in one collective); not a parallel layout (that is
    :class:`~lossparity.distributed.parallel_dims.ParallelDims`).

    ``add(name, size)`` registers a state; ``zeros()`` builds the buffer; ``sl(name)`` is its slice.
    ``local`` states are kept on every rank of a tensor-parallel group (not only on the log owner)."""

    def __init__(self) -> None:
        self._slots: dict[str, tuple[int, int]] = {}
        self.local: set[str] = set()
        self.size = 0

    def add(self, name: str, size: int = 1, *, local: bool = False) -> None:
        """Register state ``name`` of ``size`` slots (names are unique)."""
        if name in self._slots:
            raise ValueError(f"state {name!r} is already registered")
        self._slots[name] = (self.size, size)
        self.size += size
        if local:
            self.local.add(name)

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def names(self) -> tuple[str, ...]:
        """Registered names in buffer order (part of the fingerprint)."""
        return tuple(self._slots)

    def sl(self, name: str) -> slice:
        """The slice of state ``name`` in the buffer."""
        start, size = self._slots[name]
        return slice(start, start + size)

    def zeros(self, device: torch.device) -> Tensor:
        """A zero buffer of this layout."""
        return torch.zeros(self.size, dtype=torch.float64, device=device)


# Fixed fingerprint fields (the buffer length may not depend on the configuration: ranks with different
# buffer lengths crash the collective instead of reporting). Unknown fields hash into "other".
FINGERPRINT_FIELDS = (
    "mode",
    "normalization",
    "grad_reduction",
    "fixed_length",
    "mtp_depths",
    "mtp_convention",
    "mtp_log_estimator",
    "mtp_weight",
    "counts",
    "log_metrics",
    "moe",
    "other",
)
_COMPONENTS = 2  # independent 14-bit hashes per field: a false match has probability 2^-28
_BITS = 14


def _hashes(value: object) -> list[int]:
    h = zlib.crc32(repr(value).encode())
    return [1 + ((h >> (_BITS * i)) & ((1 << _BITS) - 1)) for i in range(_COMPONENTS)]


def fingerprint_slots() -> int:
    """Number of buffer slots of a fingerprint."""
    return 2 * _COMPONENTS * len(FINGERPRINT_FIELDS)


def fingerprint_values(fields: Mapping[str, object]) -> list[float]:
    """``[h..., h²...]`` of every field of :data:`FINGERPRINT_FIELDS` (missing: ``None``; extra: ``other``)."""
    known = {k: fields.get(k) for k in FINGERPRINT_FIELDS}
    known["other"] = sorted((k, repr(v)) for k, v in fields.items() if k not in FINGERPRINT_FIELDS)
    hs = [float(x) for name in FINGERPRINT_FIELDS for x in _hashes(known[name])]
    return hs + [h * h for h in hs]


def raise_fingerprint(
    fields: Mapping[str, object], reduced: Sequence[float], n: int, who: str, rank: int, fix: str
) -> None:
    """``ValueError`` naming the fields whose hashes differ over the ``n`` ranks of the SUM-reduced
    fingerprint ``reduced`` (``fields``: this rank's values, ``who``: the ranks, ``fix``: what to build
    alike); nothing when they agree. Every rank reaches the same verdict."""
    bad = fingerprint_mismatch(reduced, n) if n > 1 else []
    if bad:
        mine = ", ".join(f"{f}={fields.get(f, '...')!r}" for f in bad)
        raise ValueError(
            f"the accounting configuration differs between the {who} in {', '.join(bad)} (rank {rank} "
            f"has {mine}): build every rank's {fix}"
        )


def fingerprint_mismatch(reduced: Sequence[float], n_ranks: int) -> list[str]:
    """Fields whose hashes differ over the ``n_ranks`` ranks of a SUM-reduced fingerprint (same on every rank)."""
    half = len(reduced) // 2
    sums, squares = reduced[:half], reduced[half:]
    bad = [i // _COMPONENTS for i in range(half) if n_ranks * squares[i] != sums[i] * sums[i]]
    return [FINGERPRINT_FIELDS[i] for i in sorted(set(bad))]


class DeviceChecks:
    """Value checks recorded on the device, reported at the step's logging collective.

    ``flag(name, bad, code)`` keeps a reference to the bool tensor ``bad`` (any shape) and its location
    ``code`` (a number, or a tensor of ``bad``'s shape): no kernel, no host sync in the hot path.
    ``counts()`` (at the logging collective, once per step) is the per-check 0/1 "this rank saw a bad
    value" vector; ``first()`` (a host sync, only on the error path) finds the first failing location."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._flags: dict[str, list[tuple[Tensor, Tensor | float, float]]] = {n: [] for n in self.names}

    def reset(self) -> None:
        """Start a step: no check has failed."""
        self._flags = {n: [] for n in self.names}

    def flag(self, name: str, bad: Tensor, code: Tensor | float, offset: float = 0.0) -> None:
        """Remember that ``bad`` marks a failed check ``name`` at ``code + offset``: a bool tensor (bad where
        true), or a floating tensor (bad where not finite, tested once per step in :meth:`counts`)."""
        self._flags[name].append((bad, code, offset))

    @staticmethod
    def _bad(items: Sequence[tuple[Tensor, Tensor | float, float]], device: torch.device) -> Tensor:
        """``[1]`` bool: any flagged element of ``items`` (bool: true; float: not finite)."""
        bools = [b.reshape(-1) for b, _, _ in items if b.dtype == torch.bool]
        floats = [b.reshape(-1) for b, _, _ in items if b.dtype != torch.bool]
        parts = []
        if bools:
            parts.append(torch.cat(bools).any().reshape(1).to(device))
        if floats:
            parts.append(torch.isfinite(torch.cat(floats)).logical_not_().any().reshape(1).to(device))
        return parts[0] if len(parts) == 1 else parts[0] | parts[1]

    def counts(self, device: torch.device) -> Tensor:
        """``[checks]`` float64 on ``device``: 1 where this rank recorded a bad value (a few kernels per step)."""
        rows = [
            self._bad(items, device) if items else torch.zeros(1, dtype=torch.bool, device=device)
            for items in self._flags.values()
        ]
        if not rows:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.cat(rows).to(torch.float64)

    def first(self) -> dict[str, float]:
        """Smallest failing location code per failed check (host sync: the error path only)."""
        out: dict[str, float] = {}
        for name, items in self._flags.items():
            for bad, code, offset in items:
                b = bad.detach().cpu().reshape(-1)
                if b.dtype != torch.bool:
                    b = ~torch.isfinite(b)
                c = torch.as_tensor(code, dtype=torch.float64).detach().cpu().reshape(-1).expand(b.shape[0])
                hits = c[b]
                if hits.numel():
                    out[name] = min(out.get(name, math.inf), float(hits.min()) + offset)
        return out
