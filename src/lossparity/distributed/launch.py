"""Start ``world_size`` local ranks with ``torch.distributed`` initialized (gloo on CPU, NCCL on GPU).

Used by ``lossparity train``/``verify`` when not run under ``torchrun`` and by the multi-process tests.
Every rank gets a bounded collective timeout, the rendezvous uses a free port of 127.0.0.1 chosen at
run time, and a rank that raises makes ``spawn`` raise in the parent with the error of *every* failed
rank (in the order they failed: the first is the cause, later ones are usually its consequences)
instead of leaving the others hanging.

Results travel back through one file per rank in a folder only the launching user can read and write
(``tempfile.mkdtemp``: mode 0700), created for this launch and deleted after it. They are read with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples, dicts: what the callers of
this project return); only a result holding other objects is unpickled in full, which is safe because no
other user can write into that folder and its files were written by the ranks this call started.

Rank lifecycle: a rank never outlives its launcher. On Linux each rank asks the kernel for ``SIGKILL``
when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and a watchdog thread also checks every second that
its parent is still the launcher (the fallback elsewhere, and for the window before ``prctl``), so a
launcher killed in any way (``SIGKILL``, a shell job whose ``SIGINT`` is ignored...) leaves no rank
training and writing the run folder. The death signal follows the *thread* that started the ranks:
call :func:`spawn` from a thread that outlives them (the main thread).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn", "init_from_env", "RankError", "RankFailure", "die_with_parent"]

# Exceptions that mean "the input was invalid" (the CLI exits 2 for them), as opposed to a failure of the run.
_INPUT_ERRORS = (ValueError, TypeError, LookupError, FileNotFoundError)
_WATCHDOG_PERIOD_S = 1.0
_GRACE_PERIOD_S = 3.0
_PORT_ATTEMPTS = 3


@dataclass(frozen=True)
class RankFailure:
    """One failed rank: its exception type and message, whether it is an input error, the traceback, and
    when it failed (``time.time()``, to order the failures)."""

    rank: int
    kind: str
    message: str
    input_error: bool
    traceback: str
    when: float


class RankError(RuntimeError):
    """Spawned ranks failed. ``failures`` lists every failed rank's error, earliest first (the first is
    the cause, e.g. rank 1's invalid mask; later ones are peers that noticed it). The message holds
    all of them with their tracebacks."""

    def __init__(self, message: str, failures: list[RankFailure] | None = None) -> None:
        self.failures = sorted(failures or [], key=lambda f: (f.when, f.rank))
        parts = [message] + [f"rank {f.rank} failed:\n{f.traceback}" for f in self.failures]
        super().__init__("\n".join(parts))
        self.summary = message

    @property
    def input_error(self) -> bool:
        """Whether the first failure is an input error (bad argument, bad file), not a crash of the run."""
        return bool(self.failures) and self.failures[0].input_error

    def summary_lines(self) -> list[str]:
        """One line per failed rank, earliest first (``rank r: Type: message``), then the launcher's note."""
        lines = [f"rank {f.rank}: {f.kind}: {' '.join(f.message.split())}" for f in self.failures]
        return lines + ([self.summary] if self.summary else [])


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when ``parent_pid`` (its launcher) dies: ``PR_SET_PDEATHSIG`` = ``SIGKILL``
    on Linux, plus a daemon thread that kills the process once its parent pid changes (re-parented to
    init or a subreaper). Exits at once when the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # the watchdog below still bounds the lifetime
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(_WATCHDOG_PERIOD_S)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lossparity-parent-watchdog", daemon=True).start()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None, timeout_s: float = 120.0) -> None:
    """Initialize the default process group from ``torchrun``-style environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with a bounded timeout. Under
    ``torchrun`` (``TORCHELASTIC_RUN_ID`` set) the rank also dies with its agent (:func:`die_with_parent`)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(os.getppid())
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    result_dir: str,
    parent_pid: int,
) -> None:
    die_with_parent(parent_pid)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    # Each rank gets one thread: ranks share the machine's cores, oversubscription only slows them down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    path = os.path.join(result_dir, f"rank{rank}.pt")
    stage = "init"
    try:
        init_from_env(backend, timeout_s)
        stage = "run"
        out = fn(rank, world_size, *args)
        # Leave together: a rank tearing down while a peer (the TCP store's host) is gone can abort.
        dist.barrier()
        torch.save({"ok": True, "result": out}, path)
    except BaseException as e:  # noqa: BLE001 - report any failure to the parent
        torch.save(
            {
                "ok": False,
                "error": traceback.format_exc(),
                "kind": type(e).__name__,
                "message": str(e),
                "input_error": isinstance(e, _INPUT_ERRORS),
                "when": time.time(),
                "stage": stage,
            },
            path,
        )
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with the default group
    initialized, and return the list of their return values (rank order). ``fn`` must be importable
    (a module-level function). Raises :class:`RankError` naming the first failing rank. A rendezvous
    port taken by another process between its choice and the bind (a race between concurrent jobs of
    one machine) is retried with a new port, up to three times, before any rank has run ``fn``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _spawn_once(fn, world_size, args, backend, timeout_s)
        except _PortTaken:
            if attempt == _PORT_ATTEMPTS - 1:
                raise RankError(
                    f"the rendezvous port was taken by another process {_PORT_ATTEMPTS} times in a row "
                    "(free ports are picked at run time; is something grabbing ports of 127.0.0.1?)"
                ) from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """The rendezvous failed before any rank ran ``fn`` because the chosen port was taken meanwhile."""


def _read_result(path: str) -> dict[str, Any]:
    """A rank's result file of this launch's private folder (see the module docstring)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        # Objects beyond plain values: written by a rank of this launch into a 0700 folder of this user.
        return torch.load(path, weights_only=False)


def _port_taken(tmp: str, world_size: int) -> bool:
    """Whether every recorded failure happened while joining the rendezvous, one of them on a busy port
    (another process took the port between :func:`free_port` and the store's bind)."""
    recs = []
    for r in range(world_size):
        path = os.path.join(tmp, f"rank{r}.pt")
        if os.path.exists(path):
            recs.append(_read_result(path))
    failed = [rec for rec in recs if not rec["ok"]]
    return (
        bool(failed)
        and all(rec.get("stage") == "init" for rec in failed)
        and any(
            "address already in use" in rec.get("error", "").lower() or "eaddrinuse" in rec.get("error", "").lower()
            for rec in failed
        )
    )


def _spawn_once(fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout_s: float) -> list[Any]:
    import tempfile

    tmp = tempfile.mkdtemp(prefix="lossparity-spawn-")  # mode 0700: only this user reads or writes results
    try:
        port = free_port()
        # C++ reducer notices ("find_unused_parameters found no unused parameter") are read when the
        # child imports torch, so the variable must be in the environment the children inherit.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        ctx = mp.start_processes(
            _entry,
            args=(world_size, port, backend, timeout_s, fn, args, tmp, os.getpid()),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        failed = None
        deadline = time.monotonic() + 2 * timeout_s + 60
        try:
            # grace_period: after a rank fails, its peers get a few seconds to fail on their own and
            # record their error (every failed rank is reported) before join terminates them.
            while not ctx.join(timeout=5, grace_period=_GRACE_PERIOD_S):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise RankError(f"ranks still running after {2 * timeout_s + 60:.0f} s: killed (hang?)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            failed = e
            # Peers of a failed rank may wait in a collective until their timeout: stop them now.
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            if _port_taken(tmp, world_size):
                raise _PortTaken from None
        return _collect(tmp, world_size, failed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(tmp: str, world_size: int, failed: BaseException | None) -> list[Any]:
    """The ranks' results in rank order, or :class:`RankError` with every failed rank's error."""
    results, failures, missing = [], [], []
    for r in range(world_size):
        path = os.path.join(tmp, f"rank{r}.pt")
        if not os.path.exists(path):
            missing.append(r)
            continue
        rec = _read_result(path)
        if rec["ok"]:
            results.append(rec["result"])
        else:
            failures.append(
                RankFailure(
                    r,
                    rec.get("kind", "Error"),
                    rec.get("message", rec["error"]),
                    rec.get("input_error", False),
                    rec["error"],
                    rec.get("when", 0.0),
                )
            )
    if failures:
        stopped = f"rank(s) {', '.join(map(str, missing))} stopped by the launcher" if missing else ""
        raise RankError(stopped, failures)
    if missing:
        raise RankError(
            f"rank(s) {', '.join(map(str, missing))} exited without a result"
            + (f" ({failed})" if failed is not None else "")
        )
    # Every rank saved its result: an abnormal exit after that (process-group teardown) loses nothing.
    return results
