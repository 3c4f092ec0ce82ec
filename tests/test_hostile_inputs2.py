"""Issue 50: hostile inputs, round 2 (``gap``, sample dumps on resume, saved schedule values, unbounded series,
a checkpoint whose data does not load).

One regression test per reproduction of the issue (builders in ``tests/_hostile2.py``, shared with
``scripts/measure_hostile_inputs.py --round 2``, which measures time and peak memory at the issue's sizes).
The commands run in this process through ``lossparity.cli.main`` inside a thread joined with a hang guard (a
FIFO that blocked a read fails the test instead of hanging the suite); the large cases run scaled down here.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import sys
import threading
from collections.abc import Callable

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _hostile2  # noqa: E402

HANG_GUARD_S = 60


def _finishes(call: Callable[[], int]) -> int:
    """``call()`` in a daemon thread joined with the hang guard (a blocked read fails, never hangs)."""
    result: list[object] = []

    def target() -> None:
        try:
            result.append(call())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the command did not finish (blocked on a read?)"
    if isinstance(result[0], BaseException):
        raise result[0]
    return int(result[0])  # type: ignore[call-overload]


def _cli(argv: list[str], capfd) -> tuple[int, str, list[str]]:
    from lossparity.cli import main

    capfd.readouterr()
    code = _finishes(lambda: main(argv))
    captured = capfd.readouterr()
    return code, captured.out, captured.err.splitlines()


def _check(case, capfd) -> None:
    code, out, err = _cli(case.argv, capfd)
    assert code == case.code, (case.name, code, err[-5:])
    assert not any("Traceback" in line for line in err), err
    if case.code == 2:
        assert len(err) == 1 and case.needle in err[0], (case.name, err)
        assert case.file is None or case.file in err[0], (case.name, err)
        assert "allow_pickle" not in err[0] and "weights_only" not in err[0]
    else:
        assert case.needle in out, (case.name, out[-2000:])


# ---------------------------------------------------------------------------------------------- gap
def test_gap_on_fifos_devices_and_bad_contents_ends_in_one_line(tmp_path, capfd):
    """FIFOs as a rank file or ``samples_meta.json`` (once a hang), ``/dev/zero`` (a MemoryError), 100k-deep
    JSON, ``1e400``/list values of the description's numbers, complex/inf/object ``.npz`` scalars, an object
    column, an ``.npy`` named ``.npz``, an empty ``.npz``, a member declaring shape 2**40 (once tracebacks or
    lines without the file): exit 2, one line naming the file and the key or what it is."""
    cases = _hostile2.gap_files(tmp_path)
    assert len(cases) >= 20
    for case in cases:
        _check(case, capfd)


def test_gap_missing_steps_are_ranges_and_sizes_are_bounded(tmp_path, capfd):
    """Steps 1 and 1e12, a ``metrics.jsonl`` step of 2**53-1 (once a MemoryError building the list of missing
    steps): exit 1 with the missing range; a sparse rank file (zero records) and a deflate bomb: exit 2 naming
    the file; a long dump is read; ``--bootstrap 1000000000`` is refused naming the option (sizes scaled)."""
    for case in _hostile2.gap_sizes(tmp_path, size=1 / 64):
        _check(case, capfd)


def test_gap_json_reports_missing_ranges_and_their_count(tmp_path, capfd):
    d = _hostile2.dump(tmp_path / "d", steps=[1, 2, 5, 10**12])
    code, out, _ = _cli(["gap", str(d), "--bootstrap", "0", "--json"], capfd)
    assert code == 1
    report = json.loads(out)
    assert report["missing_steps"] == [[3, 4], [6, 10**12 - 1]]
    assert report["missing_step_count"] == 2 + (10**12 - 1 - 6 + 1)


def test_missing_steps_match_the_set_difference():
    from lossparity.parity.gap import missing_count, missing_steps

    present = [3, 4, 9, 10, 11, 15, 2, 30]
    ranges = missing_steps(present, 1, 20)
    expanded = [s for lo, hi in ranges for s in range(lo, hi + 1)]
    assert expanded == sorted(set(range(1, 21)) - set(present))
    assert missing_count(ranges) == len(expanded)
    assert missing_steps([5], 5, 5) == [] and missing_steps([], 1, 3) == [(1, 3)]


# ---------------------------------------------------------------------------------------------- compare
def test_compare_series_cap_restarts_mtp_digits_and_step_bases(tmp_path, capfd):
    """New keys on every line (JSONL, Megatron), a table of 99,999 columns: refused at the cap on metrics,
    naming the file and line; an MTP key with a 5,000-digit depth is read as a plain metric; step bases
    2**54 apart are refused naming both logs (once an IndexError). Sizes scaled."""
    cases = _hostile2.compare_files(tmp_path, size=1 / 16)
    for case in cases:
        if case.name in ("compare:jsonl_new_keys", "compare:megatron_new_keys"):
            assert "10000" in case.needle
        _check(case, capfd)
    # the cap itself: 10,000 metrics are read, the 10,001st is refused naming its line
    from lossparity.parity import LogParseError, read_log

    lines = "".join(json.dumps({"step": i + 1, f"m{i}": 1.0}) + "\n" for i in range(10_001))
    path = tmp_path / "cap.jsonl"
    path.write_text(lines)
    with pytest.raises(LogParseError, match=r"cap\.jsonl:10001: expected at most 10000 metrics"):
        read_log(path)
    path.write_text("".join(lines.splitlines(keepends=True)[:10_000]))
    assert len(read_log(path).metrics) == 10_000


def _replay(lines: list[tuple[int, dict[str, float]]]) -> dict[str, dict[int, float]]:
    """The restart rule on a flat list of points, independently: a step below the last one drops every point
    at or after it, whatever its metric; a later point of the same metric and step replaces an earlier one."""
    points: list[tuple[str, int, float]] = []
    last = None
    for step, values in lines:
        if last is not None and step < last:
            points = [p for p in points if p[1] < step]
        last = step
        points += [(k, step, v) for k, v in values.items()]
    out: dict[str, dict[int, float]] = {}
    for k, step, v in points:
        out.setdefault(k, {})[step] = v
    return out


@pytest.mark.parametrize("seed", range(6))
def test_restarts_drop_what_a_plain_replay_drops(tmp_path, seed):
    """Random logs with restarts (steps going back by random amounts, keys appearing and reappearing): the
    recorder, which visits only the series a restart reaches, keeps exactly what the plain replay keeps."""
    import random

    from lossparity.parity import read_log

    rng = random.Random(seed)
    lines, step = [], 1
    for _ in range(400):
        step = max(1, step + rng.choice([1, 1, 1, 2, 5, -1, -3, -20]))
        keys = rng.sample([f"m{i}" for i in range(30)], rng.randint(1, 4))
        lines.append((step, {"lm loss": rng.random(), **{k: float(rng.randint(0, 9)) for k in keys}}))
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"step": s, **v}) + "\n" for s, v in lines))
    run = read_log(path)
    expected = _replay(lines)
    expected["lm_loss"] = expected.pop("lm loss")
    assert {k: dict(v.items()) for k, v in run.metrics.items()} == expected


def test_restarts_with_new_keys_are_read_below_the_cap(tmp_path):
    """The issue's log shape (the step goes back every other line, a new key on every line) below the cap:
    each restart drops every value, so only the last two lines' keys keep a value, as the replay says."""
    from lossparity.parity import read_log

    text = _hostile2.restarts_with_new_keys(1_001)
    path = tmp_path / "back.jsonl"
    path.write_text(text)
    lines = [json.loads(x) for x in text.splitlines()]
    expected = _replay([(o.pop("step"), o) for o in lines])
    expected["lm_loss"] = expected.pop("lm loss")
    run = read_log(path)
    assert {k: dict(v.items()) for k, v in run.metrics.items()} == expected
    assert run.restarts == 500


# ---------------------------------------------------------------------------------------------- train --resume
def _train_argv(out: pathlib.Path, *extra: str) -> list[str]:
    from test_checkpoint_safety import _argv

    return _argv(out, *extra)


@pytest.fixture(scope="module")
def dumped_run(tmp_path_factory) -> pathlib.Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 and a sample dump (copied by each test)."""
    from lossparity.cli import main

    out = tmp_path_factory.mktemp("hostile2") / "run"
    assert main(_train_argv(out, "--dump-samples")) == 0
    return out


@pytest.fixture
def run(dumped_run, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(dumped_run, tmp_path / "run", symlinks=True))


@pytest.mark.parametrize("target", ["fifo", "dev_zero", "sparse"])
def test_resume_with_a_dump_file_that_is_no_dump_ends_in_one_line(run, capfd, target):
    """``samples_rank0.bin`` as a FIFO (once a hang), ``/dev/zero`` (a MemoryError) or a 1 GiB sparse file
    (once 13 s and 3.4 GB; its zeros are no records of the run: refused at its first chunk): exit 2, one line
    naming it, and the run folder unchanged."""
    rank0 = run / "samples" / "samples_rank0.bin"
    rank0.unlink()
    if target == "fifo":
        os.mkfifo(rank0)
    elif target == "dev_zero":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero")
        rank0.symlink_to("/dev/zero")
    else:
        with open(rank0, "wb") as f:
            f.truncate(2**30)
    metrics_before = (run / "metrics.jsonl").read_bytes()
    code, _, err = _cli(_train_argv(run, "--dump-samples", "--resume"), capfd)
    assert code == 2 and len(err) == 1 and str(rank0) in err[0], err
    want = {"fifo": "a FIFO", "dev_zero": "a device", "sparse": "duplicate sample (step 0, row 0)"}[target]
    assert want in err[0] and "Traceback" not in err[0]
    assert (run / "metrics.jsonl").read_bytes() == metrics_before


@pytest.mark.parametrize("name,text", _hostile2.config_values(pathlib.Path(".")))
def test_saved_decay_steps_is_checked_like_a_command_line_value(run, capfd, name, text):
    """``"decay_steps"`` of the saved ``config.json`` as ``1e400`` (once an OverflowError traceback), ``"x"``,
    ``[1]``, ``NaN`` (exit 2 without the file) or ``-5`` (accepted, then a note of steps "-4-3"): exit 2,
    one line naming the file and the field."""
    config = run / "config.json"
    _hostile2.set_saved(config, "decay_steps", text)
    code, _, err = _cli(_train_argv(run, "--resume", "--steps", "6"), capfd)
    assert code == 2 and len(err) == 1, err
    assert str(config) in err[0] and "decay_steps" in err[0] and "Traceback" not in err[0], err


def test_single_file_checkpoint_with_damaged_bytes_falls_back(run, capfd):
    """The newest ``step_<n>.pt`` overwritten with as many ``0x5a`` bytes: skipped with one note naming it
    (never torch's advice to load with ``weights_only=False``), the run resumes from the previous one and
    ends with the numbers of the uninterrupted run."""
    from test_checkpoint_safety import _lines

    reference = _lines(run / "metrics.jsonl")
    newest = run / "checkpoints" / "step_00000004.pt"
    newest.write_bytes(b"\x5a" * newest.stat().st_size)
    code, _, err = _cli(_train_argv(run, "--resume"), capfd)
    assert code == 0, err
    notes = [line for line in err if f"checkpoint {newest} cannot be read" in line]
    assert len(notes) == 1 and "damaged, not a checkpoint" in notes[0] and "falling back" in notes[0], err
    assert not any("weights_only" in line or "Traceback" in line for line in err), err
    assert _lines(run / "metrics.jsonl") == reference


@pytest.mark.slow
def test_sharded_checkpoint_with_a_damaged_shard_falls_back_on_both_ranks(tmp_path, monkeypatch, capfd):
    """The issue's reproduction with 2 ranks (gloo on 127.0.0.1 through the launcher): ``__0_0.distcp`` of the
    newest checkpoint overwritten with as many ``0x5a`` bytes (its size still fits the metadata). The resume
    skips it on both ranks together with one note naming it (once 172 lines of tracebacks), never torch's
    ``weights_only`` advice, resumes from step 1 and ends with the numbers of the uninterrupted run."""
    from test_checkpoint_safety import _lines

    from lossparity.cli import main

    out = tmp_path / "S"
    argv = ["train", "--steps", "2", "--ckpt-interval", "1", "--global-batch", "4", "--seq-len", "32"]
    argv += ["--warmup", "1", "--no-tensorboard", "--no-progress", "--dp", "2", "--dtype", "float64", "--out", str(out)]
    assert main(argv) == 0
    reference = _lines(out / "metrics.jsonl")
    shard = out / "checkpoints" / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(b"\x5a" * shard.stat().st_size)
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    code, _, err = _cli([*argv, "--resume"], capfd)
    assert code == 0, err[-20:]
    assert not any("Traceback" in line or "weights_only" in line for line in err), err[-20:]
    notes = [line for line in err if line.startswith("lossparity train: note: ")]
    skipped = [n for n in notes if f"checkpoint {shard.parent} cannot be read" in n]
    assert len(skipped) == 1 and "its data does not load" in skipped[0] and "falling back" in skipped[0], err
    assert re.search(r"rank \d: ", skipped[0]), skipped[0]
    assert _lines(out / "metrics.jsonl") == reference
