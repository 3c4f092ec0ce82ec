"""What the objective is made of (issue 28): the trainer logs J's parts and its console line shows them."""

from __future__ import annotations

import pytest
import torch
from _precision import float32_sums_rtol

from lossparity.losses import modes
from lossparity.training.trainer import TrainConfig, Trainer, objective_parts


def _fit(**kw):
    cfg = TrainConfig(steps=1, global_batch=4, seq_len=32, packed=True, progress=False, tensorboard=False, **kw)
    trainer = Trainer(cfg.resolved())
    return trainer, trainer.fit()


def test_logged_parts_add_up_to_the_objective():
    trainer, history = _fit(mode="per_sample")  # MTP λ=0.3, load balancing and router z-loss on by default
    cfg = trainer.cfg
    # the routers of the default model: one MoE layer of the main stack (2 layers, the first dense) and the MTP
    # block's; the per-layer expert-load logs name them
    moe_layers = sum(k.startswith("max_vio/layer_") for k in history[0])
    assert moe_layers == 2
    for line in history:
        # the accountant's own sum, in its order: exactly the logged objective
        total = line["objective_lm"] + line["mtp_weight"] * line["objective_mtp"] + line["objective_aux"]
        assert total == line["objective"]
        # the added part, rebuilt from the logged MoE terms (each logged divided by its coefficient and
        # averaged over the MoE layers, semantics §5): coefficient · layers · logged value
        aux = cfg.aux_coeff * moe_layers * line["global_load_balancing_loss"]
        z = cfg.z_coeff * moe_layers * line["z_loss"]
        assert line["objective_aux"] == pytest.approx(aux + z, rel=1e-6)
        # per_sample: the LM part of J is the mean of the samples' mean losses, not the token mean lm_loss
        assert line["objective_lm"] != line["lm_loss"]
    text = objective_parts(history[-1])
    last = history[-1]
    assert text == (
        f" = lm {last['objective_lm']:.4f} + 0.3·mtp {last['objective_mtp']:.4f} + aux+z {last['objective_aux']:.4f}"
    )


def _sequential_reversed_sum(per_token_loss, mask):
    """The masked total in another float32 order than PyTorch's kernels (one addition at a time, last token
    first): what another CPU's vector width or thread split may do. Differentiable, as the original."""
    flat = torch.where(mask.reshape(-1) > 0, per_token_loss.reshape(-1), torch.zeros_like(per_token_loss).reshape(-1))
    total = flat.new_zeros(())
    for value in flat.flip(0):
        total = total + value
    return total


@pytest.mark.parametrize("order", ["torch", "sequential_reversed"])
def test_plain_lm_objective_logs_no_parts(monkeypatch, order):
    # With J = lm_loss (per_token, no MTP, no added terms) the two logged values are two float32 sums of the
    # same per-token losses in two orders (the masked total of the objective's numerator, the per-sample sums
    # of lm_loss), each accumulated over microbatches in float64 (semantics §2, "Precision"): they agree to
    # the float32 bound of the step's token count, whatever order the CPU's kernels add in. The second case
    # forces another order on the objective's side, as a CPU with other float32 kernels would.
    if order == "sequential_reversed":
        monkeypatch.setattr(modes, "masked_token_sum", _sequential_reversed_sum)
    _, history = _fit(mode="per_token", model_overrides={"mtp_depths": 0}, aux_scope="none", z_coeff=0.0)
    for line in history:
        assert line["objective"] == pytest.approx(line["lm_loss"], rel=float32_sums_rtol(line["tokens"]))
    assert not any(k.startswith("objective_") for line in history for k in line)
    assert objective_parts(history[-1]) == ""
