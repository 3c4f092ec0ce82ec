"""Per-sample and per-document sums and counts (semantics §0).

Pure tensor functions, no process groups. Every normalization mode of semantics §1 is a function of
these statistics only, which is why they are the one place where per-token losses are reduced.
:func:`unit_count_map` gives the counts at every position (the token count of the unit holding it), the
input of the token weights (:mod:`lossparity.losses.token_weights`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import describe
from .mode_table import mode_spec

__all__ = [
    "check_inputs",
    "sample_stats",
    "document_starts",
    "document_ids",
    "document_stats",
    "document_sums",
    "rows_documents",
    "count_documents",
    "masked_token_sum",
    "unit_count_map",
    "group_token_counts",
]


def check_inputs(
    per_token_loss: Tensor,
    mask: Tensor,
    segment_ids: Tensor | None = None,
    *,
    where: str = "",
    check_finite: bool = True,
    check_mask_values: bool = True,
    check_segment_values: bool = True,
) -> None:
    """Validate a (per-token loss, mask, segment ids) triple, raising a clear error (semantics §7).

    Checks that ``per_token_loss`` and ``mask`` are ``[B, S]`` (or ``[S]``) tensors of the same shape,
    that ``mask`` only holds 0/1, that ``segment_ids`` (when given) is an integer tensor of the same
    shape, and (when ``check_finite``) that the loss has no NaN/Inf where the mask is 1. ``where`` (e.g.
    ``"rank 1, microbatch 3"``) is appended to every message. ``check_mask_values=False`` skips the 0/1
    scan (for a mask already validated, e.g. by ``Accountant.begin_step``); ``check_segment_values=False``
    skips the ``segment_ids >= 0`` scan (each scan is a host synchronization on an accelerator).
    """
    loc = f" ({where})" if where else ""
    if not isinstance(per_token_loss, Tensor):
        raise TypeError(f"per_token_loss must be a torch.Tensor, got {describe(per_token_loss)}{loc}")
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {describe(mask)}{loc}")
    if per_token_loss.dim() not in (1, 2):
        raise ValueError(f"per_token_loss must be [batch, seq] or [seq], got shape {tuple(per_token_loss.shape)}{loc}")
    if mask.shape != per_token_loss.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match per_token_loss shape {tuple(per_token_loss.shape)}{loc}"
        )
    if not per_token_loss.is_floating_point():
        raise TypeError(f"per_token_loss must be floating point, got dtype {per_token_loss.dtype}{loc}")
    if mask.is_complex():
        raise TypeError(f"mask must be real with values in {{0, 1}}, got dtype {mask.dtype}{loc}")
    if check_mask_values and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
        raise ValueError(f"mask values must be 0 or 1, found {bad}{loc}")
    if segment_ids is not None:
        if not isinstance(segment_ids, Tensor) or segment_ids.is_floating_point() or segment_ids.is_complex():
            dtype = getattr(segment_ids, "dtype", type(segment_ids).__name__)
            raise TypeError(f"segment_ids must be an integer tensor, got {dtype}{loc}")
        if segment_ids.shape != per_token_loss.shape:
            raise ValueError(
                f"segment_ids shape {tuple(segment_ids.shape)} does not match per_token_loss shape "
                f"{tuple(per_token_loss.shape)}{loc}"
            )
        if check_segment_values and segment_ids.numel() and bool((segment_ids < 0).any()):
            raise ValueError(f"segment_ids must be >= 0 (0 = padding), found negative ids{loc}")
    if check_finite and per_token_loss.numel():
        # Only loss-bearing positions matter: garbage under mask 0 is ignored by every formula.
        finite = torch.isfinite(per_token_loss.detach()) | (mask == 0)
        if not bool(finite.all()):
            idx = (~finite).nonzero()[0].tolist()
            raise FloatingPointError(f"per_token_loss has NaN/Inf at index {idx}{loc}")


def _as_2d(x: Tensor) -> Tensor:
    return x.unsqueeze(0) if x.dim() == 1 else x


def sample_stats(per_token_loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample loss sums and token counts: ``s_i = Σ_t w[i,t]·l[i,t]``, ``n_i = Σ_t w[i,t]``.

    ``per_token_loss`` and ``mask`` are ``[B, S]`` (a 1-D input is one sample). Returns ``(s, n)``,
    both ``[B]``; ``s`` keeps the loss dtype and autograd graph, ``n`` is in the loss dtype (exact for
    counts below 2**24 in float32). Masked positions contribute exactly 0 even if the loss there is
    non-finite-free garbage, because the product is taken with the 0/1 mask.
    """
    check_inputs(per_token_loss, mask, check_finite=False, check_mask_values=False, check_segment_values=False)
    l2, w2 = _as_2d(per_token_loss), _as_2d(mask).to(per_token_loss.dtype)
    # torch.where rather than a product: a masked position holding Inf must not give NaN.
    s = torch.where(w2 > 0, l2, torch.zeros_like(l2)).sum(dim=-1)
    return s, w2.sum(dim=-1)


def masked_token_sum(per_token_loss: Tensor, mask: Tensor) -> Tensor:
    """``Σ_{i,t} w[i,t]·l[i,t]`` over all positions, summed exactly as ``F.cross_entropy(reduction='sum')``.

    The sum goes through ``F.nll_loss`` on a one-class input, so PyTorch's own (cascade) summation
    order is used: with one microbatch, the ``per_token`` objective is then bit-for-bit
    ``F.cross_entropy(logits, labels, reduction='sum') / count`` — the "default path unchanged"
    guarantee that users porting an existing loop check first. Masked positions are ignored (never
    multiplied), so a NaN/Inf there does not leak into the sum.
    """
    flat = per_token_loss.reshape(-1, 1)
    target = torch.where(mask.reshape(-1) > 0, 0, -100)
    return F.nll_loss(-flat, target, reduction="sum", ignore_index=-100)


def document_starts(segment_ids: Tensor) -> Tensor:
    """``True`` where a document starts (semantics §0): at a non-zero segment id that differs from its
    left neighbour in the row, or sits in column 0. A document is a maximal run of equal non-zero ids
    within a row, so ``[1, 1, 2, 2, 1, 1]`` holds 3 documents; id 0 is padding. ``[B, S]`` or ``[S]``."""
    seg = _as_2d(segment_ids).long()
    prev = F.pad(seg[:, :-1], (1, 0), value=0)
    return (seg != 0) & (seg != prev)


def document_ids(segment_ids: Tensor) -> Tensor:
    """The document number of every position within its row, ``1, 2, ...`` (0 at padding), documents as
    in :func:`document_starts`: ``[1, 1, 2, 2, 1, 1]`` gives ``[1, 1, 2, 2, 3, 3]``. Two positions of a
    row belong to the same document iff their numbers are equal and non-zero (attention masks and MTP
    shifts compare these, never the raw ids). Same shape as ``segment_ids``."""
    starts = document_starts(segment_ids).view(segment_ids.shape)
    return torch.where(segment_ids != 0, starts.long().cumsum(-1), torch.zeros_like(segment_ids, dtype=torch.long))


def _document_index(segment_ids: Tensor) -> Tensor:
    """Document index of every position of the batch, row-major in order of appearance; -1 at padding."""
    seg = _as_2d(segment_ids).long()
    index = document_starts(seg).flatten().cumsum(0).view_as(seg) - 1
    return torch.where(seg != 0, index, torch.full_like(index, -1))


def rows_documents(segment_ids: Tensor) -> tuple[Tensor, int]:
    """Map every position to a document index of the batch (documents as in :func:`document_starts`),
    numbered row-major in order of appearance.

    Returns ``(doc_index [B,S] with -1 at padding positions (segment id 0), num_documents)``; the count
    is read to the host (one synchronization). A document with no loss-bearing token still exists (and
    counts in ``Ndoc``, semantics §1).
    """
    return _document_index(segment_ids), count_documents(segment_ids)


def count_documents(segment_ids: Tensor) -> int:
    """Number of documents ``Ndoc`` of a batch (runs of :func:`document_starts`), read to the host."""
    if segment_ids.numel() == 0:
        return 0
    return int(document_starts(segment_ids).sum())


def document_sums(per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-document sums and counts of ``[b, S]`` packed rows without a host synchronization (for hot
    paths: the integrations' loss functions). Documents as in :func:`document_starts`.

    Returns ``(s, n, ndoc)``: ``s[j] = Σ_{t∈j} w·l``, ``n[j] = Σ_{t∈j} w`` in ``b·S`` slots (slot ``j`` is
    document ``j`` of :func:`rows_documents`; unused slots hold 0) and the document count ``ndoc`` as a
    0-dim ``torch.int`` tensor. A loss-bearing token at segment id 0 fails (asynchronously on a GPU).
    """
    seg = segment_ids.view_as(per_token_loss).long()
    w = mask.to(per_token_loss.dtype)
    torch._assert_async(~((seg == 0) & (w > 0)).any(), "segment_ids: loss-bearing token at segment id 0 (padding)")
    inside = (seg != 0).flatten()
    slot = _document_index(seg).flatten().clamp(min=0)
    contrib = torch.where(inside & (w.flatten() > 0), per_token_loss.flatten(), per_token_loss.new_zeros(()))
    zeros = per_token_loss.new_zeros(seg.numel())
    s = zeros.index_add(0, slot, contrib)
    n = zeros.index_add(0, slot, torch.where(inside, w.flatten(), torch.zeros_like(contrib)))
    return s, n, document_starts(seg).sum().to(torch.int)


def document_stats(
    per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor, *, documents: tuple[Tensor, int] | None = None
) -> tuple[Tensor, Tensor]:
    """Per-document sums and counts for packed rows: ``s_j = Σ_{t in doc j} w·l``, ``n_j = Σ w``.

    A document is a maximal run of equal non-zero segment ids within a row (:func:`document_starts`;
    segment id 0 marks padding). Returns ``(s [Ndoc], n [Ndoc])`` ordered by row, then position.
    Loss-bearing tokens at segment id 0 are rejected: they would belong to no document.
    ``documents``: the ``rows_documents(segment_ids)`` of a caller that numbered and validated them
    already (the accountant, at ``begin_step``): no host synchronization then.
    """
    check_inputs(
        per_token_loss, mask, segment_ids, check_finite=False, check_mask_values=False, check_segment_values=False
    )
    l2, w2 = _as_2d(per_token_loss), _as_2d(mask).to(per_token_loss.dtype)
    doc, ndoc = rows_documents(segment_ids) if documents is None else documents
    if documents is None and bool(((doc < 0) & (w2 > 0)).any()):
        raise ValueError("mask has loss-bearing tokens at segment_ids == 0 (padding); they belong to no document")
    if ndoc == 0:
        empty = l2.new_zeros(0)
        return empty + l2.sum() * 0, empty
    contrib = torch.where(w2 > 0, l2, torch.zeros_like(l2))
    idx = doc.clamp(min=0).flatten()
    s = torch.zeros(ndoc, dtype=l2.dtype, device=l2.device).index_add(0, idx, contrib.flatten())
    n = torch.zeros(ndoc, dtype=l2.dtype, device=l2.device).index_add(0, idx, w2.flatten())
    return s, n


def group_token_counts(mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """The groups of rows (semantics §1, ``per_group``) of ``mask`` ``[b, S]`` with row-level ``group_ids``
    ``[b]`` (any integers): ``(index, n, Ngrp)`` with ``index[i]`` the dense number of row ``i``'s group,
    ``n[g] = Σ_{i∈g} n_i`` (float64) and ``Ngrp`` the number of distinct ids (a group of empty rows counts).
    One host synchronization (the number of groups); the accountant calls it once per step."""
    w = mask if mask.dim() == 2 else mask.unsqueeze(0)
    if not isinstance(group_ids, Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        raise TypeError(f"group_ids must be an integer tensor (one id per row), got {describe(group_ids)}")
    if group_ids.shape != (w.shape[0],):
        raise ValueError(f"group_ids must have shape [{w.shape[0]}] (one id per row), got {tuple(group_ids.shape)}")
    uniq, index = torch.unique(group_ids.to(w.device), return_inverse=True)
    n = torch.zeros(uniq.numel(), dtype=torch.float64, device=w.device)
    n.index_add_(0, index, w.to(torch.float64).sum(dim=-1))
    return index, n, int(uniq.numel())


def unit_count_map(
    mode: str,
    mask: Tensor,
    segment_ids: Tensor | None = None,
    *,
    documents: tuple[Tensor, int] | None = None,
    group_ids: Tensor | None = None,
) -> Tensor | None:
    """For the modes that normalize per unit (``per_sample``, ``per_document``, ``per_microbatch``,
    ``per_group``): a ``[b, S]`` map giving at every position the token count ``n`` of the unit (sample,
    document, microbatch, group of rows by ``group_ids``) that contains it, computed from whole rows;
    ``None`` for the other modes.

    Context parallelism splits a row's columns over ranks; a shard's numerator is then
    ``Σ_{shard positions} w·l / max(n_unit, 1)`` with ``n_unit`` read from this map, and the shards'
    numerators add up to the unit's exact ``s_unit / max(n_unit, 1)``. ``documents``: the
    ``rows_documents(segment_ids)`` of the rows when already known (the accountant numbers them at
    ``begin_step``), which spares the numbering's host synchronization.
    """
    if not mode_spec(mode).per_unit:
        return None
    w = (mask if mask.dim() == 2 else mask.unsqueeze(0)).to(torch.float64)
    if mode == "per_sample":
        return w.sum(dim=-1, keepdim=True).expand_as(w)
    if mode == "per_microbatch":
        return w.sum().expand_as(w)
    if mode == "per_group":  # groups held whole by these rows; spanning groups take the pre-counted map
        if group_ids is None:
            raise ValueError("mode 'per_group' needs group_ids (one group id per row) or the groups' unit_counts")
        index, n, _ = group_token_counts(w, group_ids)
        return n[index].unsqueeze(-1).expand_as(w)
    if segment_ids is None:
        raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
    doc, ndoc = rows_documents(segment_ids) if documents is None else documents
    doc = doc.to(w.device).clamp(min=0)
    n = torch.zeros(max(ndoc, 1), dtype=torch.float64, device=w.device).index_add(0, doc.flatten(), w.flatten())
    return n[doc].view_as(w)
