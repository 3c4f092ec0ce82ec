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
from collections.abc import Callable, Iterator
from typing import Any

from ..input_files import MAX_STEP, InputFileError, loads_json, open_regular, read_capped
from ._record import (
    MAX_SERIES,
    SAMPLES_KEYS,
    LogParseError,
    Recorder,
    input_error,
    int_step,
    json_number,
    lines,
    to_float,
)

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
        with open_regular(path) as f:  # never blocks on a FIFO, never reads a device
            return f.read(len(_LFS_MAGIC)) == _LFS_MAGIC
    except (OSError, InputFileError):  # not a readable regular file: refused where it is read
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


def _jsonl_objects(path: str, rec: Recorder) -> Iterator[tuple[int, dict[str, object]]]:
    # one object at a time: the parsed objects of a long log are never all held at once
    for ln, line, complete in lines(path):
        if not line.strip():
            rec.skipped_lines += 1
            continue
        try:
            obj = loads_json(line)
        except json.JSONDecodeError as e:
            if not complete:
                rec.torn(ln)
                continue
            raise LogParseError(path, ln, f"one JSON object per line ({e.msg})") from None
        except ValueError as e:  # nested too deeply
            raise LogParseError(path, ln, f"one JSON object per line ({e})") from None
        if not isinstance(obj, dict):
            raise LogParseError(path, ln, "a JSON object")
        yield ln, obj


_UNRESOLVED, _SAMPLES = object(), object()  # a plan's name before the key's first number; consumed samples


def _record_plan(rec: Recorder, keys: tuple[str, ...], step_key: str) -> list[list[Any]]:
    """``[key, series name, strict]`` per value key of an object with these keys (the name is resolved at the
    key's first number), so the name map and strictness cost once per set of keys, not per value."""
    return [[key, _UNRESOLVED, rec.strict(key)] for key in keys if key != step_key]


def _read_json_lines(path: str, rec: Recorder, step_key: str) -> None:
    plans: dict[tuple[str, ...], list[list[Any]]] = {}
    generation = rec.generation
    for ln, obj in _jsonl_objects(path, rec):
        if step_key not in obj:
            raise LogParseError(path, ln, f"a JSON object with a {step_key!r} key")
        raw_step = obj[step_key]
        step = raw_step if type(raw_step) is int and -MAX_STEP < raw_step < MAX_STEP else int_step(raw_step)
        if step is None:
            raise LogParseError(path, ln, f"an integer {step_key!r} below 2**53, got {obj[step_key]!r}")
        if generation != rec.generation:  # a metric was renamed (an alias met its canonical name): plans stale
            plans, generation = {}, rec.generation
        keys = tuple(obj)
        plan = plans.get(keys)
        if plan is None:
            if len(plans) >= 4096:  # new keys on every line: plans are a cache (a real log has a few key sets)
                plans = {}
            if any(k.startswith(MAXTEXT_KEY_PREFIXES) for k in keys):
                rec.step_base = 0
            long_key = "metric" if "metric" in obj else "name" if "name" in obj else None
            if long_key is not None and "value" in obj:
                _put_long_form(path, rec, obj, long_key, step, ln)
                continue
            plan = plans[keys] = _record_plan(rec, keys, step_key)
        rec.begin(step)
        for entry in plan:
            key, name, strict = entry
            raw = obj[key]
            # the common case (a float) skips the scalar rules of json_number
            value = raw if type(raw) is float else json_number(raw)
            if value is None:
                if raw is not None and strict:
                    raise LogParseError(path, ln, f"a number for {key!r}, got {raw!r}")
                continue
            if name is _UNRESOLVED:
                name = entry[1] = _SAMPLES if key in SAMPLES_KEYS else rec.name(key, ln)
            if name is None:
                continue
            (rec.samples if name is _SAMPLES else rec.series(name, ln))[step] = value


def _put_long_form(path: str, rec: Recorder, obj: dict[str, object], long_key: str, step: int, ln: int) -> None:
    """One metric per line (``{"step": s, "metric": name, "value": v}``): a file may list whole series one
    after another, so a step going backwards is a restart only within the same metric."""
    name = obj[long_key]
    if not isinstance(name, str):
        raise LogParseError(path, ln, f"a string {long_key!r}, got {name!r}")
    value = _json_value(rec, path, name, obj["value"], ln)
    if value is None and obj["value"] is not None:
        raise LogParseError(path, ln, f"a number 'value', got {obj['value']!r}")
    if value is not None:
        rec.put_ordered(name, step, value, ln)


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
    try:
        text = read_capped(path).decode("utf-8-sig", errors="replace")
    except InputFileError as e:
        raise input_error(e) from None
    if text.endswith(("\n", "\r")) or "\n" not in text:
        return text
    head, _, last = text.rpartition("\n")
    try:
        header = next(csv.reader([text.partition("\n")[0]]), [])
        last_cells = next(csv.reader([last]), [])
    except csv.Error as e:
        raise LogParseError(path, None, f"a well-formed CSV table ({e})") from None
    if len(last_cells) < len(header):
        rec.torn(head.count("\n") + 2)
        return head + "\n"
    return text


def read_csv(path: str, rec: Recorder) -> None:
    """A table with a step column, e.g. a W&B export (see :mod:`lossparity.parity.readers`)."""
    reader = csv.reader(io.StringIO(_csv_text(path, rec), newline=""))
    try:
        _read_csv_table(path, reader, rec)
    except csv.Error as e:  # a cell beyond csv's field size limit, a line break inside an unquoted cell
        raise LogParseError(path, reader.line_num, f"a well-formed CSV row ({e})") from None


def _read_csv_table(path: str, reader: Any, rec: Recorder) -> None:
    header = next(reader, None)
    if header is None:
        raise LogParseError(path, 1, "a CSV header row")
    if len(header) > MAX_SERIES + 1:  # refused before the rows: the step, then at most MAX_SERIES series
        raise LogParseError(path, 1, f"at most {MAX_SERIES + 1} columns, got {len(header)}")
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
    """The parsed JSON document (a regular file of at most
    :data:`lossparity.input_files.MAX_DOCUMENT_BYTES`); a broken, empty or too deeply nested one raises
    naming line and column."""
    try:
        text = read_capped(path).decode("utf-8", errors="replace")
    except InputFileError as e:
        raise input_error(e) from None
    if not text.strip():
        raise LogParseError(path, None, "a JSON document, got an empty file")
    try:
        return loads_json(text)
    except json.JSONDecodeError as e:
        raise LogParseError(
            path,
            e.lineno,
            f"valid JSON: the file is JSON but broken at line {e.lineno} column {e.colno} ({e.msg}; truncated?)",
        ) from None
    except ValueError as e:  # nested too deeply
        raise LogParseError(path, None, f"a JSON document ({e})") from None


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
    start, interval = int_step(spec.get("start_step")), int_step(spec.get("step_interval"))
    last = None if start is None or interval is None else start + (len(values) - 1) * interval + 1
    if last is None or not (-MAX_STEP < last < MAX_STEP and start + 1 < MAX_STEP):  # type: ignore[operator]
        raise LogParseError(
            path, None, "integer 'start_step' and 'step_interval' (steps below 2**53) for a list of values", where=where
        )
    assert start is not None and interval is not None
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
_TB_EVENTS_RE = re.compile(r"tfevents\.(\d{1,18})")  # a timestamp; never int() of 5,000 digits


def event_files(path: str) -> list[str]:
    """The ``*tfevents*`` files of ``path`` (itself, or searched recursively), oldest first."""
    if os.path.isfile(path):
        return [path]
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names if "tfevents" in f]

    def order(p: str) -> tuple[int, str]:
        m = _TB_EVENTS_RE.search(os.path.basename(p))
        return (int(m.group(1)) if m else int(os.path.getmtime(p)), p)

    return sorted(files, key=order)


# TensorFlow DataType numbers of real and integer tensors (float, double, int32, uint8, int16, int8, int64,
# bfloat16, uint16, half, uint32, uint64): the dtypes a scalar summary can hold
_TB_NUMERIC_DTYPES = frozenset({1, 2, 3, 4, 5, 6, 9, 14, 17, 19, 22, 23})
_TB_MAX_DIMS = 8


def _tb_scalar(proto: Any, tensor_util: Any) -> float | None:
    """The value of a tensor summary holding one real or integer number; ``None`` for any other tensor.
    The dtype and the shape are checked before the tensor is built: a crafted shape of ``2**40``
    elements is never allocated, an unknown dtype never reaches ``make_ndarray``."""
    dims = [d.size for d in proto.tensor_shape.dim]
    if proto.dtype not in _TB_NUMERIC_DTYPES or len(dims) > _TB_MAX_DIMS or any(d != 1 for d in dims):
        return None
    try:
        arr = tensor_util.make_ndarray(proto)
        return float(arr.reshape(())) if arr.size == 1 and arr.dtype.kind in "fiu" else None
    except Exception:  # noqa: BLE001 - a malformed tensor (content of the wrong length...) is not a scalar
        return None


def _tb_step(step: int, file: str, tag: str) -> int:
    if not -MAX_STEP < step < MAX_STEP:
        raise LogParseError(file, None, f"steps below 2**53, got {step}", where=f"tag {tag!r}")
    return int(step)


def _tb_series(acc: Any, tensor_util: Any, file: str) -> dict[str, list[tuple[int, float]]]:
    tags = acc.Tags()
    series: dict[str, list[tuple[int, float]]] = {}
    for tag in tags.get("scalars", []):
        series[tag] = [(_tb_step(e.step, file, tag), float(e.value)) for e in acc.Scalars(tag)]
    for tag in tags.get("tensors", []):
        points = []
        for e in acc.Tensors(tag):
            value = _tb_scalar(e.tensor_proto, tensor_util)
            if value is None:
                break
            points.append((_tb_step(e.step, file, tag), value))
        else:
            series.setdefault(tag, points)
    return series


class _CountingLoader:
    """Wraps an event-file loader and counts the events it yields (it stops quietly at a damaged record)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.count = inner, 0

    def Load(self) -> Any:  # noqa: N802 - the loader interface of tensorboard
        for event in self.inner.Load():
            self.count += 1
            yield event


_TB_MAX_CUT_RECORD = 64 * 1024 * 1024


def _tfrecord_frames(file: str) -> tuple[int, str | None, bool]:
    """Walk the TFRecord framing of an event file (8-byte length, its 4-byte masked CRC32C, data, 4-byte CRC):
    ``(complete records, damage, cut)``. ``damage`` says where a length fails its checksum; ``cut``: the
    file ends inside its last record (a write in progress or a copy cut short). Data checksums are left to
    tensorboard's reader, which stops at the first bad one (compared by the caller)."""
    import struct

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    records = 0
    with open_regular(file) as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos < size:
            header = f.read(12)
            if len(header) < 12:
                return records, None, True
            (length,) = struct.unpack("<Q", header[:8])
            if struct.unpack("<I", header[8:])[0] != masked_crc32c(header[:8]):
                return records, f"the length of record {records + 1} (byte {pos}) fails its checksum", False
            pos += 12 + length + 4
            if pos > size:
                if length > _TB_MAX_CUT_RECORD:  # tensorboard's reader would allocate the declared length
                    return records, f"record {records + 1} declares {length} bytes, the file ends first", False
                return records, None, True
            f.seek(pos)
            records += 1
    return records, None, False


def _tb_check_frames(file: str, frames: tuple[int, str | None, bool], loaded: int | None, rec: Recorder) -> None:
    """Say what a damaged event file lost: an error for damage inside the file, a note for a cut last record.
    ``frames``: :func:`_tfrecord_frames` of the file; ``loaded``: the events tensorboard's reader yielded."""
    records, damage, cut = frames
    if damage is None and loaded is not None and loaded < records:
        damage = f"record {loaded + 1} fails its data checksum"
    if damage is not None:
        raise LogParseError(
            file,
            None,
            f"an intact TensorBoard event file: {damage}; the events after it cannot be read (damaged file)",
        )
    if cut:
        rec.live = True
        rec.note(
            f"{file}: the last record is incomplete (cut after {records} complete records; the file may still "
            "be written, or was copied before it was complete): ignored"
        )


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
        rec.samples.drop_from(min(samples))
        rec.samples.update(samples)


def read_tensorboard(path: str, rec: Recorder) -> None:
    """TensorBoard event files (see :mod:`lossparity.parity.readers`)."""
    files = event_files(path)
    if not files:
        raise LogParseError(path, None, "TensorBoard event files (*tfevents*)")
    for file in files:
        try:
            open_regular(file, "a regular TensorBoard event file").close()
        except InputFileError as e:
            raise input_error(e) from None
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
        frames = _tfrecord_frames(file)
        if frames[1] is not None:  # damaged framing: refused before tensorboard's reader sees it
            _tb_check_frames(file, frames, None, rec)
        acc = ea.EventAccumulator(file, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        loader = getattr(acc, "_generator", None)
        counting = _CountingLoader(loader) if hasattr(loader, "Load") else None
        if counting is not None:
            acc._generator = counting  # counts the events read: the loader stops quietly at damage
        try:
            acc.Reload()
        except Exception as e:  # corrupt records surface as assorted protobuf/IO errors
            raise LogParseError(file, None, f"a readable TensorBoard event file ({e})") from None
        _tb_check_frames(file, frames, None if counting is None else counting.count, rec)
        _tb_record(_tb_series(acc, tensor_util, file), rec)


READERS: dict[str, Callable[[str, Recorder], None]] = {
    "jsonl": read_jsonl,
    "llamafactory": read_llamafactory,
    "csv": read_csv,
    "megatron_golden": read_megatron_golden,
    "hf_trainer_state": read_hf_trainer_state,
    "tensorboard": read_tensorboard,
}
__all__ += ["READERS", "SAMPLES_KEYS", "lfs_error"]
