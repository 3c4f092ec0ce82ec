"""Reading files that come from elsewhere (other people's logs, copied run folders) in bounded time and memory.

Torch-free and NumPy-free (the log readers use it). The rules, shared by the log readers, the run-folder
checks and the checkpoint loader:

- Only regular files are opened (:func:`open_regular`): a FIFO, a device (``/dev/zero``), a socket or a
  folder given where a file is expected is refused with an :class:`InputFileError` naming it. The file is
  opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so neither a FIFO (which
  would block the open) nor a path swapped between a check and the open gets through.
- Whole-file reads are capped (:func:`read_capped`): a file larger than its cap is refused naming the
  size and the cap, before it is read.
- Line reads are capped (:func:`capped_lines`): a line longer than :data:`MAX_LINE_CHARS` characters is
  an error naming file:line, so one endless line cannot exhaust memory.
- JSON is parsed with bounded results (:func:`loads_json`): an integer of more than
  :data:`MAX_INT_DIGITS` digits becomes a float (never Python's int-digits error, never an
  ``OverflowError`` later), nesting deeper than the interpreter's recursion allows is a
  :class:`ValueError` naming what it is, never a ``RecursionError`` traceback.
- Step numbers are integers with ``|step| < 2**53`` (:data:`MAX_STEP`): exact in a float64 and in
  the int64 arrays of the comparison.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

__all__ = [
    "InputFileError",
    "MAX_LINE_CHARS",
    "MAX_DOCUMENT_BYTES",
    "MAX_INT_DIGITS",
    "MAX_STEP",
    "open_regular",
    "check_regular",
    "read_capped",
    "capped_lines",
    "loads_json",
    "bounded_step",
]

MAX_LINE_CHARS = 4 * 1024 * 1024
"""Longest line a line-based reader accepts (characters); real metric lines are below 10 KB."""
MAX_DOCUMENT_BYTES = 512 * 1024 * 1024
"""Largest file read whole (a JSON document, a CSV table, ``metrics.jsonl`` on resume)."""
MAX_INT_DIGITS = 18
"""Integers with more digits are read as floats (every step below :data:`MAX_STEP` has at most 16)."""
MAX_STEP = 2**53
"""Steps are integers with ``|step| < MAX_STEP``: exact as float64 and as int64."""


class InputFileError(ValueError):
    """A file that is not read: not a regular file, too large, a line too long. ``path``, ``line`` (1-based,
    or ``None``) and ``reason``; the message is ``"<path>[:<line>]: <reason>"``."""

    def __init__(self, path: str, reason: str, line: int | None = None) -> None:
        self.path, self.reason, self.line = path, reason, line
        super().__init__(f"{path}{'' if line is None else f':{line}'}: {reason}")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], what: str = "a regular file") -> BinaryIO:
    """Open ``path`` for binary reading when it is a regular file (symlinks followed); anything else raises
    :class:`InputFileError` ``"<path>: expected <what>, got a FIFO (named pipe)"``. Never blocks on a FIFO."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except IsADirectoryError:
        raise InputFileError(p, f"expected {what}, got a folder") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputFileError(p, f"expected {what}, got {_kind(mode)}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: str | os.PathLike[str], what: str = "a regular file") -> None:
    """Raise :class:`InputFileError` unless ``path`` is a regular file (``FileNotFoundError`` when missing)."""
    open_regular(path, what).close()


def read_capped(path: str | os.PathLike[str], cap: int | None = None, what: str = "a regular file") -> bytes:
    """The bytes of the regular file ``path``; a file of more than ``cap`` bytes (default
    :data:`MAX_DOCUMENT_BYTES`) raises :class:`InputFileError` naming its size and the cap (checked before
    reading, and while reading)."""
    p = os.fspath(path)
    cap = MAX_DOCUMENT_BYTES if cap is None else cap
    with open_regular(p, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise InputFileError(p, f"{size} bytes, more than the {cap} bytes read from such a file")
        data = f.read(cap + 1)
    if len(data) > cap:  # grew while being read
        raise InputFileError(p, f"more than the {cap} bytes read from such a file")
    return data


def capped_lines(
    path: str | os.PathLike[str], max_chars: int | None = None, encoding: str = "utf-8"
) -> Iterator[tuple[int, str]]:
    """``(1-based number, line with its line break)`` of the regular file ``path``, decoded with
    ``errors="replace"`` and split as ``open(..., newline="")`` splits (``\\n``, ``\\r\\n`` and a lone
    ``\\r``). A line longer than ``max_chars`` characters (default :data:`MAX_LINE_CHARS`) raises
    :class:`InputFileError` naming file:line."""
    p = os.fspath(path)
    max_chars = MAX_LINE_CHARS if max_chars is None else max_chars
    with open_regular(p) as raw, io.TextIOWrapper(raw, encoding=encoding, errors="replace", newline="") as f:
        ln = 0
        while True:
            line = f.readline(max_chars + 1)
            if not line:
                return
            ln += 1
            if len(line) > max_chars:
                raise InputFileError(p, f"a line longer than {max_chars} characters; not read", ln)
            yield ln, line


def _parse_int(text: str) -> int | float:
    # a long digit string is read as the float it denotes (``inf`` past 1e308): never Python's
    # int-digits limit error, never an int too large for a float or an int64 later
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else float(text)


_DECODER = json.JSONDecoder(parse_int=_parse_int)  # one decoder: json.loads(..., parse_int=) builds one per call


def loads_json(text: str | bytes) -> object:
    """``json.loads`` with bounded results: long integers become floats (:data:`MAX_INT_DIGITS`), and
    nesting too deep to parse raises ``ValueError("JSON nested too deeply ...")`` instead of a
    ``RecursionError``. Malformed JSON raises ``json.JSONDecodeError`` as ``json.loads`` does."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")  # a UnicodeDecodeError is a ValueError, as JSON errors are
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply (arrays or objects inside each other)") from None


def bounded_step(value: object) -> int | None:
    """The integer step of a parsed value (an int, or an integral finite float) with ``|step| <``
    :data:`MAX_STEP`; ``None`` for anything else (a bool, a string, a fraction, inf, a huge number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or value != math.floor(value):
            return None
        value = int(value)
    if isinstance(value, int) and -MAX_STEP < value < MAX_STEP:
        return value
    return None
