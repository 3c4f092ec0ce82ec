"""No host synchronization in the reference trainer's per-microbatch path (model forward, cross-entropy,
accountant, MoE accounting, backward): its value checks run once per step on the host-side batch."""

from __future__ import annotations

import pytest
import torch
from _no_sync import no_host_sync

from lossparity.losses.cross_entropy import chunked_cross_entropy
from lossparity.losses.fused_cross_entropy import fused_linear_cross_entropy
from lossparity.training.trainer import TrainConfig, Trainer


def _cfg(moe: bool = False, **kw) -> TrainConfig:
    # moe: the tiny preset's MoE layers (router, fixed-shape dispatch of model/moe.py, MoE accounting);
    # otherwise dense layers.
    base = dict(steps=1, global_batch=4, seq_len=32, ga=2, packed=True, progress=False, tensorboard=False)
    base["model_overrides"] = {} if moe else {"num_experts": 0}
    return TrainConfig(**{**base, **kw})


# per_group: the groups' global token counts are read from the pre-count's device buffer (groups of 3 rows span
# the 2 microbatches)
GROUPS = {"mode": "per_group", "group_size": 3}


@pytest.mark.parametrize(
    "loss_impl,moe,kw",
    [
        ("fused", False, {}),
        ("chunked", False, {}),
        ("fused", True, {}),
        ("fused", False, GROUPS),
        ("chunked", False, GROUPS),
    ],
)
def test_trainer_microbatch_path_does_not_synchronize(loss_impl, moe, kw, monkeypatch):
    # Before: the model read tokens.min/max (and segment/position minima), the cross-entropy read the label
    # range check and the compaction of the ignored positions (bool(...), nonzero) on every microbatch, and
    # the MoE layers one nonzero per expert per layer (model/moe.py's previous dispatch).
    plain = Trainer(_cfg(moe, loss_impl=loss_impl, **kw)).train_step()
    original = Trainer._microbatch

    def guarded(self, *args):
        with no_host_sync():
            loss = original(self, *args)
            loss.backward()
        return loss.detach().requires_grad_()  # the step's own backward then has nothing left to do

    monkeypatch.setattr(Trainer, "_microbatch", guarded)
    line = Trainer(_cfg(moe, loss_impl=loss_impl, **kw)).train_step()
    for key in ("objective", "lm_loss", "grad_norm"):
        assert line[key] == plain[key], key


def test_the_step_still_names_bad_values_before_the_transfer():
    t = Trainer(_cfg())
    t.model_config.vocab_size = 7  # every token of the synthetic corpus is now out of range
    t.raw.config.vocab_size = 7
    with pytest.raises(ValueError, match=r"tokens values must be in \[0, 7\)"):
        t.train_step()


@pytest.mark.parametrize("fused", [False, True])
def test_trusted_labels_give_the_same_losses_and_gradients(fused):
    # trusted_labels=True computes the ignored positions and zeroes them instead of leaving them out;
    # the reference is torch's own cross-entropy on the materialized float64 logits.
    torch.manual_seed(0)
    h = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, 2] = labels[1, 5] = -100
    tw = torch.rand(2, 6, dtype=torch.float64)
    ref = torch.nn.functional.cross_entropy((h @ w.T).reshape(-1, 11), labels.reshape(-1), reduction="none")
    ref = ref.view(2, 6)
    (ref * tw).sum().backward()
    want = (ref.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    with no_host_sync():
        if fused:
            total, loss = fused_linear_cross_entropy(h, w, labels, tw, trusted_labels=True)
        else:
            loss = chunked_cross_entropy(h, w, labels, trusted_labels=True)
            total = (loss * tw).sum()
        total.backward()
    torch.testing.assert_close(loss.detach(), want[0], rtol=1e-12, atol=1e-12)
    assert float(loss[0, 2]) == 0.0 and float(loss[1, 5]) == 0.0
    torch.testing.assert_close(h.grad, want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, want[2], rtol=1e-10, atol=1e-12)


def _x() -> torch.Tensor:
    return torch.tensor([0.5, -1.0, 2.0, 0.0])


# Each reads values back to the host (on a GPU: waits for the device); the guard must see every one of them.
SYNCING = {
    "item": lambda: _x().sum().item(),
    "bool": lambda: bool(_x().sum() > 0),
    "float": lambda: float(_x().sum()),
    "int": lambda: int(_x().sum()),
    "equal": lambda: torch.equal(_x(), _x()),
    "nonzero": lambda: _x().nonzero(),
    "where(cond)": lambda: torch.where(_x() > 0),
    "argwhere": lambda: torch.argwhere(_x()),
    "boolean index": lambda: _x()[_x() >= 0],
    "boolean index_put": lambda: _x().__setitem__(_x() > 0, 1.0),
    "masked_select": lambda: _x().masked_select(_x() > 0),
    "unique": lambda: torch.unique(_x()),
    "unique_consecutive": lambda: torch.unique_consecutive(_x()),
    "bincount": lambda: torch.bincount(torch.tensor([0, 2, 2])),
    "repeat_interleave": lambda: torch.repeat_interleave(_x(), torch.tensor([1, 0, 2, 1])),
    "tolist": lambda: _x().tolist(),
    "numpy": lambda: _x().numpy(),
}


@pytest.mark.parametrize("name", list(SYNCING))
def test_the_guard_sees_every_synchronizing_operation(name):
    with no_host_sync(), pytest.raises(AssertionError, match="host synchronization"):
        SYNCING[name]()


def test_the_guard_lets_device_side_operations_pass():
    # the fixed-shape forms of the same computations: no value leaves the device
    with no_host_sync():
        x = _x()
        torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1]), output_size=4)
        torch.where(x > 0, x, torch.zeros_like(x)).sum()
        x.index_select(0, torch.tensor([2, 0])).cumsum(0)
        x[torch.tensor([1, 3])] = 0.0
    assert x.tolist() == [0.5, 0.0, 2.0, 0.0]
