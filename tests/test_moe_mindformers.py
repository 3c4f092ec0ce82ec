"""The public MoE toolkit (``lossparity.moe``) against MindSpore MindFormers 2.x conventions: group-limited
routing (pynative and graph mode), the graph mode's aux counts, its load-balancing names, the MTP and indexer
logs and the trackers' log arithmetic. MindSpore is not installed here: each expectation is a float64 loop
written in this file from MindFormers' released source (2.0.0 / 2.1.0, the file and function named at each
reference) or a hand-worked number, never the code under test."""

from __future__ import annotations

import math

import pytest
import torch

from lossparity import moe, mtp

E, K = 8, 2
BF16_MIN = -3.3895313892515355e38  # MindFormers' finite mask value (bfloat16's lowest)


def _randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _sigmoid_rows(x):
    return [[1.0 / (1.0 + math.exp(-v)) for v in row] for row in x.tolist()]


def _topk_set(values, k):
    return set(sorted(range(len(values)), key=lambda e: -values[e])[:k])


# ------------------------------------------------------------------------------------------------
# group-limited routing
# ------------------------------------------------------------------------------------------------


def mf_pynative_route(scores, bias, groups, gtop, k):
    """pynative/transformers/moe/router.py TopKRouter: v = s + b; a group scores the sum of its top-2 v;
    the dropped groups' v become -inf; top-k of v."""
    v = [si + bi for si, bi in zip(scores, bias)]
    size = len(v) // groups
    gs = [sum(sorted(v[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(groups)]
    kept = _topk_set(gs, gtop)
    masked = [v[e] if e // size in kept else -math.inf for e in range(len(v))]
    return _topk_set(masked, k)


def mf_graph_masked(scores, bias, groups, gtop, k):
    """training_graph/transformer/moe/router.py _group_limited_topk: a group scores the sum of its top k//g
    biased values; the dropped groups' values become 0.0 (masked_fill); the router takes the top-k of these
    masked values. Returns them (ties among the 0.0 fills are the framework's choice: compare values)."""
    v = [si + bi for si, bi in zip(scores, bias)]
    size = len(v) // groups
    gs = [sum(sorted(v[g * size : (g + 1) * size], reverse=True)[: k // gtop]) for g in range(groups)]
    kept = _topk_set(gs, gtop)
    return [v[e] if e // size in kept else 0.0 for e in range(len(v))], kept


def test_group_limited_routing_as_mindformers_pynative_and_graph_mode():
    n, groups, gtop = 400, 4, 2
    s = torch.sigmoid(_randn(n, E, seed=1, scale=1.5))
    bias = _randn(E, seed=2, scale=0.4) - 0.8  # many biased values < 0: graph mode's 0-fill then matters
    rows, b = s.tolist(), bias.tolist()
    _, pyn = moe.topk_routing(s, K, expert_bias=bias, num_groups=groups, group_topk=gtop, group_score_topk=2)
    _, graph = moe.topk_routing(s, K, expert_bias=bias, num_groups=groups, group_topk=gtop, group_fill=0.0)
    _, default = moe.topk_routing(s, K, expert_bias=bias, num_groups=groups, group_topk=gtop)
    differ_pyn = filled = 0
    for x in range(n):
        want_pyn = mf_pynative_route(rows[x], b, groups, gtop, K)
        assert {e for e in range(E) if pyn[x, e]} == want_pyn
        differ_pyn += {e for e in range(E) if default[x, e]} != want_pyn
        masked, kept = mf_graph_masked(rows[x], b, groups, gtop, K)
        sel = [e for e in range(E) if graph[x, e]]
        assert sorted(masked[e] for e in sel) == sorted(masked, reverse=True)[:K][::-1]
        filled += any(e // (E // groups) not in kept for e in sel)  # a dropped group's expert: never with -inf
    # on these tokens the default (the k//g = 1 best expert scores a group, -inf fill) differs from both
    assert differ_pyn > 0 and filled > 0
    with pytest.raises(ValueError, match="group_fill must be a number"):
        moe.topk_routing(s, K, num_groups=groups, group_topk=gtop, group_fill=float("nan"))


# ------------------------------------------------------------------------------------------------
# graph mode: the aux losses count the dispatch indices
# ------------------------------------------------------------------------------------------------


def mf_graph_aux(chunks, indices, coeff, k, fi_accu=None):
    """training_graph/.../router.py _expert_load_balancing on C chunks (dp·tp·cp): pi = mean over the chunk's
    N tokens of the aux probs, fi = mean over its k·N dispatch slots of one-hot(index); sub_seq_aux_loss:
    mean over (C, E) of pi·fi times α·E²; gbs_aux_loss: fi replaced by the running, sum-normalized mean over
    chunks (fi_accu carries the step's earlier microbatches). Returns (loss, new fi_accu)."""
    ne = len(chunks[0][0])
    pis = [[sum(r[e] for r in ch) / len(ch) for e in range(ne)] for ch in chunks]
    fis = [[sum(e in sel for sel in ix) / (k * len(ix)) for e in range(ne)] for ix in indices]
    if fi_accu is not None:
        dp_mean = [sum(f[e] for f in fis) / len(fis) for e in range(ne)]
        acc = [a + d for a, d in zip(fi_accu, dp_mean)]
        fbar = [a / sum(acc) for a in acc]
        fis = [fbar] * len(chunks)
        fi_accu = acc
    mean = sum(pis[c][e] * fis[c][e] for c in range(len(chunks)) for e in range(ne)) / (len(chunks) * ne)
    return mean * coeff * ne * ne, fi_accu


def _graph_batch(seed, n):
    logits = _randn(n, E, seed=seed, scale=1.5)
    scores = torch.sigmoid(logits)
    probs = moe.router_probs(logits, "sigmoid")  # graph mode normalizes sigmoid scores for the aux loss
    return scores, probs


def test_graph_mode_aux_loss_counts_the_dispatch_indices():
    coeff, bias = 0.01, _randn(E, seed=5, scale=0.5)
    scores, probs = _graph_batch(6, 24)
    dispatch = moe.aux_routing_map(scores, K, counts="dispatch", expert_bias=bias)
    idx = [{e for e in range(E) if dispatch[x, e]} for x in range(24)]
    for x in range(24):  # the dispatch map is the biased top-k (training_graph _topk_with_bias)
        assert idx[x] == _topk_set([s + b for s, b in zip(scores[x].tolist(), bias.tolist())], K)
    want, _ = mf_graph_aux([probs.tolist()], [idx], coeff, K)  # sub_seq_aux_loss, one chunk (TP = CP = 1)
    got = moe.switch_load_balancing_loss(probs, moe.tokens_per_expert(dispatch), 24, K, E, coeff)
    assert got.item() == pytest.approx(want, rel=1e-12)
    plain = moe.aux_routing_map(scores, K)  # semantics §5 and pynative: the unbiased top-k
    assert torch.equal(plain, moe.topk_routing_map(probs, K))
    other = moe.switch_load_balancing_loss(probs, moe.tokens_per_expert(plain), 24, K, E, coeff).item()
    assert abs(other - want) > 1e-3 * want  # the bias moves the counts: the choice matters
    with pytest.raises(ValueError, match="counts must be one of"):
        moe.aux_routing_map(scores, K, counts="biased")  # type: ignore[arg-type]


def test_graph_mode_gbs_aux_loss_is_global_running_over_dp_with_dispatch_counts():
    coeff, bias = 0.02, _randn(E, seed=7, scale=0.5)
    state, fi_accu = moe.GlobalRunningCounts(), [0.0] * E
    for m in range(3):  # three microbatches of one step, two data-parallel chunks of 10 tokens each
        scores, probs = _graph_batch(10 + m, 20)
        dispatch = moe.aux_routing_map(scores, K, counts="dispatch", expert_bias=bias)
        idx = [{e for e in range(E) if dispatch[x, e]} for x in range(20)]
        p = probs.tolist()
        want, fi_accu = mf_graph_aux([p[:10], p[10:]], [idx[:10], idx[10:]], coeff, K, fi_accu)
        # the counts summed over the DP chunks, T the microbatch's tokens over all of them
        got = moe.global_running_load_balancing_loss(
            probs, moe.tokens_per_expert(dispatch), 20, state, topk=K, num_experts=E, coeff=coeff
        )
        assert got.item() == pytest.approx(want, rel=1e-12)


def test_mindformers_load_balancing_names():
    assert moe.aux_scope_for("mindformers", "sub_seq_aux_loss") == "microbatch"  # graph mode's config default
    assert moe.aux_scope_for("mindformers", "gbs_aux_loss") == "global_running"
    assert moe.aux_scope_for("mindformers", "seq_aux_loss") == "sequence"
    from lossparity.options import AUX_SCOPES, check_option

    assert check_option("aux_scope", "sub_seq_aux_loss", AUX_SCOPES) == "microbatch"


# ------------------------------------------------------------------------------------------------
# MTP log (pynative multi_token_prediction.py process_mtp_loss, loss_callback.py)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["2.0.0", "2.1.0"])
def test_mtp_log_as_mindformers(version):
    lam, depths, b, ga, dp = 0.3, 2, 2, 2, 2
    g = torch.Generator().manual_seed(8)
    n = b * ga * dp  # rows in (rank, microbatch) order
    losses = [torch.rand(n, 5, generator=g, dtype=torch.float64) * 3 for _ in range(depths)]
    masks = [(torch.rand(n, 5, generator=g) > 0.3).double() for _ in range(depths)]
    for w in masks:
        w[:, 0] = 1.0  # MindFormers divides by the microbatch's tokens without a guard: keep them > 0
    scale = lam / depths if version == "2.0.0" else 1.0  # 2.0.0 tracks (λ/Dm)·mean, 2.1.0 the unscaled mean
    got = mtp.mtp_log_losses(losses, masks, estimator="microbatch_mean", microbatch_size=b)
    for d in range(depths):
        per_rank = []
        for r in range(dp):
            tracker = 0.0
            for m in range(ga):
                rows = range((r * ga + m) * b, (r * ga + m + 1) * b)
                s = sum(losses[d][i, t].item() * masks[d][i, t].item() for i in rows for t in range(5))
                tracker += scale * s / sum(masks[d][i, t].item() for i in rows for t in range(5))
            per_rank.append(tracker / ga)  # loss_callback: ÷ num_accumulation_steps
        want = sum(per_rank) / dp  # track_mtp_metrics: mean over the metric group
        assert scale * got[d] == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# indexer loss: public, and the 2.1.0 sparse logits [b, sq, k]
# ------------------------------------------------------------------------------------------------


def mf_unfused_indexer_loss(raw, index_scores, topk_idx, causal, coeff):
    """pynative/.../indexer.py UnfusedCSAIndexerLoss (2.1.0) in float64: attention masked (bf16 min) outside
    causal ∧ selected keys, softmax, summed over heads, L1-normalized, gathered at the selected keys;
    KL with eps 1e-9 against softmax(index_scores); mean over b·sq; × coeff."""
    eps = 1e-9
    b, h, sq, sk = len(raw), len(raw[0]), len(raw[0][0]), len(raw[0][0][0])
    total = 0.0
    for i in range(b):
        for t in range(sq):
            sel = topk_idx[i][t]
            a = [0.0] * sk
            for hh in range(h):
                v = [raw[i][hh][t][j] if (causal[t][j] and j in sel) else BF16_MIN for j in range(sk)]
                m = max(v)
                ex = [math.exp(x - m) for x in v]
                z = sum(ex)
                for j in range(sk):
                    a[j] += ex[j] / z
            norm = max(sum(a), 1e-12)
            target = [a[j] / norm for j in sel]
            sc = [x if math.isfinite(x) else BF16_MIN for x in index_scores[i][t]]
            m = max(sc)
            ex = [math.exp(x - m) for x in sc]
            pred = [x / sum(ex) for x in ex]
            ts = sum(target)
            total += sum(
                (math.log(max(tj / (ts + eps), eps)) - math.log(pj + eps)) * tj for tj, pj in zip(target, pred)
            )
    return coeff * total / (b * sq)


def test_indexer_loss_public_with_sparse_logits_matches_mindformers_2_1():
    b, h, sq, k, coeff = 2, 3, 6, 3, 0.7
    raw = _randn(b, h, sq, sq, seed=20)
    causal = torch.tril(torch.ones(sq, sq, dtype=torch.bool))
    dense_logits = _randn(b, sq, sq, seed=21, scale=1.5).masked_fill(~causal, -math.inf)
    # the sparse indexer: top-k of its causal-masked logits (the first rows select future keys at -inf)
    index_scores, topk_idx = dense_logits.topk(k, dim=-1)
    want = mf_unfused_indexer_loss(raw.tolist(), index_scores.tolist(), topk_idx.tolist(), causal.tolist(), coeff)
    attn = torch.softmax(raw.masked_fill(~causal, -math.inf), dim=-1).float()  # lossparity renormalizes per head
    sparse = index_scores.float().requires_grad_(True)
    got = moe.indexer_loss(attn, sparse, None, coeff=coeff, topk_indices=topk_idx, sparse_logits=True)
    assert got.item() == pytest.approx(want, rel=1e-6)
    # the same as the hand-scattered dense logits, value and gradient
    dense = torch.full((b, sq, sq), -math.inf).scatter(-1, topk_idx, index_scores.float()).requires_grad_(True)
    ref = moe.indexer_loss(attn, dense, None, coeff=coeff, topk_indices=topk_idx)
    assert got.item() == ref.item()
    got.backward()
    ref.backward()
    torch.testing.assert_close(sparse.grad, dense.grad.gather(-1, topk_idx), rtol=0, atol=0)
    assert moe.indexer_kl is not None and moe.indexer_token_count is not None  # the rest of the module, public


def test_scatter_indexer_logits_and_its_errors():
    sel = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    idx = torch.tensor([[2, 0, -1], [1, 3, 0]])
    got = moe.scatter_indexer_logits(sel, idx, 4)
    inf = -math.inf
    assert got.tolist() == [[2.0, inf, 1.0, inf], [6.0, 4.0, inf, 5.0]]
    with pytest.raises(ValueError, match="lists a key twice"):
        moe.scatter_indexer_logits(sel, torch.tensor([[2, 2, -1], [1, 3, 0]]), 4)
    with pytest.raises(ValueError, match=r"must be in -1\.\.3"):
        moe.scatter_indexer_logits(sel, idx + 2, 4)
    with pytest.raises(ValueError, match="same shape"):
        moe.scatter_indexer_logits(sel[:, :2], idx, 4)
    attn = torch.full((1, 2, 4), 0.25)  # [heads, Tq, Tk] unbatched
    with pytest.raises(ValueError, match="needs topk_indices"):
        moe.indexer_loss(attn, sel, None, sparse_logits=True)
    with pytest.raises(ValueError, match="pass sparse_logits=True"):
        moe.indexer_loss(attn, sel, None, topk_indices=idx)
    # -1 entries (no key) and the unbatched form
    assert moe.indexer_loss(attn, sel, None, topk_indices=idx, sparse_logits=True).item() >= 0.0


# ------------------------------------------------------------------------------------------------
# the trackers' log arithmetic
# ------------------------------------------------------------------------------------------------


def test_tracker_log_value_hand_worked():
    # 2 microbatches × 3 MoE layers, α = 0.01: terms/α = [[2, 3, 0], [4, 1, 0]], Σ = 10; the model has 4 MoE
    # layers (one on another stage) and GA = 2: log = 10 / (4 · 2) = 1.25
    terms = torch.tensor([[0.02, 0.03, 0.0], [0.04, 0.01, 0.0]], dtype=torch.float64)
    assert moe.tracker_log_value(terms, 0.01, num_layers=4).item() == pytest.approx(1.25, rel=1e-15)
    # defaults L = 3, G = M = 2: 10 / 6
    assert moe.tracker_log_value(terms, 0.01).item() == pytest.approx(10 / 6, rel=1e-15)
    # per-layer coefficients (the third layer has none: it logs 0): [[2, 3, 0], [4, 1, 0]] again
    per_layer = torch.tensor([[0.02, 0.06, 0.5], [0.04, 0.02, 0.7]], dtype=torch.float64)
    got = moe.tracker_log_value(per_layer, torch.tensor([0.01, 0.02, 0.0], dtype=torch.float64))
    assert got.item() == pytest.approx(10 / 6, rel=1e-15)
    # two data-parallel ranks (leading dim, averaged): the second's terms/α sum to 6 → (10/6 + 6/6) / 2
    ranks = torch.stack([terms, torch.tensor([[0.01, 0.01, 0.01], [0.01, 0.01, 0.01]], dtype=torch.float64)])
    assert moe.tracker_log_value(ranks, 0.01).item() == pytest.approx((10 / 6 + 1.0) / 2, rel=1e-15)
    with pytest.raises(ValueError, match="num_layers=2 is smaller"):
        moe.tracker_log_value(terms, 0.01, num_layers=2)
    with pytest.raises(ValueError, match=r"coeff must be a number or \[layers=3\]"):
        moe.tracker_log_value(terms, torch.ones(2))
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        moe.tracker_log_value(terms, 0.01, num_microbatches=0)


def test_tracker_log_value_matches_megatron_track_moe_metrics(monkeypatch):
    # megatron-core's own tracker (one rank: its cross-rank reductions are the identity) on 4 decoder layers
    # with moe_layer_freq [1, 0, 1, 1] and one MoE MTP layer: MoE layer numbers 1, 3, 4, 5. Two tracker APIs,
    # chosen by what the installed release provides: 0.16.1's module-level dict (save_to_aux_losses_tracker /
    # track_moe_metrics), 0.19.2's MoEMetricsTracker (record / report; the old names are deprecated wrappers
    # there, and get_moe_layer_wise_logging_tracker returns a copy).
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    try:
        import megatron.core.transformer.moe.moe_logging as ml
    except ImportError:  # 0.16.1
        ml = None
    coeff, ga, moe_layers = 0.01, 3, [1, 3, 4, 5]
    terms = _randn(ga, len(moe_layers), seed=40).abs() * 0.02
    # the router saves aux_loss / coeff (router.py); float32, as the router's
    values = [[torch.tensor(terms[m, j].item() / coeff, dtype=torch.float32) for j in range(4)] for m in range(ga)]
    logged: dict[str, torch.Tensor] = {}
    report = dict(total_loss_dict=logged, num_layers=4, moe_layer_freq=[1, 0, 1, 1], mtp_num_layers=1)
    if ml is None:
        monkeypatch.setattr(mu, "reduce_aux_losses_tracker_across_ranks", lambda *a, **k: None)
        tracker = mu.get_moe_layer_wise_logging_tracker()
        saved = dict(tracker)
        tracker.clear()
        try:
            for m in range(ga):
                for j, layer in enumerate(moe_layers):
                    mu.save_to_aux_losses_tracker("load_balancing_loss", values[m][j], layer, 5)
            mu.track_moe_metrics(1.0 / ga, 0, **report)
        finally:
            tracker.clear()
            tracker.update(saved)
    else:
        # _sync_metrics' all-reduces (PP, reduce group, DP average) on one rank: no-ops
        monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
        monkeypatch.setattr(ml.parallel_state, "get_pipeline_model_parallel_group", lambda *a, **k: None)
        monkeypatch.setattr(ml.parallel_state, "get_data_parallel_group", lambda *a, **k: None)
        tracker = ml.MoEMetricsTracker()
        monkeypatch.setattr(ml, "_MOE_METRICS_TRACKER", tracker)  # what the router's record() reaches
        for m in range(ga):
            for j, layer in enumerate(moe_layers):
                ml.get_moe_metrics_tracker().record("load_balancing_loss", values[m][j], layer, 5)
        ml.get_moe_metrics_tracker().report(1.0 / ga, 0, **report)
    assert set(logged) == {"load_balancing_loss"}
    got = moe.tracker_log_value(terms.float(), coeff)
    torch.testing.assert_close(got, logged["load_balancing_loss"].float(), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# one argument order: probs, [counts,] total_num_tokens, state
# ------------------------------------------------------------------------------------------------


def test_global_lagged_takes_the_common_order_and_the_old_one_warns():
    probs = moe.router_probs(_randn(6, E, seed=30))
    state = moe.GlobalLaggedCounts(E, K)
    state.accumulate(torch.tensor([3, 1, 0, 2, 2, 1, 2, 1]), 6)
    state.end_step()
    new = moe.global_lagged_load_balancing_loss(probs, 6, state, topk=K, num_experts=E, coeff=0.1)
    kw = moe.global_lagged_load_balancing_loss(probs, total_num_tokens=6, state=state, topk=K, num_experts=E, coeff=0.1)
    with pytest.warns(DeprecationWarning, match=r"pass \(probs, total_num_tokens, state\)"):
        old = moe.global_lagged_load_balancing_loss(probs, state, 6, topk=K, num_experts=E, coeff=0.1)  # type: ignore[arg-type]
    assert new.item() == kw.item() == old.item()
    # hand-worked: f = c/T = [3,1,0,2,2,1,2,1]/6, Σ_x p = 6/E per expert only for uniform rows; check the formula
    want = 0.1 * E / K * sum(c / 6 * probs[:, e].sum().item() / 6 for e, c in enumerate([3, 1, 0, 2, 2, 1, 2, 1]))
    assert new.item() == pytest.approx(want, rel=1e-6)
    with pytest.raises(TypeError, match="state must be a GlobalLaggedCounts"):
        moe.global_lagged_load_balancing_loss(probs, 6, topk=K, num_experts=E, coeff=0.1)
