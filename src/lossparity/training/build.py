"""What a training run is built from, one function each: the model sharded by the layout, the gradient
engine around it, the corpus, the MoE accounting of its routers, the optimizer.
:class:`~lossparity.training.trainer.Trainer` calls them in this order; nothing here runs a step.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from ..distributed.accountant import Accountant
from ..distributed.moe.accounting import MoEAccounting
from ..distributed.parallel_dims import ParallelDims
from ..model import GPT
from ..model.config import ModelConfig
from ..model.context_parallel import ContextParallel
from .config import TrainConfig
from .data import Corpus, JsonlCorpus, SyntheticCorpus, TextFileCorpus
from .forward import LossForward, run_dtypes

__all__ = ["build_model", "wrap_engine", "build_corpus", "build_moe_accounting", "build_optimizer"]


def build_model(
    cfg: TrainConfig,
    model_config: ModelConfig,
    dims: ParallelDims,
    device: torch.device,
    cp_ctx: ContextParallel | None,
) -> tuple[GPT, list[nn.Parameter]]:
    """The model in the run's dtype (seeded: identical on every rank), then sharded: context
    parallelism over ``cp``, tensor (and sequence) parallelism over the ``tp`` sub-mesh, routed experts
    over the ``ep`` ranks. Returns the model and the expert-parallel shards (whose gradients bypass the
    engine; empty without EP)."""
    torch.manual_seed(cfg.seed)
    raw = GPT(model_config)
    raw.to(device=device, dtype=run_dtypes(cfg.dtype).params)
    raw.enable_context_parallel(cp_ctx)
    if dims.tp > 1:
        from ..model.tensor_parallel import apply_tensor_parallel

        # Under EP the experts stay whole on every TP rank (expert TP size 1) and EP shards them.
        apply_tensor_parallel(raw, dims.submesh("tp"), sequence_parallel=dims.sp, shard_experts=dims.ep == 1)
    expert_params: list[nn.Parameter] = []
    if dims.ep > 1:  # routed experts sharded over the EP ranks; their gradients bypass the engine
        from ..model.expert_parallel import apply_expert_parallel, expert_parameters

        apply_expert_parallel(raw, dims.ep_mesh)
        expert_params = expert_parameters(raw)
    return raw, expert_params


def wrap_engine(raw: GPT, fwd: LossForward, dims: ParallelDims, world: int) -> nn.Module:
    """The gradient engine of ``dims.grad_engine`` around ``fwd`` (the loss forward of ``raw``): FSDP2
    (DTensor parameters sharded over DP, gradients reduce-scattered and averaged, the accountant multiplies
    them by D), DDP over the gradient group ``dp × cp``, or the plain module (the accountant sums
    gradients itself)."""
    engine = dims.grad_engine
    if world == 1 or engine == "plain":
        return fwd
    if engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in [*raw.layers, *(m.block for m in raw.mtp)]:
            fully_shard(cast(nn.Module, block))  # router buffers stay per-rank (FSDP does not sync them)
        return cast(nn.Module, fully_shard(fwd))  # an FSDPModule is the module, sharded in place
    # broadcast_buffers=False: the routers' dispatch counters are per-rank until end_step sums them.
    # find_unused_parameters: an expert may receive no token of this rank's microbatch.
    with warnings.catch_warnings():
        # torch >= 2.12 deprecates broadcast_buffers; its replacement still syncs buffers at init.
        warnings.simplefilter("ignore", FutureWarning)
        return nn.parallel.DistributedDataParallel(
            fwd, broadcast_buffers=False, find_unused_parameters=True, process_group=dims.grad_group
        )


def build_corpus(cfg: TrainConfig, vocab_size: int) -> Corpus:
    """The corpus named by ``cfg.data``: ``synthetic`` (embedded generator), a ``.jsonl`` file or a text file
    (both with the byte-level tokenizer)."""
    from .data import ByteTokenizer

    if cfg.data == "synthetic":
        return SyntheticCorpus(vocab_size=vocab_size, seed=cfg.seed)
    tok = ByteTokenizer()
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"model vocab_size {vocab_size} is smaller than the byte tokenizer's {tok.vocab_size} "
            f"needed by --data {cfg.data}: pass --set vocab_size={tok.vocab_size} (or more)"
        )
    if cfg.data.endswith(".jsonl"):
        return JsonlCorpus(cfg.data, tok, field=cfg.data_field)
    return TextFileCorpus(cfg.data, tok)


def build_moe_accounting(
    cfg: TrainConfig, model_config: ModelConfig, acc: Accountant, num_layers: int, **kwargs: Any
) -> MoEAccounting:
    """MoE accounting of ``num_layers`` routers with the run's scope and coefficients (one per pipeline
    chunk under PP, one for the model otherwise)."""
    mc = model_config
    return MoEAccounting(
        acc,
        num_layers,
        max(mc.num_experts, 1),
        max(mc.topk, 1) if mc.num_experts else 1,  # a dense model has no router: any valid k
        scope=cfg.aux_scope,
        aux_coeff=cfg.aux_coeff,
        z_coeff=cfg.z_coeff,
        z_form=cfg.z_form,
        megatron_quirks=cfg.megatron_quirks,
        **kwargs,
    )


def build_optimizer(
    cfg: TrainConfig, named: Sequence[tuple[str, nn.Parameter]], dims: ParallelDims
) -> torch.optim.Optimizer:
    """AdamW over the parameters this rank owns (``named``; weight decay on matrices only). ``foreach`` is
    off under TP and EP: DTensor and plain parameters cannot share one foreach kernel."""
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False if dims.tp > 1 or dims.ep > 1 else None,
    )
