"""The plot of ``lossparity gap --plot`` (matplotlib's Agg canvas, imported only when a plot is asked for)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .gap import GapReport

__all__ = ["plot_gap"]


def plot_gap(report: GapReport, path: str) -> None:
    """Write a PNG: the per-step gap with its bootstrap band, the ``Cov(n,l)/mean(n)`` term, and (with a
    drift check) the observed ``A − B`` of the two logs. Uses matplotlib's Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x = np.array([st.step for st in report.steps], dtype=np.float64)
    fig = Figure(figsize=(9, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if report.replicates is not None:
        lo = np.array([st.ci_low for st in report.steps], dtype=np.float64)
        hi = np.array([st.ci_high for st in report.steps], dtype=np.float64)
        ax.fill_between(x, lo, hi, color="tab:blue", alpha=0.2, label=f"{100 * report.ci:g}% bootstrap CI")
    ax.plot(x, [st.gap for st in report.steps], color="tab:blue", lw=1.4, label="gap per_token − per_sample")
    ax.plot(
        x, [st.cov_term for st in report.steps], color="tab:orange", lw=0, marker=".", ms=4, label="Cov(n, l) / mean(n)"
    )
    if report.drift is not None:
        ax.plot(
            report.drift.steps,
            report.drift.observed,
            color="tab:red",
            lw=0,
            marker="x",
            ms=5,
            label=f"observed {report.drift.metric} A − B",
        )
    ax.axhline(0.0, color="black", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss difference")
    ax.set_title("estimator gap" + (f" — {report.drift.verdict.split(' (')[0]}" if report.drift else ""))
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path)
