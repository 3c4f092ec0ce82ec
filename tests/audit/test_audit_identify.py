"""The audit's crafted batch and the weights each mode predicts, against hand-worked numbers.

The batch's target counts are written out from its row shapes (real tokens, prompt tokens): a row of
``r`` tokens with a prompt of ``p`` has ``r - p`` targets (position 0 predicts nothing).
"""

from __future__ import annotations

import pytest
import torch

from lossparity.audit.batch import Config, configs_for, craft_batch, split_rows
from lossparity.audit.identify import Basis, fmt_factor, identify, mode_weights

TARGETS = [14, 4, 9, 0, 8, 11, 5, 10]  # (16,2) (5,1) (12,3) (6,6) (9,1) (16,5) (7,2) (11,1)
NTOK = 61


def _assign(cfg: Config) -> dict[int, tuple[int, int]]:
    return {row: (r, k) for r, ks in enumerate(split_rows(8, cfg)) for k, rows in enumerate(ks) for row in rows}


def test_crafted_batch_has_the_documented_target_counts():
    b = craft_batch(64)
    assert [u.n for u in b.units] == TARGETS
    assert int((b.labels[:, 1:] != -100).sum()) == NTOK
    assert len(set(b.row_of())) == 8  # every row is its own key
    packed = craft_batch(64, packed=True)
    assert packed.rows == 4 and [u.n for u in packed.units] == TARGETS
    assert int((packed.labels != -100).sum()) == NTOK


def test_mode_weights_hand_worked():
    b = craft_batch(64)
    ref = _assign(Config("r", "r"))
    k2 = Config("k2", "ga", ga=2, micro=4)
    w = mode_weights("per_token", b, ref, 1, 1)
    assert torch.allclose(w, torch.full((8,), 1 / 61, dtype=torch.float64))
    w = mode_weights("per_sample", b, ref, 1, 1)
    assert w[1] == pytest.approx(1 / (8 * 4)) and w[3] == pytest.approx(1 / 8)
    # microbatch 0 holds rows 0-3 (27 targets), microbatch 1 rows 4-7 (34): mean of the two means
    w = mode_weights("per_microbatch", b, _assign(k2), 1, 2)
    assert w[0] == pytest.approx(1 / (2 * 27)) and w[7] == pytest.approx(1 / (2 * 34))
    w = mode_weights("sample_sum", b, ref, 1, 1)
    assert torch.allclose(w, torch.full((8,), 1 / 8, dtype=torch.float64))
    # per_rank at 2 ranks x 2 microbatches of 2 rows: rank 0 holds rows 0,1,4,5 (37), rank 1 rows 2,3,6,7 (24)
    d2 = Config("d2", "dp", dp=2, ga=2, micro=2)
    w = mode_weights("per_rank", b, _assign(d2), 2, 2)
    assert w[0] == pytest.approx(1 / (2 * 37)) and w[2] == pytest.approx(1 / (2 * 24))


def test_split_rows_follows_a_sharded_sequential_sampler():
    assert split_rows(8, Config("d2k2", "dp", dp=2, ga=2, micro=2)) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    with pytest.raises(ValueError, match="rows"):
        split_rows(8, Config("bad", "x", ga=3, micro=2))
    with pytest.raises(ValueError, match="unknown class 'gaa'"):
        configs_for(["gaa"])


def _synthetic_basis() -> Basis:
    """A basis of random document gradients (P = 200 parameters) on the crafted batch."""
    b = craft_batch(64)
    g = torch.Generator().manual_seed(3)
    grads = torch.randn(200, 8, generator=g, dtype=torch.float64)
    grads[:, 3] = 0.0  # the prompt-only row has no gradient
    return Basis(["w"], [torch.Size([200])], grads, torch.rand(8, generator=g, dtype=torch.float64) * 10, b)


@pytest.mark.parametrize(
    ("weights", "name"),
    [
        ([1 / 61] * 8, "per_token"),
        ([2 / 61] * 8, "per_token × 2"),
        ([1 / (7 * max(n, 1)) for n in TARGETS], "per_sample × 8/7"),
        ([1 / 8] * 8, "sample_sum"),
    ],
)
def test_identify_names_a_known_combination(weights, name):
    basis = _synthetic_basis()
    c = torch.tensor(weights, dtype=torch.float64)
    grads = {"w": basis.grads @ c}
    found = identify(basis, grads, _assign(Config("r", "r")), 1, 1, separable_tol=1e-8)
    assert found.name == name
    assert found.residual < 1e-12 and found.separable
    live = [i for i, n in enumerate(TARGETS) if n]
    assert found.objective == pytest.approx(float(c[live] @ basis.sums[live]), rel=1e-12)


def test_identify_names_a_rank_whose_rows_were_dropped():
    basis = _synthetic_basis()
    cfg = Config("d2", "dp", dp=2, micro=4)
    assign = _assign(cfg)
    c = torch.tensor([1 / 61 if assign[i][0] == 0 else 0.0 for i in range(8)], dtype=torch.float64)
    found = identify(basis, {"w": basis.grads @ c}, assign, 2, 1, separable_tol=1e-8)
    assert found.mode is None
    assert found.name == "per_token; rank 0's rows × 1, rank 1's rows × 0"


def test_identify_names_a_step_that_kept_only_the_last_micro_step():
    # DeepSpeed #7718's signature at 2 ranks x GA 2 x 2 rows: each microbatch's token mean / (D·K), the first
    # micro-step of each rank dropped. Rows 0,1 | 2,3 are microbatches 0 | 1 (step 0), rows 4,5 | 6,7 are 2 | 3.
    basis = _synthetic_basis()
    cfg = Config("d2k2", "zero", dp=2, ga=2, micro=2)
    assign = _assign(cfg)
    mb_tokens = {2: TARGETS[4] + TARGETS[5], 3: TARGETS[6] + TARGETS[7]}  # 19 and 15 targets
    c = torch.tensor([0.0] * 4 + [1 / (4 * mb_tokens[2])] * 2 + [1 / (4 * mb_tokens[3])] * 2, dtype=torch.float64)
    found = identify(basis, {"w": basis.grads @ c}, assign, 2, 2, separable_tol=1e-8)
    assert found.mode is None
    assert found.name == (
        "per_microbatch; microbatch 0's rows × 0, microbatch 1's rows × 0, microbatch 2's rows × 1, "
        "microbatch 3's rows × 1 (only the last micro-step of each rank)"
    )


def test_identify_reports_a_non_separable_gradient():
    basis = _synthetic_basis()
    extra = torch.randn(200, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = {"w": basis.grads @ torch.full((8,), 1 / 61, dtype=torch.float64) + 0.05 * extra}
    found = identify(basis, grads, _assign(Config("r", "r")), 1, 1, separable_tol=1e-4)
    assert not found.separable and found.residual > 1e-3


def test_identify_refuses_a_missing_or_non_finite_gradient():
    basis = _synthetic_basis()
    with pytest.raises(ValueError, match="no gradient"):
        identify(basis, {}, _assign(Config("r", "r")), 1, 1, separable_tol=1e-4)
    with pytest.raises(ValueError, match="NaN or inf"):
        identify(basis, {"w": torch.full((200,), float("nan"))}, _assign(Config("r", "r")), 1, 1, separable_tol=1e-4)


def test_fmt_factor():
    assert fmt_factor(8 / 7) == "8/7" and fmt_factor(0.25) == "1/4" and fmt_factor(2.0) == "2"
    assert fmt_factor(1.23456789) == "1.235"
