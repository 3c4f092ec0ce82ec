"""torchtitan stacks for the audit tests: a tiny float64 decoder in torchtitan's convention
(``model(tokens, positions=None)`` returns logits; transformer blocks under ``model.layers``, where
torchtitan's activation checkpointing and FSDP wrap), and losses with torchtitan's signature.

torchtitan's own decoders cannot be trained on a CPU: their attention backends are flex, flex_flash and varlen
(SDPA was removed for language models) and FlexAttention has no backward on CPU ("FlexAttention does not
support backward on CPU"), so the model here is written for the test; everything around it is torchtitan's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.trainer import Trainer

from lossparity.integrations.torchtitan import LossParityLoss, LossParityTitanMixin

V, H = 13, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H, dtype=torch.float64) / H**0.5)
        self.mix = nn.Parameter(torch.full((1,), 0.3, dtype=torch.float64))  # FSDP2 shards no 0-d parameter

    def forward(self, h):
        # a causal mix (the running mean of the row so far) makes a token's loss depend on earlier tokens
        run = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[None, :, None]
        return h + torch.tanh((h + self.mix * run) @ self.w)


class TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Parameter(torch.randn(V, H, dtype=torch.float64))
        self.pos = nn.Parameter(torch.randn(16, H, dtype=torch.float64) / 4)
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
        self.output = nn.Parameter(torch.randn(V, H, dtype=torch.float64) / H**0.5)

    def forward(self, tokens, positions=None, **kwargs):
        h = self.tok_embeddings[tokens]
        if positions is not None:
            h = h + self.pos[positions]
        for block in self.layers.values():
            h = block(h)
        return h @ self.output.T


def model():
    return TinyDecoder()


def mean_loss(pred, labels, global_valid_tokens=None, **kwargs):
    """A loss written without torchtitan's global count: each microbatch's token mean."""
    loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), ignore_index=-100)
    return loss, {}


# lossparity's per_sample loss: an instance (a MODULE:NAME spec names it), used with the mixin below, whose
# train_step pre-counts the mode's normalizer over the step's microbatches and ranks
PER_SAMPLE = LossParityLoss("per_sample")


class LossParityTrainer(LossParityTitanMixin, Trainer):
    """The user's class: lossparity's mixin on torchtitan's Trainer."""
