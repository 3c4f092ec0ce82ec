"""lossparity.integrations.megatron inside megatron-core's real schedule (2 gloo ranks, float64).

Expected values: a naive single-process float64 computation on the whole global batch (per-sample and
per-document loops written out here, not lossparity's formulas), back-propagated in one pass.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from _megatron_workers import S, TinyLM, global_batch, run_megatron  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402
from lossparity.integrations.megatron import LossFunc, document_sums  # noqa: E402

N_ROWS, WORLD, NUM_MBS, MBS = 16, 2, 4, 2
MODES = ["per_sample", "per_document", "per_token", "per_microbatch"]
# finalize_model_grads scales by ``1.0 / num_tokens`` with an int32 tensor: a float32 reciprocal. Exact
# for the power-of-two counts of this batch (N = 16, Ndoc = 32, D·K = 8); Ntok is not one, so per_token
# carries float32 rounding of 1/Ntok (Megatron's, not lossparity's).
TOL = {"per_token": 1e-7}


def _naive_objective(mode: str, loss: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    terms, units = [], 0
    for i in range(loss.shape[0]):
        if mode == "per_sample":
            n = mask[i].sum()
            terms.append((loss[i] * mask[i]).sum() / max(float(n), 1.0))
            units += 1
        elif mode == "per_document":
            for d in seg[i].unique().tolist():
                w = mask[i] * (seg[i] == d)
                terms.append((loss[i] * w).sum() / max(float(w.sum()), 1.0))
                units += 1
    if mode == "per_token":
        return (loss * mask).sum() / mask.sum()
    if mode == "per_microbatch":  # microbatches of MBS consecutive rows, over all ranks
        for r in range(0, loss.shape[0], MBS):
            w = mask[r : r + MBS]
            terms.append((loss[r : r + MBS] * w).sum() / max(float(w.sum()), 1.0))
        return torch.stack(terms).sum() / len(terms)
    return torch.stack(terms).sum() / units


def _reference(mode: str):
    tokens, labels, mask, seg = global_batch(N_ROWS)
    model = TinyLM(config=None)
    loss = model(tokens, labels)
    J = _naive_objective(mode, loss, mask, seg)
    J.backward()
    lm = float((loss.detach() * mask).sum() / mask.sum())
    return float(J), lm, {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
def test_forward_backward_no_pipelining_gives_the_objective_gradients():
    _, _, mask, _ = global_batch(N_ROWS)
    assert mask[2:4].sum() == 0  # rank 0's second microbatch has no loss token
    results = spawn(run_megatron, WORLD, MODES, N_ROWS, NUM_MBS, MBS, timeout_s=240)
    for mode in MODES:
        J, lm, grads = _reference(mode)
        for rank in range(WORLD):
            got, reduced = results[rank][mode]
            worst = max(_rel(got[n], grads[n]) for n in grads)
            print(f"measured: Megatron {mode} rank {rank} gradients vs one-pass float64: {worst:.1e}")
            assert worst <= TOL.get(mode, 1e-10), (mode, rank, worst)
            assert reduced["objective"] == pytest.approx(J, rel=1e-12, abs=0), mode
            assert reduced["lm loss"] == pytest.approx(lm, rel=1e-12, abs=0), mode


def test_returned_counts_are_integer_tensors_and_numerators_match_naive():
    _, _, mask, seg = global_batch(4)
    loss = torch.rand(4, S, dtype=torch.float64)
    for mode, count in [("per_sample", 4), ("per_token", int(mask.sum())), ("per_microbatch", 1), ("per_document", 8)]:
        num, n, report = LossFunc(mode)(mask, loss, segment_ids=seg)
        assert n.dtype == torch.int and n.dim() == 0 and int(n) == count, mode
        # one microbatch of 4 rows: its per_microbatch numerator is its token mean
        naive = "per_token" if mode == "per_microbatch" else mode
        want = _naive_objective(naive, loss, mask, seg) * (1 if mode == "per_microbatch" else count)
        assert float(num) == pytest.approx(float(want), rel=1e-12), mode
        assert report["lm loss"].tolist() == pytest.approx([float((loss * mask).sum()), float(mask.sum())])


def test_document_sums_counts_runs_and_skips_padding():
    seg = torch.tensor([[1, 1, 2, 2, 0, 0], [3, 3, 3, 1, 1, 0]])
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    loss = torch.arange(12, dtype=torch.float64).view(2, 6)
    s, n, ndoc = document_sums(loss, mask, seg)
    assert int(ndoc) == 4  # two documents per row; row 1's are empty but still count
    assert s[:4].tolist() == [0.0, 5.0, 0.0, 0.0] and n[:4].tolist() == [1.0, 2.0, 0.0, 0.0]


def test_bad_input_names_the_argument():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="calculate_per_token_loss=True"):
        LossFunc("per_sample", config=SimpleNamespace(calculate_per_token_loss=False))
    with pytest.raises(ValueError, match="context_parallel_size"):
        LossFunc("per_sample", config=SimpleNamespace(calculate_per_token_loss=True, context_parallel_size=2))
    LossFunc("per_token", config=SimpleNamespace(calculate_per_token_loss=True, context_parallel_size=2))
    with pytest.raises(ValueError, match="segment_ids"):
        LossFunc("per_document")(torch.ones(2, 3), torch.rand(2, 3))
    with pytest.raises(ValueError, match="loss_mask"):
        LossFunc("per_sample")(torch.ones(2, 4), torch.rand(2, 3))
    with pytest.raises(ValueError, match="unknown mode"):
        LossFunc("per_row")


def test_loss_token_in_padding_segment_is_rejected():
    seg = torch.tensor([[1, 1, 0]])
    with pytest.raises(RuntimeError, match="segment id 0"):
        document_sums(torch.rand(1, 3), torch.ones(1, 3), seg)
