"""Fused linear cross-entropy: the weighted loss of the output layer with its gradients formed in the forward.

For hidden states ``h [T, H]``, output weight ``W [V, H]``, labels ``y [T]`` and per-token objective
weights ``w [T]`` known before the forward (pre-counted normalizers make them known for every mode,
docs/semantics.md §1, §3), :func:`fused_linear_cross_entropy` returns

    J = Σ_t w[t] · l[t],   l[t] = lse[t] - z[t, y[t]] + λz · lse[t]²,   z = h @ W.T

(``l[t] = 0`` where ``y[t] == ignore_index``) together with the detached per-token losses ``l`` (for the
log channel). Since ``J`` is linear in the losses with known coefficients, its gradients

    s[t]   = w[t] · (1 + 2 λz lse[t]),      P = softmax(z)
    ∂J/∂h  = diag(s) · (P @ W) - diag(w) · W[y]
    ∂J/∂W  = P.T @ (diag(s) · h) - Σ_t w[t] · e_{y[t]} h[t]ᵀ

are computed tile by tile *during the forward*: three ``T·V·H`` matmuls in all (logits, ``P @ W``,
``P.T @ h``), no ``[T, V]`` buffer and no recompute. The backward only multiplies the stored gradients
by the incoming scalar gradient.

One token tile (``c`` tokens × the whole vocabulary, in vocabulary sub-tiles of ``v`` rows sized to
stay in cache) is processed as follows. Pass 1, per sub-tile: logits ``z = h_c @ W_vᵀ``, the
running max ``m`` of each token, ``E_v = exp(z - m)`` in place, the running sum of exponentials, and
``acc += E_v @ W_v`` after rescaling ``acc`` by ``exp(m_old - m_new)`` (online softmax applied to the
accumulated ``P @ W``); the max used for ``E_v`` is kept per sub-tile. Once the tile's ``lse`` is known,
pass 2 forms ``∂J/∂W[v] += E_vᵀ @ (diag(s · exp(m_v - lse)) · h_c)``: the per-token correction from
the sub-tile's max to the final ``lse`` is applied to the ``[c, H]`` operand, never to a logits tile,
so pass 2 is one matmul per sub-tile. Under vocabulary (tensor) parallelism each rank holds rows
``[vstart, vstart + V_local)``: the tile's local ``(max, sum of exponentials, target logit)`` are
all-gathered over the group between the passes (one collective of ``3c`` numbers per token tile), every
rank forms the global ``lse`` and its own rows' ``∂J/∂W``, and ``∂J/∂h`` (partial on each rank) is
summed over the group once at the end of the forward.

Dtypes follow :func:`~lossparity.losses.cross_entropy.chunked_cross_entropy`: bf16/fp16/fp32 inputs
are computed in float32 (weighted sum and per-token losses in float32), float64 inputs in float64;
the gradients have the dtype of their input. Autocast is switched off inside.

Backward behaviour: the gradients are handed out once. The first backward scales the stored buffers
in place (no second ``[V, H]`` copy) and releases them; a second backward through the same call (with
``retain_graph=True``) raises ``RuntimeError``; call the function again instead. ``create_graph``
(double backward) is not supported. Under ``torch.no_grad()`` or when neither ``hidden`` nor
``weight`` requires grad, no gradient is computed (one matmul per tile).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ._checks import check_float_tensor, check_int
from .cross_entropy import _check_inputs, _compute_dtype, check_label_values

__all__ = ["fused_linear_cross_entropy", "fused_tiling"]

# The token tile's logits buffer holds at most this fraction of the weight gradient's size, so that the
# peak extra memory stays within a constant factor of the floor grad_h + grad_W (see fused_tiling).
TILE_FRACTION_OF_GRAD_W = 0.5
MIN_TILE_TOKENS = 64  # below this, the P.T @ h matmul (inner size = tokens) loses most of its BLAS speed
DEFAULT_CACHE_BYTES = 32 * 2**20
CACHE_SHARE = 4  # a sub-tile fills this fraction (1/4) of the last-level cache


@functools.lru_cache(maxsize=1)
def _cache_bytes() -> int:
    """Size of the last-level CPU cache (Linux sysfs: the highest cache level of cpu0), else 32 MiB."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    best = (0, 0)
    try:
        for entry in sorted(os.listdir(base)):
            with open(os.path.join(base, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
            best = max(best, (level, size))
    except (OSError, ValueError, IndexError):
        return DEFAULT_CACHE_BYTES
    return best[1] or DEFAULT_CACHE_BYTES


def fused_tiling(
    tokens: int,
    vocab: int,
    hidden_size: int,
    *,
    itemsize: int = 4,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    device_type: str = "cpu",
) -> tuple[int, int]:
    """``(chunk_size, vocab_chunk_size)`` of :func:`fused_linear_cross_entropy`, chosen from the shapes.

    Token tile ``c``: the ``[c, V]`` exponentials of a tile are kept until its ``lse`` is known, so
    ``c·V`` is bounded by ``TILE_FRACTION_OF_GRAD_W · V·H`` (the tile never costs more than half the
    weight gradient that must exist anyway): ``c = H / 2`` rounded down to a power of two, at least
    ``MIN_TILE_TOKENS`` (the ``Pᵀ @ h`` matmul needs a few dozen tokens of inner size), at most ``T``.
    Vocabulary sub-tile ``v``: on a CPU, ``c·v·itemsize`` fills a quarter of the last-level cache
    (sysfs; 32 MiB assumed if unknown) so that the elementwise passes after each logits matmul mostly
    hit the cache, while each op stays large enough to amortize the threads' synchronization (on a busy
    2-core machine, L2-sized sub-tiles of ~1 MiB made the two-thread run several times slower);
    ``v`` is a multiple of 128 and at most ``V``. On a GPU the whole vocabulary is one sub-tile. A
    value given by the caller is kept (capped at ``T`` and ``V``).
    """
    check_int("tokens", tokens, minimum=0)
    check_int("vocab", vocab, minimum=1)
    check_int("hidden_size", hidden_size, minimum=1)
    check_int("chunk_size", chunk_size, minimum=1, optional=True)
    check_int("vocab_chunk_size", vocab_chunk_size, minimum=1, optional=True)
    if chunk_size is None:
        limit = max(1, int(TILE_FRACTION_OF_GRAD_W * hidden_size))
        chunk_size = max(MIN_TILE_TOKENS, 1 << (limit.bit_length() - 1))
    chunk_size = max(1, min(chunk_size, tokens))
    if vocab_chunk_size is None:
        if device_type == "cpu":
            rows = _cache_bytes() // CACHE_SHARE // max(chunk_size * itemsize, 1)
            vocab_chunk_size = max(128, rows // 128 * 128)
        else:
            vocab_chunk_size = vocab
    return chunk_size, max(1, min(vocab_chunk_size, vocab))


def _tiles(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _combine_over_group(m: Tensor, s: Tensor, tgt: Tensor, group: ProcessGroup) -> tuple[Tensor, Tensor]:
    """Global ``(lse, target logit)`` of a token tile from every rank's local running max ``m``, sum of
    ``exp(z - m)`` ``s`` and target logit (0 where the rank does not own the label): one all-gather."""
    local = torch.stack([m, s, tgt])
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    ms, ss, ts = torch.stack(parts).unbind(1)  # each [ranks, c]
    top = ms.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = (ss * (ms - top).exp()).sum(0)
    return total.log() + top, ts.sum(0)


class _Tile:
    """Work buffers reused by every token tile of one call."""

    def __init__(
        self, chunk: int, vchunk: int, vocab: int, hsize: int, cdt: torch.dtype, dev: torch.device, need_h: bool
    ) -> None:
        self.subtiles = _tiles(vocab, vchunk)
        # sub-tile-major layout: sub-tile j of a c-token tile is a contiguous [c, v_j] view (mm out= needs it)
        self.buf = torch.empty(chunk * vocab, dtype=cdt, device=dev)
        self.sub_max = torch.empty(len(self.subtiles), chunk, dtype=cdt, device=dev)
        self.acc = torch.empty(chunk, hsize, dtype=cdt, device=dev) if need_h else None

    def view(self, c: int, v0: int, v1: int) -> Tensor:
        return self.buf[c * v0 : c * v1].view(c, v1 - v0)


def _pass1(h: Tensor, w: Tensor, y: Tensor, work: _Tile) -> tuple[Tensor, Tensor, Tensor]:
    """Logits, online max/sum of exponentials, target logit and ``acc = Σ_v exp(z - m) @ W_v`` of one token
    tile; the exponentials stay in ``work.buf``. Returns the running max, sum and target logit."""
    c = h.shape[0]
    m = torch.full((c,), -math.inf, dtype=h.dtype, device=h.device)
    s = torch.zeros_like(m)
    tgt = torch.zeros_like(m)
    acc = None if work.acc is None else work.acc[:c].zero_()
    for j, (v0, v1) in enumerate(work.subtiles):
        z = torch.mm(h, w[v0:v1].t(), out=work.view(c, v0, v1))
        in_tile = (y >= v0) & (y < v1)
        tgt += z.gather(1, (y - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1).where(in_tile, 0.0)
        new_m = torch.maximum(m, z.amax(1))
        alpha = (m - new_m).exp_()  # exp(-inf) = 0 on the first sub-tile
        s.mul_(alpha).add_(z.sub_(new_m.unsqueeze(1)).exp_().sum(1))
        if acc is not None:
            acc.mul_(alpha.unsqueeze(1)).addmm_(z, w[v0:v1])
        work.sub_max[j, :c] = new_m
        m = new_m
    return m, s, tgt


def _grad_w_tile(grad_w: Tensor, h: Tensor, scale: Tensor, lse: Tensor, work: _Tile) -> None:
    """Pass 2: ``grad_w[v] += E_vᵀ @ (diag(scale · exp(m_v - lse)) · h)`` for every sub-tile ``v``."""
    c = h.shape[0]
    for j, (v0, v1) in enumerate(work.subtiles):
        factor = (work.sub_max[j, :c] - lse).exp_().mul_(scale)
        grad_w[v0:v1].addmm_(work.view(c, v0, v1).t(), h * factor.unsqueeze(1))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Autograd Function over the non-ignored tokens (``idx`` maps them to rows of ``hidden``, None when
    every token counts). Returns ``(Σ w·l, l)``; the gradients are formed in the forward."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        tok_w: Tensor,
        idx: Tensor | None,
        tiling: tuple[int, int],
        z_coeff: float,
        need: tuple[bool, bool],
        group: ProcessGroup | None,
        vstart: int,
    ) -> tuple[Tensor, Tensor]:
        cdt = _compute_dtype(hidden, weight)
        w = weight.to(cdt)
        n, vocab, hsize, dev = labels.shape[0], w.shape[0], w.shape[1], hidden.device
        need_h, need_w = need
        chunk, vchunk = tiling
        y_all = labels - vstart if group is not None else labels  # local rows; others match no sub-tile
        tok_w = tok_w.to(cdt)
        loss = torch.empty(n, dtype=cdt, device=dev)
        dh = torch.empty(n, hsize, dtype=cdt if group is not None else hidden.dtype, device=dev) if need_h else None
        grad_w = torch.zeros(vocab, hsize, dtype=cdt, device=dev) if need_w else None
        work = _Tile(min(chunk, n), vchunk, vocab, hsize, cdt, dev, need_h)
        for t0, t1 in _tiles(n, chunk):
            h = (hidden[t0:t1] if idx is None else hidden.index_select(0, idx[t0:t1])).to(cdt)
            y, wt = y_all[t0:t1], tok_w[t0:t1]
            m, s, tgt = _pass1(h, w, y, work)
            lse, tgt = _combine_over_group(m, s, tgt, group) if group is not None else (s.log() + m, tgt)
            loss[t0:t1] = lse - tgt + z_coeff * lse.square() if z_coeff else lse - tgt
            scale = wt * (1.0 + 2.0 * z_coeff * lse) if z_coeff else wt
            owned = (y >= 0) & (y < vocab)
            y_own, w_own = y.clamp(0, vocab - 1), wt.where(owned, 0.0).unsqueeze(1)
            if grad_w is not None:  # need_w
                _grad_w_tile(grad_w, h, scale, lse, work)
                # index_put_ rather than index_add_: the latter is ~10x slower on CPU (torch 2.x)
                grad_w.index_put_((y_own,), h * -w_own, accumulate=True)
            if dh is not None:  # need_h (then the tile keeps its accumulator)
                assert work.acc is not None
                corr = (m - lse).exp_().mul_(scale).unsqueeze(1)
                dh[t0:t1] = work.acc[: t1 - t0].mul_(corr).sub_(w.index_select(0, y_own) * w_own)
        if dh is not None and group is not None:
            dist.all_reduce(dh, group=group)  # each rank saw only its vocabulary rows
        ctx.grads = (_scatter_rows(dh, idx, hidden), grad_w.to(weight.dtype) if grad_w is not None else None)
        ctx.mark_non_differentiable(loss)
        return (tok_w * loss).sum(), loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_sum: Tensor, _grad_loss: Tensor | None):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "fused_linear_cross_entropy: its gradients were handed out by an earlier backward (they are "
                "scaled in place and released); call fused_linear_cross_entropy again for a second backward"
            )
        ctx.grads = None
        gh, gw = (None if g is None else g.mul_(grad_sum) for g in grads)
        return gh, gw, None, None, None, None, None, None, None, None


def _scatter_rows(dh: Tensor | None, idx: Tensor | None, hidden: Tensor) -> Tensor | None:
    """``∂J/∂h`` over all rows of ``hidden`` in its dtype (rows of ignored tokens are zero)."""
    if dh is None:
        return None
    if idx is None:
        return dh.to(hidden.dtype)
    return torch.zeros_like(hidden).index_copy_(0, idx, dh.to(hidden.dtype))


def _check_weights(token_weights: Tensor, labels: Tensor) -> None:
    check_float_tensor("token_weights", token_weights)
    if tuple(token_weights.shape) != tuple(labels.shape):
        raise ValueError(
            f"token_weights shape {tuple(token_weights.shape)} does not match labels shape {tuple(labels.shape)}"
        )
    if token_weights.device != labels.device:
        raise ValueError(f"token_weights on {token_weights.device} but labels on {labels.device}")


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_weights: Tensor,
    *,
    ignore_index: int = -100,
    z_loss_coeff: float = 0.0,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    vocab_parallel_group: object | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    trusted_labels: bool = False,
) -> tuple[Tensor, Tensor]:
    """Weighted output-layer cross-entropy ``J = Σ_t w[t]·l[t]`` with ``l[t] = logsumexp(z[t]) - z[t, y[t]]
    + z_loss_coeff · logsumexp(z[t])²``, ``z = hidden @ weight.T``, ``l[t] = 0`` where ``labels[t] ==
    ignore_index``; returns ``(J, l.detach())``. The gradients of ``J`` w.r.t. ``hidden`` and ``weight``
    are computed tile by tile in the forward (3 matmuls, no ``[T, V]`` buffer; see the module docstring)
    and the backward scales them by the incoming gradient of ``J``. Exact for any per-token weights
    ``w = token_weights`` (e.g. ``Accountant.token_weights``, every mode).

    ``hidden`` is ``[T, H]`` or ``[B, S, H]``; ``labels`` and ``token_weights`` have its leading shape;
    ``weight`` is ``[V, H]``. Tiles: ``chunk_size`` tokens × ``vocab_chunk_size`` vocabulary rows per
    matmul, chosen by :func:`fused_tiling` when not given. Vocabulary parallel: with
    ``vocab_parallel_group``, ``weight`` holds rows ``[vocab_start, vocab_start + V_local)`` of the
    ``vocab_size``-row head; every rank returns the same ``J`` and ``l``, the full ``∂J/∂hidden``, and
    ``∂J/∂weight`` of its own rows (give every rank the same ``hidden``, labels and weights). Dtypes and
    backward behaviour: see the module docstring. Ignored positions cost no matmul work, except with
    ``trusted_labels=True``: then nothing is read to the host (no label range check, see
    :func:`~lossparity.losses.cross_entropy.check_label_values`; no compaction of the ignored positions,
    which are computed with label 0 and weight 0 and their losses zeroed), for a per-microbatch path whose
    labels were validated once per step before the transfer.
    """
    if vocab_parallel_group is not None and vocab_size is None:
        raise ValueError("vocab_parallel_group needs vocab_size (the rows of the whole output head)")
    check_int("vocab_start", vocab_start, minimum=0)
    _check_inputs(hidden, weight, labels, ignore_index, chunk_size, z_loss_coeff, vocab_chunk_size, vocab_size)
    _check_weights(token_weights, labels)
    out_shape = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    flat, tok_w = labels.reshape(-1).long(), token_weights.reshape(-1)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    cdt = _compute_dtype(hidden, weight)
    tiling = fused_tiling(
        flat.shape[0],
        weight.shape[0],
        weight.shape[1],
        itemsize=cdt.itemsize,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        device_type=hidden.device.type,
    )
    valid = flat != ignore_index
    if trusted_labels:  # no host read: ignored positions get label 0 and weight 0, their losses are zeroed
        idx = None
        flat, tok_w = torch.where(valid, flat, 0), torch.where(valid, tok_w, torch.zeros_like(tok_w))
    else:
        check_label_values(labels, weight.shape[0] if vocab_size is None else vocab_size, ignore_index)
        idx = None if bool(valid.all()) else valid.nonzero().squeeze(1)
    if idx is not None:
        flat, tok_w = flat[idx], tok_w[idx]
    if flat.numel() == 0:  # nothing to compute: J = 0, still connected to the inputs for backward
        zero = (hidden2d.sum() * 0 + weight.sum() * 0).to(cdt)
        return zero, torch.zeros(out_shape, dtype=cdt, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        total, loss = _FusedLinearCrossEntropy.apply(
            hidden2d, weight, flat, tok_w, idx, tiling, float(z_loss_coeff), need, vocab_parallel_group, vocab_start
        )
    if idx is not None:
        loss = loss.new_zeros(valid.shape[0]).index_copy(0, idx, loss)
    elif trusted_labels:
        loss = torch.where(valid, loss, torch.zeros_like(loss))
    return total, loss.view(out_shape)
