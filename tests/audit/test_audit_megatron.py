"""``lossparity audit`` on megatron-core's real schedule (``forward_backward_no_pipelining`` and
``finalize_model_grads``) with a forward step and loss function written as Megatron-LM's pretrain_gpt.py
writes them: ``calculate_per_token_loss=True`` is the token mean at every layout; ``False`` is the mean of
the microbatch means (the schedule divides each microbatch's sum by its own tokens and by GA), which
Megatron-LM logs as the token mean (its train_step sums the [loss, tokens] reports before dividing)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from lossparity.audit import audit, render  # noqa: E402
from lossparity.audit.megatron import MegatronStep  # noqa: E402

STACKS = str(Path(__file__).resolve().parent / "_megatron_stacks.py")
pytestmark = [pytest.mark.frameworks, pytest.mark.multiprocess]


def _step(model: str) -> MegatronStep:
    return MegatronStep(model=f"{STACKS}:{model}", forward_step=f"{STACKS}:forward_step", vocab_size=13)


def test_calculate_per_token_loss_true_is_per_token_at_every_layout():
    report = audit(_step("model_per_token"), classes=["ga", "dp"], expect="per_token")
    assert {r.found.name for r in report.rows} == {"per_token"}, render(report)
    assert report.tol == 1e-10  # a float64 model
    assert report.exit_code == 0 and all(r.log_matches for r in report.rows)


def test_calculate_per_token_loss_false_is_per_microbatch_and_logs_the_token_mean():
    report = audit(_step("model_per_microbatch"), classes=["ga", "dp"])
    names = {r.config: r.found.name for r in report.rows}
    assert names == {
        "D1 K1 b8": "per_token",
        "K2 b4": "per_microbatch",
        "K4 b2": "per_microbatch",
        "D2 K1 b4": "per_microbatch",
        "D2 K2 b2": "per_microbatch",
    }, render(report)
    assert report.first_broken == "ga"
    k2 = next(r for r in report.rows if r.config == "K2 b4")
    assert k2.log_matches is False  # logged: the token mean of the reference; optimized: the microbatch means
    assert k2.logged == pytest.approx(report.rows[0].logged, rel=1e-12)
