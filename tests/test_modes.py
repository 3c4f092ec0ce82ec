"""Pure semantics of semantics §1–§2: hand-worked values, the gap identity, and GA invariance per mode."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import lossparity as lp
from lossparity.losses.logchannel import IntervalMean, ratio_or_none
from lossparity.losses.modes import Normalizers, count_normalizers, denominator

# Hand-worked example (see the comments for the arithmetic).
#   A: l=[1,2,3] w=[1,1,1] -> s=6 n=3 mean 2      segments [1,1,2]: docs (A,1) 3/2, (A,2) 3/1
#   B: l=[4,9,9] w=[1,0,0] -> s=4 n=1 mean 4      segments [1,0,0]: doc (B,1) 4/1
#   C: all padding        -> s=0 n=0 (counts!)    segments [1,1,0]: doc (C,1) 0/0 -> 0, counts
#   D: l=[.5,1.5,7] w=[1,1,0] -> s=2 n=2 mean 1   segments [1,1,0]: doc (D,1) 2/2
LOSS = torch.tensor([[1, 2, 3], [4, 9, 9], [5, 5, 5], [0.5, 1.5, 7]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.float64)
SEG = torch.tensor([[1, 1, 2], [1, 0, 0], [1, 1, 0], [1, 1, 0]])
HAND = {
    "per_token": 12 / 6,
    "per_sample": (2 + 4 + 0 + 1) / 4,
    "per_microbatch": ((6 + 4) / 4 + (0 + 2) / 2) / 2,  # b = 2
    "per_document": (1.5 + 3 + 4 + 0 + 1) / 5,
    "sample_sum": 12 / 4,
    "sample_sum_norm": 12 / (4 * 3),  # L = 3
    "token_sum": 12,
    "per_group": ((6 + 4) / 4 + (0 + 2) / 2) / 2,  # groups {A, B}, {C, D}
}
GROUPS = torch.tensor([0, 0, 1, 1])
# per_group's counts span microbatches: the RLAccountant counts them (tests/test_rl_modes.py)
ACCOUNTANT_MODES = tuple(m for m in lp.MODES if m != "per_group")


@pytest.mark.parametrize("mode", lp.MODES)
def test_hand_worked_example(mode):
    got = lp.objective(mode, LOSS, MASK, segment_ids=SEG, microbatch_size=2, fixed_length=3, group_ids=GROUPS)
    assert float(got) == pytest.approx(HAND[mode], abs=1e-15)


@pytest.mark.parametrize("mode", ACCOUNTANT_MODES)
def test_hand_worked_through_accountant_ga2(mode):
    acc = lp.Accountant(mode, fixed_length=3)
    acc.begin_step([MASK[:2], MASK[2:]], [SEG[:2], SEG[2:]])
    total = acc.lm_loss(LOSS[:2], MASK[:2], SEG[:2]) + acc.lm_loss(LOSS[2:], MASK[2:], SEG[2:])
    acc.finish_step()
    logs = acc.logs()
    assert float(total) == pytest.approx(HAND[mode], abs=1e-15)
    assert logs["objective"] == pytest.approx(HAND[mode], abs=1e-15)
    assert logs["lm_loss"] == pytest.approx(2.0, abs=1e-15)  # log channel: always the token mean
    assert logs["tokens"] == 6 and logs["samples"] == 4


def test_all_padding_sample_counts_in_denominator():
    # Removing the all-padding row C changes per_sample from 7/4 to 7/3: it must count.
    keep = torch.tensor([0, 1, 3])
    assert float(lp.objective("per_sample", LOSS, MASK)) == pytest.approx(7 / 4)
    assert float(lp.objective("per_sample", LOSS[keep], MASK[keep])) == pytest.approx(7 / 3)


def test_zero_tokens_gives_zero_objective_and_missing_lm_loss():
    zero = torch.zeros_like(MASK)
    for mode in lp.MODES:
        kw = {"group_ids": GROUPS} if mode == "per_group" else {}
        assert float(lp.objective(mode, LOSS, zero, segment_ids=SEG, microbatch_size=2, fixed_length=3, **kw)) == 0.0
    acc = lp.Accountant("per_token")
    acc.begin_step([zero])
    out = acc.lm_loss(LOSS, zero)
    assert float(out) == 0.0 and not math.isnan(float(out))
    acc.finish_step()
    logs = acc.logs()
    assert logs["lm_loss"] is None and logs["objective"] == 0.0


def test_gap_hand_worked():
    s, n = lp.sample_stats(LOSS, MASK)
    gap = lp.estimator_gap(s, n)
    # n=[3,1,0,2], l=[2,4,0,1]: Cov = 0.375, mean(n) = 1.5 -> 0.25 = 2 - 1.75
    assert gap.per_token == pytest.approx(2.0) and gap.per_sample == pytest.approx(1.75)
    assert gap.cov == pytest.approx(0.375) and gap.cov_term == pytest.approx(0.25)
    assert gap.gap == pytest.approx(0.25)


def test_directionality_and_gap_identity():
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 200, (64,), generator=g)
    S = int(lengths.max())
    mask = (torch.arange(S)[None, :] < lengths[:, None]).double()
    # longer samples have higher mean loss
    base = 0.5 + lengths.double()[:, None] / 100
    loss = base + 0.1 * torch.rand(64, S, generator=g, dtype=torch.float64)
    pt = float(lp.objective("per_token", loss, mask))
    ps = float(lp.objective("per_sample", loss, mask))
    assert ps < pt
    s, n = lp.sample_stats(loss, mask)
    gap = lp.estimator_gap(s, n)
    # independent covariance in plain Python floats
    nn_, ll = n.tolist(), (s / n).tolist()
    mn, ml = sum(nn_) / 64, sum(ll) / 64
    cov = sum((a - mn) * (b - ml) for a, b in zip(nn_, ll)) / 64
    assert pt - ps == pytest.approx(cov / mn, abs=1e-12)
    assert gap.gap == pytest.approx(gap.cov_term, abs=1e-12)


def test_per_token_single_microbatch_bit_for_bit_with_cross_entropy():
    torch.manual_seed(0)
    for B, S, V in [(4, 128, 300), (8, 512, 1000), (2, 2048, 64)]:
        logits = torch.randn(B, S, V)
        labels = torch.randint(0, V, (B, S))
        labels[:, -5:] = -100
        labels[0, ::3] = -100
        mask = (labels != -100).float()
        ref = F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="sum") / mask.sum()
        per_tok = F.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="none").view(B, S)
        acc = lp.Accountant("per_token")
        acc.begin_step([mask])
        got = acc.lm_loss(per_tok, mask)
        assert got.dtype == torch.float32
        assert got.item() == ref.item()  # bit-for-bit
        assert lp.objective("per_token", per_tok, mask).item() == ref.item()


def _naive_float64(mode, loss, mask, seg, b, L):
    """Independent reference: Python loops (no library code)."""
    rows = loss.shape[0]
    s = [float((loss[i] * mask[i]).sum()) for i in range(rows)]
    n = [float(mask[i].sum()) for i in range(rows)]
    if mode == "per_token":
        return sum(s) / max(sum(n), 1)
    if mode == "per_sample":
        return sum(a / max(c, 1) for a, c in zip(s, n)) / rows
    if mode == "per_microbatch":
        vals = [sum(s[i : i + b]) / max(sum(n[i : i + b]), 1) for i in range(0, rows, b)]
        return sum(vals) / len(vals)
    if mode == "per_document":
        docs = {}  # a document is a run of equal non-zero ids in a row (semantics §0): key (row, run start)
        for i in range(rows):
            start = 0
            for t in range(loss.shape[1]):
                if t == 0 or seg[i, t] != seg[i, t - 1]:
                    start = t
                if seg[i, t] > 0:
                    d = docs.setdefault((i, start), [0.0, 0.0])
                    d[0] += float(loss[i, t] * mask[i, t])
                    d[1] += float(mask[i, t])
        return sum(a / max(c, 1) for a, c in docs.values()) / max(len(docs), 1)
    if mode == "sample_sum":
        return sum(s) / rows
    if mode == "token_sum":
        return sum(s)
    return sum(s) / (rows * L)


@st.composite
def _batches(draw):
    b = draw(st.sampled_from([1, 2, 3]))
    k = draw(st.sampled_from([1, 2, 4]))
    S = draw(st.integers(1, 12))
    rows = b * k
    lengths = draw(st.lists(st.integers(0, S), min_size=rows, max_size=rows))
    seed = draw(st.integers(0, 2**31 - 1))
    return b, k, S, lengths, seed


@settings(max_examples=60, deadline=None)
@given(_batches())
def test_property_accountant_matches_naive_for_random_layouts(case):
    b, k, S, lengths, seed = case
    g = torch.Generator().manual_seed(seed)
    rows = b * k
    loss = torch.rand(rows, S, generator=g, dtype=torch.float64) * 4
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).double()
    # random packing: 1-3 segments per row, padding tail (segment 0) where the row is short
    cut = torch.randint(0, S + 1, (rows,), generator=g)
    seg = torch.where(torch.arange(S)[None, :] < cut[:, None], 1, 2)
    seg = torch.where(torch.arange(S)[None, :] < torch.tensor(lengths)[:, None] + 1, seg, 0)
    for mode in ACCOUNTANT_MODES:
        ref = _naive_float64(mode, loss, mask, seg, b, S)
        acc = lp.Accountant(mode, fixed_length=S)
        acc.begin_step([mask[i : i + b] for i in range(0, rows, b)], [seg[i : i + b] for i in range(0, rows, b)])
        total = sum(float(acc.lm_loss(loss[i : i + b], mask[i : i + b], seg[i : i + b])) for i in range(0, rows, b))
        acc.finish_step()
        logs = acc.logs()
        assert total == pytest.approx(ref, rel=1e-12, abs=1e-12), mode
        assert logs["objective"] == pytest.approx(ref, rel=1e-12, abs=1e-12), mode
        tokens = float(mask.sum())
        assert logs["tokens"] == tokens
        if tokens:
            assert logs["lm_loss"] == pytest.approx(float((loss * mask).sum()) / tokens, rel=1e-12)
        else:
            assert logs["lm_loss"] is None


def test_normalizers_and_denominator():
    n = count_normalizers(MASK, SEG)
    assert (n.tokens, n.samples, n.documents, n.microbatches) == (6, 4, 5, 1)
    assert denominator("per_token", n + n) == 12.0
    assert denominator("per_document", n) == 5.0


def test_log_helpers():
    assert ratio_or_none(1.0, 0.0) is None and ratio_or_none(3.0, 2.0) == 1.5
    m = IntervalMean()
    m.update({"lm_loss": 2.0, "x": None})
    m.update({"lm_loss": 100.0}, skipped=True)
    m.update({"lm_loss": 4.0, "x": 1.0})
    assert m.compute() == {"lm_loss": 3.0, "x": 1.0} and m.skipped == 1


def test_denominator_refuses_fixed_length_in_both_ports():
    # the L of sample_sum_norm is divided in the numerator; the JAX port raised, torch silently ignored it
    norms = Normalizers(tokens=6, samples=2, documents=0, microbatches=1)
    with pytest.raises(ValueError, match="denominator takes no fixed_length"):
        denominator("sample_sum_norm", norms, fixed_length=3)
    assert denominator("sample_sum_norm", norms) == 2.0


def test_count_documents_matches_numbering():
    from lossparity.losses.stats import count_documents, rows_documents

    seg = torch.tensor([[1, 1, 2, 0], [0, 0, 0, 0], [3, 3, 1, 1], [2, 0, 2, 5]])
    # runs of equal non-zero ids: [1,1][2] | none | [3,3][1,1] | [2][2][5] (padding splits the two 2s)
    assert count_documents(seg) == rows_documents(seg)[1] == 2 + 0 + 2 + 3
    assert rows_documents(seg)[0].tolist() == [[0, 0, 1, -1], [-1] * 4, [2, 2, 3, 3], [4, -1, 5, 6]]
    assert count_documents(torch.zeros(0, 3, dtype=torch.long)) == 0
