"""Tiny float64 MoE models (Mixtral, Qwen3-MoE) and one-global-batch Trainer runs for the ``aux_scope`` tests.

Also the ``torchrun`` entry point: ``python _hf_aux_common.py OUT KINDS B GA SCOPE`` trains 2 steps per model
kind on every rank; each rank saves its last recorded gradient and ``log_history``. Nothing is downloaded.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from _hf_common import TINY, RowDataset, grad_recorder, padded_rows, training_args  # noqa: E402

COEF = 0.5  # large, so that a wrong aux weighting shows far above the float32 noise of HF's internals


def moe_model(kind: str):
    """2 layers, 4 experts top-2, float64, eager experts (grouped_mm refuses float64 on CPU), seeded."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        TINY,
        num_hidden_layers=2,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=COEF,
        experts_implementation="eager",
    )
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4))
    else:
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=32)
        model = transformers.Qwen3MoeForCausalLM(config)
    return model.double()


def rows8() -> list[dict[str, torch.Tensor]]:
    """Exactly one global batch: 8 right-padded rows of unequal lengths (one without a loss token)."""
    return padded_rows(8)


def run(
    out_dir: str,
    kind: str,
    b: int,
    ga: int,
    steps: int,
    scope: str | None,
    mode: str = "per_token",
    fused_loss: bool = True,
    dtype: torch.dtype = torch.float64,
):
    """Train ``steps`` steps at learning rate 0 on :func:`rows8` (``scope=None``: plain
    ``transformers.Trainer``). Returns (gradients recorded before each optimizer step, log_history)."""
    import transformers

    from lossparity.integrations.hf import LossParityTrainer

    rec = grad_recorder()
    kw = dict(
        model=moe_model(kind).to(dtype),
        args=training_args(out_dir, b, ga, steps, learning_rate=0.0),
        train_dataset=RowDataset(rows8()),
        callbacks=[rec],
    )
    if scope is None:
        trainer = transformers.Trainer(**kw)
    else:
        trainer = LossParityTrainer(**kw, loss_mode=mode, aux_scope=scope, fused_loss=fused_loss)
    trainer.train()
    return rec.grads, trainer.state.log_history


if __name__ == "__main__":  # torchrun entry point: OUT KINDS(comma-separated) B GA SCOPE
    import tempfile

    torch.set_num_threads(1)
    out, kinds, b, ga, scope = sys.argv[1:6]
    results = {}
    for kind in kinds.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            grads, logs = run(tmp, kind, int(b), int(ga), 2, scope)
        results[kind] = {"grad": grads[-1], "logs": logs}
    torch.save(results, f"{out}.rank{os.environ.get('RANK', '0')}.pt")
