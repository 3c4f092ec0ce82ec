"""MoE auxiliary losses (semantics §5) against naive float64 loops and hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch

import lossparity.moe as moe_alias
from lossparity.losses import moe

# ------------------------------------------------------------------------------------------------
# naive float64 references (loops over tokens / experts, written independently of the code)
# ------------------------------------------------------------------------------------------------


def naive_probs(logits: torch.Tensor, score_function: str) -> list[list[float]]:
    rows = []
    for row in logits.double().tolist():
        if score_function == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            rows.append([v / sum(ex) for v in ex])
        else:
            s = [1.0 / (1.0 + math.exp(-v)) for v in row]
            rows.append([v / sum(s) for v in s])
    return rows


def naive_topk_sets(probs: torch.Tensor, k: int) -> list[set[int]]:
    out = []
    for row in probs.tolist():
        order = sorted(range(len(row)), key=lambda e: -row[e])
        out.append(set(order[:k]))
    return out


def naive_switch(probs, counts, total, k, num_experts, coeff) -> float:
    acc = 0.0
    for e in range(num_experts):
        p_e = 0.0
        for x in range(len(probs)):
            p_e += float(probs[x][e])
        acc += float(counts[e]) * p_e
    return coeff * num_experts / (k * total * total) * acc


def naive_seq_loss(probs, valid, k, coeff) -> list[float]:
    """probs [N][L][E] float, valid [N][L] bool -> per-sequence A(X_j) with the sequence's own counts."""
    out = []
    for seq_p, seq_v in zip(probs, valid):
        num_experts = len(seq_p[0])
        toks = [x for x in range(len(seq_p)) if seq_v[x]]
        if not toks:
            out.append(0.0)
            continue
        counts = [0] * num_experts
        for x in toks:
            for e in naive_topk_sets(torch.tensor([seq_p[x]]), k)[0]:
                counts[e] += 1
        out.append(naive_switch([seq_p[x] for x in toks], counts, len(toks), k, num_experts, coeff))
    return out


def naive_lse2(row) -> float:
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return lse * lse


def rand_logits(*shape, seed=0, scale=2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# ------------------------------------------------------------------------------------------------
# router scores and routing map
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_router_probs_matches_float64_formula(score_function):
    logits = rand_logits(7, 6, seed=1)
    got = moe.router_probs(logits, score_function)
    assert got.dtype == torch.float32 and got.shape == (7, 6)
    want = torch.tensor(naive_probs(logits, score_function), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.sum(-1).double(), torch.ones(7, dtype=torch.float64), rtol=1e-6, atol=0)


def test_router_probs_low_precision_input_is_computed_in_float32():
    logits = rand_logits(3, 2, 5, seed=2).bfloat16()
    got = moe.router_probs(logits, "softmax")
    assert got.dtype == torch.float32 and got.shape == (3, 2, 5)
    want = torch.tensor(naive_probs(logits.float().reshape(6, 5), "softmax")).reshape(3, 2, 5)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)


def test_router_probs_bad_score_function():
    with pytest.raises(ValueError, match="score_function.*softmax.*sigmoid.*'relu'"):
        moe.router_probs(rand_logits(2, 3), "relu")
    with pytest.raises(TypeError, match="logits"):
        moe.router_probs(torch.ones(2, 3, dtype=torch.int64))


def test_topk_routing_map_and_counts():
    probs = moe.router_probs(rand_logits(9, 5, seed=3))
    m = moe.topk_routing_map(probs, 2)
    assert m.dtype == torch.bool and m.shape == (9, 5)
    sets = naive_topk_sets(probs, 2)
    for x in range(9):
        assert {e for e in range(5) if m[x, e]} == sets[x]
    pad = torch.tensor([False, True, False, False, True, False, False, False, True])
    counts = moe.tokens_per_expert(m, keep_mask=~pad)
    want = [sum(1 for x in range(9) if not pad[x] and e in sets[x]) for e in range(5)]
    assert counts.dtype == torch.int64 and counts.tolist() == want
    assert moe.tokens_per_expert(m).tolist() == [sum(e in s for s in sets) for e in range(5)]
    assert int(moe.tokens_per_expert(m).sum()) == 9 * 2


def test_topk_routing_map_bad_topk():
    probs = torch.rand(4, 3)
    for k in (0, 4, -1):
        with pytest.raises(ValueError, match=f"topk must be in 1..num_experts=3, got {k}"):
            moe.topk_routing_map(probs, k)
    with pytest.raises(TypeError, match="topk"):
        moe.topk_routing_map(probs, 1.0)


# ------------------------------------------------------------------------------------------------
# switch load-balancing loss
# ------------------------------------------------------------------------------------------------


def test_switch_perfect_balance_is_exactly_coeff():
    # 4 tokens, 4 experts, top-1, each token to a different expert, uniform scores.
    probs = torch.full((4, 4), 0.25)
    counts = torch.tensor([1, 1, 1, 1])
    loss = moe.switch_load_balancing_loss(probs, counts, 4, 1, 4, 0.01)
    assert loss.item() == pytest.approx(0.01, rel=1e-7)
    # One-hot scores routed to their own expert: still perfectly balanced.
    loss = moe.switch_load_balancing_loss(torch.eye(4), counts, 4, 1, 4, 1.0)
    assert loss.item() == 1.0
    # top-2 of 4 with uniform scores over 2 tokens: c = [1,1,1,1], Σ_x p = [0.5]*4 -> 1.
    loss = moe.switch_load_balancing_loss(torch.full((2, 4), 0.25), counts, 2, 2, 4, 1.0)
    assert loss.item() == 1.0


def test_switch_hand_worked_imbalance():
    # 2 tokens both on expert 0 with p = [1, 0]: c = [2, 0], Σ p = [2, 0] -> 2/(1*4) * 4 = 2 (times coeff).
    probs = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss = moe.switch_load_balancing_loss(probs, torch.tensor([2, 0]), 2, 1, 2, 0.5)
    assert loss.item() == 1.0


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_switch_matches_float64_loop(score_function):
    num_experts, k, t = 8, 3, 13
    probs = moe.router_probs(rand_logits(t, num_experts, seed=4), score_function)
    counts = moe.tokens_per_expert(moe.topk_routing_map(probs, k))
    got = moe.switch_load_balancing_loss(probs, counts, t, k, num_experts, 0.03)
    want = naive_switch(probs.double().tolist(), counts.tolist(), t, k, num_experts, 0.03)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_switch_gradient_only_through_probs():
    num_experts, k, t, coeff = 5, 2, 6, 0.2
    logits = rand_logits(t, num_experts, seed=5).requires_grad_(True)
    probs = moe.router_probs(logits)
    counts = moe.tokens_per_expert(moe.topk_routing_map(probs, k)).float().requires_grad_(True)
    probs.retain_grad()
    moe.switch_load_balancing_loss(probs, counts, t, k, num_experts, coeff).backward()
    assert counts.grad is None
    # dA/dp[x,e] = coeff * E/(k T^2) * c_e, the same for every token.
    want = (coeff * num_experts / (k * t * t) * counts.detach().double()).expand(t, num_experts)
    torch.testing.assert_close(probs.grad.double(), want, rtol=1e-6, atol=0)
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_switch_shard_decomposition_equals_whole_batch():
    # Megatron identity: with counts/T at the global level, the sum over shards of the loss on local
    # probs equals the loss of the whole token set.
    num_experts, k = 6, 2
    probs = moe.router_probs(rand_logits(12, num_experts, seed=6))
    counts = moe.tokens_per_expert(moe.topk_routing_map(probs, k))
    whole = moe.switch_load_balancing_loss(probs, counts, 12, k, num_experts, 1.0)
    parts = sum(moe.switch_load_balancing_loss(p, counts, 12, k, num_experts, 1.0) for p in probs.split(4))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_switch_padding_mask_and_tensor_total():
    num_experts, k = 4, 1
    probs = moe.router_probs(rand_logits(5, num_experts, seed=7))
    pad = torch.tensor([False, True, False, True, False])
    probs_nan = probs.clone()
    probs_nan[1] = float("nan")  # garbage under padding must not leak
    m = moe.topk_routing_map(probs, k)
    counts = moe.tokens_per_expert(m, keep_mask=~pad)
    total = (~pad).sum()
    got = moe.switch_load_balancing_loss(probs_nan, counts, total, k, num_experts, 1.0, keep_mask=~pad)
    keep = [x for x in range(5) if not pad[x]]
    want = naive_switch([probs[x].tolist() for x in keep], counts.tolist(), 3, k, num_experts, 1.0)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_switch_zero_counts_give_zero():
    probs = torch.rand(3, 4)
    assert moe.switch_load_balancing_loss(probs, torch.zeros(4), 3, 1, 4, 1.0).item() == 0.0


def test_switch_bad_inputs():
    probs, counts = torch.rand(4, 3), torch.tensor([2, 1, 1])
    with pytest.raises(ValueError, match=r"probs has 3 experts.*num_experts=4"):
        moe.switch_load_balancing_loss(probs, counts, 4, 1, 4, 1.0)
    with pytest.raises(ValueError, match=r"tokens_per_expert must have shape \(3,\).*got \(2,\)"):
        moe.switch_load_balancing_loss(probs, counts[:2], 4, 1, 3, 1.0)
    with pytest.raises(ValueError, match="probs must be \\[tokens, num_experts\\]"):
        moe.switch_load_balancing_loss(probs.unsqueeze(0), counts, 4, 1, 3, 1.0)
    for k in (0, 4):
        with pytest.raises(ValueError, match=f"topk must be in 1..num_experts=3, got {k}"):
            moe.switch_load_balancing_loss(probs, counts, 4, k, 3, 1.0)
    with pytest.raises(ValueError, match="coeff must be a finite number >= 0, got -0.1"):
        moe.switch_load_balancing_loss(probs, counts, 4, 1, 3, -0.1)
    for t in (0, -2, torch.tensor(0)):
        with pytest.raises(ValueError, match="total_num_tokens must be a finite number > 0"):
            moe.switch_load_balancing_loss(probs, counts, t, 1, 3, 1.0)
    with pytest.raises(ValueError, match="keep_mask shape"):
        moe.switch_load_balancing_loss(probs, counts, 4, 1, 3, 1.0, keep_mask=torch.zeros(3, dtype=bool))
    with pytest.raises(TypeError, match="probs must be a floating-point tensor"):
        moe.switch_load_balancing_loss(torch.ones(4, 3, dtype=torch.int64), counts, 4, 1, 3, 1.0)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        moe.switch_load_balancing_loss(probs, counts, 4, 1, 0, 1.0)


# ------------------------------------------------------------------------------------------------
# sequence-wise loss
# ------------------------------------------------------------------------------------------------


def test_sequence_loss_matches_float64_loop_with_padding_and_empty_sequence():
    n, length, num_experts, k, coeff = 4, 6, 5, 2, 0.1
    probs = moe.router_probs(rand_logits(n, length, num_experts, seed=8))
    routing = moe.topk_routing_map(probs, k)
    pad = torch.zeros(n, length, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, :] = True  # an all-padding sequence contributes 0 and still counts
    total, count = moe.sequence_load_balancing_loss(
        probs, routing, topk=k, num_experts=num_experts, coeff=coeff, keep_mask=~pad
    )
    per_seq = naive_seq_loss(probs.double().tolist(), (~pad).tolist(), k, coeff)
    assert per_seq[2] == 0.0
    assert count.dtype == torch.int64 and int(count) == 4
    assert total.item() == pytest.approx(sum(per_seq), rel=1e-6)


def test_sequence_loss_perfect_balance_per_sequence():
    # Each sequence: 2 tokens, 2 experts, top-1, token x -> expert x with uniform scores: A = coeff.
    probs = torch.full((3, 2, 2), 0.5)
    routing = torch.eye(2, dtype=torch.bool).expand(3, 2, 2)
    total, count = moe.sequence_load_balancing_loss(probs, routing, topk=1, num_experts=2, coeff=0.3)
    assert int(count) == 3
    assert total.item() == pytest.approx(3 * 0.3, rel=1e-7)


def test_sequence_loss_seq_ids_layout_and_documents():
    n, length, num_experts, k = 2, 6, 4, 1
    probs = moe.router_probs(rand_logits(n, length, num_experts, seed=9))
    routing = moe.topk_routing_map(probs, k)
    rows, _ = moe.sequence_load_balancing_loss(probs, routing, topk=k, num_experts=num_experts, coeff=1.0)
    # Same rows given as a flat token list (seq-first order, as Megatron lays out [S, B, E]).
    flat_p = probs.transpose(0, 1).reshape(-1, num_experts)
    flat_m = routing.transpose(0, 1).reshape(-1, num_experts)
    ids = torch.arange(n).repeat(length)
    kw = dict(topk=k, num_experts=num_experts, coeff=1.0)
    flat, cnt = moe.sequence_load_balancing_loss(flat_p, flat_m, ids, **kw)
    assert int(cnt) == n and flat.item() == pytest.approx(rows.item(), rel=1e-6)
    # Documents: row 0 = docs {0: 4 tokens, 1: 2 tokens}, row 1 = doc 2 on 5 tokens + 1 token of no doc.
    doc = torch.tensor([[0, 0, 0, 0, 1, 1], [2, 2, 2, 2, 2, -1]])
    docs, dcnt = moe.sequence_load_balancing_loss(probs, routing, doc, **kw)
    segs_p = [probs[0, :4], probs[0, 4:], probs[1, :5]]
    want = sum(naive_seq_loss([s.double().tolist()], [[True] * len(s)], k, 1.0)[0] for s in segs_p)
    assert int(dcnt) == 3 and docs.item() == pytest.approx(want, rel=1e-6)


def test_sequence_loss_context_parallel_shards_with_global_counts():
    n, length, num_experts, k = 3, 8, 6, 2
    probs = moe.router_probs(rand_logits(n, length, num_experts, seed=10))
    routing = moe.topk_routing_map(probs, k)
    full, _ = moe.sequence_load_balancing_loss(probs, routing, topk=k, num_experts=num_experts, coeff=1.0)
    shards = [slice(0, 2), slice(2, 5), slice(5, 8)]
    c = sum(moe.sequence_tokens_per_expert(routing[:, s])[0] for s in shards)
    nt = sum(moe.sequence_tokens_per_expert(routing[:, s])[1] for s in shards)
    assert nt.tolist() == [length] * n
    parts = sum(
        moe.sequence_load_balancing_loss(
            probs[:, s], routing[:, s], topk=k, num_experts=num_experts, coeff=1.0, counts=(c, nt)
        )[0]
        for s in shards
    )
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_sequence_loss_gradient_only_through_probs():
    n, length, num_experts, k, coeff = 2, 5, 4, 2, 0.5
    probs = moe.router_probs(rand_logits(n, length, num_experts, seed=11)).requires_grad_(True)
    routing = moe.topk_routing_map(probs, k)
    c, nt = moe.sequence_tokens_per_expert(routing)
    cf = c.float().requires_grad_(True)
    total, _ = moe.sequence_load_balancing_loss(
        probs, routing, topk=k, num_experts=num_experts, coeff=coeff, counts=(cf, nt)
    )
    total.backward()
    assert cf.grad is None
    want = coeff * num_experts / (k * length**2) * c.double().unsqueeze(1).expand(n, length, num_experts)
    torch.testing.assert_close(probs.grad.double(), want, rtol=1e-6, atol=0)


def test_sequence_loss_all_padding_gives_zero_and_finite_grad():
    probs = moe.router_probs(rand_logits(2, 3, 4, seed=12)).requires_grad_(True)
    routing = moe.topk_routing_map(probs, 1)
    pad = torch.ones(2, 3, dtype=torch.bool)
    total, count = moe.sequence_load_balancing_loss(probs, routing, topk=1, num_experts=4, coeff=1.0, keep_mask=~pad)
    assert total.item() == 0.0 and int(count) == 2
    total.backward()
    assert torch.equal(probs.grad, torch.zeros_like(probs))


def test_sequence_loss_bad_inputs():
    probs = torch.rand(2, 3, 4)
    routing = moe.topk_routing_map(probs, 1)
    kw = dict(topk=1, num_experts=4, coeff=1.0)
    with pytest.raises(ValueError, match="routing_map shape"):
        moe.sequence_load_balancing_loss(probs, routing[:, :2], **kw)
    with pytest.raises(ValueError, match="seq_ids shape"):
        moe.sequence_load_balancing_loss(probs, routing, torch.zeros(2, 2, dtype=torch.long), **kw)
    with pytest.raises(TypeError, match="seq_ids must be an integer tensor"):
        moe.sequence_load_balancing_loss(probs, routing, torch.zeros(2, 3), **kw)
    with pytest.raises(ValueError, match="seq_ids must be >= -1"):
        moe.sequence_load_balancing_loss(probs, routing, torch.full((2, 3), -2), **kw)
    with pytest.raises(ValueError, match="num_sequences must be an int >= max"):
        moe.sequence_load_balancing_loss(probs, routing, torch.full((2, 3), 3), num_sequences=2, **kw)
    with pytest.raises(ValueError, match="num_sequences=3 but probs has 2 rows"):
        moe.sequence_load_balancing_loss(probs, routing, num_sequences=3, **kw)
    with pytest.raises(ValueError, match="counts must have shapes"):
        moe.sequence_load_balancing_loss(probs, routing, counts=(torch.zeros(2, 3), torch.zeros(2)), **kw)
    with pytest.raises(ValueError, match="keep_mask shape"):
        moe.sequence_load_balancing_loss(probs, routing, keep_mask=torch.zeros(3, dtype=bool), **kw)
    with pytest.raises(ValueError, match="topk must be in 1..num_experts=4, got 5"):
        moe.sequence_load_balancing_loss(probs, routing, topk=5, num_experts=4, coeff=1.0)
    with pytest.raises(ValueError, match="coeff must be a finite number >= 0"):
        moe.sequence_load_balancing_loss(probs, routing, topk=1, num_experts=4, coeff=float("nan"))
    with pytest.raises(ValueError, match=r"must be \[num_sequences, seq_len, num_experts\]"):
        moe.sequence_load_balancing_loss(probs[None], routing[None], **kw)


# ------------------------------------------------------------------------------------------------
# router z-loss
# ------------------------------------------------------------------------------------------------


def test_router_z_loss_matches_float64_loop():
    logits = rand_logits(7, 5, seed=13, scale=4.0)
    got = moe.router_z_loss(logits, 1e-3)
    want = 1e-3 * sum(naive_lse2(r) for r in logits.double().tolist()) / 7
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want, rel=1e-6)


def test_router_z_loss_padding_and_sum_form():
    logits = rand_logits(2, 4, 6, seed=14)
    pad = torch.tensor([[False, True, False, False], [True, True, False, True]])
    logits_nan = logits.clone()
    logits_nan[0, 1] = float("nan")
    rows = [logits[i, j].double().tolist() for i in range(2) for j in range(4) if not pad[i, j]]
    s, n = moe.router_z_loss_sum(logits_nan, keep_mask=~pad)
    assert n.dtype == torch.int64 and int(n) == 4
    assert s.item() == pytest.approx(sum(naive_lse2(r) for r in rows), rel=1e-6)
    z = moe.router_z_loss(logits_nan, 0.5, keep_mask=~pad)
    assert z.item() == pytest.approx(0.5 * sum(naive_lse2(r) for r in rows) / 4, rel=1e-6)
    # integer 0/1 masks are accepted
    z_int = moe.router_z_loss(logits, 0.5, keep_mask=1 - pad.long())
    assert z_int.item() == pytest.approx(z.item(), rel=1e-7)


def test_router_z_loss_all_padding_is_zero_not_nan():
    logits = rand_logits(3, 4, seed=15).requires_grad_(True)
    z = moe.router_z_loss(logits, 1.0, keep_mask=torch.zeros(3, dtype=torch.bool))
    assert z.item() == 0.0
    z.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    s, n = moe.router_z_loss_sum(torch.zeros(0, 4))
    assert s.item() == 0.0 and int(n) == 0
    assert moe.router_z_loss(torch.zeros(0, 4), 1.0).item() == 0.0


def test_router_z_loss_gradient():
    # d/dlogit[x,e] of coeff * mean lse^2 = coeff * 2 * lse[x] * softmax[x,e] / T
    logits = rand_logits(4, 3, seed=16).double().requires_grad_(True)
    moe.router_z_loss(logits, 0.1).backward()
    rows = logits.detach().tolist()
    for x, row in enumerate(rows):
        m = max(row)
        lse = m + math.log(sum(math.exp(v - m) for v in row))
        for e, v in enumerate(row):
            want = 0.1 * 2 * lse * math.exp(v - lse) / 4
            assert logits.grad[x, e].item() == pytest.approx(want, rel=1e-5)


def test_router_z_loss_bad_inputs():
    with pytest.raises(ValueError, match="coeff must be a finite number >= 0, got -1"):
        moe.router_z_loss(torch.rand(2, 3), -1.0)
    with pytest.raises(ValueError, match=r"keep_mask shape \(3,\) does not match"):
        moe.router_z_loss(torch.rand(2, 3), 1.0, keep_mask=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"keep_mask values must be 0 or 1 \(True = keep\)"):
        moe.router_z_loss(torch.rand(2, 3), 1.0, keep_mask=torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="keep_mask must be bool or integer"):
        moe.router_z_loss(torch.rand(2, 3), 1.0, keep_mask=torch.tensor([0.0, 1.0]))


# ------------------------------------------------------------------------------------------------
# expert bias and MaxVio
# ------------------------------------------------------------------------------------------------


def naive_bias(counts, bias, rate, zero_mean):
    mean = sum(counts) / len(counts)
    delta = [rate * ((mean - c > 0) - (mean - c < 0)) for c in counts]
    if zero_mean:
        dm = sum(delta) / len(delta)
        delta = [d - dm for d in delta]
    return [b + d for b, d in zip(bias, delta)]


@pytest.mark.parametrize("zero_mean", [False, True])
def test_expert_bias_update_matches_loop(zero_mean):
    counts = torch.tensor([[5, 1, 3, 3], [0, 0, 8, 4]])  # layer 0 has two experts exactly at the mean
    bias = torch.tensor([[0.1, -0.2, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]])
    before_c, before_b = counts.clone(), bias.clone()
    got = moe.expert_bias_update(counts, bias, 0.01, zero_mean=zero_mean)
    assert got.dtype == torch.float32 and not got.requires_grad
    assert torch.equal(counts, before_c) and torch.equal(bias, before_b)
    for layer in range(2):
        want = naive_bias(counts[layer].tolist(), bias[layer].double().tolist(), 0.01, zero_mean)
        want_t = torch.tensor(want, dtype=torch.float64)
        torch.testing.assert_close(got[layer].double(), want_t, rtol=0, atol=1e-7)
    got1 = moe.expert_bias_update(counts[0], bias[0], 0.01, zero_mean=zero_mean)
    assert torch.equal(got1, got[0])


def test_expert_bias_update_hand_example():
    got = moe.expert_bias_update(torch.tensor([4.0, 0.0, 2.0]), torch.zeros(3), 0.5)
    assert got.tolist() == [-0.5, 0.5, 0.0]
    got = moe.expert_bias_update(torch.tensor([4.0, 0.0, 2.0]), torch.zeros(3), 0.5, zero_mean=True)
    assert got.tolist() == [-0.5, 0.5, 0.0]  # Δb already has zero mean
    got = moe.expert_bias_update(torch.tensor([4.0, 0.0, 0.0]), torch.zeros(3), 0.3, zero_mean=True)
    torch.testing.assert_close(got, torch.tensor([-0.3 - 0.1, 0.3 - 0.1, 0.3 - 0.1]))
    # fp32 result even for a low-precision bias
    got = moe.expert_bias_update(torch.tensor([1, 3]), torch.zeros(2, dtype=torch.bfloat16), 1e-3)
    assert got.dtype == torch.float32 and got.tolist() == [pytest.approx(1e-3), pytest.approx(-1e-3)]


def test_expert_bias_update_bad_inputs():
    with pytest.raises(ValueError, match=r"expert_bias shape \(3,\) does not match tokens_per_expert shape"):
        moe.expert_bias_update(torch.zeros(4), torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="rate must be a finite number >= 0, got -0.1"):
        moe.expert_bias_update(torch.zeros(4), torch.zeros(4), -0.1)
    with pytest.raises(ValueError, match="tokens_per_expert must be \\[E\\] or \\[layers, E\\]"):
        moe.expert_bias_update(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), 0.1)
    with pytest.raises(TypeError, match="expert_bias must be a floating-point tensor"):
        moe.expert_bias_update(torch.zeros(4), torch.zeros(4, dtype=torch.long), 0.1)


def test_max_violation():
    assert moe.max_violation(torch.tensor([1, 2, 3, 6])).item() == 1.0
    got = moe.max_violation(torch.tensor([[1, 2, 3, 6], [0, 0, 0, 0], [2, 2, 2, 2]]))
    assert got.tolist() == [1.0, 0.0, 0.0]
    assert moe.max_violation(torch.tensor([0.0, 0.0])).item() == 0.0
    with pytest.raises(ValueError, match="tokens_per_expert must be"):
        moe.max_violation(torch.tensor(3.0))


def test_public_alias_module():
    import lossparity
    from lossparity.distributed.moe.accounting import MoEAccounting

    assert moe_alias.switch_load_balancing_loss is moe.switch_load_balancing_loss
    from lossparity.losses import aux_scopes, indexer, moe_tracker, router

    homes = moe.__all__ + router.__all__ + aux_scopes.__all__ + indexer.__all__ + moe_tracker.__all__
    assert moe_alias.__all__ == homes  # each name has one home
    for name in moe.__all__:
        assert getattr(moe_alias, name) is getattr(moe, name)
    assert lossparity.MoEAccounting is MoEAccounting and "MoEAccounting" in lossparity.__all__


# ---------------------------------------------------------------------------------------------------
# the forms with the gradient formed in the forward pass (MoEAccounting's hot path)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor_counts", [False, True])
def test_switch_weights_are_the_terms_gradient_and_hand_formula(tensor_counts):
    # K_e = coeff·E·c_e/(k·T_c·T_p): checked against the formula written out in float64, and as the
    # gradient of the terms w.r.t. the score sums (autograd through switch_load_balancing_terms)
    g = torch.Generator().manual_seed(5)
    L, E, k, coeff = 3, 6, 2, 0.07
    counts = torch.randint(0, 9, (L, E), generator=g).double()
    psum = torch.rand(L, E, generator=g, dtype=torch.float64).requires_grad_(True)
    t_c, t_p = 11.0, 13.0
    tc = torch.full((L,), t_c, dtype=torch.float64) if tensor_counts else t_c
    tp = torch.full((L,), t_p, dtype=torch.float64) if tensor_counts else t_p
    K = moe.switch_load_balancing_weights(counts, tc, tp, topk=k, num_experts=E, coeff=coeff)
    hand = torch.tensor(
        [[coeff * E * float(counts[l, e]) / (k * t_c * t_p) for e in range(E)] for l in range(L)], dtype=torch.float64
    )
    torch.testing.assert_close(K, hand, rtol=1e-14, atol=0)
    terms = moe.switch_load_balancing_terms(psum, counts, tc, tp, topk=k, num_experts=E, coeff=coeff)
    (grad,) = torch.autograd.grad(terms.sum(), psum)
    torch.testing.assert_close(grad, hand, rtol=1e-14, atol=0)
    # an empty set (T = 0) gives exactly zero weights, no NaN
    zero = torch.zeros(L, dtype=torch.float64) if tensor_counts else 0.0
    K0 = moe.switch_load_balancing_weights(counts * 0, zero, topk=k, num_experts=E, coeff=coeff)
    assert torch.equal(K0, torch.zeros_like(K0))


@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_router_z_loss_sums_and_grad_match_autograd_of_the_plain_formula(offset):
    # z_l = Σ_x w_x·(log Σ_e exp(logit))²; the gradient of Σ_l s_l·z_l by autograd of that plain formula
    # (float64, with a large common offset: exp(300) still fits a double, the stable form must agree)
    g = torch.Generator().manual_seed(6)
    L, T, E = 2, 9, 5
    logits = (torch.randn(L, T, E, generator=g, dtype=torch.float64) * 3 + offset).requires_grad_(True)
    w = (torch.rand(T, generator=g) > 0.3).double()
    s = torch.tensor([0.3, -1.7], dtype=torch.float64)
    plain = torch.log(torch.exp(logits).sum(dim=-1)).square() @ w
    (want_grad,) = torch.autograd.grad((plain * s).sum(), logits)
    z, grad = moe.router_z_loss_sums_and_grad(logits.detach(), w, s)
    torch.testing.assert_close(z, plain.detach(), rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-300)
    torch.testing.assert_close(z, moe.router_z_loss_sums(logits.detach(), weights=w), rtol=1e-13, atol=0)


def test_router_z_loss_sums_takes_keep_mask_and_deprecates_padding_mask():
    # by hand: logits [0, 0] -> lse = ln 2; [ln 3, 0] -> lse = ln 4
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [float("nan"), 0.0]], dtype=torch.float64)
    keep = torch.tensor([True, True, False])  # True = the token counts: the NaN row never reaches the sum
    want = math.log(2.0) ** 2 + math.log(4.0) ** 2
    assert float(moe.router_z_loss_sums(logits, keep_mask=keep)) == pytest.approx(want, rel=1e-15)
    with pytest.warns(DeprecationWarning, match="keep_mask=~padding_mask"):
        old = moe.router_z_loss_sums(logits, padding_mask=~keep)
    assert float(old) == pytest.approx(want, rel=1e-15)
    with pytest.raises(TypeError, match="renamed keep_mask"):
        moe.router_z_loss_sums(logits, valid=keep)
    with pytest.raises(ValueError, match="not both"):
        moe.router_z_loss_sums(logits, keep_mask=keep, padding_mask=~keep)
    with pytest.raises(TypeError):  # positional masks are refused: an older positional meant the opposite
        moe.router_z_loss_sums(logits, keep)  # type: ignore[misc]


_OLD_NEW = {  # each deprecated padding_mask call and its keep_mask replacement
    "tokens_per_expert": (
        lambda m, p, pad: moe.tokens_per_expert(m, pad),
        lambda m, p, keep: moe.tokens_per_expert(m, keep_mask=keep),
    ),
    "switch_load_balancing_loss": (
        lambda m, p, pad: moe.switch_load_balancing_loss(p, torch.ones(4), 3, 1, 4, 1.0, padding_mask=pad),
        lambda m, p, keep: moe.switch_load_balancing_loss(p, torch.ones(4), 3, 1, 4, 1.0, keep_mask=keep),
    ),
    "router_z_loss": (
        lambda m, p, pad: moe.router_z_loss(p, 1.0, pad),
        lambda m, p, keep: moe.router_z_loss(p, 1.0, keep_mask=keep),
    ),
    "router_z_loss_sum": (
        lambda m, p, pad: moe.router_z_loss_sum(p, pad),
        lambda m, p, keep: moe.router_z_loss_sum(p, keep_mask=keep),
    ),
    "sequence_tokens_per_expert": (
        lambda m, p, pad: moe.sequence_tokens_per_expert(m, padding_mask=pad),
        lambda m, p, keep: moe.sequence_tokens_per_expert(m, keep_mask=keep),
    ),
    "sequence_load_balancing_loss": (
        lambda m, p, pad: moe.sequence_load_balancing_loss(p, m, topk=1, num_experts=4, coeff=1.0, padding_mask=pad),
        lambda m, p, keep: moe.sequence_load_balancing_loss(p, m, topk=1, num_experts=4, coeff=1.0, keep_mask=keep),
    ),
}


@pytest.mark.parametrize("name", sorted(_OLD_NEW))
def test_padding_mask_is_deprecated_and_equals_keep_mask(name):
    import warnings

    old_call, new_call = _OLD_NEW[name]
    probs = moe.router_probs(rand_logits(5, 4, seed=40))
    m = moe.topk_routing_map(probs, 1)
    pad = torch.tensor([False, True, False, False, True])
    with pytest.warns(DeprecationWarning, match=f"{name}: padding_mask .*keep_mask=~padding_mask"):
        old = old_call(m, probs, pad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the keep-polarity form does not warn
        new = new_call(m, probs, ~pad)
    for a, b in zip(old if isinstance(old, tuple) else (old,), new if isinstance(new, tuple) else (new,)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not both"):
        moe.tokens_per_expert(m, pad, keep_mask=~pad)
