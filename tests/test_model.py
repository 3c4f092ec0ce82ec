"""Tests of the reference model (src/lossparity/model). Expected values come from naive float64 formulas
written here (loops over tokens/heads, explicit angles), never from the code under test."""

from __future__ import annotations

import math

import pytest
import torch

from lossparity.model import (
    GPT,
    PRESETS,
    Attention,
    ModelConfig,
    MoE,
    RMSNorm,
    Router,
    apply_rope,
    checkpoint,
    get_config,
    is_recomputing,
    positions_from_segments,
    rope_cos_sin,
    shift_tokens,
)

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: intra-op threads only add contention on a shared CPU (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(name: str = "tiny", seed: int = 0, dtype: torch.dtype = F64, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(get_config(name, **overrides)).to(dtype)


def _tokens(B: int, S: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max().item()


# ---------------------------------------------------------------- config


def test_get_config_errors_list_valid_names() -> None:
    with pytest.raises(ValueError, match="tiny"):
        get_config("nope")
    with pytest.raises(ValueError, match="bogus"):
        get_config("tiny", bogus=1)
    with pytest.raises(ValueError, match="n_heads"):
        get_config("tiny", n_heads=5)
    with pytest.raises(ValueError, match="score_function"):
        get_config("tiny", score_function="relu")
    with pytest.raises(ValueError, match="topk"):
        get_config("tiny", topk=5)
    with pytest.raises(ValueError, match="indexer_layer"):
        get_config("tiny", indexer_layer=2)
    assert get_config("tiny", dim=64).dim == 64 and PRESETS["tiny"].dim == 32


def _naive_param_count(c: ModelConfig) -> int:
    d, hd = c.dim, c.dim // c.n_heads
    kv = c.n_heads if c.n_kv_heads is None else c.n_kv_heads
    attn = d * c.n_heads * hd + 2 * d * kv * hd + c.n_heads * hd * d
    dense = 3 * d * c.ffn_hidden
    moe = (
        c.num_experts * d
        + 3 * c.num_experts * d * c.moe_ffn_hidden
        + (3 * d * c.moe_ffn_hidden if c.shared_expert else 0)
    )
    indexer = d * c.indexer_heads * c.indexer_dim + d * c.indexer_dim + d * c.indexer_heads
    has_moe = c.num_experts > 0 and c.n_dense_layers < c.n_layers
    total = c.vocab_size * d * (1 if c.tie_embeddings else 2) + d
    for i in range(c.n_layers):
        total += attn + 2 * d + (moe if c.num_experts > 0 and i >= c.n_dense_layers else dense)
        total += indexer if i == c.indexer_layer else 0
    total += c.mtp_depths * (2 * d + 2 * d * d + attn + 2 * d + (moe if has_moe else dense) + d)
    return total


def test_param_counts_of_presets() -> None:
    for name, cfg in PRESETS.items():
        with torch.device("meta"):  # counts elements without allocating the 100M parameters
            n = GPT(cfg).num_params()
        print(f"preset {name}: {n:,} parameters")
        assert n == _naive_param_count(cfg)
    assert 80e6 <= _naive_param_count(PRESETS["100m"]) <= 130e6
    overrides = dict(tie_embeddings=True, indexer_layer=0, num_experts=0, mtp_depths=2)
    assert _model("tiny", **overrides).num_params() == _naive_param_count(get_config("tiny", **overrides))


# ---------------------------------------------------------------- building blocks


@torch.no_grad()
def test_rmsnorm_matches_formula() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-6).to(F64)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8, dtype=F64))
    x = torch.randn(3, 8, dtype=F64)
    for r in range(3):
        ms = sum(float(v) ** 2 for v in x[r]) / 8
        expected = torch.tensor(
            [float(x[r, i]) / math.sqrt(ms + 1e-6) * float(norm.weight[i]) for i in range(8)], dtype=F64
        )
        _close(norm(x)[r], expected)


def test_positions_from_segments_restart_per_document() -> None:
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 3], [4, 4, 4, 4, 4, 4, 4, 4]])
    expected = []
    for row in seg.tolist():
        out, p = [], 0
        for t, s in enumerate(row):
            p = 0 if t == 0 or s != row[t - 1] else p + 1
            out.append(p)
        expected.append(out)
    assert positions_from_segments(seg).tolist() == expected


def test_rope_matches_explicit_rotation() -> None:
    D, theta = 8, 10000.0
    x = torch.randn(1, 3, 2, D, dtype=F64)
    pos = torch.tensor([[0, 5, 17]])
    cos, sin = rope_cos_sin(pos, D, theta, F64)
    y = apply_rope(x, cos, sin)
    for t in range(3):
        for h in range(2):
            for i in range(D // 2):
                a = int(pos[0, t]) * theta ** (-2 * i / D)
                x1, x2 = float(x[0, t, h, i]), float(x[0, t, h, i + D // 2])
                assert abs(float(y[0, t, h, i]) - (x1 * math.cos(a) - x2 * math.sin(a))) < 1e-12
                assert abs(float(y[0, t, h, i + D // 2]) - (x1 * math.sin(a) + x2 * math.cos(a))) < 1e-12


def _naive_rope(x: torch.Tensor, pos: list[int], theta: float) -> torch.Tensor:
    """x [S, H, D] rotated pairwise (i, i + D/2) by pos·theta^(-2i/D)."""
    S, H, D = x.shape
    out = x.clone()
    for t in range(S):
        for i in range(D // 2):
            a = pos[t] * theta ** (-2 * i / D)
            out[t, :, i] = x[t, :, i] * math.cos(a) - x[t, :, i + D // 2] * math.sin(a)
            out[t, :, i + D // 2] = x[t, :, i] * math.sin(a) + x[t, :, i + D // 2] * math.cos(a)
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])
@torch.no_grad()
def test_attention_matches_naive_document_masked_softmax(kv_heads: int) -> None:
    torch.manual_seed(0)
    dim, H, S = 16, 4, 9
    attn = Attention(dim, H, kv_heads).to(F64)
    x = torch.randn(1, S, dim, dtype=F64)
    seg = [1, 1, 1, 1, 2, 2, 2, 0, 0]
    pos = [0, 1, 2, 3, 0, 1, 2, 0, 1]
    seg_t, pos_t = torch.tensor([seg]), torch.tensor([pos])
    mask = (torch.ones(S, S, dtype=torch.bool).tril() & (seg_t[0][:, None] == seg_t[0][None, :]))[None, None]
    cos, sin = rope_cos_sin(pos_t, dim // H, 10000.0, F64)
    out, probs = attn(x, cos, sin, mask, return_probs=True)

    hd, rep = dim // H, H // kv_heads
    q = _naive_rope((x[0] @ attn.wq.weight.T).view(S, H, hd), pos, 10000.0)
    k = _naive_rope((x[0] @ attn.wk.weight.T).view(S, kv_heads, hd), pos, 10000.0)
    v = (x[0] @ attn.wv.weight.T).view(S, kv_heads, hd)
    ctx = torch.zeros(S, H, hd, dtype=F64)
    for h in range(H):
        for t in range(S):
            keys = [s for s in range(t + 1) if seg[s] == seg[t]]
            logits = [float(q[t, h] @ k[s, h // rep]) / math.sqrt(hd) for s in keys]
            m = max(logits)
            w = [math.exp(z - m) for z in logits]
            for s, wi in zip(keys, w):
                ctx[t, h] += wi / sum(w) * v[s, h // rep]
                assert abs(float(probs[0, h, t, s]) - wi / sum(w)) < 1e-12
            assert float(probs[0, h, t].sum()) == pytest.approx(1.0, abs=1e-12)
    _close(out[0], ctx.reshape(S, dim) @ attn.wo.weight.T)


def _naive_expert(x: torch.Tensor, moe: MoE, e: int) -> torch.Tensor:
    w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
    a, b = x @ w1, x @ w3
    return (a / (1 + torch.exp(-a)) * b) @ w2


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@torch.no_grad()
def test_moe_matches_per_token_naive_routing(score_function: str) -> None:
    torch.manual_seed(0)
    E, k, dim, T = 5, 2, 8, 12
    moe = MoE(dim, 6, E, k, score_function, shared_expert=True, layer_id=3).to(F64)
    with torch.no_grad():
        moe.router.weight.normal_()
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.0, 0.6]))
    x = torch.randn(2, T // 2, dim, dtype=F64)
    y, rec = moe(x)
    flat = x.reshape(T, dim)
    for t in range(T):
        logits = [float(flat[t] @ moe.router.weight[e]) for e in range(E)]
        if score_function == "softmax":
            m = max(logits)
            z = sum(math.exp(v - m) for v in logits)
            scores = [math.exp(v - m) / z for v in logits]
            probs = scores
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
            probs = [s / sum(scores) for s in scores]
        plain = sorted(range(E), key=lambda e: -probs[e])[:k]
        biased = [scores[e] + float(moe.router.expert_bias[e]) for e in range(E)]
        chosen = sorted(range(E), key=lambda e: -biased[e])[:k]
        gates = {e: scores[e] for e in chosen}
        if score_function == "sigmoid":
            gates = {e: g / sum(gates.values()) for e, g in gates.items()}
        expected = sum(gates[e] * _naive_expert(flat[t], moe, e) for e in chosen)
        expected = expected + moe.shared.w2.weight @ (
            torch.nn.functional.silu(moe.shared.w1.weight @ flat[t]) * (moe.shared.w3.weight @ flat[t])
        )
        _close(y.reshape(T, dim)[t], expected)
        assert rec.topk_map[t].tolist() == [e in plain for e in range(E)]
        assert rec.dispatch_map[t].tolist() == [e in chosen for e in range(E)]
        _close(rec.probs[t], torch.tensor(probs, dtype=F64))
    assert rec.layer_id == 3 and rec.logits.dtype == F64


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_bias_changes_dispatch_not_topk_and_gates_stay_unbiased(score_function: str) -> None:
    torch.manual_seed(0)
    router = Router(8, 4, 2, score_function, layer_id=1).to(F64)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(32, 8, dtype=F64)
    gates0, rec0 = router(x)
    with torch.no_grad():
        router.expert_bias[3] = 10.0  # forces expert 3 into every token's dispatch
    gates1, rec1 = router(x)
    assert torch.equal(rec0.topk_map, rec1.topk_map)
    _close(rec0.probs, rec1.probs, 0.0)
    assert rec1.dispatch_map[:, 3].all() and not torch.equal(rec0.dispatch_map, rec1.dispatch_map)
    logits = x @ router.weight.T
    scores = logits.softmax(-1) if score_function == "softmax" else torch.sigmoid(logits)
    sel = torch.where(rec1.dispatch_map, scores, torch.zeros_like(scores))
    expected = sel if score_function == "softmax" else sel / sel.sum(-1, keepdim=True)
    _close(gates1, expected)


# ---------------------------------------------------------------- whole model


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_forward_shapes(name: str) -> None:
    cfg = get_config(name)
    model = _model(name, dtype=torch.float32)
    B, S = 2, 16
    out = model(_tokens(B, S))
    assert out.hidden.shape == (B, S, cfg.dim) and out.hidden.dtype == torch.float32
    assert len(out.mtp_hidden) == cfg.mtp_depths
    assert all(h.shape == (B, S, cfg.dim) for h in out.mtp_hidden)
    n_moe = cfg.n_layers - cfg.n_dense_layers
    assert [r.layer_id for r in out.routers] == list(range(cfg.n_dense_layers, cfg.n_layers + cfg.mtp_depths))
    assert len(model.moe_routers()) == n_moe + cfg.mtp_depths
    for r in out.routers:
        assert r.logits.shape == r.probs.shape == r.topk_map.shape == (B * S, cfg.num_experts)
        assert r.logits.dtype == torch.float32 and r.dispatch_map.dtype == torch.bool
        assert (r.topk_map.sum(-1) == cfg.topk).all() and (r.dispatch_map.sum(-1) == cfg.topk).all()
    assert out.indexer is None
    assert model.output.weight.shape == (cfg.vocab_size, cfg.dim) and model.output.bias is None


def test_dense_only_model_and_tied_embeddings() -> None:
    model = _model("tiny", num_experts=0, tie_embeddings=True, mtp_depths=2)
    out = model(_tokens(2, 8))
    assert out.routers == [] and model.moe_routers() == [] and len(out.mtp_hidden) == 2
    assert model.output.weight is model.tok_embeddings.weight


def test_init_is_deterministic_and_scaled() -> None:
    a, b = _model("small", seed=3), _model("small", seed=3)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    assert torch.equal(a.layers[0].attention_norm.weight, torch.ones(64, dtype=F64))
    tokens = _tokens(2, 16)
    _close(a(tokens).hidden, a(tokens).hidden, 0.0)
    assert a.moe_routers()[0].tokens_per_expert.dtype == F64
    a16 = _model("tiny", dtype=torch.bfloat16)
    assert a16.moe_routers()[0].tokens_per_expert.dtype == F64
    assert a16.moe_routers()[0].expert_bias.dtype == torch.float32
    std_wo = a.layers[1].attention.wo.weight.std().item()
    std_wq = a.layers[1].attention.wq.weight.std().item()
    assert std_wo < 0.7 * std_wq  # 0.02 / sqrt(2 * 4) vs 0.02


def test_float64_and_bf16_autocast() -> None:
    model = _model("small", indexer_layer=1)
    out = model(_tokens(2, 16))
    assert out.hidden.dtype == F64 and out.routers[0].logits.dtype == F64 and out.indexer[1].dtype == F64
    model32 = _model("small", dtype=torch.float32, indexer_layer=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model32(_tokens(2, 16), recompute=True)
    assert out.routers[0].logits.dtype == torch.float32 and out.indexer[1].dtype == torch.float32
    loss = out.hidden.float().square().mean() + sum(h.float().square().mean() for h in out.mtp_hidden)
    loss = loss + sum(r.probs.square().mean() for r in out.routers)
    loss.backward()
    grads = [p.grad for p in model32.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def _row(out_value: torch.Tensor, B: int, i: int) -> torch.Tensor:
    return out_value.reshape(B, -1, *out_value.shape[1:])[i]


def test_rows_are_independent_of_each_other() -> None:
    model = _model("tiny", indexer_layer=1, mtp_depths=2)
    B, S = 4, 24
    tokens = _tokens(B, S)
    full = model(tokens)
    for i in range(B):
        alone = model(tokens[i : i + 1])
        _close(full.hidden[i], alone.hidden[0])
        for a, b in zip(full.mtp_hidden, alone.mtp_hidden):
            _close(a[i], b[0])
        for ra, rb in zip(full.routers, alone.routers):
            _close(_row(ra.logits, B, i), rb.logits)
            _close(_row(ra.probs, B, i), rb.probs)
            assert torch.equal(_row(ra.topk_map, B, i), rb.topk_map)
            assert torch.equal(_row(ra.dispatch_map, B, i), rb.dispatch_map)
        _close(full.indexer[0][i], alone.indexer[0][0])
        _close(full.indexer[1][i], alone.indexer[1][0])


def test_documents_are_independent_of_each_other() -> None:
    model = _model("tiny", indexer_layer=1, mtp_depths=2)
    docs = [(0, 7), (7, 16), (16, 21)]
    seg = torch.tensor([[1] * 7 + [2] * 9 + [5] * 5 + [0] * 3])
    tokens = _tokens(1, 24, seed=5)
    packed = model(tokens, segment_ids=seg)
    E = model.config.num_experts
    for a, b in docs:
        alone = model(tokens[:, a:b])
        _close(packed.hidden[0, a:b], alone.hidden[0])
        for hp, ha in zip(packed.mtp_hidden, alone.mtp_hidden):
            _close(hp[0, a:b], ha[0])
        for rp, ra in zip(packed.routers, alone.routers):
            _close(rp.logits.view(24, E)[a:b], ra.logits)
            assert torch.equal(rp.dispatch_map.view(24, E)[a:b], ra.dispatch_map)
        _close(packed.indexer[0][0, :, a:b, a:b], alone.indexer[0][0])
        _close(packed.indexer[1][0, a:b, a:b], alone.indexer[1][0])
        assert (packed.indexer[0][0, :, a:b, :a] == 0).all()
        assert torch.isneginf(packed.indexer[1][0, a:b, :a]).all()


def test_default_positions_restart_in_each_document(monkeypatch: pytest.MonkeyPatch) -> None:
    # RoPE attention is invariant to a common shift of positions up to rounding, so the outputs alone
    # cannot show which positions were used: record what the model feeds to the rotary tables.
    import lossparity.model.gpt as gpt_module

    seen: list[torch.Tensor] = []
    real = gpt_module.rope_cos_sin
    monkeypatch.setattr(gpt_module, "rope_cos_sin", lambda pos, *a: (seen.append(pos.clone()), real(pos, *a))[1])
    model = _model("tiny")
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3]])
    model(_tokens(2, 8), segment_ids=seg)
    assert seen[-1].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))]
    model(_tokens(2, 8))
    assert seen[-1].tolist() == [list(range(8))] * 2
    explicit = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]] * 2)
    model(_tokens(2, 8), segment_ids=seg, positions=explicit)
    assert torch.equal(seen[-1], explicit)


def test_shift_tokens_rolls_within_documents() -> None:
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]])
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3, 3, 3]])
    for k in (1, 2, 3, 9):
        expected = [
            [row[t + k] if t + k < 8 and srow[t + k] == srow[t] else 0 for t in range(8)]
            for row, srow in zip(tokens.tolist(), seg.tolist())
        ]
        assert shift_tokens(tokens, k, seg).tolist() == expected
        no_seg = [[row[t + k] if t + k < 8 else 0 for t in range(8)] for row in tokens.tolist()]
        assert shift_tokens(tokens, k).tolist() == no_seg


def test_mtp_input_is_the_next_token_of_the_same_document() -> None:
    model = _model("tiny")
    seg = torch.tensor([[1] * 6 + [2] * 6])
    tokens = _tokens(1, 12, seed=7)
    base = model(tokens, segment_ids=seg)
    inner = tokens.clone()
    inner[0, 3] = (inner[0, 3] + 1) % 256  # the depth-1 input of position 2
    out = model(inner, segment_ids=seg)
    _close(out.hidden[0, :3], base.hidden[0, :3])
    assert (out.mtp_hidden[0][0, 2] - base.mtp_hidden[0][0, 2]).abs().max() > 1e-6
    _close(out.mtp_hidden[0][0, :2], base.mtp_hidden[0][0, :2])
    cross = tokens.clone()
    cross[0, 6] = (cross[0, 6] + 1) % 256  # first token of document 2: not an input of document 1
    out = model(cross, segment_ids=seg)
    _close(out.mtp_hidden[0][0, :6], base.mtp_hidden[0][0, :6])
    out = model(cross)  # without segment ids position 5 does see token 6
    assert (out.mtp_hidden[0][0, 5] - model(tokens).mtp_hidden[0][0, 5]).abs().max() > 1e-6


def test_tokens_per_expert_counts_dispatch_of_non_padding_tokens() -> None:
    model = _model("small")
    seg = torch.tensor([[1] * 10 + [2] * 4 + [0] * 2, [3] * 13 + [0] * 3])
    tokens = _tokens(2, 16)
    out = model(tokens, segment_ids=seg)
    valid = (seg != 0).reshape(-1).tolist()
    for router, rec in zip(model.moe_routers(), out.routers):
        expected = [
            sum(1 for t in range(32) if valid[t] and bool(rec.dispatch_map[t, e]))
            for e in range(model.config.num_experts)
        ]
        assert router.tokens_per_expert.tolist() == expected and router.tokens_per_expert.dtype == F64
        assert sum(expected) == 27 * model.config.topk
    with torch.no_grad():
        model(tokens, segment_ids=seg)  # evaluation does not count
    assert model.moe_routers()[0].tokens_per_expert.sum().item() == 27 * model.config.topk
    for router in model.moe_routers():
        router.reset_counts()
        assert router.tokens_per_expert.sum().item() == 0


def test_is_recomputing_only_inside_the_rerun() -> None:
    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(is_recomputing())
        return (x * 2).sin()

    x = torch.randn(4, requires_grad=True)
    y = checkpoint(fn, x)
    assert seen == [False] and not is_recomputing()
    y.sum().backward()
    assert seen == [False, True] and not is_recomputing()

    model = _model("tiny")
    flags: list[bool] = []
    model.moe_routers()[0].register_forward_pre_hook(lambda *_: flags.append(is_recomputing()))
    model(_tokens(2, 8), recompute=True).hidden.sum().backward()
    assert flags == [False, True]
    flags.clear()
    model(_tokens(2, 8), recompute=False).hidden.sum().backward()
    assert flags == [False]


def test_recompute_gives_identical_outputs_gradients_and_counts() -> None:
    g = torch.Generator().manual_seed(11)
    seg = torch.tensor([[1] * 9 + [2] * 5 + [0] * 2, [4] * 16])
    tokens = _tokens(2, 16)
    results = []
    for recompute in (False, True):
        model = _model("small", indexer_layer=1)
        out = model(tokens, segment_ids=seg, recompute=recompute)
        g.manual_seed(11)
        loss = (out.hidden * torch.randn(out.hidden.shape, generator=g, dtype=F64)).sum()
        loss = loss + sum((h * torch.randn(h.shape, generator=g, dtype=F64)).sum() for h in out.mtp_hidden)
        loss = loss + sum((r.probs * torch.randn(r.probs.shape, generator=g, dtype=F64)).sum() for r in out.routers)
        idx = out.indexer[1]
        loss = loss + torch.where(torch.isfinite(idx), idx, torch.zeros_like(idx)).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        counts = [r.tokens_per_expert.clone() for r in model.moe_routers()]
        results.append((out, grads, counts))
    (o0, g0, c0), (o1, g1, c1) = results
    _close(o0.hidden, o1.hidden)
    # every parameter but the output head (applied by the loss code, not by forward) gets a gradient
    assert g0.keys() == g1.keys() and len(g0) == len(list(model.parameters())) - 1
    for name in g0:
        _close(g0[name], g1[name])
    for a, b in zip(c0, c1):
        assert torch.equal(a, b)
    assert sum(c.sum().item() for c in c0) == 30 * 2 * len(c0)


def test_indexer_outputs_and_gradient_isolation() -> None:
    model = _model("tiny", indexer_layer=0)
    seg = torch.tensor([[1] * 5 + [2] * 7])
    out = model(_tokens(1, 12), segment_ids=seg)
    probs, logits = out.indexer
    assert probs.shape == (1, 4, 12, 12) and logits.shape == (1, 12, 12) and not probs.requires_grad
    allowed = torch.ones(12, 12, dtype=torch.bool).tril() & (seg[0][:, None] == seg[0][None, :])
    assert torch.isneginf(logits[0][~allowed]).all() and torch.isfinite(logits[0][allowed]).all()
    assert (probs[0][:, ~allowed] == 0).all()
    _close(probs.sum(-1), torch.ones(1, 4, 12, dtype=F64))
    torch.where(allowed, logits[0], torch.zeros_like(logits[0])).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.startswith("layers.0.indexer."), name


def test_bad_inputs_name_the_argument() -> None:
    model = _model("tiny")
    with pytest.raises(ValueError, match="tokens values"):
        model(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), segment_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(1, 4, dtype=torch.long), positions=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(4, dtype=torch.long))
