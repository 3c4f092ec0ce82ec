"""Live parity guard: compare a run against a reference log step by step while it trains.

``guard = ParityGuard("golden.json")`` reads the reference once (any format :func:`read_log` reads,
detected); then the training loop calls ``guard.update(step, {name: value})`` at every logged step and gets a
:class:`Verdict`. The rules are those of :mod:`lossparity.parity.compare`, applied to the points seen so far:

- **Names and pairing.** Candidate names go through the same name table (``loss`` is ``objective``,
  ``learning_rate`` is ``lr``, ...) and the same default pairing (every shared canonical metric; ``lm_loss``
  with ``objective`` when each side has only one of them); ``metrics=`` restricts it.
- **Alignment.** Candidate step ``s`` meets reference step ``s - step_base + ref.step_base``.
- **Point judgement.** :func:`~lossparity.parity.compare.judge_points` on the (trailing ``smooth``-point
  moving average of the) aligned values: ``|c - r| <= abs + rel·|r|`` with the tolerance of
  :func:`~lossparity.parity.compare.tolerance_for` (``tol`` overrides the defaults).
- **Violation.** A metric violates at the point where its failing points exceed the allowed number: 0, or
  with ``rule="megatron"`` Megatron's ``min(max(n // 100, 1), 50)`` for ``n`` = the reference's points of
  that metric (the most the run can compare, so a live stop implies a failing offline verdict). With
  ``missing_steps="all"`` a reference step the candidate passes without logging it violates at once.
  ``missing_steps="span"`` (a candidate that starts late or stops early) needs the whole run: :meth:`finish`
  judges it.
- **Restarts.** A step below the last one (a resumed job) discards the points at steps ``>=`` it, as the log
  readers do.

The first violation is kept (:attr:`ParityGuard.violation`), written to ``parity_report.md`` and
``parity_report.json`` in ``report_dir`` (:mod:`.violation`), and with ``on_violation="stop"`` every later
verdict says ``stop``; ``"warn"`` only reports. :meth:`finish` returns :func:`compare_runs` of the reference
and everything the guard received: the offline verdict of the same points (a test replays real logs
through :meth:`update` and checks that the first violation and the verdict are those of ``compare``).

Multi-rank: the values a training loop logs come out of its logging collective (identical on every rank),
so a guard on each rank reaches the same decision at the same step without another collective; only the
rank with ``write_report=True`` writes files. Nothing is read from disk after the constructor.
"""

from __future__ import annotations

import bisect
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..options import MISSING_STEPS, MissingSteps, check_option
from ._record import Recorder
from .compare import CompareInputError, CompareResult, _default_pairs, compare_runs, judge_points, moving_average
from .names import default_canonical_name, is_canonical
from .readers import Run, read_log
from .tolerance import Tolerance, _normalize_tolerances, megatron_allowed_failures, tolerance_for
from .violation import Violation, violation_from_result, write_violation_report

__all__ = ["ON_VIOLATION", "ParityGuard", "PointCheck", "Verdict"]

ON_VIOLATION = ("stop", "warn")
RULES = (None, "megatron")
# log entries that are not training metrics of the step (HF's end-of-training summary, evaluations)
_NOT_TRAINING = ("eval_", "predict_", "test_")


@dataclass(frozen=True)
class PointCheck:
    """One compared point: reference step, metric (reference name), both (smoothed) values, the relative
    difference ``|c - r| / |r|``, whether it passes, and its tolerance."""

    step: int
    metric: str
    ref: float
    cand: float
    rel_diff: float
    ok: bool
    tolerance: Tolerance

    def text(self) -> str:
        return (
            f"{self.metric} {self.cand:.7g} vs {self.ref:.7g} (rel {self.rel_diff:.2e}, tol {self.tolerance}) "
            f"{'ok' if self.ok else 'FAIL'}"
        )


@dataclass(frozen=True)
class Verdict:
    """What :meth:`ParityGuard.update` says about one step.

    ``checks``: the points compared at this step; ``violation``: the run's first violation so far (``None``:
    parity so far); ``new``: this step produced it; ``stop``: the caller must stop (a violation with
    ``on_violation="stop"``).
    """

    step: int
    checks: tuple[PointCheck, ...]
    violation: Violation | None
    new: bool
    stop: bool

    @property
    def ok(self) -> bool:
        return self.violation is None

    def line(self) -> str:
        """One printable line: ``step 4: objective 2.07 vs 2.01 (rel 2.9e-02, tol rel 0.0002) FAIL``."""
        if self.new and self.violation is not None:
            return f"step {self.step}: VIOLATION {self.violation.detail()}"
        if not self.checks:
            return f"step {self.step}: no reference point"
        # the first metric (the loss) and every failing point (allowed failures under rule="megatron")
        shown = [c for i, c in enumerate(self.checks) if i == 0 or not c.ok or len(self.checks) <= 2]
        more = len(self.checks) - len(shown)
        body = "; ".join(c.text() for c in shown) + (f"; {more} more metrics ok" if more else "")
        return f"step {self.step}: {body}"


class _Series:
    """The compared points of one metric pair, in step order: ``x`` (reference step), the candidate step,
    raw values, smoothed values and pass flags."""

    def __init__(self, ref_name: str, cand_name: str, tol: Tolerance, allowed: int, ref_x: list[float]) -> None:
        self.ref_name, self.cand_name, self.tol, self.allowed = ref_name, cand_name, tol, allowed
        self.ref_x = ref_x  # sorted reference steps of the metric
        self.x: list[float] = []
        self.cand_step: list[int] = []
        self.r: list[float] = []
        self.c: list[float] = []
        self.rs: list[float] = []
        self.cs: list[float] = []
        self.ok: list[bool] = []
        self.last_cand_x = -math.inf  # last aligned candidate step of the metric (shared with the reference or not)

    def truncate(self, x: float) -> None:
        """Forget the points at ``x`` and later (a restart, or a step logged again)."""
        k = bisect.bisect_left(self.x, x)
        for arr in (self.x, self.cand_step, self.r, self.c, self.rs, self.cs, self.ok):
            del arr[k:]
        self.last_cand_x = self.x[-1] if self.x else -math.inf

    @property
    def failures(self) -> int:
        return len(self.ok) - sum(self.ok)


class ParityGuard:
    """Compare a run against a reference log as it trains (module docstring).

    Args:
        reference: path of the reference log (file or TensorBoard directory) or a :class:`Run`.
        metrics: reference metric names to compare (default: every shared canonical metric, paired as
            ``compare`` pairs them).
        tol: tolerance overrides, as ``compare``'s ``--tol`` (``"lm_loss=1e-3,grad_norm=abs:0.01"``) or a
            mapping.
        rule: ``None`` (no failing point allowed) or ``"megatron"`` (Megatron's functional-test allowance).
        missing_steps: ``"span"`` (judged by :meth:`finish`), ``"all"`` (a skipped reference step violates
            at once) or ``"ignore"``.
        on_violation: ``"stop"`` (verdicts say ``stop`` from the first violation on) or ``"warn"``.
        smooth: trailing moving-average width of both series (as ``compare --smooth``).
        name_map: ``{raw: canonical}`` for both the reference log and the candidate's names.
        ref_format: format of the reference log (default: detected).
        step_base: the number the candidate gives its first optimizer step (1: HF, Megatron, torchtitan,
            lossparity; 0: MaxText).
        report_dir: where the report files go on the first violation (``None``: not written).
        write_report: ``False`` on every rank but one.
        source: the candidate's name in reports.
        tail: how many compared points of both curves the report lists.

    Raises ``ValueError`` (a :class:`CompareInputError` for comparison settings) naming the argument, before
    anything is read; a :class:`~lossparity.parity.readers.LogParseError` for an unreadable reference.
    """

    def __init__(
        self,
        reference: str | os.PathLike[str] | Run,
        *,
        metrics: Sequence[str] | None = None,
        tol: Mapping[str, Tolerance | float | str] | str | None = None,
        rule: str | None = None,
        missing_steps: MissingSteps = "span",
        on_violation: str = "stop",
        smooth: int = 1,
        name_map: Mapping[str, str] | None = None,
        ref_format: str | None = None,
        step_base: int = 1,
        report_dir: str | os.PathLike[str] | None = ".",
        write_report: bool = True,
        source: str = "live run",
        tail: int = 5,
    ) -> None:
        if on_violation not in ON_VIOLATION:
            raise ValueError(f"on_violation: expected one of {', '.join(ON_VIOLATION)}, got {on_violation!r}")
        if rule not in RULES:
            raise ValueError(f"rule: expected None or 'megatron', got {rule!r}")
        try:
            self.missing_steps: MissingSteps = check_option("missing_steps", missing_steps, MISSING_STEPS)
            self._overrides = _normalize_tolerances(tol)
        except ValueError as e:
            raise CompareInputError(str(e)) from None
        for name, v, low in (("smooth", smooth, 1), ("tail", tail, 1), ("step_base", step_base, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {v!r}")
        if metrics is not None and (isinstance(metrics, str) or not metrics):
            raise ValueError(f"metrics: expected a non-empty list of metric names, got {metrics!r}")
        self.on_violation, self.rule, self.smooth, self.tail = on_violation, rule, smooth, tail
        self.metrics = list(dict.fromkeys(metrics)) if metrics is not None else None
        self.report_dir = report_dir
        self.write_report = write_report
        self.ref = reference if isinstance(reference, Run) else read_log(reference, fmt=ref_format, name_map=name_map)
        self._check_names()
        self._rec = Recorder(source, "live", name_map, step_base)
        self._series: dict[str, _Series] = {}
        self._pair_key: frozenset[str] | None = None
        self._last_step: int | None = None
        self.violation: Violation | None = None
        self.report_files: tuple[str, str] | None = None
        self.notes: list[str] = []

    # ------------------------------------------------------------------ setup
    def _check_names(self) -> None:
        """Requested metrics must exist in the reference; every tolerance override must name one of its
        metrics (a typo must not pass silently), as ``compare`` requires."""
        have = sorted(self.ref.metrics)
        for m in self.metrics or []:
            if m not in self.ref.metrics:
                raise CompareInputError(
                    f"metrics: {m!r} is not in the reference {self.ref.source}; it has {', '.join(have)}"
                )
        names = self.metrics or have
        for key in self._overrides:
            if key != "*" and not any(key == n or _match(n, key) for n in names):
                canonical = default_canonical_name(key)
                hint = (
                    f" (the log name {key!r} is {canonical!r} here)" if canonical != key and canonical in names else ""
                )
                raise CompareInputError(
                    f"tolerances: {key!r} matches no reference metric{hint}; it has {', '.join(names)}"
                )

    @property
    def name_map(self) -> Mapping[str, str] | None:
        """The user name map applied to both logs."""
        return self._rec.name_map

    @property
    def candidate(self) -> Run:
        """Everything received so far, as a :class:`Run` (the restart rule applied)."""
        return self._rec.run()

    def _pairs(self) -> list[tuple[str, str]]:
        cand = Run(source=self._rec.path, format="live", metrics=self._rec.metrics, step_base=self._rec.step_base)
        if self.metrics is not None:
            return [(m, m) for m in self.metrics if m in cand.metrics]
        pairs, _, notes = _default_pairs(self.ref, cand)
        for n in notes:
            if n not in self.notes:
                self.notes.append(n)
        return pairs

    def _repair(self) -> list[tuple[str, str]]:
        """(Re)build the compared series when the candidate's metric names change; returns new pairs, whose
        points so far are then compared."""
        fresh = []
        pairs = self._pairs()
        for gone in set(self._series) - {r for r, _ in pairs}:  # a pairing the new names replace
            del self._series[gone]
        for rname, cname in pairs:
            s = self._series.get(rname)
            if s is not None and s.cand_name == cname:
                continue
            ref_x = sorted(float(x) for x in self.ref.metrics[rname])
            allowed = megatron_allowed_failures(len(ref_x)) if self.rule == "megatron" else 0
            self._series[rname] = _Series(rname, cname, tolerance_for(rname, self._overrides), allowed, ref_x)
            fresh.append((rname, cname))
        return fresh

    # ------------------------------------------------------------------ per step
    def _clean(self, step: object, values: Mapping[str, object]) -> tuple[int, dict[str, float]]:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or int(step) < 0:
            raise ValueError(f"step: expected an integer >= 0, got {step!r}")
        if not isinstance(values, Mapping):
            raise ValueError(f"values: expected a mapping of metric name to number, got {type(values).__name__}")
        out: dict[str, float] = {}
        for raw, v in values.items():
            if not isinstance(raw, str) or raw.startswith(_NOT_TRAINING) or v is None:
                continue
            number = _as_float(v)
            if number is None:
                name = default_canonical_name(raw)
                if is_canonical(name) or "loss" in raw.lower():
                    raise ValueError(f"values[{raw!r}] at step {step}: expected a number, got {v!r}")
                continue  # a label (HF's "epoch" is a number; a run name is not a metric)
            out[raw] = number
        return int(step), out

    def update(self, step: int, values: Mapping[str, object]) -> Verdict:
        """Record the candidate's ``values`` of ``step`` (log names, numbers; other entries such as labels are
        ignored) and compare every paired metric that has a reference point at that step.

        Returns the :class:`Verdict`; on the first violation writes the report (``report_dir``). Raises
        ``ValueError`` naming ``step`` or ``values[name]`` for bad input (nothing recorded), and
        :class:`CompareInputError` when, after the first step, no candidate metric pairs with the reference.
        """
        step, clean = self._clean(step, values)
        names = {self._rec.name(raw) for raw in clean}
        if self._last_step is not None and step <= self._last_step:
            # a restart drops every later point; a step logged again replaces the metrics it gives
            x0 = float(step - self._rec.step_base + self.ref.step_base)
            for s in self._series.values():
                if step < self._last_step or s.cand_name in names:
                    s.truncate(x0)
        self._rec.begin(step)
        for raw, v in clean.items():
            self._rec.put(raw, step, v)
        self._last_step = step
        checks: list[PointCheck] = []
        first_new: Violation | None = None
        key = frozenset(self._rec.metrics)
        if key != self._pair_key:
            self._pair_key = key
            for rname, _ in self._repair():  # a new pairing: its earlier points are compared now
                for s_prev in sorted(self._rec.metrics.get(self._series[rname].cand_name, {})):
                    if s_prev < step:
                        found = self._add_point(self._series[rname], s_prev, [])
                        first_new = first_new or found
        if not self._series:
            raise CompareInputError(
                f"values: no metric of step {step} pairs with the reference (the reference has "
                f"{', '.join(sorted(self.ref.metrics))}; step {step} gave {', '.join(sorted(clean)) or 'nothing'}); "
                "name them with name_map or metrics"
            )
        for s in self._series.values():
            if step in self._rec.metrics.get(s.cand_name, {}):
                found = self._add_point(s, step, checks)
                first_new = first_new or found
        new = first_new is not None and self.violation is None
        if new:
            self.violation = first_new
            self._write()
        return Verdict(
            step, tuple(checks), self.violation, new, self.violation is not None and self.on_violation == "stop"
        )

    def _add_point(self, s: _Series, step: int, checks: list[PointCheck]) -> Violation | None:
        """Compare the candidate's value of ``s`` at ``step``; return a violation it causes, if any."""
        x = float(step - self._rec.step_base + self.ref.step_base)
        missed: list[float] = []
        if self.missing_steps == "all":
            lo = bisect.bisect_right(s.ref_x, s.last_cand_x)
            missed = [p for p in s.ref_x[lo : bisect.bisect_left(s.ref_x, x)]]
        s.last_cand_x = x
        ref_series = self.ref.metrics[s.ref_name]
        found: Violation | None = None
        if missed:
            found = self._missing(s, missed, step)
        if int(x) not in ref_series:
            return found
        c = self._rec.metrics[s.cand_name][step]
        r = ref_series[int(x)]
        s.x.append(x)
        s.cand_step.append(step)
        s.r.append(r)
        s.c.append(c)
        rs, cs = _smoothed_last(s.r, self.smooth), _smoothed_last(s.c, self.smooth)
        ok_a, rel_a = judge_points(np.array([rs]), np.array([cs]), s.tol)
        ok, rel = bool(ok_a[0]), float(rel_a[0])
        s.rs.append(rs)
        s.cs.append(cs)
        s.ok.append(ok)
        checks.append(PointCheck(int(x), s.ref_name, rs, cs, rel, ok, s.tol))
        if found is None and not ok and s.failures == s.allowed + 1:
            found = self._tolerance(s, rel)
        return found

    def _names(self, s: _Series) -> tuple[str, str]:
        return (self.ref.raw_names.get(s.ref_name, s.ref_name), self._rec.raw_names.get(s.cand_name, s.cand_name))

    def _tail(self, s: _Series) -> tuple[tuple[int, float, float], ...]:
        k = max(0, len(s.x) - self.tail)
        return tuple((int(x), r, c) for x, r, c in zip(s.x[k:], s.rs[k:], s.cs[k:]))

    def _tolerance(self, s: _Series, rel: float) -> Violation:
        ref_name, cand_name = self._names(s)
        return Violation(
            step=int(s.x[-1]),
            cand_step=s.cand_step[-1],
            metric=s.ref_name,
            cand_metric=s.cand_name,
            ref_name=ref_name,
            cand_name=cand_name,
            ref=s.rs[-1],
            cand=s.cs[-1],
            rel_diff=rel,
            tolerance=s.tol,
            kind="tolerance",
            reason=f"outside the tolerance {s.tol}",
            failures=s.failures,
            allowed=s.allowed,
            tail=self._tail(s),
        )

    def _missing(self, s: _Series, missed: list[float], step: int) -> Violation:
        from .compare import step_ranges

        ref_name, cand_name = self._names(s)
        return Violation(
            step=int(missed[0]),
            cand_step=int(missed[0]) - self.ref.step_base + self._rec.step_base,
            metric=s.ref_name,
            cand_metric=s.cand_name,
            ref_name=ref_name,
            cand_name=cand_name,
            ref=None,
            cand=None,
            rel_diff=None,
            tolerance=s.tol,
            kind="missing_steps",
            reason=f"the candidate went to step {step} without reference steps {step_ranges(missed)} "
            "(missing_steps='all')",
            tail=self._tail(s),
        )

    def _write(self) -> None:
        if self.violation is None or self.report_dir is None or not self.write_report:
            return
        md, js = write_violation_report(
            self.violation,
            self.report_dir,
            ref_source=self.ref.source,
            cand_source=self._rec.path,
            on_violation=self.on_violation,
        )
        self.report_files = (str(md), str(js))

    # ------------------------------------------------------------------ end of run
    @property
    def covered(self) -> bool:
        """Every compared metric has reached the reference's last point of it."""
        return bool(self._series) and all(s.x and s.last_cand_x >= s.ref_x[-1] for s in self._series.values())

    def finish(self, live: bool = False) -> CompareResult:
        """The offline verdict of everything received: :func:`compare_runs` (same options) of the reference
        and :attr:`candidate`. When it fails and no violation was found live (a ``span`` violation), its first
        violation becomes :attr:`violation` and its report is written. ``live``: the run goes on (judged up
        to a chosen step): reference steps after its last one are not missing, as for a log whose last line
        is incomplete. Raises :class:`CompareInputError` as ``compare`` does (nothing shared, no overlapping
        steps)."""
        cand = self.candidate
        cand.live = live
        result = compare_runs(
            self.ref,
            cand,
            tolerances=self._overrides or None,
            metrics=self.metrics,
            smooth=self.smooth,
            megatron_rule=self.rule == "megatron",
            missing_steps=self.missing_steps,
        )
        if not result.passed and self.violation is None:
            self.violation = violation_from_result(result, self.tail)
            self._write()
        return result


def _match(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


def _smoothed_last(values: list[float], w: int) -> float:
    """The last element of :func:`~lossparity.parity.compare.moving_average` of ``values`` (computed by it,
    so that live and offline smoothing agree to the bit)."""
    if w == 1:
        return values[-1]
    return float(moving_average(np.asarray(values, dtype=np.float64), w)[-1])


def _as_float(v: object) -> float | None:
    """A logged number as a float: Python and NumPy numbers, 0-dim arrays/tensors (already on the host in a
    log); ``None`` for anything else (bools and strings included)."""
    if isinstance(v, bool) or isinstance(v, (str, bytes)):
        return None
    if isinstance(v, numbers.Real):
        return float(v)
    shape = getattr(v, "shape", None)
    if shape is not None and tuple(shape) == () and hasattr(v, "__float__"):
        return float(v)  # type: ignore[arg-type]
    return None
