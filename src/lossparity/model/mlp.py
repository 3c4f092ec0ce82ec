"""SwiGLU feed-forward (Shazeer, 2020), used by the dense layers and the shared expert."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """``y = W2 (silu(W1 x) ⊙ W3 x)``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the gated MLP to the last dimension of ``x``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
