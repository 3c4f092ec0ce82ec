"""Pipeline-parallel training step of the reference trainer (``torch.distributed.pipelining``).

Every pipeline rank builds the whole (small) model but owns, updates and checkpoints only the chunks
it holds (:mod:`lossparity.model.pipeline`). Per step, on every rank:

1. ``acc.begin_step`` with the whole rows of the rank's data-parallel microbatches (every stage takes
   part in the pre-count, so no collective is skipped);
2. the schedule (1F1B, or interleaved 1F1B with ``V > 1`` virtual chunks) runs forwards and
   backwards; the loss function on the last stage feeds the accountant in microbatch order, auxiliary
   MoE shares of the other stages enter through ``AuxInject``. ``scale_grads=False``: the schedule
   must not divide by the number of microbatches, the accountant's shares are already exact;
3. the shared embedding's gradient is summed over the pipeline ranks that hold a copy (the first
   chunk's embedding and the last chunk's MTP copy; ownership counted over all chunks of a rank),
   then the accountant sums gradients over DP × CP; every stage updates its experts' biases;
4. the global gradient norm is reduced over the pipeline group, the optimizer steps, and the logs are
   reduced in one collective over all ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.accountant import Accountant
from ..distributed.moe.accounting import MoEAccounting
from ..distributed.parallel_dims import ParallelDims
from ..losses.mtp import roll_mtp
from ..model import GPT
from ..model.pipeline import StageModule, chunks_of_rank, split_layers
from ..model.router import RouterRecord
from ..model.sequence_parallel import sp_shard
from .forward import head_losses, head_weights, indexer_share, microbatch_share, run_dtypes
from .grads import clip_grad_norm

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """The pipeline half of a trainer with ``dims.pp > 1`` (see the module docstring). ``moe_factory(n,
    **kw)`` builds the MoE accounting of a chunk with ``n`` routers (the trainer's settings)."""

    def __init__(
        self,
        cfg: Any,
        raw: GPT,
        acc: Accountant,
        dims: ParallelDims,
        device: torch.device,
        moe_factory: Callable[..., MoEAccounting],
    ) -> None:
        self.cfg, self.raw, self.acc, self.dims, self.device = cfg, raw, acc, dims, device
        self.pp_group, self.pp_rank = dims.pp_group, dims.pp_rank
        num_chunks = dims.pp * dims.pp_virtual
        ranges = split_layers(len(raw.layers), num_chunks)
        self.chunk_ids = chunks_of_rank(self.pp_rank, dims.pp, dims.pp_virtual)
        self.first = 0 in self.chunk_ids
        self.last = num_chunks - 1 in self.chunk_ids
        total_moe = len(raw.moe_routers())
        self.stages, self.moes = [], []
        for c in self.chunk_ids:
            module = StageModule(raw, c, num_chunks, ranges[c], recompute=cfg.recompute)
            routers = module.routers()
            moe = moe_factory(
                len(routers),
                log_layers=total_moe,
                declare=total_moe > 0,
                log_layer_ids=[r.layer_id for r in raw.moe_routers()],
            )
            module.aux_fn = self._aux_fn(moe, routers)
            self.stages.append(module)
            self.moes.append((moe, routers))
        self.schedule = self._schedule(num_chunks)
        # Parameters this rank owns (distinct objects over its chunks): the optimizer's and the checkpoint's.
        owned = {id(p) for m in self.stages for p in m.parameters()}
        self.params = {name: p for name, p in raw.named_parameters() if id(p) in owned}
        self.embedding = raw.tok_embeddings.weight
        self.shares_embedding = bool(len(raw.mtp))
        self._batch: list[dict[str, Any]] = []
        self._loss_mb = 0
        self._cols: Tensor | None = None

    def _schedule(self, num_chunks: int) -> Any:
        """1F1B (or interleaved 1F1B) over this rank's chunks, with static stage shapes: without them
        PipelineStage infers shapes by running a forward and a backward of the first microbatch, which
        would consume a microbatch context and record auxiliary losses. Shapes are per rank: under CP a
        stage holds ``S/C`` positions, under SP the hidden state between stages ``S/(C·T)``."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        cfg, raw = self.cfg, self.raw
        b, dim = cfg.microbatch_size, raw.config.dim
        s_local = cfg.seq_len // self.dims.cp
        s_between = s_local // self.dims.tp if self.dims.sp else s_local
        dtype = raw.tok_embeddings.weight.dtype
        # requires_grad on the example: the received activation buffers copy it, and the backward of a
        # stage only sends a gradient for inputs that require one.
        hidden = torch.empty(b, s_between, dim, dtype=dtype, device=self.device, requires_grad=True)
        stacked = torch.empty(1 + len(raw.mtp), b, s_local, dim, dtype=dtype, device=self.device)
        tokens = torch.empty(b, cfg.seq_len, dtype=torch.long, device=self.device)
        pstages = [
            PipelineStage(
                m,
                c,
                num_chunks,
                self.device,
                group=self.pp_group,
                input_args=tokens if c == 0 else hidden,
                output_args=stacked if c == num_chunks - 1 else hidden,
                input_grads=(None,) if c == 0 else hidden,
                output_grads=(None,) if c == num_chunks - 1 else hidden,
            )
            for m, c in zip(self.stages, self.chunk_ids)
        ]
        # scale_grads=False: the accountant's shares are already exact, the schedule must not divide.
        if self.dims.pp_virtual == 1:
            return Schedule1F1B(pstages[0], cfg.ga, loss_fn=self._loss_fn, scale_grads=False)
        # torch annotates the stages as list[_PipelineStageBase]; a list of its subclass is what it expects
        return ScheduleInterleaved1F1B(cast(Any, pstages), cfg.ga, loss_fn=self._loss_fn, scale_grads=False)

    def _aux_fn(self, moe: MoEAccounting, routers: list) -> Any:
        """The chunk's auxiliary share of one microbatch: MoE terms of its routers plus the indexer loss
        when the chunk holds the indexer layer (``None`` when neither)."""

        def fn(records: list[RouterRecord], mb: int, indexer: tuple[Tensor, Tensor] | None) -> Tensor | None:
            data = self._batch[mb]
            share = moe.microbatch_loss(records, data["valid"], data["seg"]) if records else None
            if indexer is not None:
                idx = indexer_share(self.acc, self.cfg.indexer_coeff, indexer, data["valid"], per_rank=self.dims.sp)
                share = idx if share is None else share + idx
            return share

        return fn

    def _loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        """Last stage: the accountant's shares of one microbatch (main loss and MTP depths)."""
        data = self._batch[self._loss_mb]
        self._loss_mb += 1
        dtype = run_dtypes(self.cfg.dtype).loss
        weights = head_weights(
            self.acc, self.cfg.loss_impl, dtype, data["mask"], data["seg"], data["mtp_masks"], self._cols
        )
        mtp_hidden = [output[k] for k in range(1, 1 + len(self.raw.mtp))]
        head = head_losses(self.raw, output[0], mtp_hidden, data["labels"], data["mtp_labels"], weights)
        return microbatch_share(self.acc, head, data["mask"], data["seg"], data["mtp_masks"], self._cols)

    def run(self, mbs: list, segs: list, valids: list) -> None:
        """Forward and backward of the step's microbatches through the pipeline schedule. Under context
        parallelism the losses and routers see this rank's columns (cut here from whole rows), under
        sequence parallelism the routers this TP rank's slice of them."""
        raw = self.raw
        S = mbs[0].tokens.shape[1]
        cols = None if raw.cp is None else raw.cp.columns(S).to(mbs[0].tokens.device)
        self._cols = cols

        def cut(x: Tensor) -> Tensor:
            return x if cols is None else x[:, cols]

        tp_mesh = self.dims.submesh("tp") if self.dims.sp else None
        self._batch = []
        for mb, seg, valid in zip(mbs, segs, valids):
            rolled = [roll_mtp(mb.labels, mb.mask, seg, k) for k in range(1, len(raw.mtp) + 1)]
            valid_c = cut(valid) if tp_mesh is None else sp_shard(cut(valid), tp_mesh)
            self._batch.append(
                {
                    "labels": cut(mb.labels),
                    "mask": cut(mb.mask),
                    "seg": cut(seg),
                    "valid": valid_c,
                    "mtp_labels": [cut(r[0]) for r in rolled],
                    "mtp_masks": [cut(r[1]) for r in rolled],
                }
            )
        contexts = [  # values were checked once per step on the host-side batch (Trainer.train_step)
            raw.prepare(mb.tokens, segment_ids=seg, positions=mb.positions, check_values=False)
            for mb, seg in zip(mbs, segs)
        ]
        for m in self.stages:
            m.set_microbatches(contexts)
        self._loss_mb = 0
        x = torch.cat([mb.tokens for mb in mbs])
        target = torch.arange(x.shape[0], device=x.device)
        args = (x,) if self.first else ()
        kwargs = {"target": target} if self.last else {}
        self.schedule.step(*args, **kwargs)

    def reduce_grads(self) -> None:
        """Sum the shared embedding's gradient over the pipeline ranks holding a copy (zeros elsewhere, so
        that every pipeline rank enters the collective every step)."""
        if not self.shares_embedding:
            return
        holds = self.first or self.last
        g = self.embedding.grad if holds and self.embedding.grad is not None else torch.zeros_like(self.embedding)
        dist.all_reduce(g, group=self.pp_group)
        if holds:
            self.embedding.grad = g

    def end_step_moe(self, bias_rate: float, zero_mean: bool) -> None:
        """Expert-bias update of every chunk of this rank (one collective per chunk, every step); each
        chunk's ``end_step`` records its layers' load imbalance in the step's logging collective."""
        for moe, routers in self.moes:
            moe.end_step(routers, bias_rate=bias_rate, zero_mean=zero_mean)

    def grad_norm_and_clip(self, max_norm: float) -> float:
        """Global L2 norm of the gradients over all pipeline ranks (the shared embedding counted once, on
        the rank of the first chunk), then clipping with that norm (:func:`clip_grad_norm`)."""
        params = list(self.params.values())
        counted = [p for p in params if p is not self.embedding or self.first]
        return clip_grad_norm(params, max_norm, pp_group=self.pp_group, norm_params=counted)
