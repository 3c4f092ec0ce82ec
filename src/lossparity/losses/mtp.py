"""Multi-token prediction (MTP) labels, masks and objective (semantics §4).

Depth ``k`` predicts, from position ``t``, the token that the main head predicts from ``t + k``:
its labels and mask are the main ones rolled left by ``k`` within each sequence (and within each
document of a packed row), the vacated tail masked. The objective term is built from per-depth
statistics with one of three count conventions:

- ``own`` (default, exact): ``λ·(1/Dm)·Σ_k J_k`` with ``J_k`` the active mode on depth ``k`` alone
  (``per_token``: ``S_k / max(Ntok_k, 1)``; ``per_sample``: every (depth, sample) pair weighs the same,
  which is MaxText's ``mtp_per_layer_loss_norm=True``).
- ``main`` (DeepSeek-V3 paper, torchtitan, Megatron ``calculate_per_token_loss=True``): as ``own`` but
  every depth is divided by the main loss's denominator (differs from ``own`` only for ``per_token``).
- ``pooled`` (MaxText): one ``J`` over all depths pooled, no ``1/Dm``: ``per_token``:
  ``λ·Σ_k S_k / max(Σ_k Ntok_k, 1)``; ``per_sample``: ``λ·(1/N) Σ_i Σ_k s_ki / max(Σ_k n_ki, 1)``
  (``mtp_per_layer_loss_norm=False``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from ..options import MTP_CONVENTIONS, MTP_LOG_ESTIMATORS, MTPConvention, MTPLogEstimator, check_option
from ._checks import check_int, check_int_tensor, check_real, check_same_shape, check_tensor, describe
from .modes import check_mode, numerator, objective
from .stats import check_inputs, document_ids

__all__ = [
    "CONVENTIONS",
    "roll_mtp",
    "roll_mask",
    "mtp_numerator",
    "mtp_objective",
    "check_convention",
    "mtp_denominators",
    "mtp_scale",
    "LOG_ESTIMATORS",
    "token_mean",
    "microbatch_mean",
    "mtp_log_value",
    "mtp_log_losses",
]

LOG_ESTIMATORS: tuple[MTPLogEstimator, ...] = MTP_LOG_ESTIMATORS

CONVENTIONS: tuple[MTPConvention, ...] = MTP_CONVENTIONS


def check_convention(convention: str) -> MTPConvention:
    """Return ``convention`` if it is one of :data:`CONVENTIONS`, else raise ``ValueError``."""
    return check_option("mtp_convention", convention, MTP_CONVENTIONS)


def mtp_denominators(mode: str, convention: str, main_denominator: float, depth_tokens: Sequence[float]) -> list[float]:
    """The global denominators of the MTP term's numerators (semantics §4), one place for the accountant's
    gradient shares and its logs. Same argument order as the JAX ``mtp_denominators(mode, convention,
    main_norms, depth_norms)``, which takes the step's ``Normalizers`` instead of reduced counts.

    ``own``/``main``: one per depth; ``own`` with ``per_token`` divides depth ``k`` by ``max(Ntok_k, 1)``,
    every other case by the main loss's denominator ``main_denominator`` (already ``max(·, 1)``).
    ``pooled``: one value, ``max(Σ_k Ntok_k, 1)`` for ``per_token``, else ``main_denominator``.
    ``depth_tokens[k-1]`` is ``Ntok_k``, the global loss-bearing token count of depth ``k``.
    """
    if convention == "pooled":
        return [max(float(sum(depth_tokens)), 1.0) if mode == "per_token" else main_denominator]
    if mode == "per_token" and convention == "own":
        return [max(float(n), 1.0) for n in depth_tokens]
    return [main_denominator] * len(depth_tokens)


def mtp_scale(weight: float, convention: str, depths: int) -> float:
    """The factor of the summed per-depth terms: ``λ/Dm`` (``own``/``main``), ``λ`` (``pooled``)."""
    return weight / (1 if convention == "pooled" else depths)


def token_mean(loss_sum: float, tokens: float) -> float | None:
    """The ``token_mean`` log estimator of a depth: ``S_k / Ntok_k`` (the global token mean), ``None``
    (reported as missing) when ``Ntok_k = 0``. ``loss_sum``/``tokens`` are summed over microbatches and ranks."""
    return None if tokens == 0 else loss_sum / tokens


def microbatch_mean(local_means_sum: float, microbatches: float) -> float:
    """The ``microbatch_mean`` log estimator (Megatron's tracker): ``(1/M) Σ_mb s_{k,mb} / max(n_{k,mb}, 1)``,
    the mean over the ``M`` microbatches of every data-parallel (and CP) rank of their local token means;
    ``local_means_sum`` is ``Σ_mb s_{k,mb}/max(n_{k,mb}, 1)``. 0 when ``M = 0``."""
    return local_means_sum / max(microbatches, 1.0)


def mtp_log_value(
    estimator: str, loss_sum: float, tokens: float, local_means_sum: float, microbatches: float
) -> float | None:
    """The logged ``mtp_<k>_loss`` (not multiplied by ``λ``) under ``estimator``: :func:`token_mean` of
    ``(S_k, Ntok_k)`` or :func:`microbatch_mean` of ``(Σ_mb local means, M)`` (semantics §4)."""
    est = check_option("mtp_log_estimator", estimator, MTP_LOG_ESTIMATORS)
    return token_mean(loss_sum, tokens) if est == "token_mean" else microbatch_mean(local_means_sum, microbatches)


def mtp_log_losses(
    losses: Sequence[Tensor],
    masks: Sequence[Tensor],
    *,
    estimator: str = "token_mean",
    microbatch_size: int | None = None,
) -> list[float | None]:
    """The logged ``mtp_<k>_loss`` of every depth on a whole global batch in one process: ``losses[k-1]`` and
    ``masks[k-1]`` ``[N, S]`` (rolled, :func:`roll_mtp`). ``token_mean``: ``S_k / Ntok_k`` (``None`` without
    tokens); ``microbatch_mean``: the rows cut into microbatches of ``microbatch_size`` rows, mean over them of
    ``s_{k,mb} / max(n_{k,mb}, 1)`` (host floats: a log, not a hot path)."""
    est = check_option("mtp_log_estimator", estimator, MTP_LOG_ESTIMATORS)
    _check_depths(losses, masks)
    out: list[float | None] = []
    for k, (x, w) in enumerate(zip(losses, masks), start=1):
        check_inputs(x, w, None, where=f"MTP depth {k}")
        x2, w2 = (x, w) if x.dim() == 2 else (x.unsqueeze(0), w.unsqueeze(0))
        lw = torch.where(w2 > 0, x2.double() * w2.double(), torch.zeros((), dtype=torch.float64))
        if est == "token_mean":
            out.append(token_mean(float(lw.sum()), float(w2.double().sum())))
            continue
        check_int("microbatch_size", microbatch_size, minimum=1)
        assert microbatch_size is not None  # checked above
        means = [
            float(lw[i : i + microbatch_size].sum()) / max(float(w2[i : i + microbatch_size].double().sum()), 1.0)
            for i in range(0, x2.shape[0], microbatch_size)
        ]
        out.append(microbatch_mean(sum(means), len(means)))
    return out


def pool_depths(xs: Sequence[Tensor]) -> Tensor:
    """The depths' ``[b, S]`` (or ``[S]``) tensors pooled into one ``[b, S·Dm]``, interleaved: the ``Dm``
    copies of a position sit next to each other (``out[i, t·Dm + k-1] = xs[k-1][i, t]``), so that every
    row, document (a run of ids, semantics §0) and microbatch keeps one contiguous piece and pools its
    sums and counts over the depths. Segment ids are pooled with :func:`pool_ids`."""
    x2 = [x if x.dim() == 2 else x.unsqueeze(0) for x in xs]
    return torch.stack(x2, dim=-1).flatten(-2)


def pool_ids(ids: Tensor, depths: int) -> Tensor:
    """Segment ids (or document indices) of :func:`pool_depths`' layout: each position repeated ``depths``
    times in place."""
    ids2 = ids if ids.dim() == 2 else ids.unsqueeze(0)
    return ids2.repeat_interleave(depths, dim=-1)


def _shift_left(x: Tensor, k: int, fill: int | float) -> Tensor:
    out = torch.full_like(x, fill)
    if k < x.shape[-1]:
        out[..., : x.shape[-1] - k] = x[..., k:]
    return out


def roll_mask(mask: Tensor, segment_ids: Tensor | None, k: int) -> Tensor:
    """The depth-``k`` loss mask: ``w_k[i,t] = w[i,t+k]`` when ``t+k`` is inside row ``i`` and (with
    ``segment_ids``) in the same document as ``t``, else 0. Works on ``[B, S]`` or ``[S]``."""
    check_tensor("mask", mask, dims=(1, 2), shape_text="[B, S] or [S]")
    check_int("k", k, minimum=0)
    if segment_ids is not None:
        check_int_tensor("segment_ids", segment_ids)
        if segment_ids.shape != mask.shape and (
            segment_ids.numel() == mask.numel() and segment_ids.shape[-1:] == mask.shape[-1:]
        ):
            segment_ids = segment_ids.reshape(mask.shape)  # the same rows, one of them as [S] and [1, S]
        check_same_shape("segment_ids", segment_ids, "mask", mask)
    if k == 0:
        return mask
    w = _shift_left(mask, k, 0)
    if segment_ids is not None:
        doc = document_ids(segment_ids)  # same document = same run of ids (semantics §0), not the same id
        same = (_shift_left(doc, k, -1) == doc) & (doc > 0)
        w = torch.where(same, w, torch.zeros_like(w))
    return w


def roll_mtp(
    labels: Tensor, mask: Tensor, segment_ids: Tensor | None, k: int, *, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """Labels and mask of MTP depth ``k`` (semantics §4): both rolled left by ``k`` within each row and each
    document; rolled-out positions get ``ignore_index`` and mask 0. Raises if ``k`` is not smaller than
    the sequence length (the depth would have no position at all)."""
    check_int_tensor("labels", labels, dims=(1, 2), shape_text="[B, S] or [S]")
    check_tensor("mask", mask)
    if labels.shape != mask.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match mask shape {tuple(mask.shape)}")
    check_int("k", k, minimum=0)
    check_int("ignore_index", ignore_index)
    if k >= labels.shape[-1]:
        raise ValueError(f"MTP depth k={k} must be smaller than the sequence length {labels.shape[-1]}")
    w = roll_mask(mask, segment_ids, k)
    lab = torch.where(w > 0, _shift_left(labels, k, ignore_index), torch.full_like(labels, ignore_index))
    return lab, w


def _check_depths(losses: Sequence[Tensor], masks: Sequence[Tensor]) -> None:
    """``losses`` and ``masks``: sequences of tensors (not one tensor), one of each per MTP depth, at least one."""
    for name, seq in (("losses", losses), ("masks", masks)):
        if isinstance(seq, Tensor) or not isinstance(seq, Sequence):
            raise TypeError(f"{name} must be a sequence of tensors (one per MTP depth), got {describe(seq)}")
        for k, x in enumerate(seq):
            check_tensor(f"{name}[{k}]", x)
    if len(losses) != len(masks) or not losses:
        raise ValueError(
            f"need one mask per MTP depth and at least one depth: {len(losses)} losses, {len(masks)} masks"
        )


def mtp_numerator(
    mode: str,
    losses: Sequence[Tensor],
    masks: Sequence[Tensor],
    *,
    convention: str = "own",
    segment_ids: Tensor | None = None,
    fixed_length: int | None = None,
    documents: tuple[Tensor, int] | None = None,
) -> list[Tensor]:
    """Per-microbatch numerators of the MTP term, before ``λ`` and before the global denominators.

    ``own``/``main``: one numerator per depth, each the mode's numerator (:func:`numerator`) of that
    depth's per-token losses and rolled mask. ``pooled``: a one-element list holding the numerator of
    the depths pooled (:func:`pool_depths`), so that each sample (document, microbatch) pools its sums
    and counts over the depths. ``documents``: the
    ``rows_documents(segment_ids)`` of the microbatch, validated by the caller (no host sync).
    """
    check_mode(mode)
    check_convention(convention)
    _check_depths(losses, masks)
    if convention == "pooled":
        loss, mask = pool_depths(losses), pool_depths(masks)
        seg = None if segment_ids is None else pool_ids(segment_ids, len(losses))
        # The same documents, hence the same numbering, each position repeated per depth.
        docs = None if documents is None else (pool_ids(documents[0], len(losses)), documents[1])
        return [numerator(mode, loss, mask, segment_ids=seg, fixed_length=fixed_length, documents=docs)]
    return [
        numerator(mode, x, w, segment_ids=segment_ids, fixed_length=fixed_length, documents=documents)
        for x, w in zip(losses, masks)
    ]


def mtp_objective(
    mode: str,
    losses: Sequence[Tensor],
    masks: Sequence[Tensor],
    main_mask: Tensor,
    *,
    weight: float = 1.0,
    convention: str = "own",
    segment_ids: Tensor | None = None,
    microbatch_size: int | None = None,
    fixed_length: int | None = None,
) -> Tensor:
    """The MTP objective term on a whole global batch in one process (see module docstring).

    ``losses[k-1]`` and ``masks[k-1]`` are depth ``k``'s per-token losses and rolled mask ``[N, S]``;
    ``main_mask`` is the main loss mask (for the ``main`` convention's count). Returns
    ``λ·(1/Dm)·Σ_k J_k`` (``own``/``main``) or ``λ·J_pooled`` (``pooled``).
    """
    check_convention(convention)
    _check_depths(losses, masks)
    check_tensor("main_mask", main_mask)
    check_real("weight", weight)
    for k, (x, w) in enumerate(zip(losses, masks), start=1):
        check_inputs(x, w, segment_ids, where=f"MTP depth {k}")
    if convention == "pooled":
        seg = None if segment_ids is None else pool_ids(segment_ids, len(losses))
        if mode == "per_token":
            # a Tensor for one or more depths (for none, sum would be the int 0: not a valid MTP input)
            s = cast(Tensor, sum((x * w).sum() for x, w in zip(losses, masks)))
            n = sum(w.sum() for w in masks)
            return weight * s / max(float(n), 1.0)
        return weight * objective(
            mode,
            pool_depths(losses),
            pool_depths(masks),
            segment_ids=seg,
            microbatch_size=microbatch_size,
            fixed_length=fixed_length,
        )
    terms = []
    for x, w in zip(losses, masks):
        if convention == "main" and mode == "per_token":
            terms.append(torch.where(w > 0, x, torch.zeros_like(x)).sum() / max(float(main_mask.sum()), 1.0))
        else:
            terms.append(
                objective(
                    mode, x, w, segment_ids=segment_ids, microbatch_size=microbatch_size, fixed_length=fixed_length
                )
            )
    return weight * torch.stack(terms).mean()
