"""Accountant: GA invariance per mode (values, gradients, logs), deferred normalization, bad input."""

from __future__ import annotations

import pytest
import torch
from _models import TinyLM, global_batch
from _models import reference as _reference

import lossparity as lp

N_ROWS = 8


def reference(mode: str, b: int):
    return _reference(mode, b, N_ROWS)


def run(mode: str, K: int, normalization: str = "precount"):
    tokens, labels, mask, seg = global_batch(N_ROWS)
    b = N_ROWS // K
    mbs = [slice(k * b, (k + 1) * b) for k in range(K)]
    model = TinyLM()
    acc = lp.Accountant(mode, normalization=normalization, fixed_length=tokens.shape[1])
    acc.begin_step([mask[m] for m in mbs], [seg[m] for m in mbs])
    for m in mbs:
        acc.lm_loss(model(tokens[m], labels[m]), mask[m], seg[m]).backward()
    acc.finish_step(model)
    return acc.logs(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close(a: dict, b: dict, rel=1e-10):
    for k in a:
        err = float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-300))
        assert err <= rel, (k, err)


@pytest.mark.parametrize("normalization", ["precount", "deferred"])
@pytest.mark.parametrize("mode", [m for m in lp.MODES if m != "per_group"])  # per_group: tests/test_rl_modes.py
def test_ga1_equals_ga4_equals_reference(mode, normalization):
    for K in (1, 2, 4, 8):
        if mode == "per_microbatch":
            # per_microbatch depends on b: compare each K with the reference at the same b
            J, gref, lm = reference(mode, N_ROWS // K)
        else:
            J, gref, lm = reference(mode, 1)
        logs, grads = run(mode, K, normalization)
        assert logs["objective"] == pytest.approx(J, rel=1e-12), K
        assert logs["lm_loss"] == pytest.approx(lm, rel=1e-12)
        assert_close(grads, gref)


def test_per_microbatch_really_depends_on_b():
    assert reference("per_microbatch", 1)[0] != pytest.approx(reference("per_microbatch", 4)[0], rel=1e-6)


def test_float32_ga_invariance_within_spec_tolerance():
    tokens, labels, mask, seg = global_batch(N_ROWS)
    results = []
    for K in (1, 4):
        b = N_ROWS // K
        model = TinyLM(torch.float32)
        acc = lp.Accountant("per_sample")
        acc.begin_step([mask[k * b : (k + 1) * b] for k in range(K)])
        for k in range(K):
            m = slice(k * b, (k + 1) * b)
            acc.lm_loss(model(tokens[m], labels[m]), mask[m]).backward()
        acc.finish_step(model)
        results.append((acc.logs(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert results[0][0]["objective"] == pytest.approx(results[1][0]["objective"], rel=1e-5)
    assert_close(results[0][1], results[1][1], rel=1e-5)


# ---------------------------------------------------------------- bad input (semantics §7)
def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="valid modes: per_token, per_sample"):
        lp.Accountant("token_mean")


def test_bad_options():
    with pytest.raises(ValueError, match="fixed_length"):
        lp.Accountant("sample_sum_norm")
    with pytest.raises(ValueError, match="normalization"):
        lp.Accountant("per_token", normalization="lazy")
    with pytest.raises(ValueError, match="grad_reduction"):
        lp.Accountant("per_token", grad_reduction="avg")
    with pytest.raises(ValueError, match="mtp_convention='main'"):
        lp.Accountant("per_token", normalization="deferred", mtp_depths=1, mtp_convention="own")
    with pytest.raises(ValueError, match="per_document.*segment_ids"):
        lp.Accountant("per_document").begin_step([torch.ones(2, 3)])
    with pytest.raises(ValueError, match="per_group.*group_ids"):  # the groups: tests/test_per_group_trainer.py
        lp.Accountant("per_group").begin_step([torch.ones(2, 3)], num_groups=2)


def test_mask_values_and_shapes_named():
    acc = lp.Accountant("per_token")
    with pytest.raises(ValueError, match=r"mask values must be 0 or 1.*microbatch 1"):
        acc.begin_step([torch.ones(2, 3), torch.tensor([[1.0, 0.5, 0.0]])])
    acc = lp.Accountant("per_token")
    acc.begin_step([torch.ones(2, 3)])
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\) does not match per_token_loss shape \(2, 3\)"):
        acc.lm_loss(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(TypeError, match="segment_ids must be an integer tensor"):
        acc.lm_loss(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3))


def test_nan_loss_names_rank_and_microbatch():
    # The check is a device flag (no host sync per microbatch), raised by the step's logging collective.
    acc = lp.Accountant("per_token")
    acc.begin_step([torch.ones(1, 3), torch.ones(1, 3)])
    acc.lm_loss(torch.ones(1, 3), torch.ones(1, 3))
    acc.lm_loss(torch.tensor([[1.0, float("nan"), 0.0]]), torch.ones(1, 3))
    acc.finish_step()
    with pytest.raises(FloatingPointError, match=r"NaN/Inf.*rank 0, microbatch 1"):
        acc.logs()


def test_nan_under_mask_is_ignored():
    acc = lp.Accountant("per_token")
    acc.begin_step([torch.tensor([[1.0, 0.0]])])
    out = acc.lm_loss(torch.tensor([[2.0, float("inf")]]), torch.tensor([[1.0, 0.0]]))
    assert float(out) == 2.0


def test_protocol_errors():
    acc = lp.Accountant("per_token")
    with pytest.raises(RuntimeError, match="begin_step"):
        acc.lm_loss(torch.ones(1, 2), torch.ones(1, 2))
    acc.begin_step([torch.ones(1, 2)])
    acc.lm_loss(torch.ones(1, 2), torch.tensor([[1.0, 0.0]]))
    acc.finish_step()
    with pytest.raises(ValueError, match=r"begin_step counted for this microbatch \(2 tokens\)"):
        acc.logs()
    acc = lp.Accountant("per_token")
    acc.begin_step([torch.ones(1, 2), torch.ones(1, 2)])
    acc.lm_loss(torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="2 masks but lm_loss was called for 1"):
        acc.finish_step(None)
    acc.lm_loss(torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="only 2 masks"):
        acc.lm_loss(torch.ones(1, 2), torch.ones(1, 2))


def test_record_many_adds_numerators_denominators_and_objective_in_one_call():
    acc = lp.Accountant("per_token")
    acc.declare_metric("z_loss")
    acc.declare_metric("aux", "sum")
    acc.begin_step([torch.ones(1, 2)])
    acc.lm_loss(torch.ones(1, 2), torch.ones(1, 2))  # objective 1.0 from the LM term
    slots = ["num:z_loss", "den:z_loss", "num:aux", "objective"]
    acc.record_many(slots, torch.tensor([3.0, 2.0, 0.25, 0.5], dtype=torch.float32))
    acc.record_many(slots, torch.tensor([1.0, 2.0, 0.25, 0.5], dtype=torch.float64))
    with pytest.raises(KeyError, match="unknown slot 'num:nope'"):
        acc.record_many(["num:nope"], torch.zeros(1))
    with pytest.raises(ValueError, match="2 slots for 1 values"):
        acc.record_many(["num:aux", "objective"], torch.zeros(1))
    acc.finish_step()
    logs = acc.logs()
    assert logs["z_loss"] == 1.0  # (3 + 1) / (2 + 2)
    assert logs["aux"] == 0.5
    assert logs["objective"] == 2.0


def test_record_needs_declaration():
    acc = lp.Accountant("per_token")
    acc.declare_metric("z_loss")
    acc.begin_step([torch.ones(1, 2)])
    acc.lm_loss(torch.ones(1, 2), torch.ones(1, 2))
    acc.record("z_loss", 3.0, 2.0)
    with pytest.raises(KeyError, match="not declared"):
        acc.record("aux", 1.0)
    acc.finish_step()
    assert acc.logs()["z_loss"] == 1.5


def test_docs_accountant_page_code_blocks_run():
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "accountant-internals.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(page), "exec"), {})
