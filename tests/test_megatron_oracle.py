"""Cross-check of the MoE / indexer losses against Megatron-LM's own functions (megatron-core).

Megatron is installed without its torch pin (``pip install --no-deps megatron-core``); the module is
skipped when it is absent. Megatron's helpers all-reduce over process groups; in one process those
reductions are over a group of size 1, so the test replaces them by the identity (monkeypatch, undone
after each test) instead of initializing ``torch.distributed`` in the test process.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core")
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
router_mod = pytest.importorskip("megatron.core.transformer.moe.router")

from lossparity.losses import moe  # noqa: E402
from lossparity.losses.indexer import indexer_kl  # noqa: E402

RTOL = 1e-6


class _Group1:
    """Stand-in for a process group of size 1."""

    def size(self) -> int:
        return 1


@pytest.fixture
def single_rank(monkeypatch):
    monkeypatch.setattr(moe_utils, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda *a, **k: None)


def _logits(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 1.5


def _close(a, b, rtol=RTOL, atol=0.0):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_routing_scores_and_map_match_megatron(score_function):
    logits = _logits(32, 8, seed=0)
    m_map, m_scores = moe_utils.compute_routing_scores_for_aux_loss(logits, 2, score_function)
    probs = moe.router_probs(logits, score_function)
    _close(probs, m_scores)
    assert torch.equal(moe.topk_routing_map(probs, 2), m_map)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_padding", [False, True])
def test_switch_load_balancing_matches_megatron(single_rank, score_function, with_padding):
    num_experts, k, t, coeff = 8, 2, 40, 0.01
    base = _logits(t, num_experts, seed=1)
    pad = (torch.arange(t) % 7 == 3) if with_padding else None

    # Megatron: TopKRouter._apply_aux_loss pipeline with a TP x CP group of size 1.
    lm = base.clone().requires_grad_(True)
    m_map, m_scores = moe_utils.compute_routing_scores_for_aux_loss(lm, k, score_function, padding_mask=pad)
    m_counts, _, m_total = moe_utils.get_tokens_per_expert_and_token_count(
        m_map, _Group1(), topk=k, with_padding_mask=pad is not None
    )
    m_loss = moe_utils.switch_load_balancing_loss_func(m_scores, m_counts, m_total, k, num_experts, coeff)
    m_loss.backward()

    lo = base.clone().requires_grad_(True)
    probs = moe.router_probs(lo, score_function)
    counts = moe.tokens_per_expert(moe.topk_routing_map(probs, k), keep_mask=None if pad is None else ~pad)
    total = t if pad is None else int((~pad).sum())
    keep = None if pad is None else ~pad
    loss = moe.switch_load_balancing_loss(probs, counts, total, k, num_experts, coeff, keep_mask=keep)
    loss.backward()

    assert torch.equal(counts.float(), m_counts.float())
    _close(loss, m_loss)
    _close(lo.grad, lm.grad, atol=1e-12)


def test_switch_function_level_equal_on_same_inputs():
    g = torch.Generator().manual_seed(2)
    probs = torch.rand(50, 16, generator=g)
    counts = torch.randint(0, 20, (16,), generator=g).float()
    for total in (50, 123, torch.tensor(77.0)):
        want = moe_utils.switch_load_balancing_loss_func(probs, counts, total, 4, 16, 0.3)
        got = moe.switch_load_balancing_loss(probs, counts, total, 4, 16, 0.3)
        _close(got, want)


class _FakeRouter:
    """The attributes ``TopKRouter._apply_seq_aux_loss`` reads; captures the loss it attaches."""

    def __init__(self, topk, num_experts, coeff):
        self.topk = topk
        self.config = types.SimpleNamespace(num_moe_experts=num_experts, moe_router_fusion=False)
        self.tp_cp_group = _Group1()
        self._coeff = coeff
        self.captured = None

    def get_aux_loss_coeff(self, aux_loss_type):
        return self._coeff if aux_loss_type == "seq_aux_loss" else 0.0

    def attach_and_log_load_balancing_loss(self, activation, coeff, aux_loss, *args, **kwargs):
        self.captured = aux_loss
        return activation


def _megatron_seq_loss(logits_sb, k, coeff, score_function, pad_sb=None):
    """Megatron's seq_aux_loss on logits laid out [seq_len, batch, E] (its native layout)."""
    s, b, num_experts = logits_sb.shape
    flat = logits_sb.reshape(-1, num_experts)
    pad = None if pad_sb is None else pad_sb.reshape(-1)
    m_map, m_scores = moe_utils.compute_routing_scores_for_aux_loss(flat, k, score_function, padding_mask=pad)
    fake = _FakeRouter(k, num_experts, coeff)
    router_mod.TopKRouter._apply_seq_aux_loss(
        fake, torch.zeros(1), m_scores, m_map, s, b, with_padding_mask=pad is not None
    )
    return fake.captured


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_sequence_loss_matches_megatron_without_padding(single_rank, score_function):
    s, b, num_experts, k, coeff = 12, 3, 8, 2, 0.05
    base = _logits(s, b, num_experts, seed=3)
    lm = base.clone().requires_grad_(True)
    m_loss = _megatron_seq_loss(lm, k, coeff, score_function)
    m_loss.backward()

    lo = base.clone().requires_grad_(True)
    probs = moe.router_probs(lo.transpose(0, 1), score_function)  # rows = sequences
    total, count = moe.sequence_load_balancing_loss(
        probs, moe.topk_routing_map(probs, k), topk=k, num_experts=num_experts, coeff=coeff
    )
    mean = total / count
    mean.backward()
    _close(mean, m_loss)
    _close(lo.grad, lm.grad, atol=1e-12)


def test_sequence_loss_megatron_padding_uses_mean_valid_length(single_rank):
    # Documented difference: with padding Megatron divides every sequence by the *mean* number of
    # valid tokens per sequence of the microbatch; semantics §5 (and our default) uses each sequence's own.
    s, b, num_experts, k, coeff = 10, 3, 6, 2, 1.0
    base = _logits(s, b, num_experts, seed=4)
    pad = torch.zeros(s, b, dtype=torch.bool)
    pad[7:, 0] = True
    pad[4:, 2] = True
    m_loss = _megatron_seq_loss(base, k, coeff, "softmax", pad)

    probs = moe.router_probs(base.transpose(0, 1))
    routing = moe.topk_routing_map(probs, k)
    pad_rows = pad.transpose(0, 1)
    c, n = moe.sequence_tokens_per_expert(routing, keep_mask=~pad_rows)
    mean_n = torch.full((b,), n.sum().item() / b)
    quirk, count = moe.sequence_load_balancing_loss(
        probs, routing, topk=k, num_experts=num_experts, coeff=coeff, keep_mask=~pad_rows, counts=(c, mean_n)
    )
    _close(quirk / count, m_loss)
    exact, _ = moe.sequence_load_balancing_loss(
        probs, routing, topk=k, num_experts=num_experts, coeff=coeff, keep_mask=~pad_rows
    )
    assert abs(exact.item() / b - m_loss.item()) > 1e-3 * m_loss.item()


@pytest.mark.parametrize("with_padding", [False, True])
def test_z_loss_matches_megatron(with_padding):
    base = _logits(30, 8, seed=5) * 3
    pad = (torch.arange(30) % 4 == 0) if with_padding else None
    lm = base.clone().requires_grad_(True)
    m = moe_utils.z_loss_func(lm, 1e-3, padding_mask=pad)
    m.backward()
    lo = base.clone().requires_grad_(True)
    z = moe.router_z_loss(lo, 1e-3, keep_mask=None if pad is None else ~pad)
    z.backward()
    _close(z, m)
    _close(lo.grad, lm.grad, atol=1e-12)


def test_z_loss_all_padding_matches_megatron():
    pad = torch.ones(5, dtype=torch.bool)
    m = moe_utils.z_loss_func(_logits(5, 4, seed=6), 0.1, padding_mask=pad)
    assert moe.router_z_loss(_logits(5, 4, seed=6), 0.1, keep_mask=~pad).item() == m.item() == 0.0


@pytest.mark.parametrize("shape", [(8,), (3, 8)])
def test_expert_bias_update_matches_megatron(single_rank, shape):
    g = torch.Generator().manual_seed(7)
    rows = torch.tensor([[3.0, 5, 4, 4, 1, 7, 4, 4], [0, 0, 0, 0, 0, 0, 0, 0], [9, 0, 2, 1, 1, 6, 3, 2]])
    counts = rows[0] if len(shape) == 1 else rows  # experts at the mean (sign 0) and an all-zero layer
    bias = torch.randn(shape, generator=g)
    want = moe_utils.get_updated_expert_bias(counts.clone(), bias.clone(), 1e-3)
    got = moe.expert_bias_update(counts, bias, 1e-3)
    assert torch.equal(got, want)


def test_megatron_has_no_zero_mean_bias_correction(single_rank):
    counts, bias = torch.tensor([4.0, 0.0, 0.0]), torch.zeros(3)
    want = moe_utils.get_updated_expert_bias(counts.clone(), bias.clone(), 0.3)
    assert torch.equal(moe.expert_bias_update(counts, bias, 0.3, zero_mean=False), want)
    assert not torch.equal(moe.expert_bias_update(counts, bias, 0.3, zero_mean=True), want)


# ------------------------------------------------------------------------------------------------
# DSA indexer loss
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_loss_matches_megatron(sparse):
    dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
    sq, b, heads, dim, index_topk, coeff = 10, 2, 3, 8, 4, 0.7
    g = torch.Generator().manual_seed(8)
    query = torch.randn(sq, b, heads, dim, generator=g)
    key = torch.randn(sq, b, heads, dim, generator=g)
    scale = dim**-0.5
    causal = torch.triu(torch.full((sq, sq), float("-inf")), diagonal=1)
    index_scores = (torch.randn(b, sq, sq, generator=g) * 2 + causal).requires_grad_(True)
    topk_indices = index_scores.detach().topk(min(index_topk, sq), dim=-1)[1]
    pg = types.SimpleNamespace(tp=_Group1())

    m_in = index_scores.clone()  # Megatron adds the sparse mask in place
    m_loss = dsa.compute_dsa_indexer_loss(m_in, topk_indices, query, key, scale, coeff, sparse, pg)
    m_loss.backward()
    m_grad = index_scores.grad.clone()
    index_scores.grad = None

    # Main attention probabilities, computed here as Megatron does before its own masking.
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale + causal
    attn = torch.softmax(scores, dim=-1)
    got = indexer_kl(attn, index_scores, None, topk=index_topk if sparse else None)
    loss = got / (b * sq) * coeff  # Megatron: mean over all b*sq query tokens, times coeff
    loss.backward()
    # Megatron evaluates log(x + 1e-10); the exact log differs by ~1e-10 per key.
    _close(loss, m_loss, rtol=1e-5)
    _close(index_scores.grad, m_grad, rtol=1e-5, atol=1e-8)
