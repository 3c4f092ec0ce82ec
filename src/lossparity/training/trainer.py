"""Reference trainer: the small MoE+MTP GPT trained with every loss term going through the accountant.

One optimizer step (``train_step``) of data-parallel rank ``d``:

1. the global batch of the step (a pure function of the seed and the step) is cut into this rank's
   ``K`` microbatches of ``b`` rows (:func:`split_batch`);
2. ``acc.begin_step`` pre-counts ``Ntok, N, Ndoc, D·K``, the MTP depths' counts and the routers'
   non-padding tokens in one all-reduce;
3. per microbatch: forward (optionally with activation recompute), chunked cross-entropy of the main
   head and of every MTP depth, MoE auxiliary shares, one ``backward`` of the sum of the shares;
4. ``acc.finish_step`` (gradient scaling), MoE end of step (expert-bias update from the step's global
   dispatch counts, every step), gradient clipping, AdamW;
5. ``acc.logs()``: every logged scalar in one collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed.accountant import Accountant
from ..distributed.moe_accounting import ROUTER_TOKENS, SCOPES, MoEAccounting
from ..losses.cross_entropy import chunked_cross_entropy
from ..losses.fused_cross_entropy import fused_linear_cross_entropy
from ..losses.indexer import indexer_kl
from ..losses.logchannel import IntervalMean
from ..losses.modes import check_mode
from ..losses.mtp import check_convention, roll_mtp
from ..losses.stats import sample_stats
from ..model import GPT, RouterRecord, get_config
from ..options import LOSS_IMPLS, check_option
from .checkpoint import (
    load_latest,
    load_sharded_latest,
    rng_state,
    save_checkpoint,
    save_sharded_checkpoint,
    set_rng_state,
)
from .data import Batch, Corpus, JsonlCorpus, SyntheticCorpus, TextFileCorpus, global_batch, split_batch

__all__ = ["TrainConfig", "Trainer", "build_corpus", "run_training"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bf16": torch.float32}


@dataclass
class TrainConfig:
    """Everything that defines a run. Layout fields (``dp``, ``ga``, ``recompute``, ``engine``) must not
    change the numbers (semantics §3), all others may."""

    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    mode: str = "per_token"
    normalization: str = "precount"
    fixed_length: int | None = None
    dp: int = 1
    cp: int = 1
    pp: int = 1
    pp_virtual: int = 1
    tp: int = 1
    sp: bool = False
    cp_zigzag: bool = True
    ga: int = 1
    global_batch: int = 8
    seq_len: int = 64
    packed: bool = False
    data: str = "synthetic"
    data_field: str = "text"
    steps: int = 20
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 2
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    recompute: bool = False
    engine: str = "ddp"
    mtp_weight: float = 0.3
    mtp_weight_after: float = 0.1
    mtp_switch_step: int | None = None
    mtp_convention: str = "own"
    mtp_log_estimator: str = "token_mean"
    aux_scope: str = "global_lagged"
    aux_coeff: float = 1e-2
    z_coeff: float = 1e-3
    z_form: str = "global"
    megatron_quirks: bool = False
    bias_rate: float = 1e-3
    bias_freeze_step: int | None = None
    bias_zero_mean: bool = False
    indexer_coeff: float = 1e-2
    out: str | None = None
    log_interval: int = 1
    ckpt_interval: int = 0
    resume: bool = False
    tensorboard: bool = True
    progress: bool = True
    dump_samples: bool = False
    device: str = "cpu"  # "cuda": single-process runs on the current GPU (multi-rank runs use NCCL's device)
    loss_impl: str = "fused"  # output-layer cross-entropy: fused (grads in the forward) or chunked

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field for any inconsistent setting."""
        check_mode(self.mode)
        check_convention(self.mtp_convention)
        self.loss_impl = check_option("loss_impl", self.loss_impl, LOSS_IMPLS)
        if self.aux_scope not in SCOPES:
            raise ValueError(f"unknown aux_scope {self.aux_scope!r}; valid: {', '.join(SCOPES)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(_DTYPES)}")
        if self.engine not in ("ddp", "fsdp", "plain"):
            raise ValueError(f"unknown engine {self.engine!r}; valid: ddp, fsdp, plain")
        if self.engine == "fsdp" and (self.cp > 1 or self.pp > 1):
            raise ValueError("engine='fsdp' is supported for data parallelism without cp/pp")
        if self.cp > 1:
            if self.aux_scope not in ("global_lagged", "none") or self.z_form != "global":
                raise ValueError(f"cp={self.cp} supports aux_scope global_lagged/none and z_form global (got "
                                 f"aux_scope={self.aux_scope!r}, z_form={self.z_form!r}): the other forms need the "
                                 "counts of whole microbatches or sequences on every shard")
            parts = 2 * self.cp if self.cp_zigzag else self.cp
            if self.seq_len % parts:
                raise ValueError(f"seq_len={self.seq_len} must be divisible by {parts} for cp={self.cp}")
        if self.sp:
            if self.tp < 2:
                raise ValueError("sp (sequence parallelism) needs tp > 1")
            if self.seq_len % self.tp:
                raise ValueError(f"seq_len={self.seq_len} must be divisible by tp={self.tp} for sequence parallelism")
            if self.aux_scope not in ("global_lagged", "none") or self.z_form != "global":
                raise ValueError(f"sp supports aux_scope global_lagged/none and z_form global (got aux_scope="
                                 f"{self.aux_scope!r}, z_form={self.z_form!r}): the other forms need the counts of "
                                 "whole microbatches or sequences on every shard")
        if self.tp > 1:
            if self.cp > 1 or self.pp > 1:
                raise ValueError(f"tp={self.tp} is not combined with cp > 1 or pp > 1 yet")
            if self.engine != "plain":
                self.engine = "plain"  # DTensor-sharded parameters: the accountant sums gradients over DP
        if self.pp > 1:
            if self.cp > 1 or self.dump_samples or self.ckpt_interval:
                raise ValueError(f"pp={self.pp} is not combined with cp > 1, dump_samples or checkpoints yet")
            if self.ga < self.pp:
                raise ValueError(f"pp={self.pp} needs ga >= pp microbatches per step (got ga={self.ga}) to fill the "
                                 "pipeline")
            if self.pp_virtual > 1 and self.ga % self.pp:
                raise ValueError(f"interleaved pipelining (pp_virtual={self.pp_virtual}) needs ga divisible by "
                                 f"pp={self.pp}, got ga={self.ga}")
        for name in ("dp", "cp", "pp", "pp_virtual", "tp", "ga", "global_batch", "seq_len", "steps", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch % (self.dp * self.ga):
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by dp*ga={self.dp}*{self.ga}: every rank "
                "needs the same number of whole rows per microbatch"
            )
        if self.mode == "sample_sum_norm" and self.fixed_length is None:
            self.fixed_length = self.seq_len
        if self.dump_samples and (self.out is None or self.cp > 1):
            raise ValueError("dump_samples needs out= (the dump goes to OUT/samples) and cp=1 (a context-parallel "
                             "shard holds only part of a sample's sum)")
        if self.data != "synthetic" and not os.path.exists(self.data):
            raise FileNotFoundError(f"data file not found: {self.data}")

    @property
    def microbatch_size(self) -> int:
        """``b = N / (D·K)``."""
        return self.global_batch // (self.dp * self.ga)


def build_corpus(cfg: TrainConfig, vocab_size: int) -> Corpus:
    """The corpus named by ``cfg.data``: ``synthetic`` (embedded generator), a ``.jsonl`` file or a text file
    (both with the byte-level tokenizer)."""
    from .data import ByteTokenizer

    if cfg.data == "synthetic":
        return SyntheticCorpus(vocab_size=vocab_size, seed=cfg.seed)
    tok = ByteTokenizer()
    if tok.vocab_size > vocab_size:
        raise ValueError(f"model vocab_size {vocab_size} is smaller than the byte tokenizer's {tok.vocab_size}")
    if cfg.data.endswith(".jsonl"):
        return JsonlCorpus(cfg.data, tok, field=cfg.data_field)
    return TextFileCorpus(cfg.data, tok)


def _valid_tokens(mb: Batch) -> tuple[Tensor, Tensor]:
    """``(segment_ids, valid)``: packed rows keep their ids; a padded row is one document (id 1) over
    its non-padding positions (position 0 and every position > 0 of the document)."""
    if mb.segment_ids is not None:
        return mb.segment_ids, mb.segment_ids > 0
    S = mb.tokens.shape[1]
    valid = (mb.positions > 0) | (torch.arange(S, device=mb.tokens.device) == 0)
    return valid.long(), valid


def _clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of the gradients (DTensor shards reduced over their mesh: ``full_tensor`` semantics
    without materializing), then clipping by ``max_norm`` (``<= 0``: no clipping). Returns the norm."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        if hasattr(g, "to_local"):
            local = g.to_local().detach().to(torch.float64).pow(2).sum()
            if any(pl.is_shard() for pl in g.placements):
                local = local.to(g.to_local().device)
                dist.all_reduce(local, group=g.device_mesh.get_group())
            sq += local.cpu()
        else:
            sq += g.detach().to(torch.float64).pow(2).sum().cpu()
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.mul_(coef)
    return norm


def _lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``lr`` to ``min_lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    t = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def _up(x: Tensor) -> Tensor:
    """Low-precision losses are accumulated in float32; float64 runs (verify) stay float64. Never a view:
    FSDP2 hooks the module's outputs and warns about (and cannot protect) views."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous().clone() if x._is_view() else x


def head_loss_fn(gpt: GPT):
    """Per-token cross-entropy of ``gpt``'s output head: the chunked cross-entropy, vocabulary-parallel
    when tensor parallelism shards the head's rows (a ``DTensor``)."""
    weight = gpt.output.weight
    if hasattr(weight, "to_local"):
        mesh = weight.device_mesh
        local = weight.to_local()
        start = mesh.get_local_rank() * local.shape[0]
        return lambda h, lab: chunked_cross_entropy(h, local, lab, vocab_parallel_group=mesh.get_group(),
                                                    vocab_start=start, vocab_size=weight.shape[0])
    return lambda h, lab: chunked_cross_entropy(h, weight, lab)


def head_fused_fn(gpt: GPT):
    """``(h, labels, token_weights) -> (Σ w·l, l.detach())`` of ``gpt``'s output head by the fused linear
    cross-entropy (gradients formed in the forward), vocabulary-parallel like :func:`head_loss_fn`."""
    weight = gpt.output.weight
    if hasattr(weight, "to_local"):
        mesh = weight.device_mesh
        local = weight.to_local()
        start = mesh.get_local_rank() * local.shape[0]
        return lambda h, lab, w: fused_linear_cross_entropy(h, local, lab, w, vocab_parallel_group=mesh.get_group(),
                                                            vocab_start=start, vocab_size=weight.shape[0])
    return lambda h, lab, w: fused_linear_cross_entropy(h, weight, lab, w)


class LossForward(nn.Module):
    """The model plus its output head applied by the output-layer cross-entropy, as one module, so that an
    engine wrapping it (DDP) sees every parameter used inside its ``forward``.

    Returns ``(per_token_loss [b,S], [per_token_loss_k for MTP depths], [(logits, probs, topk_map,
    dispatch_map) per MoE layer], indexer outputs or None, shares)``; router records are flattened to
    tuples so DDP can walk them. ``weights = (main [b,S], [per MTP depth])`` (the accountant's
    per-token weights) selects the fused head: ``shares = (Σ w·l main, Σ_k Σ w_k·l_k)`` carry the
    gradients and the per-token losses are detached; without ``weights`` (chunked head) ``shares`` is
    None."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def _head_loss(self):
        return head_loss_fn(self.gpt)

    def forward(self, tokens: Tensor, labels: Tensor, mtp_labels: list[Tensor], segment_ids: Tensor,
                positions: Tensor, recompute: bool = False, autocast_dtype: torch.dtype | None = None,
                weights: tuple[Tensor, list[Tensor]] | None = None
                ) -> tuple[Tensor, list[Tensor], list[tuple[Tensor, ...]], tuple[Tensor, Tensor] | None,
                           tuple[Tensor, Tensor] | None]:
        if self.gpt.cp is not None:  # the model returns this shard's columns: cut the labels alike
            cols = self.gpt.cp.columns(tokens.shape[1]).to(tokens.device)
            labels, mtp_labels = labels[:, cols], [lab[:, cols] for lab in mtp_labels]
        shares = None
        with torch.autocast(tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = self.gpt(tokens, segment_ids=segment_ids, positions=positions, recompute=recompute)
            if weights is None:
                ce = self._head_loss()
                main = ce(out.hidden, labels)
                mtp = [ce(h, lab) for h, lab in zip(out.mtp_hidden, mtp_labels)]
            else:
                fce = head_fused_fn(self.gpt)
                main_share, main = fce(out.hidden, labels, weights[0])
                parts = [fce(h, lab, w) for h, lab, w in zip(out.mtp_hidden, mtp_labels, weights[1])]
                mtp = [p[1] for p in parts]
                shares = (main_share, sum((p[0] for p in parts), torch.zeros_like(main_share)))
        routers = [(r.logits, r.probs, r.topk_map, r.dispatch_map) for r in out.routers]
        return _up(main), [_up(x) for x in mtp], routers, out.indexer, shares


class Trainer:
    """A reference training run on this process (rank ``dist.get_rank()`` when distributed)."""

    def __init__(self, cfg: TrainConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if self.world != cfg.dp * cfg.cp * cfg.pp * cfg.tp:
            raise ValueError(f"dp*cp*pp*tp={cfg.dp}*{cfg.cp}*{cfg.pp}*{cfg.tp} but the process group has "
                             f"{self.world} ranks")
        self.mesh = None
        self.dp_rank, self.cp_ctx = self.rank, None
        if self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
            if cfg.pp > 1:
                self.mesh = init_device_mesh(device_type, (cfg.pp, cfg.dp), mesh_dim_names=("pp", "dp"))
                self.dp_rank = self.mesh.get_coordinate()[1]
            elif cfg.tp > 1:
                self.mesh = init_device_mesh(device_type, (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
                self.dp_rank = self.mesh.get_coordinate()[0]
            else:
                self.mesh = init_device_mesh(device_type, (cfg.dp, cfg.cp), mesh_dim_names=("dp", "cp"))
                self.dp_rank = self.mesh.get_coordinate()[0]
            if cfg.cp > 1:
                from ..model.context_parallel import ContextParallel

                self.cp_ctx = ContextParallel.from_group(self.mesh.get_group("cp"), cfg.cp_zigzag)
        if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif cfg.device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but torch.cuda.is_available() is False")
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        overrides = dict(cfg.model_overrides)
        self.model_config = get_config(cfg.model, **overrides)
        torch.manual_seed(cfg.seed)
        raw = GPT(self.model_config)
        raw.to(device=self.device, dtype=torch.float64 if cfg.dtype == "float64" else torch.float32)
        raw.enable_context_parallel(self.cp_ctx)
        if cfg.tp > 1:
            from ..model.tensor_parallel import apply_tensor_parallel

            if self.model_config.indexer_layer is not None:
                raise ValueError("the indexer head is not supported with tensor parallelism yet (it needs every "
                                 "head's attention probabilities)")
            apply_tensor_parallel(raw, self.mesh["tp"], sequence_parallel=cfg.sp)
        self.raw = raw
        fwd = LossForward(raw)
        if self.world > 1 and cfg.engine == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # FSDP2: parameters become DTensors sharded over DP; gradients are reduce-scattered (averaged),
            # the accountant multiplies them by D. Router buffers stay per-rank (FSDP does not sync them).
            for block in list(raw.layers) + [m.block for m in raw.mtp]:
                fully_shard(block)
            self.model = fully_shard(fwd)
        elif self.world > 1 and cfg.engine == "ddp" and cfg.pp == 1:
            # broadcast_buffers=False: the routers' dispatch counters are per-rank until end_step sums them.
            # find_unused_parameters: an expert may receive no token of this rank's microbatch.
            with warnings.catch_warnings():
                # torch >= 2.12 deprecates broadcast_buffers; its replacement still syncs buffers at init.
                warnings.simplefilter("ignore", FutureWarning)
                # Gradients are reduced over DP x CP: context-parallel peers hold the same replica.
                group = self.mesh["dp", "cp"]._flatten().get_group() if cfg.cp > 1 else None
                self.model: nn.Module = nn.parallel.DistributedDataParallel(
                    fwd, broadcast_buffers=False, find_unused_parameters=True, process_group=group)
        else:
            self.model = fwd
        self.corpus = build_corpus(cfg, self.model_config.vocab_size)
        depths = self.model_config.mtp_depths
        self.acc = Accountant(cfg.mode, normalization=cfg.normalization, fixed_length=cfg.fixed_length,
                              mtp_depths=depths, mtp_convention=cfg.mtp_convention, device=self.device,
                              mtp_log_estimator=cfg.mtp_log_estimator,
                              mesh=self.mesh, sequence_parallel=cfg.sp)
        self.routers = raw.moe_routers()
        if self.model_config.indexer_layer is not None:
            if cfg.pp > 1:
                raise ValueError("the indexer head is not supported with pipeline parallelism yet")
            self.acc.declare_metric("indexer_loss", "ratio")
        self.pipeline = None
        if cfg.pp > 1:
            from .pipeline import PipelineRunner

            self.pipeline = PipelineRunner(self)
        # Under pipeline parallelism every chunk has its own MoE accounting (see training/pipeline.py).
        self.moe = None if self.pipeline is not None else MoEAccounting(
            self.acc, len(self.routers), max(self.model_config.num_experts, 1), max(self.model_config.topk, 1),
            scope=cfg.aux_scope, aux_coeff=cfg.aux_coeff, z_coeff=cfg.z_coeff, z_form=cfg.z_form,
            megatron_quirks=cfg.megatron_quirks)
        named = list(raw.named_parameters()) if self.pipeline is None else list(self.pipeline.params.items())
        decay = [p for n, p in named if p.dim() >= 2]
        no_decay = [p for n, p in named if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False if cfg.tp > 1 else None)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.dump = None  # per-sample (n_i, s_i) writer of `lossparity gap`, opened by fit()

    # ------------------------------------------------------------------ one step
    def mtp_weight(self, step: int) -> float:
        """The MTP ``λ`` schedule: ``mtp_weight`` until ``mtp_switch_step``, then ``mtp_weight_after``."""
        c = self.cfg
        return c.mtp_weight if c.mtp_switch_step is None or step < c.mtp_switch_step else c.mtp_weight_after

    def bias_rate(self, step: int) -> float:
        """Expert-bias update rate: constant, then frozen (0) from ``bias_freeze_step`` on."""
        c = self.cfg
        return 0.0 if c.bias_freeze_step is not None and step >= c.bias_freeze_step else c.bias_rate

    def train_step(self) -> dict[str, Any]:
        """Run optimizer step ``self.step`` and return its log line."""
        cfg, acc, model = self.cfg, self.acc, self.model
        t0 = time.perf_counter()
        batch = global_batch(self.corpus, self.step, global_batch_size=cfg.global_batch, seq_len=cfg.seq_len,
                             packed=cfg.packed, seed=cfg.seed).to(self.device)
        mbs = split_batch(batch, cfg.dp, self.dp_rank, cfg.ga, cfg.microbatch_size)
        cols = None if self.cp_ctx is None else self.cp_ctx.columns(cfg.seq_len).to(self.device)
        segs, valids = zip(*(_valid_tokens(mb) for mb in mbs))
        depths = self.model_config.mtp_depths
        acc.begin_step([mb.mask for mb in mbs], list(segs), mtp_weight=self.mtp_weight(self.step),
                       extra_counts=MoEAccounting.router_tokens(valids))
        if self.pipeline is not None:
            return self._finish_pipeline_step(mbs, segs, valids, t0)
        dtype = torch.bfloat16 if cfg.dtype == "bf16" else None
        for i, (mb, seg, valid) in enumerate(zip(mbs, segs, valids)):
            last = i == len(mbs) - 1
            sync = model.no_sync() if isinstance(model, nn.parallel.DistributedDataParallel) and not last \
                else contextlib.nullcontext()
            if cfg.engine == "fsdp" and self.world > 1:
                model.set_requires_gradient_sync(last)  # reduce-scatter once, after the last microbatch
            rolled = [roll_mtp(mb.labels, mb.mask, seg, k) for k in range(1, depths + 1)]
            if cols is not None:  # context parallelism: this rank's columns of the whole rows
                mask_c, seg_c, valid_c = mb.mask[:, cols], seg[:, cols], valid[:, cols]
                masks_k = [r[1][:, cols] for r in rolled]
            else:
                mask_c, seg_c, valid_c, masks_k = mb.mask, seg, valid, [r[1] for r in rolled]
            weights = self.head_weights(mask_c, seg_c, masks_k, cols)
            with sync:
                per_tok, mtp_losses, routers, indexer, shares = model(
                    mb.tokens, mb.labels, [r[0] for r in rolled], seg, mb.positions, cfg.recompute, dtype, weights)
                if cfg.sp:  # routers saw this TP rank's slice of the sequence (losses are whole rows)
                    from ..model.tensor_parallel import sp_shard

                    valid_c = sp_shard(valid_c, self.mesh["tp"])
                loss = (acc.lm_loss(per_tok, mask_c, seg_c, columns=cols) if shares is None
                        else acc.add_lm_share(shares[0], per_tok, mask_c, seg_c, columns=cols))
                if self.dump is not None:
                    s_i, n_i = sample_stats(per_tok.detach(), mask_c)
                    first = (self.dp_rank * cfg.ga + i) * cfg.microbatch_size
                    self.dump.write(self.step + 1, torch.arange(first, first + len(n_i)), n_i, s_i)
                if depths:
                    loss = loss + (acc.mtp_loss(mtp_losses, masks_k, seg_c, columns=cols) if shares is None
                                   else acc.add_mtp_share(shares[1], mtp_losses, masks_k, seg_c, columns=cols))
                if self.routers:
                    records = [RouterRecord(r.layer_id, *t) for r, t in zip(self.routers, routers)]
                    loss = loss + self.moe.microbatch_loss(records, valid_c, seg_c)
                if indexer is not None:
                    loss = loss + self._indexer_share(indexer, valid)
                loss.backward()
        if cfg.sp:
            self._sum_replicated_grads_over_tp()
        acc.finish_step(model)
        moe_logs = self.moe.end_step(self.routers, bias_rate=self.bias_rate(self.step),
                                     zero_mean=cfg.bias_zero_mean)
        grad_norm = _clip_grad_norm([p for p in self.raw.parameters() if p.grad is not None], cfg.grad_clip)
        return self._optimizer_step(grad_norm, moe_logs, t0)

    def head_weights(self, mask: Tensor, seg: Tensor, mtp_masks: list[Tensor], cols: Tensor | None
                      ) -> tuple[Tensor, list[Tensor]] | None:
        """The accountant's per-token weights of the next microbatch (main, per MTP depth) for the fused
        head, in the loss dtype; None for the chunked head."""
        if self.cfg.loss_impl != "fused":
            return None
        acc, dtype = self.acc, torch.float64 if self.cfg.dtype == "float64" else torch.float32
        main = acc.token_weights(mask, seg, columns=cols).to(dtype)
        mtp = acc.mtp_token_weights(mtp_masks, seg, columns=cols) if mtp_masks else []
        return main, [w.to(dtype) for w in mtp]

    def _sum_replicated_grads_over_tp(self) -> None:
        """Sequence parallelism: parameters that stay replicated (norms, routers, embedding, MTP projections)
        saw only this TP rank's slice of the sequence, so their gradients are summed over TP (one
        all-reduce); TP-sharded (DTensor) parameters already have their full gradients."""
        grads = [p.grad for p in self.raw.parameters() if p.grad is not None and not hasattr(p.grad, "to_local")]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.mesh.get_group("tp"))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _optimizer_step(self, grad_norm: float, extra_logs: dict[str, float], t0: float) -> dict[str, Any]:
        """Step 5 of :meth:`train_step`: learning rate, optimizer step, the logging collective, the log line."""
        cfg = self.cfg
        lr = _lr_at(cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        logs = self.acc.logs()
        elapsed = time.perf_counter() - t0
        self.step += 1
        return {"step": self.step, **logs, **extra_logs, "grad_norm": grad_norm, "lr": lr,
                "tokens_per_s": cfg.global_batch * cfg.seq_len / elapsed, "step_time_s": elapsed}

    def _finish_pipeline_step(self, mbs: list[Batch], segs: tuple, valids: tuple, t0: float) -> dict[str, Any]:
        """Steps 2-5 of :meth:`train_step` through the pipeline schedule (see ``training/pipeline.py``)."""
        cfg, acc, pipe = self.cfg, self.acc, self.pipeline
        assert pipe is not None
        pipe.run(mbs, list(segs), list(valids))
        pipe.reduce_grads()
        acc.finish_step(list(pipe.params.values()))
        pipe.end_step_moe(self.bias_rate(self.step), cfg.bias_zero_mean)
        return self._optimizer_step(pipe.grad_norm_and_clip(cfg.grad_clip), {}, t0)

    def _indexer_share(self, indexer: tuple[Tensor, Tensor], valid: Tensor) -> Tensor:
        """DeepSeek-V3.2 indexer loss in its invariant form ``c·Σ_t KL_t / Tq_global`` (semantics §5), ``Tq`` =
        the step's non-padding query tokens; logged as the global mean of ``KL_t``."""
        probs, logits = indexer
        kl = indexer_kl(probs, logits, valid)
        tq = max(self.acc.global_count(ROUTER_TOKENS), 1.0)
        share = self.cfg.indexer_coeff * kl / tq
        self.acc.record("indexer_loss", kl.detach(), float(valid.sum()))
        self.acc.add_objective(share.detach())
        return share

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything an exact resume needs: model (with expert biases), optimizer, MoE accounting state,
        step (the data position: batches are a function of the step), RNG states and the config."""
        return {"step": self.step, "model": self.raw.state_dict(), "optimizer": self.optimizer.state_dict(),
                "moe": self.moe.state_dict(), "rng": rng_state(), "config": dataclasses.asdict(self.cfg),
                "mtp_weight": self.acc.mtp_weight}

    @property
    def sharded(self) -> bool:
        """Parameters are DTensor shards (FSDP2 or tensor parallel): checkpoints go through DCP."""
        return self.world > 1 and (self.cfg.engine == "fsdp" or self.cfg.tp > 1)

    def _extra_state(self) -> dict[str, Any]:
        return {"step": self.step, "moe": self.moe.state_dict(), "rng": rng_state(),
                "config": dataclasses.asdict(self.cfg)}

    def save(self, ckpt_dir: str) -> None:
        """Write the checkpoint of the current step (one file on rank 0, or a DCP folder when sharded)."""
        if self.sharded:
            save_sharded_checkpoint(ckpt_dir, self.step, self.raw, self.optimizer, self._extra_state())
            return
        if self.rank == 0:
            save_checkpoint(ckpt_dir, self.step, self.state_dict())
        if dist.is_initialized():
            dist.barrier()

    def restore(self, ckpt_dir: str) -> bool:
        """Load the newest checkpoint of ``ckpt_dir`` if there is one; returns whether it did."""
        if self.sharded:
            extra = load_sharded_latest(ckpt_dir, self.raw, self.optimizer)
            if extra is None:
                return False
            self.moe.load_state_dict(extra["moe"])
            set_rng_state(extra["rng"])
            self.step = int(extra["step"])
            return True
        state = load_latest(ckpt_dir)
        if state is None:
            return False
        self.load_state_dict(state)
        return True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.raw.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.moe.load_state_dict(state["moe"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])

    # ------------------------------------------------------------------ loop
    def fit(self, steps: int | None = None, crash_after: int | None = None) -> list[dict[str, Any]]:
        """Train until ``steps`` (default ``cfg.steps``) optimizer steps are done; logs, checkpoints and
        resumes as configured. ``crash_after`` (tests) raises after that many steps of this call."""
        cfg = self.cfg
        total = cfg.steps if steps is None else steps
        out = cfg.out if self.rank == 0 else None
        ckpt_dir = os.path.join(cfg.out, "checkpoints") if cfg.out else None
        if cfg.resume and ckpt_dir:
            self.restore(ckpt_dir)
        writer = _open_logs(out, self.step, cfg.tensorboard) if out else None
        if cfg.dump_samples and cfg.out:
            from ..parity.sample_dump import DUMP_SUBDIR, SampleDumpWriter

            meta = {"global_batch": cfg.global_batch, "microbatch_size": cfg.microbatch_size, "seq_len": cfg.seq_len,
                    "mode": cfg.mode, "fixed_length": cfg.fixed_length, "world_size": self.world}
            self.dump = SampleDumpWriter(os.path.join(cfg.out, DUMP_SUBDIR), self.rank, meta=meta,
                                         resume_step=self.step if self.step else None)
        interval = IntervalMean()
        done = 0
        try:
            while self.step < total:
                line = self.train_step()
                self.history.append(line)
                interval.update(line)
                if writer:
                    writer.write(line)
                if self.step % cfg.log_interval == 0 or self.step == total:
                    if self.rank == 0 and cfg.progress:
                        _progress(self.step, total, interval.compute())
                    interval.reset()
                if ckpt_dir and cfg.ckpt_interval and (self.step % cfg.ckpt_interval == 0 or self.step == total):
                    self.save(ckpt_dir)
                done += 1
                if crash_after is not None and done >= crash_after:
                    raise KeyboardInterrupt(f"simulated crash after step {self.step}")
        finally:
            if writer:
                writer.close()
            if self.dump is not None:
                self.dump.close()
                self.dump = None
            if self.rank == 0 and cfg.progress and sys.stdout.isatty():
                print()
        return self.history


class _LogWriter:
    """``metrics.jsonl`` (one line per step, the schema is the README's) and TensorBoard scalars."""

    def __init__(self, out: str, start_step: int, tensorboard: bool) -> None:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "metrics.jsonl")
        kept = []
        if start_step and os.path.exists(path):
            # Resume: drop lines of steps after the checkpoint (they will be recomputed identically).
            with open(path) as f:
                kept = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= start_step]
        self.f = open(path, "w")  # noqa: SIM115 - closed in close()
        self.f.writelines(kept)
        self.f.flush()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(out, "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.tb = None

    def write(self, line: dict[str, Any]) -> None:
        self.f.write(json.dumps(line, sort_keys=False) + "\n")
        self.f.flush()
        if self.tb:
            for k, v in line.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, line["step"])

    def close(self) -> None:
        self.f.close()
        if self.tb:
            self.tb.close()


def _open_logs(out: str, start_step: int, tensorboard: bool) -> _LogWriter:
    return _LogWriter(out, start_step, tensorboard)


def _progress(step: int, total: int, means: dict[str, float]) -> None:
    width = 24
    filled = int(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    loss = means.get("lm_loss")
    text = (f"[{bar}] step {step}/{total}  lm_loss {loss:.4f}" if loss is not None else
            f"[{bar}] step {step}/{total}")
    text += f"  objective {means.get('objective', float('nan')):.4f}  tok/s {means.get('tokens_per_s', 0):.0f}"
    if sys.stdout.isatty():
        print("\r" + text, end="", flush=True)
    else:
        print(text, flush=True)


def _train_entry(rank: int, world: int, cfg: TrainConfig) -> list[dict[str, Any]]:
    return Trainer(cfg).fit()


def run_training(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Run ``cfg``: under ``torchrun`` (``WORLD_SIZE`` set) on the existing ranks, else on ``cfg.dp`` local
    ranks started here (gloo on CPU). Returns rank 0's per-step log lines."""
    from ..distributed.launch import init_from_env, spawn

    cfg.validate()
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        init_from_env()
        try:
            return Trainer(cfg).fit()
        finally:
            dist.destroy_process_group()
    world = cfg.dp * cfg.cp * cfg.pp * cfg.tp
    if world == 1:
        return Trainer(cfg).fit()
    return spawn(_train_entry, world, cfg)[0]
