"""``lossparity train --resume --steps N`` extends a finished run with its saved learning-rate schedule
(``training/extend.py``); a shorter run or another schedule is refused with one line (exit 2)."""

from __future__ import annotations

import json
import math

import pytest

from lossparity.cli import main

# tiny runs: 1 warm-up step, float64 so that the extended and the fresh run agree bit for bit
BASE = ["train", "--warmup", "1", "--global-batch", "4", "--seq-len", "16", "--dtype", "float64", "--no-progress"]
BASE += ["--no-tensorboard", "--ckpt-interval", "1", "--lr", "0.004", "--min-lr", "0.001"]


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _documented_lr(step: int, lr: float, min_lr: float, warmup: int, end: int) -> float:
    """docs/reference-trainer.md: step s (1-based) warms up linearly over the first `warmup` steps, then
    follows lr -> min_lr by a half cosine whose argument reaches pi at step end + 1, min_lr from there on."""
    if step <= warmup:
        return lr * step / warmup
    frac = min((step - 1 - warmup) / (end - warmup), 1.0)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * frac)) / 2


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "a"
    assert main([*BASE, "--steps", "2", "--out", str(out)]) == 0
    return out


def test_extending_a_finished_run_keeps_its_schedule_and_says_so(two_step_run, tmp_path, capsys):
    import shutil

    out = tmp_path / "a"
    shutil.copytree(two_step_run, out)
    capsys.readouterr()
    assert main([*BASE, "--steps", "4", "--resume", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "extending the run" in line]
    assert len(notes) == 1, err
    assert notes[0].startswith("lossparity train: note: extending the run in ") and "from 2 to 4 steps" in notes[0]
    assert "steps 3-4 run at min_lr 0.001" in notes[0]
    lines = _metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    want = [_documented_lr(s, 0.004, 0.001, 1, end=2) for s in (1, 2, 3, 4)]
    assert want == pytest.approx([0.004, 0.004, 0.001, 0.001], abs=0)  # the hand-worked values
    assert [m["lr"] for m in lines] == pytest.approx(want, rel=1e-15, abs=0)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["steps"], saved["decay_steps"]) == (4, 2)
    # The extended run is the fresh run --steps 4 --decay-steps 2 (the record in config.json), bit for bit.
    fresh = tmp_path / "fresh"
    assert main([*BASE, "--steps", "4", "--decay-steps", "2", "--out", str(fresh)]) == 0
    for a, b in zip(lines, _metrics(fresh)):
        for key in ("lm_loss", "objective", "grad_norm", "lr"):
            assert a[key] == b[key], (a["step"], key)
    # resuming the extended run again with its own --steps is accepted (nothing left to run)
    assert main([*BASE, "--steps", "4", "--resume", "--out", str(out)]) == 0


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--steps", "1"], "--steps 1 is smaller than the saved run's 2 steps: a run is extended, never shortened"),
        (
            ["--steps", "4", "--lr", "0.002"],
            "learning-rate schedule differs from the saved run's (lr: 0.004 -> 0.002)",
        ),
        (["--steps", "4", "--decay-steps", "4"], "(decay_steps: 2 -> 4)"),
        (["--steps", "2", "--warmup", "2"], "(warmup: 1 -> 2)"),
    ],
)
def test_a_shorter_run_or_another_schedule_is_refused(two_step_run, flags, reason, capsys):
    before = (two_step_run / "config.json").read_text()
    capsys.readouterr()
    assert main([*BASE, "--resume", "--out", str(two_step_run), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("lossparity train: error: --resume into "), err
    assert reason in err
    assert (two_step_run / "config.json").read_text() == before  # refused before anything changed
