"""benchmarks/moe_aux_compiled.py times the right math: its eager ``aux_math`` (float32) against the formula of
its docstring written out naively in float64, the z-loss gradient by float64 autograd (the compiled variant
and its timings are the benchmark's, run by hand: ``python -m benchmarks.bench_moe_aux --compiled``)."""

from __future__ import annotations

import torch

from benchmarks.moe_aux_compiled import aux_math


def test_aux_math_matches_naive_float64():
    gen = torch.Generator().manual_seed(0)
    n, t, e, topk, aux_c, z_c = 3, 40, 6, 2, 1e-2, 1e-3
    logits = torch.randn(n, t, e, generator=gen, dtype=torch.float64) * 3
    probs = logits.softmax(-1)
    top = torch.zeros_like(probs).scatter_(-1, probs.topk(topk, dim=-1).indices, 1.0)
    valid = (torch.arange(t) < 29).double()  # 11 padding tokens
    w = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)

    # naive float64: token by token, layer by layer
    x = logits.clone().requires_grad_()
    tt = float(valid.sum())
    want_share = torch.zeros((), dtype=torch.float64)
    want_k = torch.zeros(n, e, dtype=torch.float64)
    for layer in range(n):
        p_sum = sum(valid[i] * probs[layer, i] for i in range(t))
        c = sum(valid[i] * top[layer, i] for i in range(t))
        want_k[layer] = aux_c * e * c / (topk * tt * tt)
        z = sum(valid[i] * torch.logsumexp(x[layer, i], 0) ** 2 for i in range(t))
        want_share = want_share + w[layer] * ((want_k[layer] * p_sum).sum() + z_c * z / tt)
    (want_g,) = torch.autograd.grad(want_share, x)

    stacked = torch.cat([probs, top, logits]).float()
    share, k, g = aux_math(stacked, valid.float(), w.float(), topk=topk, num_experts=e, aux_coeff=aux_c, z_coeff=z_c)
    # float32 inputs and sums of 29 terms: a few float32 ulps
    torch.testing.assert_close(share.double(), want_share.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(k.double(), want_k, rtol=1e-5, atol=0)
    torch.testing.assert_close(g.double(), want_g, rtol=1e-5, atol=1e-12)
    assert float(want_g[:, 29:].abs().max()) == 0.0 and float(g[:, 29:].abs().max()) == 0.0  # padding: no gradient
