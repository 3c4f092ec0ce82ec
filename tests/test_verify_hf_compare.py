"""``lossparity verify --hf``'s judgement of one tensor (``hf_compare``): a tensor's largest absolute difference
relative to ``max(its own largest |entry|, 1e-6 x the largest |entry| of every tensor of the quantity)``.

The expected values are worked by hand from the tensors below (every number is a power of two times a small
integer, or a difference well above float64 rounding of the values it comes from)."""

from __future__ import annotations

import pytest
import torch

from lossparity.verify.hf_compare import _tensor_rel, _worst, compare_runs


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# The largest entry of all: |-4| (in "w"), so the shared denominator is 1e-6 x 4 = 4e-6.
REF = {"w": _t(2.0, -4.0), "tiny": _t(3e-12, -1e-12), "small": _t(1e-3, 0.0)}


def test_own_scale_alone_is_the_old_rule():
    # 1e-20 / 3e-12 = 3.3e-9: a near-zero tensor judged on its own scale
    assert _tensor_rel(_t(3e-12 + 1e-20, -1e-12), REF["tiny"]) == pytest.approx(1e-20 / 3e-12, rel=1e-3)


def test_near_zero_tensor_is_judged_against_the_quantitys_scale():
    run = {"w": _t(2.0, -4.0), "tiny": _t(3e-12, -1e-12 + 1e-20), "small": _t(1e-3, 0.0)}
    worst, name = _worst(run, REF)
    # tiny: 1e-20 / max(3e-12, 4e-6) = 2.5e-15; w and small equal
    assert name == "tiny" and worst == pytest.approx(2.5e-15, rel=1e-3)


def test_a_tensor_above_the_shared_scale_keeps_its_own():
    run = {"w": _t(2.0, -4.0), "tiny": _t(3e-12, -1e-12), "small": _t(1e-3 + 2.0**-60, 0.0)}
    worst, name = _worst(run, REF)
    # small: own largest 1e-3 > 4e-6: (difference, exactly as float64 rounds it) / 1e-3 ≈ 8.7e-16
    diff = float((torch.tensor(1e-3, dtype=torch.float64) + 2.0**-60) - 1e-3)
    assert name == "small" and worst == pytest.approx(diff / 1e-3, rel=1e-12)
    assert 8e-16 < worst < 1e-15


def test_largest_relative_difference_wins():
    # w: 2^-40 / 4 = 2^-42 ≈ 2.3e-13; tiny: 2e-18 / 4e-6 = 5e-13 (larger: reported)
    run = {"w": _t(2.0, -4.0 + 2.0**-40), "tiny": _t(3e-12 + 2e-18, -1e-12), "small": _t(1e-3, 0.0)}
    worst, name = _worst(run, REF)
    assert name == "tiny" and worst == pytest.approx(5e-13, rel=1e-3)


def _record(grads: dict[str, torch.Tensor]) -> dict:
    return {"history": [{"objective": 1.5, "grad_norm": 2.0}], "grads": [grads], "params": dict(REF)}


def test_compare_runs_passes_a_rounding_difference_of_a_near_zero_gradient():
    run = _record({**REF, "tiny": _t(3e-12, -1e-12 + 1e-20)})
    verdict = compare_runs(run, _record(dict(REF)), 1e-10)
    assert verdict["pass"] and verdict["first"] is None
    assert verdict["diffs"]["grads"] == pytest.approx(2.5e-15, rel=1e-3)
    assert verdict["diffs"]["grads_abs"] == pytest.approx(1e-20, rel=1e-3)


def test_compare_runs_still_fails_a_difference_large_on_the_quantitys_scale():
    # tiny off by 4e-15: 4e-15 / 4e-6 = 1e-9 > 1e-10 (the old rule: 4e-15 / 3e-12 = 1.3e-3)
    run = _record({**REF, "tiny": _t(3e-12 + 4e-15, -1e-12)})
    verdict = compare_runs(run, _record(dict(REF)), 1e-10)
    assert not verdict["pass"] and verdict["first"] == "gradient of tiny at step 1"
    assert verdict["diffs"]["grads"] == pytest.approx(1e-9, rel=1e-3)


# The float32-floor rule of verify --hf (verify/hf.py's report): a layout's row passes when each quantity's
# difference from its reference is at most max(tol, 10 x floor), the floor being the difference between two
# single-process runs that differ only in the order of the rows (at least 2**-24 where the model computes in
# float32), and no floor at all when that exceeds 1e-5 (a model that does not repeat itself). Worked by hand:
# the objective of the D2 run is 1.5 x (1 + r) against the reference 1.5.
def _run(objective: float, float32_param: bool = False) -> dict:
    params = {"w": _t(2.0, -4.0)}
    if float32_param:
        params["g"] = torch.tensor([1.0], dtype=torch.float32)
    return {"per_token": {"history": [{"objective": objective}], "grads": [dict(params)], "params": params}}


def _d2_row(r: float, floor_r: float, float32_param: bool = False) -> dict:
    from lossparity.verify.hf import _report
    from lossparity.verify.hf_spec import FLOOR, ModelSpec
    from lossparity.verify.layouts import Layout

    results = {
        (0, "1x1"): _run(1.5, float32_param),
        (0, FLOOR): _run(1.5 * (1 + floor_r), float32_param),
        (0, "D2"): _run(1.5 * (1 + r), float32_param),
    }
    report = _report(0, ModelSpec(name="m"), (Layout("D2", 2, 1),), ("per_token",), 1, results, {}, 0.0)
    (row,) = report["rows"]
    assert row["reference"] == "1x1"
    return row


@pytest.mark.parametrize(
    "r,floor_r,float32_param,passes",
    [
        (5e-11, 0.0, False, True),  # within tol 1e-10, no floor
        (5e-9, 0.0, False, False),  # a float64 model whose rows-reversed run is identical: tol alone
        (5e-9, 1e-9, False, True),  # floor 1e-9: limit 1e-8
        (2e-8, 1e-9, False, False),
        (5e-7, 0.0, True, True),  # a float32 parameter: floor at least 2**-24, limit 10 x 2**-24 = 5.96e-7
        (7e-7, 0.0, True, False),
        (5e-9, 2e-5, False, False),  # floor 2e-5 > 1e-5: not deterministic, no floor, tol alone
    ],
)
def test_the_float32_floor_widens_the_tolerance_as_worked_by_hand(r, floor_r, float32_param, passes):
    row = _d2_row(r, floor_r, float32_param)
    assert row["pass"] is passes, row
    assert row["diffs"]["objective"] == pytest.approx(r, rel=1e-6)
    if not passes:
        assert row["first"].startswith("objective at step 1")


@pytest.mark.parametrize(
    "repeat_r,words",
    [
        (0.0, "the model repeats its 1x1 run bit for bit, but reversing the rows' summation order"),
        (3e-3, "the model is not deterministic in training mode: the same 1x1 run twice differs by 3.0e-03"),
    ],
)
def test_a_floor_above_1e_5_is_diagnosed_by_running_1x1_again(monkeypatch, repeat_r, words):
    # floor 2e-5 > FLOOR_MAX: no floor, D2's 5e-9 FAILs at tol 1e-10, and the row becomes an ERROR whose
    # diagnosis comes from the repeated 1x1 run (here equal to the first, or 3e-3 away in the objective)
    from lossparity.verify import hf
    from lossparity.verify.hf_spec import FLOOR, REPEAT, ModelSpec
    from lossparity.verify.layouts import Layout

    results = {(0, "1x1"): _run(1.5), (0, FLOOR): _run(1.5 * (1 + 2e-5)), (0, "D2"): _run(1.5 * (1 + 5e-9))}
    spec = ModelSpec(name="m")
    report = hf._report(0, spec, (Layout("D2", 2, 1),), ("per_token",), 1, results, {}, 0.0)
    assert report["_floor_over"] == pytest.approx(2e-5, rel=1e-6) and report["floor"] is None
    asked = []

    def run_needed(needed, *args):
        asked.extend(needed)
        return {key: (_run(1.5 * (1 + repeat_r)), 0.0) for key in needed}

    monkeypatch.setattr(hf, "_run_needed", run_needed)
    hf._unusable_floor([spec], [report], results, ("per_token",), 1, False)
    (row,) = report["rows"]
    assert asked == [(0, REPEAT)] and "_floor_over" not in report
    assert not row["pass"] and row["error"].startswith(words), row["error"]
