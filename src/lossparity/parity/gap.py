"""``lossparity gap``: every mode's value and the estimator gap, step by step, from a per-sample dump.

For each step of a dump (:mod:`lossparity.parity.sample_dump`) with per-sample counts ``n_i`` and
loss sums ``s_i``, ``l_i = s_i / max(n_i, 1)``, ``N`` samples, ``Ntok = Σ n_i``, ``S = Σ s_i``::

    per_token       = S / max(Ntok, 1)
    per_sample      = (1/N) Σ_i l_i
    per_microbatch  = mean over consecutive blocks of b rows of Σ_blk s / max(Σ_blk n, 1)
    sample_sum      = S / N
    sample_sum_norm = S / (N · L)
    gap             = per_token − per_sample = Cov(n, l) / mean(n)     (population covariance)

The formulas are those of the mode table (:mod:`lossparity.losses.mode_table`), applied to NumPy arrays.
``per_document`` is not a function of per-sample data (a row's ``(n, s)`` does not say how they split
over its documents) and is reported as not computable.

Uncertainty: a percentile bootstrap that resamples the samples of each step with replacement (a
seeded ``numpy.random.Generator``) gives a confidence interval of each step's gap; the interval of the
mean gap over several steps resamples every step independently (stratified bootstrap) and averages.

Drift check (``--compare-drift A B``): with two training logs, A trained with ``per_token`` and B with
``per_sample`` (or any pair whose objectives differ by the estimator), the observed ``A − B`` of the
logged objective is compared per step with the gap of the dump (which should come from one of the two
runs): the drift is "explained" when the mean observed difference over the common steps lies in the
confidence interval of the mean gap over those steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..losses.mode_table import mode_spec, reduce_units
from ._gap_batch import block_values, bootstrap_block, quantile_rows, step_blocks, value_at
from ._gap_plot import plot_gap
from .sample_dump import StepSamples

__all__ = [
    "NOT_COMPUTABLE",
    "DriftResult",
    "GapReport",
    "StepGap",
    "bootstrap_gaps",
    "compare_drift",
    "compute_gap",
    "covariance_gap",
    "format_table",
    "MAX_BOOTSTRAP_VALUES",
    "format_ranges",
    "missing_count",
    "missing_steps",
    "plot_gap",
    "step_mode_values",
    "summarize",
]

NOT_COMPUTABLE = {
    "per_document": "not computable from per-sample data: a row's (n, s) does not say how they split over its "
    "documents (dump per-document sums and counts instead)",
}
_MODE_COLUMNS = ("per_token", "per_sample", "per_microbatch", "sample_sum", "sample_sum_norm")
_VALUE_COLUMNS = (*_MODE_COLUMNS, "gap", "cov_term")
_BOOTSTRAP_CHUNK = 2_000_000  # resampled indices held at once (B_chunk · N)
MAX_BOOTSTRAP_VALUES = 1 << 25
"""Most bootstrap replicates held (steps x replicates: 33,554,432 float64 values, 256 MiB); more is refused."""


# --------------------------------------------------------------------------------------------------
# per-step values


def step_mode_values(
    n: np.ndarray, s: np.ndarray, *, microbatch_size: int | None = None, fixed_length: int | None = None
) -> dict[str, float | None]:
    """Every mode of semantics §1 that is a function of per-sample data, for one step's ``[N]`` counts ``n``
    and sums ``s`` ordered by row (see the module docstring for the formulas). ``per_microbatch`` cuts the
    rows into consecutive blocks of ``microbatch_size`` (``None`` when it is not given or does not divide
    ``N``); ``sample_sum_norm`` needs ``fixed_length`` (``None`` otherwise)."""
    n = np.asarray(n, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    if n.size == 0:
        raise ValueError("a step needs at least one sample")
    return {mode: _mode_value(mode, n, s, microbatch_size, fixed_length) for mode in _MODE_COLUMNS}


def _mode_value(
    mode: str, n: np.ndarray, s: np.ndarray, microbatch_size: int | None, fixed_length: int | None
) -> float | None:
    """One mode of the table from per-sample ``(n, s)``: the units' sums and counts (samples, or blocks of
    ``microbatch_size`` rows), the table's reduction, divided by ``max(count, 1)``; ``None`` when the
    step does not determine it (no dividing ``microbatch_size``, no ``fixed_length``)."""
    spec = mode_spec(mode)
    N = n.size
    if spec.reduction == "sum_over_length" and (fixed_length is None or fixed_length <= 0):
        return None
    if spec.unit == "microbatch":
        if microbatch_size is None or microbatch_size <= 0 or N % microbatch_size:
            return None
        s, n = s.reshape(-1, microbatch_size).sum(axis=1), n.reshape(-1, microbatch_size).sum(axis=1)
    count = {"tokens": float(n.sum()), "samples": N, "microbatches": n.size}[spec.count]
    return float(reduce_units(mode, s, n, fixed_length=fixed_length)) / max(count, 1)


def covariance_gap(n: np.ndarray, s: np.ndarray) -> tuple[float, float, float]:
    """The covariance side of the gap identity (semantics §1) for one step, in float64 NumPy:
    ``(Cov(n, l), mean(n), Cov(n, l) / mean(n))`` with ``l_i = s_i / max(n_i, 1)`` and the population
    covariance; the last is 0 when ``mean(n) = 0`` (no loss token, per-token mean 0). Written independently
    of the difference of the two means, so that their agreement is a check (the torch-free twin of
    :func:`lossparity.losses.gap.estimator_gap`, which the log tools cannot import)."""
    n = np.asarray(n, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    l = s / np.maximum(n, 1.0)
    mean_n = float(n.mean())
    cov = float(((n - mean_n) * (l - l.mean())).mean())
    return cov, mean_n, cov / mean_n if mean_n > 0 else 0.0


def missing_steps(steps: Iterable[int], first: int, last: int) -> list[tuple[int, int]]:
    """The steps of ``first..last`` (inclusive) that ``steps`` lacks, as inclusive ``(lo, hi)`` ranges in
    increasing order: cost and size follow the steps present, never the width of the range (a dump of steps
    1 and 10**12 has one missing range)."""
    have = sorted({st for st in steps if first <= st <= last})
    out: list[tuple[int, int]] = []
    prev = first - 1
    for st in [*have, last + 1]:
        if st > prev + 1:
            out.append((prev + 1, st - 1))
        prev = st
    return out


def missing_count(ranges: Sequence[tuple[int, int]]) -> int:
    """How many steps the ranges of :func:`missing_steps` hold."""
    return sum(hi - lo + 1 for lo, hi in ranges)


def format_ranges(ranges: Sequence[tuple[int, int]], limit: int = 20) -> str:
    """``"3-4, 6-7"``: the ranges of :func:`missing_steps`; more than ``limit`` are cut to the first ones,
    ``... (k more)`` and the last one."""
    parts = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
    if len(parts) > limit:
        parts = [*parts[: limit - 1], f"... ({len(parts) - limit} more)", parts[-1]]
    return ", ".join(parts) if parts else "-"


def bootstrap_gaps(n: np.ndarray, s: np.ndarray, replicates: int, rng: np.random.Generator) -> np.ndarray:
    """``replicates`` bootstrap values of ``per_token − per_sample`` for one step: each resamples the ``N``
    samples with replacement (``rng.integers``) and recomputes ``S*/max(Ntok*,1) − mean(l*)``."""
    n = np.asarray(n, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    l = s / np.maximum(n, 1.0)
    N = n.size
    out = np.empty(replicates, dtype=np.float64)
    chunk = max(1, _BOOTSTRAP_CHUNK // max(N, 1))
    for lo in range(0, replicates, chunk):
        hi = min(replicates, lo + chunk)
        idx = rng.integers(0, N, size=(hi - lo, N))
        out[lo:hi] = s[idx].sum(axis=1) / np.maximum(n[idx].sum(axis=1), 1.0) - l[idx].mean(axis=1)
    return out


def _interval(reps: np.ndarray | None, ci: float) -> tuple[float | None, float | None]:
    if reps is None or reps.size == 0:
        return None, None
    lo, hi = np.quantile(reps, [(1.0 - ci) / 2.0, 1.0 - (1.0 - ci) / 2.0])
    return float(lo), float(hi)


@dataclass
class StepGap:
    """One step: sample and token counts, every computable mode, the gap and its decomposition
    (``cov``, ``mean_count``, ``cov_term = cov/mean_count``) and the bootstrap interval of the gap."""

    step: int
    samples: int
    tokens: int
    per_token: float
    per_sample: float
    per_microbatch: float | None
    sample_sum: float
    sample_sum_norm: float | None
    gap: float
    cov: float
    mean_count: float
    cov_term: float
    ci_low: float | None = None
    ci_high: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return dict(self.__dict__)


@dataclass
class DriftResult:
    """Observed difference ``A − B`` of a logged metric vs the estimator gap, on the common steps.

    ``steps`` are the dump's step numbers; ``explained`` is whether ``observed_mean`` lies in
    ``[ci_low, ci_high]``, the interval of the mean gap over those steps."""

    metric: str
    a_source: str
    b_source: str
    steps: list[int]
    observed: list[float]
    gap: list[float]
    step_ci: list[tuple[float | None, float | None]]
    observed_mean: float
    gap_mean: float
    ci_low: float
    ci_high: float
    explained: bool

    @property
    def verdict(self) -> str:
        """One line: "explained" or "not explained", with the numbers that decide it."""
        word = "explained" if self.explained else "not explained"
        return (
            f"verdict: {word} (observed mean {self.metric} difference A−B {self.observed_mean:.6g} "
            f"{'lies' if self.explained else 'does not lie'} in the CI [{self.ci_low:.6g}, {self.ci_high:.6g}] "
            f"of the mean estimator gap {self.gap_mean:.6g} over {len(self.steps)} steps)"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with one row per step and the verdict line."""
        return {
            "metric": self.metric,
            "a": self.a_source,
            "b": self.b_source,
            "steps": [
                {"step": st, "observed": o, "gap": g, "ci_low": c[0], "ci_high": c[1]}
                for st, o, g, c in zip(self.steps, self.observed, self.gap, self.step_ci)
            ],
            "observed_mean": self.observed_mean,
            "gap_mean": self.gap_mean,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "explained": self.explained,
            "verdict": self.verdict,
        }


@dataclass
class GapReport:
    """All steps of one dump, the settings used, and the bootstrap replicates (``replicates[j]`` belongs
    to ``steps[j]``; ``None`` without bootstrap)."""

    source: str
    meta: dict[str, Any] | None
    microbatch_size: int | None
    fixed_length: int | None
    bootstrap: int
    seed: int
    ci: float
    steps: list[StepGap]
    notes: list[str] = field(default_factory=list)
    replicates: np.ndarray | None = None
    drift: DriftResult | None = None
    missing: list[tuple[int, int]] = field(default_factory=list)

    def mean_interval(self, indices: list[int] | np.ndarray) -> tuple[float | None, float | None]:
        """Bootstrap interval of the mean gap over the steps at ``indices`` (stratified: each step
        resampled on its own, replicate ``r`` of the mean = mean of the steps' replicates ``r``)."""
        if self.replicates is None:
            return None, None
        idx = np.asarray(indices, dtype=np.int64)
        total = np.zeros(self.replicates.shape[1], dtype=np.float64)
        for lo in range(0, idx.size, 256):  # a few rows at a time: never a copy of every replicate
            total += self.replicates[idx[lo : lo + 256]].sum(axis=0)
        return _interval(total / max(idx.size, 1), self.ci)

    def overall(self) -> dict[str, Any]:
        """Mean over all steps of the gap and the covariance term, the interval of the mean gap, and the
        largest ``|gap − cov_term|`` (the decomposition's numerical error)."""
        gaps = np.array([st.gap for st in self.steps])
        lo, hi = self.mean_interval(list(range(len(self.steps))))
        return {
            "steps": len(self.steps),
            "mean_gap": float(gaps.mean()),
            "mean_cov_term": float(np.mean([st.cov_term for st in self.steps])),
            "ci_low": lo,
            "ci_high": hi,
            "max_decomposition_error": float(max(abs(st.gap - st.cov_term) for st in self.steps)),
        }

    def to_dict(self, every: int = 1) -> dict[str, Any]:
        """JSON-ready report: settings, per-step rows (or blocks of ``every`` steps), overall summary,
        what is not computable, notes and the drift check."""
        return {
            "source": self.source,
            "meta": self.meta,
            "microbatch_size": self.microbatch_size,
            "fixed_length": self.fixed_length,
            "bootstrap": self.bootstrap,
            "seed": self.seed,
            "ci": self.ci,
            "every": every,
            "steps": [st.to_dict() for st in self.steps] if every == 1 else summarize(self, every),
            "overall": self.overall(),
            "not_computable": dict(NOT_COMPUTABLE),
            "notes": list(self.notes),
            "missing_steps": [list(r) for r in self.missing],
            "missing_step_count": missing_count(self.missing),
            "compare_drift": self.drift.to_dict() if self.drift else None,
        }


def _check_gap_arguments(
    samples: dict[int, StepSamples], microbatch_size: int | None, fixed_length: int | None, bootstrap: int, ci: float
) -> None:
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap}")
    if not 0.0 < ci < 1.0:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    if microbatch_size is not None and microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    if fixed_length is not None and fixed_length < 1:
        raise ValueError(f"fixed_length must be >= 1, got {fixed_length}")
    if not samples:
        raise ValueError("samples: the dump holds no step")
    if any(np.asarray(v[1]).size == 0 for v in samples.values()):
        raise ValueError("a step needs at least one sample")
    if bootstrap * len(samples) > MAX_BOOTSTRAP_VALUES:
        most = max(MAX_BOOTSTRAP_VALUES // len(samples), 1)
        raise ValueError(
            f"--bootstrap {bootstrap} over {len(samples)} steps would hold {bootstrap * len(samples)} replicates, more "
            f"than the {MAX_BOOTSTRAP_VALUES} kept; use at most --bootstrap {most}"
        )


def compute_gap(
    samples: dict[int, StepSamples],
    *,
    microbatch_size: int | None = None,
    fixed_length: int | None = None,
    bootstrap: int = 1000,
    seed: int = 0,
    ci: float = 0.95,
    source: str = "",
    meta: dict[str, Any] | None = None,
) -> GapReport:
    """Compute a :class:`GapReport` from ``{step: (rows, n, s)}`` (as :func:`read_sample_dump` returns).

    Per step: the values of :func:`step_mode_values`, the gap identity (``per_token − per_sample`` from the
    two means and the covariance of :func:`covariance_gap`, computed independently), and, with
    ``bootstrap > 0``, the replicates of :func:`bootstrap_gaps` drawn from one
    ``numpy.random.default_rng(seed)`` in step order (a deterministic function of the seed). Steps with the
    same number of samples are computed together as ``[G, N]`` arrays (:mod:`._gap_batch`; their indices
    drawn in one ``rng.integers`` call per block). ``per_microbatch`` needs the rows of a step to be exactly
    ``0..N-1``.
    """
    _check_gap_arguments(samples, microbatch_size, fixed_length, bootstrap, ci)
    rng = np.random.default_rng(seed)
    notes: list[str] = []
    rows_out: list[StepGap] = []
    # filled in place, one row per step: never the list of rows and its stacked copy at once
    reps = np.empty((len(samples), bootstrap), dtype=np.float64) if bootstrap else None
    mb_problem: str | None = None
    for block in step_blocks(samples):
        n2 = np.stack([np.asarray(samples[st][1], dtype=np.float64) for st in block])
        s2 = np.stack([np.asarray(samples[st][2], dtype=np.float64) for st in block])
        vals = block_values(n2, s2, microbatch_size, fixed_length)
        b = microbatch_size
        for i, step in enumerate(block):
            rows = samples[step][0]
            mb = vals["per_microbatch"]
            if b is not None and (rows.size % b or not np.array_equal(rows, np.arange(rows.size))):
                mb_problem = mb_problem or (
                    f"per_microbatch not computed from step {step}: its {rows.size} rows are not 0..N-1 in blocks "
                    f"of b={b}"
                )
                mb = None
            per_token, per_sample = float(vals["per_token"][i]), float(vals["per_sample"][i])  # type: ignore[index]
            rows_out.append(
                StepGap(
                    step=step,
                    samples=int(n2.shape[1]),
                    tokens=int(vals["tokens"][i]),  # type: ignore[index]
                    per_token=per_token,
                    per_sample=per_sample,
                    per_microbatch=None if mb is None else float(mb[i]),
                    sample_sum=float(vals["sample_sum"][i]),  # type: ignore[index]
                    sample_sum_norm=value_at(vals["sample_sum_norm"], i),
                    gap=per_token - per_sample,
                    cov=float(vals["cov"][i]),  # type: ignore[index]
                    mean_count=float(vals["mean_count"][i]),  # type: ignore[index]
                    cov_term=float(vals["cov_term"][i]),  # type: ignore[index]
                )
            )
        if reps is not None:
            bootstrap_block(n2, s2, bootstrap, rng, reps[len(rows_out) - len(block) : len(rows_out)])
    if reps is not None:
        lows, highs = quantile_rows(reps, ci)
        for st, lo, hi in zip(rows_out, lows.tolist(), highs.tolist()):
            st.ci_low, st.ci_high = lo, hi
    if microbatch_size is None:
        notes.append("per_microbatch not computed: give --microbatch-size (the dump's meta has no microbatch_size)")
    elif mb_problem:
        notes.append(mb_problem)
    if fixed_length is None:
        notes.append("sample_sum_norm not computed: give --fixed-length L (the dump's meta has no fixed_length)")
    return GapReport(
        source=source,
        meta=meta,
        microbatch_size=microbatch_size,
        fixed_length=fixed_length,
        bootstrap=bootstrap,
        seed=seed,
        ci=ci,
        steps=rows_out,
        notes=notes,
        replicates=reps,
    )


def summarize(report: GapReport, every: int) -> list[dict[str, Any]]:
    """Blocks of ``every`` consecutive steps (in step order): the mean of every value column over the
    block, its sample and token totals, and the bootstrap interval of the block's mean gap."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    out = []
    for lo in range(0, len(report.steps), every):
        idx = list(range(lo, min(lo + every, len(report.steps))))
        block = [report.steps[i] for i in idx]
        row: dict[str, Any] = {
            "first_step": block[0].step,
            "last_step": block[-1].step,
            "steps": len(block),
            "samples": sum(b.samples for b in block),
            "tokens": sum(b.tokens for b in block),
        }
        for col in _VALUE_COLUMNS:
            vals = [getattr(b, col) for b in block]
            row[col] = None if any(v is None for v in vals) else float(np.mean(vals))
        row["ci_low"], row["ci_high"] = report.mean_interval(idx)
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------------
# drift between two runs


def compare_drift(report: GapReport, run_a: Any, run_b: Any, metric: str = "objective") -> DriftResult:
    """Compare ``A − B`` of ``metric`` in two :class:`~lossparity.parity.readers.Run` with the report's gap.

    Steps are aligned by their offset from each log's first step (``step - step_base``) and from the
    dump's (``step - meta.step_base``, 1 by default). Needs a bootstrap (``report.bootstrap > 0``);
    raises ``ValueError`` naming the run when ``metric`` is missing or no step is shared.
    """
    if report.replicates is None:
        raise ValueError("--compare-drift needs the bootstrap interval: use --bootstrap > 0")
    for role, run in (("A", run_a), ("B", run_b)):
        if metric not in run.metrics or not run.metrics[metric]:
            have = ", ".join(sorted(run.metrics)) or "none"
            raise ValueError(f"log {role} ({run.source}) has no {metric!r} values; its metrics: {have}")
    base = int((report.meta or {}).get("step_base", 1) or 1)
    a = {s - run_a.step_base: v for s, v in run_a.metrics[metric].items()}
    b = {s - run_b.step_base: v for s, v in run_b.metrics[metric].items()}
    idx, observed = [], []
    for j, st in enumerate(report.steps):
        off = st.step - base
        if off in a and off in b and math.isfinite(a[off]) and math.isfinite(b[off]):
            idx.append(j)
            observed.append(a[off] - b[off])
    if not idx:
        raise ValueError(
            f"no step in common between the dump ({report.steps[0].step}..{report.steps[-1].step}, first "
            f"step {base}) and the finite {metric!r} values of both logs"
        )
    lo, hi = report.mean_interval(idx)
    assert lo is not None and hi is not None
    obs_mean = float(np.mean(observed))
    gap_mean = float(np.mean([report.steps[j].gap for j in idx]))
    slack = 1e-12 * max(1.0, abs(gap_mean))  # the two sides are computed by different sums
    return DriftResult(
        metric=metric,
        a_source=run_a.source,
        b_source=run_b.source,
        steps=[report.steps[j].step for j in idx],
        observed=observed,
        gap=[report.steps[j].gap for j in idx],
        step_ci=[(report.steps[j].ci_low, report.steps[j].ci_high) for j in idx],
        observed_mean=obs_mean,
        gap_mean=gap_mean,
        ci_low=lo,
        ci_high=hi,
        explained=bool(lo - slack <= obs_mean <= hi + slack),
    )


# --------------------------------------------------------------------------------------------------
# output


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.6g}"


def _ci(lo: float | None, hi: float | None) -> str:
    return "-" if lo is None or hi is None else f"[{lo:.4g}, {hi:.4g}]"


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]


def _drift_blocks(report: GapReport, every: int) -> list[tuple[int, int, float, float, float | None, float | None]]:
    """Drift rows per block of ``every`` common steps: (first, last, mean observed, mean gap, CI of the mean gap)."""
    d = report.drift
    assert d is not None
    if every == 1:
        return [(st, st, o, g, c[0], c[1]) for st, o, g, c in zip(d.steps, d.observed, d.gap, d.step_ci)]
    index = {st.step: j for j, st in enumerate(report.steps)}
    out = []
    for lo in range(0, len(d.steps), every):
        hi = min(lo + every, len(d.steps))
        ci = report.mean_interval([index[s] for s in d.steps[lo:hi]])
        out.append((d.steps[lo], d.steps[hi - 1], float(np.mean(d.observed[lo:hi])), float(np.mean(d.gap[lo:hi])), *ci))
    return out


def format_table(report: GapReport, every: int = 1) -> str:
    """The text ``gap`` prints: settings, one row per step (or per block of ``every`` steps) with every
    computable mode, the gap, ``Cov(n,l)/mean(n)`` and the interval, then the overall summary, what is not
    computable, notes and (when present) the drift table and verdict."""
    pct = f"{100 * report.ci:g}% CI"
    mode = (report.meta or {}).get("mode")
    lines = [
        f"lossparity gap: {report.source}" + (f" (run mode {mode})" if mode else ""),
        f"  steps {len(report.steps)}, microbatch size {report.microbatch_size or '-'}, fixed length "
        f"{report.fixed_length or '-'}, bootstrap {report.bootstrap} (seed {report.seed})",
    ]
    head = ("step", "N", "tokens", *_MODE_COLUMNS, "gap", "Cov(n,l)/mean(n)", pct)
    rows: list[tuple[str, ...]] = []
    if every == 1:
        for st in report.steps:
            rows.append(
                (
                    str(st.step),
                    str(st.samples),
                    str(st.tokens),
                    *(_f(getattr(st, c)) for c in _MODE_COLUMNS),
                    _f(st.gap),
                    _f(st.cov_term),
                    _ci(st.ci_low, st.ci_high),
                )
            )
    else:
        head = ("steps", "N", "tokens", *_MODE_COLUMNS, "gap", "Cov(n,l)/mean(n)", pct)
        for blk in summarize(report, every):
            rows.append(
                (
                    f"{blk['first_step']}-{blk['last_step']}",
                    str(blk["samples"]),
                    str(blk["tokens"]),
                    *(_f(blk[c]) for c in _MODE_COLUMNS),
                    _f(blk["gap"]),
                    _f(blk["cov_term"]),
                    _ci(blk["ci_low"], blk["ci_high"]),
                )
            )
        lines.append(f"  (means over blocks of {every} steps)")
    lines += _table(head, rows)
    ov = report.overall()
    lines.append(
        f"  overall: mean gap per_token − per_sample {ov['mean_gap']:.6g} {_ci(ov['ci_low'], ov['ci_high'])}, "
        f"mean Cov(n,l)/mean(n) {ov['mean_cov_term']:.6g}, max |gap − Cov/mean| "
        f"{ov['max_decomposition_error']:.3g}"
    )
    lines.append(
        "  (gap and Cov(n,l)/mean(n) agree by the identity per_token − per_sample = Cov(n,l)/mean(n), n_i the "
        "tokens and l_i the mean loss of sample i; both are computed separately, so their agreement checks the dump)"
    )
    lines += [f"  {k}: {why}" for k, why in NOT_COMPUTABLE.items()]
    lines += [f"  note: {x}" for x in report.notes]
    if report.missing:
        lines.append(f"  MISSING STEPS: the dump lacks step(s) {format_ranges(report.missing)}")
    d = report.drift
    if d is not None:
        lines.append(f"  compare-drift: {d.metric}, A = {d.a_source}, B = {d.b_source}")
        drows = [
            (
                f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}",
                _f(r[2]),
                _f(r[3]),
                _ci(r[4], r[5]),
                "yes" if r[4] is not None and r[5] is not None and r[4] <= r[2] <= r[5] else "no",
            )
            for r in _drift_blocks(report, every)
        ]
        lines += _table(("step" if every == 1 else "steps", "observed A−B", "gap", pct, "in CI"), drows)
        lines.append("  " + d.verdict)
    return "\n".join(lines)
