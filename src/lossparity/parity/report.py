"""Renderings of a comparison: the text table ``compare`` prints, and a report directory with ``summary.md``
and one PNG per compared metric.

Each plot has two panels over the alignment coordinate: both curves overlaid (with point markers), and
the signed relative difference ``(c - r) / |r|`` with the pass band ``±(abs + rel·|r|) / |r|`` shaded
(on a symmetric-log axis whose linear part is the band, so that a narrow band stays visible) and the
failing points marked. Plots use matplotlib's Agg canvas directly (no pyplot, no global backend
switch). Without matplotlib only ``summary.md`` is written, and it says that plots were skipped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from .compare import CompareResult, MetricResult, describe_points, step_ranges

__all__ = [
    "ReportFiles",
    "format_text",
    "run_labels",
    "summary_markdown",
    "metric_figure",
    "plot_metric",
    "write_report",
]


@dataclass
class ReportFiles:
    """Paths written by :func:`write_report`; ``plots_skipped`` says why no PNG was written."""

    summary: Path
    plots: dict[str, Path] = field(default_factory=dict)
    plots_skipped: str | None = None


def _file_stem(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", metric).strip("_") or "metric"


def _fmt(v: float) -> str:
    return f"{v:.6g}" if np.isfinite(v) else str(v)


def run_labels(ref_source: str, cand_source: str) -> tuple[str, str]:
    """Short names that tell the two logs apart: the file names, or as many trailing path components as it
    takes when the file names are equal (``runA/trainer_state.json`` vs ``runB/trainer_state.json``)."""
    a = Path(os.path.abspath(ref_source)).parts
    b = Path(os.path.abspath(cand_source)).parts
    for k in range(1, max(len(a), len(b)) + 1):
        la, lb = "/".join(a[-k:]), "/".join(b[-k:])
        if la != lb:
            return la, lb
    return ref_source, cand_source


def _metric_label(m: MetricResult) -> str:
    return m.metric if m.cand_metric == m.metric else f"{m.metric} (cand: {m.cand_metric})"


def _missing_cell(m: MetricResult) -> str:
    return f"{m.only_ref}/{m.only_cand}"


def format_text(result: CompareResult) -> str:
    """Plain-text table of a :class:`CompareResult` (what ``compare`` prints without ``--json``): verdict,
    both inputs, one row per metric (``missing`` = reference points the candidate lacks / candidate points
    the reference lacks), the missing-steps violations, skipped metrics, notes."""
    lines = [f"lossparity compare: {'PARITY' if result.passed else 'VIOLATION'}"]
    for role, run in (("ref", result.ref), ("cand", result.cand)):
        lines.append(f"  {role:<4} {run.source} ({run.format}, first step {run.step_base})")
    if result.no_loss:
        lines.append(f"  FAIL: {result.no_loss}")
    head = (
        "metric",
        "tolerance",
        "points",
        "failed",
        "allowed",
        "first fail",
        "worst step",
        "max rel diff",
        "missing r/c",
        "",
    )
    rows = [head]
    for m in result.metrics.values():
        first = m.first_fail_step
        rows.append(
            (
                _metric_label(m),
                str(m.tolerance),
                str(m.n_compared),
                str(m.n_failed),
                str(m.allowed_failures),
                "-" if first is None else str(first),
                str(m.worst_step),
                f"{m.max_rel_diff:.3e}",
                _missing_cell(m),
                "ok" if m.passed else "FAIL",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += _missing_lines(result)
    lines += _flagged_lines(result)
    lines += [f"  skipped {k}: {why}" for k, why in result.skipped.items()]
    if result.not_compared:
        names = _first_names(result.not_compared)
        lines.append(f"  not compared (not canonical; name them with --metrics): {names}")
    lines += [f"  note: {n}" for n in result.notes]
    for role, run in (("ref", result.ref), ("cand", result.cand)):
        lines += [f"  note ({role}): {n}" for n in _short_notes(run.notes)]
    return "\n".join(lines)


def _missing_lines(result: CompareResult) -> list[str]:
    """One line per group of metrics with the same missing points (counts and ranges, not lists), and one per
    group failing the missing-steps rule."""
    unit = "step" if result.align == "step" else "sample count"
    groups: dict[tuple[tuple[float, ...], tuple[float, ...], str | None], list[str]] = {}
    for m in result.metrics.values():
        if m.missing_cand or m.missing_ref or m.missing_violation:
            key = (tuple(m.missing_cand), tuple(m.missing_ref), m.missing_violation)
            groups.setdefault(key, []).append(m.metric)
    lines = []
    for (cand_lacks, ref_lacks, violation), names in groups.items():
        parts = []
        if cand_lacks:
            parts.append(f"the candidate lacks {describe_points(cand_lacks, 'reference ' + unit)}")
        if ref_lacks:
            parts.append(f"the reference lacks {describe_points(ref_lacks, 'candidate ' + unit)}")
        if parts:
            lines.append(f"  {', '.join(names)}: {'; '.join(parts)}")
        if violation:
            lines.append(f"  {', '.join(names)}: FAIL (missing steps, rule {result.missing_steps}): {violation}")
    return lines


def _flag_roles(result: CompareResult) -> dict[int, str]:
    """``{step: "both logs" | "reference only" | "candidate only"}`` for the steps a log flags as skipped/NaN
    (reference step numbers)."""
    offset = result.ref.step_base - result.cand.step_base
    ref, cand = set(result.ref.skipped_steps), {s + offset for s in result.cand.skipped_steps}
    return {
        s: "both logs" if s in ref and s in cand else ("reference only" if s in ref else "candidate only")
        for s in ref | cand
    }


def _flagged_lines(result: CompareResult) -> list[str]:
    """The skipped/NaN iterations that may decide a verdict: the steps the logs flag (Megatron's skipped or NaN
    iterations, MindFormers' overflow), and for each failing metric whether its first failure is such a step
    or follows a step that only one log flags (the runs then skipped different iterations)."""
    roles = _flag_roles(result)
    if not roles or result.align != "step":
        return []
    # a step flagged by one log only explains later failures when both logs report skipped iterations (a log
    # format that never reports them, such as an HF trainer state, flags nothing)
    both_report = bool(result.ref.skipped_steps) and bool(result.cand.skipped_steps)
    lines = []
    for m in result.metrics.values():
        first = m.first_fail_step
        if m.passed or first is None:
            continue
        lone = [s for s, r in sorted(roles.items()) if r != "both logs" and s <= first] if both_report else []
        if first in roles:
            lines.append(f"  {m.metric}: its first failure, step {first}, is flagged skipped/NaN ({roles[first]})")
        elif lone:
            lines.append(
                f"  {m.metric}: fails from step {first}, after step {lone[-1]} that only one log flags as skipped/NaN "
                f"({roles[lone[-1]]})"
            )
    if lines:
        flags = ", ".join(f"{s} ({r})" for s, r in sorted(roles.items())[:6])
        lines.insert(
            0,
            f"  steps flagged skipped/NaN by the logs: {flags}{', ...' if len(roles) > 6 else ''}; a skipped "
            "iteration updates neither the weights nor the learning-rate schedule, so runs that skip different "
            "iterations differ from there on",
        )
    return lines


_LINE_NOTE_RE = re.compile(r"^line (\d+)([:\s].*)$")
_MAX_NOTES = 4


def _first_names(names: list[str], limit: int = 50) -> str:
    """The first ``limit`` names and how many more (a 100,000-column table stays a readable line)."""
    more = f", ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _short_notes(notes: list[str]) -> list[str]:
    """A run's notes for the console: notes that differ only in their line number are joined
    (``lines 1, 9, 11: ...``), and at most ``_MAX_NOTES`` are shown."""
    grouped: dict[str, list[int]] = {}
    out: list[str | tuple[str, list[int]]] = []
    for n in notes:
        m = _LINE_NOTE_RE.match(n)
        if m is None:
            out.append(n)
        elif m.group(2) in grouped:
            grouped[m.group(2)].append(int(m.group(1)))
        else:
            grouped[m.group(2)] = [int(m.group(1))]
            out.append((m.group(2), grouped[m.group(2)]))
    text = [
        n if isinstance(n, str) else f"line{'s' if len(n[1]) > 1 else ''} {step_ranges(n[1], 6)}{n[0]}" for n in out
    ]
    if len(text) > _MAX_NOTES:
        text = [*text[: _MAX_NOTES - 1], f"{len(text) - _MAX_NOTES + 1} more notes (see --json or --report)"]
    return text


def summary_markdown(result: CompareResult, plots: dict[str, Path], plots_skipped: str | None) -> str:
    """Markdown text of ``summary.md``: inputs, settings, one table row per metric, skipped metrics, notes."""
    verdict = "PARITY" if result.passed else "VIOLATION"
    out = [f"# lossparity compare: {verdict}", ""]
    labels = run_labels(result.ref.source, result.cand.source)
    for role, run, label in (("Reference", result.ref, labels[0]), ("Candidate", result.cand, labels[1])):
        notes = [f"format `{run.format}`", f"first step {run.step_base}"]
        if run.restarts:
            notes.append(f"{run.restarts} restart(s), {run.dropped_values} superseded value(s) dropped")
        if run.skipped_steps:
            notes.append(f"{len(run.skipped_steps)} step(s) flagged skipped/NaN/overflow by the log")
        out.append(f"- {role}: `{label}` ({', '.join(notes)})")
    window = "all" if result.window is None else f"{result.window[0]} .. {result.window[1]}"
    rule = (
        "Megatron functional-test rule (min(max(n//100,1),50) failures allowed)"
        if result.megatron_rule
        else "every point must pass"
    )
    out += [
        f"- Alignment: {result.align}; window: {window}; smoothing: {result.smooth}; verdict rule: {rule}",
        "",
        "| metric | tolerance | points | failed | allowed | first failing step | worst step | "
        "max rel diff | ref at worst | cand at worst | missing ref/cand | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in result.metrics.values():
        w = m.worst_index
        first = m.first_fail_step
        out.append(
            f"| {_metric_label(m)} | {m.tolerance} | {m.n_compared} | {m.n_failed} | {m.allowed_failures} | "
            f"{'-' if first is None else first} | {m.worst_step} | {m.max_rel_diff:.3e} | "
            f"{_fmt(m.ref[w])} | {_fmt(m.cand[w])} | {_missing_cell(m)} | {'ok' if m.passed else '**FAIL**'} |"
        )
    out.append("")
    if result.no_loss:
        out.append(f"- **FAIL**: {result.no_loss}")
    out += [f"- {line.strip()}" for line in _flagged_lines(result)]
    for m in result.metrics.values():
        if m.missing_violation:
            out.append(f"- `{m.metric}` fails the missing-steps rule ({result.missing_steps}): {m.missing_violation}")
    out += [f"- Note: {n}" for n in result.notes]
    for role, run in (("reference", result.ref), ("candidate", result.cand)):
        out += [f"- Note ({role}): {n}" for n in run.notes]
    for name, why in result.skipped.items():
        out.append(f"- `{name}` skipped: {why}")
    if result.not_compared:
        out.append(f"- Shared but not compared (not canonical): {_first_names(result.not_compared)}")
    if result.skipped or result.not_compared:
        out.append("")
    if plots_skipped:
        out += [f"Plots skipped: {plots_skipped}.", ""]
    else:
        out += ["## Plots", ""]
        out += [f"### {name}\n\n![{name}]({path.name})\n" for name, path in plots.items()]
    return "\n".join(out)


def metric_figure(m: MetricResult, xlabel: str, smooth: int) -> Figure:
    """The two-panel figure of one metric: both curves with point markers (a single shared point is visible),
    and the signed relative difference with the tolerance band. The band is drawn on a symmetric-log axis
    whose linear part is the band itself, so a 1e-5 band stays visible next to differences of 1e-1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), dpi=100)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    suffix = f" (moving average {smooth})" if smooth > 1 else ""
    top.plot(m.x, m.ref, label="reference", lw=1.4, marker="o", ms=3)
    top.plot(m.x, m.cand, label="candidate", lw=1.0, ls="--", marker="x", ms=4)
    top.set_ylabel(m.metric + suffix)
    top.set_title(
        f"{m.metric}: {'ok' if m.passed else 'FAIL'} ({m.n_failed}/{m.n_compared} points outside {m.tolerance})"
    )
    top.legend(loc="best")
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.abs(m.ref)
        signed = np.where(np.isfinite(m.rel_diff), (m.cand - m.ref) / scale, np.nan)
        band = np.where(scale > 0, m.tolerance.bound(m.ref) / scale, np.nan)
    finite_band = band[np.isfinite(band) & (band > 0)]
    if finite_band.size:
        bottom.set_yscale("symlog", linthresh=float(finite_band.min()))
    # a one-point band has no width along x: widen it to a visible strip around that point
    bx = m.x if m.x.size > 1 else np.array([m.x[0] - 0.5, m.x[0] + 0.5])
    bb = band if m.x.size > 1 else np.repeat(band, 2)
    bottom.fill_between(bx, -bb, bb, color="tab:green", alpha=0.3, label="tolerance")
    bottom.plot(bx, bb, color="tab:green", lw=0.8, ls=":")
    bottom.plot(bx, -bb, color="tab:green", lw=0.8, ls=":")
    bottom.plot(m.x, signed, color="tab:blue", lw=1.0, marker="o", ms=3, label="(cand - ref) / |ref|")
    bad = ~m.ok
    if bad.any():
        bottom.scatter(
            m.x[bad],
            np.nan_to_num(signed[bad], nan=0.0, posinf=0.0, neginf=0.0),
            color="tab:red",
            s=16,
            zorder=3,
            label="failing",
        )
    bottom.axhline(0.0, color="black", lw=0.5)
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel(xlabel)
    bottom.legend(loc="best")
    fig.tight_layout()
    return fig


def plot_metric(m: MetricResult, path: Path, xlabel: str, smooth: int) -> None:
    """Write the two-panel PNG of one metric to ``path`` (:func:`metric_figure`)."""
    metric_figure(m, xlabel, smooth).savefig(path)


def write_report(result: CompareResult, out_dir: str | os.PathLike[str]) -> ReportFiles:
    """Write ``summary.md`` and ``<metric>.png`` for every compared metric into ``out_dir``.

    Creates ``out_dir`` if needed. Without matplotlib the PNGs are skipped and ``summary.md`` says
    so. Returns the written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: dict[str, Path] = {}
    skipped: str | None = None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        skipped = "matplotlib is not installed (pip install lossparity[report])"
    if skipped is None:
        xlabel = "consumed samples" if result.align == "samples" else "step (reference numbering)"
        used: set[str] = set()
        for name, m in result.metrics.items():
            stem = _file_stem(name)
            while stem in used:
                stem += "_"
            used.add(stem)
            path = out / f"{stem}.png"
            plot_metric(m, path, xlabel, result.smooth)
            plots[name] = path
    summary = out / "summary.md"
    summary.write_text(summary_markdown(result, plots, skipped), encoding="utf-8")
    return ReportFiles(summary=summary, plots=plots, plots_skipped=skipped)
