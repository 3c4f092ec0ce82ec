"""The results of ``lossparity compare``: :class:`MetricResult` (one metric, point by point) and
:class:`CompareResult` (the verdict of all metrics), with the step-range descriptions their summaries use.
The comparison itself, and its semantics, are in :mod:`lossparity.parity.compare`; these are plain data
with derived properties, no printing (the report is :mod:`lossparity.parity.report`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .readers import Run
from .tolerance import Tolerance

__all__ = ["MetricResult", "CompareResult", "step_ranges", "describe_points"]


def _num(v: float) -> float | str:
    """JSON-safe float: non-finite values become the strings ``nan``, ``inf``, ``-inf``."""
    v = float(v)
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def _progressions(vals: list[float]) -> list[tuple[float, float, float, int]]:
    """Sorted points cut greedily into arithmetic runs ``(first, last, spacing, count)``: a run of 3 or more
    equally spaced points (or of 2 consecutive integers) is one entry, any other point its own entry."""
    out: list[tuple[float, float, float, int]] = []
    i = 0
    while i < len(vals):
        j = i
        if i + 1 < len(vals):
            d = vals[i + 1] - vals[i]
            while j + 1 < len(vals) and vals[j + 1] - vals[j] == d:
                j += 1
            if j - i < 2 and d != 1:  # two points that are not consecutive integers: no pattern
                j = i
        out.append((vals[i], vals[j], vals[j] - vals[j - 1] if j > i else 0.0, j - i + 1))
        i = j + 1
    return out


def step_ranges(xs: Sequence[float], limit: int | None = None) -> str:
    """Compact text of points: ``"3, 7-10, 14"`` (consecutive integers joined), ``"15-2790 every 15"``
    (3 or more equally spaced points), ``"-"`` when empty. With ``limit``, at most that many parts are
    written: the first ones, ``...``, and the last one."""
    parts = []
    for lo, hi, d, n in _progressions(sorted(xs)):
        if n == 1:
            parts.append(f"{lo:g}")
        elif d == 1:
            parts.append(f"{lo:g}-{hi:g}")
        else:
            parts.append(f"{lo:g}-{hi:g} every {d:g}")
    if limit is not None and len(parts) > limit:
        parts = [*parts[: max(limit - 1, 1)], f"... ({len(parts) - limit} more)", parts[-1]]
    return ", ".join(parts) if parts else "-"


def describe_points(xs: Sequence[float], unit: str = "step", limit: int = 4) -> str:
    """``"187 steps (15-2790 every 15)"``: the count, and the points as :func:`step_ranges` with ``limit``."""
    return f"{len(xs)} {unit}{'' if len(xs) == 1 else 's'} ({step_ranges(xs, limit)})"


@dataclass
class MetricResult:
    """Point-by-point comparison of one metric (arrays are aligned and sorted by ``x``).

    ``steps``: reference step numbers; ``x``: the alignment coordinate (``steps``, or consumed samples);
    ``ref``/``cand``: the compared (smoothed) values; ``ok``: pass flags; ``rel_diff``: ``|c-r|/|r|``.
    ``cand_metric``: the candidate's name of the metric (differs from ``metric`` when paired).
    ``missing_cand``/``missing_ref``: ``x`` of the points inside the window that only the reference /
    only the candidate has; ``missing_violation``: why the missing-steps rule fails, or ``None``.
    """

    metric: str
    tolerance: Tolerance
    steps: np.ndarray
    x: np.ndarray
    ref: np.ndarray
    cand: np.ndarray
    ok: np.ndarray
    rel_diff: np.ndarray
    allowed_failures: int = 0
    cand_metric: str = ""
    missing_cand: list[float] = field(default_factory=list)
    missing_ref: list[float] = field(default_factory=list)
    missing_violation: str | None = None

    def __post_init__(self) -> None:
        self.cand_metric = self.cand_metric or self.metric

    @property
    def only_ref(self) -> int:
        """Number of reference points inside the window that the candidate lacks."""
        return len(self.missing_cand)

    @property
    def only_cand(self) -> int:
        """Number of candidate points inside the window that the reference lacks."""
        return len(self.missing_ref)

    @property
    def n_compared(self) -> int:
        return int(self.ok.size)

    @property
    def n_failed(self) -> int:
        return int((~self.ok).sum())

    @property
    def passed(self) -> bool:
        """At most ``allowed_failures`` failing points and no missing-steps violation."""
        return self.n_failed <= self.allowed_failures and self.missing_violation is None

    @property
    def first_fail_step(self) -> int | None:
        """Reference step of the first failing point, ``None`` when none fails."""
        bad = np.flatnonzero(~self.ok)
        return int(self.steps[bad[0]]) if bad.size else None

    @property
    def worst_index(self) -> int:
        """Index of the largest relative difference among failing points (among all if none fails)."""
        bad = np.flatnonzero(~self.ok)
        idx = bad if bad.size else np.arange(self.ok.size)
        return int(idx[np.argmax(self.rel_diff[idx])])

    @property
    def worst_step(self) -> int:
        return int(self.steps[self.worst_index])

    @property
    def max_rel_diff(self) -> float:
        return float(self.rel_diff.max())

    def to_dict(self, max_failures: int = 100) -> dict[str, object]:
        """JSON-ready summary; lists at most ``max_failures`` failing points."""
        w = self.worst_index
        bad = np.flatnonzero(~self.ok)
        failures = [
            {
                "step": int(self.steps[i]),
                "x": _num(self.x[i]),
                "ref": _num(self.ref[i]),
                "cand": _num(self.cand[i]),
                "rel_diff": _num(self.rel_diff[i]),
            }
            for i in bad[:max_failures]
        ]
        return {
            "metric": self.metric,
            "cand_metric": self.cand_metric,
            "passed": self.passed,
            "tolerance": {"rel": self.tolerance.rel, "abs": self.tolerance.abs},
            "n_compared": self.n_compared,
            "n_failed": self.n_failed,
            "allowed_failures": self.allowed_failures,
            "first_fail_step": self.first_fail_step,
            "worst_step": self.worst_step,
            "worst_x": _num(self.x[w]),
            "worst_ref": _num(self.ref[w]),
            "worst_cand": _num(self.cand[w]),
            "max_rel_diff": _num(self.max_rel_diff),
            "first_step": int(self.steps[0]),
            "last_step": int(self.steps[-1]),
            "only_ref": self.only_ref,
            "only_cand": self.only_cand,
            "missing_in_cand": step_ranges(self.missing_cand),
            "missing_in_ref": step_ranges(self.missing_ref),
            "missing_violation": self.missing_violation,
            "failures": failures,
            "failures_truncated": bool(bad.size > max_failures),
        }


@dataclass
class CompareResult:
    """All metrics of one comparison; ``passed`` when every compared metric passes.

    ``notes``: decisions taken on the user's behalf (a cross-framework pairing), one sentence each.
    ``no_loss``: with the default metrics, why no loss was compared (what each run has); the comparison
    then fails whatever the other metrics say.
    """

    ref: Run
    cand: Run
    align: str
    window: tuple[float | None, float | None] | None
    smooth: int
    megatron_rule: bool
    metrics: dict[str, MetricResult] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    not_compared: list[str] = field(default_factory=list)
    missing_steps: str = "span"
    notes: list[str] = field(default_factory=list)
    no_loss: str | None = None

    @property
    def passed(self) -> bool:
        return self.no_loss is None and all(m.passed for m in self.metrics.values())

    @property
    def violations(self) -> list[MetricResult]:
        return [m for m in self.metrics.values() if not m.passed]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready result (non-finite numbers as strings)."""

        def run_info(run: Run) -> dict[str, object]:
            return {
                "source": run.source,
                "format": run.format,
                "step_base": run.step_base,
                "restarts": run.restarts,
                "dropped_values": run.dropped_values,
                "skipped_lines": run.skipped_lines,
                "skipped_steps": sorted(run.skipped_steps),
                "live": run.live,
                "notes": list(run.notes),
            }

        return {
            "passed": self.passed,
            "ref": run_info(self.ref),
            "cand": run_info(self.cand),
            "align": self.align,
            "window": list(self.window) if self.window else None,
            "smooth": self.smooth,
            "megatron_rule": self.megatron_rule,
            "missing_steps": self.missing_steps,
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()},
            "skipped": dict(self.skipped),
            "not_compared": list(self.not_compared),
            "notes": list(self.notes),
            "no_loss": self.no_loss,
        }


# ---------------------------------------------------------------------------------------------------
# comparison
