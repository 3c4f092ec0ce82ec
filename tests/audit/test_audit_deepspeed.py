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


def test_deepspeed_default_loop_is_per_microbatch_at_every_zero_stage():
    stack = DeepSpeedStep(model=f"{STACKS}:tiny_llama", loss=f"{STACKS}:deepspeed_hf_loss")
    report = audit(stack, classes=["ga", "zero"])
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
