"""The audit's report as a Markdown table (the terminal) and as JSON (``--json``)."""

from __future__ import annotations

import math

from .core import AuditReport, ConfigRow
from .identify import fmt_factor

__all__ = ["render"]


def _num(x: float | None, fmt: str = ".1e") -> str:
    return "-" if x is None else format(x, fmt)


def _line(r: ConfigRow, tol: float) -> str:
    if r.skipped:
        return f"| {r.config} | {r.klass} | could not run: {r.skipped} | | | | | |"
    f = r.found
    if f is None:
        return f"| {r.config} | {r.klass} | {r.note} | | | | | BREAKS |"
    if r.logged is None:
        log = "not logged"
    elif not math.isfinite(r.logged):
        log = f"{r.logged} (not finite)"
    elif r.log_matches is None:
        log = f"{r.logged:.6g}"
    else:
        ratio = r.logged / f.objective if f.objective else float("nan")
        log = (
            f"{r.logged:.6g} = J" if r.log_matches else f"{r.logged:.6g} ≠ J {f.objective:.6g} (× {fmt_factor(ratio)})"
        )
    verdict = "ok" if r.invariant else f"BREAKS (> {tol:g})"
    return (
        f"| {r.config} | {r.klass} | {f.name}{'; ' + r.aux if r.aux else ''} | {_num(f.residual)} | "
        f"{_num(r.vs_reference)} | "
        f"{f.objective:.6g} | {log} | {verdict} |"
    )


def render(report: AuditReport) -> str:
    """The report's table, its verdict line and its notes."""
    lines = [
        "| config | class | computes | residual | vs reference | objective J | logged | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_line(r, report.tol) for r in report.rows]
    for r in report.rows:
        if r.note and r.found is not None:
            lines.append(f"  note ({r.config}): {r.note}")
    lines += [f"  note: {n}" for n in report.notes]
    mismatched = [r for r in report.rows if r.log_matches is False]
    if mismatched:
        lines.append(f"  the logged loss is not the optimized objective in {len(mismatched)} configuration(s)")
    if report.incomplete:
        verdict = f"INCOMPLETE: {len(report.incomplete)} configuration(s) could not run"
    elif report.invariant:
        verdict = "INVARIANT"
    else:
        verdict = f"NOT INVARIANT: first broken class '{report.first_broken}'"
    if report.expect is not None:
        verdict += f"; expected {report.expect}: " + ("yes" if report.as_expected else "NO")
    lines.append(f"{verdict} (tolerance {report.tol:g} relative, wall {report.wall_s:.1f} s)")
    return "\n".join(lines)
