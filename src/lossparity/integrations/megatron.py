"""Megatron-core integration: a ``loss_func`` that makes every mode exact under deferred normalization.

Megatron-core with ``calculate_per_token_loss=True`` back-propagates each microbatch's loss *as
returned* (no division), sums the returned counts over the microbatches of the step
(``forward_backward_*``) and over the data-parallel × context-parallel ranks (``finalize_model_grads``),
and divides every gradient by that total (docs/semantics.md §3, deferred normalization). Every mode of
docs/semantics.md §1 is ``J = Σ_mb numerator(mb) / global count``, so returning the mode's numerator and
its unit count makes Megatron optimize ``J`` exactly, for any micro-batch size, number of microbatches
and DP size:

| mode             | returned loss (numerator)          | returned count |
|------------------|------------------------------------|----------------|
| per_token        | ``Σ_i s_i`` (Megatron's own)         | ``Ntok_mb``    |
| per_sample       | ``Σ_i s_i / max(n_i, 1)``          | ``b``          |
| per_document     | ``Σ_j s_j / max(n_j, 1)``          | ``Ndoc_mb``    |
| per_microbatch   | ``s_mb / max(n_mb, 1)``            | ``1``          |
| sample_sum       | ``Σ_i s_i``                        | ``b``          |
| sample_sum_norm  | ``Σ_i s_i / L``                    | ``b``          |

Usage in a ``forward_step`` (exactly like ``pretrain_gpt.py``'s ``loss_func``)::

    loss_fn = LossFunc("per_sample", config=model_config)
    def forward_step(data_iterator, model):
        tokens, labels, loss_mask, ... = get_batch(data_iterator)
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)  # [b, s] per-token loss
        return output_tensor, partial(loss_fn, loss_mask)          # per_document: segment_ids=...

With ``calculate_per_token_loss=False`` Megatron would divide the returned loss by the count itself
(per microbatch) and by the number of microbatches, which is not ``J``: passing ``config=`` makes the
constructor reject that; without it, the flag is a documented requirement.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..losses.stats import masked_token_sum
from ..options import MODES, Mode, check_option
from . import require
from ._common import document_sums, mode_numerator
from .megatron_moe import MoETerms
from .megatron_pipeline import check_pipeline_split

__all__ = ["LossFunc", "MoETerms", "check_pipeline_split", "document_sums"]


class LossFunc:
    """The ``loss_func`` of a megatron-core ``forward_step`` for any lossparity mode (module docstring).

    Call it as ``partial(loss_fn, loss_mask)(output_tensor)``, i.e. ``loss_fn(loss_mask, output_tensor,
    segment_ids=None)``, with the ``[b, s]`` per-token losses ``output_tensor`` and 0/1 ``loss_mask``.
    Returns Megatron's 3-tuple ``(loss, count, report)``: ``loss`` = the mode's numerator of this
    microbatch (scalar, differentiable), ``count`` = its unit count (0-dim ``torch.int``: Megatron sums
    it into an integer tensor), ``report = {"lm loss": [S_mb, Ntok_mb], "objective": [num_mb, count_mb]}``,
    which Megatron's training loop sums over microbatches and DP ranks and divides: ``lm loss = S/Ntok``
    (global token mean, docs/semantics.md §2) and ``objective = J``.

    Args:
        mode: a lossparity mode (docs/semantics.md §1). ``per_document`` needs ``segment_ids``.
        config: the model's megatron ``TransformerConfig``/``ModelParallelConfig``; when given, a
            ``calculate_per_token_loss=False`` config is rejected here.
        fixed_length: the ``L`` of ``sample_sum_norm``.
        terms: a :class:`MoETerms` of the same model: the loss then also carries the MTP terms, is
            normalized by the global counts of ``terms.begin_step`` and returns the count 1, so any
            ``calculate_per_token_loss`` is exact (see :mod:`lossparity.integrations.megatron_moe`).
    """

    def __init__(
        self,
        mode: Mode = "per_sample",
        *,
        config: Any = None,
        fixed_length: int | None = None,
        terms: MoETerms | None = None,
    ) -> None:
        require("megatron.core", "megatron")
        self.mode: Mode = check_option("mode", mode, MODES)
        if mode == "sample_sum_norm" and (fixed_length is None or fixed_length <= 0):
            raise ValueError(f"fixed_length: mode 'sample_sum_norm' needs fixed_length > 0, got {fixed_length}")
        self.fixed_length = fixed_length
        self.terms = terms
        if terms is not None:
            if not isinstance(terms, MoETerms):
                raise TypeError(f"terms: expected a MoETerms, got {type(terms).__name__}")
            terms.bind(self.mode, fixed_length)
        elif config is not None:
            self.check_config(config)
            # Under context parallelism each rank sees a shard of every row: unit counts (n_i, n_j, b) would
            # be shard-local and Megatron sums the counts over DP×CP, so only per_token stays exact.
            cp = getattr(config, "context_parallel_size", 1) or 1
            if cp > 1 and self.mode != "per_token":
                raise ValueError(
                    f"config.context_parallel_size={cp}: mode {self.mode!r} needs whole rows on each "
                    "rank (only per_token is exact under context parallelism)"
                )

    @staticmethod
    def check_config(config: Any) -> None:
        """Raise ``ValueError`` unless ``config.calculate_per_token_loss`` is True (deferred normalization)."""
        if not getattr(config, "calculate_per_token_loss", False):
            raise ValueError(
                "config: lossparity.integrations.megatron.LossFunc needs calculate_per_token_loss=True "
                "(Megatron then divides the gradients by the summed counts this loss returns); "
                f"got calculate_per_token_loss={getattr(config, 'calculate_per_token_loss', None)!r}"
            )

    def __call__(
        self, loss_mask: Tensor, output_tensor: Tensor, *, segment_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``(numerator, count, report)`` of this microbatch (class docstring)."""
        loss, mask = self._check(loss_mask, output_tensor, segment_ids)
        if self.terms is not None and torch.is_grad_enabled():  # (evaluation: the plain LM numerator below)
            share, num, s_tok = self.terms.loss_share(self.mode, loss, mask, segment_ids)
            one = torch.ones((), dtype=torch.int, device=loss.device)
            n_tok = mask.sum().to(s_tok.dtype)
            report = {"lm loss": torch.stack([s_tok, n_tok]), "objective": torch.stack([share.detach(), n_tok * 0 + 1])}
            return share, one, report
        num, count = self._numerator(loss, mask, segment_ids)
        s_tok = masked_token_sum(loss.detach(), mask)
        n_tok = mask.sum().to(loss.dtype)
        report = {
            "lm loss": torch.stack([s_tok, n_tok]),
            "objective": torch.stack([num.detach(), count.to(loss.dtype)]),
        }
        return num, count, report

    def _numerator(self, loss: Tensor, mask: Tensor, segment_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        return mode_numerator(self.mode, loss, mask, segment_ids, self.fixed_length)

    def _check(self, loss_mask: Tensor, output_tensor: Tensor, segment_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        if not isinstance(output_tensor, Tensor) or not output_tensor.is_floating_point():
            raise TypeError(f"output_tensor: expected the [b, s] floating per-token losses, got {type(output_tensor)}")
        loss = output_tensor if output_tensor.dim() == 2 else output_tensor.unsqueeze(0)
        if loss_mask.numel() != loss.numel():
            raise ValueError(
                f"loss_mask: shape {tuple(loss_mask.shape)} does not match output_tensor {tuple(output_tensor.shape)}"
            )
        if self.mode == "per_document" and segment_ids is None:
            raise ValueError(
                "segment_ids: mode 'per_document' needs segment_ids (partial(loss_fn, loss_mask, "
                "segment_ids=...)) to find the documents of packed rows"
            )
        if segment_ids is not None and segment_ids.numel() != loss.numel():
            raise ValueError(
                f"segment_ids: shape {tuple(segment_ids.shape)} does not match output_tensor "
                f"{tuple(output_tensor.shape)}"
            )
        # Megatron's loss masks are float; the formulas take a 0/1 mask of the loss's shape.
        return loss, loss_mask.view_as(loss).to(loss.dtype)
