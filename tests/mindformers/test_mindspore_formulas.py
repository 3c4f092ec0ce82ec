"""lossparity.mindspore against lossparity's PyTorch functions on the same inputs (run in the torch venv,
``_torch_ref.py``): per-token cross-entropy, every mode's objective and its gradient w.r.t. the logits, the
microbatch shares at GA 1, 2 and 4... of the rows, the Switch term and the global_running scope."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from _data import ASL, DOCUMENTS, LENGTHS, B, S, batch, lm_jobs
from _torch_ref import run
from mindspore import Tensor

import lossparity.mindspore as lpm

E, TOPK = 6, 2


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    jobs = lm_jobs(lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S).asnumpy())  # GA 1, 2, 4
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(E), (4, 10)).astype(np.float32)
    jobs.update(
        {
            "job/moe/kind": np.array("moe"),
            "job/moe/probs": probs,
            "job/moe/counts": rng.integers(0, 9, (4, E)).astype(np.float32),
            "job/moe/tokens": np.array([20.0, 18.0, 20.0, 11.0], np.float32),
            "job/moe/topk": np.array(TOPK),
            "job/moe/coeff": np.array(0.01),
        }
    )
    return {**jobs, **{"out/" + k: v for k, v in run(jobs).items()}}


def test_segment_ids_from_actual_seq_len_hand_worked() -> None:
    # row [3, 8, 12] of S=12: documents [0,3), [3,8), [8,12); the batch-offset form (row 1 of a microbatch
    # adds S) decodes to the same ids, and repeated ends (padding) make no document
    asl = Tensor(np.array([[3, 8, 12], [15, 20, 24], [12, 12, 12]], np.int32))
    ids = lpm.segment_ids_from_actual_seq_len(asl, 12).asnumpy()
    expected = [1] * 3 + [2] * 5 + [3] * 4
    assert ids.tolist() == [expected, expected, [1] * 12]


def test_token_nll_matches_torch_cross_entropy(reference) -> None:
    x = batch()
    nll = lpm.token_nll(Tensor(x["logits"]), Tensor(x["labels"])).asnumpy()
    np.testing.assert_allclose(nll, reference["out/lm8/nll"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["per_token", "per_sample", "per_document", "sample_sum"])
def test_objective_and_logit_gradient_match_torch(reference, mode: str) -> None:
    x = batch()
    mask, labels = Tensor(x["mask"]), Tensor(x["labels"])
    seg = lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S)

    def objective(z: Tensor) -> Tensor:
        return lpm.objective(mode, lpm.token_nll(z, labels), mask, segment_ids=seg)

    value, grad = ms.value_and_grad(objective)(Tensor(x["logits"]))
    np.testing.assert_allclose(value.asnumpy(), reference[f"out/lm8/{mode}/objective"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad.asnumpy(), reference[f"out/lm8/{mode}/grad"], rtol=1e-5, atol=1e-7)
    assert float(np.abs(grad.asnumpy()[1]).max()) == 0.0  # the row without targets gets no gradient


@pytest.mark.parametrize("micro", [8, 4, 2])
@pytest.mark.parametrize("mode", ["per_token", "per_sample", "per_document"])
def test_microbatch_shares_match_torch_and_sum_to_the_objective(reference, mode: str, micro: int) -> None:
    x = batch()
    seg = lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S)
    nll = lpm.token_nll(Tensor(x["logits"]), Tensor(x["labels"]))
    mask = Tensor(x["mask"])
    # the step's counts: the sum of each microbatch's own counts (as the hook sums them before the first backward)
    parts = [lpm.count_normalizers(mask[r : r + micro], seg[r : r + micro]) for r in range(0, B, micro)]
    norms = parts[0]
    for p in parts[1:]:
        norms = norms + p
    shares = []
    for r in range(0, B, micro):
        rows = slice(r, r + micro)
        share = lpm.share(mode, nll[rows], mask[rows], norms, segment_ids=seg[rows])
        weights = lpm.token_weights(mode, mask[rows], norms, segment_ids=seg[rows])
        np.testing.assert_allclose((weights * nll[rows]).sum().asnumpy(), share.asnumpy(), rtol=1e-6)
        shares.append(float(share.asnumpy()))
    np.testing.assert_allclose(shares, reference[f"out/lm{micro}/{mode}/shares"], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(sum(shares), reference[f"out/lm8/{mode}/objective"], rtol=1e-6)


def test_count_normalizers_hand_counted() -> None:
    x = batch()
    seg = lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S)
    norms = lpm.count_normalizers(Tensor(x["mask"]), seg)
    # tokens: Σ LENGTHS; samples: 8 rows (the empty row counts); documents: 1+1+2+1+3+1+2+1
    assert norms.stacked().asnumpy().tolist() == [sum(LENGTHS), B, DOCUMENTS]


def test_switch_and_global_running_match_torch(reference) -> None:
    probs = reference["job/moe/probs"]
    counts, tokens = reference["job/moe/counts"], reference["job/moe/tokens"]
    switch = [
        float(
            lpm.switch_load_balancing_loss(
                Tensor(probs[m]), Tensor(counts[m]), float(tokens[m]), TOPK, E, 0.01
            ).asnumpy()
        )
        for m in range(4)
    ]
    np.testing.assert_allclose(switch, reference["out/moe/switch"], rtol=1e-6)
    state = lpm.GlobalRunningCounts()
    running = [
        float(
            lpm.global_running_load_balancing_loss(
                Tensor(probs[m]), Tensor(counts[m]), float(tokens[m]), state, topk=TOPK, num_experts=E, coeff=0.01
            ).asnumpy()
        )
        for m in range(4)
    ]
    np.testing.assert_allclose(running, reference["out/moe/global_running"], rtol=1e-6)


def test_bad_arguments_are_named() -> None:
    x = batch()
    with pytest.raises(ValueError, match="mode"):
        lpm.objective("per_groupz", Tensor(x["mask"]), Tensor(x["mask"]))
    with pytest.raises(ValueError, match="segment_ids"):
        lpm.numerator("per_document", Tensor(x["mask"]), Tensor(x["mask"]))
    with pytest.raises(ValueError, match="labels shape"):
        lpm.token_nll(Tensor(x["logits"]), Tensor(x["labels"][:, :3]))
    with pytest.raises(ValueError, match="seq_length"):
        lpm.segment_ids_from_actual_seq_len(Tensor(ASL), 0)
    with pytest.raises(TypeError, match="state"):
        lpm.global_running_load_balancing_loss(
            Tensor(np.ones((2, E), np.float32)),
            Tensor(np.ones(E, np.float32)),
            2.0,
            None,
            topk=1,
            num_experts=E,
            coeff=1.0,  # type: ignore[arg-type]
        )
