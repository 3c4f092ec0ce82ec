"""Multi-token prediction (semantics §4): rolling within rows and documents, the three count conventions,
per-layer normalization, invariance under gradient accumulation, logs and bad input."""

from __future__ import annotations

import pytest
import torch

import lossparity as lp
from lossparity.losses.mtp import mtp_objective, roll_mask, roll_mtp


def test_roll_within_rows_and_documents_matches_naive_loop():
    g = torch.Generator().manual_seed(3)
    B, S = 3, 10
    labels = torch.randint(0, 50, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) < 0.8).double()
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0], [1] * 10, [1, 1, 2, 2, 2, 2, 2, 2, 0, 0]])
    mask = mask * (seg > 0)
    labels = torch.where(mask > 0, labels, torch.full_like(labels, -100))
    for k in (1, 2, 3):
        lab_k, w_k = roll_mtp(labels, mask, seg, k)
        for i in range(B):
            for t in range(S):
                inside = t + k < S and seg[i, t] > 0 and seg[i, t + k] == seg[i, t]
                exp_w = float(mask[i, t + k]) if inside else 0.0
                assert float(w_k[i, t]) == exp_w, (k, i, t)
                assert int(lab_k[i, t]) == (int(labels[i, t + k]) if exp_w else -100)


def test_roll_without_segments_only_masks_the_tail():
    w = torch.ones(2, 5)
    assert roll_mask(w, None, 2).tolist() == [[1, 1, 1, 0, 0]] * 2


def test_three_conventions_differ_hand_worked():
    # One row, main mask [1,1,1,0] -> 3 tokens; depth 1 mask [1,1,0,0] (2 tokens), depth 2 [1,0,0,0] (1 token).
    # Depth losses l1=[1,2,..] (S_1=3), l2=[4,..] (S_2=4).
    #   own    = (1/2)(3/2 + 4/1) = 2.75
    #   main   = (1/2)(3/3 + 4/3) = 7/6
    #   pooled = (3 + 4)/(2 + 1) = 7/3
    main_mask = torch.tensor([[1.0, 1, 1, 0]])
    m1, m2 = roll_mask(main_mask, None, 1), roll_mask(main_mask, None, 2)
    assert m1.tolist() == [[1, 1, 0, 0]] and m2.tolist() == [[1, 0, 0, 0]]
    l1 = torch.tensor([[1.0, 2, 9, 9]], dtype=torch.float64)
    l2 = torch.tensor([[4.0, 9, 9, 9]], dtype=torch.float64)
    expected = {"own": 2.75, "main": 7 / 6, "pooled": 7 / 3}
    for conv, value in expected.items():
        got = mtp_objective("per_token", [l1, l2], [m1, m2], main_mask, weight=0.3, convention=conv)
        assert float(got) == pytest.approx(0.3 * value, abs=1e-15), conv
        acc = lp.Accountant("per_token", mtp_depths=2, mtp_convention=conv)
        acc.begin_step([main_mask], mtp_weight=0.3)
        acc.lm_loss(torch.zeros(1, 4, dtype=torch.float64), main_mask)
        share = acc.mtp_loss([l1, l2], [m1, m2])
        acc.finish_step()
        logs = acc.logs()
        assert float(share) == pytest.approx(0.3 * value, abs=1e-15), conv
        assert logs["objective"] == pytest.approx(0.3 * value, abs=1e-15)
        # log channel: per-depth token means, never multiplied by lambda
        assert logs["mtp_1_loss"] == pytest.approx(1.5) and logs["mtp_2_loss"] == pytest.approx(4.0)


def _naive_mtp(mode, conv, losses, masks, main_mask, N, b):
    """Python-loop reference of semantics §4 (own/main/pooled) for modes per_token/per_sample/per_microbatch."""
    Dm = len(losses)

    def rows_stats(loss, mask):
        return ([float((loss[i] * mask[i]).sum()) for i in range(N)], [float(mask[i].sum()) for i in range(N)])

    if conv == "pooled":
        s = [0.0] * N
        n = [0.0] * N
        for x, w in zip(losses, masks):
            si, ni = rows_stats(x, w)
            s = [a + c for a, c in zip(s, si)]
            n = [a + c for a, c in zip(n, ni)]
        if mode == "per_token":
            return sum(s) / max(sum(n), 1)
        if mode == "per_sample":
            return sum(a / max(c, 1) for a, c in zip(s, n)) / N
        return sum(sum(s[i : i + b]) / max(sum(n[i : i + b]), 1) for i in range(0, N, b)) / (N // b)
    total = 0.0
    ntok_main = float(main_mask.sum())
    for x, w in zip(losses, masks):
        s, n = rows_stats(x, w)
        if mode == "per_token":
            total += sum(s) / max(ntok_main if conv == "main" else sum(n), 1)
        elif mode == "per_sample":
            total += sum(a / max(c, 1) for a, c in zip(s, n)) / N
        else:
            total += sum(sum(s[i : i + b]) / max(sum(n[i : i + b]), 1) for i in range(0, N, b)) / (N // b)
    return total / Dm


@pytest.mark.parametrize("conv", ["own", "main", "pooled"])
@pytest.mark.parametrize("mode", ["per_token", "per_sample", "per_microbatch"])
def test_accountant_mtp_matches_naive_for_every_k(mode, conv):
    g = torch.Generator().manual_seed(11)
    N, S, Dm = 8, 7, 2
    lengths = torch.tensor([7, 1, 0, 3, 5, 2, 7, 4])  # includes an all-padding sample and a 1-token one
    main_mask = (torch.arange(S)[None] < lengths[:, None]).double()
    masks = [roll_mask(main_mask, None, k) for k in range(1, Dm + 1)]
    losses = [torch.rand(N, S, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(Dm)]
    b = 2
    ref = _naive_mtp(mode, conv, [x.detach() for x in losses], masks, main_mask, N, b)
    # autograd reference: gradient of the library's whole-batch formula
    whole = mtp_objective(mode, losses, masks, main_mask, convention=conv, microbatch_size=b)
    assert float(whole.detach()) == pytest.approx(ref, rel=1e-12)
    gref = torch.autograd.grad(whole, losses)
    for K in (1, 2, 4):
        if mode == "per_microbatch" and N // K != b:
            continue
        rows = N // K
        acc = lp.Accountant(mode, mtp_depths=Dm, mtp_convention=conv)
        acc.begin_step([main_mask[k * rows : (k + 1) * rows] for k in range(K)])
        total = 0
        for k in range(K):
            sl = slice(k * rows, (k + 1) * rows)
            acc.lm_loss(torch.zeros(rows, S, dtype=torch.float64), main_mask[sl])
            total = total + acc.mtp_loss([x[sl] for x in losses], [w[sl] for w in masks])
        grads = torch.autograd.grad(total, losses)
        acc.finish_step()
        logs = acc.logs()
        assert float(total.detach()) == pytest.approx(ref, rel=1e-12), K
        assert logs["objective"] == pytest.approx(ref, rel=1e-12), K
        for a, r in zip(grads, gref):
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-15)


def test_per_layer_norm_differs_from_pooled_per_sample():
    # own == MaxText mtp_per_layer_loss_norm=True (every (depth, sample) pair weighs the same);
    # pooled == per-sample over both depths pooled.
    main = torch.tensor([[1.0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    masks = [roll_mask(main, None, 1), roll_mask(main, None, 2)]  # row0: 3,2 tokens; row1: 1,0 tokens
    l1 = torch.tensor([[1.0, 1, 1, 0, 0, 0], [5, 0, 0, 0, 0, 0]], dtype=torch.float64)
    l2 = torch.tensor([[2.0, 2, 0, 0, 0, 0], [9, 9, 0, 0, 0, 0]], dtype=torch.float64)
    own = mtp_objective("per_sample", [l1, l2], masks, main, convention="own")
    pooled = mtp_objective("per_sample", [l1, l2], masks, main, convention="pooled")
    # own: depth1 (1 + 5)/2 = 3, depth2 (2 + 0)/2 = 1 (row1 has no depth-2 token: 0, still counts) -> 2
    # pooled: row0 (3+4)/(3+2) = 1.4, row1 5/1 = 5 -> 3.2
    assert float(own) == pytest.approx(2.0) and float(pooled) == pytest.approx(3.2)


def test_packed_rows_roll_within_documents_in_accountant_counts():
    main = torch.tensor([[1.0, 1, 0, 1, 1, 1, 0, 0]])
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
    acc = lp.Accountant("per_token", mtp_depths=1)
    acc.begin_step([main], [seg])
    # depth-1 tokens at t=0 (t+1 in doc 1), t=3 and t=4 (doc 2); t=2 would cross into doc 2: masked
    assert acc.global_count("mtp_1_tokens") == 3
    acc.lm_loss(torch.zeros(1, 8), main, seg)


def test_all_padding_depth_is_zero_not_nan_and_log_missing():
    main = torch.tensor([[1.0, 0, 0]])  # depth 1 has no token at all
    acc = lp.Accountant("per_token", mtp_depths=1)
    acc.begin_step([main])
    acc.lm_loss(torch.ones(1, 3), main)
    share = acc.mtp_loss([torch.ones(1, 3)], [roll_mask(main, None, 1)])
    assert float(share) == 0.0
    acc.finish_step()
    assert acc.logs()["mtp_1_loss"] is None


def test_megatron_log_estimator_is_mean_of_microbatch_means():
    main = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    masks = [roll_mask(main, None, 1)]  # row0 3 tokens, row1 1 token
    l1 = torch.tensor([[1.0, 1, 1, 0], [7, 0, 0, 0]])
    acc = lp.Accountant("per_token", mtp_depths=1, mtp_log_estimator="microbatch_mean")
    acc.begin_step([main[:1], main[1:]])
    for i in range(2):
        acc.lm_loss(torch.zeros(1, 4), main[i : i + 1])
        acc.mtp_loss([l1[i : i + 1]], [masks[0][i : i + 1]])
    # Megatron: mean over microbatches of local means = (1 + 7)/2 = 4; token mean would be 10/4
    acc.finish_step()
    assert acc.logs()["mtp_1_loss"] == pytest.approx(4.0)


def test_bad_mtp_inputs():
    with pytest.raises(ValueError, match="MTP depth k=5 must be smaller than the sequence length 4"):
        roll_mtp(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), None, 5)
    acc = lp.Accountant("per_token", mtp_depths=2)
    acc.begin_step([torch.ones(1, 4)])
    acc.lm_loss(torch.ones(1, 4), torch.ones(1, 4))
    with pytest.raises(ValueError, match="needs 2 losses and masks"):
        acc.mtp_loss([torch.ones(1, 4)], [torch.ones(1, 4)])
    with pytest.raises(ValueError, match=r"mask shape \(1, 3\).*MTP depth 2"):
        acc.mtp_loss([torch.ones(1, 4), torch.ones(1, 4)], [torch.ones(1, 4), torch.ones(1, 3)])
    with pytest.raises(ValueError, match="unknown mtp_convention 'mean'"):
        lp.Accountant("per_token", mtp_depths=1, mtp_convention="mean")


def test_public_log_estimators_match_hand_values_and_the_accountant():
    import lossparity.mtp as public
    from lossparity.losses import mtp as impl
    from lossparity.mtp import microbatch_mean, mtp_log_losses, mtp_log_value, token_mean

    assert public.__all__ == impl.__all__ and all(getattr(public, n) is getattr(impl, n) for n in impl.__all__)

    # the case above by hand: microbatch 0 = row 0 (3 tokens, sum 3), microbatch 1 = row 1 (1 token, sum 7)
    main = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    w = roll_mask(main, None, 1)
    l1 = torch.tensor([[1.0, 1, 1, 0], [7, 0, 0, 0]])
    assert token_mean(10.0, 4.0) == 2.5 and token_mean(0.0, 0.0) is None
    assert microbatch_mean(1.0 + 7.0, 2) == 4.0 and microbatch_mean(0.0, 0) == 0.0
    assert mtp_log_value("token_mean", 10.0, 4.0, 8.0, 2) == 2.5
    assert mtp_log_value("megatron", 10.0, 4.0, 8.0, 2) == 4.0  # the old spelling is accepted
    assert mtp_log_losses([l1], [w]) == [pytest.approx(2.5)]
    assert mtp_log_losses([l1], [w], estimator="microbatch_mean", microbatch_size=1) == [pytest.approx(4.0)]
    assert mtp_log_losses([l1], [w], estimator="microbatch_mean", microbatch_size=2) == [pytest.approx(2.5)]
    with pytest.raises(TypeError, match="microbatch_size"):
        mtp_log_losses([l1], [w], estimator="microbatch_mean")
    with pytest.raises(ValueError, match="unknown mtp_log_estimator"):
        mtp_log_value("median", 1.0, 1.0, 1.0, 1)
    for est, want in (("token_mean", 2.5), ("microbatch_mean", 4.0)):  # the accountant logs the same estimators
        acc = lp.Accountant("per_token", mtp_depths=1, mtp_log_estimator=est)
        acc.begin_step([main[:1], main[1:]])
        for i in range(2):
            acc.lm_loss(torch.zeros(1, 4), main[i : i + 1])
            acc.mtp_loss([l1[i : i + 1]], [w[i : i + 1]])
        acc.finish_step()
        assert acc.logs()["mtp_1_loss"] == pytest.approx(want)
