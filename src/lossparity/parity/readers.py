"""Training-log readers: one :class:`Run` per log, whatever framework wrote it.

Formats (``fmt`` names; :func:`detect_format` picks one when ``fmt`` is ``None``):

``megatron``
    Megatron-LM stdout: `` [date] iteration      N/     M | consumed samples: ... | lm loss: 1.2E+00 |
    ... | number of skipped iterations:   0 | number of nan iterations:   0 |``. Each value is
    Megatron's mean over the logging interval ending at iteration ``N``, over the interval's
    non-skipped iterations. Megatron prints a loss only when that mean is ``> 0``, so an interval
    whose iterations were all skipped (or NaN) has no loss value: it is left out. Steps that report
    skipped or NaN iterations are listed in ``Run.skipped_steps``.
``tensorboard``
    A directory of ``*tfevents*`` files (searched recursively) or one such file. Scalar summaries
    and scalar tensor summaries are read. Megatron's ``<tag> vs samples`` series are not metrics;
    they give ``consumed_samples`` when they pair one-to-one with ``<tag>``.
``jsonl``
    One JSON object per line with a ``"step"`` and metric keys (lossparity's own log; MaxText's
    metrics file), or the long form ``{"step": s, "metric": name, "value": v}``. ``null`` = missing;
    strings other than ``"nan"``/``"inf"`` are labels (``run_name``) and ignored.
``csv``
    A table with a ``step`` / ``Step`` / ``_step`` / ``global_step`` / ``iteration`` column (e.g. a
    W&B export); empty cells = missing; ``__MIN`` / ``__MAX`` columns are ignored and a W&B
    ``"<run> - "`` prefix is removed from column names. Columns with no numeric cell are labels.
``megatron_golden``
    Megatron functional-test golden values ``{metric: {start_step, end_step, step_interval,
    values: {"<step>": v}}}``; ``values`` may also be a list (step = start + i·interval).
``hf_trainer_state``
    Hugging Face ``trainer_state.json``: every numeric entry of each ``log_history`` item.
``maxtext``
    MaxText console: ``completed step: N, seconds: ..., loss: x, ...`` (also with ``lm_loss``).
``torchtitan``
    torchtitan console: ``step: N  loss: x  grad_norm: y  memory: ...  tps: 1,234 ...`` (ANSI
    colour codes removed); validation lines (``validate step:``) are not training lines.
``mindformers``
    MindFormers ``{ Epoch:[e/E], step:[s/S], loss: x, ..., overflow cond: False, global_norm: [g]``.
    The printed step counts within its epoch: the global step is ``(e - 1)·S + s``. Overflow steps
    are listed in ``Run.skipped_steps``.

Conventions shared by all readers:

- Values: a value the log writes (NaN and inf included) is recorded as written; a value the log
  does not write for a step (absent key, empty cell, ``null``) is left out. Nothing is filled in.
- Restarts: a restarted job repeats steps. When a log's step goes *backwards* (to ``s`` below the
  last step read), every value already read at a step ``>= s`` is discarded: the later run wins,
  also over steps it never reaches (they belong to the abandoned trajectory). A value written again
  at the same step replaces the earlier one. ``Run.restarts`` and ``Run.dropped_values`` count this.
  TensorBoard applies the rule per tag and per event file (files in time order), long-form JSONL
  lines per metric.
- Step numbering: ``Run.step_base`` is the number a log gives its first optimizer step: 1 for
  Megatron, HF, torchtitan, MindFormers, lossparity; 0 for MaxText (console, TensorBoard with
  ``learning/*`` tags, metrics file). The comparison aligns ``step - step_base``.
- Console formats interleave unrelated text: such lines are skipped and counted in
  ``Run.skipped_lines``. A line that starts like a metric line but cannot be parsed raises
  :class:`LogParseError` (file, 1-based line number, what was expected); so does any bad line or
  entry in the structured formats.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from .names import canonical_name

FORMATS: tuple[str, ...] = (
    "megatron",
    "tensorboard",
    "jsonl",
    "csv",
    "megatron_golden",
    "hf_trainer_state",
    "maxtext",
    "torchtitan",
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
    "json": "jsonl",
}


class LogParseError(ValueError):
    """A log that cannot be read: names the file, the 1-based line (when known) and what was expected."""

    def __init__(self, path: str, line: int | None, expected: str, where: str | None = None):
        self.path, self.line, self.expected, self.where = str(path), line, expected, where
        loc = self.path if line is None else f"{self.path}:{line}"
        if where:
            loc += f" ({where})"
        super().__init__(f"{loc}: expected {expected}")


@dataclass
class Run:
    """The metrics of one training run, keyed by canonical metric name.

    ``metrics[name][step] = value`` (see the module docstring for missing/NaN values, restarts and
    step numbering). ``consumed_samples[step]`` is the number of samples consumed up to and
    including ``step`` when the log states it. ``raw_names[name]`` is the name in the log.
    """

    source: str
    format: str
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)
    consumed_samples: dict[int, float] = field(default_factory=dict)
    step_base: int = 1
    skipped_lines: int = 0
    skipped_steps: set[int] = field(default_factory=set)
    restarts: int = 0
    dropped_values: int = 0
    raw_names: dict[str, str] = field(default_factory=dict)

    def steps(self) -> list[int]:
        """Sorted union of the steps at which any metric has a value."""
        return sorted({s for values in self.metrics.values() for s in values})

    def with_constant_batch_size(self, global_batch_size: int) -> Run:
        """Copy of the run with ``consumed_samples[s] = (s - step_base + 1) · global_batch_size``.

        For logs that do not state consumed samples and were trained with a fixed global batch size;
        the value counts the batch of step ``s`` itself (Megatron's convention).
        """
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        samples = {s: float((s - self.step_base + 1) * global_batch_size) for s in self.steps()}
        return replace(self, consumed_samples=samples)


# ---------------------------------------------------------------------------------------------------
# recording (name mapping, restart rule)


def _drop_from(values: dict[int, float], step: int) -> int:
    """Delete the entries at steps ``>= step``; return how many were deleted."""
    stale = [s for s in values if s >= step]
    for s in stale:
        del values[s]
    return len(stale)


class _Recorder:
    """Collects values for one run and applies the name map and the restart rule."""

    def __init__(self, path: str, fmt: str, name_map: Mapping[str, str] | None, step_base: int = 1):
        self.path, self.fmt, self.name_map = path, fmt, name_map
        self.metrics: dict[str, dict[int, float]] = {}
        self.samples: dict[int, float] = {}
        self.raw_names: dict[str, str] = {}
        self.skipped_steps: set[int] = set()
        self.step_base = step_base
        self.skipped_lines = 0
        self.restarts = 0
        self.dropped = 0
        self._last_step: int | None = None
        self._last_by_metric: dict[str, int] = {}

    def begin(self, step: int) -> None:
        """Start a record at ``step``; a step below the last one read is a restart."""
        if self._last_step is not None and step < self._last_step:
            self.restarts += 1
            for values in self.metrics.values():
                self.dropped += _drop_from(values, step)
            _drop_from(self.samples, step)
            self.skipped_steps = {s for s in self.skipped_steps if s < step}
        self._last_step = step

    def name(self, raw: str, line: int | None = None) -> str | None:
        name = canonical_name(raw, self.name_map)
        if name is None:
            return None
        prev = self.raw_names.setdefault(name, raw)
        if prev != raw:
            raise LogParseError(
                self.path, line,
                f"one log name per metric, but {prev!r} and {raw!r} both map to {name!r} "
                "(rename one with a name map)",
            )
        return name

    def put(self, raw: str, step: int, value: float, line: int | None = None) -> None:
        name = self.name(raw, line)
        if name is not None:
            self.metrics.setdefault(name, {})[step] = value

    def put_ordered(self, raw: str, step: int, value: float, line: int | None = None) -> None:
        """Add one value with the restart rule applied to this metric alone (one metric per record)."""
        is_samples = raw in _SAMPLES_KEYS
        name = _SAMPLES_KEYS[0] if is_samples else self.name(raw, line)
        if name is None:
            return
        values = self.samples if is_samples else self.metrics.setdefault(name, {})
        last = self._last_by_metric.get(name)
        if last is not None and step < last:
            self.restarts += 1
            dropped = _drop_from(values, step)
            self.dropped += 0 if is_samples else dropped
        self._last_by_metric[name] = step
        values[step] = value

    def put_series(self, raw: str, points: Iterable[tuple[int, float]]) -> None:
        """Add one tag's series from one file: replaces that tag's values from its first step on."""
        points = sorted(points)
        name = self.name(raw)
        if name is None or not points:
            return
        values = self.metrics.setdefault(name, {})
        dropped = _drop_from(values, points[0][0])
        self.restarts += int(dropped > 0)
        self.dropped += dropped
        values.update(points)

    def run(self) -> Run:
        return Run(
            source=self.path,
            format=self.fmt,
            metrics={k: dict(sorted(v.items())) for k, v in self.metrics.items() if v},
            consumed_samples=dict(sorted(self.samples.items())),
            step_base=self.step_base,
            skipped_lines=self.skipped_lines,
            skipped_steps=set(self.skipped_steps),
            restarts=self.restarts,
            dropped_values=self.dropped,
            raw_names={k: v for k, v in self.raw_names.items() if self.metrics.get(k)},
        )


# ---------------------------------------------------------------------------------------------------
# value helpers

_NUM_PREFIX_RE = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
              "infinity": math.inf, "+infinity": math.inf, "-infinity": -math.inf}


def _to_float(text: str) -> float | None:
    """Plain float of a token (``1.2E+00``, ``nan``, ``inf``), or ``None``."""
    t = text.strip()
    if t.lower() in _NONFINITE:
        return _NONFINITE[t.lower()]
    try:
        return float(t)
    except ValueError:
        return None


def _to_float_loose(text: str) -> float | None:
    """Float of a console token with decoration: ``1,234``, ``5.7%``, ``123ms``, ``[1.5]``, ``10GiB(..)``."""
    t = text.strip().strip("[]").replace(",", "").strip()
    v = _to_float(t)
    if v is not None:
        return v
    m = _NUM_PREFIX_RE.match(t)
    return float(m.group(0)) if m else None


def _json_number(value: object) -> float | None:
    """Numeric value of a JSON scalar (bools and other strings are labels, ``None`` = missing)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return _NONFINITE[value.strip().lower()]
    return None


def _int_step(value: object) -> int | None:
    """Integer step of a JSON/CSV value (``3``, ``3.0``, ``"3"``), or ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        v = _to_float(value)
        value = v if v is not None else value
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return None


def _lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for i, line in enumerate(f, start=1):
            yield i, line.rstrip("\r\n").replace("\r", "")


# ---------------------------------------------------------------------------------------------------
# Megatron-LM text log

_MEG_START_RE = re.compile(r"\biteration\s+\d+\s*/")
_MEG_LINE_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_MEG_SAMPLES = "consumed samples"
_MEG_COUNTS = ("number of skipped iterations", "number of nan iterations")
_MEG_NUMERIC = (_MEG_SAMPLES, *_MEG_COUNTS, "learning rate", "global batch size", "grad norm",
                "loss scale", "num zeros", "params norm", "elapsed time per iteration (ms)")


def _read_megatron(path: str, rec: _Recorder) -> None:
    for ln, line in _lines(path):
        if not _MEG_START_RE.search(line):
            rec.skipped_lines += 1
            continue
        m = _MEG_LINE_RE.search(line)
        if m is None:
            raise LogParseError(path, ln, "a Megatron line 'iteration N/ M | name: value | ...'")
        step = int(m.group(1))
        rec.begin(step)
        for fld in m.group(3).split("|"):
            fld = fld.strip()
            if not fld:
                continue
            key, sep, text = fld.partition(":")
            key = key.strip()
            if not sep or not key:
                raise LogParseError(path, ln, f"'name: value' between '|', got {fld!r}")
            value = _to_float(text)
            if value is None:
                # forks append non-numeric fields (ETA strings); only known numeric ones must parse
                if key in _MEG_NUMERIC or "loss" in key:
                    raise LogParseError(path, ln, f"a number for {key!r}, got {text.strip()!r}")
                continue
            if key == _MEG_SAMPLES:
                rec.samples[step] = value
            elif key in _MEG_COUNTS:
                if value > 0:
                    rec.skipped_steps.add(step)
            else:
                rec.put(key, step, value, ln)


# ---------------------------------------------------------------------------------------------------
# console formats: MaxText, torchtitan, MindFormers

_MAXTEXT_RE = re.compile(r"completed step:\s*(\S+?)\s*(?:,(.*))?$")
_MAXTEXT_REQUIRED = ("loss", "lm_loss", "total_weights")


def _read_maxtext(path: str, rec: _Recorder) -> None:
    for ln, line in _lines(path):
        m = _MAXTEXT_RE.search(line)
        if m is None:
            rec.skipped_lines += 1
            continue
        step = _int_step(m.group(1))
        if step is None:
            raise LogParseError(path, ln, f"an integer after 'completed step:', got {m.group(1)!r}")
        rec.begin(step)
        for fld in (m.group(2) or "").split(","):
            if not fld.strip():
                continue
            key, sep, text = fld.partition(":")
            key = key.strip()
            if not sep or not key:
                raise LogParseError(path, ln, f"'name: value' between commas, got {fld.strip()!r}")
            value = _to_float(text)
            if value is None:
                if key in _MAXTEXT_REQUIRED or key.endswith("loss"):
                    raise LogParseError(path, ln, f"a number for {key!r}, got {text.strip()!r}")
                continue
            rec.put(key, step, value, ln)


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# "step:" as the first token of the message: after a log prefix ending in '-', ']' or '|', or at the start
_TITAN_START_RE = re.compile(r"(?:^|[-\]|])\s*step:")
_TITAN_LINE_RE = re.compile(r"(?:^|[-\]|])\s*step:\s*(\d+)\s+(loss:.*)$")
_TITAN_FIELD_RE = re.compile(r"([A-Za-z_][\w/]*):\s*(\S+)")
_TITAN_REQUIRED = ("loss", "grad_norm")


def _read_torchtitan(path: str, rec: _Recorder) -> None:
    for ln, raw_line in _lines(path):
        line = _ANSI_RE.sub("", raw_line)
        if not _TITAN_START_RE.search(line):
            rec.skipped_lines += 1
            continue
        m = _TITAN_LINE_RE.search(line)
        if m is None:
            raise LogParseError(path, ln, "a torchtitan line 'step: N  loss: x  ...'")
        step = int(m.group(1))
        rec.begin(step)
        for key, text in _TITAN_FIELD_RE.findall(m.group(2)):
            value = _to_float_loose(text)
            if value is None:
                if key in _TITAN_REQUIRED:
                    raise LogParseError(path, ln, f"a number for {key!r}, got {text!r}")
                continue
            rec.put(key, step, value, ln)


_MF_START_RE = re.compile(r"Epoch:\s*\[")
_MF_LINE_RE = re.compile(
    r"Epoch:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,\s*step:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,?(.*)$"
)
_MF_FIELD_RE = re.compile(r"([A-Za-z_][\w ]*?)\s*:\s*(\[[^\]]*\]|[^,]*)")
_MF_REQUIRED = ("loss", "global_norm", "lr", "loss_scale")


def _read_mindformers(path: str, rec: _Recorder) -> None:
    for ln, line in _lines(path):
        if not _MF_START_RE.search(line):
            rec.skipped_lines += 1
            continue
        m = _MF_LINE_RE.search(line)
        if m is None:
            raise LogParseError(path, ln, "a MindFormers line '{ Epoch:[e/E], step:[s/S], loss: x, ...'")
        epoch, step_in_epoch, per_epoch = int(m.group(1)), int(m.group(3)), int(m.group(4))
        step = (epoch - 1) * per_epoch + step_in_epoch
        rec.begin(step)
        for key, text in _MF_FIELD_RE.findall(m.group(5)):
            key, text = key.strip(), text.strip()
            if key == "overflow cond":
                if text not in ("True", "False"):
                    raise LogParseError(path, ln, f"True or False for 'overflow cond', got {text!r}")
                if text == "True":
                    rec.skipped_steps.add(step)
                continue
            if text.startswith("[") and "," in text:
                raise LogParseError(path, ln, f"one number for {key!r}, got {text!r}")
            value = _to_float_loose(text)
            if value is None:
                if key in _MF_REQUIRED or key.endswith("loss"):
                    raise LogParseError(path, ln, f"a number for {key!r}, got {text!r}")
                continue
            rec.put(key, step, value, ln)


# ---------------------------------------------------------------------------------------------------
# structured formats: JSONL, CSV, golden values, trainer_state.json

_SAMPLES_KEYS = ("consumed_samples", "consumed samples")
_MAXTEXT_KEY_PREFIXES = ("learning/", "perf/")


def _read_jsonl(path: str, rec: _Recorder) -> None:
    for ln, line in _lines(path):
        if not line.strip():
            rec.skipped_lines += 1
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LogParseError(path, ln, f"one JSON object per line ({e.msg})") from None
        if not isinstance(obj, dict) or "step" not in obj:
            raise LogParseError(path, ln, "a JSON object with a 'step' key")
        step = _int_step(obj["step"])
        if step is None:
            raise LogParseError(path, ln, f"an integer 'step', got {obj['step']!r}")
        if any(k.startswith(_MAXTEXT_KEY_PREFIXES) for k in obj):
            rec.step_base = 0
        long_key = "metric" if "metric" in obj else "name" if "name" in obj else None
        if long_key is not None and "value" in obj:
            # one metric per line: a file may list whole series one after another, so a step going
            # backwards is a restart only within the same metric
            if not isinstance(obj[long_key], str):
                raise LogParseError(path, ln, f"a string {long_key!r}, got {obj[long_key]!r}")
            value = _json_number(obj["value"])
            if value is None and obj["value"] is not None:
                raise LogParseError(path, ln, f"a number 'value', got {obj['value']!r}")
            if value is not None:
                rec.put_ordered(obj[long_key], step, value, ln)
            continue
        rec.begin(step)
        for key, raw_value in obj.items():
            value = _json_number(raw_value)
            if key == "step" or value is None:
                continue
            if key in _SAMPLES_KEYS:
                rec.samples[step] = value
            else:
                rec.put(key, step, value, ln)


_CSV_STEP_COLUMNS = ("step", "_step", "global_step", "trainer/global_step", "iteration")


def _read_csv(path: str, rec: _Recorder) -> None:
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise LogParseError(path, 1, "a CSV header row")
        lowered = [h.strip().lower() for h in header]
        step_col = next((lowered.index(c) for c in _CSV_STEP_COLUMNS if c in lowered), None)
        if step_col is None:
            raise LogParseError(path, 1, f"a step column (one of {', '.join(_CSV_STEP_COLUMNS)})")
        columns: dict[int, str] = {}
        for i, h in enumerate(header):
            h = h.strip()
            if i == step_col or not h or h.endswith(("__MIN", "__MAX")):
                continue
            columns[i] = h.rsplit(" - ", 1)[-1] if " - " in h else h
        if len(set(columns.values())) < len(columns):  # W&B prefix removal made names collide
            columns = {i: header[i].strip() for i in columns}
        rows: list[tuple[int, int, dict[int, float]]] = []
        first_text: dict[int, int] = {}
        numeric_cols: set[int] = set()
        for row in reader:
            ln = reader.line_num
            if not any(c.strip() for c in row):
                rec.skipped_lines += 1
                continue
            if len(row) > len(header):
                raise LogParseError(path, ln, f"at most {len(header)} cells, got {len(row)}")
            step = _int_step(row[step_col].strip()) if step_col < len(row) else None
            if step is None:
                cell = row[step_col] if step_col < len(row) else ""
                raise LogParseError(path, ln, f"an integer step in column {header[step_col]!r}, got {cell!r}")
            values: dict[int, float] = {}
            for i in columns:
                cell = row[i].strip() if i < len(row) else ""
                if not cell:
                    continue
                v = _to_float(cell)
                if v is None:
                    first_text.setdefault(i, ln)
                else:
                    values[i] = v
                    numeric_cols.add(i)
            rows.append((ln, step, values))
        for i, ln in first_text.items():
            if i in numeric_cols:
                raise LogParseError(path, ln, f"a number or an empty cell in column {header[i]!r}")
        for ln, step, values in rows:
            rec.begin(step)
            for i, v in values.items():
                if columns[i] in _SAMPLES_KEYS:
                    rec.samples[step] = v
                else:
                    rec.put(columns[i], step, v, ln)


def _load_json(path: str) -> object:
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise LogParseError(path, e.lineno, f"valid JSON ({e.msg})") from None


def _read_megatron_golden(path: str, rec: _Recorder) -> None:
    data = _load_json(path)
    if not isinstance(data, dict) or not data:
        raise LogParseError(
            path, None, "a JSON object {metric: {start_step, end_step, step_interval, values}}"
        )
    for metric, spec in data.items():
        if not isinstance(spec, dict) or "values" not in spec:
            raise LogParseError(path, None, "an object with 'values'", where=f"metric {metric!r}")
        values = spec["values"]
        if isinstance(values, list):
            try:
                start, interval = int(spec["start_step"]), int(spec["step_interval"])
            except (KeyError, TypeError, ValueError):
                raise LogParseError(
                    path, None, "integer 'start_step' and 'step_interval' for a list of values",
                    where=f"metric {metric!r}",
                ) from None
            items = [(start + i * interval, v) for i, v in enumerate(values)]
        elif isinstance(values, dict):
            items = []
            for key, v in values.items():
                step = _int_step(key)
                if step is None:
                    raise LogParseError(
                        path, None, f"integer step keys, got {key!r}", where=f"metric {metric!r}"
                    )
                items.append((step, v))
        else:
            raise LogParseError(path, None, "'values' as an object or a list", where=f"metric {metric!r}")
        points = []
        for step, v in items:
            value = _json_number(v)
            if value is None:
                raise LogParseError(path, None, f"a number or \"nan\" at step {step}, got {v!r}",
                                    where=f"metric {metric!r}")
            points.append((step, value))
        rec.put_series(metric, points)


def _read_hf_trainer_state(path: str, rec: _Recorder) -> None:
    data = _load_json(path)
    history = data.get("log_history") if isinstance(data, dict) else None
    if not isinstance(history, list):
        raise LogParseError(path, None, "a JSON object with a 'log_history' list")
    for i, entry in enumerate(history):
        if not isinstance(entry, dict) or "step" not in entry:
            raise LogParseError(path, None, "an object with a 'step'", where=f"log_history[{i}]")
        step = _int_step(entry["step"])
        if step is None:
            raise LogParseError(
                path, None, f"an integer 'step', got {entry['step']!r}", where=f"log_history[{i}]"
            )
        rec.begin(step)
        for key, raw_value in entry.items():
            value = _json_number(raw_value)
            if key != "step" and value is not None:
                rec.put(key, step, value)


# ---------------------------------------------------------------------------------------------------
# TensorBoard

_TB_SAMPLES_SUFFIX = " vs samples"
_TB_EVENTS_RE = re.compile(r"tfevents\.(\d+)")


def _event_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names if "tfevents" in f]

    def order(p: str) -> tuple[int, str]:
        m = _TB_EVENTS_RE.search(os.path.basename(p))
        return (int(m.group(1)) if m else int(os.path.getmtime(p)), p)

    return sorted(files, key=order)


def _read_tensorboard(path: str, rec: _Recorder) -> None:
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
        from tensorboard.util import tensor_util
    except ImportError:
        raise ImportError(
            f"reading the TensorBoard log {path} needs the 'tensorboard' package (lossparity[tensorboard])"
        ) from None
    files = _event_files(path)
    if not files:
        raise LogParseError(path, None, "TensorBoard event files (*tfevents*)")
    for file in files:
        acc = ea.EventAccumulator(file, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        try:
            acc.Reload()
        except Exception as e:  # corrupt records surface as assorted protobuf/IO errors
            raise LogParseError(file, None, f"a readable TensorBoard event file ({e})") from None
        tags = acc.Tags()
        series: dict[str, list[tuple[int, float]]] = {}
        for tag in tags.get("scalars", []):
            series[tag] = [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]
        for tag in tags.get("tensors", []):
            points = []
            for e in acc.Tensors(tag):
                arr = tensor_util.make_ndarray(e.tensor_proto)
                if arr.size != 1 or arr.dtype.kind not in "fiu":
                    break
                points.append((int(e.step), float(arr.reshape(()))))
            else:
                series.setdefault(tag, points)
        if any(t.startswith(_MAXTEXT_KEY_PREFIXES) for t in series):
            rec.step_base = 0
        samples: dict[int, float] = {}
        for tag, points in series.items():
            if tag.endswith(_TB_SAMPLES_SUFFIX):
                base = series.get(tag[: -len(_TB_SAMPLES_SUFFIX)])
                # both series are monotone in time, so the i-th points belong to the same iteration
                if base is not None and len(base) == len(points) and not samples:
                    samples = {s: float(x) for (s, _), (x, _) in zip(sorted(base), sorted(points))}
                continue
            rec.put_series(tag, points)
        if samples:
            _drop_from(rec.samples, min(samples))
            rec.samples.update(samples)


# ---------------------------------------------------------------------------------------------------
# detection and entry point

_READERS = {
    "megatron": _read_megatron,
    "tensorboard": _read_tensorboard,
    "jsonl": _read_jsonl,
    "csv": _read_csv,
    "megatron_golden": _read_megatron_golden,
    "hf_trainer_state": _read_hf_trainer_state,
    "maxtext": _read_maxtext,
    "torchtitan": _read_torchtitan,
    "mindformers": _read_mindformers,
}

_STEP_BASE = {"maxtext": 0}
_DETECT_MAX_LINES = 5000


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
        if "step" in data:
            return "jsonl"
        if data and all(isinstance(v, dict) and "values" in v for v in data.values()):
            return "megatron_golden"
    return None


def _detect_json(path: str, first: str) -> str | None:
    """``jsonl`` / ``hf_trainer_state`` / ``megatron_golden`` from the first line or the whole file."""
    if not first.startswith("{"):
        return None
    try:
        return _json_kind(json.loads(first))  # JSONL, or a document written on one line
    except json.JSONDecodeError:
        pass
    try:  # a pretty-printed document
        with open(path, encoding="utf-8") as f:
            return _json_kind(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def detect_format(path: str | os.PathLike[str]) -> str:
    """Name of the log format of ``path`` (one of :data:`FORMATS`).

    A directory or a ``*tfevents*`` file is ``tensorboard``. A file holding one JSON document is
    ``hf_trainer_state`` (has ``log_history``) or ``megatron_golden`` (every value has ``values``).
    A file whose first non-blank line is a JSON object with ``step`` is ``jsonl``; a first line that
    is a CSV header with a step column is ``csv``. Otherwise the first of its first 5000 lines that
    looks like a Megatron, MindFormers, MaxText or torchtitan metric line decides. Raises
    :class:`LogParseError` when nothing matches and ``FileNotFoundError`` when ``path`` is missing.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"path: log {p} does not exist")
    if os.path.isdir(p):
        if _event_files(p):
            return "tensorboard"
        raise LogParseError(p, None, "a directory with TensorBoard event files (*tfevents*)")
    if "tfevents" in os.path.basename(p):
        return "tensorboard"
    with open(p, encoding="utf-8", errors="replace", newline="") as f:
        head_lines = [line for _, line in zip(range(_DETECT_MAX_LINES), f)]
    first = next((line.strip() for line in head_lines if line.strip()), "")
    fmt = _detect_json(p, first)
    if fmt is not None:
        return fmt
    if "," in first:
        cols = [c.strip().strip('"').lower() for c in next(csv.reader([first]))]
        if any(c in _CSV_STEP_COLUMNS for c in cols):
            return "csv"
    for line in head_lines:
        if _MEG_START_RE.search(line):
            return "megatron"
        if _MF_START_RE.search(line) and "step:" in line:
            return "mindformers"
        if "completed step:" in line:
            return "maxtext"
        if _TITAN_START_RE.search(_ANSI_RE.sub("", line)):
            return "torchtitan"
    raise LogParseError(
        p, None, f"a known log format in the first {_DETECT_MAX_LINES} lines ({', '.join(FORMATS)}); "
        "pass the format explicitly"
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
    numbering and skipped lines follow the conventions in this module's docstring. Raises
    :class:`LogParseError` for a malformed log and ``FileNotFoundError`` for a missing one.
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"path: log {p} does not exist")
    key = detect_format(p) if fmt is None else _normalize_format(fmt)
    rec = _Recorder(p, key, name_map, step_base=_STEP_BASE.get(key, 1))
    _READERS[key](p, rec)
    return rec.run()
