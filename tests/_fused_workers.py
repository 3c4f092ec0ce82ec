"""Workers of the fused cross-entropy's multi-process tests (importable by ``spawn``)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_fused(rank: int, world: int, z_loss: float):
    """Each rank holds a vocabulary slice of the head (uneven: the last rank holds the remainder);
    returns ``(J, per-token losses, grad_h, grad of the local weight rows, inputs, (lo, rows))``."""
    from lossparity.losses.fused_cross_entropy import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(7)
    T, V, H = 41, 53, 8
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::6] = -100
    weights = torch.randn(T, generator=g, dtype=torch.float64)
    base = V // world
    lo = rank * base
    rows = base if rank < world - 1 else V - lo
    h = hidden.clone().requires_grad_()
    w = weight[lo : lo + rows].clone().requires_grad_()
    total, loss = fused_linear_cross_entropy(
        h,
        w,
        labels,
        weights,
        chunk_size=8,
        vocab_chunk_size=7,
        z_loss_coeff=z_loss,
        vocab_parallel_group=dist.group.WORLD,
        vocab_start=lo,
        vocab_size=V,
    )
    (3.0 * total).backward()
    return total.detach(), loss, h.grad, w.grad, (hidden, weight, labels, weights), (lo, rows)
