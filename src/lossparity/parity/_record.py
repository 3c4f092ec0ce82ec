"""Shared pieces of the log readers: the :class:`Run` they return, the error they raise, the recorder that
applies the name map and the restart rule, strict number parsing and a line iterator that knows whether a
line was complete (ended with a newline).

Torch-free and NumPy-free: the readers start fast and work where neither is installed.
"""

from __future__ import annotations

import math
import re
from bisect import insort
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from ..input_files import MAX_STEP, InputFileError, bounded_step, capped_lines
from ._series import Series
from .names import canonical_name, is_canonical

__all__ = [
    "LogParseError",
    "Run",
    "Recorder",
    "to_float",
    "to_number",
    "decorated_number",
    "is_number_array",
    "json_number",
    "int_step",
    "console_step",
    "input_error",
    "lines",
    "SAMPLES_KEYS",
    "MAX_SERIES",
    "Series",
]

SAMPLES_KEYS = ("consumed_samples", "consumed samples")
MAX_SERIES = 10_000
"""Most metrics one log holds: each is a series of its own (a few hundred bytes even when it holds one value),
so a log that names new keys on every line would otherwise grow without bound; real logs have tens to a few
thousand (a W&B export)."""


_MAX_MESSAGE = 600


class LogParseError(ValueError):
    """A log that cannot be read: names the file, the 1-based line (when known) and what was expected."""

    def __init__(self, path: str, line: int | None, expected: str, where: str | None = None):
        if len(expected) > _MAX_MESSAGE:  # a quoted piece of a crafted line: the message stays one short line
            expected = f"{expected[: _MAX_MESSAGE - 100]}... ({len(expected)} characters)"
        self.path, self.line, self.expected, self.where = str(path), line, expected, where
        loc = self.path if line is None else f"{self.path}:{line}"
        if where:
            loc += f" ({where})"
        super().__init__(f"{loc}: expected {expected}")


@dataclass
class Run:
    """The metrics of one training run, keyed by canonical metric name.

    ``metrics[name][step] = value``, each series a :class:`Series` (a sorted step→value mapping on two
    arrays; plain mappings given here are converted; see :mod:`lossparity.parity.readers` for missing/NaN
    values, restarts and step numbering). ``consumed_samples[step]`` is the number of samples consumed up to
    and including ``step`` when the log states it. ``raw_names[name]`` is the name in the log. ``notes`` says what the
    reader ignored or decided on the user's behalf (an incomplete last line, joined wrapped lines,
    evaluation entries, a detected step base), one sentence each. ``live``: the log's last line was
    incomplete, i.e. the log is probably still being written. ``unreadable[name]`` says where a metric's
    value was visibly not one number (a bracketed array such as MindFormers' ``global_norm: [1 31049]``):
    those values were skipped with a note, and asking to compare that metric is an input error.
    """

    source: str
    format: str
    metrics: dict[str, Series] = field(default_factory=dict)
    consumed_samples: dict[int, float] = field(default_factory=dict)
    step_base: int = 1
    skipped_lines: int = 0
    skipped_steps: set[int] = field(default_factory=set)
    restarts: int = 0
    dropped_values: int = 0
    raw_names: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    live: bool = False
    unreadable: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = {k: v if isinstance(v, Series) else Series(v) for k, v in self.metrics.items()}

    def steps(self) -> list[int]:
        """Sorted union of the steps at which any metric has a value."""
        return sorted({s for values in self.metrics.values() for s in values})

    def with_constant_batch_size(self, global_batch_size: int) -> Run:
        """Copy of the run with ``consumed_samples[s] = (s - step_base + 1) · global_batch_size``.

        For logs that do not state consumed samples and were trained with a fixed global batch size;
        the value counts the batch of step ``s`` itself (Megatron's convention).
        """
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        samples = {s: float((s - self.step_base + 1) * global_batch_size) for s in self.steps()}
        return replace(self, consumed_samples=samples)


# ---------------------------------------------------------------------------------------------------
# recording (name mapping, restart rule)


class _Segment:
    """The records read since one restart: the first ``lo`` and last ``hi`` step read, and the names of the
    series written (each once). Segments follow each other in increasing, disjoint step ranges, so a restart at
    step ``s`` touches only the segments whose steps reach ``s`` and, in them, only the series written there."""

    __slots__ = ("lo", "hi", "names", "ordered")

    def __init__(self, lo: int) -> None:
        self.lo = self.hi = lo
        self.names: list[str] = []
        self.ordered = False  # names sorted by their series' last step (done once the segment is closed)


class Recorder:
    """Collects values for one run and applies the name map and the restart rule.

    A restart (a step below the last one read, :meth:`begin`) drops every value at or after that step; it
    visits only the series written at those steps (:class:`_Segment`), never every series the log created, so
    a log that restarts often costs what the dropped values cost. A log of more than :data:`MAX_SERIES`
    metrics is an error naming it."""

    def __init__(self, path: str, fmt: str, name_map: Mapping[str, str] | None, step_base: int = 1):
        self.path, self.fmt, self.name_map = path, fmt, name_map
        self.metrics: dict[str, Series] = {}
        self.samples = Series()
        self.raw_names: dict[str, str] = {}
        self.skipped_steps: set[int] = set()
        self.step_base = step_base
        self.skipped_lines = 0
        self.restarts = 0
        self.dropped = 0
        self.notes: list[str] = []
        self.live = False
        self._last_step: int | None = None
        self._last_by_metric: dict[str, int] = {}
        self.unreadable: dict[str, tuple[str, int]] = {}  # name -> (first "line N: 'raw: text'", count)
        self._canonical: dict[str, str | None] = {}  # canonical_name of each raw name seen (called per value)
        self.generation = 0  # bumped when a metric is renamed (an alias met its canonical name): caches expire
        self._segments: list[_Segment] = []
        self._stamp: dict[str, _Segment] = {}  # the segment each series was last registered in
        self._max_skipped: int | None = None

    def canonical(self, raw: str) -> str | None:
        """:func:`~.names.canonical_name` of ``raw`` with this log's name map (computed once per raw name)."""
        try:
            return self._canonical[raw]
        except KeyError:
            name = canonical_name(raw, self.name_map)
            if len(self._canonical) < 2 * MAX_SERIES:  # names dropped by a name map are no series: bounded here
                self._canonical[raw] = name
            return name

    def note(self, text: str) -> None:
        """Record one sentence for ``Run.notes`` (said once)."""
        if text not in self.notes:
            self.notes.append(text)

    def torn(self, ln: int, why: str = "it does not end with a newline", last: bool = True) -> None:
        """Ignore an incomplete line with a note; it is never compared. ``last``: it ends the file, so the log
        is probably still being written (``Run.live``)."""
        self.skipped_lines += 1
        self.live = self.live or last
        where = "last line" if last else "line"
        self.note(
            f"{where} {ln} ignored: incomplete ({why}; the log may still be written)"
            if last
            else f"{where} {ln} ignored: incomplete ({why}; the job was probably killed while writing it)"
        )

    def skip_array(self, raw: str, text: str, line: int) -> None:
        """Skip a value that is visibly not one number (a bracketed array) of a field that is not a loss; it is
        said in a note and in ``Run.unreadable`` (comparing that metric is then an input error)."""
        name = self.name(raw, line)
        if name is None:
            return
        first, count = self.unreadable.get(name, (f"line {line}: '{raw}: {text}'", 0))
        self.unreadable[name] = (first, count + 1)

    def begin(self, step: int) -> None:
        """Start a record at ``step``; a step below the last one read is a restart: the values at ``step`` and
        after are dropped from every series (visiting only the series written at those steps)."""
        if self._last_step is not None and step < self._last_step:
            self.restarts += 1
            self._restart(step)
            self.samples.drop_from(step)
            if self._max_skipped is not None and self._max_skipped >= step:
                self.skipped_steps = {s for s in self.skipped_steps if s < step}
                self._max_skipped = max(self.skipped_steps, default=None)
        if not self._segments or (self._last_step is not None and step < self._last_step):
            self._segments.append(_Segment(step))
        self._segments[-1].hi = step
        self._last_step = step

    def skip_step(self, step: int) -> None:
        """List ``step`` in ``Run.skipped_steps`` (the log flags it skipped, NaN or an overflow)."""
        self.skipped_steps.add(step)
        if self._max_skipped is None or step > self._max_skipped:
            self._max_skipped = step

    def _restart(self, step: int) -> None:
        """Drop the values at ``step`` and after: whole segments that start there or later, and in the one
        segment that straddles ``step`` the series whose last step reaches it (its names are kept sorted by
        their series' last step, so only those are visited)."""
        segments = self._segments
        while segments and segments[-1].lo >= step:
            gone = segments.pop()
            for name in gone.names:
                values = self.metrics.get(name)
                if values is not None:
                    self.dropped += values.drop_from(step)
            gone.names = []  # stale stamps may still point at it
        if not segments or segments[-1].hi < step:
            return
        seg = segments[-1]
        seg.hi = step - 1
        if not seg.ordered:  # once per segment: sorted by last step, the series a restart reaches are a suffix
            seg.names.sort(key=self._last_of)
            seg.ordered = True
        moved = []
        while seg.names and self._last_of(seg.names[-1]) >= step:
            name = seg.names.pop()
            self.dropped += self.metrics[name].drop_from(step)
            moved.append(name)
        for name in moved:  # still written in this segment: back in its place among the others
            if self._last_of(name) >= seg.lo:
                insort(seg.names, name, key=self._last_of)
            elif self._stamp.get(name) is seg:
                del self._stamp[name]

    def _last_of(self, name: str) -> int:
        values = self.metrics.get(name)
        steps = values.arrays()[0] if values is not None else None
        return steps[-1] if steps else -MAX_STEP

    def name(self, raw: str, line: int | None = None) -> str | None:
        """Canonical name of ``raw`` (``None``: dropped by the name map); two raw names for one metric raise."""
        name = self.canonical(raw)
        if name is None:
            return None
        prev = self.raw_names.setdefault(name, raw)
        if prev != raw and name in (prev, raw):
            # The log names the canonical metric itself next to an alias of it (LossParityTrainer logs
            # lossparity's `objective` beside HF's `loss`): the literal name is the metric, the alias keeps
            # its own raw name (listed, not compared by default).
            alias = prev if raw == name else raw
            if prev == alias:  # the alias came first: its values move to its own name
                self.metrics[alias] = self.metrics.pop(name, Series())
                self.generation += 1  # names cached by readers are stale
                for seg in self._segments:  # once per log: the segments follow the series to its new name
                    seg.names = [alias if n == name else n for n in seg.names]
                if name in self._stamp:
                    self._stamp[alias] = self._stamp.pop(name)
                self.raw_names[name] = name
            self.raw_names[alias] = alias
            return raw
        if prev != raw:
            raise LogParseError(
                self.path,
                line,
                f"one log name per metric, but {prev!r} and {raw!r} both map to {name!r} (rename one with a name map)",
            )
        return name

    def put(self, raw: str, step: int, value: float, line: int | None = None) -> None:
        """Record ``value`` of the raw metric ``raw`` at ``step`` (consumed samples go to ``samples``)."""
        if raw in SAMPLES_KEYS:
            self.samples[step] = value
            return
        name = self.name(raw, line)
        if name is not None:
            self.series(name, line)[step] = value

    def series(self, name: str, line: int | None = None) -> Series:
        """The series of the canonical ``name`` (created empty on first use: more than :data:`MAX_SERIES` is a
        :class:`LogParseError` naming the file and ``line``), registered as written in the current record."""
        values = self.metrics.get(name)
        if values is None:
            if len(self.metrics) >= MAX_SERIES:
                raise LogParseError(
                    self.path,
                    line,
                    f"at most {MAX_SERIES} metrics in one log, got a new one, {name[:80]!r} (a log that names new keys "
                    "on every line is no training log)",
                )
            values = self.metrics[name] = Series()
        if self._segments:
            seg = self._segments[-1]
            if self._stamp.get(name) is not seg:
                self._stamp[name] = seg
                seg.names.append(name)
        return values

    def put_ordered(self, raw: str, step: int, value: float, line: int | None = None) -> None:
        """Add one value with the restart rule applied to this metric alone (one metric per record)."""
        is_samples = raw in SAMPLES_KEYS
        name = SAMPLES_KEYS[0] if is_samples else self.name(raw, line)
        if name is None:
            return
        values = self.samples if is_samples else self.series(name, line)
        last = self._last_by_metric.get(name)
        if last is not None and step < last:
            self.restarts += 1
            dropped = values.drop_from(step)
            self.dropped += 0 if is_samples else dropped
        self._last_by_metric[name] = step
        values[step] = value

    def put_series(self, raw: str, points: Iterable[tuple[int, float]]) -> None:
        """Add one tag's series from one file: replaces that tag's values from its first step on."""
        points = sorted(points)
        name = self.name(raw)
        if name is None or not points:
            return
        values = self.series(name)
        dropped = values.drop_from(points[0][0])
        self.restarts += int(dropped > 0)
        self.dropped += dropped
        for s, v in points:
            values[s] = v

    def strict(self, raw: str) -> bool:
        """Whether the value of ``raw`` must be a plain number: canonical metrics and any ``*loss*``."""
        name = self.canonical(raw) or raw
        return is_canonical(name) or "loss" in raw.lower()

    def run(self, release: bool = False) -> Run:
        """The collected :class:`Run` (series sorted by step, empty metrics left out). ``release``: the recorder
        is done (a whole log was read): its series are handed over instead of copied."""
        for name, (first, count) in self.unreadable.items():
            raw = self.raw_names.get(name, name)
            self.note(
                f"{raw!r} ({name}): {count} value(s) that are not one number skipped (first at {first}); "
                "the other fields of those lines were read"
            )
        if release:  # handed over, not copied; the names stay known (raw_names below)
            metrics = {k: v for k, v in self.metrics.items() if v}
            self.metrics = {k: Series() for k in metrics}
        else:
            metrics = {k: Series(v.items()) for k, v in self.metrics.items() if v}
        return Run(
            source=self.path,
            format=self.fmt,
            metrics=metrics,
            consumed_samples=dict(self.samples.items()),
            step_base=self.step_base,
            skipped_lines=self.skipped_lines,
            skipped_steps=set(self.skipped_steps),
            restarts=self.restarts,
            dropped_values=self.dropped,
            raw_names={k: v for k, v in self.raw_names.items() if metrics.get(k)},
            notes=list(self.notes),
            live=self.live,
            unreadable={k: first for k, (first, _) in self.unreadable.items()},
        )


# ---------------------------------------------------------------------------------------------------
# numbers

_NONFINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "-inf": -math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-infinity": -math.inf,
}
# one way to match each number (no `\d+\.?\d*`, which backtracks quadratically on a long digit run)
_PLAIN_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")
# a console number with decoration: thousands separators, a unit or percent sign, a parenthesized remark
_DECORATED_RE = re.compile(
    r"^([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?)(?:%|[A-Za-z/]+)?(?:\([^()]*\))?$"
)


def to_float(text: str) -> float | None:
    """The float of a complete plain number token (``1.2E+00``, ``-3``, ``nan``, ``inf``), else ``None``.

    The whole token must be the number: ``4.6O72`` or ``1 2`` are not numbers (no prefix is cut off).
    """
    t = text.strip()
    if t.lower() in _NONFINITE:
        return _NONFINITE[t.lower()]
    return float(t) if _PLAIN_RE.match(t) else None


def to_number(text: str) -> float | None:
    """:func:`to_float` of a token that may be wrapped in one pair of brackets (``[4.56]``, MindFormers)."""
    t = text.strip()
    if t.startswith("[") and t.endswith("]"):
        t = t[1:-1]
    return to_float(t)


_ARRAY_SEP_RE = re.compile(r"[\s,]+")


def is_number_array(text: str) -> bool:
    """Whether ``text`` is visibly several numbers in one pair of brackets (``[1 31049]``, ``[0.5, 2]``): a
    value that is not one number, as opposed to a corrupted number (``4.6O72``, ``[4.6O72]``). The
    numbers are separated by spaces and commas, the first comes before any comma. Linear in the length
    (a split, no backtracking regex)."""
    t = text.strip()
    if len(t) < 2 or t[0] != "[" or t[-1] != "]":
        return False
    inner = t[1:-1]
    if "[" in inner or "]" in inner or inner.lstrip().startswith(","):
        return False
    parts = [p for p in _ARRAY_SEP_RE.split(inner) if p]
    return len(parts) >= 2 and all(to_float(p) is not None for p in parts)


def decorated_number(text: str) -> float | None:
    """The number of a decorated console token: ``1,234``, ``5.7%``, ``123ms``, ``10.2GiB(11.3%)``, ``2.8T``.

    The decoration must be the whole rest of the token, so a corrupted digit is not a number.
    """
    v = to_number(text)
    if v is not None:
        return v
    m = _DECORATED_RE.match(text.strip())
    return float(m.group(1).replace(",", "")) if m else None


def json_number(value: object) -> float | None:
    """Numeric value of a JSON scalar: numbers, and the strings ``nan``/``inf``; anything else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # an int beyond float64 (JSON is parsed with long ints as floats already)
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return _NONFINITE[value.strip().lower()]
    return None


def int_step(value: object) -> int | None:
    """Integer step of a JSON/CSV value (``3``, ``3.0``, ``"3"``) with ``|step| < 2**53``, or ``None``."""
    if isinstance(value, str):
        value = to_float(value) if len(value) < 64 else None
    return bounded_step(value)


_MAX_STEP_DIGITS = len(str(MAX_STEP))


def console_step(digits: str, path: str, line: int, what: str = "step") -> int:
    """The step of a console line's digit run (matched by ``\\d+``); a number of ``2**53`` or more is a
    :class:`LogParseError` naming file:line (never Python's int-digits error, never an int64 overflow)."""
    value = int(digits) if len(digits) <= _MAX_STEP_DIGITS else MAX_STEP
    if value >= MAX_STEP:
        shown = digits if len(digits) <= 24 else f"{digits[:20]}... ({len(digits)} digits)"
        raise LogParseError(path, line, f"a {what} below 2**53, got {shown}")
    return value


def lines(path: str) -> Iterator[tuple[int, str, bool]]:
    """``(1-based number, text without the line break, complete)`` of every line; ``complete`` is False only
    for a last line that does not end with a newline (a log cut while being written). Only a regular file
    is read, and a line longer than :data:`lossparity.input_files.MAX_LINE_CHARS` is a
    :class:`LogParseError` naming file:line."""
    try:
        for i, line in capped_lines(path):
            complete = line.endswith(("\n", "\r"))
            yield i, line.rstrip("\r\n").replace("\r", ""), complete
    except InputFileError as e:
        raise input_error(e) from None


def input_error(e: InputFileError) -> LogParseError:
    """The readers' own error for a file refused by :mod:`lossparity.input_files` (not a regular file, too
    large, a line too long)."""
    reason = e.reason
    return LogParseError(
        e.path, e.line, reason[len("expected ") :] if reason.startswith("expected ") else f"a log file ({reason})"
    )
