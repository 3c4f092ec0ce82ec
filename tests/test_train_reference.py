"""`lossparity train --reference LOG`: an identical run against its own JSONL log and a Megatron-format copy of it
trains to the end; against a copy whose lm loss is raised 3% from step 3 it stops at step 3 with exit code 3,
after writing the checkpoint of step 3, and `--resume` continues to the end with the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lossparity.cli import main

STEPS = 4
ARGS = ["--steps", str(STEPS), "--global-batch", "2", "--seq-len", "16", "--warmup", "1", "--no-progress"]
ARGS += ["--no-tensorboard"]


def megatron_log(metrics: list[dict], path: Path, raise_from: int | None = None) -> Path:
    """The run's lm_loss, grad_norm and lr as Megatron-LM prints them (``%.6E``, grad norm ``%.3f``)."""
    rows = []
    for m in metrics:
        s = m["step"]
        loss = m["lm_loss"] * (1.03 if raise_from is not None and s >= raise_from else 1.0)
        rows.append(
            f" [2026-03-01 10:00:{s:02d}] iteration {s:8d}/{STEPS:8d} | consumed samples: {2 * s:12d} | "
            f"elapsed time per iteration (ms): 900.0 | learning rate: {m['lr']:.6E} | global batch size:     2 | "
            f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {m['grad_norm']:.3f} | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |\n"
        )
    path.write_text("".join(rows))
    return path


def lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """An earlier one-rank run: its metrics.jsonl is the reference."""
    out = tmp_path_factory.mktemp("golden") / "run"
    assert main(["train", *ARGS, "--out", str(out)]) == 0
    return out


def test_train_against_a_reference_log(golden, tmp_path, capsys):
    ref = lines(golden)
    mega = megatron_log(ref, tmp_path / "megatron.log")
    for i, reference in enumerate((golden / "metrics.jsonl", mega)):
        out = tmp_path / f"same{i}"
        assert main(["train", *ARGS, "--out", str(out), "--reference", str(reference)]) == 0
        assert not (out / "parity_report.md").exists() and len(lines(out)) == STEPS
    capsys.readouterr()

    raised = megatron_log(ref, tmp_path / "raised.log", raise_from=3)
    out = tmp_path / "stopped"
    assert main(["train", *ARGS, "--out", str(out), "--ckpt-interval", "100", "--reference", str(raised)]) == 3
    err = capsys.readouterr().err
    assert "training stopped after step 3" in err and "lm_loss" in err and "checkpoint of step 3" in err
    assert [x["step"] for x in lines(out)] == [1, 2, 3]
    assert list((out / "checkpoints").iterdir())  # the checkpoint of step 3 (none other: interval 100)
    report = json.loads((out / "parity_report.json").read_text())
    assert (report["step"], report["metric"], report["ref_name"]) == (3, "lm_loss", "lm loss")
    assert report["ref"] == float(f"{ref[2]['lm_loss'] * 1.03:.6E}") and report["cand"] == ref[2]["lm_loss"]

    assert main(["train", *ARGS, "--out", str(out), "--resume"]) == 0  # continues after the stop
    resumed = lines(out)
    assert [x["step"] for x in resumed] == list(range(1, STEPS + 1))
    assert [x["lm_loss"] for x in resumed] == [x["lm_loss"] for x in ref]  # the same run, bit for bit


@pytest.mark.slow
def test_two_data_parallel_ranks_stop_at_the_same_step(golden, tmp_path, capsys):
    # the reference is a one-rank run: the two-rank run equals it within the tolerance (layout invariance) until
    # the raised step; both ranks take the decision from the same collective log line and stop together
    raised = megatron_log(lines(golden), tmp_path / "raised.log", raise_from=2)
    out = tmp_path / "dp2"
    code = main(["train", *ARGS, "--dp", "2", "--out", str(out), "--ckpt-interval", "100", "--reference", str(raised)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "training stopped after step 2" in err and "lm_loss" in err
    assert [x["step"] for x in lines(out)] == [1, 2] and list((out / "checkpoints").iterdir())
    assert json.loads((out / "parity_report.json").read_text())["step"] == 2


def test_bad_reference_is_an_input_error(tmp_path, capsys):
    assert main(["train", *ARGS, "--reference", str(tmp_path / "none.log")]) == 2
    assert "reference" in capsys.readouterr().err
    (tmp_path / "ref.jsonl").write_text('{"step": 1, "lm_loss": 2.0}\n')
    assert main(["train", *ARGS, "--reference", str(tmp_path / "ref.jsonl"), "--tol", "lm_los=1e-3"]) == 2
    assert "tolerances: 'lm_los'" in capsys.readouterr().err
    assert main(["train", *ARGS, "--reference", str(tmp_path / "ref.jsonl"), "--on-violation", "halt"]) == 2
