"""``lossparity audit`` on a real DeepSpeed 0.19.8 engine (CPU, gloo): a loop that hands each microbatch's
token mean to ``engine.backward`` with DeepSpeed's defaults computes the mean of the microbatch means
(DeepSpeed divides by GA, its data-parallel reduction averages) at every ZeRO stage and with offload."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from lossparity.audit import DeepSpeedStep, audit, render  # noqa: E402

STACKS = str(Path(__file__).resolve().parent / "_stacks.py")
pytestmark = [pytest.mark.frameworks, pytest.mark.multiprocess]


def test_deepspeed_default_loop_is_per_microbatch_at_every_zero_stage(tmp_path, monkeypatch):
    # the loss also has each engine record its own ZeRO stage and offload (an earlier version dropped the
    # configuration's stage on its way to the worker processes: every "ZeRO-k" row ran the stack's own stage)
    record = tmp_path / "engines.txt"
    monkeypatch.setenv("LOSSPARITY_TEST_RECORD", str(record))
    stack = DeepSpeedStep(model=f"{STACKS}:tiny_llama", loss=f"{STACKS}:deepspeed_recording_loss")
    report = audit(stack, classes=["ga", "zero"])
    seen = {tuple(line.split()[1:]) for line in record.read_text().splitlines()}
    # the stack's own ZeRO-0 (reference and ga), ZeRO-1/2/3 and ZeRO-2 with offload
    assert seen == {("0", "False"), ("1", "False"), ("2", "False"), ("3", "False"), ("2", "True")}, seen
    names = {r.config: r.found.name for r in report.rows}
    assert names == {
        "D1 K1 b8": "per_token",
        "K2 b4": "per_microbatch",
        "K4 b2": "per_microbatch",
        "D2 K2 b2 ZeRO-1": "per_microbatch",
        "D2 K2 b2 ZeRO-2": "per_microbatch",
        "D2 K2 b2 ZeRO-3": "per_microbatch",
        "D2 K2 b2 ZeRO-2+offload": "per_microbatch",
    }, render(report)
    # the four ZeRO configurations apply the same gradient (the stage and offload change nothing on 0.19.8)
    zero = [r.vs_reference for r in report.rows if r.klass == "zero"]
    assert max(zero) - min(zero) < 1e-5 * max(zero)
    assert report.first_broken == "ga"


def test_the_zero_class_needs_a_deepspeed_stack():
    from lossparity.audit import AuditError, HandLoop

    with pytest.raises(AuditError, match="needs a DeepSpeed stack"):
        audit(HandLoop(model=f"{STACKS}:tiny_llama", step=f"{STACKS}:mean_over_ga"), classes=["zero"])
