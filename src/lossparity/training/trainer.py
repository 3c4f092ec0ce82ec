"""Reference trainer: the small MoE+MTP GPT trained with every loss term going through the accountant.

One optimizer step (``train_step``) of data-parallel rank ``d``:

1. the global batch of the step (a pure function of the seed and the step) is cut into this rank's
   ``K`` microbatches of ``b`` rows (:func:`split_batch`);
2. ``acc.begin_step`` pre-counts ``Ntok, N, Ndoc, D·K``, the MTP depths' counts, the routers'
   non-padding tokens and (``per_group``) every prompt group's rows and tokens in one all-reduce;
3. per microbatch: forward (optionally with activation recompute), chunked cross-entropy of the main
   head and of every MTP depth, MoE auxiliary shares, one ``backward`` of the sum of the shares;
4. ``acc.finish_step`` (gradient scaling), MoE end of step (expert-bias update from the step's global
   dispatch counts, every step), gradient clipping, AdamW;
5. ``acc.logs()``: every logged scalar in one collective.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..checkpoint.checkpointer import Checkpointer
from ..distributed.accountant import Accountant
from ..distributed.moe.accounting import MoEAccounting
from ..distributed.parallel_dims import ParallelDims
from ..losses.cross_entropy import check_label_values
from ..losses.logchannel import IntervalMean
from ..losses.mtp import roll_mtp
from ..losses.stats import sample_stats
from ..model import RouterRecord, get_config
from ..model.context_parallel import ContextParallel
from ..model.sequence_parallel import sp_shard
from ..notes import Notify, warn_note
from .build import build_corpus, build_model, build_moe_accounting, build_optimizer, wrap_engine
from .config import TrainConfig
from .data import IGNORE_INDEX, Batch, global_batch, split_batch
from .forward import LossForward, head_loss_fn, head_weights, indexer_share, microbatch_share, run_dtypes
from .grads import clip_grad_norm, sum_replicated_grads_over_tp
from .parity_stop import make_guard, parity_check
from .pipeline import PipelineRunner
from .rundir import extended_config, prepare_run_dir
from .runlog import MetricsLog

if TYPE_CHECKING:
    from ..parity.sample_dump import SampleDumpWriter

__all__ = ["TrainConfig", "Trainer", "build_corpus", "run_training", "parallel_dims", "LossForward", "head_loss_fn"]


def parallel_dims(cfg: TrainConfig) -> ParallelDims:
    """The layout of ``cfg`` as a (not yet built) :class:`ParallelDims`."""
    return cfg.parallel_dims()


def _valid_tokens(mb: Batch) -> tuple[Tensor, Tensor]:
    """``(segment_ids, valid)``: packed rows keep their ids; a padded row is one document (id 1) over
    its non-padding positions (position 0 and every position > 0 of the document)."""
    if mb.segment_ids is not None:
        return mb.segment_ids, mb.segment_ids > 0
    S = mb.tokens.shape[1]
    valid = (mb.positions > 0) | (torch.arange(S, device=mb.tokens.device) == 0)
    return valid.long(), valid


def group_arguments(cfg: TrainConfig, dp_rank: int, k: int, device: torch.device) -> dict[str, Any]:
    """``per_group``'s arguments of ``begin_step`` on data-parallel rank ``dp_rank`` with ``k`` microbatches:
    row ``r`` of the global batch is in group ``r // G`` (``G = group_size``, GRPO's completions of one prompt
    side by side), so microbatch ``i`` (rows ``(d·K + i)·b ...``, the layout convention of ``split_batch``)
    gets ids ``row // G``, and there are ``ceil(N / G)`` groups; no arguments for the other modes."""
    if cfg.mode != "per_group":
        return {}
    assert cfg.group_size is not None  # TrainConfig.validate
    b = cfg.microbatch_size
    first = dp_rank * k * b
    rows = [torch.arange(first + i * b, first + (i + 1) * b) for i in range(k)]
    return {
        "group_ids": [(r // cfg.group_size).to(device) for r in rows],
        "num_groups": -(-cfg.global_batch // cfg.group_size),
    }


def _lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of the step of index ``step`` (0-based): linear warm-up over ``warmup`` steps, then cosine
    from ``lr`` to ``min_lr`` over ``E - warmup`` steps, ``min_lr`` from index ``E`` on, where ``E`` =
    ``decay_steps`` (default ``steps``; an extended run keeps its saved ``E``: training/extend.py)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    end = cfg.steps if cfg.decay_steps is None else cfg.decay_steps
    span = max(end - cfg.warmup, 1)
    t = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


def _pick_device(cfg: TrainConfig) -> torch.device:
    """NCCL ranks use their current GPU; a single process uses ``cfg.device``; everything else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    """A reference training run on this process (rank ``dist.get_rank()`` when distributed)."""

    def __init__(self, cfg: TrainConfig, dims: ParallelDims | None = None, notify: Notify | None = None) -> None:
        """Build the run of ``cfg`` on this rank: the layout (``dims``, default from ``cfg``; its mesh is
        built here on every rank), the model sharded by it, the gradient engine, the accountant, the MoE
        accounting (one per pipeline chunk under PP), the pipeline schedule, the optimizer and the
        checkpointer. ``notify``: where rank 0's operational notes go (a checkpoint skipped on resume,
        metrics lines dropped); default a ``UserWarning``."""
        # the device is this process's (its GPU under NCCL, else cfg.device's kind), not part of the run's record
        device = _pick_device(cfg)
        cfg = cfg.resolved()  # validated copy with the derived values (the caller's config is not changed)
        cfg, extension_note = extended_config(cfg)  # --resume with more steps: the saved schedule is kept
        self.cfg = cfg
        self.model_config = get_config(cfg.model, **dict(cfg.model_overrides))
        self.dims = cfg.parallel_dims(dims)  # from cfg, or the caller's own checked against it
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device
        self.dims.build_mesh(self.device.type)
        self.dp_rank = self.dims.dp_rank
        self.cp_ctx = (
            ContextParallel(self.dims.cp_group, self.dims.cp, self.dims.cp_rank, cfg.cp_zigzag)
            if self.dims.cp > 1
            else None
        )
        self.raw, self.expert_params = build_model(cfg, self.model_config, self.dims, self.device, self.cp_ctx)
        self.model = wrap_engine(self.raw, LossForward(self.raw), self.dims, self.world)
        self.corpus = build_corpus(cfg, self.model_config.vocab_size)
        self.acc = Accountant(
            cfg.mode,
            normalization=cfg.normalization,
            fixed_length=cfg.fixed_length,
            mtp_depths=self.model_config.mtp_depths,
            mtp_convention=cfg.mtp_convention,
            device=self.device,
            mtp_log_estimator=cfg.mtp_log_estimator,
            dims=self.dims,
        )
        self.routers = self.raw.moe_routers()
        moe_accounting = functools.partial(build_moe_accounting, cfg, self.model_config, self.acc)
        if self.model_config.indexer_layer is not None:
            self.acc.declare_metric("indexer_loss", "ratio", per_rank=self.dims.sp)
        self.pipeline = (
            PipelineRunner(cfg, self.raw, self.acc, self.dims, self.device, moe_accounting)
            if self.dims.pp > 1
            else None
        )
        # Under pipeline parallelism every chunk has its own MoE accounting (see training/pipeline.py).
        self.moe = (
            moe_accounting(len(self.routers), log_layer_ids=[r.layer_id for r in self.routers])
            if self.pipeline is None
            else None
        )
        named = list(self.raw.named_parameters()) if self.pipeline is None else list(self.pipeline.params.items())
        self.optimizer = build_optimizer(cfg, named, self.dims)
        self.notify: Notify = (notify or warn_note) if self.rank == 0 else _quiet
        if extension_note:
            self.notify(extension_note)
        self.checkpointer = self._build_checkpointer()
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.dump: SampleDumpWriter | None = None  # per-sample (n_i, s_i) writer of `lossparity gap`, opened by fit()

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
        batch = global_batch(
            self.corpus,
            self.step,
            global_batch_size=cfg.global_batch,
            seq_len=cfg.seq_len,
            packed=cfg.packed,
            seed=cfg.seed,
        )
        # The step's value checks, once, on the host-side batch (before the transfer): the microbatch path
        # (model, cross-entropy) then reads nothing back from the device.
        self.raw.check_values(batch.tokens, batch.segment_ids, batch.positions)
        check_label_values(batch.labels, self.model_config.vocab_size, IGNORE_INDEX)
        batch = batch.to(self.device)
        mbs = split_batch(batch, self.dims.dp, self.dp_rank, cfg.ga, cfg.microbatch_size)
        cols = None if self.cp_ctx is None else self.cp_ctx.columns(cfg.seq_len).to(self.device)
        segs, valids = zip(*(_valid_tokens(mb) for mb in mbs))
        acc.begin_step(
            [mb.mask for mb in mbs],
            list(segs),
            mtp_weight=self.mtp_weight(self.step),
            extra_counts=MoEAccounting.router_tokens(valids),
            **group_arguments(cfg, self.dp_rank, len(mbs), self.device),
        )
        if self.pipeline is not None:
            return self._finish_pipeline_step(mbs, segs, valids, t0)
        for i, (mb, seg, valid) in enumerate(zip(mbs, segs, valids)):
            last = i == len(mbs) - 1
            sync = (
                model.no_sync()
                if isinstance(model, nn.parallel.DistributedDataParallel) and not last
                else contextlib.nullcontext()
            )
            if self.dims.grad_engine == "fsdp" and self.world > 1:
                # an FSDPModule method: reduce-scatter once, after the last microbatch
                cast(Any, model).set_requires_gradient_sync(last)
            with sync:
                self._microbatch(i, mb, seg, valid, cols).backward()
        if self.dims.sp:
            sum_replicated_grads_over_tp(list(self.raw.parameters()), self.dims.tp_group)
        acc.finish_step(model, expert_params=self.expert_params)
        # max_vio reaches the log line through acc.logs(), as under pipelining (one route).
        assert self.moe is not None  # without pipelining there is one MoE accounting
        self.moe.end_step(self.routers, bias_rate=self.bias_rate(self.step), zero_mean=cfg.bias_zero_mean)
        grad_norm = clip_grad_norm(list(self.raw.parameters()), cfg.grad_clip)
        return self._optimizer_step(grad_norm, {}, t0)

    def _microbatch(self, i: int, mb: Batch, seg: Tensor, valid: Tensor, cols: Tensor | None) -> Tensor:
        """Forward of microbatch ``i`` and its exact share of ``J`` (main loss, MTP depths, MoE terms, indexer),
        accounted by the accountant. With the fused head, the per-token weights are taken from the
        accountant before the forward and the share carries the gradients formed in the forward."""
        cfg, acc = self.cfg, self.acc
        rolled = [roll_mtp(mb.labels, mb.mask, seg, k) for k in range(1, self.model_config.mtp_depths + 1)]
        if cols is not None:  # context parallelism: this rank's columns of the whole rows
            mask_c, seg_c, valid_c = mb.mask[:, cols], seg[:, cols], valid[:, cols]
            masks_k = [r[1][:, cols] for r in rolled]
        else:
            mask_c, seg_c, valid_c, masks_k = mb.mask, seg, valid, [r[1] for r in rolled]
        dtypes = run_dtypes(cfg.dtype)
        weights = head_weights(acc, cfg.loss_impl, dtypes.loss, mask_c, seg_c, masks_k, cols)
        per_tok, mtp_losses, routers, indexer, shares = self.model(
            mb.tokens,
            mb.labels,
            [r[0] for r in rolled],
            seg,
            mb.positions,
            cfg.recompute,
            dtypes.autocast,
            weights,
        )
        if self.dims.sp:  # routers saw this TP rank's slice of the sequence (losses are whole rows)
            valid_c = sp_shard(valid_c, self.dims.submesh("tp"))
        loss = microbatch_share(acc, (per_tok, mtp_losses, shares), mask_c, seg_c, masks_k, cols)
        if self.dump is not None:
            s_i, n_i = sample_stats(per_tok.detach(), mask_c)
            first = (self.dp_rank * cfg.ga + i) * cfg.microbatch_size
            self.dump.write(self.step + 1, torch.arange(first, first + len(n_i)), n_i, s_i)
        if self.routers and self.moe is not None:
            records = [RouterRecord(r.layer_id, *t) for r, t in zip(self.routers, routers)]
            loss = loss + self.moe.microbatch_loss(records, valid_c, seg_c)
        if indexer is not None:
            loss = loss + indexer_share(acc, cfg.indexer_coeff, indexer, valid_c, per_rank=self.dims.sp)
        return loss

    def _optimizer_step(self, grad_norm: float, extra_logs: dict[str, float], t0: float) -> dict[str, Any]:
        """Step 5 of :meth:`train_step`: the logging collective, learning rate, optimizer step, the log line.
        The logs come first: the value checks the accountant deferred to its one collective (NaN losses,
        masks that differ from the counted ones) raise on every rank before any parameter changes."""
        cfg = self.cfg
        logs = self.acc.logs()
        if not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"step {self.step + 1} (rank {self.rank}): the gradient norm is {grad_norm}; the optimizer step was "
                "not taken: a term of this step's objective or its gradient is not finite (the losses, weights and "
                "coefficients of the step were checked; look for an overflow, e.g. lower --lr or use float32)"
            )
        lr = _lr_at(cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        self.step += 1
        return {
            "step": self.step,
            **logs,
            **extra_logs,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": cfg.global_batch * cfg.seq_len / elapsed,
            "step_time_s": elapsed,
        }

    def _finish_pipeline_step(self, mbs: list[Batch], segs: tuple, valids: tuple, t0: float) -> dict[str, Any]:
        """Steps 2-5 of :meth:`train_step` through the pipeline schedule (see ``training/pipeline.py``)."""
        cfg, acc, pipe = self.cfg, self.acc, self.pipeline
        assert pipe is not None
        pipe.run(mbs, list(segs), list(valids))
        pipe.reduce_grads()
        if self.dims.sp:
            sum_replicated_grads_over_tp(list(pipe.params.values()), self.dims.tp_group)
        experts = {id(p) for p in self.expert_params}
        acc.finish_step(
            [p for p in pipe.params.values() if id(p) not in experts],
            expert_params=[p for p in pipe.params.values() if id(p) in experts],
        )
        pipe.end_step_moe(self.bias_rate(self.step), cfg.bias_zero_mean)
        return self._optimizer_step(pipe.grad_norm_and_clip(cfg.grad_clip), {}, t0)

    # ------------------------------------------------------------------ state (checkpoint/checkpointer.py)
    def _build_checkpointer(self) -> Checkpointer:
        return Checkpointer(
            self.raw,
            self.optimizer,
            self._moe_instances(),
            self.cfg,
            world=self.world,
            owned=self._owned_names(),
            notify=self.notify,
        )

    def _moe_instances(self) -> list[tuple[MoEAccounting, list[Any]]]:
        if self.pipeline is not None:
            return list(self.pipeline.moes)
        assert self.moe is not None
        return [(self.moe, self.routers)]

    def _owned_names(self) -> set[str] | None:
        """FQNs of the parameters and buffers this pipeline rank owns (``None`` without PP: all)."""
        if self.pipeline is None:
            return None
        ids = {id(t) for m in self.pipeline.stages for t in [*m.parameters(), *m.buffers()]}
        named = [*self.raw.named_parameters(), *self.raw.named_buffers()]
        return {n for n, t in named if id(t) in ids}

    @property
    def sharded(self) -> bool:
        """Multi-rank runs checkpoint through DCP, in the layout-independent form of
        :meth:`distributed_state` (any layout can resume from any other)."""
        return self.checkpointer.sharded

    def state_dict(self) -> dict[str, Any]:
        """The single-process checkpoint (``Checkpointer.state_dict``: tensors and plain values only)."""
        return self.checkpointer.state_dict(self.step, self.acc.mtp_weight)

    def distributed_state(self) -> dict[str, Any]:
        """This rank's layout-independent checkpoint state (``Checkpointer.distributed_state``)."""
        return self.checkpointer.distributed_state()

    def save(self, ckpt_dir: str) -> None:
        """Write the checkpoint of the current step (one file in a single process, else a DCP folder)."""
        self.checkpointer.save(ckpt_dir, self.step, self.acc.mtp_weight)

    def restore(self, ckpt_dir: str) -> bool:
        """Load the newest intact checkpoint of ``ckpt_dir`` if there is one (invalid ones are skipped with
        a note through ``notify``); returns whether it did."""
        step = self.checkpointer.restore(ckpt_dir)
        if step is not None:
            self.step = step
            if self.rank == 0 and self.cfg.progress:  # which one, after any fallback notes above it
                print(f"resumed from {self.checkpointer.loaded_path} (step {step})", flush=True)
        return step is not None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (validated against the model first)."""
        self.step = self.checkpointer.load_state_dict(state)

    # ------------------------------------------------------------------ loop
    def _sync_run_logs(self, writer: MetricsLog | None) -> None:
        """Before a checkpoint of step ``s``: the metrics lines and sample records of steps ``<= s`` are made
        durable on every rank first, so that a resume from it never finds them missing."""
        if writer is not None:
            writer.sync()
        if self.dump is not None:
            self.dump.sync()
            if self.world > 1:
                dist.barrier()

    def _save_now(self, writer: MetricsLog | None, ckpt_dir: str | None) -> str | None:
        """The checkpoint of the current step (after its metrics are durable); its folder, or ``None``."""
        if not ckpt_dir:
            return None
        self._sync_run_logs(writer)
        self.save(ckpt_dir)
        return ckpt_dir

    def fit(self, steps: int | None = None, crash_after: int | None = None) -> list[dict[str, Any]]:
        """Train until ``steps`` (default ``cfg.steps``) optimizer steps are done; logs, checkpoints and
        resumes as configured. ``crash_after`` (tests) raises after that many steps of this call."""
        cfg = self.cfg
        total = cfg.steps if steps is None else steps
        out = cfg.out if self.rank == 0 else None
        ckpt_dir = os.path.join(cfg.out, "checkpoints") if cfg.out else None
        if not getattr(self, "_run_dir_ready", False):  # the run-folder contract, once per Trainer
            prepare_run_dir(cfg, self.rank, dist.barrier if self.world > 1 else None, self.notify)
            self._run_dir_ready = True
        if cfg.resume and ckpt_dir:
            self.restore(ckpt_dir)
        writer = MetricsLog(out, self.step, cfg.tensorboard, self.notify) if out else None
        if cfg.dump_samples and cfg.out:
            from ..parity.sample_dump import DUMP_SUBDIR, SampleDumpWriter

            meta = {
                "global_batch": cfg.global_batch,
                "microbatch_size": cfg.microbatch_size,
                "seq_len": cfg.seq_len,
                "mode": cfg.mode,
                "fixed_length": cfg.fixed_length,
                "world_size": self.world,
            }
            self.dump = SampleDumpWriter(
                os.path.join(cfg.out, DUMP_SUBDIR),
                self.rank,
                meta=meta,
                resume_step=self.step if self.step else None,
                notify=self.notify,
            )
        interval = IntervalMean()
        done = 0
        guard = make_guard(cfg, self.rank)  # --reference: the live parity guard (training/parity_stop.py)
        try:
            while self.step < total:
                line = self.train_step()
                if self.dump is not None:
                    self.dump.flush()  # a killed process loses no record of a finished step
                self.history.append(line)
                interval.update(line)
                if writer:
                    writer.write(line)
                if guard is not None:
                    parity_check(guard, line, self.rank, lambda: self._save_now(writer, ckpt_dir))
                if self.step % cfg.log_interval == 0 or self.step == total:
                    if self.rank == 0 and cfg.progress:
                        _progress(self.step, total, interval.compute())
                    interval.reset()
                if ckpt_dir and cfg.ckpt_interval and (self.step % cfg.ckpt_interval == 0 or self.step == total):
                    self._sync_run_logs(writer)
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


def _progress(step: int, total: int, means: dict[str, float]) -> None:
    width = 24
    filled = int(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    loss = means.get("lm_loss")
    text = f"[{bar}] step {step}/{total}  lm_loss {loss:.4f}" if loss is not None else f"[{bar}] step {step}/{total}"
    text += f"  objective {means.get('objective', float('nan')):.4f}{objective_parts(means)}"
    text += f"  tok/s {means.get('tokens_per_s', 0):.0f}"
    if sys.stdout.isatty():
        print("\r" + text, end="", flush=True)
    else:
        print(text, flush=True)


def objective_parts(logs: dict[str, float]) -> str:
    """`` = lm 5.5496 + 0.3·mtp 5.5211 + aux+z 0.0238``: the parts of the objective the accountant logs
    (``objective_lm``, ``mtp_weight·objective_mtp``, ``objective_aux``), or ``""`` when it logs none (the
    objective is then the LM loss itself)."""
    if "objective_lm" not in logs:
        return ""
    text = f" = lm {logs['objective_lm']:.4f}"
    if "objective_mtp" in logs:
        text += f" + {logs.get('mtp_weight', float('nan')):g}·mtp {logs['objective_mtp']:.4f}"
    if logs.get("objective_aux"):
        # which added terms there are: MoE load balancing, router z-loss, DeepSeek indexer
        kinds = [
            k
            for k, present in (
                ("aux", any("load_balancing_loss" in n for n in logs)),
                ("z", "z_loss" in logs),
                ("indexer", "indexer_loss" in logs),
            )
            if present
        ]
        text += f" + {'+'.join(kinds) or 'aux'} {logs['objective_aux']:.4f}"
    return text


def _quiet(text: str) -> None:
    """The ``notify`` of ranks other than 0 (rank 0 reports the run's notes once)."""


def _train_entry(rank: int, world: int, cfg: TrainConfig, notify: Notify | None = None) -> list[dict[str, Any]]:
    return Trainer(cfg, notify=notify).fit()


def run_training(cfg: TrainConfig, notify: Notify | None = None) -> list[dict[str, Any]]:
    """Run ``cfg``: under ``torchrun`` (``WORLD_SIZE`` set) on the existing ranks, else on the layout's
    ``dp·cp·tp·pp`` local ranks started here (gloo on CPU). Returns rank 0's per-step log lines.
    ``notify``: where the run's operational notes go (default a ``UserWarning``; it must be a module-level
    function when ranks are started here, since it travels to them)."""
    from ..distributed.launch import init_from_env, spawn

    cfg = cfg.resolved()
    world = cfg.parallel_dims().world_size
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        init_from_env()
        try:
            return Trainer(cfg, notify=notify).fit()
        finally:
            dist.destroy_process_group()
    if world == 1:
        return Trainer(cfg, notify=notify).fit()
    return spawn(_train_entry, world, cfg, notify)[0]
