"""Hostile log files of issue 39's table (rows 1-12): builders shared by ``tests/test_hostile_inputs.py`` and
``scripts/measure_hostile_inputs.py`` (which times them and measures their peak memory).

Each builder writes its file(s) under a folder and returns :class:`Case` objects: the arguments after
``lossparity compare``, the exit code the command must end with, and a text its one stderr line (exit 2)
or its output (exit 0/1) must hold.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
MF_HEAD = "2024-05-01 10:00:05,123 - mindformers[mindformers/core/callback/callback.py:391] - INFO - "
TITAN_HEAD = "[rank0]:[titan] 2025-03-01 10:00:03,004 - root - INFO - "
MEGATRON_HEAD = (
    " [2026-03-01 10:00:02] iteration        1/      10 | consumed samples:            8 | lm loss: 1.082340E+01 |"
)


@dataclass
class Case:
    """One hostile input: ``argv`` after ``lossparity compare``, the expected exit ``code``, and ``needle``,
    a text of the one stderr line (exit 2) or of stdout (exit 0/1); ``file``: the file the line must name."""

    row: int
    name: str
    argv: list[str]
    code: int
    needle: str
    file: str | None = None


def _write(path: Path, data: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return str(path)


def _self(row: int, name: str, path: str, code: int, needle: str, fmt: str | None = None) -> Case:
    """``compare PATH PATH`` (a file against itself): a reader's error ends it before any comparison."""
    extra = [] if fmt is None else ["--format", fmt]
    return Case(row, name, [path, path, *extra], code, needle, path if code == 2 else None)


def row1(d: Path) -> list[Case]:
    """A 20 KB bracket value (once cubic in ``_ARRAY_RE``) in the four console formats."""
    pad = "[1" + " " * 20000 + "x"
    lines = {
        "megatron": f"{MEGATRON_HEAD} grad norm: {pad} |\n",
        "maxtext": f"completed step: 1, seconds: 1.0, loss: 1.5, grad_norm: {pad}\n",
        "mindformers": f"{MF_HEAD}{{ Epoch:[  1/  2], step:[    1/    3], loss: 10.8, global_norm: {pad}\n",
        "torchtitan": f"{TITAN_HEAD}step:  1  loss:  1.5  grad_norm: [1{'1' * 20000}x\n",
    }
    return [_self(1, fmt, _write(d / f"row1_{fmt}.log", line), 2, "a number for", fmt) for fmt, line in lines.items()]


def row2(d: Path) -> list[Case]:
    """A MindFormers line followed by ``a a a ...`` x20,000 (once quadratic): junk words that are no field."""
    text = MF_HEAD + "{ Epoch:[  1/  2], step:[    1/    3], loss: 10.873456, " + "a " * 20000 + "\n"
    return [_self(2, "mindformers_words", _write(d / "row2.log", text), 0, "PARITY")]


def row3(d: Path) -> list[Case]:
    """A torchtitan line followed by a 100 KB word (once quadratic): a word that is no field."""
    text = TITAN_HEAD + "step:  1  loss:  1.5  " + "w" * 100_000 + "\n"
    return [_self(3, "torchtitan_word", _write(d / "row3.log", text), 0, "PARITY")]


def row4(d: Path) -> list[Case]:
    """JSON nested 100,000 deep (once a RecursionError) in JSONL, trainer_state.json and golden values."""
    deep = "[" * 100_000 + "]" * 100_000
    return [
        _self(4, "jsonl", _write(d / "row4.jsonl", f'{{"step": 1, "loss": {deep}}}\n'), 2, "nested too deeply"),
        _self(
            4,
            "trainer_state",
            _write(d / "row4_trainer_state.json", f'{{\n"log_history": [{deep}]\n}}\n'),
            2,
            "nested too deeply",
        ),
        _self(4, "golden", _write(d / "row4_golden.json", f'{{\n"lm loss": {{"values": {deep}}}\n}}\n'), 2, "nested"),
    ]


def row5(d: Path) -> list[Case]:
    """A 400-digit integer as a step and as a value; a step of 2**63 (once OverflowErrors)."""
    big = "7" * 400
    good = (FIXTURES / "lossparity.jsonl").read_text().splitlines(keepends=True)
    return [
        _self(5, "step_400_digits", _write(d / "row5_step.jsonl", f'{{"step": {big}, "lm_loss": 1.0}}\n'), 2, "2**53"),
        _self(5, "step_2_63", _write(d / "row5_step63.jsonl", f'{{"step": {2**63}, "lm_loss": 1.0}}\n'), 2, "2**53"),
        # a value beyond float64 is the infinity a float parse gives: compared, and it fails at its step
        Case(
            5,
            "value_400_digits",
            [
                str(FIXTURES / "lossparity.jsonl"),
                _write(d / "row5_value.jsonl", "".join([good[0].replace("10.8234", big), *good[1:]])),
            ],
            1,
            "VIOLATION",
        ),
    ]


def row6(d: Path) -> list[Case]:
    """Golden values with ``start_step: Infinity`` (once an OverflowError)."""
    text = '{\n"lm loss": {"start_step": Infinity, "end_step": 5, "step_interval": 1, "values": [1.0, 2.0]}\n}\n'
    return [_self(6, "golden_infinity", _write(d / "row6_golden.json", text), 2, "start_step")]


def row7(d: Path) -> list[Case]:
    """CSV: a 200,000-character cell, a 200,000-character header, a lone carriage return in a cell."""
    cell = "x" * 200_000
    return [
        _self(7, "cell", _write(d / "row7_cell.csv", f'step,loss\n1,"{cell}"\n'), 2, "field larger", "csv"),
        _self(7, "header", _write(d / "row7_header.csv", f'step,"{cell}"\n1,2.0\n'), 2, "expected", None),
        # a lone carriage return ends the header for the line splitter, not for the csv module
        _self(7, "lone_cr", _write(d / "row7_cr.csv", "step,loss\r1,2.0\n2,3.0"), 2, "new-line character"),
    ]


def row8(d: Path) -> list[Case]:
    """Paths that are not regular files: devices and a FIFO (once a hang, 2.7 GB, or a MemoryError)."""
    fifo = d / "row8.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    out = [_self(8, "fifo", str(fifo), 2, "FIFO"), _self(8, "fifo_jsonl", str(fifo), 2, "FIFO", "jsonl")]
    for dev in ("/dev/zero", "/dev/urandom"):
        if os.path.exists(dev):
            name = os.path.basename(dev)
            out += [_self(8, name, dev, 2, "device"), _self(8, f"{name}_jsonl", dev, 2, "device", "jsonl")]
    return out


# ---------------------------------------------------------------------------------------------- TensorBoard
def _masked_crc(data: bytes) -> int:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    return int(masked_crc32c(data))


def tf_record(payload: bytes) -> bytes:
    """One TFRecord: length, masked CRC32C of the length, payload, masked CRC32C of the payload."""
    head = struct.pack("<Q", len(payload))
    return head + struct.pack("<I", _masked_crc(head)) + payload + struct.pack("<I", _masked_crc(payload))


def tb_events(scalars: dict[str, list[tuple[int, float]]], tensors: list[bytes] = ()) -> bytes:  # type: ignore[assignment]
    """An event file: a version event, one scalar event per point, then the given serialized events."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    out = [tf_record(event_pb2.Event(wall_time=1.0, file_version="brain.Event:2").SerializeToString())]
    for tag, points in scalars.items():
        for step, value in points:
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            out.append(tf_record(event_pb2.Event(wall_time=1.0 + step, step=step, summary=summary).SerializeToString()))
    out += [tf_record(t) for t in tensors]
    return b"".join(out)


def tensor_event(tag: str, step: int, dtype: int, dims: list[int], content: bytes) -> bytes:
    """A serialized event of one tensor summary with the given TensorFlow dtype number, shape and bytes."""
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2

    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in dims])
    tensor = tensor_pb2.TensorProto(dtype=dtype, tensor_shape=shape, tensor_content=content)
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=meta)
    return event_pb2.Event(wall_time=2.0, step=step, summary=summary_pb2.Summary(value=[value])).SerializeToString()


LOSSES = [(s, 10.0 - 0.5 * s) for s in range(1, 11)]


def row9(d: Path) -> list[Case]:
    """TensorBoard tensor summaries of a bad dtype and of a 2**40-element shape next to a good scalar series:
    the bad tensors are not scalars (ignored, as any non-scalar tensor), the loss is read."""
    bad = [
        tensor_event("bad_dtype", 1, 7, [], b"\x00" * 8),  # DT_STRING
        tensor_event("huge_shape", 1, 1, [2**20, 2**20], b"\x00" * 4),
        tensor_event("wrong_bytes", 1, 2, [1], b"\x00" * 3),  # a double of 3 bytes
    ]
    path = _write(d / "row9" / "events.out.tfevents.1.host", tb_events({"lm loss": LOSSES}, bad))
    return [_self(9, "tensors", str(Path(path).parent), 0, "PARITY")]


def row10(d: Path) -> list[Case]:
    """A TensorBoard file with a flipped byte in a middle record (error), and one cut inside its last record
    (read up to the cut, with a note that says so)."""
    data = tb_events({"lm loss": LOSSES})
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    damaged = _write(d / "row10_damaged" / "events.out.tfevents.1.host", bytes(flipped))
    cut = _write(d / "row10_cut" / "events.out.tfevents.1.host", data[:-7])
    return [
        _self(10, "damaged", damaged, 2, "damaged file"),
        Case(10, "cut", [str(Path(damaged).parent.parent / "row10_cut"), cut], 0, "last record is incomplete"),
    ]


def row11(d: Path) -> list[Case]:
    """A 5,000-digit integer as a console step (once Python's int-digits advice without a file)."""
    digits = "9" * 5000
    text = f" [2026-03-01 10:00:02] iteration {digits}/      10 | lm loss: 1.082340E+01 |\n"
    return [_self(11, "megatron_step", _write(d / "row11.log", text), 2, "2**53")]


MAX_CSV_COLUMNS = 10_001  # the readers' documented cap: the step and 10,000 metrics (docs/parity-tools.md)


def row12(d: Path, columns: int = 1_000_000, steps: int = 590_000) -> list[Case]:
    """A CSV of ``columns`` columns and a JSONL of ``steps`` steps (memory once 65x / 13x the file size). A
    table wider than the cap is refused in one line before its rows are read; the long JSONL is read."""
    header = "step," + ",".join(f"m{i}" for i in range(columns - 1))
    row = "1," + ",".join("0.5" for _ in range(columns - 1))
    csv_path = _write(d / "row12_wide.csv", f"{header},loss\n{row},2.5\n")
    lines = "".join(
        f'{{"step": {s}, "lm_loss": {10.0 - s * 1e-6:.6f}, "grad_norm": 1.5}}\n' for s in range(1, steps + 1)
    )
    jsonl = _write(d / "row12_long.jsonl", lines)
    wide = (
        _self(12, "wide_csv", csv_path, 2, f"at most {MAX_CSV_COLUMNS} columns")
        if columns + 1 > MAX_CSV_COLUMNS
        else _self(12, "wide_csv", csv_path, 0, "PARITY")
    )
    return [wide, _self(12, "long_jsonl", jsonl, 0, "PARITY")]


ROWS: dict[int, Callable[[Path], list[Case]]] = {
    1: row1,
    2: row2,
    3: row3,
    4: row4,
    5: row5,
    6: row6,
    7: row7,
    8: row8,
    9: row9,
    10: row10,
    11: row11,
    12: row12,
}
