"""Log-channel estimators (semantics §2): pure functions on already-reduced sums.

The log channel keeps its own estimators whatever the objective's mode: ``lm_loss`` is always the
global token mean ``S / Ntok`` (missing, never NaN, when ``Ntok = 0``); over an interval of several
steps a metric is the plain mean of its per-step values over the steps that were not skipped
(Megatron ``training_log``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["ratio_or_none", "IntervalMean"]


def ratio_or_none(num: float, den: float) -> float | None:
    """``num / den``, or ``None`` (reported as missing) when ``den == 0`` — e.g. ``lm_loss = S / Ntok``."""
    return None if den == 0 else num / den


class IntervalMean:
    """Plain mean of per-step metrics over a logging interval, skipping missing values and skipped
    steps: ``m = (1/|steps with m|) Σ_step m_step``.

    ``update(logs, skipped=False)`` adds one step; ``compute()`` returns the means and ``reset()``
    starts a new interval. A metric that is ``None`` at a step does not count for that step.
    """

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._n: dict[str, int] = {}
        self.skipped = 0

    def update(self, logs: Mapping[str, float | None], *, skipped: bool = False) -> None:
        """Add one step's values (ignored entirely when ``skipped``)."""
        if skipped:
            self.skipped += 1
            return
        for key, value in logs.items():
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isnan(value):
                continue
            self._sum[key] = self._sum.get(key, 0.0) + float(value)
            self._n[key] = self._n.get(key, 0) + 1

    def compute(self) -> dict[str, float]:
        """Means over the interval's non-skipped steps."""
        return {k: self._sum[k] / self._n[k] for k in self._sum}

    def reset(self) -> None:
        """Start a new interval."""
        self._sum.clear()
        self._n.clear()
        self.skipped = 0
