"""The MTP term and the parallel layout of :class:`~lossparity.integrations.hf.LossParityMixin` (its base
class): the documents a batch's loss needs, the data-parallel layout the accountant counts over (tensor
parallelism supported, context/sequence parallelism refused with the reason), the MTP depths of a forward
(rolled labels and masks, :mod:`.hf_mtp`'s output hook) and the MTP term of an evaluation batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..losses.mtp import mtp_denominators, mtp_objective, mtp_scale, roll_mtp
from ..losses.token_weights import mtp_token_weights
from ..options import MTPConvention
from .hf_mtp import mtp_outputs

__all__ = ["IGNORE_INDEX", "MTPTerms", "per_token_ce"]

IGNORE_INDEX = -100  # the label HF causal-LM losses ignore (hf.IGNORE_INDEX, the same number)


def per_token_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token cross-entropy ``[b, S]`` (0 at ignored labels), float32 as HF's loss computes (bf16/fp16
    upcast), float64 logits kept float64 (HF casts them down)."""
    return F.cross_entropy(
        (logits if logits.dtype == torch.float64 else logits.float()).flatten(0, 1),
        labels.flatten().to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(labels.shape)


class MTPTerms:
    """The MTP and layout methods of the Trainer mixin; its ``__init__`` sets the state below."""

    model: Any
    accelerator: Any
    loss_mode: str
    lp_fixed_length: int | None
    lp_mtp_depths: int
    lp_mtp_convention: MTPConvention
    lp_mtp_weight: float

    def _lp_dims(self) -> Any:
        """The layout the accountant counts over: the data-parallel ranks (``world / tp``); tensor-parallel
        ranks hold the same rows (transformers' Trainer gives them the same batches) and are not counted
        again. Context and sequence parallelism are refused with the reason (docs/hf-trainer.md)."""
        from ..distributed.parallel_dims import ParallelDims

        tp, cp, sp = (int(getattr(self, f"get_{k}_size", lambda: 1)()) for k in ("tp", "cp", "sp"))
        if cp > 1:
            raise ValueError(
                f"parallelism_config.cp_size={cp}: LossParityMixin does not support transformers' context "
                "parallelism: it was tried on CPU (gloo) and torch's context_parallel has no CPU attention "
                "kernel (NotImplementedError: aten._scaled_dot_product_flash_attention_for_cpu has no sharding "
                "strategy), so its per-shard shares are untested; see docs/hf-trainer.md"
            )
        if sp > 1:
            raise ValueError(
                f"parallelism_config.sp_size={sp}: LossParityMixin does not support DeepSpeed Ulysses sequence "
                "parallelism (its loss path is DeepSpeed's own, deepspeed_sp_compute_loss); see docs/hf-trainer.md"
            )
        world = int(getattr(self.accelerator, "num_processes", 1))  # type: ignore[attr-defined]
        if tp == 1:
            return ParallelDims.from_group(None)
        if world % tp:
            raise ValueError(f"tp_size={tp} does not divide the {world} processes")
        dims = ParallelDims(dp=world // tp, tp=tp)
        dims.build_mesh(getattr(getattr(self.accelerator, "device", None), "type", "cpu"))  # type: ignore[attr-defined]
        return dims

    def _lp_mtp_inputs(
        self, outputs: Any, labels: Tensor, seg: Tensor | None
    ) -> tuple[str, list[Tensor], list[Tensor], list[Tensor]] | None:
        """The MTP depths of this forward: (``"hidden"``/``"logits"``, the model's per-depth tensors, the
        depths' labels and masks rolled from the main shifted labels within rows and documents)."""
        if not self.lp_mtp_depths:
            return None
        kind, xs = mtp_outputs(outputs, self.lp_mtp_depths)
        mask = (labels != IGNORE_INDEX).float()
        lab_k, mask_k = [], []
        for k in range(1, self.lp_mtp_depths + 1):
            lab, w = roll_mtp(labels, mask, seg, k, ignore_index=IGNORE_INDEX)
            lab_k.append(lab.to(xs[k - 1].device))
            mask_k.append(w)
        return kind, xs, lab_k, mask_k

    def _lp_eval_mtp(self, losses: list[Tensor], masks: list[Tensor], mask: Tensor, seg: Tensor | None) -> Tensor:
        """Evaluation: the MTP term of this batch alone (one microbatch)."""
        return mtp_objective(
            self.loss_mode,
            losses,
            [w.to(losses[0].dtype) for w in masks],
            mask,
            weight=self.lp_mtp_weight,
            convention=self.lp_mtp_convention,
            segment_ids=seg if self.loss_mode == "per_document" else None,
            microbatch_size=mask.shape[0],
            fixed_length=self.lp_fixed_length,
        )

    def _lp_resolve_mtp_depths(self, depths: int | None) -> int:
        """``mtp_depths``: the argument, else the depth count of :func:`~lossparity.integrations.hf_mtp.attach_mtp`'s
        layers on the model, else 0; an argument that contradicts the attached layers raises."""
        hook = getattr(self.model, "_lp_mtp_hook", None)
        attached = len(hook.mtp.layers) if hook is not None else None
        if depths is None:
            return attached or 0
        if isinstance(depths, bool) or not isinstance(depths, int) or depths < 0:
            raise ValueError(f"mtp_depths: need an int >= 0, got {depths!r}")
        if attached is not None and depths != attached:
            raise ValueError(f"mtp_depths={depths} but the model has {attached} MTP layers attached (attach_mtp)")
        return depths

    def _lp_eval_mtp_weights(
        self, masks: list[Tensor], mask: Tensor, seg: Tensor | None, main_den: float
    ) -> list[Tensor]:
        """Evaluation: per-depth weights of the MTP term of this batch alone (λ, ``1/Dm`` and the
        convention's denominators included), counted from its rolled masks."""
        tokens = [float(w.sum()) for w in masks]  # evaluation only: host counts are fine here
        dens = mtp_denominators(self.loss_mode, self.lp_mtp_convention, main_den, tokens)
        return mtp_token_weights(
            self.loss_mode,
            masks,
            convention=self.lp_mtp_convention,
            segment_ids=seg,
            fixed_length=self.lp_fixed_length,
            denominators=dens,
            scale=mtp_scale(self.lp_mtp_weight, self.lp_mtp_convention, len(masks)),
        )
