"""Fused linear cross-entropy against a naive float64 autograd formula (semantics §1 z-loss, §7)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossparity.losses.fused_cross_entropy import fused_linear_cross_entropy, fused_tiling

IGNORE = -100


def reference(hidden, weight, labels, weights, z_loss=0.0, upstream=1.0):
    """``J = Σ w·l`` with ``l = lse - z[y] + λ lse²`` (0 at ignored labels) by plain float64 autograd;
    returns ``(J, l, upstream·∂J/∂h, upstream·∂J/∂W)``."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1]).requires_grad_()
    w = weight.detach().double().requires_grad_()
    y = labels.reshape(-1)
    keep = y != IGNORE
    z = h @ w.t()
    lse = torch.logsumexp(z, dim=1)
    picked = z.gather(1, torch.where(keep, y, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(keep, lse - picked + z_loss * lse**2, torch.zeros_like(lse))
    total = (weights.reshape(-1).double() * loss).sum()
    (upstream * total).backward()
    return total.detach(), loss.detach().reshape(labels.shape), h.grad.reshape(hidden.shape), w.grad


def make(tokens, vocab, hsize, seed=0, ignore_every=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hsize, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, hsize, generator=gen, dtype=torch.float64) * hsize**-0.5
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    # ragged per-token weights: signs, zeros, sizes over two orders of magnitude
    weights = torch.randn(tokens, generator=gen, dtype=torch.float64) * torch.logspace(
        -1, 1, tokens, dtype=torch.float64
    )
    weights[1::5] = 0.0
    return hidden, weight, labels, weights


def run(hidden, weight, labels, weights, upstream=1.0, **kwargs):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    total, loss = fused_linear_cross_entropy(h, w, labels, weights, **kwargs)
    (upstream * total).backward()
    return total.detach(), loss, h.grad, w.grad


# (T, V, chunk, vchunk): tiles dividing neither T nor V, 1x1 tiles, one tile, shape-chosen tiles
TILINGS = [(37, 53, 7, 10), (37, 53, 1, 1), (37, 53, 64, 64), (37, 53, None, None), (37, 53, 5, 9), (40, 50, 8, 25)]


@pytest.mark.parametrize("tokens,vocab,chunk,vchunk", TILINGS)
@pytest.mark.parametrize("z_loss", [0.0, 0.3])
@pytest.mark.parametrize("ignore_every", [0, 3])
def test_float64_values_and_grads_match_naive_formula(tokens, vocab, chunk, vchunk, z_loss, ignore_every):
    hidden, weight, labels, weights = make(tokens, vocab, 16, ignore_every=ignore_every)
    got = run(
        hidden, weight, labels, weights, upstream=2.5, z_loss_coeff=z_loss, chunk_size=chunk, vocab_chunk_size=vchunk
    )
    ref = reference(hidden, weight, labels, weights, z_loss, upstream=2.5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hand_worked_example():
    # h = [1, 0], W rows e0, e1, -e0 -> z = [1, 0, -1], lse = log(e + 1 + 1/e); token weights 0.5 and 2
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 2])
    lse = torch.log(torch.tensor(torch.e + 1 + 1 / torch.e, dtype=torch.float64))
    total, loss, gh, _ = run(hidden, weight, labels, torch.tensor([0.5, 2.0], dtype=torch.float64))
    torch.testing.assert_close(loss, torch.stack([lse - 1, lse + 1]))
    torch.testing.assert_close(total, 0.5 * (lse - 1) + 2.0 * (lse + 1))
    # dJ/dh_0 = 0.5·(Σ_v p_v W_v - W_0), p = softmax(z); Σ_v p_v W_v = [(e - 1/e), 1] / (e + 1 + 1/e)
    pw = torch.tensor([torch.e - 1 / torch.e, 1.0], dtype=torch.float64) / lse.exp()
    torch.testing.assert_close(gh[0], 0.5 * (pw - torch.tensor([1.0, 0.0], dtype=torch.float64)))


def test_batched_input_and_weights_shape():
    hidden, weight, labels, weights = make(24, 19, 8, ignore_every=4)
    got = run(hidden.view(4, 6, 8), weight, labels.view(4, 6), weights.view(4, 6), chunk_size=5)
    ref = reference(hidden, weight, labels, weights)
    assert got[1].shape == (4, 6) and got[2].shape == (4, 6, 8)
    torch.testing.assert_close(got[1].reshape(-1), ref[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[2].reshape(24, 8), ref[2], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[3], ref[3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtype_rules(dtype):
    hidden, weight, labels, weights = make(33, 40, 8, ignore_every=5)
    h, w = hidden.to(dtype), weight.to(dtype)
    total, loss, gh, gw = run(h, w, labels, weights.float(), chunk_size=8, vocab_chunk_size=16)
    assert total.dtype == loss.dtype == torch.float32  # losses in float32 whatever the input precision
    assert gh.dtype == gw.dtype == dtype  # gradients in their input's dtype
    ref = reference(h, w, labels, weights)  # the same rounded inputs, computed in float64
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.double(), ref[1], rtol=1e-5, atol=1e-5)  # computed in float32
    torch.testing.assert_close(gh.double(), ref[2], rtol=tol, atol=tol)
    torch.testing.assert_close(gw.double(), ref[3], rtol=tol, atol=tol)


def test_autocast_does_not_lower_the_precision():
    hidden, weight, labels, weights = make(20, 30, 8)
    plain = run(hidden.float(), weight.float(), labels, weights.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = run(hidden.float(), weight.float(), labels, weights.float())
    assert cast[0].dtype == torch.float32
    for a, b in zip(plain, cast):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_second_backward_raises_and_first_backward_releases_the_buffers():
    hidden, weight, labels, weights = make(12, 10, 4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total, _ = fused_linear_cross_entropy(h, w, labels, weights)
    total.backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError, match="handed out by an earlier backward"):
        total.backward()
    torch.testing.assert_close(h.grad, first)  # the failed second backward added nothing


def test_gradients_accumulate_over_calls_like_autograd():
    hidden, weight, labels, weights = make(12, 10, 4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for _ in range(2):
        fused_linear_cross_entropy(h, w, labels, weights)[0].backward()
    ref = reference(hidden, weight, labels, weights, upstream=2.0)
    torch.testing.assert_close(h.grad, ref[2], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, ref[3], rtol=1e-12, atol=1e-12)


def test_no_grad_and_partial_requires_grad():
    hidden, weight, labels, weights = make(12, 10, 4, ignore_every=4)
    ref = reference(hidden, weight, labels, weights)
    with torch.no_grad():
        total, loss = fused_linear_cross_entropy(hidden.requires_grad_(), weight, labels, weights)
    assert not total.requires_grad
    torch.testing.assert_close(total, ref[0], rtol=1e-12, atol=1e-12)
    hidden.requires_grad_(False)
    w = weight.clone().requires_grad_()
    fused_linear_cross_entropy(hidden, w, labels, weights)[0].backward()
    torch.testing.assert_close(w.grad, ref[3], rtol=1e-12, atol=1e-12)


def test_all_ignored_gives_zero_and_zero_gradients():
    hidden, weight, _, weights = make(6, 10, 4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total, loss = fused_linear_cross_entropy(h, w, torch.full((6,), IGNORE), weights)
    total.backward()
    assert float(total.detach()) == 0.0 and not loss.any() and not h.grad.any() and not w.grad.any()


def test_per_token_loss_is_detached_and_matches():
    hidden, weight, labels, weights = make(12, 10, 4, ignore_every=3)
    h = hidden.clone().requires_grad_()
    total, loss = fused_linear_cross_entropy(h, weight, labels, weights)
    assert total.requires_grad and not loss.requires_grad
    assert (loss[labels == IGNORE] == 0).all()


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materializes_full_logits():
    tokens, vocab, hsize, chunk = 256, 512, 8, 16
    hidden, weight, labels, weights = make(tokens, vocab, hsize, ignore_every=7)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with LargestTensor() as mode:
        fused_linear_cross_entropy(h, w, labels, weights, chunk_size=chunk)[0].backward()
    assert mode.largest <= max(chunk * vocab, vocab * hsize, tokens * hsize) < tokens * vocab // 8


def test_tiling_is_chosen_from_shapes():
    # token tile: H/2 rounded down to a power of two, at least 64, at most T; vocabulary sub-tile:
    # a multiple of 128 filling about the L2 cache, at most V; a GPU takes the whole vocabulary
    c, v = fused_tiling(8192, 32768, 512)
    assert c == 256 and v % 128 == 0 and 128 <= v <= 32768
    assert fused_tiling(8192, 32768, 256)[0] == 128
    assert fused_tiling(8192, 32768, 64)[0] == 64
    assert fused_tiling(8192, 131072, 4096)[0] == 2048
    assert fused_tiling(100, 32768, 512)[0] == 100
    assert fused_tiling(8192, 32768, 512, device_type="cuda")[1] == 32768
    assert fused_tiling(8192, 500, 512, chunk_size=10, vocab_chunk_size=9999) == (10, 500)


GOOD = make(6, 10, 4)


def _bad(**changes):
    hidden, weight, labels, weights = GOOD
    return {"hidden": hidden, "weight": weight, "labels": labels, "token_weights": weights, **changes}


BAD_INPUTS = [
    (_bad(token_weights=torch.ones(5, dtype=torch.float64)), ValueError, "token_weights shape"),
    (_bad(token_weights=torch.ones(6, dtype=torch.long)), TypeError, "token_weights must be a floating"),
    (_bad(token_weights=[1.0] * 6), TypeError, "token_weights must be a floating"),
    (_bad(weight=torch.zeros(10, 5)), ValueError, "weight hidden size"),
    (_bad(labels=torch.tensor([0, 1, 10, 2, 3, 4])), ValueError, r"labels\[2\] = 10"),
    (_bad(labels=torch.zeros(6)), TypeError, "labels must be an integer"),
    (_bad(chunk_size=0), ValueError, "chunk_size"),
    (_bad(vocab_chunk_size=-1), ValueError, "vocab_chunk_size"),
    (_bad(z_loss_coeff=-0.1), ValueError, "z_loss_coeff"),
    (_bad(vocab_parallel_group=object()), ValueError, "vocab_size"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_INPUTS)
def test_bad_input_names_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fused_linear_cross_entropy(**kwargs)


def test_exported_from_package():
    import lossparity

    assert lossparity.fused_linear_cross_entropy is fused_linear_cross_entropy


@pytest.mark.slow
@pytest.mark.parametrize("z_loss", [0.0, 0.05])
def test_vocab_parallel_matches_full_vocabulary_on_gloo_ranks(z_loss):
    sys.path.insert(0, str(Path(__file__).parent))
    from _fused_workers import vocab_parallel_fused

    from lossparity.distributed.launch import spawn

    out = spawn(vocab_parallel_fused, 3, z_loss, timeout_s=120)
    hidden, weight, labels, weights = out[0][4]
    ref = reference(hidden, weight, labels, weights, z_loss, upstream=3.0)
    for total, loss, gh, gw, _, (lo, rows) in out:  # identical J, losses and grad_h on every rank
        torch.testing.assert_close(total, ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(loss, ref[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gh, ref[2], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, ref[3][lo : lo + rows], rtol=1e-12, atol=1e-12)
