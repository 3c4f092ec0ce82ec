"""Readers of console logs: Megatron-LM, MaxText, torchtitan, MindFormers, and torchtitan's loss export.

Every reader follows the conventions of :mod:`lossparity.parity.readers`. Numbers of canonical metrics
(and of any ``*loss*`` field) must be complete plain numbers (:func:`~._record.to_number`), otherwise the
line is an error naming file:line; other fields may carry a unit, a percent sign or thousands separators
(:func:`~._record.decorated_number`) and are ignored when they are not numbers at all. A bracketed array of
numbers in a canonical field that is not a loss (MindFormers' ``global_norm: [1 31049]``) is skipped with a
note and listed in ``Run.unreadable``. A last line without
a newline (a log still being written) is ignored with a note, as is a Megatron metric line that does not
end with ``|`` and is not continued on the next line (Megatron ends every complete metric line with
``|``); a Megatron line hard-wrapped by a terminal is joined with its continuation lines.
"""

from __future__ import annotations

import re

from ..input_files import MAX_STEP
from ._record import (
    LogParseError,
    Recorder,
    console_step,
    decorated_number,
    int_step,
    is_number_array,
    lines,
    to_float,
    to_number,
)

__all__ = [
    "MEG_START_RE",
    "MF_START_RE",
    "TITAN_START_RE",
    "ANSI_RE",
    "MAXTEXT_START",
    "LOSS_EXPORT_RE",
    "read_megatron",
    "read_maxtext",
    "read_torchtitan",
    "read_mindformers",
    "read_loss_export",
    "titan_fields",
    "mindformers_fields",
]


def _put_field(rec: Recorder, path: str, ln: int, step: int, key: str, text: str) -> None:
    """Record one ``key: text`` field: strict for canonical/loss fields, decorated numbers otherwise.

    A bracketed array (``global_norm: [1 31049]``, visibly not one number) in a field that is not a loss is
    skipped with a note (:meth:`Recorder.skip_array`); in a loss field, as any other non-number there, it
    is an error naming file:line."""
    if rec.strict(key):
        value = to_number(text)
        if value is None and "loss" not in key.lower() and is_number_array(text):
            rec.skip_array(key, text.strip(), ln)
            return
        if value is None:
            raise LogParseError(path, ln, f"a number for {key!r}, got {text.strip()!r}")
    else:
        value = decorated_number(text)
        if value is None:  # a label (an ETA string, a flag): not a metric
            return
    rec.put(key, step, value, ln)


# ---------------------------------------------------------------------------------------------------
# Megatron-LM

MEG_START_RE = re.compile(r"\biteration\s+\d+\s*/")
_MEG_LINE_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_MEG_COUNTS = ("number of skipped iterations", "number of nan iterations")
_MEG_MAX_WRAPS = 8


def _megatron_record(path: str, ln: int, text: str, rec: Recorder) -> None:
    m = _MEG_LINE_RE.search(text)
    if m is None:
        raise LogParseError(path, ln, "a Megatron line 'iteration N/ M | name: value | ...'")
    step = console_step(m.group(1), path, ln)
    rec.begin(step)
    for fld in m.group(3).split("|"):
        fld = fld.strip()
        if not fld:
            continue
        key, sep, text_value = fld.partition(":")
        key = key.strip()
        if not sep or not key:
            raise LogParseError(path, ln, f"'name: value' between '|', got {fld!r}")
        if key in _MEG_COUNTS:
            count = to_float(text_value)
            if count is None:
                raise LogParseError(path, ln, f"a number for {key!r}, got {text_value.strip()!r}")
            if count > 0:
                rec.skip_step(step)
            continue
        _put_field(rec, path, ln, step, key, text_value)


def read_megatron(path: str, rec: Recorder) -> None:
    """Megatron-LM stdout (see :mod:`lossparity.parity.readers`)."""
    pending: tuple[int, str, int] | None = None  # (first line, joined text, continuation lines)
    for ln, line, complete in lines(path):
        starts = MEG_START_RE.search(line) is not None
        if pending is not None:
            first, text, wraps = pending
            if starts or wraps >= _MEG_MAX_WRAPS or not complete:
                rec.torn(first, "a Megatron metric line ends with '|'", last=False)
                pending = None
            else:
                text += line
                if text.rstrip().endswith("|"):
                    _megatron_record(path, first, text, rec)
                    rec.note(
                        f"line {first}: a metric line hard-wrapped by the terminal was joined with the "
                        f"{wraps + 1} line(s) after it"
                    )
                    rec.skipped_lines += wraps + 1
                    pending = None
                else:
                    pending = (first, text, wraps + 1)
                continue
        if not starts:
            rec.skipped_lines += 1
        elif complete and line.rstrip().endswith("|"):
            _megatron_record(path, ln, line, rec)
        elif complete:
            pending = (ln, line, 0)
        else:
            rec.torn(ln)
    if pending is not None:  # the last metric line was never completed: live when nothing followed it
        rec.torn(pending[0], "a Megatron metric line ends with '|'", last=pending[2] == 0)


# ---------------------------------------------------------------------------------------------------
# MaxText

MAXTEXT_START = "completed step:"
_MAXTEXT_PROFILER = "completed profiler activation/deactivation step:"
_MAXTEXT_RE = re.compile(r"completed (?:profiler activation/deactivation )?step:\s*([^,\s]+)\s*(?:,(.*))?$")


def read_maxtext(path: str, rec: Recorder) -> None:
    """MaxText console, profiler boundary lines included (see :mod:`lossparity.parity.readers`)."""
    for ln, line, complete in lines(path):
        m = _MAXTEXT_RE.search(line)
        if m is None:
            rec.skipped_lines += 1
            continue
        if not complete:
            rec.torn(ln)
            continue
        step = int_step(m.group(1))
        if step is None:
            raise LogParseError(path, ln, f"an integer step after 'completed ... step:', got {m.group(1)!r}")
        if _MAXTEXT_PROFILER in line:
            rec.note(f"step {step} is a profiler boundary step (MaxText prints no timing for it); its loss was read")
        rec.begin(step)
        for fld in (m.group(2) or "").split(","):
            if not fld.strip():
                continue
            key, sep, text = fld.partition(":")
            if not sep or not key.strip():
                raise LogParseError(path, ln, f"'name: value' between commas, got {fld.strip()!r}")
            _put_field(rec, path, ln, step, key.strip(), text)


# ---------------------------------------------------------------------------------------------------
# torchtitan

ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# "step:" as the first token of the message: after a log prefix ending in '-', ']' or '|', or at the start
TITAN_START_RE = re.compile(r"(?:^|[-\]|])\s*step:")
_TITAN_LINE_RE = re.compile(r"(?:^|[-\]|])\s*step:\s*(\d+)\s+(loss:.*)$")
_TITAN_KEY_RE = re.compile(r"[\w/]+")
_KEY_START_RE = re.compile(r"[A-Za-z_]")
_SPACES_RE = re.compile(r"\s*")
_NON_SPACE_RE = re.compile(r"\S+")


def _blank_end(text: str, pos: int) -> int:
    """The position after the whitespace that starts at ``pos``."""
    m = _SPACES_RE.match(text, pos)
    return pos if m is None else m.end()


def titan_fields(text: str) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs ``name: value`` of a torchtitan line: a name is ``[A-Za-z_][\\w/]*``
    right before a colon, the value the next run of non-space characters. What
    ``re.findall(r"([A-Za-z_][\\w/]*):\\s*(\\S+)", text)`` returns, in time linear in the length (that
    regex rescans a long word from each of its characters: quadratic)."""
    out: list[tuple[str, str]] = []
    pos, n = 0, len(text)
    while pos < n:
        run = _TITAN_KEY_RE.search(text, pos)
        if run is None:
            break
        start = _KEY_START_RE.search(text, run.start(), run.end())
        end = run.end()
        if start is None or end >= n or text[end] != ":":
            pos = end  # no start inside the run ends before a colon
            continue
        value = _NON_SPACE_RE.match(text, _blank_end(text, end + 1))
        if value is None:
            pos = end
            continue
        out.append((text[start.start() : end], value.group()))
        pos = value.end()
    return out


def read_torchtitan(path: str, rec: Recorder) -> None:
    """torchtitan console (see :mod:`lossparity.parity.readers`)."""
    for ln, raw_line, complete in lines(path):
        line = ANSI_RE.sub("", raw_line)
        if not TITAN_START_RE.search(line):
            rec.skipped_lines += 1
            continue
        if not complete:
            rec.torn(ln)
            continue
        m = _TITAN_LINE_RE.search(line)
        if m is None:
            raise LogParseError(path, ln, "a torchtitan line 'step: N  loss: x  ...'")
        step = console_step(m.group(1), path, ln)
        rec.begin(step)
        for key, text in titan_fields(m.group(2)):
            _put_field(rec, path, ln, step, key, text)


# ---------------------------------------------------------------------------------------------------
# MindFormers

MF_START_RE = re.compile(r"Epoch:\s*\[")
_MF_LINE_RE = re.compile(r"Epoch:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,\s*step:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,?(.*)$")
_MF_KEY_RE = re.compile(r"[A-Za-z_][\w ]*")


def mindformers_fields(text: str) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs of a MindFormers line: ``name: value`` or, as some releases print
    global_norm, ``name [value]`` without the colon; a value is ``[...]`` or the text up to the next comma.
    What ``re.findall(r"([A-Za-z_][\\w ]*?)\\s*(?::\\s*|\\s(?=\\[))(\\[[^\\]]*\\]|[^,]*)", text)`` returns, in
    time linear in the length (that regex is quadratic on a long run of words without a colon)."""
    out: list[tuple[str, str]] = []
    pos, n = 0, len(text)
    no_close_from = n + 1  # no ']' at or after this position (found once, never searched again)
    while pos < n:
        run = _MF_KEY_RE.search(text, pos)
        if run is None:
            break
        start, end = run.start(), run.end()
        after = _blank_end(text, end)  # the key's trailing blanks: its spaces, then any other whitespace
        key_end = start + len(text[start:end].rstrip(" "))
        if after < n and text[after] == ":":
            value_at = _blank_end(text, after + 1)
        elif after < n and text[after] == "[" and after > key_end:
            value_at = after  # "name [value]"
        else:
            pos = end  # every start inside this run fails the same way
            continue
        key = text[start:key_end]
        close = -1
        if value_at < n and text[value_at] == "[" and value_at < no_close_from:
            close = text.find("]", value_at + 1)
            if close < 0:
                no_close_from = value_at
        if close >= 0:
            out.append((key, text[value_at : close + 1]))
            pos = close + 1
        else:
            comma = text.find(",", value_at)
            stop = n if comma < 0 else comma
            out.append((key, text[value_at:stop]))
            pos = stop
    return out


def read_mindformers(path: str, rec: Recorder) -> None:
    """MindFormers console (see :mod:`lossparity.parity.readers`)."""
    for ln, line, complete in lines(path):
        if not MF_START_RE.search(line):
            rec.skipped_lines += 1
            continue
        if not complete:
            rec.torn(ln)
            continue
        m = _MF_LINE_RE.search(line)
        if m is None:
            raise LogParseError(path, ln, "a MindFormers line '{ Epoch:[e/E], step:[s/S], loss: x, ...'")
        epoch, step_in_epoch = console_step(m.group(1), path, ln, "epoch"), console_step(m.group(3), path, ln)
        per_epoch = console_step(m.group(4), path, ln, "steps per epoch")
        step = (epoch - 1) * per_epoch + step_in_epoch
        if step >= MAX_STEP:
            raise LogParseError(path, ln, f"a global step (epoch - 1)·steps per epoch + step below 2**53, got {step}")
        rec.begin(step)
        for key, text in mindformers_fields(m.group(5)):
            key, text = key.strip(), text.strip()
            if key == "overflow cond":
                if text not in ("True", "False"):
                    raise LogParseError(path, ln, f"True or False for 'overflow cond', got {text!r}")
                if text == "True":
                    rec.skip_step(step)
                continue
            _put_field(rec, path, ln, step, key, text)


# ---------------------------------------------------------------------------------------------------
# torchtitan loss export (scripts/loss_compare.py --export-result)

LOSS_EXPORT_RE = re.compile(r"^\s*(\d+)\s+(\S+)\s*$")


def read_loss_export(path: str, rec: Recorder) -> None:
    """``<step> <loss>`` per line, as torchtitan's ``loss_compare.py --export-result`` writes it."""
    for ln, line, complete in lines(path):
        if not line.strip():
            rec.skipped_lines += 1
            continue
        if not complete:
            rec.torn(ln)
            continue
        m = LOSS_EXPORT_RE.match(line)
        value = to_float(m.group(2)) if m else None
        if m is None or value is None:
            raise LogParseError(path, ln, f"'<step> <loss>' (two numbers), got {line.strip()!r}")
        step = console_step(m.group(1), path, ln)
        rec.begin(step)
        rec.put("loss", step, value, ln)
