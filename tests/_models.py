"""A tiny deterministic language model and global batch shared by the GA/DP invariance tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

V, S, H = 11, 9, 6


class TinyLM(nn.Module):
    """Embedding -> tanh MLP -> output head; per-token cross-entropy. Rows are independent."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(42)
        self.emb = nn.Parameter(torch.randn(V, H, generator=g, dtype=dtype))
        self.w1 = nn.Parameter(torch.randn(H, H, generator=g, dtype=dtype) / H**0.5)
        self.out = nn.Parameter(torch.randn(V, H, generator=g, dtype=dtype) / H**0.5)

    def forward(self, tokens, labels):
        h = torch.tanh(self.emb[tokens] @ self.w1)
        logits = h @ self.out.T
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none", ignore_index=-100).view(
            labels.shape
        )


def global_batch(n_rows: int, seed: int = 0):
    """Tokens, labels, mask, segment ids of ``n_rows`` rows with uneven lengths and empty rows."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n_rows, S), generator=g)
    labels = torch.randint(0, V, (n_rows, S), generator=g)
    lengths = torch.randint(0, S + 1, (n_rows,), generator=g)
    lengths[1] = 0  # an all-padding sample
    pos = torch.arange(S)[None, :]
    mask = (pos < lengths[:, None]).double()
    labels = torch.where(mask > 0, labels, torch.full_like(labels, -100))
    seg = torch.where(pos < (lengths[:, None] + 1) // 2, 1, 2)
    seg = torch.where(pos < lengths[:, None].clamp(min=1), seg, 0)
    return tokens, labels, mask, seg


def reference(mode: str, b: int, n_rows: int):
    """Naive single-process float64 on the whole ``global_batch(n_rows)``: the objective ``J`` of
    ``mode`` (``per_microbatch`` with ``b`` rows per microbatch), its gradients, and the token mean."""
    import lossparity as lp

    tokens, labels, mask, seg = global_batch(n_rows)
    model = TinyLM()
    J = lp.objective(
        mode, model(tokens, labels), mask, segment_ids=seg, microbatch_size=b, fixed_length=tokens.shape[1]
    )
    J.backward()
    lm = float((model(tokens, labels).detach() * mask).sum() / mask.sum())
    return float(J.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, lm
