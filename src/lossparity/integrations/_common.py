"""Per-microbatch numerators and unit counts of every mode, without host synchronization.

Shared by the integrations whose framework divides by a count it sums itself (Megatron's deferred
normalization) or by one pre-counted before the step (torchtitan). ``J = Σ_mb numerator(mb) / Σ count``
(docs/semantics.md §1, §3); the counts are integer tensors so that nothing leaves the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..losses.stats import masked_token_sum, sample_stats

__all__ = ["document_sums", "mode_numerator", "unit_count"]


def document_sums(per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-document sums and counts of a microbatch of packed rows, without a host synchronization.

    A document is a maximal run of equal non-zero ``segment_ids`` within a row (segment id 0 = padding),
    the packed-row convention of Megatron and MaxText. Returns ``(s, n, ndoc)``: ``s[j] = Σ_{t∈j} w·l``,
    ``n[j] = Σ_{t∈j} w`` in ``b·S`` slots (unused slots hold 0) and the integer document count ``ndoc``
    (0-dim int tensor). Same values as ``lossparity.losses.stats.document_stats`` for contiguous
    segments; the run starts replace its ``torch.unique`` (a host sync) so that it fits a hot path.
    """
    seg = segment_ids.long()
    start = _run_starts(seg)
    index = start.flatten().cumsum(0) - 1
    w = mask.to(per_token_loss.dtype)
    # A loss token at segment id 0 belongs to no document: fail loudly (asynchronously on a GPU).
    torch._assert_async(~((seg == 0) & (w > 0)).any(), "segment_ids: loss-bearing token at segment id 0 (padding)")
    inside = (seg != 0).flatten()
    contrib = torch.where(w > 0, per_token_loss, torch.zeros_like(per_token_loss)).flatten()
    slot = torch.where(inside, index, torch.zeros_like(index)).clamp(min=0)
    zeros = per_token_loss.new_zeros(seg.numel())
    s = zeros.index_add(0, slot, torch.where(inside, contrib, torch.zeros_like(contrib)))
    n = zeros.index_add(0, slot, torch.where(inside, w.flatten(), torch.zeros_like(contrib)))
    return s, n, start.sum().to(torch.int)


def unit_count(mode: str, mask: Tensor, segment_ids: Tensor | None = None) -> Tensor:
    """The count a microbatch ``[b, S]`` adds to the global denominator of ``mode`` (0-dim ``torch.int``):
    ``Ntok_mb`` (per_token), ``b`` (per_sample, sample_sum, sample_sum_norm), ``Ndoc_mb`` (per_document,
    runs of equal non-zero ``segment_ids``), 1 (per_microbatch)."""
    if mode == "per_token":
        return (mask != 0).sum().to(torch.int)
    if mode == "per_microbatch":
        return torch.ones((), dtype=torch.int, device=mask.device)
    if mode == "per_document":
        if segment_ids is None:
            raise ValueError("segment_ids: mode 'per_document' needs the segment ids of packed rows")
        return _run_starts(segment_ids.view(mask.shape).long()).sum().to(torch.int)
    return torch.tensor(mask.shape[0], dtype=torch.int, device=mask.device)


def mode_numerator(
    mode: str, loss: Tensor, mask: Tensor, segment_ids: Tensor | None = None, fixed_length: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(numerator, count)`` of one microbatch for ``mode`` (docs/semantics.md §1): ``Σ s_i`` (per_token,
    sample_sum), ``Σ s_i/max(n_i,1)`` (per_sample), ``Σ_j s_j/max(n_j,1)`` (per_document),
    ``s_mb/max(n_mb,1)`` (per_microbatch), ``Σ s_i / L`` (sample_sum_norm); count = :func:`unit_count`."""
    count = unit_count(mode, mask, segment_ids)
    if mode == "per_document":
        assert segment_ids is not None
        s, n, _ = document_sums(loss, mask, segment_ids.view_as(loss))
        return (s / n.clamp(min=1)).sum(), count
    if mode == "per_token":
        return masked_token_sum(loss, mask), count
    s, n = sample_stats(loss, mask)
    if mode == "per_sample":
        return (s / n.clamp(min=1)).sum(), count
    if mode == "per_microbatch":
        return s.sum() / n.sum().clamp(min=1), count
    scale = 1.0 if mode == "sample_sum" else 1.0 / float(fixed_length or 1)
    return s.sum() * scale, count


def _run_starts(seg: Tensor) -> Tensor:
    """True where a document starts: a non-zero id different from its left neighbour (or at column 0)."""
    prev = torch.nn.functional.pad(seg[:, :-1], (1, 0), value=0)
    return (seg != 0) & (seg != prev)
