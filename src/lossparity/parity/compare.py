"""Compare two runs metric by metric: do their curves agree within tolerance?

Semantics (all functions below follow them):

- **Alignment.** ``align="step"`` pairs optimizer steps: a candidate step ``s`` sits at reference
  step ``s - cand.step_base + ref.step_base`` (so MaxText's step 0 meets Megatron's iteration 1);
  results are reported in reference step numbers. ``align="samples"`` pairs points with the same
  consumed-sample count (for runs with different global batch sizes); each run needs
  ``consumed_samples`` (from its log, or :meth:`Run.with_constant_batch_size`). When several steps
  of one run share a sample count, the last of them is used.
- **Window.** ``window=(start, end)`` keeps aligned points with ``start <= x <= end`` (``x`` = the
  reference step, or the consumed samples with ``align="samples"``); ``None`` for an open side.
- **Smoothing.** ``smooth=w`` replaces both compared series by their trailing moving average over
  the aligned points, ``y'[i] = mean(y[max(0, i-w+1) .. i])``; a window holding a non-finite value
  gives NaN.
- **Tolerance.** A point passes when ``|c - r| <= abs + rel·|r|`` (``r`` reference, ``c``
  candidate), as ``numpy.isclose``. Two non-finite values agree when both are NaN or both are the
  same infinity (both runs blew up on that step); one non-finite value fails. Relative difference
  ``|c - r| / |r|`` (0 when both are equal, inf when ``r = 0 != c`` or a non-finite value fails).
- **Verdict.** A metric passes when its number of failing points is ``<= allowed``, where
  ``allowed = 0``, or with ``megatron_rule=True`` Megatron-LM's functional-test rule
  ``allowed = min(max(n // 100, 1), 50)`` for ``n > 1`` compared points (``0`` for ``n = 1``).
  The comparison passes when every compared metric passes.
- **Default metrics.** Without ``metrics``, every canonical metric (see :mod:`.names`) that both
  runs have is compared; other shared names are listed as not compared.
- **Default tolerances** (:data:`DEFAULT_TOLERANCES`): ``lm_loss`` and ``objective`` rel 2e-4,
  ``mtp_<k>_loss`` rel 2e-3, load-balancing and router z-losses rel 2e-3, ``grad_norm`` rel 1e-2,
  ``lr`` rel 1e-5, ``tokens`` abs 0.5 (integers must be equal), any other metric rel 1e-3.
  Overrides: ``"lm_loss=1e-3,mtp_*_loss=rel:1e-3,grad_norm=abs:0.01,*=rel:5e-3"`` (bare number =
  relative; ``rel:a+abs:b`` for both; shell-style patterns; ``*`` = everything else).

Note that a log's printed precision bounds what can pass: Megatron prints losses with 7 significant
digits, older MaxText consoles with 3 decimals.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .names import CANONICAL_METRICS, MTP_RE, is_canonical, parse_name_map
from .readers import FORMAT_ALIASES, FORMATS, LogParseError, Run, read_log


class CompareInputError(ValueError):
    """The two runs cannot be compared as asked (no shared metric, no overlapping steps, ...)."""


# ---------------------------------------------------------------------------------------------------
# tolerances


@dataclass(frozen=True)
class Tolerance:
    """Pass band of one metric: ``|c - r| <= abs + rel·|r|``."""

    rel: float = 0.0
    abs: float = 0.0

    def __post_init__(self) -> None:
        for name, v in (("rel", self.rel), ("abs", self.abs)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"tolerance: {name} must be a finite number >= 0, got {v}")

    def bound(self, ref: np.ndarray) -> np.ndarray:
        """Allowed ``|c - r|`` at each reference value: ``abs + rel·|r|``."""
        return self.abs + self.rel * np.abs(ref)

    def __str__(self) -> str:
        parts = [f"rel {self.rel:.3g}"] if self.rel else []
        parts += [f"abs {self.abs:.3g}"] if self.abs or not self.rel else []
        return " + ".join(parts)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "lm_loss": Tolerance(rel=2e-4),
    "objective": Tolerance(rel=2e-4),
    "mtp_*_loss": Tolerance(rel=2e-3),
    "load_balancing_loss": Tolerance(rel=2e-3),
    "seq_load_balancing_loss": Tolerance(rel=2e-3),
    "global_load_balancing_loss": Tolerance(rel=2e-3),
    "z_loss": Tolerance(rel=2e-3),
    "grad_norm": Tolerance(rel=1e-2),
    "lr": Tolerance(rel=1e-5),
    "tokens": Tolerance(abs=0.5),
    "*": Tolerance(rel=1e-3),
}


def _parse_one_tolerance(text: str, key: str) -> Tolerance:
    rel = abs_ = 0.0
    seen: set[str] = set()
    for part in text.split("+"):
        kind, sep, num = part.strip().partition(":")
        if not sep:
            kind, num = "rel", kind
        kind = kind.strip().lower()
        if kind not in ("rel", "abs") or kind in seen:
            raise ValueError(f"tolerances: {key}={text!r}: expected 'x', 'rel:x', 'abs:x' or 'rel:x+abs:y'")
        seen.add(kind)
        try:
            value = float(num)
        except ValueError:
            raise ValueError(f"tolerances: {key}={text!r}: {num.strip()!r} is not a number") from None
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"tolerances: {key}={text!r}: tolerance must be finite and >= 0")
        rel, abs_ = (value, abs_) if kind == "rel" else (rel, value)
    return Tolerance(rel=rel, abs=abs_)


def parse_tolerances(spec: str) -> dict[str, Tolerance]:
    """Parse ``"lm_loss=1e-3,mtp_1_loss=rel:1e-3,grad_norm=abs:0.01"`` into ``{metric: Tolerance}``.

    Each comma-separated entry is ``name=value`` where ``value`` is ``x`` (relative), ``rel:x``,
    ``abs:x`` or ``rel:x+abs:y``; ``name`` may be a shell-style pattern (``mtp_*_loss``) or ``*``.
    Raises ``ValueError`` naming ``tolerances`` and the bad entry.
    """
    out: dict[str, Tolerance] = {}
    for entry in spec.split(","):
        if not entry.strip():
            continue
        key, sep, text = entry.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise ValueError(f"tolerances: entry {entry.strip()!r} is not of the form 'metric=tolerance'")
        if key in out:
            raise ValueError(f"tolerances: metric {key!r} is given twice")
        out[key] = _parse_one_tolerance(text, key)
    return out


def _normalize_tolerances(
    tolerances: Mapping[str, Tolerance | float | str] | str | None,
) -> dict[str, Tolerance]:
    if tolerances is None:
        return {}
    if isinstance(tolerances, str):
        return parse_tolerances(tolerances)
    out: dict[str, Tolerance] = {}
    for key, tol in tolerances.items():
        if isinstance(tol, Tolerance):
            out[key] = tol
        elif isinstance(tol, str):
            out[key] = _parse_one_tolerance(tol, key)
        elif isinstance(tol, (int, float)) and not isinstance(tol, bool):
            out[key] = Tolerance(rel=float(tol))
        else:
            raise ValueError(f"tolerances: {key}: expected a Tolerance, a number or a string, got {tol!r}")
    return out


def _lookup(metric: str, table: Mapping[str, Tolerance]) -> Tolerance | None:
    if metric in table:
        return table[metric]
    for pattern, tol in table.items():
        if pattern != "*" and fnmatch.fnmatchcase(metric, pattern):
            return tol
    return None


def tolerance_for(metric: str, overrides: Mapping[str, Tolerance] | None = None) -> Tolerance:
    """Tolerance of ``metric``: the overrides' exact name, then their patterns, then their ``*``;
    then the same lookups in :data:`DEFAULT_TOLERANCES` (whose ``*`` is rel 1e-3)."""
    user = overrides or {}
    tol = _lookup(metric, user) or user.get("*") or _lookup(metric, DEFAULT_TOLERANCES)
    return tol if tol is not None else DEFAULT_TOLERANCES["*"]


def megatron_allowed_failures(n: int) -> int:
    """Failing points Megatron-LM's functional tests tolerate among ``n`` compared steps.

    ``min(max(n // 100, 1), 50)`` for ``n > 1`` and 0 for ``n <= 1`` (Megatron-LM
    ``tests/functional_tests/python_test_utils/common.py``: a single step must match; it passes when
    ``mean(is_close) >= 1 - allowed / n``, i.e. ``failures <= allowed``).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return 0 if n <= 1 else min(max(n // 100, 1), 50)


# ---------------------------------------------------------------------------------------------------
# results


def _num(v: float) -> float | str:
    """JSON-safe float: non-finite values become the strings ``nan``, ``inf``, ``-inf``."""
    v = float(v)
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


@dataclass
class MetricResult:
    """Point-by-point comparison of one metric (arrays are aligned and sorted by ``x``).

    ``steps``: reference step numbers; ``x``: the alignment coordinate (``steps``, or consumed samples);
    ``ref``/``cand``: the compared (smoothed) values; ``ok``: pass flags; ``rel_diff``: ``|c-r|/|r|``.
    ``only_ref``/``only_cand``: points inside the window that the other run lacks.
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
    only_ref: int = 0
    only_cand: int = 0

    @property
    def n_compared(self) -> int:
        return int(self.ok.size)

    @property
    def n_failed(self) -> int:
        return int((~self.ok).sum())

    @property
    def passed(self) -> bool:
        return self.n_failed <= self.allowed_failures

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
            {"step": int(self.steps[i]), "x": _num(self.x[i]), "ref": _num(self.ref[i]),
             "cand": _num(self.cand[i]), "rel_diff": _num(self.rel_diff[i])}
            for i in bad[:max_failures]
        ]
        return {
            "metric": self.metric,
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
            "failures": failures,
            "failures_truncated": bool(bad.size > max_failures),
        }


@dataclass
class CompareResult:
    """All metrics of one comparison; ``passed`` when every compared metric passes."""

    ref: Run
    cand: Run
    align: str
    window: tuple[float | None, float | None] | None
    smooth: int
    megatron_rule: bool
    metrics: dict[str, MetricResult] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    not_compared: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.metrics.values())

    @property
    def violations(self) -> list[MetricResult]:
        return [m for m in self.metrics.values() if not m.passed]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready result (non-finite numbers as strings)."""

        def run_info(run: Run) -> dict[str, object]:
            return {"source": run.source, "format": run.format, "step_base": run.step_base,
                    "restarts": run.restarts, "dropped_values": run.dropped_values,
                    "skipped_lines": run.skipped_lines, "skipped_steps": sorted(run.skipped_steps)}

        return {
            "passed": self.passed,
            "ref": run_info(self.ref),
            "cand": run_info(self.cand),
            "align": self.align,
            "window": list(self.window) if self.window else None,
            "smooth": self.smooth,
            "megatron_rule": self.megatron_rule,
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()},
            "skipped": dict(self.skipped),
            "not_compared": list(self.not_compared),
        }


# ---------------------------------------------------------------------------------------------------
# comparison


def moving_average(y: np.ndarray, w: int) -> np.ndarray:
    """Trailing moving average ``y'[i] = mean(y[max(0, i-w+1) .. i])``; NaN where the window holds a
    non-finite value."""
    if w < 1:
        raise ValueError(f"smooth must be >= 1, got {w}")
    y = np.asarray(y, dtype=np.float64)
    if w == 1 or y.size == 0:
        return y.copy()
    finite = np.isfinite(y)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, y, 0.0))])
    cbad = np.concatenate([[0], np.cumsum(~finite)])
    hi = np.arange(1, y.size + 1)
    lo = np.maximum(hi - w, 0)
    out = (csum[hi] - csum[lo]) / (hi - lo)
    out[(cbad[hi] - cbad[lo]) > 0] = np.nan
    return out


def _points(run: Run, metric: str, align: str, offset: int) -> dict[float, tuple[int, float]]:
    """``{x: (step, value)}`` of one metric in the alignment coordinate."""
    series = run.metrics[metric]
    if align == "step":
        return {float(s + offset): (s, v) for s, v in sorted(series.items())}
    out: dict[float, tuple[int, float]] = {}
    for s, v in sorted(series.items()):
        if s in run.consumed_samples:
            out[float(run.consumed_samples[s])] = (s, v)
    return out


def _compare_metric(
    metric: str, ref: Run, cand: Run, tol: Tolerance, align: str,
    window: tuple[float | None, float | None] | None, smooth: int, megatron_rule: bool,
) -> MetricResult | None:
    rp = _points(ref, metric, align, 0)
    cp = _points(cand, metric, align, ref.step_base - cand.step_base)
    if window is not None:
        lo, hi = window
        keep = lambda x: (lo is None or x >= lo) and (hi is None or x <= hi)  # noqa: E731
        rp = {x: p for x, p in rp.items() if keep(x)}
        cp = {x: p for x, p in cp.items() if keep(x)}
    xs = sorted(set(rp) & set(cp))
    if not xs:
        return None
    steps = np.array([rp[x][0] for x in xs], dtype=np.int64)
    r = moving_average(np.array([rp[x][1] for x in xs], dtype=np.float64), smooth)
    c = moving_average(np.array([cp[x][1] for x in xs], dtype=np.float64), smooth)
    finite = np.isfinite(r) & np.isfinite(c)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.abs(c - r)
        ok = np.where(finite, diff <= tol.bound(r), (np.isnan(r) & np.isnan(c)) | (r == c))
        rel = np.where(diff == 0, 0.0, diff / np.abs(r))
    rel = np.where(finite, rel, np.where(ok, 0.0, np.inf))
    return MetricResult(
        metric=metric, tolerance=tol, steps=steps, x=np.array(xs, dtype=np.float64), ref=r, cand=c,
        ok=ok.astype(bool), rel_diff=rel,
        allowed_failures=megatron_allowed_failures(len(xs)) if megatron_rule else 0,
        only_ref=len(set(rp) - set(cp)), only_cand=len(set(cp) - set(rp)),
    )


def _metric_order(name: str) -> tuple[int, int, str]:
    m = MTP_RE.match(name)
    if m:
        return (1, int(m.group(1)), name)
    if name in CANONICAL_METRICS:
        return (0 if name in ("lm_loss", "objective") else 2, CANONICAL_METRICS.index(name), name)
    return (3, 0, name)


def compare_runs(
    ref: Run,
    cand: Run,
    *,
    tolerances: Mapping[str, Tolerance | float | str] | str | None = None,
    metrics: Sequence[str] | None = None,
    window: tuple[float | None, float | None] | None = None,
    smooth: int = 1,
    megatron_rule: bool = False,
    align: str = "step",
) -> CompareResult:
    """Compare ``cand`` against ``ref`` metric by metric (semantics in this module's docstring).

    ``tolerances`` overrides :data:`DEFAULT_TOLERANCES` (a mapping or a spec string for
    :func:`parse_tolerances`); ``metrics`` restricts the comparison (each must exist in both runs
    and overlap); ``window`` is an inclusive ``(start, end)`` on the alignment coordinate.
    Raises :class:`CompareInputError` for unusable input: bad ``smooth``/``align``/``window``, a
    requested metric missing from a run, no shared metric, no overlapping steps, or
    ``align="samples"`` without consumed samples.
    """
    if align not in ("step", "samples"):
        raise CompareInputError(f"align must be 'step' or 'samples', got {align!r}")
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise CompareInputError(f"smooth must be an integer >= 1, got {smooth!r}")
    if window is not None:
        if len(window) != 2:
            raise CompareInputError(f"window must be (start, end), got {window!r}")
        lo, hi = window
        if lo is not None and hi is not None and lo > hi:
            raise CompareInputError(f"window: start {lo} is after end {hi}")
        window = (lo, hi)
    try:
        overrides = _normalize_tolerances(tolerances)
    except ValueError as e:
        raise CompareInputError(str(e)) from None
    if align == "samples":
        for role, run in (("ref", ref), ("cand", cand)):
            if not run.consumed_samples:
                raise CompareInputError(
                    f"align='samples': {role} run {run.source} has no consumed samples; "
                    "give its global batch size (Run.with_constant_batch_size, --{role}-gbs)"
                )

    shared = set(ref.metrics) & set(cand.metrics)
    if metrics is not None:
        wanted = list(dict.fromkeys(metrics))
        for m in wanted:
            missing = [role for role, run in (("ref", ref), ("cand", cand)) if m not in run.metrics]
            if missing:
                raise CompareInputError(
                    f"metrics: {m!r} is not in the {' and '.join(missing)} run "
                    f"(ref has {sorted(ref.metrics)}, cand has {sorted(cand.metrics)})"
                )
        not_compared: list[str] = []
    else:
        wanted = sorted((m for m in shared if is_canonical(m)), key=_metric_order)
        not_compared = sorted(m for m in shared if not is_canonical(m))
        if not wanted:
            raise CompareInputError(
                f"no shared canonical metric (ref has {sorted(ref.metrics)}, cand has "
                f"{sorted(cand.metrics)}); map names with a name map or name metrics explicitly"
            )

    result = CompareResult(ref=ref, cand=cand, align=align, window=window, smooth=smooth,
                           megatron_rule=megatron_rule, not_compared=not_compared)
    for m in wanted:
        mr = _compare_metric(m, ref, cand, tolerance_for(m, overrides), align, window, smooth, megatron_rule)
        if mr is None:
            if metrics is not None:
                raise CompareInputError(f"metrics: {m!r} has no overlapping {align}s in the two runs"
                                        + (" inside the window" if window else ""))
            result.skipped[m] = f"no overlapping {align}s" + (" inside the window" if window else "")
        else:
            result.metrics[m] = mr
    if not result.metrics:
        raise CompareInputError(
            f"no overlapping {align}s for any shared metric ({', '.join(wanted)})"
            + (f" inside the window {window}" if window else "")
        )
    return result


# ---------------------------------------------------------------------------------------------------
# command line


def _parse_window(text: str) -> tuple[float | None, float | None]:
    sep = ":" if ":" in text else ","
    lo, s, hi = text.partition(sep)
    if not s:
        raise argparse.ArgumentTypeError(f"--window: expected START:END (a side may be empty), got {text!r}")
    try:
        return (float(lo) if lo.strip() else None, float(hi) if hi.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window: START and END must be numbers, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the error names the text)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``compare`` command's arguments: positionals ``ref`` and ``cand`` and the options.

    Options: ``--format/--ref-format/--cand-format``, ``--name-map/--ref-name-map/--cand-name-map``,
    ``--metrics``, ``--tol``, ``--window START:END``, ``--smooth N``, ``--megatron-rule``,
    ``--align step|samples``, ``--ref-gbs/--cand-gbs``, ``--ref-step-base/--cand-step-base``,
    ``--report DIR``, ``--json``.
    """
    fmts = sorted([*FORMATS, *FORMAT_ALIASES])
    parser.add_argument("ref", help="reference log (file or TensorBoard directory)")
    parser.add_argument("cand", help="candidate log (file or TensorBoard directory)")
    parser.add_argument("--format", dest="fmt", choices=fmts, help="format of both logs (default: detect)")
    parser.add_argument("--ref-format", choices=fmts, help="format of the reference log")
    parser.add_argument("--cand-format", choices=fmts, help="format of the candidate log")
    parser.add_argument("--name-map", default="", help="raw=canonical,... for both logs")
    parser.add_argument("--ref-name-map", default="", help="raw=canonical,... for the reference log")
    parser.add_argument("--cand-name-map", default="", help="raw=canonical,... for the candidate log")
    parser.add_argument("--metrics", default=None, help="comma-separated metrics (default: shared canonical)")
    parser.add_argument("--tol", default="", help="e.g. lm_loss=1e-3,mtp_1_loss=rel:1e-3,grad_norm=abs:0.01")
    parser.add_argument("--window", type=_parse_window, default=None, help="START:END, inclusive")
    parser.add_argument("--smooth", type=positive_int, default=1, help="trailing moving-average width")
    parser.add_argument("--megatron-rule", action="store_true",
                        help="allow min(max(n//100,1),50) failing points of n (Megatron functional tests)")
    parser.add_argument("--align", choices=("step", "samples"), default="step")
    parser.add_argument("--ref-gbs", type=positive_int, default=None,
                        help="reference global batch size (consumed samples for --align samples)")
    parser.add_argument("--cand-gbs", type=positive_int, default=None, help="candidate global batch size")
    parser.add_argument("--ref-step-base", type=int, default=None, help="reference's first step number")
    parser.add_argument("--cand-step-base", type=int, default=None, help="candidate's first step number")
    parser.add_argument("--report", default=None, metavar="DIR", help="write summary.md and plots to DIR")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _load(args: argparse.Namespace, role: str) -> Run:
    shared_map = parse_name_map(args.name_map)
    own_map = parse_name_map(getattr(args, f"{role}_name_map"))
    run = read_log(getattr(args, role), fmt=getattr(args, f"{role}_format") or args.fmt,
                   name_map={**shared_map, **own_map} or None)
    base = getattr(args, f"{role}_step_base")
    if base is not None:
        run.step_base = base
    gbs = getattr(args, f"{role}_gbs")
    return run.with_constant_batch_size(gbs) if gbs is not None else run


def format_text(result: CompareResult) -> str:
    """Plain-text table of a :class:`CompareResult` (what ``compare`` prints without ``--json``)."""
    lines = [f"lossparity compare: {'PARITY' if result.passed else 'VIOLATION'}"]
    for role, run in (("ref", result.ref), ("cand", result.cand)):
        lines.append(f"  {role:<4} {run.source} ({run.format}, first step {run.step_base})")
    head = ("metric", "tolerance", "points", "failed", "allowed", "first fail", "worst step", "max rel diff",
            "")
    rows = [head]
    for m in result.metrics.values():
        first = m.first_fail_step
        rows.append((m.metric, str(m.tolerance), str(m.n_compared), str(m.n_failed), str(m.allowed_failures),
                     "-" if first is None else str(first), str(m.worst_step), f"{m.max_rel_diff:.3e}",
                     "ok" if m.passed else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"  skipped {k}: {why}" for k, why in result.skipped.items()]
    if result.not_compared:
        names = ", ".join(result.not_compared)
        lines.append(f"  not compared (not canonical; name them with --metrics): {names}")
    return "\n".join(lines)


def run_compare(args: argparse.Namespace) -> int:
    """Run ``compare`` from parsed arguments; return the exit code.

    0 = parity, 1 = at least one metric violates its tolerance, 2 = input error (unreadable or
    unparseable log, bad option, no shared metric, no overlapping steps). Prints a table, or with
    ``--json`` a JSON object (``{"error": ..., "exit_code": 2}`` on input errors); errors go to
    stderr. With ``--report DIR`` writes ``summary.md`` and one PNG per metric.
    """
    try:
        ref, cand = _load(args, "ref"), _load(args, "cand")
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
        result = compare_runs(ref, cand, tolerances=args.tol or None, metrics=metrics, window=args.window,
                              smooth=args.smooth, megatron_rule=args.megatron_rule, align=args.align)
    except (OSError, ImportError, ValueError) as e:  # LogParseError and CompareInputError are ValueErrors
        kind = "log error" if isinstance(e, (LogParseError, OSError)) else "input error"
        print(f"lossparity compare: {kind}: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(e), "exit_code": 2}))
        return 2
    if args.report:
        from .report import write_report

        try:
            write_report(result, args.report)
        except OSError as e:
            print(f"lossparity compare: cannot write the report: {e}", file=sys.stderr)
            if args.json:
                print(json.dumps({"error": str(e), "exit_code": 2}))
            return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_text(result))
    return 0 if result.passed else 1
