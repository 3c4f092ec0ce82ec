"""Chunked output-layer cross-entropy against an independent float64 formula (semantics §1 z-loss, §7)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossparity.losses.cross_entropy import chunked_cross_entropy, default_tiling, naive_cross_entropy

IGNORE = -100


def reference(hidden, weight, labels, ignore_index=IGNORE, z_loss=0.0):
    """l = lse - z[y] + λ lse², 0 at ignored positions, everything in float64 from the formula."""
    h = hidden.double().reshape(-1, hidden.shape[-1])
    z = h @ weight.double().t()
    y = labels.reshape(-1)
    keep = y != ignore_index
    lse = torch.logsumexp(z, dim=1)
    picked = z.gather(1, torch.where(keep, y, 0).unsqueeze(1)).squeeze(1)
    loss = (lse - picked + z_loss * lse**2) * keep
    return loss.reshape(labels.shape)


def make(tokens, vocab, hsize, dtype=torch.float32, seed=0, ignore_every=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hsize, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, hsize, generator=gen, dtype=torch.float64) * hsize**-0.5
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    grad = torch.randn(tokens, generator=gen, dtype=torch.float64)  # arbitrary signs and sizes
    return hidden.to(dtype), weight.to(dtype), labels, grad


def values_and_grads(fn, hidden, weight, labels, grad, **kwargs):
    if fn is reference:  # its gradients too are float64, not rounded back to the inputs' dtype
        hidden, weight = hidden.double(), weight.double()
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels, **kwargs)
    loss.backward(grad.to(loss.dtype).reshape(loss.shape))
    return loss.detach(), h.grad, w.grad


def assert_matches_reference(hidden, weight, labels, grad, tol, z_loss=0.0, ignore_index=IGNORE, **kwargs):
    loss, gh, gw = values_and_grads(
        chunked_cross_entropy,
        hidden,
        weight,
        labels,
        grad,
        z_loss_coeff=z_loss,
        ignore_index=ignore_index,
        **kwargs,
    )
    ref, rh, rw = values_and_grads(reference, hidden, weight, labels, grad, z_loss=z_loss, ignore_index=ignore_index)
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(gh.double(), rh, rtol=tol, atol=tol)
    torch.testing.assert_close(gw.double(), rw, rtol=tol, atol=tol)


# (T, V, chunk_size, vocab_chunk_size): chunks that divide neither T nor V, single-token/row tiles,
# a single tile, and the default tiling.
TILINGS = [
    (37, 53, 7, None),
    (37, 53, 7, 10),
    (37, 53, 1, 1),
    (37, 53, 64, 64),
    (37, 53, None, None),
    (37, 53, None, 9),
    (40, 50, 8, 25),
]


@pytest.mark.parametrize("tokens,vocab,chunk,vchunk", TILINGS)
@pytest.mark.parametrize("z_loss", [0.0, 0.3])
@pytest.mark.parametrize("ignore_every", [0, 3])
def test_float32_values_and_grads(tokens, vocab, chunk, vchunk, z_loss, ignore_every):
    hidden, weight, labels, grad = make(tokens, vocab, 16, ignore_every=ignore_every)
    assert_matches_reference(
        hidden, weight, labels, grad, 1e-6, z_loss=z_loss, chunk_size=chunk, vocab_chunk_size=vchunk
    )


def test_hand_worked_example():
    # h = [1, 0], W rows e0, e1, -e0 -> z = [1, 0, -1]; lse = log(e + 1 + 1/e); l = lse - z[y]
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([0, 2])
    lse = torch.log(torch.tensor(torch.e + 1 + 1 / torch.e, dtype=torch.float64))
    expected = torch.stack([lse - 1, lse + 1]) + 0.5 * lse**2
    got = chunked_cross_entropy(hidden, weight, labels, chunk_size=1, vocab_chunk_size=2, z_loss_coeff=0.5)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


def test_ignore_index_inside_vocabulary_and_exact_zeros():
    hidden, weight, labels, grad = make(20, 30, 8)
    labels[::2] = 0  # a pad id that is a real vocabulary row
    loss = chunked_cross_entropy(hidden, weight, labels, ignore_index=0, chunk_size=3, vocab_chunk_size=7)
    assert torch.all(loss[::2] == 0)
    assert_matches_reference(hidden, weight, labels, grad, 1e-6, ignore_index=0, chunk_size=3)


def test_all_ignored_and_empty():
    hidden, weight, labels, grad = make(6, 10, 4)
    labels[:] = IGNORE
    loss, gh, gw = values_and_grads(chunked_cross_entropy, hidden, weight, labels, grad)
    assert torch.equal(loss, torch.zeros(6)) and torch.equal(gh, torch.zeros_like(gh))
    assert torch.equal(gw, torch.zeros_like(gw))
    empty = chunked_cross_entropy(hidden[:0], weight, labels[:0])
    assert empty.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_float32(dtype):
    hidden, weight, labels, grad = make(45, 70, 32, dtype=dtype, ignore_every=4)
    loss, gh, gw = values_and_grads(
        chunked_cross_entropy, hidden, weight, labels, grad, chunk_size=8, vocab_chunk_size=16, z_loss_coeff=0.1
    )
    assert loss.dtype == torch.float32 and gh.dtype == dtype and gw.dtype == dtype
    # the reference sees the same rounded inputs in float64: the loss only carries float32 rounding
    ref, rh, rw = values_and_grads(reference, hidden, weight, labels, grad, z_loss=0.1)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    # gradients are rounded once to the input dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(gh.double(), rh, rtol=2 * eps, atol=2 * eps * rh.abs().max().item())
    torch.testing.assert_close(gw.double(), rw, rtol=2 * eps, atol=2 * eps * rw.abs().max().item())


def test_only_one_input_requires_grad():
    hidden, weight, labels, grad = make(30, 40, 8, ignore_every=5)
    _, rh, rw = values_and_grads(reference, hidden, weight, labels, grad)
    h = hidden.clone().requires_grad_()
    chunked_cross_entropy(h, weight, labels, chunk_size=7).backward(grad.float())
    torch.testing.assert_close(h.grad.double(), rh, rtol=1e-6, atol=1e-6)
    w = weight.clone().requires_grad_()
    chunked_cross_entropy(hidden, w, labels, chunk_size=7, vocab_chunk_size=9).backward(grad.float())
    torch.testing.assert_close(w.grad.double(), rw, rtol=1e-6, atol=1e-6)


def test_gradcheck_float64():
    hidden, weight, labels, _ = make(5, 7, 3, dtype=torch.float64)
    labels[1] = IGNORE
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def fn(a, b):
        return chunked_cross_entropy(a, b, labels, chunk_size=2, vocab_chunk_size=3, z_loss_coeff=0.2)

    assert torch.autograd.gradcheck(fn, (h, w))


def test_batched_input():
    hidden, weight, labels, grad = make(24, 30, 8, ignore_every=5)
    b_hidden, b_labels, b_grad = hidden.view(4, 6, 8), labels.view(4, 6), grad.view(4, 6)
    loss, gh, gw = values_and_grads(
        chunked_cross_entropy, b_hidden, weight, b_labels, b_grad, chunk_size=5, z_loss_coeff=0.1
    )
    ref, rh, rw = values_and_grads(reference, b_hidden, weight, b_labels, b_grad, z_loss=0.1)
    assert loss.shape == (4, 6) and gh.shape == (4, 6, 8)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh.double(), rh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("z_loss", [0.0, 0.2])
def test_naive_reference_matches_formula(z_loss):
    hidden, weight, labels, grad = make(30, 40, 8, ignore_every=3)
    loss, gh, gw = values_and_grads(naive_cross_entropy, hidden, weight, labels, grad, z_loss_coeff=z_loss)
    ref, rh, rw = values_and_grads(reference, hidden, weight, labels, grad, z_loss=z_loss)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh.double(), rh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-6, atol=1e-6)


def test_default_tiling():
    assert default_tiling(131072) == (1024, 8192)
    assert default_tiling(512) == (16384, 512)
    assert default_tiling(131072, chunk_size=64) == (64, 131072)
    assert default_tiling(131072, vocab_chunk_size=32768) == (256, 32768)
    assert default_tiling(100, chunk_size=3, vocab_chunk_size=1000) == (3, 100)


class LargestTensor(TorchDispatchMode):
    """Records the largest numel of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk,vchunk", [(16, None), (32, 128)])
def test_never_materializes_full_logits(chunk, vchunk):
    tokens, vocab, hsize = 256, 512, 8
    hidden, weight, labels, grad = make(tokens, vocab, hsize, ignore_every=7)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with LargestTensor() as mode:
        chunked_cross_entropy(h, w, labels, chunk_size=chunk, vocab_chunk_size=vchunk).backward(grad.float())
    tile = chunk * (vchunk or vocab)
    assert mode.largest <= max(tile, vocab * hsize, tokens * hsize) < tokens * vocab // 8
    # the naive version does allocate [T, V]: the probe sees it
    with LargestTensor() as mode:
        naive_cross_entropy(hidden, weight, labels).backward(grad.float())
    assert mode.largest >= tokens * vocab


GOOD = make(6, 10, 4)


def _bad(**changes):
    hidden, weight, labels, _ = GOOD
    args = {"hidden": hidden, "weight": weight, "labels": labels, **changes}
    return args


BAD_INPUTS = [
    (_bad(hidden=torch.zeros(6)), ValueError, "hidden"),
    (_bad(hidden=torch.zeros(6, 4, dtype=torch.long)), ValueError, "hidden"),
    (_bad(weight=torch.zeros(10, 5)), ValueError, "weight hidden size"),
    (_bad(weight=torch.zeros(10)), ValueError, "weight"),
    (_bad(weight=torch.zeros(0, 4)), ValueError, "weight"),
    (_bad(labels=torch.zeros(5, dtype=torch.long)), ValueError, "labels shape"),
    (_bad(hidden=torch.zeros(2, 3, 4)), ValueError, "labels shape"),
    (_bad(labels=torch.zeros(6)), TypeError, "labels must be an integer"),
    (_bad(labels=torch.zeros(6, dtype=torch.bool)), TypeError, "labels must be an integer"),
    (_bad(labels=torch.tensor([0, 1, 10, 2, 3, 4])), ValueError, r"labels\[2\] = 10"),
    (_bad(labels=torch.tensor([0, 1, 2, -1, 3, 4])), ValueError, r"labels\[3\] = -1"),
    (_bad(chunk_size=0), ValueError, "chunk_size"),
    (_bad(chunk_size=-3), ValueError, "chunk_size"),
    (_bad(vocab_chunk_size=0), ValueError, "vocab_chunk_size"),
    (_bad(z_loss_coeff=-0.1), ValueError, "z_loss_coeff"),
    (_bad(z_loss_coeff=float("nan")), ValueError, "z_loss_coeff"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_INPUTS)
def test_bad_input_names_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        chunked_cross_entropy(**kwargs)


def test_bad_input_in_naive_reference():
    hidden, weight, labels, _ = GOOD
    with pytest.raises(ValueError, match="weight hidden size"):
        naive_cross_entropy(hidden, weight[:, :3], labels)


@pytest.mark.slow
def test_vocab_parallel_matches_full_vocabulary_on_gloo_ranks():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _dist_workers import vocab_parallel_ce

    from lossparity.distributed.launch import spawn

    out = spawn(vocab_parallel_ce, 2, timeout_s=60)
    hidden, weight, labels, upstream, _, _ = out[0][3]
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logits = h @ w.T
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != -100
    ref = torch.where(
        valid, lse - logits.gather(1, labels.clamp(min=0)[:, None])[:, 0] + 1e-2 * lse**2, torch.zeros_like(lse)
    )
    (ref * upstream).sum().backward()
    for loss, gh, gw, (_, _, _, _, lo, rows) in out:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)  # identical on every rank
        torch.testing.assert_close(gh, h.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, w.grad[lo : lo + rows], rtol=1e-12, atol=1e-12)
