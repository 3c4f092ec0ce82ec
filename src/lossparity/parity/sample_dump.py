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
from typing import Any

import numpy as np

from ..atomic_io import atomic_write_bytes

__all__ = [
    "DUMP_SUBDIR",
    "FORMAT_NAME",
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
_RECORD = np.dtype("<f8")
RECORD_FIELDS = 4
RECORD_BYTES = RECORD_FIELDS * _RECORD.itemsize
_RANK_FILE_RE = re.compile(r"^samples_rank(\d+)\.bin$")
_META_KEYS = ("global_batch", "microbatch_size", "seq_len", "fixed_length", "step_base", "mode", "world_size")

StepSamples = tuple[np.ndarray, np.ndarray, np.ndarray]


class SampleDumpError(ValueError):
    """A sample dump that cannot be read: names the file and, where known, the record or step."""


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
    an in-place rewrite) when anything is dropped. Returns notes for the user; no file: nothing to do."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    notes = []
    torn = len(data) % RECORD_BYTES
    if torn:
        notes.append(
            f"{path}: dropped a torn last record ({torn} of {RECORD_BYTES} bytes; the run was killed while writing it)"
        )
    records = np.frombuffer(data[: len(data) - torn], dtype=_RECORD).reshape(-1, RECORD_FIELDS)
    keep = records[:, 0] <= step
    if not keep.all():
        notes.append(f"{path}: dropped {int((~keep).sum())} record(s) after step {step}, the step resumed from")
    new = records[keep].astype(_RECORD).tobytes()
    if new != data:
        atomic_write_bytes(path, new)
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


def _read_records(path: str) -> np.ndarray:
    """All records of one rank file as an ``[R, 4]`` float64 array; raises on a truncated file."""
    size = os.path.getsize(path)
    if size % RECORD_BYTES:
        index = size // RECORD_BYTES
        raise SampleDumpError(
            f"{path}: truncated: record {index} (0-based) is incomplete, {size % RECORD_BYTES} of {RECORD_BYTES} "
            f"bytes; the file holds {index} whole records ({size} bytes)"
        )
    data = np.fromfile(path, dtype=_RECORD)
    return data.reshape(-1, RECORD_FIELDS)


def _read_rank_file(path: str, notes: list[str]) -> np.ndarray:
    """The whole records of one rank file; a torn last record (a write cut by a crash) is ignored with a note."""
    size = os.path.getsize(path)
    whole = size // RECORD_BYTES
    if size % RECORD_BYTES:
        notes.append(
            f"{os.path.basename(path)}: incomplete last record ignored ({size % RECORD_BYTES} of "
            f"{RECORD_BYTES} bytes after {whole} whole records; the run stopped while writing it)"
        )
    data = np.fromfile(path, dtype=_RECORD, count=whole * RECORD_FIELDS)
    return data.reshape(-1, RECORD_FIELDS)


def find_dump(path: str | os.PathLike[str]) -> str:
    """Resolve ``path`` to a dump: an ``.npz`` file, a directory holding ``samples_rank*.bin`` or
    ``samples_meta.json``, or a run directory with such a ``samples/`` subdirectory. Raises
    ``FileNotFoundError`` naming what was looked for."""
    p = os.fspath(path)
    if os.path.isfile(p):
        if p.endswith(".npz"):
            return p
        raise SampleDumpError(f"{p}: a sample dump is a directory of samples_rank<r>.bin files or an .npz file")
    if not os.path.isdir(p):
        raise FileNotFoundError(f"sample dump {p} does not exist")
    for candidate in (p, os.path.join(p, DUMP_SUBDIR)):
        if os.path.isdir(candidate) and (os.path.exists(os.path.join(candidate, META_FILE)) or _rank_files(candidate)):
            return candidate
    raise FileNotFoundError(
        f"no sample dump in {p}: expected samples_rank<r>.bin files (and {META_FILE}) there or in "
        f"{os.path.join(p, DUMP_SUBDIR)}, or an .npz file (a run writes them with `lossparity train "
        "--dump-samples`)"
    )


def _rank_files(path_dir: str) -> list[str]:
    files = []
    for f in glob.glob(os.path.join(glob.escape(path_dir), "samples_rank*.bin")):
        m = _RANK_FILE_RE.match(os.path.basename(f))
        if m:
            files.append((int(m.group(1)), f))
    return [f for _, f in sorted(files)]


def read_sample_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run description of a dump (``samples_meta.json``, or the scalar entries of an NPZ file), or
    ``None`` when there is none. Raises :class:`SampleDumpError` on an unreadable or foreign file."""
    p = find_dump(path)
    if p.endswith(".npz"):
        with np.load(p) as z:
            meta = {k: z[k].item() for k in _META_KEYS if k in z.files and z[k].ndim == 0}
        return meta or None
    mpath = os.path.join(p, META_FILE)
    if not os.path.exists(mpath):
        return None
    try:
        with open(mpath, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SampleDumpError(f"{mpath}: cannot be read as JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise SampleDumpError(f'{mpath}: expected a JSON object with "format": "{FORMAT_NAME}"')
    if meta.get("version") != FORMAT_VERSION:
        raise SampleDumpError(
            f"{mpath}: unsupported version {meta.get('version')!r}; this reader knows version {FORMAT_VERSION}"
        )
    return meta


def _read_npz(path: str) -> tuple[np.ndarray, list[tuple[str, int]]]:
    try:
        z = np.load(path)
    except (OSError, ValueError) as e:
        raise SampleDumpError(f"{path}: cannot be read as .npz: {e}") from None
    with z:
        missing = [k for k in ("step", "row", "n", "s") if k not in z.files]
        if missing:
            raise SampleDumpError(f"{path}: missing arrays {missing}; an NPZ dump needs step, row, n, s")
        cols = [np.asarray(z[k], dtype=np.float64) for k in ("step", "row", "n", "s")]
    shapes = [c.shape for c in cols]
    if any(c.ndim != 1 for c in cols) or len(set(shapes)) != 1:
        raise SampleDumpError(f"{path}: step, row, n, s must be 1-D arrays of one length, got shapes {shapes}")
    records = np.stack(cols, axis=1)
    return records, [(os.path.basename(path), i) for i in range(records.shape[0])]


def _check_values(records: np.ndarray, origin: list[tuple[str, int]]) -> None:
    """Integer step/row/n, n >= 0, finite s: the first offending record is named."""
    bad_int = (records[:, :3] != np.round(records[:, :3])).any(axis=1) | (records[:, :3] < 0).any(axis=1)
    bad_s = ~np.isfinite(records[:, 3]) | ~np.isfinite(records[:, :3]).all(axis=1)
    bad = np.flatnonzero(bad_int | bad_s)
    if bad.size:
        i = int(bad[0])
        f, r = origin[i]
        step, row, n, s = records[i].tolist()
        raise SampleDumpError(
            f"{f} record {r}: expected integer step, row, n >= 0 and a finite loss sum, got "
            f"step={step}, row={row}, n={n}, s={s}"
        )


def read_sample_dump(path: str | os.PathLike[str], notes: list[str] | None = None) -> dict[int, StepSamples]:
    """Read a dump (directory of rank files, run directory, or ``.npz``) into ``{step: (rows, n, s)}``.

    All ranks are merged; within a step the three float64 arrays are sorted by ``row`` (``rows`` as
    int64). A torn last record of a rank file is ignored, and so is the last step when it is incomplete
    (fewer rows than ``global_batch``: the step being written when the run stopped); each such decision is
    appended to ``notes``. Raises :class:`SampleDumpError` for a duplicate ``(step, row)`` (both
    locations), non-integer steps/rows/counts or a non-finite sum, and, when ``samples_meta.json`` gives
    ``global_batch``, an earlier step whose rows are not exactly ``0..N-1``.
    """
    notes = notes if notes is not None else []
    p = find_dump(path)
    if p.endswith(".npz"):
        records, origin = _read_npz(p)
    else:
        parts, origin = [], []
        for f in _rank_files(p):
            rec = _read_rank_file(f, notes)
            parts.append(rec)
            origin += [(os.path.basename(f), i) for i in range(rec.shape[0])]
        if not parts:
            raise SampleDumpError(f"{p}: no samples_rank<r>.bin files")
        records = np.concatenate(parts, axis=0)
    if records.shape[0] == 0:
        raise SampleDumpError(f"{p}: the dump holds no records")
    _check_values(records, origin)
    order = np.lexsort((records[:, 1], records[:, 0]))
    records = records[order]
    same = np.flatnonzero((records[1:, 0] == records[:-1, 0]) & (records[1:, 1] == records[:-1, 1]))
    if same.size:
        i = int(same[0])
        a, b = origin[int(order[i])], origin[int(order[i + 1])]
        raise SampleDumpError(
            f"duplicate sample (step {int(records[i, 0])}, row {int(records[i, 1])}) in "
            f"{a[0]} record {a[1]} and {b[0]} record {b[1]}"
        )
    meta = read_sample_meta(p)
    n_expected = int(meta["global_batch"]) if meta and meta.get("global_batch") else None
    out: dict[int, StepSamples] = {}
    steps, starts = np.unique(records[:, 0], return_index=True)
    bounds = list(starts[1:]) + [records.shape[0]]
    for j, (step, lo, hi) in enumerate(zip(steps, starts, bounds)):
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
