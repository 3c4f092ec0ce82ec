"""torchtitan integration: a loss with torchtitan's signature and a step hook that pre-counts its normalizer.

torchtitan's ``Trainer.train_step`` fetches the step's ``gradient_accumulation_steps ×
pipeline microbatches`` batches first, counts ``global_valid_tokens`` (labels ≠ -100, summed over the
``batch`` mesh) and calls ``loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)`` for every
microbatch; the loss is the local sum divided by that count and FSDP *sums* gradients (its divide factor
is set to 1). That is per_token with pre-counted normalizers (docs/semantics.md §3). The other modes need
their own global count (``N``, ``Ndoc``, ``D·K``) before the first forward:

- :class:`LossParityLoss` ``(pred, labels, global_valid_tokens=None, positions=None) -> (loss, {})``
  returns ``numerator(mb) / global count`` of its mode (per_token keeps torchtitan's own
  ``global_valid_tokens``);
- :meth:`LossParityLoss.precount` is the step hook: the counts of every microbatch of the step,
  summed over the ``batch`` mesh in one all-reduce, kept on the device (no host sync);
- :class:`LossParityTitanMixin` calls it from ``train_step``: ``class T(LossParityTitanMixin, Trainer)``
  with ``trainer.loss_fn = LossParityLoss("per_sample")``.

``per_document`` reads the documents of packed rows from torchtitan's ``positions`` (per-document
positions restarting at 0, passed to the loss when the dataloader provides them). MoE models: the
router terms and expert biases of :mod:`lossparity.integrations.titan_moe` (``trainer.moe_terms``), with
data and pipeline parallelism (under PP the stages' metadata-inference forward runs inside
``TitanMoETerms.paused()`` and the logs are summed over the ``pp`` mesh; ``objective`` is logged on the last
stage, where torchtitan's loss is). Not supported: pipeline parallelism with per_document or MTP
(torchtitan's schedule passes no ``positions`` to the loss), MTP with context parallelism (torchtitan's
DeepSeek-V3 refuses it itself), ``moe_terms`` with tensor, expert or context parallelism.

Loss parallel (tensor parallelism with the logits sharded on the vocabulary, a DTensor ``pred``): the
per-token losses come from a vocab-parallel cross-entropy on the local shards (three all-reduces over the
``tp`` group, in the logits' dtype), then the mode's numerator as for plain logits; every TP rank returns
the same share.

Context parallelism (every mode): the numerators of the unit modes need whole rows (a row's or a document's
token count), which a CP rank does not hold. :meth:`LossParityTitanMixin.post_dataloading_process` lets
torchtitan shard a position index with its own sharding (any load balancer), then hands the loss this
shard's part of the whole-row coefficients ``c`` (``numerator = Σ_t c_t·s_t``, linear in the per-token
losses ``s``); each CP rank's share is ``Σ_{t in shard} c_t·s_t / G`` and the shares add up to the whole
rows' numerator. The denominators are pre-counted on whole rows over the ``batch`` mesh, before sharding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..losses.mtp import roll_mask, roll_mtp
from ..options import MODES, Mode, check_option
from . import require
from ._common import mode_coefficients, mode_numerator, unit_count

__all__ = ["IGNORE_INDEX", "LossParityLoss", "LossParityTitanMixin", "segments_from_positions"]

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


def segments_from_positions(positions: Tensor) -> Tensor:
    """Document ids ``[b, S]`` of packed rows from per-document positions: each 0 opens a new document."""
    return (positions == 0).long().cumsum(-1)


def _group_of(group: Any) -> Any:
    """A ``ProcessGroup`` from a 1-D ``DeviceMesh`` (torchtitan's ``batch`` mesh), a group, or None."""
    if group is not None and hasattr(group, "get_group"):
        return group.get_group()
    return group


class _SumOverShards(torch.autograd.Function):
    """Sum over the ranks of ``group`` in the forward, identity in the backward: every rank of the group
    computes the same loss from the sum, so each shard's gradient is that loss's gradient as it stands."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _vocab_parallel_loss(local: Tensor, labels: Tensor, group: Any, vocab: int) -> Tensor:
    """Per-token cross-entropy ``lse(z) − z_y`` from this rank's vocabulary shard ``local [N, v]`` of the
    logits (torch.chunk's split of ``vocab`` over ``group``, as DTensor's ``Shard(-1)`` places it), in the
    logits' dtype: the max (no gradient: it cancels), ``Σ exp`` and the label's logit are summed over the
    shards. 0 at ignored labels."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-vocab // world)
    start, size = min(vocab, chunk * rank), local.shape[-1]
    with torch.no_grad():
        top = local.amax(dim=-1, keepdim=True)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = local - top
    sumexp = _SumOverShards.apply(shifted.exp().sum(dim=-1), group)
    safe = labels.clamp(min=0)
    mine = (safe >= start) & (safe < start + size)
    picked = shifted.gather(-1, (safe - start).clamp(0, max(size - 1, 0)).unsqueeze(-1)).squeeze(-1)
    picked = _SumOverShards.apply(torch.where(mine, picked, torch.zeros_like(picked)), group)
    loss = sumexp.log() - picked
    return torch.where(labels != IGNORE_INDEX, loss, torch.zeros_like(loss))


def _per_token_loss(pred: Tensor, labels: Tensor) -> Tensor:
    """Per-token cross-entropy ``[b, S]`` (0 at ignored labels), in float32 at least (as torchtitan; float64
    stays float64). Logits sharded on the vocabulary over a 1-D ``tp`` mesh (loss parallel: a DTensor with
    placements ``(Shard(-1),)``) go through :func:`_vocab_parallel_loss`: every TP rank gets the same
    per-token losses and the backward stays on its vocabulary shard (torchtitan's own vocab-parallel
    cross-entropy computes in float32, which a float64 run cannot match to 1e-10)."""
    if type(pred).__name__ == "DTensor":
        from torch.distributed.tensor import Shard

        dt: Any = pred
        if dt.device_mesh.ndim != 1 or tuple(dt.placements) != (Shard(pred.dim() - 1),):
            raise TypeError(
                f"pred: a DTensor with placements {tuple(dt.placements)}; LossParityLoss takes plain logits or "
                "logits sharded on the vocabulary over a 1-D tp mesh (loss parallel: placements (Shard(-1),))"
            )
        local = dt.to_local()
        local = local.float() if local.dtype in (torch.float16, torch.bfloat16) else local
        out = _vocab_parallel_loss(
            local.flatten(0, 1), labels.flatten(0, 1), dt.device_mesh.get_group(), pred.shape[-1]
        )
        return out.view(labels.shape)
    logits = pred.float() if pred.dtype in (torch.float16, torch.bfloat16) else pred
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX
    ).view(labels.shape)


class LossParityLoss:
    """torchtitan-compatible loss for any lossparity mode (module docstring).

    Args:
        mode: docs/semantics.md §1 mode (default ``per_sample``).
        fixed_length: the ``L`` of ``sample_sum_norm``.
        mtp_depths: ``Dm``, the multi-token-prediction depths of the model (torchtitan's DeepSeek-V3
            ``mtp_layers``; its forward then returns ``[main logits, depth 1, ..., depth Dm]``).
        mtp_weight: ``λ`` (torchtitan's ``MTPLoss.mtp_scale``).
        mtp_convention: ``own`` (each depth its own count) or ``main`` (the main loss's count, torchtitan's
            and the DeepSeek-V3 paper's): docs/semantics.md §4. With depths the objective is
            ``J = J_lm + λ/Dm · Σ_k J_k``, depth ``k``'s labels and mask rolled left by ``k`` inside each
            document of the row (the documents of ``positions``, as torchtitan's ``roll_mtp_sequence``).
    """

    def __init__(
        self,
        mode: Mode = "per_sample",
        *,
        fixed_length: int | None = None,
        mtp_depths: int = 0,
        mtp_weight: float = 0.3,
        mtp_convention: str = "own",
    ) -> None:
        require("torchtitan", "torchtitan")
        self.mode: Mode = check_option("mode", mode, MODES)
        if mode == "sample_sum_norm" and (fixed_length is None or fixed_length <= 0):
            raise ValueError(f"fixed_length: mode 'sample_sum_norm' needs fixed_length > 0, got {fixed_length}")
        if isinstance(mtp_depths, bool) or not isinstance(mtp_depths, int) or mtp_depths < 0:
            raise ValueError(f"mtp_depths: expected an int >= 0, got {mtp_depths!r}")
        if mtp_convention not in ("own", "main"):
            raise ValueError(f"mtp_convention: expected 'own' or 'main', got {mtp_convention!r}")
        if mtp_depths and (not isinstance(mtp_weight, (int, float)) or not 0 <= mtp_weight < float("inf")):
            raise ValueError(f"mtp_weight: expected a finite number >= 0, got {mtp_weight!r}")
        self.fixed_length = fixed_length
        self.mtp_depths, self.mtp_weight, self.mtp_convention = mtp_depths, float(mtp_weight), mtp_convention
        self.denominator: Tensor | None = None  # set by precount, once per step
        self.depth_denominators: Tensor | None = None  # [Dm], set by precount
        # context parallelism: this rank's shard of each coming microbatch's whole-row coefficients, in order
        self._shard_coefficients: deque[Tensor] = deque()

    def shard_coefficients(self, labels: Tensor, positions: Tensor | None, index: Tensor) -> None:
        """Context parallelism, once per microbatch before its forward: the whole-row coefficients ``c``
        of the mode (``numerator = Σ_t c_t·s_t``, e.g. ``w_t/max(n_i, 1)`` for per_sample; documents from the
        whole rows' ``positions``) taken at ``index`` (``[b, S/cp]``: which whole-row position each token of
        this rank's shard is, as torchtitan's CP sharding placed it). The next loss call uses them."""
        if self.mtp_depths:
            raise ValueError("mtp_depths: MTP with context parallelism is not supported (nor by torchtitan's model)")
        seg = None
        if self.mode == "per_document":
            if positions is None:
                raise ValueError("positions: mode 'per_document' needs per-document positions")
            seg = segments_from_positions(positions)
        mask = (labels != IGNORE_INDEX).to(torch.float64)
        coefficients = mode_coefficients(self.mode, mask, seg, self.fixed_length)
        self._shard_coefficients.append(coefficients.gather(1, index.to(coefficients.device)))

    def precount(
        self,
        labels: Sequence[Tensor],
        positions: Sequence[Tensor | None] | None = None,
        group: Any = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Step hook: ``max(Σ count, 1)`` over this rank's microbatches (their ``labels``, and ``positions``
        for per_document and MTP) and the data-parallel ``group`` (a ``DeviceMesh`` or process group), in
        one all-reduce, with the MTP depths' denominators. Kept on ``device`` as this step's denominators;
        the main one is returned."""
        if not labels:
            raise ValueError("labels: precount needs the labels of at least one microbatch")
        pos = list(positions) if positions is not None else [None] * len(labels)
        # [main count, depth-k tokens for k = 1..Dm]
        total = torch.zeros(1 + self.mtp_depths, dtype=torch.int64, device=device or labels[0].device)
        for i, lab in enumerate(labels):
            seg = None
            if self.mode == "per_document" or self.mtp_depths:
                p = pos[i]
                if p is None:
                    need = "mode 'per_document'" if self.mode == "per_document" else "MTP"
                    raise ValueError(f"positions: {need} needs per-document positions (microbatch {i})")
                seg = segments_from_positions(p)
            mask = lab != IGNORE_INDEX
            total[0] += unit_count(self.mode, mask, seg).to(total.device)
            for k in range(1, self.mtp_depths + 1):
                total[k] += (roll_mask(mask.long(), seg, k) != 0).sum().to(total.device)
        pg = _group_of(group)
        if pg is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pg)
        total = total.clamp(min=1)
        self.denominator = total[0]
        if self.mtp_depths:
            own = self.mode == "per_token" and self.mtp_convention == "own"
            self.depth_denominators = total[1:] if own else total[:1].expand(self.mtp_depths)
        return self.denominator

    def _numerator(self, pred: Tensor, labels: Tensor, seg: Tensor | None) -> Tensor:
        per_token = _per_token_loss(pred, labels)
        mask = (labels != IGNORE_INDEX).to(per_token.dtype)
        return mode_numerator(self.mode, per_token, mask, seg, self.fixed_length)[0]

    def __call__(
        self, pred: Tensor | list[Tensor], labels: Tensor, global_valid_tokens: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(numerator(mb) / global count [+ λ/Dm·Σ_k numerator_k(mb) / count_k], {})``: this microbatch's
        exact share of ``J``."""
        preds = list(pred) if isinstance(pred, (list, tuple)) else [pred]
        if len(preds) != 1 + self.mtp_depths:
            raise ValueError(
                f"pred: {len(preds)} logits tensors for mtp_depths={self.mtp_depths} (expected the main logits and "
                "one per MTP depth: set LossParityLoss(mtp_depths=...) to the model's MTP layers)"
            )
        if self._shard_coefficients:  # context parallelism: this shard's part of the whole rows' numerator
            return self._shard_share(preds[0], labels), {}
        positions = kwargs.get("positions")
        if (self.mode == "per_document" or self.mtp_depths) and positions is None:
            raise ValueError("positions: mode 'per_document' and MTP need torchtitan's per-document positions")
        seg = segments_from_positions(positions) if positions is not None else None
        num = self._numerator(preds[0], labels, seg if self.mode == "per_document" else None)
        if self.mode == "per_token" and global_valid_tokens is not None and not self.mtp_depths:
            return num / global_valid_tokens, {}
        if self.denominator is None:
            raise RuntimeError(
                f"LossParityLoss({self.mode!r}) called before precount: call it from the step hook "
                "(LossParityTitanMixin.train_step) before the first forward of every step"
            )
        share = num / self.denominator.to(num.device)
        if self.mtp_depths:
            assert self.depth_denominators is not None and seg is not None  # set by precount / checked above
            dens = self.depth_denominators.to(num.device)
            mask = (labels != IGNORE_INDEX).long()
            for k in range(1, self.mtp_depths + 1):
                lab_k, _ = roll_mtp(labels, mask, seg, k, ignore_index=IGNORE_INDEX)
                num_k = self._numerator(preds[k], lab_k, seg if self.mode == "per_document" else None)
                share = share + num_k * (self.mtp_weight / self.mtp_depths) / dens[k - 1]
        return share, {}

    def _shard_share(self, pred: Tensor, labels: Tensor) -> Tensor:
        coefficients = self._shard_coefficients.popleft()
        if coefficients.shape != labels.shape:
            raise ValueError(
                f"labels: shape {tuple(labels.shape)} of a context-parallel shard, but the coefficients queued for "
                f"this microbatch have shape {tuple(coefficients.shape)}"
            )
        if self.denominator is None:
            raise RuntimeError(f"LossParityLoss({self.mode!r}) called before precount")
        per_token = _per_token_loss(pred, labels)
        num = (per_token * coefficients.to(device=per_token.device, dtype=per_token.dtype)).sum()
        return num / self.denominator.to(num.device)


def _pause_metadata_inference(schedule: Any, terms: Any) -> None:
    """Run the tensor-metadata inference of ``schedule``'s stages inside ``terms.paused()``: at its first
    step a torch pipeline stage runs one extra forward and backward (its first microbatch on stage 0,
    uninitialized tensors of the received shapes on the others) that is no part of the objective. Wraps
    each stage's ``_prepare_forward_infra`` / ``_prepare_backward_infra`` once (torch 2.13's names)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        if getattr(stage, "_lossparity_paused", False):
            continue
        names = ("_prepare_forward_infra", "_prepare_backward_infra")
        if stage is None or not all(callable(getattr(stage, n, None)) for n in names):
            raise ValueError(
                f"moe_terms: pipeline stage {stage!r} has no {names}; TitanMoETerms needs them to leave the "
                "stage's metadata-inference forward out of the objective (torch 2.13's PipelineStage has them)"
            )
        for name in names:
            setattr(stage, name, _paused_call(getattr(stage, name), terms))
        stage._lossparity_paused = True


def _paused_call(fn: Any, terms: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with terms.paused():
            return fn(*args, **kwargs)

    return call


class LossParityTitanMixin:
    """Mix first into torchtitan's ``Trainer``: ``train_step`` fetches the step's microbatches, pre-counts
    the loss's normalizer over the ``batch`` mesh (:meth:`LossParityLoss.precount`), then runs torchtitan's
    own ``train_step`` on the same batches. ``self.loss_fn`` must be a :class:`LossParityLoss`.

    MoE models: with ``self.moe_terms`` a :class:`~lossparity.integrations.titan_moe.TitanMoETerms`, the
    step also begins and ends its router terms, and torchtitan's metrics log of a logging step carries
    their logs (``extra_metrics``, lossparity's names) and ``objective`` = torchtitan's ``loss`` (``J_lm``)
    + the router terms."""

    moe_terms: Any = None

    def train_step(self, data_iterator: Iterator[tuple[dict[str, Tensor], Tensor]]) -> Any:
        """Fetch the step's ``gradient_accumulation_steps × pipeline microbatches`` batches, pre-count
        ``max(Σ count, 1)`` of the loss's mode over the ``batch`` mesh, then run torchtitan's ``train_step``
        on exactly those batches (exhaustion raises from ``next`` as in torchtitan's own loop)."""
        loss_fn = self.loss_fn  # type: ignore[attr-defined]
        if not isinstance(loss_fn, LossParityLoss):
            raise TypeError(f"loss_fn: LossParityTitanMixin needs a LossParityLoss, got {type(loss_fn).__name__}")
        dims = self.parallel_dims  # type: ignore[attr-defined]
        terms = self.moe_terms
        if terms is not None:
            for flag in ("tp_enabled", "ep_enabled", "cp_enabled"):
                if getattr(dims, flag, False):
                    raise ValueError(f"moe_terms: TitanMoETerms does not support {flag[:-8]} parallelism yet")
        n = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches  # type: ignore[attr-defined]
        batches = [next(data_iterator) for _ in range(n)]
        group = dims.get_mesh("batch") if dims.dp_enabled else None
        labels = [lab for _, lab in batches]
        loss_fn.precount(
            labels,
            [d.get("positions") for d, _ in batches],
            group,
            device=self.device,  # type: ignore[attr-defined]
        )
        if terms is None:
            return super().train_step(iter(batches))  # type: ignore[misc]
        pg = _group_of(group)
        pp = getattr(dims, "pp_enabled", False)
        pipeline = _group_of(dims.get_mesh("pp")) if pp else None
        if pp:
            _pause_metadata_inference(self.pp_schedule, terms)  # type: ignore[attr-defined]
        terms.begin_step([lab.to(self.device) for lab in labels], pg)  # type: ignore[attr-defined]
        processor = self.metrics_processor  # type: ignore[attr-defined]
        original = processor.log
        ended: list[dict[str, float]] = []
        # torchtitan's loss (J_lm) is the model's on the last stage only (the others log a placeholder)
        has_loss = not pp or bool(getattr(self, "pp_has_last_stage", False))

        def log(step: int, global_avg_loss: float, *args: Any, extra_metrics: Any = None, **kwargs: Any) -> Any:
            ended.append(terms.end_step(pg, pipeline))  # every rank logs the same step: the all-reduces match
            extra = dict(extra_metrics or {})
            extra.update(ended[0])
            if has_loss:
                extra["objective"] = float(global_avg_loss) + ended[0]["moe_terms"]
            return original(step, global_avg_loss, *args, extra_metrics=extra, **kwargs)

        processor.log = log
        try:
            out = super().train_step(iter(batches))  # type: ignore[misc]
        finally:
            processor.log = original
        if not ended:  # not a logging step: the bias update and the lagged counts still happen once
            terms.end_step(pg, pipeline)
        return out

    def post_dataloading_process(self, input_dict: dict[str, Tensor], labels: Tensor) -> tuple[Tensor, Tensor, Any]:
        """torchtitan's own, and under context parallelism (unit modes) the shard's whole-row coefficients:
        torchtitan's sharding runs on a position index in place of the labels (the same permutation, for any
        load balancer), the labels and the coefficients are taken at that index."""
        loss_fn = self.loss_fn  # type: ignore[attr-defined]
        if not (getattr(self.parallel_dims, "cp_enabled", False) and loss_fn.mode != "per_token"):  # type: ignore[attr-defined]
            return super().post_dataloading_process(input_dict, labels)  # type: ignore[misc]
        whole_positions = input_dict.get("positions")
        index = torch.arange(labels.shape[1], device=labels.device).expand_as(labels).contiguous()
        inputs, index, extra = super().post_dataloading_process(input_dict, index)  # type: ignore[misc]
        loss_fn.shard_coefficients(labels, whole_positions, index)
        return inputs, labels.gather(1, index.to(labels.device)), extra
