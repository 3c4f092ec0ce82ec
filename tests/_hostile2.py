"""Hostile inputs of issue 50 (round 2): builders shared by ``tests/test_hostile_inputs2.py`` and
``scripts/measure_hostile_inputs.py --round 2`` (which times them and measures their peak memory).

Each builder writes its files under a folder and returns ``_hostile.Case`` objects (:func:`Case`): the whole
argument list after ``lossparity``, the exit code the command must end with, a text its one stderr line (exit 2)
or its output (exit 0/1) must hold, and the file that line must name. ``size`` scales the cases that are large
at full size (the tests run them smaller, the measurement at the issue's size).
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
from pathlib import Path

import _hostile
from _hostile import _write

VALID = "".join(json.dumps({"step": s, "lm loss": 2.0, "grad norm": 1.0}) + "\n" for s in range(1, 11))
META = {"format": "lossparity-samples", "version": 1, "global_batch": 1, "step_base": 1}


def Case(group: str, name: str, argv: list[str], code: int, needle: str, file: str | None = None) -> _hostile.Case:
    """A :class:`_hostile.Case` of this issue (``row`` 50; ``argv`` is the whole list after ``lossparity``)."""
    return _hostile.Case(50, f"{group}:{name}", argv, code, needle, file)


def records(rows: list[tuple[float, float, float, float]]) -> bytes:
    """Rank-file bytes of ``(step, row, n, s)`` records (four little-endian float64 each)."""
    return b"".join(struct.pack("<4d", *r) for r in rows)


def dump(d: Path, steps: range | list[int] = range(1, 4), meta: dict | str | None = None) -> Path:
    """A dump folder ``d`` with one sample per step in ``samples_rank0.bin`` and ``samples_meta.json``."""
    _write(d / "samples_rank0.bin", records([(s, 0, 2, 1.5) for s in steps]))
    if meta is not None:
        _write(d / "samples_meta.json", meta if isinstance(meta, str) else json.dumps(meta))
    return d


def _gap(
    group: str, name: str, source: Path | str, code: int, needle: str, file: Path | str | None, *extra: str
) -> Case:
    return Case(
        group, name, ["gap", str(source), "--bootstrap", "0", *extra], code, needle, None if file is None else str(file)
    )


def npy(array_bytes: bytes, descr: str, shape: tuple[int, ...]) -> bytes:
    """An ``.npy`` (version 1.0) with the given header and data bytes, whatever they declare."""
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode("latin1")
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + array_bytes


def npz(members: dict[str, bytes], compress: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for k, v in members.items():
            z.writestr(f"{k}.npy", v)
    return buf.getvalue()


def _columns(n: int = 3) -> dict[str, bytes]:
    cols = {"step": [float(s) for s in range(1, n + 1)], "row": [0.0] * n, "n": [2.0] * n, "s": [1.5] * n}
    return {k: npy(struct.pack(f"<{n}d", *v), "<f8", (n,)) for k, v in cols.items()}


def gap_files(d: Path) -> list[Case]:
    """``lossparity gap`` on FIFOs, devices and file contents that once hung, ran out of memory or raised."""
    out = []
    fifo_rank = dump(d / "fifo_rank", meta=META)
    os.mkfifo(fifo_rank / "samples_rank1.bin")
    out.append(_gap("gap", "fifo_rank_file", fifo_rank, 2, "FIFO", fifo_rank / "samples_rank1.bin"))
    fifo_meta = dump(d / "fifo_meta")
    os.mkfifo(fifo_meta / "samples_meta.json")
    out.append(_gap("gap", "fifo_meta", fifo_meta, 2, "FIFO", fifo_meta / "samples_meta.json"))
    if os.path.exists("/dev/zero"):
        zero = dump(d / "meta_dev_zero")
        os.symlink("/dev/zero", zero / "samples_meta.json")
        out.append(_gap("gap", "meta_dev_zero", zero, 2, "a device", zero / "samples_meta.json"))
    deep = dump(d / "meta_deep", meta="[" * 100_000 + "]" * 100_000)
    out.append(_gap("gap", "meta_nested", deep, 2, "nested too deeply", deep / "samples_meta.json"))
    for key in ("global_batch", "microbatch_size", "fixed_length", "step_base"):
        for label, value in (("1e400", "1e400"), ("list", "[1]")):
            text = json.dumps(META)[:-1] + f', "{key}": {value}}}'
            folder = dump(d / f"meta_{key}_{label}", meta=text)
            out.append(_gap("gap", f"meta_{key}_{label}", folder, 2, key, folder / "samples_meta.json"))
    neg = dump(d / "meta_step_base_neg", meta={**META, "step_base": -1e15})
    out.append(_gap("gap", "meta_step_base_-1e15", neg, 2, "step_base", neg / "samples_meta.json"))
    for label, member in (
        ("complex", npy(struct.pack("<2d", 1.0, 0.0), "<c16", ())),
        ("inf", npy(struct.pack("<d", float("inf")), "<f8", ())),
        ("object", npy(b"\x80\x04N.", "|O", ())),
    ):
        path = d / f"npz_{label}.npz"
        _write(path, npz({**_columns(), "global_batch": member}))
        out.append(_gap("gap", f"npz_scalar_{label}", path, 2, "global_batch", path))
    path = d / "npz_object_column.npz"
    _write(path, npz({**_columns(), "s": npy(b"\x80\x04N.", "|O", (3,))}))
    out.append(_gap("gap", "npz_object_column", path, 2, "never a pickle", path))
    path = d / "npy_named_npz.npz"
    _write(path, _columns()["step"])
    out.append(_gap("gap", "npy_named_npz", path, 2, "cannot be read as .npz", path))
    path = d / "empty.npz"
    _write(path, npz({}))
    out.append(_gap("gap", "empty_npz", path, 2, "missing arrays", path))
    path = d / "shape_2_40.npz"
    _write(path, npz({**_columns(), "n": npy(b"\x00" * 24, "<f8", (2**40,))}))
    out.append(_gap("gap", "member_shape_2**40", path, 2, "declares shape", path))
    return out


def gap_sizes(d: Path, size: float = 1.0) -> list[Case]:
    """``gap`` on inputs whose size once cost memory: steps 1 and 1e12 (missing steps as a range), a
    ``metrics.jsonl`` step of 2**53-1, a sparse rank file, a deflate bomb, a long dump, a huge --bootstrap."""
    out = []
    far = dump(d / "far_steps", steps=[1, 10**12])
    out.append(_gap("gap", "steps_1_and_1e12", far, 1, "MISSING STEPS: the dump lacks step(s) 2-999999999999", None))
    run = d / "log_2_53"
    dump(run / "samples", meta=META)
    _write(run / "metrics.jsonl", json.dumps({"step": 2**53 - 1, "objective": 1.0}) + "\n")
    out.append(_gap("gap", "metrics_step_2**53-1", run, 1, f"4-{2**53 - 1}", None))
    sparse = d / "sparse"
    sparse.mkdir()
    with open(sparse / "samples_rank0.bin", "wb") as f:
        f.truncate(int(256 * 2**20 * size) // 32 * 32)  # holes read as zero records: (0, 0, 0, 0) twice
    out.append(_gap("gap", "sparse_256MB", sparse, 2, "duplicate sample (step 0, row 0)", sparse / "samples_rank0.bin"))
    bomb = d / "bomb.npz"
    count = max(int(2**28 * size), 2**24) // 2**17 * 2**17  # 2 GiB of zeros at full size, a few MB compressed
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in _columns().items():
            if k != "step":
                z.writestr(f"{k}.npy", v)
        with z.open("step.npy", "w", force_zip64=True) as m:  # the bomb: a column of `count` zeros
            m.write(npy(b"", "<f8", (count,)))
            chunk = b"\x00" * 2**20
            for _ in range(count * 8 // len(chunk)):
                m.write(chunk)
    _write(bomb, buf.getvalue())
    out.append(_gap("gap", "deflate_bomb", bomb, 2, "declares shape", bomb))
    long = dump(d / "long_dump", steps=range(1, int(30_000 * size) + 1), meta=META)
    out.append(Case("gap", "30000_steps", ["gap", str(long)], 0, "overall: mean gap"))
    out.append(
        Case("gap", "bootstrap_1e9", ["gap", str(long), "--bootstrap", "1000000000"], 2, "--bootstrap 1000000000")
    )
    return out


def config_values(run: Path) -> list[tuple[str, str]]:
    """``(name, JSON text)`` of the saved ``decay_steps`` values a resume once failed on (``run``: unused, for
    symmetry with the other builders)."""
    return [("1e400", "1e400"), ("word", '"x"'), ("list", "[1]"), ("nan", "NaN"), ("negative", "-5")]


def set_saved(config: Path, key: str, text: str) -> None:
    """Rewrite ``key`` of a saved ``config.json`` to the raw JSON ``text`` (which may be no valid value)."""
    saved = json.loads(config.read_text())
    saved[key] = "__HOSTILE__"
    config.write_text(json.dumps(saved).replace('"__HOSTILE__"', text))


def restarts_with_new_keys(n: int) -> str:
    """``n`` JSONL lines whose step goes back every other line (2, 1, 2, 1, ...: a restart each time) while
    every line brings a new key beside ``lm loss``: each restart once walked every series ever created."""
    return "".join(json.dumps({"step": 2 - i % 2, f"k{i}": 1.0, "lm loss": 2.0}) + "\n" for i in range(n))


def compare_files(d: Path, size: float = 1.0) -> list[Case]:
    """``lossparity compare`` on logs that once cost quadratic time or unbounded memory, or raised."""
    valid = _write(d / "valid.jsonl", VALID)
    out = []
    n = int(16_000 * size)
    path = _write(d / "restarts_new_keys.jsonl", restarts_with_new_keys(n))
    full = n > 10_000  # beyond the cap on metrics: refused at its 10,001st metric
    out.append(
        Case(
            "compare",
            "restarts_new_keys",
            ["compare", path, path],
            2 if full else 0,
            "at most" if full else "PARITY",
            path,
        )
    )
    lines = int(20 * 2**20 * size) // 40
    wide = "".join(json.dumps({"step": i + 1, f"key_{i:08d}": 1.0, "lm loss": 2.0}) + "\n" for i in range(lines))
    path = _write(d / "new_keys.jsonl", wide)
    out.append(Case("compare", "jsonl_new_keys", ["compare", path, path], 2, "at most 10000 metrics", path))
    mega = "".join(f" iteration {i + 1:8d}/ 100000000 | lm loss: 2.000000E+00 | k{i}: 1.0 |\n" for i in range(lines))
    path = _write(d / "new_keys_megatron.log", mega)
    out.append(Case("compare", "megatron_new_keys", ["compare", path, path], 2, "at most 10000 metrics", path))
    cols = 99_999  # 1 MB: full size always
    header = "step," + ",".join(f"m{i}" for i in range(cols - 2)) + ",loss\n"
    path = _write(d / "wide.csv", header + "1," + "0.5," * (cols - 2) + "2.5\n")
    out.append(Case("compare", "csv_99999_columns", ["compare", path, path], 2, "at most 10001 columns", path))
    mtp = "mtp_" + "7" * 5000 + "_loss"
    path = _write(
        d / "mtp_digits.jsonl", "".join(json.dumps({"step": s, "lm loss": 2.0, mtp: 1.0}) + "\n" for s in (1, 2))
    )
    out.append(Case("compare", "mtp_5000_digits", ["compare", path, path], 0, "PARITY"))
    bases = ["--ref-step-base=9007199254740991", "--cand-step-base=-9007199254740991"]
    out.append(Case("compare", "step_bases_2**54_apart", ["compare", valid, valid, *bases], 2, "step bases", valid))
    return out
