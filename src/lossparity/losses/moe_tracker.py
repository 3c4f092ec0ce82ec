"""The MoE trackers' log arithmetic (semantics §5, docs/moe.md): the value a framework's loss tracker logs,
from the terms its routers added to the objective. Public path: ``lossparity.moe.tracker_log_value``."""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_tensor as _check_tensor

__all__ = ["tracker_log_value"]


def tracker_log_value(
    terms: Tensor,
    coeff: float | Tensor,
    *,
    num_layers: int | None = None,
    num_microbatches: int | None = None,
) -> Tensor:
    """The value an MoE loss tracker logs (Megatron's ``track_moe_metrics``, MindFormers' ``track_moe_metrics``
    with its callback's ``÷ num_accumulation_steps``), from the terms the routers added to the objective:

    ``log = mean_r [ (1/G) · (1/L) · Σ_m Σ_l terms[r, m, l] / α_l ]``

    ``terms [..., M, L]``: the term of MoE layer ``l`` in microbatch ``m`` (the coefficient included, as added to
    the objective; 0 where a layer did not run), leading dims ``r`` (e.g. the data-parallel ranks) averaged;
    ``coeff`` ``α`` (a number, or ``[L]`` per layer; a layer with ``α = 0`` logs 0); ``L = num_layers``
    (default ``terms.shape[-1]``; the MoE layers of the whole model, MTP layers included, when ``terms`` holds
    only this stage's); ``G = num_microbatches`` (default ``M``: the gradient-accumulation steps). So: ÷ the
    coefficient, Σ over microbatches, mean over layers, ÷ GA. Megatron's ``global_aux_loss`` log sums over
    its TP×DP×CP ranks instead of averaging: sum the per-rank results. Float32 (float64 stays float64).
    """
    _check_tensor("terms", terms)
    if not terms.is_floating_point() or terms.dim() < 2:
        raise ValueError(
            f"terms must be a float tensor [..., microbatches, layers], got {terms.dtype} {tuple(terms.shape)}"
        )
    m, n = terms.shape[-2], terms.shape[-1]
    for name, v in (("num_layers", num_layers), ("num_microbatches", num_microbatches)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    layers = n if num_layers is None else num_layers
    if layers < n:
        raise ValueError(f"num_layers={layers} is smaller than the {n} layers of terms {tuple(terms.shape)}")
    ga = m if num_microbatches is None else num_microbatches
    x = terms if terms.dtype == torch.float64 else terms.float()
    a = torch.as_tensor(coeff, dtype=x.dtype, device=x.device)
    if a.dim() > 1 or (a.dim() == 1 and a.shape[0] != n):
        raise ValueError(f"coeff must be a number or [layers={n}], got shape {tuple(a.shape)}")
    if a.numel() and bool(((a < 0) | ~torch.isfinite(a)).any()):
        raise ValueError("coeff must be finite and >= 0")
    # ÷ α per layer (a layer without a loss, α = 0, contributes 0, as a tracker that never received it)
    per_layer = torch.where(a > 0, x / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(x))
    per_rank = per_layer.sum(dim=(-2, -1)) / (layers * ga)
    return per_rank.mean() if per_rank.dim() else per_rank
