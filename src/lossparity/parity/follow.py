"""Follow a candidate log as it grows and feed each new step to a :class:`~lossparity.parity.guard.ParityGuard`.

For a framework we do not control: its log file is read again whenever it grows (the log readers ignore an
incomplete last line, so a line is compared once its newline is written), the steps not seen before go to
:meth:`ParityGuard.update` in order (a log whose steps go back, a restarted job, is replayed from the
repeated step on, as the readers' restart rule says), and following ends at

- the first violation (``outcome = "violation"``),
- ``until``: the candidate reached that step, or it covered the reference (reached the reference's last point
  of every compared metric): the offline verdict of :meth:`ParityGuard.finish` (``"parity"`` or
  ``"violation"``),
- ``idle`` seconds without growth (``"stalled"``: no verdict).

Only the followed file is read, each time it changes size or modification time; a read costs one parse of
the file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .compare import CompareResult
from .guard import ParityGuard, Verdict
from .readers import LogParseError, Run, detect_format, read_log

__all__ = ["FollowResult", "follow_log"]

_WHOLE_DOCUMENT = ("hf_trainer_state", "megatron_golden")  # rewritten as a whole, not appended to


@dataclass
class FollowResult:
    """How following ended: ``outcome`` (``"violation"``, ``"parity"`` or ``"stalled"``), the guard, the
    offline ``result`` when it was computed, the last step read and the number of reads."""

    outcome: str
    guard: ParityGuard | None
    result: CompareResult | None = None
    last_step: int | None = None
    reads: int = 0
    message: str = ""
    notes: list[str] = field(default_factory=list)


def _signature(path: str) -> tuple[int, int] | None:
    """Size and modification time of ``path`` (a TensorBoard directory: summed over its files)."""
    try:
        if os.path.isdir(path):
            size = mtime = 0
            for root, _, files in os.walk(path):
                for f in files:
                    st = os.stat(os.path.join(root, f))
                    size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
            return size, mtime
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    except FileNotFoundError:
        return None


def _step_values(run: Run) -> dict[int, dict[str, float]]:
    """``{step: {log name: value}}`` of a run, in step order."""
    out: dict[int, dict[str, float]] = {}
    for m, series in run.metrics.items():
        raw = run.raw_names.get(m, m)
        for s, v in series.items():
            out.setdefault(s, {})[raw] = v
    return dict(sorted(out.items()))


def follow_log(
    path: str,
    make_guard: Callable[[Run], ParityGuard],
    *,
    fmt: str | None = None,
    name_map: dict[str, str] | None = None,
    poll: float = 1.0,
    idle: float = 300.0,
    until: int | None = None,
    on_verdict: Callable[[Verdict], Any] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Any] = time.sleep,
) -> FollowResult:
    """Follow the candidate log ``path`` (module docstring).

    ``make_guard(first_read)`` builds the guard from the first readable state of the log (its step base is
    known then); ``on_verdict`` gets every verdict as it comes. ``poll``: seconds between checks of the file;
    ``idle``: seconds without growth before giving up (also while the file does not exist or its format
    cannot be told yet). Raises the readers' :class:`~lossparity.parity.readers.LogParseError` for a log that
    cannot be parsed, :class:`CompareInputError` for a candidate that cannot be compared, ``ValueError``
    naming ``poll``/``idle``/``until`` for bad settings.
    """
    for name, v in (("poll", poll), ("idle", idle)):
        if not v > 0:
            raise ValueError(f"{name}: expected a number of seconds > 0, got {v!r}")
    if until is not None and until < 0:
        raise ValueError(f"until: expected a step >= 0, got {until!r}")
    guard: ParityGuard | None = None
    fed: dict[int, dict[str, float]] = {}
    seen: tuple[int, int] | None = None
    last_growth = clock()
    reads = 0
    why_waiting = f"{path} does not exist yet"
    while True:
        sig = _signature(path)
        if sig is not None and sig != seen:
            seen, last_growth = sig, clock()
            run = None
            try:
                fmt = fmt or detect_format(path)
                run = read_log(path, fmt=fmt, name_map=name_map)
            except LogParseError as e:
                # not enough of the log yet to tell its format, or a JSON document caught while it is rewritten:
                # read again at the next change; a broken line of a line-oriented log is an error at once
                if fmt is not None and fmt not in _WHOLE_DOCUMENT:
                    raise
                why_waiting = f"{path} cannot be read yet ({e})"
            if run is not None:
                reads += 1
                guard = guard or make_guard(run)
                done = _feed(guard, fed, _step_values(run), on_verdict)
                last = max(fed) if fed else None
                if guard.violation is not None:
                    return FollowResult("violation", guard, None, last, reads, guard.violation.message())
                if done or (until is not None and last is not None and last >= until) or guard.covered:
                    return _finish(guard, last, reads, until)
                why_waiting = f"{path} stopped growing at step {last}" if last is not None else why_waiting
        if clock() - last_growth >= idle:
            return FollowResult(
                "stalled",
                guard,
                None,
                max(fed) if fed else None,
                reads,
                f"gave up after {idle:g} s without growth: {why_waiting}; no verdict",
            )
        sleep(poll)


def _feed(
    guard: ParityGuard,
    fed: dict[int, dict[str, float]],
    steps: dict[int, dict[str, float]],
    on_verdict: Callable[[Verdict], Any] | None,
) -> bool:
    """Give the guard the steps that are new or changed since the last read (from the first changed one on,
    so a restart replays); stops at the first violation. Returns whether it stopped."""
    start = next((s for s, vals in steps.items() if fed.get(s) != vals), None)
    if start is None:
        return False
    for s in [s for s in fed if s >= start]:
        del fed[s]
    for s, vals in steps.items():
        if s < start:
            continue
        verdict = guard.update(s, vals)
        fed[s] = vals
        if on_verdict is not None:
            on_verdict(verdict)
        if verdict.violation is not None:
            return True
    return False


def _finish(guard: ParityGuard, last: int | None, reads: int, until: int | None) -> FollowResult:
    # with `until` the run is judged as far as it was followed: later reference steps are not missing
    result = guard.finish(live=until is not None)
    outcome = "parity" if result.passed else "violation"
    message = guard.violation.message() if guard.violation is not None else "parity"
    return FollowResult(outcome, guard, result, last, reads, message)
