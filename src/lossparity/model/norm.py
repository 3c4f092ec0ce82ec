"""RMSNorm (Zhang & Sennrich, 2019), computed in at least float32."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x², last dim) + eps) · weight``, no bias, no mean subtraction."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalize ``x`` over its last dimension. The statistic is taken in ``max(x.dtype, float32)``
        (bf16 activations would lose the small-variance rows otherwise); the result has ``x.dtype``."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.to(dtype)).to(x.dtype)
