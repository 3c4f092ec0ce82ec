"""lossparity.integrations.deepspeed on real DeepSpeed engines: 2 gloo ranks on CPU, ZeRO 0-3, offload, GA.

Every mode's gradient at the accumulation boundary (``deepspeed.utils.safe_get_full_grad``) is compared with a
one-process float64 reference on the same global batch (naive per-mode loops, ``_deepspeed_workers.py``).
CI runs a representative subset; ``LOSSPARITY_DEEPSPEED_FULL=1`` (scripts/deepspeed_matrix.sh) runs ZeRO
0/1/2/3 and ZeRO-2/3 with optimizer offload × GA 1/2/4 × every mode.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

from _deepspeed_workers import MODES, N, drop_in_case, plain_case, reference_grads, rel  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402

WORLD = 2
RTOL = 1e-6  # float32 engine vs float64 reference (measured worst: see docs/integrations.md)
# bf16 engine vs the float32 engine: bf16 parameters and activations (8-bit significand: unit roundoff
# u = 2^-8 = 3.9e-3) through 3 layers, the gradient accumulated in float32. Bound 10·u; measured worst 1.3e-2
# (3.3·u) at ZeRO-0, ZeRO-2 offload and ZeRO-3 (docs/integrations.md).
BF16_RTOL = 10 * 2.0**-8
TIMEOUT_S = 300.0

FULL = os.environ.get("LOSSPARITY_DEEPSPEED_FULL") == "1"
STAGES = [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]
if FULL:
    CASES = [{"stage": s, "offload": o, "ga": ga, "dtype": "float32"} for s, o in STAGES for ga in (1, 2, 4)]
else:  # the CI subset: every stage once, offload at both stages that partition gradients, GA 1, 2 and 4
    CASES = [
        {"stage": 0, "offload": False, "ga": 2, "dtype": "float32", "check_bad_masks": True},
        {"stage": 1, "offload": False, "ga": 4, "dtype": "float32"},
        {"stage": 2, "offload": False, "ga": 2, "dtype": "float32", "scale_wrt_gas": True},
        {"stage": 2, "offload": True, "ga": 4, "dtype": "float32"},
        {"stage": 3, "offload": False, "ga": 1, "dtype": "float32"},
        {"stage": 3, "offload": True, "ga": 2, "dtype": "float32"},
    ]


# bf16 against float32, same engine configuration (the float32 rows of this group are its reference)
BF16_CASES = [
    {"stage": s, "offload": o, "ga": 2, "dtype": d, "modes": ["per_sample", "per_document"], "group": "bf16"}
    for s, o in ((0, False), (2, True), (3, False))
    for d in ("float32", "bfloat16")
]


@pytest.fixture(scope="module")
def engine_runs():
    """One launch of 2 ranks for the float32 cases and the bf16 group (DeepSpeed's import and its op load are
    paid once): per case and mode, rank 0's and rank 1's results."""
    results = spawn(drop_in_case, WORLD, CASES + BF16_CASES, timeout_s=TIMEOUT_S)
    return list(zip(results[0], results[1]))


def _name(case: dict) -> str:
    return f"ZeRO-{case['stage']}{' offload' if case['offload'] else ''} GA {case['ga']} {case['dtype']}"


@pytest.mark.slow
def test_every_mode_gives_the_objective_gradient_at_every_zero_stage(engine_runs):
    worst: dict[str, float] = {}
    for got, other in [(a, b) for a, b in engine_runs if a.get("group") != "bf16"]:
        b = N // (WORLD * got["ga"])
        ref, J = reference_grads(got["mode"], b)
        err = rel(got["grads"], ref)
        worst[got["mode"]] = max(worst.get(got["mode"], 0.0), err)
        print(f"measured: DeepSpeed {_name(got)} {got['mode']}: gradient vs float64 reference {err:.1e}")
        assert err <= RTOL, (_name(got), got["mode"], err)
        # The logs come from the accountant: J itself (float64 collective), the same on both ranks.
        assert got["logs"]["objective"] == pytest.approx(J, rel=1e-6)
        assert other["logs"]["objective"] == got["logs"]["objective"]
    assert set(worst) == set(MODES)
    # a wrong mask count on rank 1 only (CI cases): both ranks stop with a ValueError, neither hangs
    bad = [(a, b) for a, b in engine_runs if "bad_masks_error" in a]
    assert len(bad) == (0 if FULL else 1)
    for got, other in bad:
        assert "another rank" in got["bad_masks_error"]
        assert other["bad_masks_error"].startswith("masks: 1 microbatch masks on rank 1")
    print("measured: worst per mode " + ", ".join(f"{m} {e:.1e}" for m, e in worst.items()))


@pytest.mark.slow
def test_bf16_engine_is_the_float32_run_within_bf16_rounding(engine_runs):
    results = [a for a, _ in engine_runs if a.get("group") == "bf16"]
    assert len(results) == 12
    by_key = {(r["stage"], r["offload"], r["mode"], r["dtype"]): r for r in results}
    for (stage, offload, mode, dtype), r in by_key.items():
        if dtype != "bfloat16":
            continue
        f32 = by_key[(stage, offload, mode, "float32")]["grads"]
        err = rel(r["grads"], f32)
        print(f"measured: DeepSpeed {_name(r)} {mode}: gradient vs the float32 engine {err:.1e}")
        assert err <= BF16_RTOL, (_name(r), mode, err)
        # The bound discriminates: the per_sample and per_document gradients differ by far more.
        other = by_key[(stage, offload, "per_document" if mode == "per_sample" else "per_sample", "float32")]["grads"]
        assert rel(other, f32) > 5 * BF16_RTOL


@pytest.mark.slow
def test_step_gradients_returns_what_plain_deepspeed_applies():
    """A plain loop (each microbatch's token mean, ``engine.backward(loss)``) gets the mean of the D·K
    microbatch means: the per_microbatch objective, not the global token mean."""
    ga = 2
    res = spawn(plain_case, WORLD, 2, ga, timeout_s=TIMEOUT_S)
    b = N // (WORLD * ga)
    mean_of_means, _ = reference_grads("per_microbatch", b)
    token_mean, _ = reference_grads("per_token", b)
    assert all(r["untouched"] for r in res)  # the user's model is not partitioned or changed
    err, off = rel(res[0]["grads"], mean_of_means), rel(res[0]["grads"], token_mean)
    print(f"measured: plain DeepSpeed ZeRO-2 GA 2: vs mean of microbatch means {err:.1e}, vs token mean {off:.1e}")
    assert err <= RTOL
    assert off > 1e-2


class _Engine:
    """A stand-in with the engine's four calls: backward divides by K when ``scale_wrt_gas`` (as DeepSpeed);
    one process (D = 1); the boundary after every K-th backward."""

    def __init__(self, ga: int):
        self.ga, self.micro, self.calls = ga, 0, []

    def gradient_accumulation_steps(self):
        return self.ga

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % self.ga == 0

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        self.calls.append((float(loss), scale_wrt_gas))
        return loss / self.ga if scale_wrt_gas else loss

    def step(self):
        self.micro += 1


@pytest.mark.parametrize("scale_wrt_gas", [False, True])
def test_backward_hands_the_engine_the_share_whatever_scale_wrt_gas(scale_wrt_gas):
    import torch

    from lossparity.integrations.deepspeed import DeepSpeedAccountant

    engine = _Engine(ga=2)
    acc = DeepSpeedAccountant(engine, "per_sample")
    masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]])]
    losses = [torch.tensor([[2.0, 4.0, 9.0]]), torch.tensor([[6.0, 9.0, 9.0]])]
    acc.begin_step(masks)
    for loss, mask in zip(losses, masks):
        back = acc.backward(acc.lm_loss(loss, mask), scale_wrt_gas=scale_wrt_gas)
        acc.step()
    # per_sample over 2 rows: (3 + 6) / 2; each share reaches the engine as what it back-propagates
    shares = [3.0 / 2, 6.0 / 2]
    assert [c[1] for c in engine.calls] == [scale_wrt_gas] * 2
    assert [c[0] / (2 if scale_wrt_gas else 1) for c in engine.calls] == pytest.approx(shares)
    assert float(back) == pytest.approx(shares[1])
    assert acc.logs()["objective"] == pytest.approx(4.5)


def test_protocol_and_layout_errors_name_the_argument():
    import torch

    from lossparity import ProtocolError
    from lossparity.integrations.deepspeed import DeepSpeedAccountant

    mask = torch.ones(1, 2)
    acc = DeepSpeedAccountant(_Engine(ga=2), "per_token")
    with pytest.raises(ValueError, match=r"masks: 1 microbatch masks on rank 0 .*gradient_accumulation_steps=2"):
        acc.begin_step([mask])
    acc.begin_step([mask, mask])
    with pytest.raises(ProtocolError, match="before its lm_loss"):
        acc.backward(torch.zeros(()))
    with pytest.raises(ProtocolError, match="without a backward"):
        acc.step()
    with pytest.raises(ValueError, match="normalization"):
        DeepSpeedAccountant(_Engine(ga=1), "per_token", normalization="deferred")
    with pytest.raises(ValueError, match="grad_reduction"):
        DeepSpeedAccountant(_Engine(ga=1), "per_token", grad_reduction="mean")
    with pytest.raises(TypeError, match="engine: expected a deepspeed.DeepSpeedEngine"):
        DeepSpeedAccountant(object(), "per_token")
    engine = _Engine(ga=2)
    engine.ga = 3  # the engine's boundary after 3 microbatches, the step counted 2: refused at the 2nd step
    acc = DeepSpeedAccountant(engine, "per_token")
    engine.ga = 2
    acc.begin_step([mask, mask])
    engine.ga = 3
    for j in range(2):
        acc.backward(acc.lm_loss(torch.ones(1, 2), mask))
        if j == 1:
            with pytest.raises(ValueError, match="engine: microbatch 1 of 2 .* is not at its gradient accumulation"):
                acc.step()
        else:
            acc.step()


@pytest.mark.slow
def test_documented_recipe_steps_on_the_objective_gradient():
    """docs/integrations.md's DeepSpeed block as written, 2 ranks × ZeRO-2 × GA 2, SGD: the parameters after the
    step are ``p0 - lr·∇J`` (float64 reference), the logged objective is ``J``."""
    import pathlib
    import re

    import torch
    from _deepspeed_workers import TinyLM, doc_recipe_case

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
    text = page.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## DeepSpeed\n") :], re.S).group(1)
    lr = 10.0  # large, so that the float32 parameters' rounding stays far below the update
    res = spawn(doc_recipe_case, WORLD, code, lr, timeout_s=TIMEOUT_S)
    grads, J = reference_grads("per_sample", N // (WORLD * 2))
    p0 = {n: p.detach().double() for n, p in TinyLM().named_parameters()}
    update = {n: -lr * g for n, g in grads.items()}
    got = {n: res[0]["params"][n] - p0[n] for n in p0}
    err = rel(got, update)
    print(f"measured: DeepSpeed documented recipe ZeRO-2 GA 2 x 2 ranks, SGD update vs -lr·∇J (float64): {err:.1e}")
    assert err <= 1e-5  # the update is a difference of float32 parameters (|p| ~ 10·|update|)
    assert all(torch.equal(res[0]["params"][n], res[1]["params"][n]) for n in p0)
    assert res[0]["logs"]["objective"] == pytest.approx(J, rel=1e-6)
