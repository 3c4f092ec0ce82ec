"""The accountant's step protocol, device-side value checks, no host sync per microbatch, the configuration
fingerprint, and the training path against the one function per formula (docs/semantics.md §2, §4, §5, §7)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _dist_workers import cp_peers_with_different_settings, mismatched_ranks, nan_on_rank1
from _moe_workers import TOPK, E, FakeRouter, make_batch, records_for
from _no_sync import no_host_sync

import lossparity as lp
from lossparity.distributed.launch import spawn
from lossparity.distributed.moe.accounting import MoEAccounting
from lossparity.losses import moe as F_moe
from lossparity.losses.mtp import mtp_denominators, roll_mask
from lossparity.model.router import Router

ONE = torch.ones(1, 2)


def _step(acc, n=1):
    acc.begin_step([ONE] * n)
    for _ in range(n):
        acc.lm_loss(ONE, ONE)


# ----------------------------------------------------------------------------- protocol
def test_protocol_error_is_exported_runtime_error():
    assert issubclass(lp.ProtocolError, RuntimeError)


def test_begin_step_after_finish_step_without_logs():
    acc = lp.Accountant()
    _step(acc)
    acc.finish_step()
    with pytest.raises(lp.ProtocolError, match=r"begin_step called before the previous step ended: expected logs\(\)"):
        acc.begin_step([ONE])
    acc.logs()
    acc.begin_step([ONE])  # the protocol resumes where it stood


def test_deferred_logs_before_finish_step():
    acc = lp.Accountant(normalization="deferred")
    _step(acc)
    with pytest.raises(lp.ProtocolError, match=r"logs\(\) called too early: expected finish_step\(model\)"):
        acc.logs()
    acc.finish_step()
    assert acc.logs()["tokens"] == 2.0


def test_mtp_loss_before_lm_loss_and_twice():
    acc = lp.Accountant(mtp_depths=1)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rolled = roll_mask(mask, None, 1)
    acc.begin_step([mask, mask])
    with pytest.raises(
        lp.ProtocolError,
        match=r"mtp_loss called before lm_loss.*expected lm_loss\(\.\.\.\) for "
        r"microbatch 0 of 2",
    ):
        acc.mtp_loss([torch.ones(1, 3)], [rolled])
    acc.lm_loss(torch.ones(1, 3), mask)
    acc.mtp_loss([torch.ones(1, 3)], [rolled])
    with pytest.raises(lp.ProtocolError, match=r"mtp_loss called twice for one microbatch.*microbatch 1 of 2"):
        acc.mtp_loss([torch.ones(1, 3)], [rolled])


def test_more_microbatches_than_counted_and_other_orders():
    acc = lp.Accountant()
    with pytest.raises(lp.ProtocolError, match=r"outside a step: expected begin_step\(masks\)"):
        acc.record("x", 1.0)
    _step(acc, 2)
    with pytest.raises(lp.ProtocolError, match=r"only 2 masks.*expected finish_step\(model\)"):
        acc.lm_loss(ONE, ONE)
    acc.finish_step()
    with pytest.raises(lp.ProtocolError, match=r"finish_step called twice in one step: expected logs\(\)"):
        acc.finish_step()
    with pytest.raises(lp.ProtocolError, match=r"lm_loss called outside the microbatches of a step: expected logs"):
        acc.lm_loss(ONE, ONE)
    with pytest.raises(lp.ProtocolError, match="declare_metric.*outside a step"):
        acc.declare_metric("late")
    acc.logs()
    with pytest.raises(lp.ProtocolError, match=r"logs\(\) called too early: expected begin_step"):
        acc.logs()


def test_moe_end_step_is_part_of_the_protocol():
    acc = lp.Accountant()
    moe = MoEAccounting(acc, 1, E, TOPK, z_coeff=1e-3)
    routers = [FakeRouter(0)]
    _step(acc)
    with pytest.raises(lp.ProtocolError, match=r"end_step\(routers\) called before finish_step"):
        moe.end_step(routers)
    acc.finish_step()
    with pytest.raises(lp.ProtocolError, match=r"expected MoEAccounting.end_step\(routers\)"):
        acc.logs()
    with pytest.raises(lp.ProtocolError, match="microbatch_loss called outside the microbatches"):
        moe.microbatch_loss(
            records_for(torch.zeros(1, 1, 2, E), slice(0, 1), torch.zeros(1, E)), torch.ones(1, 2, dtype=torch.bool)
        )
    moe.end_step(routers)
    with pytest.raises(lp.ProtocolError, match="called twice in one step"):
        moe.end_step(routers)
    logs = acc.logs()
    assert logs["max_vio"] == 0.0 and logs["max_vio/layer_0"] == 0.0  # one route: the accountant's logs


# ----------------------------------------------------------------------------- API messages and value checks
def test_mask_after_other_mask_with_same_or_other_count():
    acc = lp.Accountant()
    acc.begin_step([torch.tensor([[1.0, 1.0, 0.0, 0.0]])])
    acc.lm_loss(torch.ones(1, 4), torch.tensor([[2.0, 0.0, 0.0, 0.0]]))  # the seed bug: a wrong value, silently
    acc.finish_step()
    with pytest.raises(
        ValueError,
        match=r"lm_loss: mask differs from the one begin_step counted.*\(2 tokens\).*"
        r"rank 0, microbatch 0",
    ):
        acc.logs()


def test_masks_as_lists_numpy_or_on_another_device_are_named():
    acc = lp.Accountant()
    with pytest.raises(TypeError, match=r"masks\[1\] must be a torch.Tensor, got ndarray.*microbatch 1"):
        acc.begin_step([ONE, np.ones((1, 2))])
    with pytest.raises(TypeError, match=r"masks\[0\] must be a torch.Tensor, got list"):
        acc.begin_step([[1.0, 1.0]])
    acc.begin_step([ONE])
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        acc.lm_loss(ONE, [[1.0, 1.0]])
    with pytest.raises(ValueError, match="mask is on meta but the losses are on cpu"):
        acc.lm_loss(ONE, torch.ones(1, 2, device="meta"))


def test_nan_values_are_rejected():
    for bad in (float("nan"), 0, 2.5):
        with pytest.raises(ValueError, match="fixed_length"):
            lp.Accountant("sample_sum_norm", fixed_length=bad)
    with pytest.raises(ValueError, match="mtp_depths must be an int"):
        lp.Accountant(mtp_depths="2")
    with pytest.raises(ValueError, match="mtp_weight"):
        lp.Accountant(mtp_depths=1).begin_step([ONE], mtp_weight=float("nan"))
    for kw in ({"aux_coeff": float("nan")}, {"z_coeff": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            MoEAccounting(lp.Accountant(), 1, E, TOPK, **kw)


@pytest.mark.parametrize("scope", ["microbatch", "global_lagged"])
def test_nan_router_logit_names_rank_microbatch_and_layer(scope):
    logits, valid, lm_mask, bias = make_batch(4, steps=1)
    logits = logits[0].clone()
    logits[2, 3, 0, 1] = float("nan")  # layer 2, row 3 (microbatch 1 of 2), a valid position
    acc = lp.Accountant("per_token")
    moe = MoEAccounting(acc, 3, E, TOPK, scope=scope, z_coeff=1e-3)
    mbs = [slice(0, 2), slice(2, 4)]
    acc.begin_step([lm_mask[m] for m in mbs], extra_counts=MoEAccounting.router_tokens([valid[m] for m in mbs]))
    for m in mbs:
        acc.lm_loss(torch.zeros(lm_mask[m].shape, dtype=torch.float64), lm_mask[m])
        recs = [SimpleNamespace(layer_id=i, **vars(r)) for i, r in enumerate(records_for(logits, m, bias))]
        moe.microbatch_loss(recs, valid[m])
    acc.finish_step()
    moe.end_step([FakeRouter(i) for i in range(3)])
    with pytest.raises(FloatingPointError, match=r"router scores have NaN/Inf.*rank 0, microbatch 1, layer 2"):
        acc.logs()


# ----------------------------------------------------------------------------- no host sync
@pytest.mark.parametrize("mode", ["per_token", "per_sample", "per_document", "sample_sum_norm"])
def test_microbatch_calls_do_not_synchronize(mode):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    logits, valid, lm_mask, bias = make_batch(4, steps=1)
    logits, valid, lm_mask, bias = logits[0].to(dev), valid.to(dev), lm_mask.to(dev), bias.to(dev)
    seg = valid.long() * (1 + (torch.arange(valid.shape[1], device=dev) >= 2).long())  # two documents per row
    mbs = [slice(0, 2), slice(2, 4)]
    acc = lp.Accountant(mode, mtp_depths=1, fixed_length=5, device=dev)
    moes = [MoEAccounting(acc, 3, E, TOPK, scope=s, z_coeff=1e-3) for s in ("microbatch", "sequence")]
    acc.begin_step(
        [lm_mask[m] for m in mbs],
        [seg[m] for m in mbs],
        extra_counts=MoEAccounting.router_tokens([valid[m] for m in mbs]),
    )
    loss = torch.rand(4, 5, dtype=torch.float64, device=dev, requires_grad=True)
    total = 0.0
    with no_host_sync():
        for m in mbs:
            total = total + acc.lm_loss(loss[m], lm_mask[m], seg[m])
            total = total + acc.mtp_loss([loss[m]], [roll_mask(lm_mask[m], seg[m], 1)], seg[m])
            for moe in moes:
                total = total + moe.microbatch_loss(records_for(logits, m, bias), valid[m], seg[m])
        total.backward()
    acc.finish_step()
    for moe in moes:
        moe.end_step([FakeRouter(i) for i in range(3)])
    assert acc.logs()["objective"] == pytest.approx(float(total.detach()), rel=1e-12)


@pytest.mark.parametrize("mode", ["per_token", "per_sample", "per_document", "sample_sum_norm"])
def test_token_weights_of_the_fused_head_do_not_synchronize(mode):
    # Before: per_document numbered the documents again (and checked them) on the host every microbatch.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, valid, lm_mask, _ = make_batch(4, steps=1)
    valid, lm_mask = valid.to(dev), lm_mask.to(dev)
    seg = valid.long() * (1 + (torch.arange(valid.shape[1], device=dev) >= 2).long())  # two documents per row
    mbs = [slice(0, 2), slice(2, 4)]
    acc = lp.Accountant(mode, mtp_depths=1, fixed_length=5, device=dev)
    acc.begin_step([lm_mask[m] for m in mbs], [seg[m] for m in mbs])
    loss = torch.rand(4, 5, dtype=torch.float64, device=dev)
    total = 0.0
    for m in mbs:
        rolled = roll_mask(lm_mask[m], seg[m], 1)
        with no_host_sync():
            w = acc.token_weights(lm_mask[m], seg[m])
            (wk,) = acc.mtp_token_weights([rolled], seg[m])
            total = total + acc.add_lm_share((w * loss[m]).sum(), loss[m], lm_mask[m], seg[m])
            total = total + acc.add_mtp_share((wk * loss[m]).sum(), [loss[m]], [rolled], seg[m])
    acc.finish_step()
    assert acc.logs()["objective"] == pytest.approx(float(total), rel=1e-12)


# ----------------------------------------------------------------------------- fingerprint, peers
def test_mismatched_ranks_stop_with_one_message_naming_the_field():
    out = spawn(mismatched_ranks, 2, timeout_s=120)
    for rank in range(2):
        modes, depths, numpy_mask, empty = out[rank]
        mode = "per_token" if rank == 0 else "per_sample"
        assert f"differs between the 2 data-parallel ranks in mode (rank {rank} has mode='{mode}')" in modes
        assert f"ranks in mtp_depths (rank {rank} has mtp_depths={rank})" in depths
        if rank == 1:
            assert numpy_mask.startswith("TypeError: masks[1] must be a torch.Tensor, got ndarray")
            assert "masks is empty" in empty
        else:
            assert "1 other rank(s) reported invalid input" in numpy_mask
            assert "1 other rank(s) reported invalid input" in empty
    nan = spawn(nan_on_rank1, 2, timeout_s=120)
    assert "FloatingPointError" in nan[1] and "rank 1, microbatch 1" in nan[1]
    assert "1 other rank(s) reported invalid values in this step (lm_nonfinite" in nan[0]


def test_context_parallel_peers_with_different_settings_are_named_at_logs():
    # Before: only data-parallel peers were compared (in the pre-count); context, tensor and pipeline peers
    # built with different settings produced silently inconsistent numbers.
    out = spawn(cp_peers_with_different_settings, 2, timeout_s=120)
    for rank, message in enumerate(out):
        mine = "'own'" if rank == 0 else "'main'"
        assert "differs between the 2 ranks of the logging collective in mtp_convention" in message, message
        assert f"(rank {rank} has mtp_convention={mine})" in message


# ----------------------------------------------------------------------------- one home per formula
def test_router_uses_the_losses_score_normalization():
    for score in ("softmax", "sigmoid"):
        router = Router(8, E, TOPK, score, layer_id=0).double()
        x = torch.randn(6, 8, dtype=torch.float64)
        _, rec = router(x)
        assert torch.equal(rec.probs, F_moe.router_probs(rec.logits, score))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_moe_training_path_equals_the_loss_functions(score):
    """Micro-batch scope and microbatch z-loss of one step, K=2: the share the accounting back-propagates
    equals the public per-layer functions evaluated on each microbatch (mean over microbatches), and so
    does its gradient (formed in the forward pass) against autograd through those functions."""
    logits, valid, lm_mask, bias = make_batch(4, steps=1)
    leaf = logits[0].clone().requires_grad_(True)
    logits = leaf
    acc = lp.Accountant()
    moe = MoEAccounting(acc, 3, E, TOPK, scope="microbatch", aux_coeff=0.01, z_coeff=1e-3, z_form="microbatch")
    mbs = [slice(0, 2), slice(2, 4)]
    acc.begin_step([lm_mask[m] for m in mbs], extra_counts=MoEAccounting.router_tokens([valid[m] for m in mbs]))
    got, want = 0.0, 0.0
    for m in mbs:
        acc.lm_loss(torch.zeros(lm_mask[m].shape, dtype=torch.float64), lm_mask[m])
        recs = records_for(logits, m, bias, score)
        got = got + moe.microbatch_loss(recs, valid[m])
        pad = ~valid[m].reshape(-1)
        t = int((~pad).sum())
        for r in recs:
            if t:
                counts = F_moe.tokens_per_expert(r.topk_map, keep_mask=~pad)
                want += F_moe.switch_load_balancing_loss(r.probs, counts, t, TOPK, E, 0.01, keep_mask=~pad) / 2
            want += F_moe.router_z_loss(r.logits, 1e-3, keep_mask=~pad) / 2
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    (g_got,) = torch.autograd.grad(got, leaf, retain_graph=True)
    (g_want,) = torch.autograd.grad(want, leaf)
    torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-18)


def test_mtp_denominators_one_place():
    assert mtp_denominators("per_token", "own", 10.0, [4.0, 0.0]) == [4.0, 1.0]
    assert mtp_denominators("per_token", "main", 10.0, [4.0, 3.0]) == [10.0, 10.0]
    assert mtp_denominators("per_token", "pooled", 10.0, [4.0, 3.0]) == [7.0]
    assert mtp_denominators("per_sample", "pooled", 5.0, [4.0, 3.0]) == [5.0]
    acc = lp.Accountant(mtp_depths=2)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    acc.begin_step([mask])
    assert acc._mtp_denominators() == [2.0, 1.0]  # rolled by 1: 2 tokens; by 2: 1 token


# ----------------------------------------------------------------------------- misuses that used to pass silently
def test_skipping_mtp_loss_is_a_protocol_error_naming_the_microbatch():
    # Before: finish_step checked only the number of lm_loss calls, so a microbatch without its MTP term
    # silently dropped that term from the objective and its gradient.
    acc = lp.Accountant(mtp_depths=1)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rolled = roll_mask(mask, None, 1)
    acc.begin_step([mask, mask])
    acc.lm_loss(torch.ones(1, 3), mask)  # microbatch 0: no mtp_loss
    acc.lm_loss(torch.ones(1, 3), mask)
    acc.mtp_loss([torch.ones(1, 3)], [rolled])
    with pytest.raises(
        lp.ProtocolError,
        match=r"finish_step: mtp_loss was not called for microbatch 0 \(rank 0\) although the accountant has "
        r"mtp_depths=1: expected mtp_loss\(\.\.\.\) for microbatch 0",
    ):
        acc.finish_step()
    with pytest.raises(lp.ProtocolError, match=r"logs\(\): mtp_loss was not called for microbatch 0"):
        acc.logs()
    assert acc.state.value == "microbatches"  # nothing changed: the step can still be repaired


def test_redeclaring_a_metric_with_another_reduction_is_a_protocol_error():
    # Before: the second declaration was ignored and the metric kept its first reduction.
    acc = lp.Accountant()
    acc.declare_metric("aux", "sum")
    acc.declare_metric("aux", "sum", per_rank=True)  # the same reduction: kept
    with pytest.raises(lp.ProtocolError, match=r"'aux' is already declared with reduce='sum'"):
        acc.declare_metric("aux", "ratio")
    with pytest.raises(ValueError, match="built-in metric"):
        acc.declare_metric("objective", "sum")


def test_record_is_one_entry_point_for_ratio_sum_and_objective():
    acc = lp.Accountant()
    acc.declare_metric("z", "ratio")
    acc.declare_metric("a", "sum")
    acc.declare_metric("b", "sum")
    acc.begin_step([torch.ones(1, 2)])
    acc.lm_loss(torch.ones(1, 2), torch.ones(1, 2))  # objective 1.0 from the LM term
    acc.record("z", torch.tensor(3.0), 2.0)
    acc.record("z", 1.0)  # den defaults to 1
    acc.record(["a", "b", "objective"], torch.tensor([0.25, 2.0, 0.5], dtype=torch.float32))
    acc.record(["a", "objective_local"], torch.tensor([0.25, 0.25]))
    with pytest.raises(ValueError, match="den given for 'a', a metric declared with reduce='sum'"):
        acc.record("a", 1.0, 1.0)
    with pytest.raises(ValueError, match=r"2 metric\(s\) for 1 value\(s\)"):
        acc.record(["a", "b"], torch.zeros(1))
    with pytest.raises(KeyError, match="not declared"):
        acc.record("nope", 1.0)
    acc.finish_step()
    logs = acc.logs()
    assert logs["z"] == 4.0 / 3.0  # (3 + 1) / (2 + 1)
    assert logs["a"] == 0.5 and logs["b"] == 2.0
    assert logs["objective"] == 1.75  # 1 + 0.5 + 0.25
