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
  The comparison passes when every compared metric passes (and the missing-steps rule holds), and, with
  the default metrics, when a loss (``lm_loss`` or ``objective``, possibly paired across frameworks) was
  compared: a verdict must rest on a loss, so a comparison of only ``lr`` or ``grad_norm`` fails and names
  the metrics each run has (:attr:`CompareResult.no_loss`).
- **Default metrics.** Without ``metrics``, every canonical metric (see :mod:`.names`) that both
  runs have is compared; other shared names are listed as not compared. **Cross-framework pairing:**
  when one run has ``lm_loss`` but no ``objective`` and the other ``objective`` but no ``lm_loss``
  (Megatron's ``lm loss`` against torchtitan/HF/MaxText/MindFormers ``loss``), the two are compared as
  one metric under the reference's name, and the result's ``notes`` say so (they agree when the
  objective holds no MTP or auxiliary term).
- **Missing steps.** Per metric, inside the window: ``missing_cand`` are the reference points the
  candidate lacks, ``missing_ref`` the candidate points the reference lacks (both reported). Rule
  ``missing_steps``: ``"span"`` (default) fails a metric when the candidate starts after or stops
  before the reference (a truncated or late-starting run): when the reference has a point at least one
  candidate logging interval (the median spacing of the candidate's points) before the candidate's
  first or after its last point; ``"all"`` fails it when the candidate lacks any reference point
  (Megatron's functional tests: a golden step absent from the run fails); ``"ignore"`` only reports.
  A candidate that runs longer than the reference never fails; a *live* candidate (its log ends with an
  incomplete line, :attr:`Run.live`) is compared as far as it got: with ``"span"`` the reference points
  after its end are reported, not failed.
- **Default tolerances** (:data:`DEFAULT_TOLERANCES`): ``lm_loss`` and ``objective`` rel 2e-4,
  ``mtp_<k>_loss`` rel 2e-3, load-balancing and router z-losses rel 2e-3, ``grad_norm`` rel 1e-2,
  ``lr`` rel 1e-5, ``tokens`` abs 0.5 (integers must be equal), any other metric rel 1e-3.
  Overrides: ``"lm_loss=1e-3,mtp_*_loss=rel:1e-3,grad_norm=abs:0.01,*=rel:5e-3"`` (bare number =
  relative; ``rel:a+abs:b`` for both; shell-style patterns; ``*`` = everything else).

Note that a log's printed precision bounds what can pass: Megatron prints losses with 7 significant
digits, older MaxText consoles with 3 decimals.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import numpy as np

from ..input_files import MAX_STEP
from ..options import ALIGNS, MISSING_STEPS, Align, MissingSteps, check_option
from ._series import Series
from .compare_result import CompareResult, MetricResult, describe_points, step_ranges
from .names import CANONICAL_METRICS, MTP_RE, default_canonical_name, is_canonical
from .readers import Run
from .tolerance import (
    DEFAULT_TOLERANCES,
    Tolerance,
    _normalize_tolerances,
    megatron_allowed_failures,
    parse_tolerances,
    tolerance_for,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "CompareInputError",
    "CompareResult",
    "MetricResult",
    "Tolerance",
    "compare_runs",
    "judge_points",
    "megatron_allowed_failures",
    "moving_average",
    "parse_tolerances",
    "describe_points",
    "step_ranges",
    "tolerance_for",
]


class CompareInputError(ValueError):
    """The two runs cannot be compared as asked (no shared metric, no overlapping steps, ...)."""


def moving_average(y: np.ndarray, w: int) -> np.ndarray:
    """Trailing moving average ``y'[i] = mean(y[max(0, i-w+1) .. i])``; NaN where the window holds a
    non-finite value."""
    if w < 1:
        raise ValueError(f"smooth must be >= 1, got {w}")
    y = np.asarray(y, dtype=np.float64)
    w = min(w, y.size)  # a window wider than the series averages from its start: the same numbers
    if w <= 1 or y.size == 0:
        return y.copy()
    finite = np.isfinite(y)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, y, 0.0))])
    cbad = np.concatenate([[0], np.cumsum(~finite)])
    hi = np.arange(1, y.size + 1)
    lo = np.maximum(hi - w, 0)
    out = (csum[hi] - csum[lo]) / (hi - lo)
    out[(cbad[hi] - cbad[lo]) > 0] = np.nan
    return out


Window = tuple[float | None, float | None]


def _points(run: Run, metric: str, align: str, offset: int, window: Window | None) -> tuple[np.ndarray, ...]:
    """``(x, step, value)`` arrays of one metric sorted by the alignment coordinate ``x``, inside the window.
    With ``align="samples"`` only the steps with a consumed-sample count are kept, and of several steps with
    one count the last (the module docstring)."""
    series = run.metrics[metric]
    if not isinstance(series, Series):  # a plain mapping assigned after the Run was built
        series = Series(sorted(series.items()))
    steps_a, values_a = series.arrays()
    # copies, not views: an array that exports its buffer cannot grow, and a live log's series still grows
    steps = np.frombuffer(steps_a, dtype=np.int64).copy() if len(steps_a) else np.zeros(0, dtype=np.int64)
    values = np.frombuffer(values_a, dtype=np.float64).copy() if len(values_a) else np.zeros(0, dtype=np.float64)
    if align == "step":
        x = (steps + offset).astype(np.float64)  # |step| < 2**53: exact
    else:
        samples = run.consumed_samples
        keep = np.fromiter((s in samples for s in steps_a), dtype=bool, count=len(steps_a))
        steps, values = steps[keep], values[keep]
        x = np.fromiter((samples[s] for s in steps.tolist()), dtype=np.float64, count=steps.size)
        order = np.argsort(x, kind="stable")
        x, steps, values = x[order], steps[order], values[order]
        last = np.append(x[1:] != x[:-1], True) if x.size else np.zeros(0, dtype=bool)
        x, steps, values = x[last], steps[last], values[last]
    if window is not None:
        lo, hi = window
        inside = np.ones(x.size, dtype=bool)
        if lo is not None:
            inside &= x >= lo
        if hi is not None:
            inside &= x <= hi
        x, steps, values = x[inside], steps[inside], values[inside]
    return x, steps, values


def _missing_violation(
    rule: str, ref_x: list[float], cand_x: list[float], missing: list[float], unit: str, cand_live: bool = False
) -> str | None:
    """Why the missing-steps ``rule`` fails for these points, or ``None`` (see the module docstring).

    With ``span`` a reference point counts as outside the candidate's span when it lies at least one
    candidate logging interval (the median spacing of its points) before its first or after its last point,
    so a candidate that logs less often is not mistaken for a truncated one. A live candidate (its log's last
    line was incomplete: still being written) has not reached the later reference points yet: with
    ``span`` they do not fail.
    """
    if not missing or rule == "ignore":
        return None
    if rule == "all":
        return f"the candidate lacks {describe_points(missing, 'reference ' + unit)} (--missing-steps all)"
    gaps = sorted(b - a for a, b in zip(cand_x, cand_x[1:]))
    spacing = gaps[len(gaps) // 2] if gaps else 0.0
    early = [x for x in missing if x <= cand_x[0] - spacing]
    late = [] if cand_live else [x for x in missing if x >= cand_x[-1] + spacing]
    parts = []
    if early:
        parts.append(f"starts at {unit} {cand_x[0]:g}, after the reference's first {unit} {ref_x[0]:g}")
    if late:
        parts.append(f"stops at {unit} {cand_x[-1]:g}, before the reference's last {unit} {ref_x[-1]:g}")
    if not parts:
        return None
    return (
        f"the candidate {' and '.join(parts)}; not compared: {describe_points(early + late, 'reference ' + unit)} "
        "(compare a part with --window, or --missing-steps ignore)"
    )


def judge_points(r: np.ndarray, c: np.ndarray, tol: Tolerance) -> tuple[np.ndarray, np.ndarray]:
    """Pass flags and relative differences of aligned (smoothed) points, the rule of the module docstring:
    ``ok = |c - r| <= abs + rel·|r|`` for finite pairs, two non-finite values agree when both are NaN or the
    same infinity; ``rel_diff = |c - r| / |r|`` (0 when equal, inf for ``r = 0 != c`` or a failing
    non-finite pair). The one point judgement of :func:`compare_runs` and of the live
    :class:`~lossparity.parity.guard.ParityGuard`."""
    r = np.asarray(r, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    finite = np.isfinite(r) & np.isfinite(c)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.abs(c - r)
        ok = np.where(finite, diff <= tol.bound(r), (np.isnan(r) & np.isnan(c)) | (r == c))
        rel = np.where(diff == 0, 0.0, diff / np.abs(r))
    rel = np.where(finite, rel, np.where(ok, 0.0, np.inf))
    return ok.astype(bool), rel


def _compare_metric(
    names: tuple[str, str],
    ref: Run,
    cand: Run,
    tol: Tolerance,
    align: str,
    window: Window | None,
    smooth: int,
    megatron_rule: bool,
    missing_rule: str,
) -> MetricResult | None:
    rx, rsteps, rvals = _points(ref, names[0], align, 0, window)
    cx, _, cvals = _points(cand, names[1], align, ref.step_base - cand.step_base, window)
    xs, ri, ci = np.intersect1d(rx, cx, assume_unique=True, return_indices=True)
    if not xs.size:
        return None
    steps = rsteps[ri]
    r = moving_average(rvals[ri], smooth)
    c = moving_average(cvals[ci], smooth)
    ok, rel = judge_points(r, c, tol)
    missing_cand = np.setdiff1d(rx, cx, assume_unique=True).tolist()
    missing_ref = np.setdiff1d(cx, rx, assume_unique=True).tolist()
    unit = "step" if align == "step" else "sample count"
    return MetricResult(
        metric=names[0],
        cand_metric=names[1],
        tolerance=tol,
        steps=steps,
        x=xs,
        ref=r,
        cand=c,
        ok=ok.astype(bool),
        rel_diff=rel,
        allowed_failures=megatron_allowed_failures(int(xs.size)) if megatron_rule else 0,
        missing_cand=missing_cand,
        missing_ref=missing_ref,
        missing_violation=_missing_violation(missing_rule, rx.tolist(), cx.tolist(), missing_cand, unit, cand.live),
    )


def _units(align: str) -> str:
    return "steps" if align == "step" else "sample counts"


def _metric_order(name: str) -> tuple[int, int, str]:
    m = MTP_RE.match(name)
    if m:
        return (1, int(m.group(1)), name)
    if name in CANONICAL_METRICS:
        return (0 if name in ("lm_loss", "objective") else 2, CANONICAL_METRICS.index(name), name)
    return (3, 0, name)


_AUX_HINT = ("mtp_", "load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


def _loss_pairing(ref: Run, cand: Run) -> tuple[tuple[str, str], str] | None:
    """``((ref name, cand name), note)`` when one run has only ``lm_loss`` and the other only ``objective``."""
    for a, b in (("lm_loss", "objective"), ("objective", "lm_loss")):
        if a in ref.metrics and b not in ref.metrics and b in cand.metrics and a not in cand.metrics:
            lm_run = ref if a == "lm_loss" else cand
            raw_r, raw_c = ref.raw_names.get(a, a), cand.raw_names.get(b, b)
            note = (
                f"paired the reference's {a} ({raw_r!r}) with the candidate's {b} ({raw_c!r}): one log has "
                "only the LM loss, the other only its objective; they agree when the objective holds no MTP or "
                "auxiliary term"
            )
            extra = sorted(m for m in lm_run.metrics if m.startswith(_AUX_HINT))
            if extra:
                note += f" (the LM-loss log also has {', '.join(extra)}: check that the objective excludes them)"
            return (a, b), note
    return None


LOSS_METRICS = ("lm_loss", "objective")


def _no_loss_reason(ref: Run, cand: Run) -> str:
    """Why no loss was compared: the metrics of each run, and the hint to map an unrecognized loss name."""

    def has(run: Run) -> str:
        names = ", ".join(sorted(run.metrics)) or "no metric"
        losses = [m for m in LOSS_METRICS if m in run.metrics]
        return f"{names}" + ("" if losses else " (no lm_loss or objective)")

    unknown = sorted({m for run in (ref, cand) for m in run.metrics if "loss" in m and not is_canonical(m)})
    hint = (
        f"; if {', '.join(repr(u) for u in unknown)} is a loss, map it, e.g. --name-map {unknown[0]}=objective"
        if unknown
        else ""
    )
    return f"no loss compared: the reference has {has(ref)}; the candidate has {has(cand)}{hint}"


def _default_pairs(ref: Run, cand: Run) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """Default ``(ref name, cand name)`` pairs, the shared non-canonical names, and pairing notes."""
    shared = set(ref.metrics) & set(cand.metrics)
    pairs = [(m, m) for m in sorted((m for m in shared if is_canonical(m)), key=_metric_order)]
    notes = []
    pairing = _loss_pairing(ref, cand)
    if pairing is not None:
        pairs.insert(0, pairing[0])
        notes.append(pairing[1])
    return pairs, sorted(m for m in shared if not is_canonical(m)), notes


def _requested_pairs(ref: Run, cand: Run, metrics: Sequence[str]) -> list[tuple[str, str]]:
    wanted = list(dict.fromkeys(metrics))
    for m in wanted:
        missing = [role for role, run in (("ref", ref), ("cand", cand)) if m not in run.metrics]
        if missing:
            raise CompareInputError(
                f"metrics: {m!r} is not in the {' and '.join(missing)} run; available: ref has "
                f"{', '.join(sorted(ref.metrics)) or 'none'}; cand has {', '.join(sorted(cand.metrics)) or 'none'}"
            )
        for role, run in (("ref", ref), ("cand", cand)):
            if m in run.unreadable:
                raise CompareInputError(
                    f"metrics: {m!r} of the {role} run {run.source} has values that are not one number "
                    f"(first at {run.unreadable[m]}); they cannot be compared"
                )
    return [(m, m) for m in wanted]


def _check_tolerance_names(overrides: Mapping[str, Tolerance], names: Sequence[str]) -> None:
    """Every override other than ``*`` must match a compared metric (a typo must not pass silently)."""
    for key in overrides:
        if key != "*" and not any(key == n or fnmatch.fnmatchcase(n, key) for n in names):
            canonical = default_canonical_name(key)
            hint = f" (the log name {key!r} is {canonical!r} here)" if canonical != key and canonical in names else ""
            raise CompareInputError(
                f"tolerances: {key!r} matches no compared metric{hint}; compared: {', '.join(names)}"
            )


def _check_arguments(align: str, smooth: int, window: Window | None, missing_steps: str) -> Window | None:
    try:
        check_option("align", align, ALIGNS)
        check_option("missing_steps", missing_steps, MISSING_STEPS)
    except ValueError as e:
        raise CompareInputError(str(e)) from None
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise CompareInputError(f"smooth must be an integer >= 1, got {smooth!r}")
    if window is None:
        return None
    if len(window) != 2:
        raise CompareInputError(f"window must be (start, end), got {window!r}")
    lo, hi = window
    if lo is not None and hi is not None and lo > hi:
        raise CompareInputError(f"window: start {lo} is after end {hi}")
    return (lo, hi)


def _check_samples(ref: Run, cand: Run) -> None:
    for role, run in (("ref", ref), ("cand", cand)):
        if not run.consumed_samples:
            raise CompareInputError(
                f"align='samples': {role} run {run.source} has no consumed samples; "
                f"give its global batch size (Run.with_constant_batch_size, --{role}-gbs)"
            )


def _check_step_bases(ref: Run, cand: Run) -> None:
    """The two step bases as a pair: the candidate's steps moved onto the reference's numbering (``step +
    ref.step_base - cand.step_base``) stay exact (``|x| < 2**53``), or the comparison is refused naming both
    logs and bases (two bases accepted one by one may still be ``2**54`` apart)."""
    offset = ref.step_base - cand.step_base
    ends = [x for series in cand.metrics.values() if series for x in _first_last(series)]
    if abs(offset) >= MAX_STEP or any(abs(x + offset) >= MAX_STEP for x in ends):
        raise CompareInputError(
            f"step bases {ref.step_base} ({ref.source}) and {cand.step_base} ({cand.source}) move the candidate's "
            f"steps by {offset}, beyond the exact steps (|step| < 2**53); check --ref-step-base/--cand-step-base"
        )


def _first_last(series: Series) -> tuple[int, int]:
    steps = series.arrays()[0] if isinstance(series, Series) else sorted(series)
    return steps[0], steps[-1]


def compare_runs(
    ref: Run,
    cand: Run,
    *,
    tolerances: Mapping[str, Tolerance | float | str] | str | None = None,
    metrics: Sequence[str] | None = None,
    window: Window | None = None,
    smooth: int = 1,
    megatron_rule: bool = False,
    align: Align = "step",
    missing_steps: MissingSteps = "span",
) -> CompareResult:
    """Compare ``cand`` against ``ref`` metric by metric (semantics in this module's docstring).

    ``tolerances`` overrides :data:`DEFAULT_TOLERANCES` (a mapping or a spec string for
    :func:`parse_tolerances`); ``metrics`` restricts the comparison (each must exist in both runs
    and overlap); ``window`` is an inclusive ``(start, end)`` on the alignment coordinate;
    ``missing_steps`` is the rule for reference points the candidate lacks (``span``, ``all``, ``ignore``).
    Raises :class:`CompareInputError` for unusable input: bad ``smooth``/``align``/``window``/
    ``missing_steps``, a requested metric missing from a run, a tolerance naming no compared metric, no
    shared metric, no overlapping steps, or ``align="samples"`` without consumed samples.
    """
    window = _check_arguments(align, smooth, window, missing_steps)
    if align == "step":
        _check_step_bases(ref, cand)
    try:
        overrides = _normalize_tolerances(tolerances)
    except ValueError as e:
        raise CompareInputError(str(e)) from None
    if align == "samples":
        _check_samples(ref, cand)
    notes: list[str] = []
    not_compared: list[str] = []
    if metrics is not None:
        pairs = _requested_pairs(ref, cand, metrics)
    else:
        pairs, not_compared, notes = _default_pairs(ref, cand)
        if not pairs:
            raise CompareInputError(
                f"no shared canonical metric (ref has {sorted(ref.metrics)}, cand has "
                f"{sorted(cand.metrics)}); map names with a name map or name metrics explicitly"
            )
    _check_tolerance_names(overrides, [p[0] for p in pairs])
    result = CompareResult(
        ref=ref,
        cand=cand,
        align=align,
        window=window,
        smooth=smooth,
        megatron_rule=megatron_rule,
        not_compared=not_compared,
        missing_steps=missing_steps,
        notes=notes,
    )
    where = " inside the window" if window else ""
    for names in pairs:
        mr = _compare_metric(
            names, ref, cand, tolerance_for(names[0], overrides), align, window, smooth, megatron_rule, missing_steps
        )
        if mr is not None:
            result.metrics[names[0]] = mr
        elif metrics is not None:
            raise CompareInputError(f"metrics: {names[0]!r} has no overlapping {_units(align)} in the two runs{where}")
        else:
            result.skipped[names[0]] = f"no overlapping {_units(align)}{where}"
    if cand.live and missing_steps == "span":
        result.notes.append(
            "the candidate log ends with an incomplete line (still being written): reference "
            "steps after its last complete step are reported, not failed"
        )
    if metrics is None and not any(p in result.metrics for p in LOSS_METRICS):
        result.no_loss = _no_loss_reason(ref, cand)
    elif metrics is not None and not any(p in result.metrics for p in LOSS_METRICS):
        result.notes.append(f"no loss among the requested metrics: the verdict covers {', '.join(result.metrics)} only")
    if not result.metrics:
        raise CompareInputError(
            f"no overlapping {_units(align)} for any shared metric "
            f"({', '.join(p[0] for p in pairs)}){f' inside the window {window}' if window else ''}"
        )
    return result
