"""Crash-safe file replacement, shared by the checkpoints, the metrics log and the sample dumps.

Torch-free on purpose (the sample-dump module must not import torch). A file is replaced by writing the
new content to a temporary file in the same directory, flushing and fsync'ing it, renaming it over the
old one (``os.replace`` is atomic on POSIX) and fsync'ing the directory, so that after a crash at any
moment the path holds either the complete old content or the complete new one, never a mix or nothing.
Temporary files are named ``.tmp-*``; :func:`remove_stale_temporaries` deletes what a killed writer left.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["TMP_PREFIX", "atomic_write", "atomic_write_bytes", "fsync_dir", "remove_stale_temporaries"]

TMP_PREFIX = ".tmp-"


def fsync_dir(directory: str) -> None:
    """Make a rename or a new file in ``directory`` durable (``fsync`` of the directory; no-op where the
    platform cannot open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` by what ``write(f)`` writes to the open binary file ``f``: temporary file ``.tmp-*``
    in the same directory, fsync, rename, fsync of the directory. A failure (in ``write`` too) removes the
    temporary file and leaves ``path`` untouched."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data`` (:func:`atomic_write`)."""
    atomic_write(path, lambda f: f.write(data))


def remove_stale_temporaries(directory: str) -> list[str]:
    """Delete the ``.tmp-*`` files and folders a killed writer left in ``directory`` (not recursive).
    Only safe while no writer of this run is active (at the start of a run). Returns the removed names."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        if not name.startswith(TMP_PREFIX):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
        removed.append(name)
    return removed
