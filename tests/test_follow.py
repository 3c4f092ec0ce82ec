"""`lossparity compare REF CAND --follow` against a Megatron log that another process writes line by line (with
pauses and a torn last line): the same verdict and first failing step as `compare` on the finished file, reported
before the writer goes on (the delay after the violating line's newline is printed, not asserted: no timed
assertions in tests)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from test_compare import cli, megatron_line

from lossparity.parity import compare_runs, read_log

SRC = Path(__file__).resolve().parents[1] / "src"
TOTAL = 10
POLL = 0.2


def loss(step: int) -> float:
    return 2.0 + 8.0 * math.exp(-step / 4.0)


def write_reference(path: Path) -> Path:
    path.write_text("".join(json.dumps({"step": s, "lm_loss": loss(s)}) + "\n" for s in range(1, TOTAL + 1)))
    return path


WRITER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[4])
from test_follow import TOTAL, loss
from test_compare import megatron_line
path, drift_from, pause, go = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[5]
with open(path, "a") as f:
    f.write("Megatron-LM training ...\n"); f.flush()
    for s in range(1, TOTAL + 1):
        line = megatron_line(s, TOTAL, loss(s) * (1.03 if drift_from and s >= drift_from else 1.0), 1.5) + "\n"
        if s == drift_from:  # the violating line arrives torn: its first half, a pause, then the rest
            f.write(line[:60]); f.flush(); time.sleep(4 * pause)
        f.write(line[60:] if s == drift_from else line); f.flush()
        print(s, time.monotonic(), flush=True)
        if s == drift_from:  # the next line comes only once the test has seen the follower's verdict
            t0 = time.monotonic()
            while not os.path.exists(go) and time.monotonic() - t0 < 120:
                time.sleep(0.01)
        time.sleep(pause)
"""


def follow(tmp_path: Path, drift_from: int, pause: float) -> tuple[int, list[tuple[float, str]], dict[int, float], str]:
    """Start the follower, then the writer; return the follower's exit code, its stdout lines with their arrival
    times, the writer's completion time of each line, and the follower's stderr."""
    ref, cand = write_reference(tmp_path / "ref.jsonl"), tmp_path / "cand.log"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    args = [
        "compare",
        str(ref),
        str(cand),
        "--follow",
        "--poll",
        str(POLL),
        "--idle",
        "20",
        "--report",
        str(tmp_path / "rep"),
    ]
    follower = subprocess.Popen(
        [sys.executable, "-c", "import sys; from lossparity.cli import main; sys.exit(main(sys.argv[1:]))", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[tuple[float, str]] = []

    go = tmp_path / "go"

    def collect() -> None:
        assert follower.stdout is not None
        for line in follower.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if "VIOLATION" in line:
                go.touch()  # lets the writer go on: the verdict came before any later line existed

    reader = threading.Thread(target=collect)
    reader.start()
    tests_dir = str(Path(__file__).parent)
    writer = subprocess.run(
        [sys.executable, "-c", WRITER, str(cand), str(drift_from), str(pause), tests_dir, str(go)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert writer.returncode == 0, writer.stderr
    code = follower.wait(timeout=60)
    reader.join(timeout=10)
    assert follower.stderr is not None
    written = {int(s): float(t) for s, t in (row.split() for row in writer.stdout.split("\n") if row)}
    return code, lines, written, follower.stderr.read()


def test_follow_a_drifting_megatron_log_stops_at_the_first_violation(tmp_path):
    code, lines, written, err = follow(tmp_path, drift_from=6, pause=0.15)
    assert code == 1, err
    texts = [t for _, t in lines]
    assert [t.split(":")[0] for t in texts[:5]] == [f"step {s}" for s in range(1, 6)]  # one line per step, in order
    hit = next(i for i, t in enumerate(texts) if "VIOLATION" in t)
    assert texts[hit].startswith("step 6: VIOLATION") and "lm_loss" in texts[hit]
    assert not any(t.startswith("step 7") for t in texts)  # it stopped there, before line 7 was written
    latency = lines[hit][0] - written[6]
    assert latency >= 0  # the torn line was not compared before its newline
    print(f"measured: follow reported the violation of step 6 {latency:.3f} s after its newline (poll {POLL} s)")
    # the same verdict and first failing step as compare on the finished file
    offline = compare_runs(read_log(tmp_path / "ref.jsonl"), read_log(tmp_path / "cand.log"))
    assert not offline.passed and offline.metrics["lm_loss"].first_fail_step == 6
    assert cli([str(tmp_path / "ref.jsonl"), str(tmp_path / "cand.log"), "--report", str(tmp_path / "off")]) == 1
    report = json.loads((tmp_path / "rep" / "parity_report.json").read_text())
    offline_report = json.loads((tmp_path / "off" / "parity_report.json").read_text())
    assert {**offline_report, "on_violation": "stop"} == report  # the same report, live and offline
    assert report["step"] == 6 and report["cand_name"] == "lm loss"
    assert report["cand"] == float(f"{loss(6) * 1.03:.6E}") and report["ref"] == loss(6)


def test_follow_a_clean_log_to_its_end(tmp_path):
    code, lines, _, err = follow(tmp_path, drift_from=0, pause=0.05)
    assert code == 0, err
    texts = [t for _, t in lines]
    assert sum(t.startswith("step ") for t in texts) == TOTAL and texts[-1].startswith("PARITY")
    assert compare_runs(read_log(tmp_path / "ref.jsonl"), read_log(tmp_path / "cand.log")).passed


def test_follow_gives_up_on_a_log_that_stops_growing(tmp_path, capsys):
    ref, cand = write_reference(tmp_path / "ref.jsonl"), tmp_path / "cand.log"
    cand.write_text("".join(megatron_line(s, TOTAL, loss(s), 1.5) + "\n" for s in (1, 2)))
    t0 = time.monotonic()
    assert cli([str(ref), str(cand), "--follow", "--poll", "0.05", "--idle", "0.4"]) == 2
    assert time.monotonic() - t0 >= 0.4
    out, err = capsys.readouterr()
    assert out.startswith("step 1:") and "gave up after 0.4 s without growth" in err and "step 2" in err
    assert cli([str(ref), str(cand), "--follow", "--poll", "0.05", "--idle", "1", "--until", "2"]) == 0
    assert cli([str(ref), str(cand), "--follow", "--window", "1:2"]) == 2
    assert cli([str(ref), str(cand), "--until", "2"]) == 2
    assert "--until needs --follow" in capsys.readouterr().err
