"""Reading per-sample dumps that come from elsewhere, in bounded time and memory (``lossparity gap``, and the
truncation of a dump on ``train --resume --dump-samples``).

The rules of :mod:`lossparity.input_files`, applied to dumps:

- only regular files are opened (a FIFO or a device named ``samples_rank<r>.bin``, ``samples_meta.json`` or
  ``*.npz`` is refused unread, never a hang or an endless read);
- a rank file is read in chunks of :data:`CHUNK_RECORDS` records, each checked as it arrives (integer
  ``step``/``row``/``n`` >= 0 below 2**53, a finite ``s``, no sample twice within the chunk), so a file of
  zeros (a sparse file) or of junk ends at its first chunk; a dump of more than :data:`MAX_DUMP_RECORDS`
  records is refused before it is read;
- ``samples_meta.json`` is read whole up to :data:`MAX_META_BYTES` with the bounded JSON parser;
- an ``.npz`` is opened as the zip it is, and each member's ``.npy`` header (dtype, shape) is checked against
  the member's size before anything is allocated: a real or integer dtype only (never an object array: no
  pickle is ever loaded), a 1-D column or a 0-D scalar, and a declared size that fits the member and the cap
  (a crafted ``2**40`` shape or a deflate bomb is refused unread);
- the run description (``global_batch``, ``microbatch_size``, ``seq_len``, ``fixed_length``, ``world_size``:
  integers >= 1; ``step_base``: an integer >= 0, as the records' steps) is checked as command-line values
  are, naming the file.

Every refusal is a :class:`SampleDumpError` (a ``ValueError``) whose message names the file.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np

from ..input_files import MAX_STEP, InputFileError, loads_json, open_regular, read_capped

__all__ = [
    "CHUNK_RECORDS",
    "MAX_DUMP_RECORDS",
    "MAX_META_BYTES",
    "RECORD",
    "RECORD_BYTES",
    "RECORD_FIELDS",
    "SampleDumpError",
    "check_meta",
    "check_records",
    "named",
    "read_meta_json",
    "read_npz",
    "read_rank_file",
    "record_chunks",
]

RECORD = np.dtype("<f8")
RECORD_FIELDS = 4
RECORD_BYTES = RECORD_FIELDS * RECORD.itemsize
CHUNK_RECORDS = 1 << 16  # 2 MiB read and checked at a time
MAX_DUMP_RECORDS = 1 << 23
"""Most records a dump is read with (8,388,608: 256 MiB of records); a larger one is refused unread."""
MAX_META_BYTES = 1 << 20
"""Largest ``samples_meta.json`` read (the real one is a few hundred bytes)."""
_POSITIVE_META = ("global_batch", "microbatch_size", "seq_len", "fixed_length", "world_size")
_NPZ_COLUMNS = ("step", "row", "n", "s")


class SampleDumpError(ValueError):
    """A sample dump that cannot be read: names the file and, where known, the record or step."""


def _opened(path: str, what: str) -> IO[bytes]:
    try:
        return open_regular(path, what)
    except InputFileError as e:
        raise SampleDumpError(str(e)) from None


def record_chunks(
    path: str, notes: list[str] | None = None, cap: int | None = MAX_DUMP_RECORDS
) -> Iterator[tuple[int, np.ndarray]]:
    """``(index of its first record, [k, 4] float64 records)`` of the rank file ``path``, read in chunks of
    :data:`CHUNK_RECORDS` (not checked here). A torn last record (a write cut by a crash) is left out, with a
    note appended to ``notes``; a file of more than ``cap`` records is refused unread (``None``: a stream
    that holds one chunk at a time, whatever the file's size)."""
    with _opened(path, "a sample dump rank file (a regular file)") as f:
        size = os.fstat(f.fileno()).st_size
        whole = size // RECORD_BYTES
        if cap is not None and whole > cap:
            raise SampleDumpError(
                f"{path}: {size} bytes ({whole} records), more than the {MAX_DUMP_RECORDS} records a dump is read "
                "with; not read"
            )
        if size % RECORD_BYTES and notes is not None:
            notes.append(
                f"{os.path.basename(path)}: incomplete last record ignored ({size % RECORD_BYTES} of "
                f"{RECORD_BYTES} bytes after {whole} whole records; the run stopped while writing it)"
            )
        done = 0
        while done < whole:
            k = min(CHUNK_RECORDS, whole - done)
            data = f.read(k * RECORD_BYTES)
            k = len(data) // RECORD_BYTES  # the file shrank while being read: what is there
            if k == 0:
                return
            yield done, np.frombuffer(data[: k * RECORD_BYTES], dtype=RECORD).reshape(k, RECORD_FIELDS)
            done += k


def check_records(records: np.ndarray, where: Callable[[int], str]) -> None:
    """Raise :class:`SampleDumpError` naming the first bad record (``where(i)``: its file and index) unless
    every ``step``, ``row``, ``n`` is an integer in ``[0, 2**53)``, every ``s`` finite, and no
    ``(step, row)`` appears twice among ``records``."""
    ints = records[:, :3]
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(records).all(axis=1) | (ints != np.floor(ints)).any(axis=1)
        bad |= (ints < 0).any(axis=1) | (ints >= MAX_STEP).any(axis=1)
    wrong = np.flatnonzero(bad)
    if wrong.size:
        i = int(wrong[0])
        step, row, n, s = records[i].tolist()
        raise SampleDumpError(
            f"{where(i)}: expected integer step, row, n >= 0 below 2**53 and a finite loss sum, got "
            f"step={step}, row={row}, n={n}, s={s}"
        )
    order = np.lexsort((records[:, 1], records[:, 0]))
    keys = records[order, :2]
    same = np.flatnonzero((keys[1:] == keys[:-1]).all(axis=1))
    if same.size:
        a, b = sorted((int(order[same[0]]), int(order[same[0] + 1])))
        step, row = records[a, :2].tolist()
        raise SampleDumpError(f"duplicate sample (step {int(step)}, row {int(row)}) in {where(a)} and {where(b)}")


def named(path: str, start: int) -> Callable[[int], str]:
    """``"<path> record <start + i>"``: a record of a chunk by its index in the chunk."""
    return lambda i: f"{path} record {start + i}"


def read_rank_file(path: str, notes: list[str], budget: int) -> np.ndarray:
    """The checked records of one rank file (:func:`record_chunks`, :func:`check_records` per chunk) as one
    ``[R, 4]`` array, filled in place (one copy of the records in memory); more than ``budget`` records (the
    dump's remaining share of :data:`MAX_DUMP_RECORDS`) is refused naming the file before it is read."""
    out: np.ndarray | None = None
    filled = 0
    for start, chunk in record_chunks(path, notes):
        if out is None:  # sized from the file's size (record_chunks refused a file beyond the cap)
            size = os.path.getsize(path) // RECORD_BYTES
            if size > budget:
                raise SampleDumpError(
                    f"{path}: {size} records, more than the {budget} left of the {MAX_DUMP_RECORDS} records a dump is "
                    "read with; not read"
                )
            out = np.empty((max(size, chunk.shape[0]), RECORD_FIELDS), dtype=RECORD)
        check_records(chunk, named(path, start))
        if filled + chunk.shape[0] > out.shape[0]:  # the file grew while being read: only what was sized
            break
        out[filled : filled + chunk.shape[0]] = chunk
        filled += chunk.shape[0]
    return np.empty((0, RECORD_FIELDS), dtype=RECORD) if out is None else out[:filled]


def _meta_int(path: str, key: str, value: Any, low: int) -> int:
    """An integer of the run description (an int, or an integral finite float of an NPZ or JSON file)."""
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and value == math.floor(value):
        value = int(value)
    if isinstance(value, np.integer):
        value = int(value)
    ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < MAX_STEP
    if not ok or value < low:
        want = f"an integer >= {low} below 2**53"
        shown = repr(value)
        raise SampleDumpError(f"{path}: {key} must be {want}, got {shown if len(shown) <= 60 else shown[:57] + '...'}")
    return int(value)


def check_meta(path: str, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with its known numbers checked and made ints (``None`` kept): ``global_batch``,
    ``microbatch_size``, ``seq_len``, ``fixed_length``, ``world_size`` >= 1, ``step_base`` >= 0 (a record's
    step is), all below 2**53; ``mode`` a string. Raises :class:`SampleDumpError` naming ``path`` and the key."""
    out = dict(meta)
    for key in (*_POSITIVE_META, "step_base"):
        if out.get(key) is not None:
            out[key] = _meta_int(path, key, out[key], 1 if key in _POSITIVE_META else 0)
    if out.get("mode") is not None and not isinstance(out["mode"], str):
        raise SampleDumpError(f"{path}: mode must be a string, got a {type(out['mode']).__name__}")
    return out


def read_meta_json(path: str) -> dict[str, Any]:
    """The JSON object of ``samples_meta.json`` (a regular file of at most :data:`MAX_META_BYTES` bytes, its
    nesting and integers bounded), not yet checked for its format; raises :class:`SampleDumpError`."""
    try:
        meta = loads_json(read_capped(path, MAX_META_BYTES, "a sample dump description (a regular file)"))
    except InputFileError as e:
        raise SampleDumpError(str(e)) from None
    except (OSError, ValueError) as e:
        raise SampleDumpError(f"{path}: cannot be read as JSON: {' '.join(str(e).split())[:300]}") from None
    if not isinstance(meta, dict):
        raise SampleDumpError(f"{path}: expected a JSON object, got a JSON {type(meta).__name__}")
    return meta


def _member_header(path: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype an ``.npy`` member declares, checked against its size before any data is read."""
    key = info.filename[:-4]
    with zf.open(info) as m:
        version = np.lib.format.read_magic(m)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(m)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(m)
        else:
            raise ValueError(f"an .npy version {version} header")
        offset = m.tell()
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biuf":
        raise SampleDumpError(
            f"{path}: member {key!r} has dtype {dtype}; a dump holds real or integer numbers (no objects, never a "
            "pickle)"
        )
    count = math.prod(shape)
    if count > MAX_DUMP_RECORDS or offset + count * dtype.itemsize != info.file_size:
        raise SampleDumpError(
            f"{path}: member {key!r} declares shape {list(shape)} of {dtype} in {info.file_size - offset} bytes of "
            f"data (at most {MAX_DUMP_RECORDS} values, and exactly the member's bytes); not read"
        )
    return shape, dtype


def _member(path: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    _member_header(path, zf, info)
    with zf.open(info) as m:
        return np.lib.format.read_array(m, allow_pickle=False)


def read_npz(path: str) -> tuple[np.ndarray, dict[str, Any]]:
    """``([R, 4] float64 records, scalar entries)`` of an ``.npz`` dump (columns ``step``, ``row``, ``n``,
    ``s``; 0-D entries ``global_batch``, ... as :func:`check_meta` checks them), every member's header
    checked before its data is read (module docstring). Raises :class:`SampleDumpError` naming ``path``."""
    with _opened(path, "an .npz sample dump (a regular file)") as f:
        try:
            with zipfile.ZipFile(f) as zf:
                members = {i.filename[:-4]: i for i in zf.infolist() if i.filename.endswith(".npy")}
                missing = [k for k in _NPZ_COLUMNS if k not in members]
                if missing:
                    raise SampleDumpError(f"{path}: missing arrays {missing}; an NPZ dump needs step, row, n, s")
                shapes = [_member_header(path, zf, members[k])[0] for k in _NPZ_COLUMNS]
                if any(len(sh) != 1 for sh in shapes) or len(set(shapes)) != 1:
                    got = [list(sh) for sh in shapes]
                    raise SampleDumpError(f"{path}: step, row, n, s must be 1-D arrays of one length, got shapes {got}")
                records = np.empty((shapes[0][0], RECORD_FIELDS), dtype=RECORD)
                for j, k in enumerate(_NPZ_COLUMNS):
                    records[:, j] = _member(path, zf, members[k])
                meta: dict[str, Any] = {}
                for k in (*_POSITIVE_META, "step_base"):
                    if k in members and _member_header(path, zf, members[k])[0] == ():
                        meta[k] = _member(path, zf, members[k]).item()
        except SampleDumpError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
            # not a zip (an .npy named .npz, an empty file), a damaged member (CRC), a header numpy refuses
            why = " ".join(str(e).split())[:300] or type(e).__name__
            raise SampleDumpError(f"{path}: cannot be read as .npz ({type(e).__name__}: {why})") from None
    return records, check_meta(path, meta)
