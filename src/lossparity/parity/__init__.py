"""Loss-parity tools: read training logs of several frameworks and compare their curves.

``read_log`` turns a Megatron-LM, TensorBoard, JSONL, LLaMA-Factory, CSV, golden-value, HF
``trainer_state.json``, MaxText, torchtitan (console or loss export) or MindFormers log into a :class:`Run`
of canonical metrics; ``compare_runs`` checks two runs against per-metric tolerances and returns a
:class:`CompareResult`; ``format_text`` and ``write_report`` render it (text table; ``summary.md`` and
plots). ``ParityGuard`` applies the same rules step by step while a run trains (:mod:`.guard`). The
command-line glue lives in :mod:`lossparity.cli.parity`.

This package never imports torch. Its names are imported lazily, so that reading a log (``readers``) does
not import NumPy, which only the comparison needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_TOLERANCES": "compare",
    "CompareInputError": "compare",
    "CompareResult": "compare",
    "MetricResult": "compare",
    "Tolerance": "compare",
    "compare_runs": "compare",
    "megatron_allowed_failures": "compare",
    "moving_average": "compare",
    "parse_tolerances": "compare",
    "step_ranges": "compare",
    "tolerance_for": "compare",
    "ParityGuard": "guard",
    "Verdict": "guard",
    "Violation": "violation",
    "CANONICAL_METRICS": "names",
    "canonical_name": "names",
    "is_canonical": "names",
    "parse_name_map": "names",
    "FORMATS": "readers",
    "LogParseError": "readers",
    "Run": "readers",
    "Series": "_series",
    "detect_format": "readers",
    "read_log": "readers",
    "ReportFiles": "report",
    "format_text": "report",
    "write_report": "report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lossparity.parity' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
