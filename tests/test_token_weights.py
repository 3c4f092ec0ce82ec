"""Per-token objective weights: Σ w·l equals the mode's microbatch share (semantics §1, §3, §4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lossparity.distributed.accountant import Accountant
from lossparity.losses.modes import MODES as ALL_MODES
from lossparity.losses.modes import numerator
from lossparity.losses.mtp import CONVENTIONS, mtp_numerator, roll_mtp
from lossparity.losses.token_weights import mtp_token_weights, token_weights

# per_group's weights need the groups' global counts: tests/test_rl_modes.py
MODES = tuple(m for m in ALL_MODES if m != "per_group")


def batch(b=3, S=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss = torch.rand(b, S, generator=g, dtype=torch.float64) * 5
    mask = (torch.rand(b, S, generator=g) > 0.3).double()
    mask[1] = 0.0  # a row without loss-bearing tokens
    seg = torch.tensor([[1] * 4 + [2] * 6, [1] * 10, [1] * 3 + [2] * 3 + [3] * 2 + [0] * 2])[:b]
    mask = torch.where(seg > 0, mask, torch.zeros_like(mask))
    return loss, mask, seg


def hand_weight(mode, mask, seg, den, L):
    """The module table, position by position, with plain Python loops."""
    w = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            if mode in ("per_token", "sample_sum", "token_sum"):
                n = 1.0
            elif mode == "sample_sum_norm":
                n = float(L)
            elif mode == "per_sample":
                n = float(mask[i].sum())
            elif mode == "per_microbatch":
                n = float(mask.sum())
            else:
                n = float(mask[i][seg[i] == seg[i, t]].sum())
            w[i, t] = 1.0 / (max(n, 1.0) * den)
    return w


@pytest.mark.parametrize("mode", MODES)
def test_weights_give_the_numerator_over_the_denominator(mode):
    loss, mask, seg = batch()
    w = token_weights(mode, mask, segment_ids=seg, fixed_length=10, denominator=7.0)
    torch.testing.assert_close(w, hand_weight(mode, mask, seg, 7.0, 10), rtol=1e-15, atol=0)
    num = numerator(mode, loss, mask, segment_ids=seg, fixed_length=10)
    torch.testing.assert_close((w * loss).sum(), num / 7.0, rtol=1e-13, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_mtp_weights_give_the_mtp_share(mode, convention):
    loss, mask, seg = batch(seed=1)
    labels = torch.zeros_like(seg)
    masks = [roll_mtp(labels, mask, seg, k)[1] for k in (1, 2)]
    losses = [loss.roll(k, dims=1) for k in (1, 2)]
    dens = [5.0] if convention == "pooled" else [5.0, 3.0]
    ws = mtp_token_weights(
        mode, masks, convention=convention, segment_ids=seg, fixed_length=10, denominators=dens, scale=0.3
    )
    nums = mtp_numerator(mode, losses, masks, convention=convention, segment_ids=seg, fixed_length=10)
    expected = 0.3 * sum(n / d for n, d in zip(nums, dens))
    torch.testing.assert_close(sum((w * x).sum() for w, x in zip(ws, losses)), expected, rtol=1e-13, atol=0)


def test_bad_input():
    _, mask, seg = batch()
    with pytest.raises(ValueError, match="unknown mode"):
        token_weights("mean", mask)
    with pytest.raises(ValueError, match="segment_ids"):
        token_weights("per_document", mask)
    with pytest.raises(ValueError, match="fixed_length"):
        token_weights("sample_sum_norm", mask)
    with pytest.raises(ValueError, match="denominator"):
        token_weights("per_token", mask, denominator=0.0)
    bad_seg = seg.clone()
    bad_seg[0, 0] = 0
    with pytest.raises(ValueError, match="segment_ids == 0"):
        token_weights("per_document", torch.ones_like(mask), segment_ids=bad_seg)


def _accountant_pair(mode, normalization, depths=2, convention="own"):
    kw = dict(normalization=normalization, fixed_length=10, mtp_depths=depths, mtp_convention=convention)
    if normalization == "deferred" and mode == "per_token":
        kw["mtp_convention"] = "main"
    return Accountant(mode, **kw), Accountant(mode, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("normalization", ["precount", "deferred"])
def test_accountant_weights_and_shares_match_lm_loss(mode, normalization):
    """Two microbatches through ``lm_loss``/``mtp_loss`` and, in a twin accountant, through
    ``token_weights`` + ``add_lm_share``: same returned shares, same logs."""
    mbs = [batch(seed=s) for s in (2, 3)]
    masks, segs = [m for _, m, _ in mbs], [s for _, _, s in mbs]
    ref, fused = _accountant_pair(mode, normalization)
    for acc in (ref, fused):
        acc.begin_step(masks, segs, mtp_weight=0.3)
    for loss, mask, seg in mbs:
        labels = torch.zeros_like(seg)
        mtp_masks = [roll_mtp(labels, mask, seg, k)[1] for k in (1, 2)]
        mtp_losses = [loss.roll(k, dims=1) for k in (1, 2)]
        expected = ref.lm_loss(loss, mask, seg)
        expected_mtp = ref.mtp_loss(mtp_losses, mtp_masks, seg)
        w = fused.token_weights(mask, seg)
        ws = fused.mtp_token_weights(mtp_masks, seg)
        got = fused.add_lm_share((w * loss).sum(), loss, mask, seg)
        got_mtp = fused.add_mtp_share(sum((wk * x).sum() for wk, x in zip(ws, mtp_losses)), mtp_losses, mtp_masks, seg)
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)
        torch.testing.assert_close(got_mtp, expected_mtp, rtol=1e-13, atol=0)
    for acc in (ref, fused):
        acc.finish_step()
    assert fused.logs() == ref.logs()


def test_accountant_weights_under_context_parallel_columns_use_whole_row_counts():
    """A shard's weights come from whole-row unit counts: the shards' shares add up to the whole rows'."""
    loss, mask, seg = batch(seed=4)
    acc = Accountant("per_sample", check_finite=False)
    acc.begin_step([mask], [seg])
    whole = acc.token_weights(mask, seg)
    # pretend to be a context-parallel shard: columns become required
    acc.groups = pretend_cp2(acc.groups)
    cols = torch.tensor([0, 1, 2, 7, 8, 9])
    with pytest.raises(ValueError, match="columns"):
        acc.token_weights(mask[:, cols], seg[:, cols])
    shard = acc.token_weights(mask[:, cols], seg[:, cols], columns=cols)
    torch.testing.assert_close(shard, whole[:, cols], rtol=0, atol=0)


def test_accountant_weights_need_a_step():
    _, mask, seg = batch()
    acc = Accountant("per_token", mtp_depths=1)
    with pytest.raises(RuntimeError, match="begin_step"):
        acc.token_weights(mask)
    acc.begin_step([mask])
    with pytest.raises(ValueError, match="1 masks"):
        acc.mtp_token_weights([mask, mask])


def pretend_cp2(dims):
    """The one-process layout relabelled as a context-parallel shard of 2 (no process groups: nothing is
    reduced), so that the CP-only argument rules apply."""
    fake = dataclasses.replace(dims, cp=2)
    fake._groups, fake._coord, fake._adopted = dict(dims._groups), dict(dims._coord), True
    return fake
