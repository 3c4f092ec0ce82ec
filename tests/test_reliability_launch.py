"""Rank lifecycle (issue 18): every failed rank's error reaches the user; no rank outlives its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lossparity.distributed.launch import RankError, spawn

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


@pytest.mark.slow
def test_every_failed_rank_is_reported_earliest_first():
    # Before: spawn reported the lowest failed rank only (rank 0's consequence, never rank 1's cause).
    sys.path.insert(0, HERE)
    from _reliability_workers import two_different_errors

    with pytest.raises(RankError) as info:
        spawn(two_different_errors, 2, timeout_s=60)
    err = info.value
    assert [f.rank for f in err.failures] == [1, 0]
    assert err.input_error
    lines = err.summary_lines()
    assert lines[0] == "rank 1: ValueError: mask of rank 1, microbatch 0 has values outside {0, 1}"
    assert lines[1] == "rank 0: RuntimeError: rank 0 noticed that a peer left"
    assert "Traceback" in str(err) and "two_different_errors" in str(err)


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the ranks")
def test_ranks_exit_when_the_launcher_is_killed(tmp_path):
    # Before: `lossparity train --dp 2` killed with SIGKILL while SIGINT was ignored (a background job of
    # a shell script) left both ranks training and writing the run folder.
    out = tmp_path / "run"
    code = "import sys; from lossparity.cli import main; sys.exit(main())"
    argv = [
        sys.executable,
        "-c",
        code,
        "train",
        "--dp",
        "2",
        "--steps",
        "100000",
        "--global-batch",
        "4",
        "--seq-len",
        "16",
        "--no-progress",
        "--no-tensorboard",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launcher = subprocess.Popen(
        argv,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").stat().st_size:
            assert launcher.poll() is None, "the launcher exited early"
            assert time.monotonic() < deadline, "the ranks never started training"
            time.sleep(0.5)
        ranks += [p for p in _children(launcher.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.wait()
        bound = time.monotonic() + 30
        while any(_alive(p) for p in ranks) and time.monotonic() < bound:
            time.sleep(0.2)
        survivors = [p for p in ranks if _alive(p)]
        assert not survivors, f"ranks {survivors} still running 30 s after their launcher was killed"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in ranks:  # never leave a rank behind, whatever the outcome
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_kill_and_resume_trial_is_bit_exact(tmp_path):
    # One trial of benchmarks/kill_resume.py (the README reports the 8-trial run): SIGKILL during
    # training, then SIGKILL of the resume itself, then a resume to the end: logs, per-sample dump and
    # parameters equal the uninterrupted run bit for bit.
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.kill_resume import run_trials

    summary = run_trials(1, steps=4, seed=3, workdir=str(tmp_path), resume_kill_p=1.0, log=lambda _: None)
    assert summary["kills"] >= 2 and summary["kills_during_resume"] >= 1, summary
    assert summary["bit_exact"] == 1, summary["results"]


@pytest.mark.slow
def test_a_port_taken_before_the_rendezvous_is_retried_with_a_new_one(monkeypatch):
    # Before: a port picked by free_port() and taken by another process before rank 0's store bound it
    # (two test sessions on one machine) failed the whole run with EADDRINUSE.
    import socket

    import lossparity.distributed.launch as launch

    sys.path.insert(0, HERE)
    from _reliability_workers import rank_and_world

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(8)
    taken = busy.getsockname()[1]
    real = launch.free_port
    picks = []

    def first_taken() -> int:
        picks.append(taken if not picks else real())
        return picks[-1]

    monkeypatch.setattr(launch, "free_port", first_taken)
    try:
        assert spawn(rank_and_world, 2, timeout_s=30) == [(0, 2), (1, 2)]
    finally:
        busy.close()
    assert len(picks) == 2 and picks[0] == taken and picks[1] != taken
