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

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.moe_accounting import MoEAccounting
from ..losses.mtp import roll_mtp
from ..model.pipeline import StageModule, chunks_of_rank, split_layers
from ..model.router import RouterRecord

if TYPE_CHECKING:  # pragma: no cover
    from .trainer import Trainer

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """The pipeline half of a :class:`Trainer` with ``cfg.pp > 1`` (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        self.t = trainer
        cfg, raw = trainer.cfg, trainer.raw
        self.pp_group = trainer.mesh.get_group("pp")
        self.pp_rank = trainer.mesh.get_coordinate()[trainer.mesh.mesh_dim_names.index("pp")]
        num_chunks = cfg.pp * cfg.pp_virtual
        ranges = split_layers(len(raw.layers), num_chunks)
        self.chunk_ids = chunks_of_rank(self.pp_rank, cfg.pp, cfg.pp_virtual)
        self.first = 0 in self.chunk_ids
        self.last = num_chunks - 1 in self.chunk_ids
        total_moe = len(raw.moe_routers())
        self.stages, self.moes = [], []
        for c in self.chunk_ids:
            module = StageModule(raw, c, num_chunks, ranges[c], recompute=cfg.recompute)
            routers = module.routers()
            moe = MoEAccounting(trainer.acc, len(routers), max(raw.config.num_experts, 1), max(raw.config.topk, 1),
                                scope=cfg.aux_scope, aux_coeff=cfg.aux_coeff, z_coeff=cfg.z_coeff,
                                z_form=cfg.z_form, log_layers=total_moe, declare=total_moe > 0,
                                megatron_quirks=cfg.megatron_quirks)
            module.aux_fn = self._aux_fn(moe, routers)
            self.stages.append(module)
            self.moes.append((moe, routers))
        # Static stage metadata: without it, PipelineStage infers shapes by running a forward and a backward
        # of the first microbatch, which would consume a microbatch context and record auxiliary losses.
        b, S, dim = cfg.microbatch_size, cfg.seq_len, raw.config.dim
        dtype = raw.tok_embeddings.weight.dtype
        # requires_grad on the example: the received activation buffers copy it, and the backward of a
        # stage only sends a gradient for inputs that require one.
        hidden = torch.empty(b, S, dim, dtype=dtype, device=trainer.device, requires_grad=True)
        stacked = torch.empty(1 + len(raw.mtp), b, S, dim, dtype=dtype, device=trainer.device)
        tokens = torch.empty(b, S, dtype=torch.long, device=trainer.device)
        pstages = [PipelineStage(m, c, num_chunks, trainer.device, group=self.pp_group,
                                 input_args=tokens if c == 0 else hidden,
                                 output_args=stacked if c == num_chunks - 1 else hidden,
                                 input_grads=(None,) if c == 0 else hidden,
                                 output_grads=(None,) if c == num_chunks - 1 else hidden)
                   for m, c in zip(self.stages, self.chunk_ids)]
        if cfg.pp_virtual == 1:
            self.schedule = Schedule1F1B(pstages[0], cfg.ga, loss_fn=self._loss_fn, scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(pstages, cfg.ga, loss_fn=self._loss_fn, scale_grads=False)
        # Parameters this rank owns (distinct objects over its chunks): the optimizer's and the checkpoint's.
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        owned = {id(p) for m in self.stages for p in m.parameters()}
        for name, p in raw.named_parameters():
            if id(p) in owned:
                seen[id(p)] = (name, p)
        self.params = dict(seen.values())
        self.embedding = raw.tok_embeddings.weight
        self.shares_embedding = bool(len(raw.mtp))
        self._batch: list[dict[str, Any]] = []
        self._loss_mb = 0
        # Expert-load metrics of every MoE layer, declared on every rank (same collective layout); each is
        # recorded by the first token-group rank of the stage that owns the layer, zeros elsewhere.
        self.moe_layer_ids = [r.layer_id for r in raw.moe_routers()]
        for lid in self.moe_layer_ids:
            trainer.acc.declare_metric(f"max_vio/layer_{lid}", "sum")
        if self.moe_layer_ids:
            trainer.acc.declare_metric("max_vio", "sum")

    def _aux_fn(self, moe: MoEAccounting, routers: list) -> Any:
        def fn(records: list[RouterRecord], mb: int) -> Tensor | None:
            if not records:
                return None
            data = self._batch[mb]
            return moe.microbatch_loss(records, data["valid"], data["seg"])

        return fn

    def _loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        """Last stage: the accountant's shares of one microbatch (main loss and MTP depths)."""
        t, acc = self.t, self.t.acc
        data = self._batch[self._loss_mb]
        self._loss_mb += 1
        from .trainer import head_fused_fn, head_loss_fn  # trainer imports this module: import at call time

        weights = t.head_weights(data["mask"], data["seg"], data["mtp_masks"], None)
        if weights is not None:  # fused head: the shares carry the gradients, losses feed the logs
            fce = head_fused_fn(t.raw)
            share, per_tok = fce(output[0], data["labels"], weights[0])
            loss = acc.add_lm_share(share, per_tok, data["mask"], data["seg"])
            if t.model_config.mtp_depths:
                parts = [fce(output[k], lab, w) for k, (lab, w) in enumerate(zip(data["mtp_labels"], weights[1]), 1)]
                loss = loss + acc.add_mtp_share(sum(p[0] for p in parts), [p[1] for p in parts],
                                                data["mtp_masks"], data["seg"])
            return loss
        ce = head_loss_fn(t.raw)
        per_tok = ce(output[0], data["labels"])
        loss = acc.lm_loss(per_tok, data["mask"], data["seg"])
        if t.model_config.mtp_depths:
            losses = [ce(output[k], lab) for k, lab in enumerate(data["mtp_labels"], 1)]
            loss = loss + acc.mtp_loss(losses, data["mtp_masks"], data["seg"])
        return loss

    def run(self, mbs: list, segs: list, valids: list) -> None:
        """Forward and backward of the step's microbatches through the pipeline schedule."""
        t = self.t
        depths = t.model_config.mtp_depths
        self._batch = []
        for mb, seg, valid in zip(mbs, segs, valids):
            rolled = [roll_mtp(mb.labels, mb.mask, seg, k) for k in range(1, depths + 1)]
            self._batch.append({"labels": mb.labels, "mask": mb.mask, "seg": seg, "valid": valid,
                                "mtp_labels": [r[0] for r in rolled], "mtp_masks": [r[1] for r in rolled]})
        contexts = [t.raw.prepare(mb.tokens, segment_ids=seg, positions=mb.positions) for mb, seg in zip(mbs, segs)]
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
        """Expert-bias update of every chunk of this rank (one collective per chunk, every step); the
        per-layer load imbalance goes into the step's logging collective."""
        acc = self.t.acc
        owner = acc.groups.token_rank() == 0
        for moe, routers in self.moes:
            vio = moe.end_step(routers, bias_rate=bias_rate, zero_mean=zero_mean)
            if owner:
                for r in routers:
                    value = vio[f"max_vio/layer_{r.layer_id}"]
                    acc.record(f"max_vio/layer_{r.layer_id}", value)
                    acc.record("max_vio", value / len(self.moe_layer_ids))

    def grad_norm_and_clip(self, max_norm: float) -> float:
        """Global L2 norm of the gradients over all pipeline ranks (the shared embedding counted once, on
        the rank of the first chunk), then clipping with that norm."""
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.t.device)
        for p in self.params.values():
            if p.grad is None or (p is self.embedding and not self.first):
                continue
            sq += p.grad.detach().to(torch.float64).pow(2).sum()
        dist.all_reduce(sq, group=self.pp_group)
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm and grads:
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
        return norm
