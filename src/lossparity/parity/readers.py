"""Training-log readers: one :class:`Run` per log, whatever framework wrote it.

Formats (``fmt`` names; :func:`detect_format` picks one when ``fmt`` is ``None``):

``megatron``
    Megatron-LM stdout: `` [date] iteration      N/     M | consumed samples: ... | lm loss: 1.2E+00 |
    ... | number of skipped iterations:   0 | number of nan iterations:   0 |`` (any prefix such as
    ``[default0]:``). Each value is Megatron's mean over the logging interval ending at iteration ``N``,
    over the interval's non-skipped iterations. Megatron prints a loss only when that mean is ``> 0``, so
    an interval whose iterations were all skipped (or NaN) has no loss value: it is left out. Steps that
    report skipped or NaN iterations are listed in ``Run.skipped_steps``. A complete metric line ends
    with ``|``: a line hard-wrapped by a terminal is joined with its continuation lines; a metric line
    that is never completed is ignored with a note.
``tensorboard``
    A directory of ``*tfevents*`` files (searched recursively) or one such file. Scalar summaries
    and scalar tensor summaries are read. Megatron's ``<tag> vs samples`` series are not metrics;
    they give ``consumed_samples`` when they pair one-to-one with ``<tag>``. A Git LFS pointer given
    instead of an event file is an error that says so.
``jsonl``
    One JSON object per line with a ``"step"`` and metric keys (lossparity's own log; MaxText's
    metrics file), or the long form ``{"step": s, "metric": name, "value": v}``. ``null`` = missing;
    strings other than ``"nan"``/``"inf"`` are labels (``run_name``) and ignored, except where a
    canonical metric or a ``*loss*`` key needs a number (an error).
``llamafactory``
    LLaMA-Factory ``trainer_log.jsonl``: JSON lines whose step is ``current_steps``.
``csv``
    A table with a step column (``train/global_step``, ``trainer/global_step``, ``global_step``,
    ``step``, ``iteration``, ``_step``, preferred in that order; a W&B export's ``Step``); empty
    cells = missing; ``__MIN`` / ``__MAX`` columns are ignored and a W&B ``"<run> - "`` prefix is
    removed from column names. Columns with no numeric cell are labels. W&B's own ``Step``/``_step``
    counter starts at 0: when it does, the run's first step is 0 (``step_base``, with a note).
``megatron_golden``
    Megatron functional-test golden values ``{metric: {start_step, end_step, step_interval,
    values: {"<step>": v}}}``. The legacy list form (``values: [...]``, written by Megatron's old
    ``get_test_results_from_tensorboard_logs.py`` as every ``step_interval``-th TensorBoard event from
    event ``start_step``) puts ``values[i]`` at iteration ``start_step + i·step_interval + 1`` (event
    0 is iteration 1). The string ``"nan"`` is what Megatron writes for a step the run never logged
    (a resumed run's first half): it is *missing*, while a JSON ``NaN`` is a NaN value. Top-level
    scalars (``iteration_timing_avg``) are not series: ignored with a note.
``hf_trainer_state``
    Hugging Face ``trainer_state.json``: every numeric entry of each training item of
    ``log_history``. Evaluation items (only ``eval_*``/``predict_*``/``test_*`` metrics) keep their
    own names when they have a step and are ignored with a note when they have none; the
    end-of-training summary item (``train_runtime``) is ignored with a note.
``maxtext``
    MaxText console: ``completed step: N, seconds: ..., loss: x, ...`` (also with ``lm_loss``), and
    the ``completed profiler activation/deactivation step: N, ...`` lines of profiler boundary steps
    (read, with a note).
``torchtitan``
    torchtitan console: ``step: N  loss: x  grad_norm: y  memory: ...  tps: 1,234 ...`` (ANSI
    colour codes removed); validation lines (``validate step:``) are not training lines.
``torchtitan_losses``
    torchtitan's ``scripts/loss_compare.py --export-result`` file: ``<step> <loss>`` per line (the
    loss is ``loss_metrics/global_avg_loss``, the objective).
``mindformers``
    MindFormers ``{ Epoch:[e/E], step:[s/S], loss: x, ..., overflow cond: False, global_norm: [g]``
    (also ``global_norm [g]`` without the colon). The printed step counts within its epoch: the
    global step is ``(e - 1)·S + s``. Overflow steps are listed in ``Run.skipped_steps``.

Conventions shared by all readers:

- Values: a value the log writes (NaN and inf included) is recorded as written; a value the log
  does not write for a step (absent key, empty cell, ``null``) is left out. Nothing is filled in.
- Numbers are strict: a canonical metric or a ``*loss*`` field must be a complete number (``4.6O72``,
  ``[1 31049]`` or ``"2.5x"`` are errors naming file:line, never cut to a prefix); console fields
  that are not metrics may carry units (``1.21GiB(0.86%)``, ``5,756``, ``103ms``).
- Live logs: a last line without a newline (a log still being written) is ignored with a note in
  ``Run.notes``, never compared.
- Restarts: a restarted job repeats steps. When a log's step goes *backwards* (to ``s`` below the
  last step read), every value already read at a step ``>= s`` is discarded: the later run wins,
  also over steps it never reaches (they belong to the abandoned trajectory). A value written again
  at the same step replaces the earlier one. ``Run.restarts`` and ``Run.dropped_values`` count this.
  TensorBoard applies the rule per tag and per event file (files in time order), long-form JSONL
  lines per metric.
- Step numbering: ``Run.step_base`` is the number a log gives its first optimizer step: 1 for
  Megatron, HF, torchtitan, MindFormers, lossparity; 0 for MaxText (console, TensorBoard with
  ``learning/*`` tags, metrics file) and W&B's ``Step`` counter. The comparison aligns
  ``step - step_base``.
- Console formats interleave unrelated text: such lines are skipped and counted in
  ``Run.skipped_lines``. A line that starts like a metric line but cannot be parsed raises
  :class:`LogParseError` (file, 1-based line number, what was expected); so does any bad line or
  entry in the structured formats.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Mapping

from ..input_files import InputFileError, check_regular, loads_json, open_regular
from . import _console, _structured
from ._record import LogParseError, Recorder, Run, input_error, to_float

__all__ = ["FORMATS", "FORMAT_ALIASES", "LogParseError", "Run", "detect_format", "read_log"]

FORMATS: tuple[str, ...] = (
    "megatron",
    "tensorboard",
    "jsonl",
    "llamafactory",
    "csv",
    "megatron_golden",
    "hf_trainer_state",
    "maxtext",
    "torchtitan",
    "torchtitan_losses",
    "mindformers",
)

FORMAT_ALIASES: dict[str, str] = {
    "megatron-lm": "megatron",
    "tb": "tensorboard",
    "golden": "megatron_golden",
    "megatron-golden": "megatron_golden",
    "hf": "hf_trainer_state",
    "trainer_state": "hf_trainer_state",
    "hf-trainer-state": "hf_trainer_state",
    "titan": "torchtitan",
    "titan-losses": "torchtitan_losses",
    "loss-export": "torchtitan_losses",
    "llama-factory": "llamafactory",
    "json": "jsonl",
}

_READERS: dict[str, Callable[[str, Recorder], None]] = {
    **_structured.READERS,
    "megatron": _console.read_megatron,
    "maxtext": _console.read_maxtext,
    "torchtitan": _console.read_torchtitan,
    "torchtitan_losses": _console.read_loss_export,
    "mindformers": _console.read_mindformers,
}

_STEP_BASE = {"maxtext": 0}
_DETECT_MAX_LINES = 5000
_DETECT_MAX_CHARS = 1024 * 1024  # detection reads at most this much of the head of a file


def _normalize_format(fmt: str) -> str:
    key = fmt.strip().lower()
    key = FORMAT_ALIASES.get(key, key)
    if key not in _READERS:
        raise ValueError(f"fmt: unknown log format {fmt!r}; valid: {', '.join(FORMATS)}")
    return key


def _json_kind(data: object) -> str | None:
    if isinstance(data, dict):
        if isinstance(data.get("log_history"), list):
            return "hf_trainer_state"
        if "current_steps" in data:
            return "llamafactory"
        if "step" in data:
            return "jsonl"
        if (
            data
            and any(isinstance(v, dict) and "values" in v for v in data.values())
            and all((isinstance(v, dict) and "values" in v) or isinstance(v, (int, float)) for v in data.values())
        ):
            return "megatron_golden"
    return None


def _detect_json(path: str, first: str) -> str | None:
    """``jsonl`` / ``llamafactory`` / ``hf_trainer_state`` / ``megatron_golden`` for a file that starts
    like JSON; a broken JSON document raises naming where it breaks."""
    if not first.startswith("{"):
        return None
    try:
        return _json_kind(loads_json(first))  # JSONL, or a document written on one line
    except ValueError:  # not one JSON value per line (or nested too deeply): read as a document below
        pass
    kind = _json_kind(_structured.load_json(path))  # a pretty-printed document (raises when broken)
    if kind is None:
        raise LogParseError(
            path,
            None,
            "a JSON log: objects with 'step' (jsonl) or 'current_steps' "
            "(llamafactory), 'log_history' (hf_trainer_state) or "
            "{metric: {values}} (megatron_golden)",
        )
    return kind


def _detect_text(head_lines: list[str]) -> str | None:
    first = next((line.strip() for line in head_lines if line.strip()), "")
    if "," in first:
        try:
            cols = [c.strip().strip('"').lower() for c in next(csv.reader([first]))]
        except csv.Error:  # a header cell beyond csv's field size limit: not a table this reader reads
            cols = []
        if any(c in _structured.CSV_STEP_COLUMNS for c in cols):
            return "csv"
    m = _console.LOSS_EXPORT_RE.match(first)
    if m is not None and to_float(m.group(2)) is not None:
        return "torchtitan_losses"
    for line in head_lines:
        if _console.MEG_START_RE.search(line):
            return "megatron"
        if _console.MF_START_RE.search(line) and "step:" in line:
            return "mindformers"
        if "completed step:" in line or "completed profiler activation/deactivation step:" in line:
            return "maxtext"
        if _console.TITAN_START_RE.search(_console.ANSI_RE.sub("", line)):
            return "torchtitan"
    return None


def _head_lines(path: str) -> list[str]:
    """The first :data:`_DETECT_MAX_LINES` lines of ``path``, at most :data:`_DETECT_MAX_CHARS` characters in
    all (a longer line is cut there: detection looks at its start only)."""
    head: list[str] = []
    total = 0
    with open_regular(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="") as f:
        while len(head) < _DETECT_MAX_LINES and total < _DETECT_MAX_CHARS:
            line = f.readline(_DETECT_MAX_CHARS - total)
            if not line:
                break
            head.append(line)
            total += len(line)
    return head


def detect_format(path: str | os.PathLike[str]) -> str:
    """Name of the log format of ``path`` (one of :data:`FORMATS`).

    A directory or a ``*tfevents*`` file is ``tensorboard``. A file that starts like JSON is
    ``hf_trainer_state`` (has ``log_history``), ``megatron_golden`` (its values have ``values``),
    ``llamafactory`` (``current_steps``) or ``jsonl`` (``step``); a broken JSON document raises
    :class:`LogParseError` naming the line and column where it breaks. A first line that is a CSV header
    with a step column is ``csv``; ``<step> <number>`` is ``torchtitan_losses``. Otherwise the first of
    its first 5000 lines that looks like a Megatron, MindFormers, MaxText or torchtitan metric line
    decides. An empty file, a Git LFS pointer and a file nothing matches raise :class:`LogParseError`;
    a missing ``path`` raises ``FileNotFoundError``.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"the log {p} does not exist")
    if os.path.isdir(p):
        if _structured.event_files(p):
            return "tensorboard"
        raise LogParseError(p, None, "a directory with TensorBoard event files (*tfevents*)")
    try:
        check_regular(p, "a log file (a regular file) or a TensorBoard folder")
        if _structured.is_lfs_pointer(p):
            raise _structured.lfs_error(p, "a training log")
        if "tfevents" in os.path.basename(p):
            return "tensorboard"
        head_lines = _head_lines(p)
    except InputFileError as e:
        raise input_error(e) from None
    first = next((line.strip() for line in head_lines if line.strip()), "")
    if not first:
        raise LogParseError(p, None, "a training log, got an empty file")
    fmt = _detect_json(p, first) or _detect_text(head_lines)
    if fmt is not None:
        return fmt
    raise LogParseError(
        p,
        None,
        f"a known log format in the first {_DETECT_MAX_LINES} lines ({', '.join(FORMATS)}); pass the format explicitly",
    )


def read_log(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    name_map: Mapping[str, str] | None = None,
) -> Run:
    """Read one training log into a :class:`Run` of canonical metric names.

    ``fmt`` is a name from :data:`FORMATS` (or an alias such as ``tb``, ``hf``, ``golden``); ``None``
    detects it with :func:`detect_format`. Raw names become canonical with
    :func:`lossparity.parity.names.canonical_name` and ``name_map``. Values, restarts, step
    numbering, skipped and incomplete lines follow the conventions in this module's docstring. Raises
    :class:`LogParseError` for a malformed log and ``FileNotFoundError`` for a missing one.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"the log {p} does not exist")
    key = detect_format(p) if fmt is None else _normalize_format(fmt)
    rec = Recorder(p, key, name_map, step_base=_STEP_BASE.get(key, 1))
    _READERS[key](p, rec)
    return rec.run(release=True)
