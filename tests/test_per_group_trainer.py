"""per_group (GRPO prompt groups) in the LM Accountant and the reference trainer (issue 46): groups that span
microbatches, a naive float64 reference, the identities G=1 -> per_sample and G=N -> per_token through the whole
trainer, and bad input named with its argument, rank and microbatch. The layouts: `lossparity verify`
(tests/test_trainer.py::test_verify_quick_all_pass and the per_group row of docs/verify.md)."""

from __future__ import annotations

import pytest
import torch

import lossparity as lp
from lossparity.training.trainer import TrainConfig, Trainer

# 7 rows of 6 positions: row 3 is empty (an empty response), group 2 holds only row 3 (an empty group)
GROUPS = [0, 0, 1, 2, 1, 3, 3]
NUM_GROUPS = 5  # id 4 holds no row: it is not a group of the batch (Ngrp = 4)
MB = [slice(0, 3), slice(3, 5), slice(5, 7)]  # group 0 in microbatch 0, group 1 spans microbatches 0 and 1


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    loss = torch.rand(7, 6, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(7, 6, generator=g) > 0.3).to(torch.float64)
    mask[3] = 0
    return loss, mask


def _shift(mask: torch.Tensor, k: int) -> torch.Tensor:
    """Depth-k mask of unpacked rows written out: position t keeps the mask of t + k, the last k are 0."""
    out = torch.zeros_like(mask)
    out[:, : mask.shape[1] - k] = mask[:, k:]
    return out


def _naive(loss: torch.Tensor, mask: torch.Tensor) -> float:
    """(1/Ngrp) Σ_g s_g / max(n_g, 1), by Python loops over the rows (semantics §1)."""
    s: dict[int, float] = {}
    n: dict[int, float] = {}
    for i, g in enumerate(GROUPS):
        s[g] = s.get(g, 0.0) + sum(float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t] > 0)
        n[g] = n.get(g, 0.0) + float(mask[i].sum())
    return sum(s[g] / max(n[g], 1.0) for g in s) / len(s)


def _ids() -> list[torch.Tensor]:
    return [torch.tensor(GROUPS[m]) for m in MB]


def test_accountant_per_group_spans_microbatches_with_mtp() -> None:
    loss, mask = _data()
    loss1 = loss.flip(-1)  # the MTP depth's own per-token losses
    mask1 = _shift(mask, 1)
    acc = lp.Accountant("per_group", mtp_depths=1, mtp_convention="own")
    acc.begin_step([mask[m] for m in MB], group_ids=_ids(), num_groups=NUM_GROUPS, mtp_weight=0.5)
    x = loss.clone().requires_grad_(True)
    shares = []
    for m in MB:
        share = acc.lm_loss(x[m], mask[m]) + acc.mtp_loss([loss1[m]], [mask1[m]])
        share.backward()
        shares.append(float(share.detach()))
    acc.finish_step()
    logs = acc.logs()
    lm, mtp = _naive(loss, mask), _naive(loss1, mask1)  # depth 1 counts its groups' own tokens n_g^1
    assert sum(shares) == pytest.approx(lm + 0.5 * mtp, rel=1e-12)
    assert logs["objective"] == pytest.approx(lm + 0.5 * mtp, rel=1e-12)
    assert logs["objective_lm"] == pytest.approx(lm, rel=1e-12)
    assert logs["groups"] == 4
    # the gradient of token (i, t): 1 / (Ngrp · n_g) where the mask is 1
    n_g = {g: float(sum(mask[i].sum() for i, h in enumerate(GROUPS) if h == g)) for g in set(GROUPS)}
    want = torch.stack([mask[i] / (4 * max(n_g[g], 1.0)) for i, g in enumerate(GROUPS)])
    assert torch.allclose(x.grad, want, rtol=1e-12, atol=0)


def test_accountant_per_group_fused_weights_equal_shares() -> None:
    """The fused head's path: token weights taken before the forward carry the same global n_g."""
    loss, mask = _data()
    acc = lp.Accountant("per_group")
    acc.begin_step([mask[m] for m in MB], group_ids=_ids(), num_groups=NUM_GROUPS)
    total = 0.0
    for m in MB:
        w = acc.token_weights(mask[m])
        total += float((w * loss[m]).sum())
        acc.add_lm_share((w * loss[m]).sum(), loss[m], mask[m])
    assert total == pytest.approx(_naive(loss, mask), rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, r"needs group_ids and num_groups in begin_step.*rank 0"),
        ({"group_ids": [torch.tensor([0, 0, 1]), torch.tensor([1, 2])]}, ValueError, r"needs num_groups.*rank 0"),
        ({"num_groups": 5, "group_ids": [torch.tensor([0, 1, 2])]}, ValueError, r"group_ids has 1 entries"),
        (
            {"num_groups": 5, "group_ids": [torch.tensor([0, 0, 1]), torch.tensor([-1, 1])]},
            ValueError,
            r"group_ids\[1\] holds the id -1 \(rank 0, microbatch 1\)",
        ),
        (
            {"num_groups": 2, "group_ids": [torch.tensor([0, 0, 1]), torch.tensor([2, 1])]},
            ValueError,
            r"group_ids\[1\] holds the id 2 .*\[0, num_groups=2\)",
        ),
        (
            {"num_groups": 5, "group_ids": [torch.tensor([0, 0]), torch.tensor([1, 1])]},
            ValueError,
            r"group_ids\[0\] must have shape \[3\].*microbatch 0",
        ),
        (
            {"num_groups": 5, "group_ids": [torch.tensor([0.0, 0, 1]), torch.tensor([1, 1])]},
            TypeError,
            r"group_ids\[0\] must be an integer",
        ),
    ],
)
def test_per_group_bad_group_ids_named_before_any_state(kwargs, error, match) -> None:
    _, mask = _data()
    masks = [mask[0:3], mask[3:5]]
    acc = lp.Accountant("per_group")
    with pytest.raises(error, match=match):
        acc.begin_step(masks, **kwargs)
    # nothing changed: the same accountant starts a valid step
    acc.begin_step(masks, group_ids=[torch.tensor([0, 0, 1]), torch.tensor([1, 2])], num_groups=3)


def test_group_ids_refused_by_other_modes_and_bad_options() -> None:
    with pytest.raises(ValueError, match="only 'per_group' takes group ids"):
        lp.Accountant("per_token").begin_step([torch.ones(2, 3)], group_ids=[torch.tensor([0, 1])])
    with pytest.raises(ValueError, match="per_group.*precount"):
        lp.Accountant("per_group", normalization="deferred")
    with pytest.raises(ValueError, match="per_group.*pooled"):
        lp.Accountant("per_group", mtp_depths=1, mtp_convention="pooled")
    with pytest.raises(ValueError, match="needs group_size"):
        TrainConfig(mode="per_group").validate()
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        TrainConfig(mode="per_group", group_size=0).validate()
    with pytest.raises(ValueError, match="per_group.*precount"):
        TrainConfig(mode="per_group", group_size=2, normalization="deferred").validate()


def _fit(mode: str, **kw) -> Trainer:
    """One float64 step of 2 microbatches of 2 rows (the tiny MoE+MTP model, fused head)."""
    base = dict(steps=1, global_batch=4, ga=2, seq_len=16, packed=True, dtype="float64", warmup=1, progress=False)
    t = Trainer(TrainConfig(mode=mode, tensorboard=False, **base, **kw))
    t.fit()
    return t


def _max_rel(a: Trainer, b: Trainer) -> float:
    worst = 0.0
    for la, lb in zip(a.history, b.history):
        for k in ("objective", "objective_lm", "objective_mtp", "lm_loss", "grad_norm"):
            worst = max(worst, abs(la[k] - lb[k]) / max(abs(lb[k]), 1e-300))
    for (_, p), (_, q) in zip(a.raw.named_parameters(), b.raw.named_parameters()):
        worst = max(worst, float((p.detach() - q.detach()).abs().max() / q.detach().abs().max()))
    return worst


@pytest.mark.parametrize(("group_size", "same_as"), [(1, "per_sample"), (4, "per_token")])
def test_trainer_per_group_identities(group_size: int, same_as: str) -> None:
    """Groups of one row are the samples (Ngrp = N); one group of every row is the token mean (Ngrp = 1, the
    MTP depth divided by its own token count as per_token's 'own' convention does): the whole trainer (MoE,
    MTP, fused head, 2 microbatches of 2 rows) gives the same run to float64 rounding."""
    group = _fit("per_group", group_size=group_size)
    other = _fit(same_as)
    assert all(line["groups"] == 4 // group_size for line in group.history)
    assert _max_rel(group, other) <= 1e-12
