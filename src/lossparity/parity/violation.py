"""The first parity violation of a run and its report files (``parity_report.md``, ``parity_report.json``).

Written by the live :class:`~lossparity.parity.guard.ParityGuard` at the first violating step and by
``lossparity compare --report`` for a failing offline comparison, so both say the same things: the first
failing step (reference numbering), the metric (canonical name and each log's own name), both values, the
difference ``c - r`` and the relative difference ``|c - r| / |r|``, the tolerance, the number of failing
points against the allowed number, and the last few compared points of both curves up to that step.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from .compare_result import CompareResult, MetricResult, _num
from .tolerance import Tolerance

__all__ = ["REPORT_JSON", "REPORT_MD", "Violation", "violation_from_result", "write_violation_report"]

REPORT_MD = "parity_report.md"
REPORT_JSON = "parity_report.json"


@dataclass(frozen=True)
class Violation:
    """The first violation of a comparison.

    ``step``: reference step; ``cand_step``: the candidate's own number of that step; ``metric``: canonical
    name in the reference (``cand_metric`` in the candidate); ``ref_name``/``cand_name``: the names the logs
    use; ``ref``/``cand``: the compared values (``None`` for a missing-steps violation); ``rel_diff``:
    ``|c - r| / |r|``; ``kind``: ``"tolerance"`` (a point outside its tolerance, beyond the allowed number of
    failing points) or ``"missing_steps"``; ``tail``: the last compared ``(ref step, ref, cand)`` points up to
    ``step``; ``reason``: one sentence.
    """

    step: int
    cand_step: int
    metric: str
    cand_metric: str
    ref_name: str
    cand_name: str
    ref: float | None
    cand: float | None
    rel_diff: float | None
    tolerance: Tolerance
    kind: str
    reason: str
    failures: int = 1
    allowed: int = 0
    tail: tuple[tuple[int, float, float], ...] = field(default_factory=tuple)

    @property
    def names(self) -> str:
        """``objective (logged as 'loss'; reference 'lm loss')``: the canonical name and the logs' own names."""
        label = self.metric if self.metric == self.cand_metric else f"{self.metric}/{self.cand_metric}"
        parts = [f"logged as '{self.cand_name}'"] if self.cand_name != label else []
        parts += [f"reference '{self.ref_name}'"] if self.ref_name not in (label, self.cand_name) else []
        return f"{label} ({'; '.join(parts)})" if parts else label

    def detail(self) -> str:
        """The violation without its step: metric, both values, the difference and the tolerance (or the
        missing steps)."""
        if self.ref is None or self.cand is None:
            return f"{self.names}: {self.reason}"
        return (
            f"{self.names} = {self.cand:.7g}, reference {self.ref:.7g}: difference {self.cand - self.ref:+.4g} "
            f"(relative {_rel_text(self.rel_diff)}) exceeds the tolerance {self.tolerance}"
            + (f" ({self.failures} failing points > {self.allowed} allowed)" if self.allowed else "")
        )

    def message(self) -> str:
        """One line: ``step N: <detail>``."""
        return f"step {self.step}: {self.detail()}"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (non-finite numbers as the strings ``nan``/``inf``/``-inf``)."""

        def num(v: float | None) -> float | str | None:
            return None if v is None else _num(v)

        return {
            "step": self.step,
            "cand_step": self.cand_step,
            "metric": self.metric,
            "cand_metric": self.cand_metric,
            "ref_name": self.ref_name,
            "cand_name": self.cand_name,
            "ref": num(self.ref),
            "cand": num(self.cand),
            "difference": num(None if self.ref is None or self.cand is None else self.cand - self.ref),
            "rel_diff": num(self.rel_diff),
            "tolerance": {"rel": self.tolerance.rel, "abs": self.tolerance.abs},
            "kind": self.kind,
            "reason": self.reason,
            "failures": self.failures,
            "allowed_failures": self.allowed,
            "message": self.message(),
            "last_steps": [{"step": s, "ref": _num(r), "cand": _num(c)} for s, r, c in self.tail],
        }


def _rel_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}" if math.isfinite(v) else str(v)


def violation_from_result(result: CompareResult, tail: int = 5) -> Violation | None:
    """The first violation of an offline :class:`CompareResult`: the failing metric whose first failing point
    (beyond the allowed number of failures) comes first; a missing-steps violation counts at the reference's
    first missing step. ``None`` when the result passes."""
    found: list[tuple[float, Violation]] = []
    for m in result.violations:
        v = _metric_violation(m, result, tail)
        if v is not None:
            found.append((v.step, v))
    return min(found, key=lambda t: t[0])[1] if found else None


def _metric_violation(m: MetricResult, result: CompareResult, tail: int) -> Violation | None:
    ref_name = result.ref.raw_names.get(m.metric, m.metric)
    cand_name = result.cand.raw_names.get(m.cand_metric, m.cand_metric)
    offset = result.cand.step_base - result.ref.step_base
    bad = [i for i in range(m.n_compared) if not m.ok[i]]
    if len(bad) > m.allowed_failures:
        i = bad[m.allowed_failures]  # the point at which the failures exceed what the rule allows
        step = int(m.steps[i])
        lo = max(0, i - tail + 1)
        return Violation(
            step=step,
            cand_step=step + offset,
            metric=m.metric,
            cand_metric=m.cand_metric,
            ref_name=ref_name,
            cand_name=cand_name,
            ref=float(m.ref[i]),
            cand=float(m.cand[i]),
            rel_diff=float(m.rel_diff[i]),
            tolerance=m.tolerance,
            kind="tolerance",
            reason=f"outside the tolerance {m.tolerance}",
            failures=m.allowed_failures + 1,
            allowed=m.allowed_failures,
            tail=tuple((int(m.steps[j]), float(m.ref[j]), float(m.cand[j])) for j in range(lo, i + 1)),
        )
    if m.missing_violation is None:
        return None
    first = int(min(m.missing_cand)) if m.missing_cand else int(m.steps[-1])
    return Violation(
        step=first,
        cand_step=first + offset,
        metric=m.metric,
        cand_metric=m.cand_metric,
        ref_name=ref_name,
        cand_name=cand_name,
        ref=None,
        cand=None,
        rel_diff=None,
        tolerance=m.tolerance,
        kind="missing_steps",
        reason=m.missing_violation,
        tail=tuple(
            (int(m.steps[j]), float(m.ref[j]), float(m.cand[j]))
            for j in range(max(0, m.n_compared - tail), m.n_compared)
        ),
    )


def _markdown(v: Violation, ref_source: str, cand_source: str, on_violation: str) -> str:
    diff = "-" if v.ref is None or v.cand is None else f"{v.cand - v.ref:+.6g}"
    rows = [
        ("first failing step", f"{v.step} (candidate step {v.cand_step})"),
        ("metric", f"`{v.metric}`" + (f" / `{v.cand_metric}`" if v.cand_metric != v.metric else "")),
        ("log names", f"reference `{v.ref_name}`, candidate `{v.cand_name}`"),
        ("reference value", "-" if v.ref is None else f"{v.ref:.8g}"),
        ("candidate value", "-" if v.cand is None else f"{v.cand:.8g}"),
        ("difference (cand - ref)", diff),
        ("relative difference", _rel_text(v.rel_diff)),
        ("tolerance", f"{v.tolerance}"),
        ("failing points / allowed", f"{v.failures} / {v.allowed}"),
        ("reason", v.reason),
        ("action", on_violation),
    ]
    out = [f"# Parity violation at step {v.step}: {v.metric}", "", f"- reference: `{ref_source}`"]
    out += [f"- candidate: `{cand_source}`", "", "| | |", "|---|---|"]
    out += [f"| {k} | {val} |" for k, val in rows]
    if v.tail:
        out += ["", f"## Last compared steps of `{v.metric}`", "", "| step | reference | candidate | rel. diff |"]
        out += ["|---|---|---|---|"]
        for s, r, c in v.tail:
            rel = abs(c - r) / abs(r) if r and math.isfinite(r) and math.isfinite(c) else float("nan")
            out.append(f"| {s} | {r:.8g} | {c:.8g} | {rel:.3g} |")
    return "\n".join(out) + "\n"


def write_violation_report(
    v: Violation, out_dir: str | os.PathLike[str], *, ref_source: str, cand_source: str, on_violation: str = "stop"
) -> tuple[Path, Path]:
    """Write ``parity_report.md`` and ``parity_report.json`` of ``v`` into ``out_dir`` (created); returns
    their paths. Each file is written to a temporary name and renamed, so a reader never sees half a report."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    payload = {"reference": ref_source, "candidate": cand_source, "on_violation": on_violation, **v.to_dict()}
    md, js = d / REPORT_MD, d / REPORT_JSON
    for path, text in (
        (md, _markdown(v, ref_source, cand_source, on_violation)),
        (js, json.dumps(payload, indent=2) + "\n"),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return md, js
