"""The public MoE toolkit (``lossparity.moe``): router conventions and every load-balancing scope as a function,
against independent float64 loops written here and, where installed, against the frameworks' own code
(megatron-core's router helpers on the CPU, transformers' ``load_balancing_loss_func``)."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

from lossparity import moe

E, K = 8, 2


def _logits(*shape, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


# ------------------------------------------------------------------------------------------------
# naive float64 references
# ------------------------------------------------------------------------------------------------


def naive_scores(row: list[float], fn: str) -> list[float]:
    if fn == "softmax":
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        return [v / sum(ex) for v in ex]
    if fn == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) for v in row]
    return [math.sqrt(math.log1p(math.exp(v))) for v in row]  # sqrt(softplus)


def naive_topk(values: list[float], k: int, groups: int | None = None, gtop: int | None = None, m=None) -> list[int]:
    n = len(values)
    allowed = set(range(n))
    if groups:
        size = n // groups
        m = m or k // gtop
        gscore = [sum(sorted(values[g * size : (g + 1) * size], reverse=True)[:m]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -gscore[g])[:gtop]
        allowed = {e for g in best for e in range(g * size, (g + 1) * size)}
    return sorted(sorted(allowed, key=lambda e: -values[e])[:k])


def naive_switch_set(p_rows, sel_rows, k, coeff, count_tokens=None) -> float:
    """A(X) = α·E/(k·T²)·Σ_e c_e·Σ_x p[x,e] over the rows given (each row's p, its selected experts)."""
    t = len(p_rows)
    if t == 0:
        return 0.0
    ne = len(p_rows[0])
    c = [sum(e in s for s in sel_rows) for e in range(ne)]
    ps = [sum(r[e] for r in p_rows) for e in range(ne)]
    return coeff * ne / (k * t * t) * sum(c[e] * ps[e] for e in range(ne))


def normalized(row):
    return [v / (sum(row) + 1e-20) for v in row]


# ------------------------------------------------------------------------------------------------
# scores, selection, gates
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_router_scores_match_float64_formulas(fn):
    lg = _logits(5, E, seed=1, scale=4.0)
    scores, probs = moe.router_scores(lg, fn)
    for x, row in enumerate(lg.tolist()):
        want = naive_scores(row, fn)
        torch.testing.assert_close(scores[x], torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=0)
        want_p = want if fn == "softmax" else normalized(want)
        torch.testing.assert_close(probs[x], torch.tensor(want_p, dtype=torch.float64), rtol=1e-13, atol=0)
    torch.testing.assert_close(moe.router_probs(lg, fn), probs, rtol=0, atol=0)


@pytest.mark.parametrize("groups", [None, (4, 2), (2, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_topk_routing_matches_float64_loop(groups, with_bias):
    s, _ = moe.router_scores(_logits(20, E, seed=2), "sigmoid")
    bias = _logits(E, seed=3, scale=0.3) if with_bias else None
    kw = {} if groups is None else {"num_groups": groups[0], "group_topk": groups[1]}
    idx, rmap = moe.topk_routing(s, K, expert_bias=bias, **kw)
    for x in range(20):
        v = [s[x, e].item() + (bias[e].item() if bias is not None else 0.0) for e in range(E)]
        want = naive_topk(v, K, *(groups or (None, None)))
        assert sorted(idx[x].tolist()) == want
        assert [e for e in range(E) if rmap[x, e]] == want


def test_topk_routing_group_score_topk_and_bad_groups():
    s, _ = moe.router_scores(_logits(30, E, seed=4), "softmax")
    idx, _ = moe.topk_routing(s, K, num_groups=4, group_topk=2, group_score_topk=1)  # DeepSeek: group max
    for x in range(30):
        assert sorted(idx[x].tolist()) == naive_topk(s[x].tolist(), K, 4, 2, m=1)
    with pytest.raises(ValueError, match="give both"):
        moe.topk_routing(s, K, num_groups=4)
    with pytest.raises(ValueError, match="must divide"):
        moe.topk_routing(s, K, num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="exceeds the experts"):
        moe.topk_routing(s, 5, num_groups=4, group_topk=2)
    with pytest.raises(ValueError, match=r"expert_bias must have shape \(8,\)"):
        moe.topk_routing(s, K, expert_bias=torch.zeros(7))


@pytest.mark.parametrize("normalize", [False, True])
def test_gate_weights_float64_and_layouts(normalize):
    s, _ = moe.router_scores(_logits(6, E, seed=5), "sqrtsoftplus")
    idx, rmap = moe.topk_routing(s, K)
    w = moe.gate_weights(s, idx, normalize=normalize, scaling_factor=2.5)
    dense = moe.gate_weights(s, rmap, normalize=normalize, scaling_factor=2.5)
    for x in range(6):
        sel = [s[x, e].item() for e in idx[x].tolist()]
        want = [2.5 * v / (sum(sel) + 1e-20) if normalize else 2.5 * v for v in sel]
        torch.testing.assert_close(w[x], torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)
        torch.testing.assert_close(dense[x, idx[x]], w[x], rtol=1e-14, atol=0)
        assert float(dense[x][~rmap[x]].abs().sum()) == 0.0


def test_model_router_gates_unchanged_by_default_and_configurable():
    from lossparity.model.router import Router

    torch.manual_seed(0)
    x = torch.randn(10, 16)
    for fn in ("softmax", "sigmoid"):
        r = Router(16, E, K, fn, layer_id=0)
        gates, rec = r(x)
        scores, _ = moe.router_scores(rec.logits, fn)
        want = scores * rec.dispatch_map  # the former formula, written out
        if fn == "sigmoid":
            want = want / want.sum(dim=-1, keepdim=True)
        assert torch.equal(gates, want)
    r = Router(16, E, K, "softmax", layer_id=0, norm_topk_prob=True, scaling_factor=2.5)
    gates, rec = r(x)
    torch.testing.assert_close(gates.sum(-1), torch.full((10,), 2.5), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# the scopes as functions
# ------------------------------------------------------------------------------------------------


def _rows(lg, fn, k=K):
    """probs rows (normalized, float64 lists) and their plain top-k sets."""
    p = [naive_scores(r, fn) for r in lg.reshape(-1, lg.shape[-1]).tolist()]
    p = [r if fn == "softmax" else normalized(r) for r in p]
    return p, [set(naive_topk(r, k)) for r in p]


@pytest.mark.parametrize("layout", ["sb", "bs"])
@pytest.mark.parametrize("flat", [False, True])
def test_seq_load_balancing_loss_layouts_match_float64(layout, flat):
    s_len, b = 7, 3
    lg = _logits(s_len, b, E, seed=6)  # [S, B, E]
    keep = torch.ones(s_len, b, dtype=torch.bool)
    keep[5:, 1] = False
    keep[:, 2] = False  # an empty sequence: 0, still counts
    p_all, sel_all = _rows(lg, "sigmoid")  # in [S, B] order
    want = 0.0
    for j in range(b):
        rows = [t * b + j for t in range(s_len) if keep[t, j]]
        want += naive_switch_set([p_all[i] for i in rows], [sel_all[i] for i in rows], K, 0.1)
    want /= b
    probs = moe.router_probs(lg, "sigmoid")
    rmap = moe.topk_routing_map(probs, K)
    km = keep
    if layout == "bs":
        probs, rmap, km = probs.transpose(0, 1), rmap.transpose(0, 1), keep.transpose(0, 1)
    kw = {}
    if flat:
        probs, rmap, km = probs.reshape(-1, E), rmap.reshape(-1, E), km.reshape(-1)
        kw = {"seq_length": s_len}
    got = moe.seq_load_balancing_loss(
        probs, rmap, token_layout=layout, topk=K, num_experts=E, coeff=0.1, keep_mask=km, **kw
    )
    assert got.dim() == 0 and got.item() == pytest.approx(want, rel=1e-12)


def test_seq_load_balancing_loss_needs_a_layout():
    probs = moe.router_probs(_logits(4, 2, E, seed=7))
    rmap = moe.topk_routing_map(probs, K)
    with pytest.raises(ValueError, match="token_layout must be one of"):
        moe.seq_load_balancing_loss(probs, rmap, token_layout="bse", topk=K, num_experts=E, coeff=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need seq_length"):
        moe.seq_load_balancing_loss(
            probs.reshape(-1, E), rmap.reshape(-1, E), token_layout="sb", topk=K, num_experts=E, coeff=1.0
        )


def test_global_running_matches_float64_running_mean():
    state = moe.GlobalRunningCounts()
    running = [0.0] * E
    for m in range(1, 4):
        lg = _logits(9, E, seed=10 + m)
        p, sel = _rows(lg, "softmax")
        c = [sum(e in s for s in sel) for e in range(E)]
        running = [a + b for a, b in zip(running, c)]
        avg = [v / m for v in running]
        want = 0.3 * E / (K * 81) * sum(avg[e] * sum(r[e] for r in p) for e in range(E))
        probs = moe.router_probs(lg)
        got = moe.global_running_load_balancing_loss(
            probs, moe.tokens_per_expert(moe.topk_routing_map(probs, K)), 9, state, topk=K, num_experts=E, coeff=0.3
        )
        assert got.item() == pytest.approx(want, rel=1e-12)
    state.reset()
    assert state.microbatches == 0 and state.total is None


def test_global_lagged_uses_the_previous_steps_fractions():
    state = moe.GlobalLaggedCounts(E, K)
    lg1, lg2 = _logits(12, E, seed=20), _logits(10, E, seed=21)
    p1 = moe.router_probs(lg1)
    # step 0: uniform k/E fractions -> α·Σ_x Σ_e p / T = α (each row sums to 1)
    assert moe.global_lagged_load_balancing_loss(p1, 12, state, topk=K, num_experts=E, coeff=0.5).item() == (
        pytest.approx(0.5, rel=1e-12)
    )
    for half in (slice(0, 5), slice(5, 12)):  # two microbatches of step 0
        state.accumulate(moe.tokens_per_expert(moe.topk_routing_map(p1[half], K)), p1[half].shape[0])
    state.end_step()
    pr1, sel1 = _rows(lg1, "softmax")
    f = [sum(e in s for s in sel1) / 12 for e in range(E)]
    pr2, _ = _rows(lg2, "softmax")
    keep = torch.tensor([True] * 8 + [False] * 2)
    want = 0.5 * E / K * sum(f[e] * sum(pr2[x][e] for x in range(8)) / 8 for e in range(E))
    p2 = moe.router_probs(lg2).clone()
    p2[9] = float("nan")  # a dropped row must not leak
    got = moe.global_lagged_load_balancing_loss(p2, 8, state, topk=K, num_experts=E, coeff=0.5, keep_mask=keep)
    assert got.item() == pytest.approx(want, rel=1e-12)
    t_dev = keep.sum()  # a device count: no host read
    got_t = moe.global_lagged_load_balancing_loss(p2, t_dev, state, topk=K, num_experts=E, coeff=0.5, keep_mask=keep)
    assert got_t.item() == pytest.approx(want, rel=1e-12)
    # checkpoint round trip; a step without tokens keeps the fractions
    saved = state.state_dict()
    fresh = moe.GlobalLaggedCounts(E, K)
    fresh.load_state_dict(saved)
    fresh.end_step()
    torch.testing.assert_close(fresh.fractions(), torch.tensor(f, dtype=torch.float64), rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match=r"state\['tokens'\] must be a number > 0"):
        fresh.load_state_dict({"counts": saved["counts"], "tokens": 0.0})
    with pytest.raises(ValueError, match=r"state\['counts'\] must be a tensor of shape \(8,\)"):
        fresh.load_state_dict({"counts": torch.zeros(3), "tokens": 1.0})


def test_framework_names_map_to_scopes():
    assert moe.aux_scope_for("megatron", "aux_loss") == "microbatch"
    assert moe.aux_scope_for("megatron", "seq_aux_loss") == "sequence"
    assert moe.aux_scope_for("mindformers", "global_aux_loss") == "global_running"
    assert moe.aux_scope_for("megatron", "global_lagged") == "global_lagged"
    with pytest.raises(ValueError, match="valid: aux_loss"):
        moe.aux_scope_for("megatron", "sinkhorn")
    with pytest.raises(ValueError, match="known frameworks"):
        moe.aux_scope_for("nemo", "aux_loss")
    from lossparity.options import AUX_SCOPES, check_option

    for table in moe.FRAMEWORK_AUX_SCOPES.values():  # the names are aliases wherever an aux_scope is taken
        for name, scope in table.items():
            assert check_option("aux_scope", name, AUX_SCOPES) == scope
    from lossparity.parity.presets.spec import _MEGATRON_LB

    assert _MEGATRON_LB is moe.FRAMEWORK_AUX_SCOPES["megatron"]  # the preset parser reads the public table


# ------------------------------------------------------------------------------------------------
# against megatron-core's own functions (CPU; its group reductions are over one rank: identity)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def mcore(monkeypatch):
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    router_mod = pytest.importorskip("megatron.core.transformer.moe.router")
    monkeypatch.setattr(mu, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    return types.SimpleNamespace(utils=mu, router=router_mod)


class _Group1:
    def size(self) -> int:
        return 1


@pytest.mark.parametrize(
    "fn,pre,groups,bias,scale",
    [
        ("softmax", True, None, False, None),
        ("softmax", False, None, False, None),
        ("softmax", True, (4, 2), False, 2.5),
        ("sigmoid", False, None, True, None),
        ("sigmoid", False, (4, 2), True, 2.5),  # DeepSeek-V3 style: node-limited, biased, scaled
    ],
)
def test_routing_and_gates_match_megatron(mcore, fn, pre, groups, bias, scale):
    lg = _logits(24, E, seed=30).float()
    b = _logits(E, seed=31, scale=0.2).float() if bias else None
    g = {} if groups is None else {"num_groups": groups[0], "group_topk": groups[1]}
    m_probs, m_map = mcore.utils.topk_routing_with_score_function(
        lg, K, use_pre_softmax=pre, scaling_factor=scale, score_function=fn, expert_bias=b, **g
    )
    scores, _ = moe.router_scores(lg, fn)
    # Megatron's softmax without pre_softmax selects on the logits: the same experts as on the scores
    _, rmap = moe.topk_routing(scores, K, expert_bias=b, **g)
    assert torch.equal(rmap, m_map)
    normalize = (fn != "softmax" and K > 1) or (fn == "softmax" and not pre)
    gates = moe.gate_weights(scores, rmap, normalize=normalize, scaling_factor=scale or 1.0)
    torch.testing.assert_close(gates, m_probs, rtol=1e-6, atol=1e-7)


def _seq_router(mcore, coeff):
    captured = {}

    def attach(activation, c, aux_loss, *a, **k):
        captured["aux"] = aux_loss
        return activation

    fake = types.SimpleNamespace(
        topk=K,
        config=types.SimpleNamespace(num_moe_experts=E, moe_router_fusion=False),
        tp_cp_group=_Group1(),
        tp_dp_cp_group=_Group1(),
        get_aux_loss_coeff=lambda name: coeff,
        attach_and_log_load_balancing_loss=attach,
    )
    return fake, captured


@pytest.mark.parametrize("with_padding", [False, True])
def test_seq_load_balancing_loss_matches_megatron_sb(mcore, with_padding):
    s_len, b, coeff = 10, 3, 0.05
    lg = _logits(s_len, b, E, seed=32).float()
    pad = torch.zeros(s_len, b, dtype=torch.bool)
    if with_padding:
        pad[7:, 0] = True
        pad[4:, 2] = True
    flat = lg.reshape(-1, E)
    m_map, m_scores = mcore.utils.compute_routing_scores_for_aux_loss(
        flat, K, "sigmoid", padding_mask=pad.reshape(-1) if with_padding else None
    )
    fake, cap = _seq_router(mcore, coeff)
    mcore.router.TopKRouter._apply_seq_aux_loss(
        fake, torch.zeros(1), m_scores, m_map, s_len, b, with_padding_mask=with_padding
    )
    probs = moe.router_probs(lg, "sigmoid")
    got = moe.seq_load_balancing_loss(
        probs,
        moe.topk_routing_map(probs, K),
        token_layout="sb",
        topk=K,
        num_experts=E,
        coeff=coeff,
        keep_mask=~pad,
        own_length=not with_padding,  # Megatron (0.16.1 and 0.19.2) divides by the mean kept length under padding
    )
    torch.testing.assert_close(got.double(), cap["aux"].double(), rtol=1e-6, atol=0)


def test_global_running_matches_megatron_over_microbatches(mcore):
    coeff = 0.02
    fake, cap = _seq_router(mcore, coeff)
    fake.global_tokens_per_expert = torch.zeros(E)
    fake.ga_steps = torch.tensor(0.0)
    state = moe.GlobalRunningCounts()
    for m in range(3):
        lg = _logits(16, E, seed=40 + m).float()
        m_map, m_scores = mcore.utils.compute_routing_scores_for_aux_loss(lg, K, "softmax")
        mcore.router.TopKRouter._apply_global_aux_loss(fake, torch.zeros(1), m_scores, m_map)
        probs = moe.router_probs(lg)
        got = moe.global_running_load_balancing_loss(
            probs,
            moe.tokens_per_expert(moe.topk_routing_map(probs, K)),
            16,
            state,
            topk=K,
            num_experts=E,
            coeff=coeff,
        )
        torch.testing.assert_close(got.double(), cap["aux"].double(), rtol=1e-6, atol=0)


def test_hf_load_balancing_loss_matches_transformers():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from lossparity.losses.hf_aux import hf_load_balancing_loss

    layers = [_logits(2 * 5, E, seed=50 + i).float() for i in range(3)]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = mixtral.load_balancing_loss_func(tuple(layers), E, K, mask)
    got = hf_load_balancing_loss(layers, K, mask)
    torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# against transformers' DeepSeek routers (the DeepSeek-V3 and -V4 conventions)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_and_gates_match_hf_deepseek_v3_router(norm_topk_prob):
    ds3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    cfg = types.SimpleNamespace(
        num_experts_per_tok=K,
        num_local_experts=E,
        hidden_size=12,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        norm_topk_prob=norm_topk_prob,
    )
    router = ds3.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(60)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, 12, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    x = torch.randn(20, 12, generator=g)
    logits, hf_w, hf_idx = router(x)
    scores, _ = moe.router_scores(logits, "sigmoid")
    idx, rmap = moe.topk_routing(
        scores, K, expert_bias=router.e_score_correction_bias, num_groups=4, group_topk=2, group_score_topk=2
    )
    hf_map = torch.zeros_like(rmap).scatter_(-1, hf_idx, True)
    assert torch.equal(rmap, hf_map)
    dense_hf = torch.zeros_like(scores).scatter_(-1, hf_idx, hf_w)
    w = moe.gate_weights(scores, rmap, normalize=norm_topk_prob, scaling_factor=2.5)
    torch.testing.assert_close(w, dense_hf, rtol=1e-6, atol=1e-7)


def test_sqrtsoftplus_routing_matches_hf_deepseek_v4_router():
    ds4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    cfg = types.SimpleNamespace(
        num_experts_per_tok=K,
        num_local_experts=E,
        hidden_size=12,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
    )
    router = ds4.DeepseekV4TopKRouter(cfg)
    g = torch.Generator().manual_seed(61)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, 12, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    logits, hf_w, hf_idx = router(torch.randn(20, 12, generator=g))
    scores, _ = moe.router_scores(logits, "sqrtsoftplus")
    idx, rmap = moe.topk_routing(scores, K, expert_bias=router.e_score_correction_bias)
    assert torch.equal(rmap, torch.zeros_like(rmap).scatter_(-1, hf_idx, True))
    dense_hf = torch.zeros_like(scores).scatter_(-1, hf_idx, hf_w)
    torch.testing.assert_close(
        moe.gate_weights(scores, rmap, normalize=True, scaling_factor=1.5), dense_hf, rtol=1e-6, atol=1e-7
    )
