"""The trainer's one gradient-clipping helper against the naive float64 formula (single process)."""

from __future__ import annotations

import math

import torch

from lossparity.training.grads import all_reduce_coalesced, clip_grad_norm, total_grad_norm


def _params(seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in ((3, 4), (5,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * scale
    return ps


def _naive_norm(ps) -> float:
    return math.sqrt(sum(float(x) ** 2 for p in ps for x in p.grad.flatten().tolist()))


def test_norm_and_clipping_match_the_formula():
    ps = _params(0, 3.0)
    before = [p.grad.clone() for p in ps]
    want = _naive_norm(ps)
    got = clip_grad_norm(ps, max_norm=1.0)
    assert abs(got - want) <= 1e-12 * want
    coef = 1.0 / (want + 1e-6)
    for p, b in zip(ps, before):
        assert torch.allclose(p.grad, b * coef, rtol=1e-12, atol=0)


def test_no_clipping_below_the_threshold_or_when_disabled():
    for max_norm in (1e9, 0.0):
        ps = _params(1, 0.1)
        before = [p.grad.clone() for p in ps]
        clip_grad_norm(ps, max_norm=max_norm)
        assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))


def test_norm_over_a_subset_counts_a_shared_parameter_once():
    ps = _params(2, 1.0)
    counted = ps[:2]
    assert abs(float(total_grad_norm([p.grad for p in counted])) - _naive_norm(counted)) <= 1e-12


def test_all_reduce_coalesced_without_group_is_a_no_op():
    ts = [torch.ones(2), torch.arange(3.0)]
    all_reduce_coalesced(ts, None)
    assert torch.equal(ts[1], torch.arange(3.0))
