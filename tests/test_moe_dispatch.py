"""The reference MoE layer's fixed-shape dispatch (model/moe.py: sort by expert, grouped or padded batched
matmul, no host read) against the per-expert loop it replaced, written out here: same outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _no_sync import no_host_sync

from lossparity.model.moe import MoE


def loop_dispatch(x, gates, dispatch_map, w1, w3, w2):
    """The previous dispatch: one ``nonzero`` per expert, gather, SwiGLU, gated ``index_add_`` in expert order."""
    out = torch.zeros_like(x)
    for e in range(dispatch_map.shape[1]):
        idx = dispatch_map[:, e].nonzero().squeeze(1)
        xe = x.index_select(0, idx)
        ye = (F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]
        out.index_add_(0, idx, ye * gates[:, e].index_select(0, idx).unsqueeze(1))
    return out


def _layer(dtype, experts=8, topk=2, score="softmax", dim=16, hidden=24):
    torch.manual_seed(0)
    return MoE(dim, hidden, experts, topk, score, shared_expert=False, layer_id=0).to(dtype)


def _grads(layer, x, out):
    g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    params = [x, layer.experts.w1, layer.experts.w3, layer.experts.w2, layer.router.weight]
    return torch.autograd.grad((out * g).sum(), params)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("experts,topk,score", [(8, 2, "softmax"), (4, 1, "sigmoid"), (6, 3, "sigmoid")])
def test_sorted_dispatch_matches_the_per_expert_loop(dtype, experts, topk, score):
    # float64: the padded batched-matmul path; float32 on CPU: torch._grouped_mm.
    layer = _layer(dtype, experts, topk, score)
    x = torch.randn(3, 11, 16, dtype=dtype, requires_grad=True)
    y, record = layer(x)
    gates, _ = layer.router(x.reshape(-1, 16))
    e = layer.experts
    ref = loop_dispatch(x.reshape(-1, 16), gates, record.dispatch_map, e.w1, e.w3, e.w2).view_as(y)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, ref, **tol)
    for got, want in zip(_grads(layer, x, y), _grads(layer, x, ref)):
        torch.testing.assert_close(got, want, **tol)


def test_dispatch_reads_nothing_to_the_host():
    layer = _layer(torch.float32)
    x = torch.randn(2, 9, 16, requires_grad=True)
    with no_host_sync():
        y, _ = layer(x)
        (y * y).sum().backward()
    assert x.grad is not None and layer.experts.w2.grad is not None


def test_an_expert_without_tokens_gets_a_zero_gradient():
    layer = _layer(torch.float64, experts=8, topk=1)
    with torch.no_grad():
        layer.router.expert_bias[3] = 1e6  # every token goes to expert 3 (the bias selects, gates unbiased)
    x = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True)
    y, record = layer(x)
    assert bool(record.dispatch_map[:, 3].all())
    y.sum().backward()
    w1 = layer.experts.w1.grad
    assert float(w1[3].abs().sum()) > 0 and all(float(w1[e].abs().sum()) == 0 for e in range(8) if e != 3)


def test_sorted_dispatch_under_bfloat16_autocast():
    # Under CPU autocast the loop's matmuls run in bfloat16; the grouped matmul (not on autocast's op lists)
    # gets its operands cast to the autocast dtype, so both compute the experts in bfloat16.
    layer = _layer(torch.float32)
    x = torch.randn(2, 13, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, record = layer(x)
        gates, _ = layer.router(x.reshape(-1, 16))
        e = layer.experts
        ref = loop_dispatch(x.reshape(-1, 16), gates, record.dispatch_map, e.w1, e.w3, e.w2).view_as(y)
    assert y.dtype == ref.dtype
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
