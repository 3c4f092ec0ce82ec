"""``lossparity train --reference LOG``: compare every step with a reference log and stop at the first violation.

Each rank holds a :class:`~lossparity.parity.guard.ParityGuard` built from the same reference (read once,
before the first step). The values it compares are the step's log line, which comes out of the Accountant's
logging collective (``acc.logs()``) and the gradient-norm all-reduce: bit-identical on every rank, so every
rank reaches the same verdict at the same step and no other collective is needed; rank 0 writes the report
(``OUT/parity_report.md`` and ``.json``). On a stop (``on_violation="stop"``) the trainer makes the step's
metrics durable, writes the checkpoint of that step (the ordinary checkpoint path, when ``OUT`` is set) and
raises :class:`ParityStop`; ``lossparity train`` prints its message and exits with code 3. ``--resume``
continues from that checkpoint (without ``--reference``, or with ``--on-violation warn``, to train past the
divergence). With ``warn`` the violation is reported once and training goes on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PARITY_STOP_EXIT", "ParityStop", "make_guard", "parity_check"]

PARITY_STOP_EXIT = 3  # exit code of `lossparity train` stopped by --reference (1 = a failure, 2 = bad input)

_NOT_COMPARED = ("step", "tokens_per_s", "step_time_s")  # timings: not part of the run's numbers


class ParityStop(Exception):
    """Training stopped at the first parity violation: ``step``, ``metric``, the one-line ``message`` and the
    ``checkpoint`` folder written before stopping (``None`` without ``--out``)."""

    def __init__(self, step: int, metric: str, message: str, checkpoint: str | None) -> None:
        self.step, self.metric, self.message, self.checkpoint = step, metric, message, checkpoint
        where = f"; checkpoint of step {step} in {checkpoint}" if checkpoint else ""
        super().__init__(f"parity violation, training stopped after step {step}: {message}{where}")


def make_guard(cfg: Any, rank: int = 0) -> Any:
    """The guard of a ``TrainConfig`` with ``reference`` set (``None`` without it): its tolerance overrides
    ``cfg.tol`` and ``cfg.on_violation``; the report goes to ``cfg.out`` (written by rank 0 only).
    Raises ``ValueError`` naming ``reference``/``tol`` for an unreadable reference or bad tolerances."""
    if not getattr(cfg, "reference", None):
        return None
    from ..parity.guard import ParityGuard

    try:
        return ParityGuard(
            cfg.reference,
            tol=cfg.tol or None,
            on_violation=cfg.on_violation,
            report_dir=cfg.out,
            write_report=rank == 0,
            source=os.path.join(cfg.out, "metrics.jsonl") if cfg.out else "lossparity train",
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"reference: {e}") from None
    except ValueError as e:
        raise ValueError(f"reference {cfg.reference}: {e}") from None


def parity_check(guard: Any, line: dict[str, Any], rank: int, save: Callable[[], str | None]) -> None:
    """Compare one step's log ``line``; on a stop call ``save()`` (the step's checkpoint; returns its folder)
    and raise :class:`ParityStop`. With ``warn`` rank 0 prints it once on stderr."""
    verdict = guard.update(int(line["step"]), {k: v for k, v in line.items() if k not in _NOT_COMPARED})
    if verdict.new and rank == 0 and not verdict.stop:  # a stop is reported once, by `lossparity train`'s exit
        print(f"lossparity train: note: parity: {verdict.line()}; continuing (--on-violation warn)", file=sys.stderr)
    if verdict.stop:
        v = verdict.violation
        checkpoint = save()
        raise ParityStop(v.step, v.metric, v.detail(), checkpoint)
