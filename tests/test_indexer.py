"""DeepSeek-V3.2 indexer KL loss (semantics §5) against a naive float64 loop and hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch

from lossparity.losses.indexer import indexer_kl, indexer_loss, indexer_token_count

NEG_INF = float("-inf")


def naive_indexer_kl(attn, logits, mask, topk=None) -> list[list[float]]:
    """attn [B][H][Tq][Tk], logits [B][Tq][Tk] (-inf = excluded), mask [B][Tq] -> KL per query (float64)."""
    out = []
    for b in range(len(attn)):
        row_out = []
        for t in range(len(logits[b])):
            if not mask[b][t]:
                row_out.append(0.0)
                continue
            lg = logits[b][t]
            keys = [j for j, v in enumerate(lg) if v != NEG_INF]
            if topk is not None:
                keys = sorted(range(len(lg)), key=lambda j: -lg[j])[:topk]
                keys = [j for j in keys if lg[j] != NEG_INF]
            p = {j: 0.0 for j in keys}
            for head in attn[b]:
                mass = sum(head[t][j] for j in keys)
                for j in keys:
                    p[j] += head[t][j] / mass
            total = sum(p.values())
            m = max(lg[j] for j in keys)
            z = sum(math.exp(lg[j] - m) for j in keys)
            kl = 0.0
            for j in keys:
                pj = p[j] / total
                if pj > 0:
                    qj = math.exp(lg[j] - m) / z
                    kl += pj * (math.log(pj) - math.log(qj))
            row_out.append(kl)
        out.append(row_out)
    return out


def causal_case(b=2, h=3, t=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    scores = torch.randn(b, h, t, t, generator=g).masked_fill(causal, NEG_INF)
    attn = torch.softmax(scores, dim=-1)
    logits = (torch.randn(b, t, t, generator=g) * 2).masked_fill(causal, NEG_INF)
    return attn, logits


def test_dense_causal_matches_float64_loop():
    attn, logits = causal_case()
    mask = torch.tensor([[1, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    per_tok = indexer_kl(attn, logits, mask, reduction="none")
    want = torch.tensor(
        naive_indexer_kl(attn.double().tolist(), logits.double().tolist(), mask.tolist()), dtype=torch.float64
    )
    assert per_tok.shape == (2, 6) and per_tok.dtype == torch.float32
    torch.testing.assert_close(per_tok.double(), want, rtol=1e-5, atol=1e-6)
    assert per_tok[0, 4].item() == 0.0 and per_tok[1, 0].item() == 0.0
    total = indexer_kl(attn, logits, mask)
    assert total.dim() == 0 and total.item() == pytest.approx(want.sum().item(), rel=1e-5)


@pytest.mark.parametrize("topk", [1, 2, 4, 10])
def test_topk_matches_float64_loop(topk):
    attn, logits = causal_case(seed=1)
    mask = torch.ones(2, 6, dtype=torch.bool)
    got = indexer_kl(attn, logits, mask, topk=topk, reduction="none")
    want = naive_indexer_kl(attn.double().tolist(), logits.double().tolist(), mask.tolist(), topk=topk)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    if topk == 1:  # one key: both distributions are the point mass, KL = 0
        assert torch.equal(got, torch.zeros_like(got))


def test_topk_renormalizes_each_head_before_summing():
    # One query, 3 keys, 2 heads; indexer keeps keys {0, 1}.
    attn = torch.tensor([[[[0.8, 0.1, 0.1]]], [[[0.1, 0.1, 0.8]]]]).transpose(0, 1)  # [1, 2, 1, 3]
    logits = torch.tensor([[[0.0, 0.0, -1.0]]])
    got = indexer_kl(attn, logits, None, topk=2)
    # head 0 on {0,1}: [8/9, 1/9]; head 1: [1/2, 1/2]; sum [25/18, 11/18] -> p = [25/36, 11/36]; q = [1/2, 1/2]
    p = [25 / 36, 11 / 36]
    want = sum(pi * math.log(pi / 0.5) for pi in p)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_zero_when_indexer_matches_target_and_zero_log_zero():
    attn = torch.tensor([[[[0.5, 0.5, 0.0, 0.0]], [[0.3, 0.1, 0.6, 0.0]]]])  # [1, 2, 1, 4]
    p = torch.tensor([0.8 / 2, 0.6 / 2, 0.6 / 2, 0.0])  # head sum / 2 (each head already sums to 1)
    logits = torch.log(p.clamp(min=1e-30)).view(1, 1, 4)
    logits[..., 3] = 5.0  # a kept key with p = 0 contributes 0 * log 0 = 0, only q moves
    got = indexer_kl(attn, logits, torch.ones(1, 1))
    q = torch.softmax(logits.double(), -1)[0, 0]
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(p.double().tolist()[:3], q.tolist()[:3]))
    assert math.isfinite(got.item()) and got.item() == pytest.approx(want, rel=1e-5)
    logits_exact = torch.log(torch.tensor([0.4, 0.3, 0.3])).view(1, 1, 3)
    attn3 = torch.tensor([[[[0.5, 0.5, 0.0]], [[0.3, 0.1, 0.6]]]])
    assert abs(indexer_kl(attn3, logits_exact, None).item()) < 1e-6


def test_gradient_only_into_indexer_and_equals_q_minus_p():
    attn, logits = causal_case(b=1, h=2, t=5, seed=2)
    attn = attn.clone().requires_grad_(True)
    lg = logits.clone().requires_grad_(True)
    indexer_kl(attn, lg, torch.ones(1, 5)).backward()
    assert attn.grad is None
    # dKL/dI = q - p on kept keys, 0 on excluded keys.
    q = torch.softmax(logits.double(), dim=-1)
    p = attn.detach().double().sum(1)
    p = p / p.sum(-1, keepdim=True)
    torch.testing.assert_close(lg.grad.double(), q - p, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(lg.grad).all()


def test_unbatched_shapes_and_count_helper():
    attn, logits = causal_case(b=1, seed=3)
    mask = torch.tensor([1, 0, 1, 1, 1, 1])
    batched = indexer_kl(attn, logits, mask.unsqueeze(0), reduction="none")
    unb = indexer_kl(attn[0], logits[0], mask, reduction="none")
    assert unb.shape == (6,) and torch.equal(unb, batched[0])
    assert indexer_token_count(mask).item() == 5
    assert indexer_token_count(mask.bool()).dtype == torch.int64
    with pytest.raises(ValueError, match="mask values must be 0 or 1"):
        indexer_token_count(torch.tensor([0, 3]))


def test_invariant_sum_over_batch_split():
    attn, logits = causal_case(b=4, seed=4)
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[:, 0] = True
    whole = indexer_kl(attn, logits, mask) / indexer_token_count(mask)
    parts = [indexer_kl(attn[i : i + 2], logits[i : i + 2], mask[i : i + 2]) for i in (0, 2)]
    counts = [indexer_token_count(mask[i : i + 2]) for i in (0, 2)]
    assert (sum(parts) / sum(counts)).item() == pytest.approx(whole.item(), rel=1e-6)


def test_all_masked_queries_and_keyless_invalid_rows_give_zero_and_finite_grad():
    attn, logits = causal_case(b=1, seed=5)
    lg = logits.clone()
    lg[0, 2] = NEG_INF  # no kept key, but the query is invalid: allowed
    lg.requires_grad_(True)
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[0, 2] = False
    out = indexer_kl(attn, lg, mask)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(lg.grad).all()
    assert torch.equal(lg.grad[0, 2], torch.zeros(6))
    lg2 = logits.clone().requires_grad_(True)
    z = indexer_kl(attn, lg2, torch.zeros(1, 6))
    z.backward()
    assert z.item() == 0.0 and torch.equal(lg2.grad, torch.zeros_like(lg2))


def test_bad_inputs():
    attn, logits = causal_case(b=1, seed=6)
    ones = torch.ones(1, 6)
    with pytest.raises(ValueError, match="indexer_logits shape"):
        indexer_kl(attn, logits[:, :5], ones)
    with pytest.raises(ValueError, match="main_attn_probs must be"):
        indexer_kl(attn[0, 0], logits, ones)
    with pytest.raises(ValueError, match=r"mask shape \(6,\) must be \[batch, query_len\]"):
        indexer_kl(attn, logits, torch.ones(6))
    with pytest.raises(ValueError, match="mask values must be 0 or 1"):
        indexer_kl(attn, logits, ones * 2)
    with pytest.raises(ValueError, match="topk must be a positive int"):
        indexer_kl(attn, logits, ones, topk=0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        indexer_kl(attn, logits, ones, reduction="mean")
    bad = logits.clone()
    bad[0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="indexer_logits contain NaN"):
        indexer_kl(attn, bad, ones)
    bad[0, 3, 0] = float("inf")
    with pytest.raises(ValueError, match="indexer_logits contain NaN or \\+inf"):
        indexer_kl(attn, bad, ones)
    neg = attn.clone()
    neg[0, 0, 0, 0] = -0.1
    with pytest.raises(ValueError, match="main_attn_probs must be non-negative"):
        indexer_kl(neg, logits, ones)
    no_mass = attn.clone()
    no_mass[0, :, 3, :2] = 0.0
    sel = torch.full_like(logits, NEG_INF)
    sel[0, :, :] = logits[0]
    sel[0, 3, 2:] = NEG_INF  # query 3 keeps only keys 0, 1 where the attention has no mass
    with pytest.raises(ValueError, match=r"no attention mass .* \(batch 0, position 3\)"):
        indexer_kl(no_mass, sel, ones)
    with pytest.raises(TypeError, match="indexer_logits must be floating point"):
        indexer_kl(attn, torch.zeros(1, 6, 6, dtype=torch.long), ones)


def test_deferred_normalization_with_the_indexer_loss_is_refused_before_any_state():
    # Before: the share divided by this rank's query tokens (deferred counts are local until finish_step)
    # and finish_step then divided by the global LM tokens: a layout-dependent indexer objective.
    from lossparity.training.config import TrainConfig
    from lossparity.training.trainer import Trainer

    kw = {"normalization": "deferred", "mtp_convention": "main", "model_overrides": {"indexer_layer": 1}, "steps": 1}
    kw.update(aux_scope="none", z_coeff=0.0)  # the MoE terms have their own deferred rule
    with pytest.raises(ValueError, match="DSA indexer loss.*normalization='precount', or indexer_coeff=0"):
        Trainer(TrainConfig(**kw))
    assert Trainer(TrainConfig(**kw, indexer_coeff=0.0)).model_config.indexer_layer == 1


def test_queries_without_a_key_give_zero_and_count_only_among_all():
    # compressed attention: the first query rows have no causal key yet. Rule: KL 0, no gradient, not valid.
    attn, logits = causal_case(seed=3)
    logits = logits.clone()
    logits[0, :2] = NEG_INF
    logits[1, 0] = NEG_INF
    lg = logits.clone().requires_grad_(True)
    per_q = indexer_kl(attn, lg, None, reduction="none")
    assert per_q[0, :2].tolist() == [0.0, 0.0] and per_q[1, 0].item() == 0.0
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False
    keep[1, 0] = False
    want = naive_indexer_kl(attn.double().tolist(), logits.double().tolist(), keep.tolist())
    torch.testing.assert_close(per_q.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    per_q.sum().backward()
    assert torch.isfinite(lg.grad).all() and lg.grad[0, :2].abs().sum() == 0
    total = sum(map(sum, want))
    # log forms: coefficient in or out, mean over all queries (Megatron: b·sq) or over the 9 valid ones
    assert indexer_loss(attn, logits, None, coeff=0.5).item() == pytest.approx(0.5 * total / 12, rel=1e-5)
    assert indexer_loss(attn, logits, None, coeff=0.5, include_coeff=False).item() == pytest.approx(
        total / 12, rel=1e-5
    )
    assert indexer_loss(attn, logits, None, mean_over="valid").item() == pytest.approx(total / 9, rel=1e-5)
    mask = torch.ones(2, 6)
    mask[1, 5] = 0
    want_m = naive_indexer_kl(attn.double().tolist(), logits.double().tolist(), (keep & (mask > 0)).tolist())
    got = indexer_loss(attn, logits, mask, mean_over="valid")
    assert got.item() == pytest.approx(sum(map(sum, want_m)) / 8, rel=1e-5)
    with pytest.raises(ValueError, match="mean_over must be one of"):
        indexer_loss(attn, logits, None, mean_over="tokens")


def test_sparse_topk_indices_equal_the_selected_key_set():
    attn, logits = causal_case(seed=4)
    idx = logits.topk(3, dim=-1).indices  # includes -inf keys in the first rows: those stay excluded
    got = indexer_kl(attn, logits, None, topk_indices=idx, reduction="none")
    want = naive_indexer_kl(attn.double().tolist(), logits.double().tolist(), [[1] * 6] * 2, topk=3)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    padded = torch.cat([idx, torch.full_like(idx[..., :1], -1)], dim=-1)  # -1 = no key
    assert torch.equal(indexer_kl(attn, logits, None, topk_indices=padded, reduction="none"), got)
    with pytest.raises(ValueError, match="not both"):
        indexer_kl(attn, logits, None, topk=3, topk_indices=idx)
    with pytest.raises(ValueError, match=r"topk_indices must be in -1\.\.5"):
        indexer_kl(attn, logits, None, topk_indices=idx + 6)
    with pytest.raises(ValueError, match=r"topk_indices shape"):
        indexer_kl(attn, logits, None, topk_indices=idx[0])
