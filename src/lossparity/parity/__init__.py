"""Loss-parity tools: read training logs of several frameworks and compare their curves.

``read_log`` turns a Megatron-LM, TensorBoard, JSONL, CSV, golden-value, HF ``trainer_state.json``,
MaxText, torchtitan or MindFormers log into a :class:`Run` of canonical metrics; ``compare_runs``
checks two runs against per-metric tolerances; ``write_report`` writes a Markdown summary and plots.
This package does not import torch.
"""

from .compare import (
    DEFAULT_TOLERANCES,
    CompareInputError,
    CompareResult,
    MetricResult,
    Tolerance,
    add_compare_arguments,
    compare_runs,
    megatron_allowed_failures,
    moving_average,
    parse_tolerances,
    run_compare,
    tolerance_for,
)
from .names import CANONICAL_METRICS, canonical_name, is_canonical, parse_name_map
from .readers import FORMATS, LogParseError, Run, detect_format, read_log
from .report import ReportFiles, write_report

__all__ = [
    "CANONICAL_METRICS",
    "DEFAULT_TOLERANCES",
    "FORMATS",
    "CompareInputError",
    "CompareResult",
    "LogParseError",
    "MetricResult",
    "ReportFiles",
    "Run",
    "Tolerance",
    "add_compare_arguments",
    "canonical_name",
    "compare_runs",
    "detect_format",
    "is_canonical",
    "megatron_allowed_failures",
    "moving_average",
    "parse_name_map",
    "parse_tolerances",
    "read_log",
    "run_compare",
    "tolerance_for",
    "write_report",
]
