"""lossparity.integrations.torchtitan inside torchtitan's real ``Trainer.train_step`` (see _titan_workers).

Expected gradients: a naive float64 computation on the whole global batch of 16 rows, with per-row /
per-document loops written out here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.trainer", exc_type=ImportError)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _titan_workers import TinyLM, V, global_batch, run_titan, run_titan_cp, run_titan_tp, titan_step  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402
from lossparity.integrations.torchtitan import LossParityLoss  # noqa: E402

MODES = ["per_sample", "per_document", "per_token"]


def _reference(mode: str, seq: int = 10) -> dict[str, torch.Tensor]:
    tokens, labels, positions = global_batch(16, seq)
    model = TinyLM(seq)
    logits = model(tokens, positions)
    loss = F.cross_entropy(logits.reshape(-1, V), labels.clamp(min=0).reshape(-1), reduction="none").view(labels.shape)
    w = (labels != -100).double()
    if mode == "per_token":
        J = (loss * w).sum() / w.sum()
    else:
        units = []
        for i in range(16):
            doc = (positions[i] == 0).cumsum(0) if mode == "per_document" else torch.ones(labels.shape[1])
            for d in doc.unique():
                wd = w[i] * (doc == d)
                units.append((loss[i] * wd).sum() / max(float(wd.sum()), 1.0))
        J = torch.stack(units).mean()
    J.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b)


@pytest.mark.parametrize("mode", MODES)
def test_train_step_with_gradient_accumulation_matches_reference(mode):
    got = titan_step(mode, slice(0, 16), ga=4)
    rel = _rel(got, _reference(mode))
    print(f"measured: torchtitan {mode} GA 4 gradients vs one-pass float64: {rel:.1e}")
    assert rel <= 1e-10


@pytest.mark.slow
def test_two_data_parallel_ranks_match_reference():
    results = spawn(run_titan, 2, MODES, timeout_s=240)
    for mode in MODES:
        ref = _reference(mode)
        for rank in range(2):
            rel = _rel(results[rank][mode], ref)
            print(f"measured: torchtitan {mode} 2 ranks x GA 2 gradients vs one-pass float64: {rel:.1e}")
            assert rel <= 1e-10, (mode, rank)


@pytest.mark.slow
def test_context_parallel_two_ranks_match_reference():
    # rows of 12 (torchtitan's head-tail sharding cuts a row into 2·cp chunks); documents cross the cut
    results = spawn(run_titan_cp, 2, MODES, 12, timeout_s=240)
    for mode in MODES:
        ref = _reference(mode, seq=12)
        for rank in range(2):
            rel = _rel(results[rank][mode], ref)
            print(f"measured: torchtitan {mode} CP 2 x GA 4 gradients vs one-pass float64: {rel:.1e}")
            assert rel <= 1e-10, (mode, rank)


@pytest.mark.slow
def test_loss_parallel_logits_two_ranks_match_reference():
    # V = 11 over 2 TP ranks: an uneven vocabulary split (6 + 5), as torch.chunk and torchtitan place it
    results = spawn(run_titan_tp, 2, MODES, timeout_s=240)
    for mode in MODES:
        ref = _reference(mode)
        for rank in range(2):
            rel = _rel(results[rank][mode], ref)
            print(
                f"measured: torchtitan {mode} loss-parallel logits TP 2 x GA 4 gradients vs one-pass float64: {rel:.1e}"
            )
            assert rel <= 1e-10, (mode, rank)


def test_bad_input_names_the_argument():
    loss = LossParityLoss("per_document")
    with pytest.raises(ValueError, match="positions"):
        loss.precount([torch.zeros(2, 3, dtype=torch.long)])
    with pytest.raises(RuntimeError, match="before precount"):
        LossParityLoss("per_sample")(torch.rand(2, 3, V), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown mode"):
        LossParityLoss("per_row")
