"""Start ``world_size`` local ranks with ``torch.distributed`` initialized (gloo on CPU, NCCL on GPU).

Used by ``lossparity train``/``verify`` when not run under ``torchrun`` and by the multi-process tests.
Every rank gets a bounded collective timeout, the rendezvous uses a free port of 127.0.0.1 chosen at
run time, and a rank that raises makes ``spawn`` raise in the parent with that rank's traceback
instead of leaving the others hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn", "init_from_env", "RankError"]


class RankError(RuntimeError):
    """A spawned rank failed; the message carries the rank and its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None, timeout_s: float = 120.0) -> None:
    """Initialize the default process group from ``torchrun``-style environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with a bounded timeout."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _entry(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable[..., Any],
           args: tuple, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # Each rank gets one thread: ranks share the machine's cores, oversubscription only slows them down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        init_from_env(backend, timeout_s)
        out = fn(rank, world_size, *args)
        # Leave together: a rank tearing down while a peer (the TCP store's host) is gone can abort.
        dist.barrier()
        torch.save({"ok": True, "result": out}, path)
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with the default group
    initialized, and return the list of their return values (rank order). ``fn`` must be importable
    (a module-level function). Raises :class:`RankError` naming the first failing rank."""
    import tempfile

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="lossparity-spawn-") as tmp:
        port = free_port()
        # C++ reducer notices ("find_unused_parameters found no unused parameter") are read when the
        # child imports torch, so the variable must be in the environment the children inherit.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        ctx = mp.start_processes(_entry, args=(world_size, port, backend, timeout_s, fn, args, tmp),
                                 nprocs=world_size, join=False, start_method="spawn")
        failed = None
        deadline = time.monotonic() + 2 * timeout_s + 60
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise RankError(f"ranks still running after {2 * timeout_s + 60:.0f} s: killed (hang?)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            failed = e
            # Peers of a failed rank may wait in a collective until their timeout: stop them now.
            time.sleep(1.0)
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pt")
            if not os.path.exists(path):
                if failed is not None:
                    continue
                raise RankError(f"rank {r} exited without a result")
            rec = torch.load(path, weights_only=False)
            if not rec["ok"]:
                raise RankError(f"rank {r} failed:\n{rec['error']}")
            results.append(rec["result"])
        if failed is not None and len(results) < world_size:
            raise RankError(str(failed))
        # Every rank saved its result: an abnormal exit after that (process-group teardown) loses nothing.
        return results
