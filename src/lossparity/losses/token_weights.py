"""Per-token objective weights of a microbatch (docs/semantics.md §1, §3, §4).

Every mode's microbatch share is linear in the per-token losses, ``numerator(mb) / denominator =
Σ_t w[t]·l[t]``, and with pre-counted normalizers the weights are known before the forward:

| mode             | w[t] at a loss-bearing position (0 where the mask is 0) |
|------------------|----------------------------------------------------------|
| per_token        | 1 / max(Ntok, 1)                                         |
| per_sample       | 1 / (N · max(n_i, 1))        (i: the row of t)           |
| per_microbatch   | 1 / (D·K · max(Σ_i n_i, 1))                              |
| per_document     | 1 / (Ndoc · max(n_j, 1))     (j: the document of t)      |
| sample_sum       | 1 / N                                                    |
| sample_sum_norm  | 1 / (N · L)                                              |
| token_sum        | 1                                                        |
| per_group        | 1 / (Ngrp · max(n_g, 1))     (g: the group of t's row)   |

(the modes themselves — unit, reduction, count — are read from :mod:`lossparity.losses.mode_table`;
the table's global denominator is the ``denominator`` argument; pass 1 for the raw numerator, as the
``deferred`` normalization back-propagates). This lets a fused output layer form the exact gradient of
the objective during its forward (:func:`lossparity.losses.fused_cross_entropy.fused_linear_cross_entropy`).

Two entry points, one formula: :func:`token_weights` here (also ``lossparity.token_weights``) takes the
mode, the counts and the denominator explicitly; ``Accountant.token_weights(mask, segment_ids)`` is its
accountant-bound form, which fills them in from the step (the mode, the pre-counted denominator or 1
under deferred normalization, the whole-row unit counts under context parallelism) and calls this
function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import check_int, check_int_tensor, check_real, check_tensor, describe
from .mode_table import check_fixed_length, check_mode, mode_spec
from .mtp import check_convention, pool_depths, pool_ids
from .stats import unit_count_map

__all__ = ["token_weights", "mtp_token_weights"]


def token_weights(
    mode: str,
    mask: Tensor,
    *,
    segment_ids: Tensor | None = None,
    fixed_length: int | None = None,
    unit_counts: Tensor | None = None,
    denominator: float = 1.0,
    group_ids: Tensor | None = None,
) -> Tensor:
    """Float64 weights ``w`` of shape ``mask.shape`` with ``Σ w·l = numerator(mode, l, mask, ...) /
    denominator`` for every per-token loss ``l`` (module table): ``w = mask / (max(n_unit, 1) ·
    denominator)`` for the unit modes (``n_unit`` the token count of the sample, document or microbatch
    holding the position, from ``unit_counts`` when given, e.g. whole-row counts under context
    parallelism, else from these rows; ``unit_counts`` with as many entries as ``mask`` is read in its
    shape), ``mask / (L · denominator)`` for ``sample_sum_norm`` and ``mask / denominator`` otherwise.
    ``mask`` is ``[b, S]`` or ``[S]`` of 0/1. ``per_group``: ``unit_counts`` holds the groups' global
    counts ``n_g`` (groups span microbatches), or ``group_ids`` ``[b]`` numbers groups held whole here."""
    check_mode(mode)
    check_tensor("mask", mask, dims=(1, 2), shape_text="[b, S] or [S]")
    check_real("denominator", denominator, positive=True)
    check_int("fixed_length", fixed_length, optional=True)
    if segment_ids is not None:  # its shape is checked where it is used (per_document, from these rows)
        check_int_tensor("segment_ids", segment_ids)
    if unit_counts is not None:
        check_tensor("unit_counts", unit_counts)
    w = mask.to(torch.float64)
    reduction = mode_spec(mode).reduction
    if reduction == "sum_over_length":
        return w / (check_fixed_length(fixed_length) * denominator)
    if reduction == "sum":
        return w / denominator
    if unit_counts is None:
        _check_documents(mode, w, segment_ids)
        seg2 = None if segment_ids is None else segment_ids.reshape(-1, w.shape[-1])
        counts = unit_count_map(mode, w.reshape(-1, w.shape[-1]), seg2, group_ids=group_ids)
        assert counts is not None  # every unit mode has a count map
        unit_counts = counts.view_as(w)
    elif unit_counts.shape != mask.shape and unit_counts.numel() == mask.numel():
        unit_counts = unit_counts.reshape(mask.shape)  # whole-row counts of a [S] mask come as [1, S]
    elif unit_counts.shape != mask.shape:
        raise ValueError(f"unit_counts shape {tuple(unit_counts.shape)} does not match mask {tuple(mask.shape)}")
    return torch.where(w > 0, w / (unit_counts.to(torch.float64).clamp(min=1) * denominator), torch.zeros_like(w))


def _check_documents(mode: str, w: Tensor, segment_ids: Tensor | None) -> None:
    if mode != "per_document":
        return
    if segment_ids is None:
        raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
    if segment_ids.shape != w.shape:
        raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} does not match mask {tuple(w.shape)}")
    if bool(((segment_ids == 0) & (w > 0)).any()):
        raise ValueError("mask has loss-bearing tokens at segment_ids == 0 (padding); they belong to no document")


def mtp_token_weights(
    mode: str,
    masks: Sequence[Tensor],
    *,
    convention: str = "own",
    segment_ids: Tensor | None = None,
    fixed_length: int | None = None,
    unit_counts: Sequence[Tensor | None] | None = None,
    denominators: Sequence[float],
    scale: float = 1.0,
) -> list[Tensor]:
    """Per-depth weights of the MTP term's microbatch share ``scale · Σ_k numerator_k / den_k``
    (:func:`lossparity.losses.mtp.mtp_numerator`): ``own``/``main``: depth ``k`` gets
    ``scale · token_weights(mode, masks[k], denominator=denominators[k])``; ``pooled``: one denominator,
    and the weights of the depths' masks pooled by :func:`lossparity.losses.mtp.pool_depths` (each sample,
    document or microbatch pools its counts over the depths), split back per depth. ``unit_counts[k]``: see
    :func:`token_weights` (``own``/``main`` only)."""
    check_convention(convention)
    if isinstance(masks, Tensor) or not isinstance(masks, Sequence):
        raise TypeError(f"masks must be a sequence of tensors (one per MTP depth), got {describe(masks)}")
    if not masks:
        raise ValueError("mtp_token_weights needs the mask of at least one MTP depth")
    for k, m in enumerate(masks):
        check_tensor(f"masks[{k}]", m, dims=(1, 2), shape_text="[b, S] or [S]")
    check_real("scale", scale)
    if segment_ids is not None:
        check_int_tensor("segment_ids", segment_ids)
    if isinstance(denominators, Tensor) or not isinstance(denominators, Sequence):
        raise TypeError(f"denominators must be a sequence of numbers (one per MTP depth), got {describe(denominators)}")
    if not denominators:
        raise ValueError("denominators must hold at least one number, got an empty sequence")
    if convention == "pooled":
        seg = None if segment_ids is None else pool_ids(segment_ids, len(masks))
        pooled = token_weights(
            mode, pool_depths(masks), segment_ids=seg, fixed_length=fixed_length, denominator=denominators[0]
        )
        parts = pooled.unflatten(-1, (-1, len(masks))).unbind(-1)  # undo pool_depths' interleaving
        return [scale * part.reshape(m.shape) for part, m in zip(parts, masks)]
    if len(denominators) != len(masks):
        raise ValueError(f"need one denominator per MTP depth: {len(denominators)} for {len(masks)} depths")
    counts = list(unit_counts) if unit_counts is not None else [None] * len(masks)
    return [
        scale * token_weights(mode, m, segment_ids=segment_ids, fixed_length=fixed_length, unit_counts=u, denominator=d)
        for m, u, d in zip(masks, counts, denominators)
    ]
