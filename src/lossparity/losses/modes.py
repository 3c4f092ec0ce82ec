"""Normalization modes of the language-model objective (semantics §1) and their microbatch shares (semantics §3).

Every mode is written as ``J = Σ_mb numerator(mb) / denominator``: a per-microbatch *numerator*
computed from that microbatch's own sample/document statistics, and one *global denominator*
(``Ntok``, ``N``, ``Ndoc`` or ``D·K``) that can be pre-counted from the masks before the first
forward (pre-counted normalizers) or summed as microbatches pass (deferred normalization). This
decomposition is what makes every mode layout-invariant: numerators only need rows, which are never
split across microbatches, and the denominator is a global count.

The table of the modes (unit, numerator, denominator, empty-unit rule) and the definition of a
document live in :mod:`lossparity.losses.mode_table`, shared with the token weights, the integrations,
the JAX port and the log tools; this module computes the units' statistics with torch and applies it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..options import MODE_INFO as _MODE_INFO
from ..options import MODES as _MODES
from ..options import Mode
from ._checks import check_int, check_int_tensor, check_tensor, describe
from .mode_table import MODE_TABLE, check_mode, check_no_fixed_length, mode_spec, reduce_units
from .stats import (
    check_inputs,
    document_stats,
    group_token_counts,
    masked_token_sum,
    rows_documents,
    sample_stats,
    unit_count_map,
)

__all__ = [
    "DENOMINATOR_KEY",
    "unit_count_map",
    "MODES",
    "MODE_INFO",
    "Normalizers",
    "check_mode",
    "count_normalizers",
    "numerator",
    "denominator",
    "objective",
]

MODES: tuple[Mode, ...] = _MODES

# mode -> (formula, frameworks whose objective it matches): one torch-free home in options.py.
MODE_INFO: Mapping[Mode, tuple[str, str]] = _MODE_INFO

# Which global count (a field of Normalizers) divides each mode's numerators.
DENOMINATOR_KEY: Mapping[str, str] = {m: spec.count for m, spec in MODE_TABLE.items()}


@dataclass(frozen=True)
class Normalizers:
    """Global counts of one optimizer step (summed over all microbatches and data-parallel ranks).

    ``tokens = Ntok = Σ_i n_i``, ``samples = N``, ``documents = Ndoc`` (0 when rows are not packed),
    ``microbatches = D·K``. They are exact integers; the divisions of semantics §1 use ``max(·, 1)`` only
    for ``tokens`` (and for the local counts inside numerators).
    """

    tokens: int
    samples: int
    documents: int
    microbatches: int
    groups: int = 0  # Ngrp of per_group: distinct group ids of the step (not additive over microbatches)

    def __post_init__(self) -> None:
        for name in ("tokens", "samples", "documents", "microbatches", "groups"):
            check_int(f"Normalizers.{name}", getattr(self, name), minimum=0)

    @property
    def one(self) -> int:
        """The count of ``token_sum``: its denominator is 1."""
        return 1

    def __add__(self, other: Normalizers) -> Normalizers:
        if self.groups or other.groups:  # a group may have rows on both sides: counts do not add
            raise ValueError("Normalizers with groups do not add: count Ngrp over the whole step's group ids")
        return Normalizers(
            self.tokens + other.tokens,
            self.samples + other.samples,
            self.documents + other.documents,
            self.microbatches + other.microbatches,
        )


def count_normalizers(mask: Tensor, segment_ids: Tensor | None = None) -> Normalizers:
    """Normalizers of one microbatch ``[b, S]``: token count, sample count ``b``, documents, 1 microbatch."""
    check_tensor("mask", mask, dims=(1, 2), shape_text="[b, S] or [S]")
    if segment_ids is not None:
        check_int_tensor("segment_ids", segment_ids)
    w = mask if mask.dim() == 2 else mask.unsqueeze(0)
    docs = 0 if segment_ids is None else rows_documents(segment_ids)[1]
    return Normalizers(int(w.sum().item()), int(w.shape[0]), docs, 1)


def denominator(mode: str, norms: Normalizers, fixed_length: int | None = None) -> float:
    """The global denominator of ``mode`` (``mode_table``): ``max(count, 1)`` of ``Ntok``, ``N``, ``Ndoc``,
    ``D·K`` or ``Ngrp`` (1 for ``token_sum``); the ``max`` turns an empty count into 1 so that an empty batch
    gives ``J = 0``.
    ``sample_sum_norm``'s ``L`` is divided in :func:`numerator`, so its denominator is ``N``: passing
    ``fixed_length`` raises (as in the JAX port) instead of being silently ignored."""
    check_mode(mode)
    if not isinstance(norms, Normalizers):
        raise TypeError(f"norms must be a Normalizers, got {describe(norms)}")
    check_no_fixed_length(fixed_length)
    return float(max(getattr(norms, mode_spec(mode).count), 1))


def _check_arguments(
    mode: str, per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor | None, fixed_length: int | None
) -> None:
    """Kinds and shapes of a mode's inputs (no host synchronization: the values are not scanned here);
    ``segment_ids`` must have the loss's shape when ``per_document`` uses it."""
    check_inputs(
        per_token_loss,
        mask,
        segment_ids if mode == "per_document" else None,
        check_finite=False,
        check_mask_values=False,
        check_segment_values=False,
    )
    check_int("fixed_length", fixed_length, optional=True)


def numerator(
    mode: str,
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    segment_ids: Tensor | None = None,
    fixed_length: int | None = None,
    unit_counts: Tensor | None = None,
    documents: tuple[Tensor, int] | None = None,
    group_ids: Tensor | None = None,
) -> Tensor:
    """The numerator of ``mode`` for one microbatch (module table); differentiable w.r.t. the loss.

    ``per_token_loss`` and ``mask`` are ``[b, S]``. ``per_document`` needs ``segment_ids``;
    ``sample_sum_norm`` needs ``fixed_length`` (the ``L`` of Dr. GRPO), and the division by ``L`` is
    done here so that every mode's denominator is a plain global count. ``unit_counts`` (a
    :func:`unit_count_map` of the whole rows, restricted to these positions) replaces the local unit
    counts of the unit modes: needed when the positions are a context-parallel shard of the rows.
    ``documents`` (``per_document``): ``stats.rows_documents(segment_ids)`` computed and validated by the
    caller beforehand, so that this call has no host synchronization. ``per_group`` needs the group token
    counts: ``unit_counts`` (the global ``n_g`` at every position: groups span microbatches), or
    ``group_ids`` ``[b]`` when these rows hold their groups whole.
    """
    check_mode(mode)
    _check_arguments(mode, per_token_loss, mask, segment_ids if unit_counts is None else None, fixed_length)
    if unit_counts is not None:
        check_tensor("unit_counts", unit_counts)
    if unit_counts is not None and mode_spec(mode).per_unit:
        if unit_counts.shape != mask.shape:
            raise ValueError(f"unit_counts shape {tuple(unit_counts.shape)} does not match mask {tuple(mask.shape)}")
        loss = per_token_loss
        per_pos = torch.where(mask > 0, loss / unit_counts.to(loss.dtype).clamp(min=1), torch.zeros_like(loss))
        return per_pos.sum()
    if mode == "per_group":
        counts = unit_count_map(mode, mask, group_ids=group_ids)
        assert counts is not None
        return numerator(mode, per_token_loss, mask, unit_counts=counts.view_as(mask))
    s, n = _unit_stats(mode, per_token_loss, mask, segment_ids, documents)
    return reduce_units(mode, s, n, fixed_length=fixed_length)


def _unit_stats(
    mode: str, loss: Tensor, mask: Tensor, segment_ids: Tensor | None, documents: tuple[Tensor, int] | None
) -> tuple[Tensor, Tensor]:
    """``(s, n)`` of the units of ``mode`` in one microbatch (``mode_table``): per document, per sample,
    the whole microbatch, or (the summing modes) the masked total, summed as ``F.cross_entropy`` does."""
    unit = mode_spec(mode).unit
    if unit == "document":
        if segment_ids is None:
            raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
        return document_stats(loss, mask, segment_ids, documents=documents)
    if not mode_spec(mode).per_unit:
        total = masked_token_sum(loss, mask)
        return total, total.new_ones(())
    s, n = sample_stats(loss, mask)
    return (s.sum(), n.sum()) if unit == "microbatch" else (s, n)


def objective(
    mode: str,
    per_token_loss: Tensor,
    mask: Tensor,
    *,
    segment_ids: Tensor | None = None,
    microbatch_size: int | None = None,
    fixed_length: int | None = None,
    group_ids: Tensor | None = None,
) -> Tensor:
    """The objective ``J`` of semantics §1 on a whole global batch ``[N, S]`` held in one process.

    ``per_microbatch`` cuts the rows into consecutive microbatches of ``microbatch_size`` rows (the
    layout convention of lossparity: rank ``d`` holds rows ``[d·K·b, (d+1)·K·b)``, microbatch ``k`` of
    it the ``k``-th block of ``b`` rows); the other modes ignore ``microbatch_size``. Equivalent to
    ``Σ_mb numerator(mb) / denominator``, but computed directly from the formula. ``per_group`` needs
    ``group_ids`` ``[N]`` (one group id per row).
    """
    check_mode(mode)
    _check_arguments(mode, per_token_loss, mask, segment_ids, fixed_length)
    check_int("microbatch_size", microbatch_size, optional=True)
    loss = per_token_loss if per_token_loss.dim() == 2 else per_token_loss.unsqueeze(0)
    w = mask if mask.dim() == 2 else mask.unsqueeze(0)
    n_rows = loss.shape[0]
    if mode == "per_microbatch":
        if microbatch_size is None or microbatch_size <= 0 or n_rows % microbatch_size:
            raise ValueError(
                f"mode 'per_microbatch' needs microbatch_size dividing the {n_rows} rows, got {microbatch_size}"
            )
        parts = [
            numerator(mode, loss[i : i + microbatch_size], w[i : i + microbatch_size])
            for i in range(0, n_rows, microbatch_size)
        ]
        return torch.stack(parts).sum() / max(len(parts), 1)
    if mode == "per_token":
        return masked_token_sum(loss, w) / max(float(w.sum()), 1.0)
    if mode == "token_sum":
        return masked_token_sum(loss, w)
    if mode == "per_group":
        if group_ids is None:
            raise ValueError("mode 'per_group' needs group_ids (one group id per row)")
        index, n, ngrp = group_token_counts(w, group_ids)
        s = torch.zeros(ngrp, dtype=loss.dtype, device=loss.device).index_add(0, index, sample_stats(loss, w)[0])
        return (s / n.to(loss.dtype).clamp(min=1)).sum() / max(ngrp, 1)
    if mode == "per_document":
        if segment_ids is None:
            raise ValueError("mode 'per_document' needs segment_ids (packed rows)")
        docs = rows_documents(segment_ids)
        return numerator(mode, loss, w, segment_ids=segment_ids, documents=docs) / max(docs[1], 1)
    num = numerator(mode, loss, w, fixed_length=fixed_length)
    return num / max(n_rows, 1)
