"""``lossparity audit`` on torchtitan's real ``Trainer.train_step`` (0.3.0): its own cross-entropy over the
global valid-token count is per_token at every GA and with 2 ranks under FSDP2 (gradient division off, as
torchtitan sets it); a loss that ignores ``global_valid_tokens`` (each microbatch's mean) is per_microbatch
times the number of microbatches, found and named; lossparity's mixin with ``LossParityLoss("per_sample")`` is
per_sample everywhere, activation checkpointing included."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan.trainer")

from lossparity.audit import TitanStep, audit, render  # noqa: E402

STACKS = str(Path(__file__).resolve().parent / "_titan_stacks.py")
pytestmark = [pytest.mark.frameworks, pytest.mark.multiprocess]


def test_torchtitan_cross_entropy_is_per_token_at_every_layout():
    report = audit(TitanStep(model=f"{STACKS}:model"), classes=["ga", "dp"], expect="per_token")
    assert {r.found.mode for r in report.rows} == {"per_token"}, render(report)
    assert all(abs(r.found.factor - 1) < 1e-6 for r in report.rows), render(report)
    assert report.tol == 1e-5  # torchtitan's cross-entropy computes in float32 whatever the model's dtype
    assert report.exit_code == 0 and all(r.log_matches for r in report.rows), render(report)


def test_a_loss_without_the_global_count_is_found_per_microbatch():
    report = audit(TitanStep(model=f"{STACKS}:model", loss=f"{STACKS}:mean_loss"), classes=["ga", "dp"])
    found = {r.config: (r.found.mode, round(r.found.factor, 6)) for r in report.rows}
    # K microbatches of means summed (no /K), FSDP summing D ranks: per_microbatch × (D·K)
    assert found == {
        "D1 K1 b8": ("per_token", 1.0),
        "K2 b4": ("per_microbatch", 2.0),
        "K4 b2": ("per_microbatch", 4.0),
        "D2 K1 b4": ("per_microbatch", 2.0),
        "D2 K2 b2": ("per_microbatch", 4.0),
    }, render(report)
    assert report.first_broken == "ga" and report.exit_code == 1


def test_lossparity_mixin_per_sample_with_recompute():
    stack = TitanStep(model=f"{STACKS}:model", loss=f"{STACKS}:PER_SAMPLE", trainer=f"{STACKS}:LossParityTrainer")
    report = audit(stack, classes=["ga", "dp", "recompute"], expect="per_sample")
    assert report.tol == 1e-10  # the loss keeps the model's float64
    assert {r.found.name for r in report.rows} == {"per_sample"}, render(report)
    assert report.exit_code == 0, render(report)
    rc = next(r for r in report.rows if r.klass == "recompute")
    assert rc.invariant and not rc.note, render(report)


def test_cli_torchtitan_options(capsys):
    from lossparity.cli import main

    # in-process: the CLI's own argument checks and error line (exit 2, one line, no traceback)
    code = main(["audit", "--step", f"{STACKS}:model", "--model", f"{STACKS}:model", "--loss", f"{STACKS}:mean_loss"])
    err = capsys.readouterr().err
    assert code == 2 and "--loss and --trainer-class go with --torchtitan" in err, err
    code = main(
        ["audit", "--torchtitan", f"{STACKS}:model", "--trainer-class", f"{STACKS}:TinyDecoder", "--classes", "ga"]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not a subclass of torchtitan.trainer.Trainer" in err, err
