"""Per-microbatch numerators and unit counts of every mode, without host synchronization.

Shared by the integrations whose framework divides by a count it sums itself (Megatron's deferred
normalization) or by one pre-counted before the step (torchtitan). ``J = Σ_mb numerator(mb) / Σ count``
(docs/semantics.md §1, §3); the counts are integer tensors so that nothing leaves the device. The modes
(unit, reduction, count) come from :mod:`lossparity.losses.mode_table` and the documents from
:func:`lossparity.losses.stats.document_starts`, as in the core.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..losses.mode_table import mode_spec, reduce_units
from ..losses.stats import document_starts, document_sums, masked_token_sum, sample_stats

__all__ = ["AttachGrad", "document_sums", "mode_coefficients", "mode_numerator", "unit_count"]


def unit_count(mode: str, mask: Tensor, segment_ids: Tensor | None = None) -> Tensor:
    """The count a microbatch ``[b, S]`` adds to the global denominator of ``mode`` (0-dim ``torch.int``):
    ``Ntok_mb`` (per_token), ``b`` (per_sample, sample_sum, sample_sum_norm), ``Ndoc_mb`` (per_document,
    documents of :func:`~lossparity.losses.stats.document_starts`), 1 (per_microbatch)."""
    count = mode_spec(mode).count
    if count == "tokens":
        return (mask != 0).sum().to(torch.int)
    if count == "microbatches":
        return torch.ones((), dtype=torch.int, device=mask.device)
    if count == "documents":
        if segment_ids is None:
            raise ValueError("segment_ids: mode 'per_document' needs the segment ids of packed rows")
        return document_starts(segment_ids.view(mask.shape)).sum().to(torch.int)
    return torch.tensor(mask.shape[0], dtype=torch.int, device=mask.device)


def mode_numerator(
    mode: str, loss: Tensor, mask: Tensor, segment_ids: Tensor | None = None, fixed_length: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(numerator, count)`` of one microbatch for ``mode`` (docs/semantics.md §1): ``Σ s_i`` (per_token,
    sample_sum), ``Σ s_i/max(n_i,1)`` (per_sample), ``Σ_j s_j/max(n_j,1)`` (per_document),
    ``s_mb/max(n_mb,1)`` (per_microbatch), ``Σ s_i / L`` (sample_sum_norm); count = :func:`unit_count`."""
    spec = mode_spec(mode)
    count = unit_count(mode, mask, segment_ids)
    if spec.unit == "document":
        assert segment_ids is not None  # unit_count raised otherwise
        s, n, _ = document_sums(loss, mask, segment_ids.view_as(loss))
    elif not spec.per_unit:
        s = masked_token_sum(loss, mask)
        n = s.new_ones(())
    else:
        s, n = sample_stats(loss, mask)
        if spec.unit == "microbatch":
            s, n = s.sum(), n.sum()
    return reduce_units(mode, s, n, fixed_length=fixed_length), count


def mode_coefficients(mode: str, mask: Tensor, segment_ids: Tensor | None, fixed_length: int | None) -> Tensor:
    """``c`` with ``numerator(s) = Σ_t c_t·s_t`` for whole rows ``[b, S]``: the numerators of every mode are
    linear in the per-token losses ``s`` (docs/semantics.md §1), so ``c = ∂numerator/∂s``, e.g.
    ``w_t/max(n_i, 1)`` (per_sample) or ``w_t/max(n_j, 1)`` with ``j`` the document of ``t`` (per_document).
    A context-parallel shard's numerator is then ``Σ_{t in shard} c_t·s_t`` with ``c`` taken on whole rows."""
    with torch.enable_grad():
        s = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device, requires_grad=True)
        num, _ = mode_numerator(mode, s, mask, segment_ids, fixed_length)
        (c,) = torch.autograd.grad(num, s, allow_unused=True)
    return torch.zeros_like(s) if c is None else c.detach()


class AttachGrad(torch.autograd.Function):
    """Identity on ``x`` whose backward also back-propagates ``term`` with the weight ``w·grad_scale``
    (``grad_scale``: Megatron's mixed-precision loss scale of ``config``, when it has one; ``config=None``: 1).
    How the drop-ins add a router term to the gradient where the framework's loss does not see it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, term: Tensor, weight: float, config: Any) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(term)
        ctx.weight, ctx.config = weight, config
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        (term,) = ctx.saved_tensors
        scale = torch.full_like(term, ctx.weight)
        if getattr(ctx.config, "grad_scale_func", None) is not None:  # mixed precision: the loss scale
            scale = scale * ctx.config.grad_scale_func(torch.ones(1, device=term.device)).to(term.dtype)
        return grad, scale, None, None
