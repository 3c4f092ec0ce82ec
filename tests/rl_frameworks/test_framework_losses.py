"""verl's and OpenRLHF's own loss aggregation, run under 5 layouts of one global batch (ranks D × micro-batches,
unequal micro-batches included, an empty response included), against the objective of the matching preset
(docs/rl.md): ``verl:<mode>`` (0.9.1, engine workers), ``verl<0.8:<mode>`` (0.7.1, legacy workers) and
``openrlhf:<mode>`` (0.11.2). A rank's value is the sum of its micro-batches' backward losses (DeepSpeed's 1/gas
and verl's legacy 1/GA applied); the ranks' gradients are averaged (DDP/FSDP), so the step's objective is the
mean over ranks."""

from __future__ import annotations

import pytest
import torch
from _frameworks import load

from lossparity.losses.modes import objective
from lossparity.losses.rl_weights import StepCounts, row_weights
from lossparity.parity.presets import resolve_preset

VERL, VERL071, ORLHF, ORLHF_UTILS = load()

N, S, L = 8, 6, 6
_g = torch.Generator().manual_seed(4)
LOSS = torch.randn(N, S, dtype=torch.float64, generator=_g)
LENGTHS = torch.tensor([6, 1, 3, 0, 5, 2, 4, 6])  # row 3: an empty response
MASK = (torch.arange(S)[None, :] < LENGTHS[:, None]).double()
FULL = (torch.arange(S)[None, :] < torch.tensor([6, 1, 3, 2, 5, 2, 4, 6])[:, None]).double()  # no empty row
# (ranks D, rows of each micro-batch of a rank): rank d holds the next D-th of the rows
LAYOUTS = [(1, [8]), (1, [4, 4]), (2, [2, 2]), (1, [3, 5]), (2, [1, 3])]


def _microbatches(D: int, sizes: list[int]) -> list[list[slice]]:
    out, start = [], 0
    for _ in range(D):
        rank = []
        for b in sizes:
            rank.append(slice(start, start + b))
            start += b
        out.append(rank)
    assert start == N
    return out


def _preset_objective(spec: str, loss: torch.Tensor, mask: torch.Tensor, mbs: list[list[slice]]) -> float:
    """The preset's objective (its mode, epsilon, empty-row convention, L) from lossparity's row weights."""
    p = resolve_preset(spec)
    n = mask.sum(-1)
    counts = StepCounts(
        tokens=float(n.sum()),
        rows=float(N),
        nonempty_rows=float((n > 0).sum()),
        microbatches=float(sum(len(r) for r in mbs)),
        groups=0.0,
    )
    total = 0.0
    for rank in mbs:
        for sl in rank:
            r = row_weights(p.mode, n[sl], counts, epsilon=p.epsilon, empty_rows=p.empty_rows, fixed_length=L)
            total += float((loss[sl] * mask[sl] * r[:, None]).sum())
    return total


def _verl(mode: str, loss: torch.Tensor, mask: torch.Tensor, mbs: list[list[slice]]) -> float:
    D = len(mbs)
    info = {"dp_size": D, "batch_num_tokens": float(mask.sum()), "global_batch_size": N, "loss_scale_factor": L}
    return sum(float(VERL.agg_loss(loss[sl], mask[sl], mode, **info)) for rank in mbs for sl in rank) / D


def _verl_legacy(mode: str, loss: torch.Tensor, mask: torch.Tensor, mbs: list[list[slice]]) -> float:
    return sum(
        float(VERL071.agg_loss(loss[sl], mask[sl], mode, loss_scale_factor=L)) / len(rank)
        for rank in mbs
        for sl in rank
    ) / len(mbs)


def _openrlhf(token_level: bool, loss: torch.Tensor, mask: torch.Tensor, mbs: list[list[slice]]) -> float:
    D, gas = len(mbs), len(mbs[0])
    # the step's counts over every rank's micro-batches (what its all-reduce sums), / gas as it pre-compensates
    info = ORLHF_UTILS._optimizer_step_loss_norm([mask[sl] for rank in mbs for sl in rank], None, D, gas)
    return (
        sum(float(ORLHF.aggregate_loss(loss[sl], mask[sl], token_level, **info)) / gas for rank in mbs for sl in rank)
        / D
    )


VERL_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("mode", VERL_MODES)
def test_verl_engine_equals_its_preset(mode: str, layout) -> None:
    mbs = _microbatches(*layout)
    got = _verl(mode, LOSS, MASK, mbs)
    want = _preset_objective(
        f"verl:{mode},loss_scale_factor={L}" if mode.endswith("norm") else f"verl:{mode}", LOSS, MASK, mbs
    )
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    p = resolve_preset(f"verl:{mode}" + (f",loss_scale_factor={L}" if mode.endswith("norm") else ""))
    plain = float(objective(p.mode, LOSS, MASK, fixed_length=L))  # the mode without the epsilon
    assert got == pytest.approx(plain, rel=1e-8 if p.epsilon else 1e-12)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_verl_legacy_token_mean_is_per_microbatch(layout) -> None:
    mbs = _microbatches(*layout)
    assert _verl_legacy("token-mean", LOSS, MASK, mbs) == pytest.approx(
        _preset_objective("verl<0.8:token-mean", LOSS, MASK, mbs), rel=1e-12
    )


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if len(set(x[1])) == 1], ids=str)
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_verl_legacy_sequence_modes_under_the_presets_conditions(mode: str, layout) -> None:
    """Equal micro-batches and no empty response (the preset's ``requires``): the legacy values are the mode's."""
    mbs = _microbatches(*layout)
    spec = f"verl<0.8:{mode}" + (f",loss_scale_factor={L}" if mode.endswith("norm") else "")
    assert _verl_legacy(mode, LOSS, FULL, mbs) == pytest.approx(_preset_objective(spec, LOSS, FULL, mbs), rel=1e-12)
    # with an empty response the legacy workers leave it out of its micro-batch's count only: not the preset's J
    assert _verl_legacy(mode, LOSS, MASK, mbs) != pytest.approx(_preset_objective(spec, LOSS, MASK, mbs), rel=1e-6) or (
        len(mbs) * len(mbs[0]) == 1
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_openrlhf_equals_its_preset(agg: str, layout) -> None:
    mbs = _microbatches(*layout)
    got = _openrlhf(agg == "token-mean", LOSS, MASK, mbs)
    assert got == pytest.approx(_preset_objective(f"openrlhf:{agg}", LOSS, MASK, mbs), rel=1e-12)
    if agg == "seq-mean-token-mean":  # empty rows dropped: N = 7 non-empty rows, not 8
        assert got == pytest.approx(float(objective("per_sample", LOSS, MASK)) * N / 7, rel=1e-8)


def test_guard_of_custom_verl_losses() -> None:
    """A custom loss that calls verl's agg_loss without the global counts gets the legacy per-micro-batch value
    at K = 2 (measured here against the preset); the guard refuses that call and accepts the engine's info."""
    from lossparity.rl import check_global_batch_info

    mbs = _microbatches(1, [3, 5])
    silent = sum(float(VERL.agg_loss(LOSS[sl], MASK[sl], "token-mean")) for sl in mbs[0]) / 2
    assert silent != pytest.approx(_preset_objective("verl:token-mean", LOSS, MASK, mbs), rel=1e-3)
    with pytest.raises(ValueError, match="lacks batch_num_tokens.*token-mean.*2 micro-batches"):
        check_global_batch_info({"dp_size": 1}, "token-mean", 2)
    with pytest.raises(ValueError, match="lacks dp_size, global_batch_size"):
        check_global_batch_info(None, "seq-mean-token-mean", 4)
    check_global_batch_info({"dp_size": 1, "batch_num_tokens": 27, "global_batch_size": 8}, "token-mean", 2)
    check_global_batch_info(None, "token-mean", 1)  # one micro-batch: its own count is the step's
