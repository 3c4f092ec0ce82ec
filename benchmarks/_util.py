"""Small helpers shared by the benchmarks: timing, peak extra memory, Markdown tables, JSON output.

Peak memory is measured per call as *extra* bytes above what was resident just before the call:
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (exact, allocator level).
- CPU on Linux: the kernel's resident-set high-water mark ``VmHWM`` of ``/proc/self/status``, reset
  before the call by writing ``5`` to ``/proc/self/clear_refs``; extra = ``VmHWM - VmRSS(before)``.
  This is exact at page granularity and needs no sampling thread, but it sees the process, not torch:
  memory the C allocator keeps from earlier frees can be reused without raising RSS (a slight
  underestimate), and tensors that are allocated but never written are not resident. Python's
  ``tracemalloc`` cannot be used: torch's allocations bypass it.
- Elsewhere the figure is reported as unavailable (``None``).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

MiB = 2**20


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_method(device: torch.device) -> str:
    """Name of the peak-memory method :func:`measure` uses on ``device`` (for the report)."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated"
    if _proc_status_kib("VmHWM") is not None and _reset_rss_peak():
        return "process RSS high-water mark (/proc/self/status VmHWM, reset via clear_refs)"
    return "unavailable"


def measure(fn: Callable[[], Any], device: torch.device) -> tuple[float, int | None]:
    """Run ``fn()`` once; return ``(wall seconds, peak extra bytes or None)``. Synchronizes CUDA around
    the call so the time covers the kernels, and collects garbage first so earlier calls' tensors are
    not counted as the baseline's."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        base_kib = _proc_status_kib("VmRSS")
        ok = _reset_rss_peak()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        return elapsed, torch.cuda.max_memory_allocated(device) - base
    peak_kib = _proc_status_kib("VmHWM")
    if not ok or base_kib is None or peak_kib is None:
        return elapsed, None
    return elapsed, max(peak_kib - base_kib, 0) * 1024


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Median and minimum of repeated timings, in seconds."""
    return {"median_s": statistics.median(times), "min_s": min(times)}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; cells are formatted with ``str``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on: platform, CPU, core count, torch version and threads, device."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
