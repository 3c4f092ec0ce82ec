"""The RL modes token_sum and per_group (semantics §1) and the several-term accountant (semantics §9), against
naive float64 formulas written here and a hand-worked example."""

from __future__ import annotations

import pytest
import torch

from lossparity.losses.modes import numerator, objective
from lossparity.losses.token_weights import token_weights
from lossparity.rl import RLAccountant, Term

# 5 rows; row 3 is empty; groups {0: rows 0, 1}, {1: rows 2, 3}, {2: row 4}
LOSS = torch.tensor(
    [[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0], [5.0, 1.0, 0.0, 0.0]],
    dtype=torch.float64,
)
MASK = torch.tensor(
    [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]],
    dtype=torch.float64,
)
GROUPS = torch.tensor([0, 0, 1, 1, 2])


def test_hand_worked_example() -> None:
    # token_sum: 1+2+3 + 4 + 2+2 + 5+1 = 20
    assert float(objective("token_sum", LOSS, MASK)) == 20.0
    # per_group: group 0: (6 + 4) / 4 tokens; group 1: 4 / 2 (the empty row 3 adds nothing); group 2: 6 / 2
    assert float(objective("per_group", LOSS, MASK, group_ids=GROUPS)) == pytest.approx((10 / 4 + 2 + 3) / 3, abs=1e-15)
    # a group whose only row is empty still counts once (the empty-unit rule)
    g = torch.tensor([0, 0, 1, 3, 2])
    assert float(objective("per_group", LOSS, MASK, group_ids=g)) == pytest.approx((10 / 4 + 2 + 0 + 3) / 4, abs=1e-15)


def test_per_group_needs_group_ids() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        objective("per_group", LOSS, MASK)
    with pytest.raises(ValueError, match="group_ids must have shape"):
        objective("per_group", LOSS, MASK, group_ids=torch.tensor([0, 1]))


def test_per_group_token_weights_and_numerator() -> None:
    w = token_weights("per_group", MASK, group_ids=GROUPS, denominator=3.0)
    assert float((w * LOSS).sum()) == pytest.approx(
        float(objective("per_group", LOSS, MASK, group_ids=GROUPS)), abs=1e-15
    )
    # microbatches that split group 1: the global group counts come as unit_counts
    n_g = torch.tensor([4.0, 2.0, 2.0])[GROUPS].unsqueeze(-1).expand_as(MASK)
    parts = [numerator("per_group", LOSS[a:b], MASK[a:b], unit_counts=n_g[a:b]) for a, b in ((0, 3), (3, 5))]
    assert float(sum(parts) / 3) == pytest.approx((10 / 4 + 2 + 3) / 3, abs=1e-15)


def _naive(mode: str, loss: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, *, eps=0.0, drop=False, L=None):
    """The formulas of semantics §1/§9 on the whole batch, written out row by row."""
    rows = [(float((loss[i] * mask[i]).sum()), float(mask[i].sum())) for i in range(loss.shape[0])]
    n_rows = sum(1 for _, n in rows if n > 0) if drop else len(rows)
    if mode == "per_token":
        return sum(s for s, _ in rows) / max(sum(n for _, n in rows), 1)
    if mode == "token_sum":
        return sum(s for s, _ in rows)
    if mode == "per_sample":
        return sum((s / (n + eps) if eps else s / max(n, 1)) if n > 0 else 0.0 for s, n in rows) / max(n_rows, 1)
    if mode == "sample_sum":
        return sum(s for s, _ in rows) / max(n_rows, 1)
    if mode == "sample_sum_norm":
        return sum(s for s, _ in rows) / (max(n_rows, 1) * L)
    ids = sorted(set(groups.tolist()))
    tot = 0.0
    for g in ids:
        s = sum(rows[i][0] for i in range(len(rows)) if int(groups[i]) == g)
        n = sum(rows[i][1] for i in range(len(rows)) if int(groups[i]) == g)
        tot += s / max(n, 1)
    return tot / len(ids)


LAYOUTS = [[5], [2, 3], [1, 1, 1, 1, 1], [4, 1], [3, 2]]  # including unequal microbatches and split groups


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accountant_terms_every_layout(layout: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    pol = torch.randn(5, 4, dtype=torch.float64, generator=gen)
    kl = torch.rand(5, 4, dtype=torch.float64, generator=gen)
    ent = torch.rand(5, 4, dtype=torch.float64, generator=gen)
    terms = {
        "policy": Term("per_group"),
        "kl": Term("per_sample", coef=0.04, epsilon=1e-8, empty_rows="drop"),
        "entropy": Term("per_token", coef=-0.01),
        "value": Term("sample_sum_norm", coef=0.5, fixed_length=4),
        "aux": Term("token_sum", coef=1e-3),
    }
    acc = RLAccountant(terms)
    cuts = torch.tensor([0, *layout]).cumsum(0).tolist()
    mbs = list(zip(cuts[:-1], cuts[1:]))
    acc.begin_step([MASK[a:b] for a, b in mbs], [GROUPS[a:b] for a, b in mbs], num_groups=3)
    x = {"policy": pol, "kl": kl, "entropy": ent, "value": kl, "aux": pol}
    leaf = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    total = sum(acc.share(i, {k: v[a:b] for k, v in leaf.items()}) for i, (a, b) in enumerate(mbs))
    total.backward()  # type: ignore[union-attr]
    logs = acc.logs()
    want = {
        "policy": _naive("per_group", pol, MASK, GROUPS),
        "kl": _naive("per_sample", kl, MASK, GROUPS, eps=1e-8, drop=True),
        "entropy": _naive("per_token", ent, MASK, GROUPS),
        "value": _naive("sample_sum_norm", kl, MASK, GROUPS, L=4),
        "aux": _naive("token_sum", pol, MASK, GROUPS),
    }
    J = sum(terms[k].coef * v for k, v in want.items())
    for k, v in want.items():
        assert logs[k] == pytest.approx(v, rel=1e-12, abs=1e-15)
    assert logs["objective"] == pytest.approx(J, rel=1e-12)
    assert float(total.detach()) == pytest.approx(J, rel=1e-12)  # type: ignore[union-attr]
    # the gradient of the policy term: 1 / (Ngrp · n_g) at every loss-bearing token of the group
    n_g = torch.tensor([4.0, 2.0, 2.0])[GROUPS].unsqueeze(-1)
    torch.testing.assert_close(leaf["policy"].grad, MASK / (3 * n_g), rtol=1e-12, atol=1e-15)


def test_accountant_bad_input_names_argument() -> None:
    acc = RLAccountant({"policy": Term("per_group")})
    with pytest.raises(ValueError, match="group_ids"):
        acc.begin_step([MASK])
    with pytest.raises(ValueError, match=r"group_ids\[0\] must lie in \[0, num_groups=2\).*microbatch 0"):
        acc.begin_step([MASK], [GROUPS], num_groups=2)
    with pytest.raises(ValueError, match="Term.mode"):
        Term("per_document")
    with pytest.raises(ValueError, match="fixed_length"):
        Term("sample_sum_norm")


def test_rl_doc_block_runs() -> None:
    """docs/rl.md's example: its asserts are the hand-worked group means of the page."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "rl.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if b.startswith("import torch")]
    exec(compile(code, "docs/rl.md", "exec"), {})
