"""One definition of a document (docs/semantics.md §0) on every path: the core losses, the accountant, the
token weights, the Hugging Face, Megatron and torchtitan integrations, the JAX port, the MTP label shift
and the reference model's attention mask all see a packed row ``[1, 1, 2, 2, 1, 1]`` as 3 documents.

Hand-worked example (per_document: ``J = (1/Ndoc) Σ_j s_j / max(n_j, 1)``), a document being a maximal
run of equal non-zero ids in a row (id 0 = padding, which also ends a run):

    row 0  ids  [1, 1, 2, 2, 1, 1]   loss [1, 2, 3, 4, 5, 6]   mask [1, 1, 1, 0, 1, 1]
           docs A = cols 0-1: s = 1+2 = 3,  n = 2  -> 1.5
                B = cols 2-3: s = 3,        n = 1  -> 3
                C = cols 4-5: s = 5+6 = 11, n = 2  -> 5.5
    row 1  ids  [3, 3, 0, 3, 0, 0]   loss [7, 8, 9, 10, 11, 12]  mask [1, 0, 0, 1, 0, 0]
           docs D = cols 0-1: s = 7,  n = 1 -> 7
                E = col 3:    s = 10, n = 1 -> 10
    Ndoc = 5,  J = (1.5 + 3 + 5.5 + 7 + 10) / 5 = 27 / 5 = 5.4

(Counting distinct (row, id) pairs instead would give 3 documents and J = (14/4 + 3 + 17/2) / 3 = 5.0.)
"""

from __future__ import annotations

import math

import pytest
import torch

from lossparity.losses.mode_table import count_document_runs, document_starts

SEG = [[1, 1, 2, 2, 1, 1], [3, 3, 0, 3, 0, 0]]
LOSS = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 10.0, 11.0, 12.0]]
MASK = [[1, 1, 1, 0, 1, 1], [1, 0, 0, 1, 0, 0]]
# per-document positions (HF position_ids, torchtitan positions): each 0 opens a document; row 1's
# documents [0..2] and [3..5] hold the same loss tokens (cols 0 and 3) as D and E above.
POSITIONS = [[0, 1, 0, 1, 0, 1], [0, 1, 2, 0, 1, 2]]
NDOC = 5
WANT = 27 / 5


def _t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def _logits_for(loss: list[list[float]]) -> torch.Tensor:
    """Logits ``[b, S, 2]`` whose cross-entropy against label 0 is ``loss``: ``log(1 + e^z) = c`` for
    ``z = log(e^c − 1)``."""
    z = torch.tensor([[math.log(math.expm1(c)) for c in row] for row in loss], dtype=torch.float64)
    return torch.stack([torch.zeros_like(z), z], dim=-1)


def _labels() -> torch.Tensor:
    return torch.where(_t(MASK, torch.long) > 0, 0, -100)


def test_the_rule_on_plain_lists():
    assert document_starts([1, 1, 2, 2, 1, 1]) == [True, False, True, False, True, False]
    assert document_starts([3, 3, 0, 3, 0, 0]) == [True, False, False, True, False, False]
    assert count_document_runs(SEG) == NDOC


def test_core_losses_accountant_and_token_weights():
    import lossparity as lp
    from lossparity.losses.modes import count_normalizers, denominator, numerator
    from lossparity.losses.stats import document_ids, rows_documents
    from lossparity.losses.token_weights import token_weights

    loss, mask, seg = _t(LOSS), _t(MASK), _t(SEG, torch.long)
    assert rows_documents(seg)[1] == NDOC
    assert document_ids(seg).tolist() == [[1, 1, 2, 2, 3, 3], [1, 1, 0, 2, 0, 0]]
    assert float(lp.objective("per_document", loss, mask, segment_ids=seg)) == pytest.approx(WANT, rel=1e-15)
    norms = count_normalizers(mask, seg)
    assert norms.documents == NDOC
    num = numerator("per_document", loss, mask, segment_ids=seg)
    assert float(num / denominator("per_document", norms)) == pytest.approx(WANT, rel=1e-15)
    w = token_weights("per_document", mask, segment_ids=seg, denominator=NDOC)
    assert float((w * loss).sum()) == pytest.approx(WANT, rel=1e-15)
    acc = lp.Accountant("per_document")
    acc.begin_step([mask], [seg])
    got = float(acc.lm_loss(loss, mask, seg))
    acc.finish_step()
    assert got == pytest.approx(WANT, rel=1e-15) and acc.logs()["objective"] == pytest.approx(WANT, rel=1e-15)


def test_megatron_loss_func():
    pytest.importorskip("megatron.core")
    from lossparity.integrations.megatron import LossFunc

    num, count, _ = LossFunc("per_document")(_t(MASK), _t(LOSS), segment_ids=_t(SEG, torch.long))
    assert int(count) == NDOC
    assert float(num / count) == pytest.approx(WANT, rel=1e-15)


def test_torchtitan_loss_from_positions():
    pytest.importorskip("torchtitan")
    from lossparity.integrations.torchtitan import LossParityLoss

    labels, pos = _labels(), _t(POSITIONS, torch.long)
    loss_fn = LossParityLoss("per_document")
    assert int(loss_fn.precount([labels], [pos])) == NDOC
    got, _ = loss_fn(_logits_for(LOSS), labels, positions=pos)
    assert float(got) == pytest.approx(WANT, rel=1e-12)


@pytest.mark.parametrize("column", ["segment_ids", "position_ids"])
def test_hugging_face_compute_loss(tmp_path, column):
    pytest.importorskip("transformers")
    from _hf_common import RowDataset, padded_rows, tiny_model, training_args

    from lossparity.integrations.hf import LossParityTrainer

    trainer = LossParityTrainer(
        model=tiny_model(),
        args=training_args(str(tmp_path), 2, 1, steps=1),
        train_dataset=RowDataset(padded_rows()),
        loss_mode="per_document",
    )
    logits = _logits_for(LOSS)

    def fake_model(**kwargs):
        return {"logits": logits}

    inputs = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "shift_labels": _labels()}
    inputs[column] = _t(SEG if column == "segment_ids" else POSITIONS, torch.long)
    assert float(trainer.compute_loss(fake_model, inputs)) == pytest.approx(WANT, rel=1e-6)  # HF casts to fp32


def test_jax_port():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import lossparity.jax as lj
    from lossparity.jax.stats import count_documents

    # float32 (this process may run without x64): the sums of small integers are exact, J to rounding
    loss, mask, seg = jnp.asarray(LOSS, jnp.float32), jnp.asarray(MASK), jnp.asarray(SEG)
    assert float(lj.objective("per_document", loss, mask, segment_ids=seg)) == pytest.approx(WANT, rel=1e-6)
    assert int(lj.count_normalizers(mask, seg).documents) == int(count_documents(seg)) == NDOC
    s, n, present = lj.document_stats(loss, mask, seg)
    assert s[present].tolist() == [3.0, 3.0, 11.0, 7.0, 10.0] and n[present].tolist() == [2, 1, 2, 1, 1]


def test_mtp_shift_and_attention_stay_inside_a_run():
    """Depth 4 of row [1,1,2,2,1,1]: t = 0, 1 would predict t + 4 (ids equal, but another document): no
    label there; no query of the third document sees a key of the first."""
    from lossparity.losses.mtp import roll_mask
    from lossparity.model.attention import attention_mask
    from lossparity.model.mtp import shift_tokens

    seg, ones = _t([SEG[0]], torch.long), torch.ones(1, 6)
    assert roll_mask(ones, seg, 4).tolist() == [[0.0] * 6]
    assert shift_tokens(torch.arange(1, 7)[None], 4, seg).tolist() == [[0] * 6]
    m = attention_mask(seg, 6)[0, 0]
    assert not m[4:, :4].any() and m[5, 4] and m[3, 2] and not m[2, :2].any()
    jax = pytest.importorskip("jax")
    from lossparity.jax.mtp import roll_mask as jax_roll_mask

    assert jax_roll_mask(jax.numpy.ones((1, 6)), jax.numpy.asarray([SEG[0]]), 4).tolist() == [[0.0] * 6]
