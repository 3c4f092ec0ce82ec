"""Worker run on spawned gloo ranks by test_integration_megatron.py (must be importable by the children).

A tiny float64 language model driven by megatron-core's real ``forward_backward_no_pipelining`` and
``finalize_model_grads`` on CPU. Two stand-ins, both outside the code under test:
- the model provides the two methods ``finalize_model_grads`` calls on Megatron's own
  ``DistributedDataParallel`` (which allocates CUDA buffers): ``finish_grad_sync`` sums the gradients
  over the data-parallel group (Megatron's DDP with ``calculate_per_token_loss=True`` uses a gradient
  scaling factor of 1, i.e. a sum) and ``scale_gradients`` multiplies them;
- the schedule allocates its token counter with ``device="cuda"``; ``torch.zeros`` is wrapped for the
  duration of the call to put it on the CPU.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

V, S, H = 13, 8, 6


class TinyLM(nn.Module):
    """Embedding -> tanh -> head; returns the [b, s] per-token cross-entropy (Megatron's output_tensor)."""

    def __init__(self, config):
        super().__init__()
        from megatron.core.enums import ModelType

        g = torch.Generator().manual_seed(7)
        self.emb = nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5)
        self.out = nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5)
        self.config = config
        self.model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, input_tensor):  # first and only stage: nothing comes from a previous stage
        del input_tensor

    def forward(self, tokens, labels):
        logits = torch.tanh(self.emb[tokens] @ self.w) @ self.out.T
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)

    # --- what finalize_model_grads calls on Megatron's DDP wrapper
    def finish_grad_sync(self, force_all_reduce=False):
        for p in self.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def scale_gradients(self, scaling):
        for p in self.parameters():
            p.grad.mul_(scaling)


def global_batch(n_rows: int):
    """Rows with ragged masks, two packed documents per row, and an all-masked pair of rows (3, 4):
    with micro-batch size 2 and rows split in order, rows 2..3 of rank 0 form a zero-token microbatch."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (n_rows, S), generator=g)
    labels = torch.randint(0, V, (n_rows, S), generator=g)
    lengths = torch.randint(1, S + 1, (n_rows,), generator=g)
    lengths[2] = lengths[3] = 0
    pos = torch.arange(S)[None, :]
    mask = (pos < lengths[:, None]).double()
    cut = torch.randint(1, S, (n_rows, 1), generator=g)
    seg = torch.where(pos < cut, 1, 2)
    return tokens, labels, mask, seg


@contextlib.contextmanager
def _cpu_zeros(schedules):
    real = torch.zeros

    def zeros(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real(*args, **kwargs)

    schedules.torch.zeros = zeros
    try:
        yield
    finally:
        schedules.torch.zeros = real


def run_megatron(rank: int, world: int, modes: list[str], n_rows: int, num_mbs: int, mbs: int):
    """Per mode, one step of megatron-core's no-pipelining schedule with lossparity's LossFunc; returns
    {mode: (this rank's final gradients, the reports reduced as Megatron's ``train_step`` does)}."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        return {mode: _one_step(mode, rank, world, n_rows, num_mbs, mbs) for mode in modes}
    finally:
        parallel_state.destroy_model_parallel()


def _one_step(mode: str, rank: int, world: int, n_rows: int, num_mbs: int, mbs: int):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lossparity.integrations.megatron import LossFunc

    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=1,
        calculate_per_token_loss=True,
        finalize_model_grads_func=finalize_model_grads,
        pipeline_dtype=torch.float64,
    )
    model = TinyLM(config)
    loss_fn = LossFunc(mode, config=config, fixed_length=S)
    tokens, labels, mask, seg = global_batch(n_rows)
    per_rank = n_rows // world
    batches = [slice(rank * per_rank + k * mbs, rank * per_rank + (k + 1) * mbs) for k in range(num_mbs)]

    def forward_step(data_iterator, model):
        m = next(data_iterator)
        out = model(tokens[m], labels[m])
        if mode == "per_document":
            return out, partial(loss_fn, mask[m], segment_ids=seg[m])
        return out, partial(loss_fn, mask[m])

    with _cpu_zeros(schedules):
        reports = schedules.forward_backward_no_pipelining(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=model,
            num_microbatches=num_mbs,
            seq_length=S,
            micro_batch_size=mbs,
        )
    reduced = {}
    for key in reports[0]:  # megatron/training/training.py train_step, calculate_per_token_loss=True
        val = torch.vstack([r[key].view(-1) for r in reports]).sum(dim=0)
        dist.all_reduce(val)
        reduced[key] = float(val[0] / val[1])
    return {n: p.grad.clone() for n, p in model.named_parameters()}, reduced
