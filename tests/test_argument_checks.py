"""Bad arguments to the public functions of ``lossparity`` raise TypeError/ValueError naming the argument, what
was expected and what was given (issue 26 item 3), never a foreign error from deep inside torch."""

from __future__ import annotations

import pytest
import torch

import lossparity
from lossparity.losses.cross_entropy import default_tiling, naive_cross_entropy
from lossparity.losses.fused_cross_entropy import fused_tiling
from lossparity.losses.modes import Normalizers, count_normalizers
from lossparity.losses.mtp import mtp_numerator, mtp_objective, roll_mask
from lossparity.losses.token_weights import mtp_token_weights

H = torch.randn(6, 4, dtype=torch.float64)
W = torch.randn(10, 4, dtype=torch.float64)
Y = torch.tensor([0, 1, 2, 3, 4, 5])
TW = torch.full((6,), 1 / 6, dtype=torch.float64)
LOSS = torch.rand(2, 5, dtype=torch.float64)
MASK = torch.ones(2, 5)
LABELS = torch.arange(10).view(2, 5)
SEG = torch.ones(2, 5, dtype=torch.long)
NORMS = Normalizers(tokens=10, samples=2, documents=2, microbatches=1)


def ce(**kw):
    h, w, y = kw.pop("h", H), kw.pop("w", W), kw.pop("y", Y)
    return lossparity.chunked_cross_entropy(h, w, y, **kw)


def fused(**kw):
    h, w, y, tw = kw.pop("h", H), kw.pop("w", W), kw.pop("y", Y), kw.pop("tw", TW)
    return lossparity.fused_linear_cross_entropy(h, w, y, tw, **kw)


# (call, exception, the message's regex: argument name, what was expected, what was given)
CASES = [
    # the three failures of the audit
    (lambda: ce(chunk_size=2.5), TypeError, r"chunk_size must be an int or None, got 2\.5"),
    (lambda: ce(h=H.tolist()), TypeError, r"hidden must be a torch\.Tensor \[T, H\] or \[B, S, H\], got list"),
    (
        lambda: lossparity.roll_mtp(LABELS, MASK, torch.ones(2, 6, dtype=torch.long), 1),
        ValueError,
        r"segment_ids must have the shape of mask \(2, 5\), got shape \(2, 6\)",
    ),
    # chunked / naive cross-entropy
    (lambda: ce(w=W.numpy()), TypeError, r"weight must be a torch\.Tensor \[V, H\], got ndarray"),
    (lambda: ce(y=[0, 1, 2, 3, 4, 5]), TypeError, r"labels must be a torch\.Tensor \[T\] or \[B, S\], got list"),
    (lambda: ce(vocab_chunk_size="8"), TypeError, r"vocab_chunk_size must be an int or None, got '8'"),
    (lambda: ce(chunk_size=True), TypeError, r"chunk_size must be an int or None, got True"),
    (lambda: ce(chunk_size=0), ValueError, r"chunk_size must be an int >= 1, got 0"),
    (lambda: ce(ignore_index=-100.0), TypeError, r"ignore_index must be an int, got -100\.0"),
    (lambda: ce(z_loss_coeff="1e-4"), TypeError, r"z_loss_coeff must be a real number, got '1e-4'"),
    (lambda: ce(z_loss_coeff=-1.0), ValueError, r"z_loss_coeff must be a finite number >= 0, got -1\.0"),
    (lambda: ce(vocab_start=-1), ValueError, r"vocab_start must be an int >= 0, got -1"),
    (lambda: ce(vocab_size=0), ValueError, r"vocab_size must be an int >= 1, got 0"),
    (lambda: naive_cross_entropy(H, W, Y, z_loss_coeff=None), TypeError, r"z_loss_coeff must be a real number"),
    # fused head
    (lambda: fused(tw=TW.tolist()), TypeError, r"token_weights must be a floating-point torch\.Tensor, got list"),
    (lambda: fused(chunk_size=1.5), TypeError, r"chunk_size must be an int or None, got 1\.5"),
    (lambda: fused(h=(1, 2)), TypeError, r"hidden must be a torch\.Tensor .*got tuple"),
    # MTP
    (lambda: lossparity.roll_mtp(LABELS.tolist(), MASK, None, 1), TypeError, r"labels must be an integer torch"),
    (lambda: lossparity.roll_mtp(LABELS.float(), MASK, None, 1), TypeError, r"labels must be an integer tensor, got"),
    (lambda: lossparity.roll_mtp(LABELS, MASK, None, 1.0), TypeError, r"k must be an int, got 1\.0"),
    (lambda: lossparity.roll_mtp(LABELS, MASK, None, -1), ValueError, r"k must be an int >= 0, got -1"),
    (lambda: lossparity.roll_mtp(LABELS, MASK, SEG.float(), 1), TypeError, r"segment_ids must be an integer tensor"),
    (lambda: lossparity.roll_mtp(LABELS, "mask", None, 1), TypeError, r"mask must be a torch\.Tensor, got 'mask'"),
    (lambda: roll_mask(MASK, None, "1"), TypeError, r"k must be an int, got '1'"),
    (lambda: mtp_numerator("per_token", LOSS, [MASK]), TypeError, r"losses must be a sequence of tensors"),
    (lambda: mtp_numerator("per_token", [LOSS], [MASK.tolist()]), TypeError, r"masks\[0\] must be a torch\.Tensor"),
    (lambda: mtp_numerator("per_token", [LOSS], [MASK, MASK]), ValueError, r"1 losses, 2 masks"),
    (lambda: mtp_objective("per_token", [LOSS], [MASK], [1]), TypeError, r"main_mask must be a torch\.Tensor"),
    (lambda: mtp_objective("per_token", [LOSS], [MASK], MASK, weight="0.3"), TypeError, r"weight must be a real"),
    # tiling helpers
    (lambda: default_tiling(10.0), TypeError, r"vocab_size must be an int, got 10\.0"),
    (lambda: default_tiling(10, chunk_size=0), ValueError, r"chunk_size must be an int >= 1, got 0"),
    (lambda: fused_tiling(6, 10, 4.5), TypeError, r"hidden_size must be an int, got 4\.5"),
    (lambda: fused_tiling(6, 10, 4, vocab_chunk_size=-1), ValueError, r"vocab_chunk_size must be an int >= 1"),
    # token weights
    (lambda: lossparity.token_weights("per_token", MASK.tolist()), TypeError, r"mask must be a torch\.Tensor \[b, S\]"),
    (lambda: lossparity.token_weights("per_token", torch.ones(2, 2, 2)), ValueError, r"mask must be \[b, S\] or \[S\]"),
    (lambda: lossparity.token_weights("per_token", MASK, denominator="2"), TypeError, r"denominator must be a real"),
    (lambda: lossparity.token_weights("per_token", MASK, denominator=0), ValueError, r"denominator must be .*> 0"),
    (
        lambda: lossparity.token_weights("sample_sum_norm", MASK, fixed_length=5.0),
        TypeError,
        r"fixed_length must be an int or None, got 5\.0",
    ),
    (lambda: lossparity.token_weights("per_document", MASK, segment_ids=[1]), TypeError, r"segment_ids must be"),
    (lambda: mtp_token_weights("per_token", MASK, denominators=[1.0]), TypeError, r"masks must be a sequence"),
    (lambda: mtp_token_weights("per_token", [MASK], denominators=2.0), TypeError, r"denominators must be a sequence"),
    (lambda: mtp_token_weights("per_token", [MASK], denominators=[]), ValueError, r"denominators must hold"),
    (lambda: mtp_token_weights("per_token", [[1.0]], denominators=[1.0]), TypeError, r"masks\[0\] must be a torch"),
    # statistics
    (lambda: lossparity.sample_stats(LOSS.tolist(), MASK), TypeError, r"per_token_loss must be a torch\.Tensor"),
    (lambda: lossparity.sample_stats(LOSS, MASK[:, :4]), ValueError, r"mask shape \(2, 4\) does not match"),
    (lambda: lossparity.sample_stats(LOSS.long(), MASK), TypeError, r"per_token_loss must be floating point"),
    (lambda: lossparity.document_stats(LOSS, MASK, SEG[:, :3]), ValueError, r"segment_ids shape \(2, 3\) does not"),
    (lambda: lossparity.document_stats(LOSS, MASK, SEG.double()), TypeError, r"segment_ids must be an integer"),
    (lambda: lossparity.estimator_gap([1.0, 2.0], torch.ones(2)), TypeError, r"sample_sums must be a torch\.Tensor"),
    (lambda: lossparity.estimator_gap(torch.ones(2), 3), TypeError, r"sample_counts must be a torch\.Tensor, got 3"),
    # modes
    (lambda: lossparity.numerator("per_token", LOSS, MASK.tolist()), TypeError, r"mask must be a torch\.Tensor"),
    (lambda: lossparity.numerator("per_sample", LOSS, MASK[:1]), ValueError, r"mask shape \(1, 5\) does not match"),
    (
        lambda: lossparity.numerator("per_document", LOSS, MASK, segment_ids=SEG[0]),
        ValueError,
        r"segment_ids shape \(5,\) does not match per_token_loss shape \(2, 5\)",
    ),
    (lambda: lossparity.numerator("per_sample", LOSS, MASK, unit_counts=[5]), TypeError, r"unit_counts must be a"),
    (lambda: lossparity.objective("per_token", LOSS.tolist(), MASK), TypeError, r"per_token_loss must be a torch"),
    (
        lambda: lossparity.objective("per_microbatch", LOSS, MASK, microbatch_size=1.0),
        TypeError,
        r"microbatch_size must be an int or None, got 1\.0",
    ),
    (lambda: lossparity.denominator("per_token", {"tokens": 3}), TypeError, r"norms must be a Normalizers, got dict"),
    (lambda: lossparity.denominator("sample_sum_norm", NORMS, "5"), ValueError, r"denominator takes no fixed_length"),
    (lambda: Normalizers(tokens=2.5, samples=1, documents=0, microbatches=1), TypeError, r"Normalizers\.tokens must"),
    (lambda: Normalizers(tokens=3, samples=-1, documents=0, microbatches=1), ValueError, r"Normalizers\.samples must"),
    (lambda: count_normalizers([[1, 1]]), TypeError, r"mask must be a torch\.Tensor \[b, S\] or \[S\], got list"),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_bad_argument_is_named(i):
    call, exc, pattern = CASES[i]
    with pytest.raises(exc, match=pattern) as e:
        call()
    assert type(e.value) is exc  # not a subclass of it raised by torch (e.g. torch's own TypeError)


def test_good_arguments_still_work():
    # the checks accept what the functions always accepted: numpy-free ints, None, float denominators
    assert lossparity.chunked_cross_entropy(H, W, Y, chunk_size=4).shape == (6,)
    lab, w = lossparity.roll_mtp(LABELS, MASK, SEG, 1)
    assert lab[0].tolist() == [1, 2, 3, 4, -100] and w[0].tolist() == [1, 1, 1, 1, 0]
    assert lossparity.token_weights("sample_sum_norm", MASK, fixed_length=5, denominator=2).max().item() == 0.1
    assert lossparity.denominator("per_sample", NORMS) == 2.0


def test_roll_mask_accepts_the_same_rows_as_s_and_1_s():
    # the accountant rolls a [1, S] view of a microbatch given as [S] with that microbatch's [S] segment ids
    seg = torch.tensor([1, 1, 2, 2, 2])
    assert roll_mask(torch.ones(1, 5), seg, 1).tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match=r"segment_ids must have the shape of mask \(2, 5\), got shape \(10,\)"):
        roll_mask(torch.ones(2, 5), torch.ones(10, dtype=torch.long), 1)
