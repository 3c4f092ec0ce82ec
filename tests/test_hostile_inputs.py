"""Issue 39: hostile inputs end in one line, in bounded time and memory, inside their folder.

One regression test per row of the issue's table. The log rows (1-12) run ``lossparity compare`` in a
subprocess (its timeout is a hang guard, not a speed assertion); the run-folder and checkpoint rows (13-20)
run ``lossparity train --resume`` / ``convert-checkpoint`` in this process, the cases that once blocked on
a FIFO inside a thread joined with a timeout (a hang guard as well). Time and peak memory of every case are
measured by ``scripts/measure_hostile_inputs.py``, not here.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _hostile  # noqa: E402

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
HANG_GUARD_S = 20


def _compare(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "lossparity", "compare", *argv],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env=env,
    )


def _one_line_naming(err: str, file: str, needle: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    assert file in lines[0] and needle in lines[0], lines[0][:1000]


_NEEDS_TB = {9, 10}


@pytest.mark.parametrize("row", range(1, 12))
def test_log_rows_end_in_one_line(row, tmp_path):
    """Rows 1-11: every case ends within the hang guard with its exit code; exit 2 with one line naming the
    file (and line) and saying what was expected; the cases that are valid logs (rows 2, 3, 9, the cut file of
    row 10) are compared, and a damaged or cut TensorBoard file says so."""
    if row in _NEEDS_TB:
        pytest.importorskip("tensorboard")
    cases = _hostile.ROWS[row](tmp_path)
    assert cases
    for case in cases:
        out = _compare(case.argv)
        assert out.returncode == case.code, (case.name, out.returncode, out.stderr[-2000:])
        if case.code == 2:
            assert case.file is not None
            _one_line_naming(out.stderr, case.file, case.needle)
        else:
            assert "Traceback" not in out.stderr, out.stderr[-2000:]
            assert case.needle in out.stdout, (case.name, out.stdout[-2000:])


# The series written in the valid logs of rows 2, 3, 9 and 10 (the cut file: up to the cut, its last step lost),
# under its canonical name (MindFormers' and torchtitan's `loss` is the objective, TensorBoard's `lm loss`).
_WRITTEN = {
    2: ("objective", {1: 10.873456}),
    3: ("objective", {1: 1.5}),
    9: ("lm_loss", dict(_hostile.LOSSES)),
    10: ("lm_loss", dict(_hostile.LOSSES[:-1])),
}


@pytest.mark.parametrize("row", sorted(_WRITTEN))
def test_valid_hostile_logs_are_read_with_the_values_written(row, tmp_path):
    """The valid logs of rows 2, 3, 9 and 10 compared with themselves above give PARITY whatever the reader
    reads (every loss read as 0 too): here the loss series read is the one written, step for step."""
    from lossparity.parity.readers import read_log

    if row in _NEEDS_TB:
        pytest.importorskip("tensorboard")
    case = next(c for c in _hostile.ROWS[row](tmp_path) if c.code == 0)
    run = read_log(case.argv[1])
    name, series = _WRITTEN[row]
    assert dict(run.metrics[name].items()) == series


def test_row12_wide_csv_and_long_jsonl_are_read(tmp_path):
    """Row 12 at a CI size (the full size is measured by the script): every value is read, the comparison
    with itself passes."""
    from lossparity.parity import read_log

    cases = _hostile.row12(tmp_path, columns=5_000, steps=20_000)
    for case in cases:
        out = _compare(case.argv)
        assert out.returncode == 0 and "PARITY" in out.stdout, out.stderr[-2000:]
    wide = read_log(cases[0].argv[0])
    assert wide.metrics["objective"] == {1: 2.5}
    long = read_log(cases[1].argv[0])
    assert len(long.metrics["lm_loss"]) == 20_000
    assert long.metrics["lm_loss"][20_000] == float(f"{10.0 - 20_000 * 1e-6:.6f}")  # the text written, parsed


def test_row12_csv_wider_than_the_cap_is_refused_in_one_line(tmp_path):
    """A table of more than 10,001 columns (the step and 10,000 metrics) is refused before its rows are read
    (exit 2, one line naming the file, the cap and the width); one of exactly 10,001 is read."""
    cap = _hostile.MAX_CSV_COLUMNS
    over = tmp_path / "over.csv"
    over.write_text("step," + ",".join(f"m{i}" for i in range(cap)) + "\n1," + ",".join(["0.5"] * cap) + "\n")
    out = _compare([str(over), str(over)])
    assert out.returncode == 2
    _one_line_naming(out.stderr, str(over), f"at most {cap} columns, got {cap + 1}")
    at = tmp_path / "at.csv"
    at.write_text("step," + ",".join(f"m{i}" for i in range(cap - 2)) + ",loss\n1," + "0.5," * (cap - 2) + "2.5\n")
    out = _compare([str(at), str(at)])
    assert out.returncode == 0 and "PARITY" in out.stdout, out.stderr[-2000:]


def test_series_behaves_as_a_sorted_dict():
    """``Series`` (the readers' step->value store on two arrays) against a plain dict under 3,000 random
    writes, overwrites, out-of-order inserts, deletions and restarts (``drop_from``), checked after each."""
    import random

    from lossparity.parity._series import Series

    rng = random.Random(0)
    series, ref = Series(), {}
    for i in range(3000):
        op = rng.random()
        if op < 0.55:
            s = (max(ref) + rng.randint(1, 3)) if ref and rng.random() < 0.7 else rng.randint(-50, 400)
            v = rng.choice([rng.uniform(-5, 5), float("nan"), float("inf")])
            series[s], ref[s] = v, v
        elif op < 0.75 and ref:
            s = rng.choice(list(ref))
            del series[s], ref[s]
        elif op < 0.8:
            s = rng.randint(-60, 450)
            stale = [k for k in ref if k >= s]
            for k in stale:
                del ref[k]
            assert series.drop_from(s) == len(stale)
        else:
            s = rng.randint(-60, 450)
            assert (s in series) == (s in ref)
            if s in ref:
                assert series[s] == ref[s] or (ref[s] != ref[s] and series[s] != series[s])
            else:
                with pytest.raises(KeyError):
                    series[s]
        if i % 50 == 0:
            assert list(series) == sorted(ref)
            assert series == ref and len(series) == len(ref)
    steps, values = series.arrays()
    assert list(steps) == sorted(ref) and len(values) == len(ref)


def test_long_lines_and_large_documents_are_refused_naming_them(tmp_path, monkeypatch):
    """The caps themselves (at a small size, by patching the module constants the readers use)."""
    from lossparity import input_files
    from lossparity.parity import LogParseError, read_log

    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 1, "lm_loss": 2.0}\n' + '{"step": 2, "lm_loss": 2.0, "x": "' + "y" * 500 + '"}\n')
    monkeypatch.setattr(input_files, "MAX_LINE_CHARS", 100)
    with pytest.raises(LogParseError, match=r"m\.jsonl:2: expected a log file \(a line longer than 100 characters"):
        read_log(log, fmt="jsonl")
    doc = tmp_path / "trainer_state.json"
    doc.write_text('{"log_history": [' + ", ".join(['{"step": 1, "loss": 2.0}'] * 50) + "]}")
    monkeypatch.setattr(input_files, "MAX_DOCUMENT_BYTES", 100)
    with pytest.raises(LogParseError, match=r"trainer_state\.json: expected a log file \(\d+ bytes, more than the 100"):
        read_log(doc, fmt="hf")


# ---------------------------------------------------------------------------------------------------
# linear parsers: the same answers as the regexes they replace (those regexes are the oracle here)

_OLD_TITAN = re.compile(r"([A-Za-z_][\w/]*):\s*(\S+)")
_OLD_MINDFORMERS = re.compile(r"([A-Za-z_][\w ]*?)\s*(?::\s*|\s(?=\[))(\[[^\]]*\]|[^,]*)")
_OLD_ARRAY = re.compile(r"^\[\s*[^\[\],\s]+(?:\s*,?\s+|\s*,\s*)[^\[\]]*\]$")


def _old_is_number_array(text: str) -> bool:
    from lossparity.parity._record import to_float

    t = text.strip()
    if not _OLD_ARRAY.match(t):
        return False
    parts = [p for p in re.split(r"[\s,]+", t[1:-1]) if p]
    return len(parts) >= 2 and all(to_float(p) is not None for p in parts)


def test_linear_field_parsers_agree_with_the_regexes_they_replace():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    from lossparity.parity._console import mindformers_fields, titan_fields
    from lossparity.parity._record import is_number_array

    @hypothesis.settings(max_examples=1000, deadline=None, derandomize=True, database=None)
    @hypothesis.given(st.text(alphabet="ab1_/ :\t[],.x9e-", max_size=30))
    def agree(text: str) -> None:
        assert titan_fields(text) == _OLD_TITAN.findall(text)
        assert mindformers_fields(text) == _OLD_MINDFORMERS.findall(text)
        assert is_number_array(text) == _old_is_number_array(text)

    agree()


# ---------------------------------------------------------------------------------------------------
# run folders and checkpoints (rows 13-20)


def _train_argv(out: pathlib.Path, *extra: str) -> list[str]:
    """A 4-step run checkpointed every 2 steps (the arguments of the checkpoint-safety tests)."""
    from test_checkpoint_safety import _argv

    return _argv(out, *extra)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> pathlib.Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copied by each test that changes it)."""
    from lossparity.cli import main

    out = tmp_path_factory.mktemp("hostile") / "run"
    assert main(_train_argv(out)) == 0
    return out


@pytest.fixture
def run(trained_run, tmp_path) -> pathlib.Path:
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy, symlinks=True)
    return copy


def _finishes(call: Callable[[], int]) -> int:
    """``call()`` in a daemon thread, joined with the hang guard: a blocking read fails the test, it does not
    hang the suite."""
    result: list[object] = []

    def target() -> None:
        try:
            result.append(call())
        except BaseException as e:  # noqa: BLE001 - reported below
            result.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S * 3)  # a train resume imports nothing new but trains: a wider guard
    assert not thread.is_alive(), "the command did not finish (blocked on a read?)"
    if isinstance(result[0], BaseException):
        raise result[0]
    return int(result[0])  # type: ignore[call-overload]


def _cli(argv: list[str], capfd) -> tuple[int, list[str]]:
    from lossparity.cli import main

    capfd.readouterr()
    code = _finishes(lambda: main(argv))
    return code, capfd.readouterr().err.splitlines()


@pytest.mark.parametrize("target", ["device", "fifo"])
def test_row13_latest_pointer_that_is_no_file_is_a_note(run, capfd, target):
    """``checkpoints/latest`` -> ``/dev/zero`` or a FIFO: the pointer is only a hint (docs/checkpoints.md), so
    the resume goes on by the checkpoints' step numbers, with one note naming it; never a read of a device."""
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    if target == "device":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero")
        latest.symlink_to("/dev/zero")
    else:
        os.mkfifo(latest)
    code, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 0, err
    assert len(err) == 1 and f"{latest} cannot be read" in err[0], err
    assert ("a device" if target == "device" else "a FIFO") in err[0]


def test_row14_fifo_named_as_a_checkpoint_falls_back_or_fails_in_one_line(run, capfd):
    fifo = run / "checkpoints" / "step_00000006.pt"
    os.mkfifo(fifo)
    code, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 0, err
    notes = [line for line in err if f"checkpoint {fifo} cannot be read" in line]
    assert len(notes) == 1 and "a FIFO" in notes[0] and "falling back" in notes[0], err
    # the FIFO as the only checkpoint: exit 2, one line naming it
    for name in ("step_00000002.pt", "step_00000004.pt"):
        (run / "checkpoints" / name).unlink()
    (run / "checkpoints" / "latest").write_text(fifo.name)  # no note about a stale pointer either
    code, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 2 and len(err) == 1, err  # the error alone: no fallback note when nothing is left
    assert "no intact checkpoint" in err[0] and str(fifo.name) in err[0] and "a FIFO" in err[0], err


@pytest.mark.parametrize("content", ["[1, 2, 3]", "[" * 100_000 + "]" * 100_000, '{"seed": ' + "9" * 5000 + "}"])
def test_row15_config_json_that_is_no_configuration(run, capfd, content):
    config = run / "config.json"
    config.write_text(content)
    metrics_before = (run / "metrics.jsonl").read_bytes()
    code, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 2 and len(err) == 1 and str(config) in err[0], err
    assert "Traceback" not in err[0]
    assert (run / "metrics.jsonl").read_bytes() == metrics_before


@pytest.mark.parametrize(
    "line",
    ['{"step": Infinity}', '{"step": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"step": "abc"}', '{"step": 1e300}'],
)
def test_row16_metrics_line_that_is_no_step(run, capfd, line):
    metrics = run / "metrics.jsonl"
    text = metrics.read_text().splitlines(keepends=True)
    text.insert(1, line + "\n")
    metrics.write_text("".join(text))
    before = metrics.read_bytes()
    code, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 2 and len(err) == 1, err
    assert f"{metrics}:2: not a metrics line" in err[0], err
    assert metrics.read_bytes() == before  # nothing truncated


def _rewrite_checkpoint(path: pathlib.Path, change: Callable[[dict], None]) -> None:
    import torch

    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize("which", ["torch_size", "python_position", "python_word"])
def test_row17_bad_rng_state_falls_back_like_a_corrupt_checkpoint(run, capfd, which):
    import torch

    def change(state: dict) -> None:
        rng = state["rng"]
        if which == "torch_size":
            rng["torch"] = torch.zeros(10, dtype=torch.uint8)
        elif which == "python_position":
            rng["python"]["state"][-1] = 700
        else:
            rng["python"]["state"][0] = 2**40

    newest = run / "checkpoints" / "step_00000004.pt"
    _rewrite_checkpoint(newest, change)
    code, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 0, err
    notes = [line for line in err if f"checkpoint {newest} cannot be read" in line]
    assert len(notes) == 1 and "rng" in notes[0] and "falling back to the previous one" in notes[0], err
    # resumed from step 2 and recomputed step 4: a valid checkpoint of step 4 is there again
    assert torch.load(newest, weights_only=True)["rng"]["torch"].shape == torch.get_rng_state().shape


def _dcp_checkpoint(folder: pathlib.Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.arange(6.0)}}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"step": 1}, folder / "extra_rank0.pt")


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_row18_dcp_storage_path_outside_the_checkpoint_is_refused(tmp_path, where):
    from lossparity.checkpoint.format import CheckpointFormatError
    from lossparity.checkpoint.safe_dcp import SafeFileSystemReader
    from lossparity.training.rundir import RunDirError, load_newest_intact, sharded_checkpoint_intact

    ckpts = tmp_path / "run" / "checkpoints"
    step = ckpts / "step_00000001"
    _dcp_checkpoint(step)
    data = next(p for p in step.iterdir() if p.suffix == ".distcp")
    other = tmp_path / "other"
    other.mkdir()
    moved = other / data.name
    shutil.move(str(data), moved)  # the bytes the metadata needs now lie outside the checkpoint folder
    rel = str(moved) if where == "absolute" else os.path.relpath(moved, step)
    meta_path = step / ".metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)  # the test's own file
    for info in meta.storage_data.values():
        info.relative_path = rel
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(CheckpointFormatError, match=re.escape(f"{meta_path}: storage path {rel!r}")):
        sharded_checkpoint_intact(str(step))
    with pytest.raises(CheckpointFormatError, match="storage path"):
        SafeFileSystemReader(str(step)).read_metadata()
    with pytest.raises(RunDirError, match="no intact checkpoint.*storage path"):
        load_newest_intact(str(ckpts), sharded_checkpoint_intact, notify=lambda _: None)


def test_row19_checkpoints_that_is_a_file_keeps_the_metrics(run, capfd):
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder\n")
    before = (run / "metrics.jsonl").read_bytes()
    code, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 2 and len(err) == 1 and str(run / "checkpoints") in err[0], err
    assert (run / "metrics.jsonl").read_bytes() == before  # the earlier run's history is kept


def test_row20_convert_checkpoint_ends_in_one_line_on_every_bad_file(trained_run, tmp_path, capfd):
    import torch

    good = trained_run / "checkpoints" / "step_00000002.pt"
    d = tmp_path / "bad"
    d.mkdir()
    (d / "step_00000001.pt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # truncated
    (d / "step_00000002.pt").write_bytes(b"")  # empty
    (d / "step_00000003.pt").write_bytes(os.urandom(4096))  # garbage
    torch.save({"step": 4, "rng": {"python": 5, "numpy": "x", "torch": None}}, d / "step_00000004.pt")
    torch.save({"step": 5, "rng": "not a dict"}, d / "step_00000005.pt")
    os.mkfifo(d / "step_00000006.pt")
    for f in sorted(d.iterdir()):
        code, err = _cli(["convert-checkpoint", "--i-trust-these-files", str(f)], capfd)
        assert code == 2, (f, err)
        assert len(err) == 1 and str(f) in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize("option", ["--smooth", "--ref-step-base", "--ref-gbs"])
@pytest.mark.parametrize("value", ["9" * 30, "9" * 5000, "1e400", "x"])
def test_huge_or_bad_integer_options_end_in_one_line(tmp_path, option, value):
    """An integer option far beyond 2**53 (once a C-long ``OverflowError`` traceback for ``--smooth``), a
    5,000-digit one, a float or a word: exit 2, one line naming the option, no usage block."""
    log = tmp_path / "a.jsonl"
    log.write_text('{"step": 1, "lm_loss": 1.0}\n')
    out = _compare([str(log), str(log), option, value])
    assert out.returncode == 2
    _one_line_naming(out.stderr, option, "2**53")


@pytest.mark.parametrize("row", [1, 2, 3, 4, 5, 6, 7, 8, 11])
def test_log_rows_under_follow_end_as_without_it(row, tmp_path):
    """``compare --follow`` (the live reader that re-reads a growing log) on the same hostile files: the same
    exit code, and one line naming the file where the plain comparison gives one."""
    for case in _hostile.ROWS[row](tmp_path):
        out = _compare([*case.argv, "--follow", "--idle", "1", "--poll", "0.2"])
        assert out.returncode == case.code, (case.name, out.returncode, out.stderr[-2000:])
        if case.code == 2:
            _one_line_naming(out.stderr, case.file, case.needle)
        else:
            assert "Traceback" not in out.stderr, out.stderr[-2000:]
