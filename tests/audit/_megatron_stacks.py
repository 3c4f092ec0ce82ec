"""megatron-core stacks for the audit tests: a tiny float64 LM, and a forward step and loss function written
as Megatron-LM's ``pretrain_gpt.py`` writes them (``(loss_sum, num_tokens, {"lm loss": [sum, n]})``).

Two stand-ins for accelerator-only parts of megatron-core, outside the code under test (as in
tests/integrations/_megatron_workers.py): the model provides the two methods ``finalize_model_grads`` calls
on Megatron's ``DistributedDataParallel`` (``finish_grad_sync``: the sum over the data-parallel group,
divided by its size unless ``calculate_per_token_loss``, as Megatron's DDP scales; ``scale_gradients``),
and ``torch.zeros(..., device="cuda")`` (the schedule's token counter) is put on the CPU while this
module is imported (a test process only).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

V, H = 13, 6
_real_zeros = torch.zeros


def _cpu_zeros(*args, **kwargs):
    if kwargs.get("device") == "cuda":
        kwargs["device"] = "cpu"
    return _real_zeros(*args, **kwargs)


torch.zeros = _cpu_zeros  # the bridge: megatron-core's schedule allocates its counter on "cuda"


class TinyLM(nn.Module):
    """Embedding -> tanh -> head; forward returns the per-token cross-entropy ``[b, s]``."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.enums import ModelType

        self.emb = nn.Parameter(torch.randn(V, H, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(H, H, dtype=torch.float64) / H**0.5)
        self.out = nn.Parameter(torch.randn(V, H, dtype=torch.float64) / H**0.5)
        self.config = config
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, input_tensor):
        del input_tensor

    def forward(self, tokens, labels):
        logits = torch.tanh(self.emb[tokens] @ self.w) @ self.out.T
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)

    def finish_grad_sync(self, force_all_reduce=False):
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        for p in self.parameters():
            dist.all_reduce(p.grad)
            if not self.config.calculate_per_token_loss:
                p.grad /= dist.get_world_size()

    def scale_gradients(self, scaling):
        for p in self.parameters():
            p.grad.mul_(scaling)


def _model(per_token: bool):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=1,
        calculate_per_token_loss=per_token,
        finalize_model_grads_func=finalize_model_grads,
        pipeline_dtype=torch.float64,
    )
    return TinyLM(config)


def model_per_token():
    return _model(True)


def model_per_microbatch():
    return _model(False)


def loss_func(loss_mask, output_tensor):
    """Megatron-LM pretrain_gpt.py's loss function: the masked sum, the token count, the report."""
    losses = output_tensor.reshape(-1)
    mask = loss_mask.reshape(-1).to(losses.dtype)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.to(loss.dtype).view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    mb = next(data_iterator)
    return model(mb["tokens"], mb["labels"]), partial(loss_func, mb["loss_mask"])
