"""Per-sample dumps: the token count ``n_i`` and loss sum ``s_i`` of every sample of every step.

The ``gap`` tool needs per-sample data to compute every normalization mode that is a function of
``(n_i, s_i)`` and the estimator gap of semantics §1. The trainer writes them while training; users with
their own trainer can write an NPZ file instead.

Binary format (version 1)
    One file per data-parallel rank, ``samples_rank<r>.bin``: a flat sequence of records, each four
    little-endian IEEE-754 float64 numbers ``(step, row, n, s)`` (32 bytes, no padding, no header):

    - ``step``: the optimizer step, numbered like the run's ``metrics.jsonl`` (lossparity: 1, 2, ...);
    - ``row``: the sample's index ``0 <= row < N`` within the step's global batch (rank ``d`` holds rows
      ``[d·K·b, (d+1)·K·b)``, its ``k``-th microbatch the ``k``-th block of ``b`` rows);
    - ``n``: the number of loss tokens of the main LM loss (``Σ_t w[i,t]``, an integer stored exactly);
    - ``s``: the sum of its per-token losses ``Σ_t w[i,t]·l[i,t]``.

    Records are appended once per microbatch; ranks and steps may interleave in any order. float64
    represents every integer below 2**53 exactly, so ``step``, ``row`` and ``n`` round-trip exactly.

    ``samples_meta.json`` (written by rank 0) describes the run: ``format`` (``"lossparity-samples"``),
    ``version`` (1), ``global_batch`` (``N``), ``microbatch_size`` (``b``), ``seq_len``, ``mode``,
    ``fixed_length`` (the ``L`` of ``sample_sum_norm``, or ``null``), ``world_size`` and ``step_base``
    (the number of the first step, 1 for lossparity). Unknown keys are kept and ignored.

NPZ format
    One ``.npz`` file with four 1-D arrays of equal length: ``step``, ``row``, ``n``, ``s`` (any
    numeric dtype). Optional scalar entries ``global_batch``, ``microbatch_size``, ``seq_len``,
    ``fixed_length`` and ``step_base`` play the role of ``samples_meta.json``.

This module does not import torch: :meth:`SampleDumpWriter.write` accepts tensors (anything with
``.detach().cpu().numpy()``) or arrays.
"""

from __future__ import annotations

import glob
import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import numpy as np

from ..atomic_io import atomic_write, atomic_write_bytes
from ._dump_input import (
    MAX_DUMP_RECORDS,
    RECORD,
    RECORD_BYTES,
    RECORD_FIELDS,
    SampleDumpError,
    check_meta,
    check_records,
    named,
    read_meta_json,
    read_npz,
    read_rank_file,
    record_chunks,
)

__all__ = [
    "DUMP_SUBDIR",
    "FORMAT_NAME",
    "MAX_DUMP_RECORDS",
    "FORMAT_VERSION",
    "META_FILE",
    "RECORD_BYTES",
    "SampleDumpError",
    "SampleDumpWriter",
    "find_dump",
    "rank_file_name",
    "truncate_records",
    "read_sample_dump",
    "read_sample_meta",
    "write_sample_meta",
]

FORMAT_NAME = "lossparity-samples"
FORMAT_VERSION = 1
META_FILE = "samples_meta.json"
DUMP_SUBDIR = "samples"
_RECORD = RECORD
_RANK_FILE_RE = re.compile(r"^samples_rank(\d{1,9})\.bin$")  # a longer number is no rank
_META_KEYS = ("global_batch", "microbatch_size", "seq_len", "fixed_length", "step_base", "mode", "world_size")

StepSamples = tuple[np.ndarray, np.ndarray, np.ndarray]


def rank_file_name(rank: int) -> str:
    """The file name of rank ``rank``'s records: ``samples_rank<rank>.bin``."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return f"samples_rank{rank}.bin"


def _as_array(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, converted without importing torch
        x = x.detach().cpu()
        if hasattr(x, "double"):
            x = x.double()
        x = x.numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [b], got shape {tuple(arr.shape)}")
    return arr


def write_sample_meta(path_dir: str | os.PathLike[str], **fields: Any) -> str:
    """Write ``samples_meta.json`` in ``path_dir`` with ``format``, ``version`` and ``fields`` (see the module
    docstring for the known keys); returns its path. Written atomically (temporary file + rename)."""
    os.makedirs(path_dir, exist_ok=True)
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step_base": 1, **fields}
    path = os.path.join(os.fspath(path_dir), META_FILE)
    atomic_write_bytes(path, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return path


def truncate_records(path: str, step: int) -> list[str]:
    """Resume of a dump: keep the records of steps ``<= step`` of the rank file ``path`` and drop a torn
    last record (a kill mid-write), replacing the file atomically (temporary file + fsync + rename, never
    an in-place rewrite) when anything is dropped. Returns notes for the user; no file: nothing to do.

    The file is read as ``gap`` reads it (:mod:`._dump_input`): a regular file only (a FIFO or a device
    raises :class:`SampleDumpError` naming it, never a hang), in chunks (memory of one chunk, whatever its
    size: a long run's dump is never capped here), each chunk checked as ``gap`` checks it, and a record of
    a step before 1 (the trainer's first) is no record of this run (a sparse file's zeros): an error naming
    the file and the record."""
    if not os.path.lexists(path):
        return []
    if not os.path.exists(path):
        raise SampleDumpError(f"{path}: a link to nothing; remove it or start a new run with --overwrite")
    notes: list[str] = []
    torn: list[str] = []
    kept = dropped = 0
    for start, chunk in record_chunks(path, torn, cap=None):
        check_records(chunk, named(path, start))
        early = np.flatnonzero(chunk[:, 0] < 1)
        if early.size:
            i = int(early[0])
            raise SampleDumpError(
                f"{path} record {start + i}: step {chunk[i, 0]:g}, before the run's first step 1; not a record of "
                "this run's dump (repair or remove the file, or start a new run with --overwrite)"
            )
        keep = int((chunk[:, 0] <= step).sum())
        kept, dropped = kept + keep, dropped + chunk.shape[0] - keep
    if torn:
        size = os.path.getsize(path)
        notes.append(
            f"{path}: dropped a torn last record ({size % RECORD_BYTES} of {RECORD_BYTES} bytes; the run was killed "
            "while writing it)"
        )
    if dropped:
        notes.append(f"{path}: dropped {dropped} record(s) after step {step}, the step resumed from")
    if torn or dropped:

        def write(f: BinaryIO) -> None:
            for _, chunk in record_chunks(path, cap=None):
                f.write(chunk[chunk[:, 0] <= step].astype(_RECORD).tobytes())

        atomic_write(path, write)
    return notes


class SampleDumpWriter:
    """Append-only writer of one rank's per-sample records (format in the module docstring).

    ``SampleDumpWriter(path_dir, rank)`` creates ``path_dir/samples_rank<rank>.bin`` (truncating an old
    one). With ``resume_step=s`` an existing file is kept up to and including step ``s`` and later records
    are dropped (a resumed run rewrites them) by :func:`truncate_records`, atomically, then appended to;
    its notes go to ``notify`` (default ``warnings.warn``; the CLI prints them).
    :meth:`sync` makes the records durable (before a checkpoint). With ``meta`` and ``rank == 0`` it also writes
    ``samples_meta.json``. Call :meth:`write` once per microbatch and :meth:`close` at the end (or use it
    as a context manager).
    """

    def __init__(
        self,
        path_dir: str | os.PathLike[str],
        rank: int,
        *,
        meta: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.path_dir = os.fspath(path_dir)
        self.rank = int(rank)
        os.makedirs(self.path_dir, exist_ok=True)
        self.path = os.path.join(self.path_dir, rank_file_name(self.rank))
        if resume_step is not None:
            for note in truncate_records(self.path, resume_step):
                if notify is None:
                    warnings.warn(note, stacklevel=2)
                else:
                    notify(note)
        # Append-only after the (atomic) truncation of a resume; a new dump starts empty.
        self._file = open(self.path, "ab" if resume_step is not None else "wb")  # noqa: SIM115 - closed in close()
        if meta is not None and self.rank == 0:
            write_sample_meta(self.path_dir, **dict(meta))

    def write(self, step: int, global_rows: Any, counts: Any, sums: Any) -> None:
        """Append one record ``(step, row, n, s)`` per sample of a microbatch.

        ``global_rows`` (``[b]``, integer): each sample's row in the step's global batch; ``counts``
        (``[b]``): its loss-token count ``n_i``; ``sums`` (``[b]``): its loss sum ``s_i``. Stored as float64.
        """
        if self._file.closed:
            raise ValueError(f"write on a closed SampleDumpWriter ({self.path})")
        rows = _as_array(global_rows, "global_rows")
        n = _as_array(counts, "counts")
        s = _as_array(sums, "sums")
        if not rows.shape == n.shape == s.shape:
            raise ValueError(
                f"global_rows, counts and sums must have the same shape [b], got {rows.shape}, {n.shape}, {s.shape}"
            )
        if rows.size and (np.any(rows < 0) or np.any(rows != np.round(rows))):
            raise ValueError(f"global_rows must be non-negative integers, got {rows.tolist()}")
        if n.size and (np.any(n < 0) or np.any(n != np.round(n))):
            raise ValueError(f"counts must be non-negative integers, got {n.tolist()}")
        if int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step}")
        block = np.empty((rows.size, RECORD_FIELDS), dtype=_RECORD)
        block[:, 0] = float(step)
        block[:, 1] = rows
        block[:, 2] = n
        block[:, 3] = s
        self._file.write(block.tobytes())

    def flush(self) -> None:
        """Flush buffered records to the operating system (the trainer does it after every step)."""
        self._file.flush()

    def sync(self) -> None:
        """Make every written record durable (flush + fsync); the trainer calls it before each checkpoint."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Flush and close the file; further writes raise."""
        if not self._file.closed:
            self.sync()
            self._file.close()

    def __enter__(self) -> SampleDumpWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def find_dump(path: str | os.PathLike[str]) -> str:
    """Resolve ``path`` to a dump: an ``.npz`` file, a directory holding ``samples_rank*.bin`` or
    ``samples_meta.json``, or a run directory with such a ``samples/`` subdirectory. Raises
    ``FileNotFoundError`` naming what was looked for, :class:`SampleDumpError` for a path that is neither."""
    p = os.fspath(path)
    if os.path.isdir(p):
        for candidate in (p, os.path.join(p, DUMP_SUBDIR)):
            if os.path.isdir(candidate) and (
                os.path.lexists(os.path.join(candidate, META_FILE)) or _rank_files(candidate)
            ):
                return candidate
        raise FileNotFoundError(
            f"no sample dump in {p}: expected samples_rank<r>.bin files (and {META_FILE}) there or in "
            f"{os.path.join(p, DUMP_SUBDIR)}, or an .npz file (a run writes them with `lossparity train "
            "--dump-samples`)"
        )
    if not os.path.lexists(p):
        raise FileNotFoundError(f"sample dump {p} does not exist")
    if p.endswith(".npz"):
        return p  # opened as a regular file only, when read
    raise SampleDumpError(f"{p}: a sample dump is a directory of samples_rank<r>.bin files or an .npz file")


def _rank_files(path_dir: str) -> list[str]:
    files = []
    for f in glob.glob(os.path.join(glob.escape(path_dir), "samples_rank*.bin")):
        m = _RANK_FILE_RE.match(os.path.basename(f))
        if m:
            files.append((int(m.group(1)), f))
    return [f for _, f in sorted(files)]


def read_sample_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run description of a dump (``samples_meta.json``, or the scalar entries of an NPZ file), or
    ``None`` when there is none, its numbers checked (``global_batch`` and the other sizes integers >= 1,
    ``step_base`` an integer, all below 2**53). Raises :class:`SampleDumpError` naming the file when it
    cannot be read, is foreign or holds a bad value."""
    p = find_dump(path)
    if p.endswith(".npz"):
        return read_npz(p)[1] or None
    mpath = os.path.join(p, META_FILE)
    if not os.path.lexists(mpath):
        return None
    meta = read_meta_json(mpath)
    if meta.get("format") != FORMAT_NAME:
        raise SampleDumpError(f'{mpath}: expected a JSON object with "format": "{FORMAT_NAME}"')
    if meta.get("version") != FORMAT_VERSION:
        shown = repr(meta.get("version"))[:60]
        raise SampleDumpError(f"{mpath}: unsupported version {shown}; this reader knows version {FORMAT_VERSION}")
    return check_meta(mpath, meta)


def _read_dump_records(p: str, notes: list[str]) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """``(records, [(file, number of its records)])`` of a dump directory; every chunk checked as it is read."""
    parts, files = [], []
    budget = MAX_DUMP_RECORDS
    for f in _rank_files(p):
        rec = read_rank_file(f, notes, budget)
        budget -= rec.shape[0]
        parts.append(rec)
        files.append((f, rec.shape[0]))
    if not parts:
        raise SampleDumpError(f"{p}: no samples_rank<r>.bin files")
    return (parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)), files


def _origin(files: list[tuple[str, int]]) -> Callable[[int], str]:
    """``"<file> record <i>"`` of a record by its index among all files' records (no per-record objects)."""
    ends = np.cumsum([n for _, n in files])

    def where(i: int) -> str:
        k = int(np.searchsorted(ends, i, side="right"))
        return f"{files[k][0]} record {i - (int(ends[k - 1]) if k else 0)}"

    return where


def read_sample_dump(path: str | os.PathLike[str], notes: list[str] | None = None) -> dict[int, StepSamples]:
    """Read a dump (directory of rank files, run directory, or ``.npz``) into ``{step: (rows, n, s)}``.

    All ranks are merged; within a step the three float64 arrays are sorted by ``row`` (``rows`` as
    int64). A torn last record of a rank file is ignored, and so is the last step when it is incomplete
    (fewer rows than ``global_batch``: the step being written when the run stopped); each such decision is
    appended to ``notes``. Raises :class:`SampleDumpError` for a duplicate ``(step, row)`` (both
    locations), non-integer steps/rows/counts or a non-finite sum, and, when ``samples_meta.json`` gives
    ``global_batch``, an earlier step whose rows are not exactly ``0..N-1``. Files are read as
    :mod:`._dump_input` says (regular files only, checked chunk by chunk, at most :data:`MAX_DUMP_RECORDS`
    records): memory is a few times the records present.
    """
    notes = notes if notes is not None else []
    p = find_dump(path)
    if p.endswith(".npz"):
        records, npz_meta = read_npz(p)
        meta: dict[str, Any] | None = npz_meta
        check_records(records, lambda i: f"{p} record {i}")
        files = [(p, records.shape[0])]
    else:
        meta = read_sample_meta(p)  # a bad description is refused before any record is read
        records, files = _read_dump_records(p, notes)
    if records.shape[0] == 0:
        raise SampleDumpError(f"{p}: the dump holds no records")
    if len(files) > 1:  # duplicates across rank files (each file was checked on its own, chunk by chunk)
        check_records(records, _origin(files))
    order = np.lexsort((records[:, 1], records[:, 0]))
    records = records[order]
    n_expected = meta["global_batch"] if meta and meta.get("global_batch") else None
    out: dict[int, StepSamples] = {}
    steps, starts = np.unique(records[:, 0], return_index=True)
    bounds = [*starts[1:].tolist(), records.shape[0]]
    for j, (step, lo, hi) in enumerate(zip(steps.tolist(), starts.tolist(), bounds)):
        block = records[lo:hi]
        rows = block[:, 1].astype(np.int64)
        incomplete = n_expected is not None and (rows.size != n_expected or rows[-1] != n_expected - 1)
        if incomplete and n_expected is not None and j == len(steps) - 1 and rows.size < n_expected and len(steps) > 1:
            notes.append(
                f"last step {int(step)} ignored: incomplete ({rows.size} of {n_expected} samples; the run "
                "stopped while writing it)"
            )
            break
        if incomplete:
            raise SampleDumpError(
                f"{p}: step {int(step)} has {rows.size} samples (rows {rows.min()}..{rows.max()}), "
                f"but {META_FILE} says global_batch={n_expected}: a rank file is missing or "
                "incomplete"
            )
        out[int(step)] = (rows, block[:, 2].copy(), block[:, 3].copy())
    return out
