"""Readers of structured logs: JSONL (lossparity, MaxText metrics, LLaMA-Factory), CSV (W&B exports), Megatron
golden values, Hugging Face ``trainer_state.json`` and TensorBoard event files.

Every reader follows the conventions of :mod:`lossparity.parity.readers`. A string where a canonical metric
(or any ``*loss*`` key) needs a number is an error naming the line or entry, never silently dropped.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Callable
from typing import Any

from ._record import SAMPLES_KEYS, LogParseError, Recorder, _drop_from, int_step, json_number, lines, to_float

__all__ = [
    "read_jsonl",
    "read_llamafactory",
    "read_csv",
    "read_megatron_golden",
    "read_hf_trainer_state",
    "read_tensorboard",
    "event_files",
    "is_lfs_pointer",
    "load_json",
    "CSV_STEP_COLUMNS",
    "MAXTEXT_KEY_PREFIXES",
]

MAXTEXT_KEY_PREFIXES = ("learning/", "perf/")
_LFS_MAGIC = b"version https://git-lfs.github.com/spec/"


def is_lfs_pointer(path: str) -> bool:
    """Whether ``path`` is a Git LFS pointer file (what a clone without git-lfs holds instead of the content)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(_LFS_MAGIC)) == _LFS_MAGIC
    except OSError:
        return False


def lfs_error(path: str, what: str) -> LogParseError:
    """The error for an LFS pointer given where ``what`` was expected."""
    return LogParseError(
        path,
        1,
        f"{what}, but the file is a Git LFS pointer (the content was never fetched: run "
        "`git lfs pull` in its repository)",
    )


def _json_value(
    rec: Recorder, path: str, key: str, raw: object, ln: int | None, where: str | None = None
) -> float | None:
    """Number of a JSON value; ``None`` for labels; a non-number for a strict key raises."""
    value = json_number(raw)
    if value is None and raw is not None and rec.strict(key):
        raise LogParseError(path, ln, f"a number for {key!r}, got {raw!r}", where=where)
    return value


# ---------------------------------------------------------------------------------------------------
# JSONL


def _jsonl_objects(path: str, rec: Recorder) -> list[tuple[int, dict[str, object]]]:
    out = []
    for ln, line, complete in lines(path):
        if not line.strip():
            rec.skipped_lines += 1
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if not complete:
                rec.torn(ln)
                continue
            raise LogParseError(path, ln, f"one JSON object per line ({e.msg})") from None
        if not isinstance(obj, dict):
            raise LogParseError(path, ln, "a JSON object")
        out.append((ln, obj))
    return out


def _read_json_lines(path: str, rec: Recorder, step_key: str) -> None:
    for ln, obj in _jsonl_objects(path, rec):
        if step_key not in obj:
            raise LogParseError(path, ln, f"a JSON object with a {step_key!r} key")
        step = int_step(obj[step_key])
        if step is None:
            raise LogParseError(path, ln, f"an integer {step_key!r}, got {obj[step_key]!r}")
        if any(k.startswith(MAXTEXT_KEY_PREFIXES) for k in obj):
            rec.step_base = 0
        long_key = "metric" if "metric" in obj else "name" if "name" in obj else None
        if long_key is not None and "value" in obj:
            # one metric per line: a file may list whole series one after another, so a step going
            # backwards is a restart only within the same metric
            name = obj[long_key]
            if not isinstance(name, str):
                raise LogParseError(path, ln, f"a string {long_key!r}, got {name!r}")
            value = _json_value(rec, path, name, obj["value"], ln)
            if value is None and obj["value"] is not None:
                raise LogParseError(path, ln, f"a number 'value', got {obj['value']!r}")
            if value is not None:
                rec.put_ordered(name, step, value, ln)
            continue
        rec.begin(step)
        for key, raw in obj.items():
            value = None if key == step_key else _json_value(rec, path, key, raw, ln)
            if value is not None:
                rec.put(key, step, value, ln)


def read_jsonl(path: str, rec: Recorder) -> None:
    """One JSON object per line with a ``step`` (see :mod:`lossparity.parity.readers`)."""
    _read_json_lines(path, rec, "step")


def read_llamafactory(path: str, rec: Recorder) -> None:
    """LLaMA-Factory ``trainer_log.jsonl``: the step is ``current_steps`` (the HF Trainer's global step)."""
    _read_json_lines(path, rec, "current_steps")


# ---------------------------------------------------------------------------------------------------
# CSV

# preferred first: an optimizer step written by the trainer, then generic names, then W&B's own counter
CSV_STEP_COLUMNS = ("train/global_step", "trainer/global_step", "global_step", "step", "iteration", "_step")
_WANDB_STEP_HEADERS = ("Step", "_step")


def _csv_columns(header: list[str], step_col: int) -> dict[int, str]:
    columns: dict[int, str] = {}
    for i, h in enumerate(header):
        h = h.strip()
        if i == step_col or not h or h.endswith(("__MIN", "__MAX")):
            continue
        columns[i] = h.rsplit(" - ", 1)[-1] if " - " in h else h
    if len(set(columns.values())) < len(columns):  # W&B prefix removal made names collide
        columns = {i: header[i].strip() for i in columns}
    return columns


def _csv_rows(
    path: str, reader: Any, header: list[str], step_col: int, columns: dict[int, str], rec: Recorder
) -> list[tuple[int, int, dict[int, float]]]:
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
        cell = row[step_col].strip() if step_col < len(row) else ""
        step = int_step(cell)
        if step is None:
            raise LogParseError(path, ln, f"an integer step in column {header[step_col]!r}, got {cell!r}")
        values: dict[int, float] = {}
        for i in columns:
            text = row[i].strip() if i < len(row) else ""
            v = to_float(text) if text else None
            if v is not None:
                values[i] = v
                numeric_cols.add(i)
            elif text:
                first_text.setdefault(i, ln)
        rows.append((ln, step, values))
    for i, ln in first_text.items():
        if i in numeric_cols or rec.strict(columns[i]):
            raise LogParseError(path, ln, f"a number or an empty cell in column {header[i]!r}")
    return rows


def _csv_text(path: str, rec: Recorder) -> str:
    """The file's text; a last row without a newline and with fewer cells than the header (a table still
    being written) is removed with a note."""
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        text = f.read()
    if text.endswith(("\n", "\r")) or "\n" not in text:
        return text
    head, _, last = text.rpartition("\n")
    header = next(csv.reader([text.partition("\n")[0]]), [])
    if len(next(csv.reader([last]), [])) < len(header):
        rec.torn(head.count("\n") + 2)
        return head + "\n"
    return text


def read_csv(path: str, rec: Recorder) -> None:
    """A table with a step column, e.g. a W&B export (see :mod:`lossparity.parity.readers`)."""
    reader = csv.reader(io.StringIO(_csv_text(path, rec), newline=""))
    header = next(reader, None)
    if header is None:
        raise LogParseError(path, 1, "a CSV header row")
    lowered = [h.strip().lower() for h in header]
    step_col = next((lowered.index(c) for c in CSV_STEP_COLUMNS if c in lowered), None)
    if step_col is None:
        raise LogParseError(path, 1, f"a step column (one of {', '.join(CSV_STEP_COLUMNS)})")
    columns = _csv_columns(header, step_col)
    rows = _csv_rows(path, reader, header, step_col, columns, rec)
    if header[step_col].strip() in _WANDB_STEP_HEADERS and rows and min(s for _, s, _ in rows) == 0:
        rec.step_base = 0
        rec.note(
            f"column {header[step_col].strip()!r} is W&B's step counter and starts at 0: first step 0 "
            "(override with --ref-step-base/--cand-step-base)"
        )
    for ln, step, values in rows:
        rec.begin(step)
        for i, v in values.items():
            rec.put(columns[i], step, v, ln)


# ---------------------------------------------------------------------------------------------------
# JSON documents: golden values, trainer_state.json


def load_json(path: str) -> object:
    """The parsed JSON document; a broken or empty one raises naming line and column."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise LogParseError(path, None, "a JSON document, got an empty file")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LogParseError(
            path,
            e.lineno,
            f"valid JSON: the file is JSON but broken at line {e.lineno} column {e.colno} ({e.msg}; truncated?)",
        ) from None


def _golden_items(path: str, metric: str, spec: dict[str, object]) -> list[tuple[int, object]]:
    values = spec["values"]
    where = f"metric {metric!r}"
    if isinstance(values, dict):
        items = []
        for key, v in values.items():
            step = int_step(key)
            if step is None:
                raise LogParseError(path, None, f"integer step keys, got {key!r}", where=where)
            items.append((step, v))
        return items
    if not isinstance(values, list):
        raise LogParseError(path, None, "'values' as an object or a list", where=where)
    try:
        start, interval = int(spec["start_step"]), int(spec["step_interval"])  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError):
        raise LogParseError(
            path, None, "integer 'start_step' and 'step_interval' for a list of values", where=where
        ) from None
    # legacy list form: values[i] is TensorBoard event start + i·interval (0-based), i.e. iteration +1
    return [(start + i * interval + 1, v) for i, v in enumerate(values)]


def read_megatron_golden(path: str, rec: Recorder) -> None:
    """Megatron functional-test golden values (see :mod:`lossparity.parity.readers`)."""
    data = load_json(path)
    if not isinstance(data, dict) or not data:
        raise LogParseError(path, None, "a JSON object {metric: {start_step, end_step, step_interval, values}}")
    missing = 0
    for metric, spec in data.items():
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            rec.note(f"top-level scalar {metric!r} is not a per-step series: ignored")
            continue
        if not isinstance(spec, dict) or "values" not in spec:
            raise LogParseError(path, None, "an object with 'values'", where=f"metric {metric!r}")
        if isinstance(spec["values"], list):
            rec.note(f"{metric!r}: legacy list form, values[i] at iteration start_step + i·step_interval + 1")
        points = []
        for step, v in _golden_items(path, metric, spec):
            if isinstance(v, str) and v.strip().lower() == "nan":
                missing += 1  # Megatron writes the string "nan" for a step the run did not log
                continue
            value = json_number(v)
            if value is None:
                raise LogParseError(
                    path, None, f'a number or "nan" at step {step}, got {v!r}', where=f"metric {metric!r}"
                )
            points.append((step, value))
        rec.put_series(metric, points)
    if missing:
        rec.note(f'{missing} value(s) written as the string "nan" (steps the run did not log) are missing')


_HF_EVAL_PREFIXES = ("eval_", "predict_", "test_")
_HF_SUMMARY_KEYS = ("train_runtime", "train_loss")


def _hf_entry_kind(entry: dict[str, object]) -> str:
    metrics = [k for k in entry if k not in ("step", "epoch")]
    if metrics and all(k.startswith(_HF_EVAL_PREFIXES) for k in metrics):
        return "eval"
    if any(k in entry for k in _HF_SUMMARY_KEYS) and "loss" not in entry:
        return "summary"
    return "train"


def read_hf_trainer_state(path: str, rec: Recorder) -> None:
    """Hugging Face ``trainer_state.json`` (see :mod:`lossparity.parity.readers`)."""
    data = load_json(path)
    history = data.get("log_history") if isinstance(data, dict) else None
    if not isinstance(history, list):
        raise LogParseError(path, None, "a JSON object with a 'log_history' list")
    ignored: dict[str, int] = {}
    eval_keys: set[str] = set()
    for i, entry in enumerate(history):
        where = f"log_history[{i}]"
        if not isinstance(entry, dict):
            raise LogParseError(path, None, "an object", where=where)
        kind = _hf_entry_kind(entry)
        step = int_step(entry.get("step"))
        if kind == "summary" or (kind == "eval" and step is None):
            ignored[kind] = ignored.get(kind, 0) + 1
            eval_keys.update(k for k in entry if kind == "eval" and k.startswith(_HF_EVAL_PREFIXES))
            continue
        if step is None:
            raise LogParseError(path, None, f"an integer 'step', got {entry.get('step')!r}", where=where)
        rec.begin(step)
        for key, raw in entry.items():
            value = None if key == "step" else _json_value(rec, path, key, raw, None, where)
            if value is not None:
                rec.put(key, step, value)
    for kind, n in ignored.items():
        if kind == "eval":
            prefixes = sorted({p + "*" for p in _HF_EVAL_PREFIXES for k in eval_keys if k.startswith(p)})
            rec.note(
                f"{n} evaluation entries without a step ignored ({', '.join(prefixes)} metrics, e.g. "
                f"{min(eval_keys)}: evaluation results, not training steps)"
            )
        else:
            rec.note(f"{n} end-of-training summary entries ignored (train_runtime etc.: totals of the whole run)")


# ---------------------------------------------------------------------------------------------------
# TensorBoard

_TB_SAMPLES_SUFFIX = " vs samples"
_TB_EVENTS_RE = re.compile(r"tfevents\.(\d+)")


def event_files(path: str) -> list[str]:
    """The ``*tfevents*`` files of ``path`` (itself, or searched recursively), oldest first."""
    if os.path.isfile(path):
        return [path]
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names if "tfevents" in f]

    def order(p: str) -> tuple[int, str]:
        m = _TB_EVENTS_RE.search(os.path.basename(p))
        return (int(m.group(1)) if m else int(os.path.getmtime(p)), p)

    return sorted(files, key=order)


def _tb_series(acc: object, tensor_util: object) -> dict[str, list[tuple[int, float]]]:
    tags = acc.Tags()  # type: ignore[attr-defined]
    series: dict[str, list[tuple[int, float]]] = {}
    for tag in tags.get("scalars", []):
        series[tag] = [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]  # type: ignore[attr-defined]
    for tag in tags.get("tensors", []):
        points = []
        for e in acc.Tensors(tag):  # type: ignore[attr-defined]
            arr = tensor_util.make_ndarray(e.tensor_proto)  # type: ignore[attr-defined]
            if arr.size != 1 or arr.dtype.kind not in "fiu":
                break
            points.append((int(e.step), float(arr.reshape(()))))
        else:
            series.setdefault(tag, points)
    return series


def _tb_record(series: dict[str, list[tuple[int, float]]], rec: Recorder) -> None:
    if any(t.startswith(MAXTEXT_KEY_PREFIXES) for t in series):
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


def read_tensorboard(path: str, rec: Recorder) -> None:
    """TensorBoard event files (see :mod:`lossparity.parity.readers`)."""
    files = event_files(path)
    if not files:
        raise LogParseError(path, None, "TensorBoard event files (*tfevents*)")
    for file in files:
        if is_lfs_pointer(file):
            raise lfs_error(file, "a TensorBoard event file")
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
        from tensorboard.util import tensor_util
    except ImportError:
        raise ImportError(
            f"reading the TensorBoard log {path} needs the 'tensorboard' package (lossparity[tensorboard])"
        ) from None
    for file in files:
        acc = ea.EventAccumulator(file, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        try:
            acc.Reload()
        except Exception as e:  # corrupt records surface as assorted protobuf/IO errors
            raise LogParseError(file, None, f"a readable TensorBoard event file ({e})") from None
        _tb_record(_tb_series(acc, tensor_util), rec)


READERS: dict[str, Callable[[str, Recorder], None]] = {
    "jsonl": read_jsonl,
    "llamafactory": read_llamafactory,
    "csv": read_csv,
    "megatron_golden": read_megatron_golden,
    "hf_trainer_state": read_hf_trainer_state,
    "tensorboard": read_tensorboard,
}
__all__ += ["READERS", "SAMPLES_KEYS", "lfs_error"]
