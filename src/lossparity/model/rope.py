"""Rotary position embeddings (RoPE, Su et al. 2021) driven by per-token positions.

Positions are an explicit ``[B, S]`` tensor instead of ``arange(S)`` so that every document of a packed
row starts again at position 0: a document then sees exactly the rotations it would see alone in a
row, which is what makes the model's outputs independent of how documents are packed.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["positions_from_segments", "rope_cos_sin", "apply_rope"]


def positions_from_segments(segment_ids: Tensor) -> Tensor:
    """Per-token positions ``[B, S]`` (int64) that restart at 0 wherever the segment id changes:
    ``pos[b, t] = t - start(b, t)`` with ``start`` the first index of the run of equal ids containing
    ``t``. Padding (id 0) runs are numbered like any other run."""
    if segment_ids.dim() != 2:
        raise ValueError(f"segment_ids must be [B, S], got shape {tuple(segment_ids.shape)}")
    B, S = segment_ids.shape
    idx = torch.arange(S, device=segment_ids.device).expand(B, S)
    boundary = torch.ones_like(segment_ids, dtype=torch.bool)
    boundary[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start = torch.where(boundary, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Cosine and sine tables ``[B, S, 1, head_dim/2]`` in ``dtype`` for ``positions [B, S]``:
    angle ``a[b, t, i] = pos[b, t] · theta^(-2i/head_dim)``. Angles are formed in float64 so that the
    float32 tables are correctly rounded and the float64 ones exact to rounding."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    inv_freq = theta ** (-exponents)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, S, H, D]`` (rotate-half convention: pairs ``(x[i], x[i + D/2])``):
    ``(x1, x2) -> (x1·cos - x2·sin, x1·sin + x2·cos)``, computed in ``cos.dtype``, returned in ``x.dtype``."""
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)
