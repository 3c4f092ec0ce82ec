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

from ._record import (
    LogParseError,
    Recorder,
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
    step = int(m.group(1))
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
                rec.skipped_steps.add(step)
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
_TITAN_FIELD_RE = re.compile(r"([A-Za-z_][\w/]*):\s*(\S+)")


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
        step = int(m.group(1))
        rec.begin(step)
        for key, text in _TITAN_FIELD_RE.findall(m.group(2)):
            _put_field(rec, path, ln, step, key, text)


# ---------------------------------------------------------------------------------------------------
# MindFormers

MF_START_RE = re.compile(r"Epoch:\s*\[")
_MF_LINE_RE = re.compile(r"Epoch:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,\s*step:\s*\[\s*(\d+)\s*/\s*(\d+)\s*\]\s*,?(.*)$")
# "name: value" or, as some releases print global_norm, "name [value]" without the colon
_MF_FIELD_RE = re.compile(r"([A-Za-z_][\w ]*?)\s*(?::\s*|\s(?=\[))(\[[^\]]*\]|[^,]*)")


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
        epoch, step_in_epoch, per_epoch = int(m.group(1)), int(m.group(3)), int(m.group(4))
        step = (epoch - 1) * per_epoch + step_in_epoch
        rec.begin(step)
        for key, text in _MF_FIELD_RE.findall(m.group(5)):
            key, text = key.strip(), text.strip()
            if key == "overflow cond":
                if text not in ("True", "False"):
                    raise LogParseError(path, ln, f"True or False for 'overflow cond', got {text!r}")
                if text == "True":
                    rec.skipped_steps.add(step)
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
        step = int(m.group(1))
        rec.begin(step)
        rec.put("loss", step, value, ln)
