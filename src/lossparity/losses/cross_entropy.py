"""Memory-lean output-layer cross-entropy: per-token losses without materializing ``[T, V]`` logits.

For hidden states ``h [T, H]``, output weight ``W [V, H]`` and labels ``y [T]`` the per-token loss is

    l[t] = lse[t] - z[t, y[t]] + λz · lse[t]²,   z = h @ W.T,   lse[t] = logsumexp_v z[t, v]

(semantics §1: the optional z-loss is part of ``l``), and ``l[t] = 0`` where ``y[t] == ignore_index``.

:func:`chunked_cross_entropy` computes it tile by tile: a tile is ``chunk_size`` tokens ×
``vocab_chunk_size`` vocabulary rows (default ~8 Mi logits, see :func:`default_tiling`). The forward
keeps an online (streaming) logsumexp across vocabulary tiles and saves only ``h``, ``W``, the labels
and ``lse``; the backward recomputes each tile's logits and turns them into probabilities with the
saved ``lse``. With ``g[t]`` the incoming per-token gradient and
``P = softmax(z)``,

    dl[t]/dz[t, v] = (1 + 2 λz lse[t]) · P[t, v] - [v == y[t]]
    dh = diag(g·(1 + 2 λz lse)) · (P @ W) - g ⊙ W[y]
    dW = P.T @ (diag(g·(1 + 2 λz lse)) · h) - Σ_t g[t] · e_{y[t]} h[t]ᵀ

so the per-token scale and the one-hot term are applied to ``[c, H]`` operands, never to a logits tile:
a tile only sees one matmul, ``z -= lse``, ``exp_`` and the two gradient matmuls. Ignored tokens are
dropped before any tile is formed, so masked prompt tokens cost nothing.

Cost: 4 ``T·V·H`` matmuls per forward+backward (the forward's logits are recomputed in the backward)
against 3 for the naive version; in exchange the peak extra memory is one tile plus ``[V, H]`` (the
weight gradient) instead of several ``[T, V]`` tensors. bf16/fp16 inputs are computed in float32 (the
weight is upcast once per call); float64 inputs are computed in float64.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_int, check_real, check_tensor

__all__ = ["chunked_cross_entropy", "naive_cross_entropy", "check_label_values", "default_tiling"]

# A logits tile holds about TILE_ELEMS values (32 MiB in float32). Measured on a 2-core AVX-512 CPU: a
# 32 MiB tile mostly stays in the last-level cache, so the elementwise passes over it (max, exp, sum) run
# several times faster than over a tile 4x larger, and near-square tiles (1024 tokens x 8192 vocabulary
# rows) keep the three matmuls at full BLAS speed, where a thin full-vocabulary tile (64 tokens x 131072)
# loses ~30% on the logits matmul. On a GPU any tile of this size saturates the matmuls.
TILE_ELEMS = 8 * 2**20
TILE_VOCAB = 8192


def default_tiling(
    vocab_size: int, chunk_size: int | None = None, vocab_chunk_size: int | None = None
) -> tuple[int, int]:
    """Return the ``(chunk_size, vocab_chunk_size)`` tile used by :func:`chunked_cross_entropy`. A value
    given by the caller is kept (the vocabulary tile capped at ``vocab_size``); a missing one is chosen
    so that a tile holds about ``TILE_ELEMS = 8 Mi`` logits (32 MiB in float32): with neither given,
    ``vocab_chunk = min(V, 8192)`` and ``chunk = TILE_ELEMS // vocab_chunk`` (1024 tokens for
    ``V >= 8192``); with only one given, the other is ``max(1, TILE_ELEMS // given)``."""
    check_int("vocab_size", vocab_size, minimum=1)
    check_int("chunk_size", chunk_size, minimum=1, optional=True)
    check_int("vocab_chunk_size", vocab_chunk_size, minimum=1, optional=True)
    if vocab_chunk_size is None:
        vocab_chunk_size = TILE_VOCAB if chunk_size is None else max(1, TILE_ELEMS // chunk_size)
    vocab_chunk_size = min(vocab_chunk_size, vocab_size)
    if chunk_size is None:
        chunk_size = max(1, TILE_ELEMS // vocab_chunk_size)
    return chunk_size, vocab_chunk_size


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32


def _check_inputs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int,
    chunk_size: int | None,
    z_loss_coeff: float,
    vocab_chunk_size: int | None,
    vocab_size: int | None = None,
) -> None:
    """Argument checks of the cross-entropy functions: kinds and shapes first (no host synchronization);
    the labels' range is a value check (one host synchronization, before any tile is formed)."""
    check_tensor("hidden", hidden, shape_text="[T, H] or [B, S, H]")
    check_tensor("weight", weight, shape_text="[V, H]")
    check_tensor("labels", labels, shape_text="[T] or [B, S]")
    check_int("ignore_index", ignore_index)
    check_int("chunk_size", chunk_size, minimum=1, optional=True)
    check_int("vocab_chunk_size", vocab_chunk_size, minimum=1, optional=True)
    check_real("z_loss_coeff", z_loss_coeff, minimum=0)
    check_int("vocab_size", vocab_size, minimum=1, optional=True)
    if not hidden.is_floating_point() or hidden.dim() not in (2, 3):
        raise ValueError(
            f"hidden must be a floating-point [T, H] or [B, S, H] tensor, got {hidden.dtype} "
            f"of shape {tuple(hidden.shape)}"
        )
    if not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError(
            f"weight must be a floating-point [V, H] tensor, got {weight.dtype} of shape {tuple(weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight hidden size {weight.shape[1]} (weight shape {tuple(weight.shape)}) does not match "
            f"hidden size {hidden.shape[-1]} (hidden shape {tuple(hidden.shape)})"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match the tokens of hidden "
            f"{tuple(hidden.shape)} (expected labels shape {tuple(hidden.shape[:-1])})"
        )
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(
            f"hidden, weight and labels must be on one device, got hidden on {hidden.device}, "
            f"weight on {weight.device}, labels on {labels.device}"
        )


def check_label_values(labels: Tensor, vocab_size: int, ignore_index: int = -100) -> None:
    """``ValueError`` naming the first label outside ``[0, vocab_size)`` that is not ``ignore_index``.

    Reads one bool (and, on failure, the position) to the host: a synchronization on an accelerator. The
    cross-entropy functions call it unless ``trusted_labels=True``; a training loop calls it once per step on
    the host-side batch, before the transfer, and passes ``trusted_labels=True`` per microbatch."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"labels{list(pos)} = {int(labels[pos])}"
        )


def _tiles(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _rows(hidden: Tensor, idx: Tensor | None, start: int, end: int) -> Tensor:
    return hidden[start:end] if idx is None else hidden.index_select(0, idx[start:end])


def _tile_view(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous ``[rows, cols]`` view of the front of a flat buffer (``mm(out=)`` needs contiguous)."""
    return buf[: rows * cols].view(rows, cols)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Autograd Function over the non-ignored tokens. ``idx`` (or None when every token counts) maps
    them back to rows of ``hidden``; all per-token tensors below are over those tokens only."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        idx: Tensor | None,
        chunk: int,
        vchunk: int,
        z_coeff: float,
        group: object | None = None,
        vstart: int = 0,
    ) -> Tensor:
        cdt = _compute_dtype(hidden, weight)
        w = weight.to(cdt)
        n, vocab = labels.shape[0], w.shape[0]
        # Vocabulary parallel: this rank holds rows [vstart, vstart + vocab) of the output weight; the
        # labels are shifted into local row numbers (out-of-range ones match no tile and add 0).
        labels_local = labels - vstart if group is not None else labels
        lse = torch.empty(n, dtype=cdt, device=hidden.device)
        target = torch.empty_like(lse)
        buf = torch.empty(min(chunk, n) * min(vchunk, vocab), dtype=cdt, device=hidden.device)
        for t0, t1 in _tiles(n, chunk):
            h = _rows(hidden, idx, t0, t1).to(cdt)
            y = labels_local[t0:t1]
            run_max = torch.full((t1 - t0,), -math.inf, dtype=cdt, device=hidden.device)
            run_sum = torch.zeros_like(run_max)
            tgt = torch.zeros_like(run_max)
            for v0, v1 in _tiles(vocab, vchunk):
                z = torch.mm(h, w[v0:v1].t(), out=_tile_view(buf, t1 - t0, v1 - v0))
                in_tile = (y >= v0) & (y < v1)
                picked = z.gather(1, (y - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
                tgt += picked.where(in_tile, 0.0)
                new_max = torch.maximum(run_max, z.amax(1))
                # online logsumexp: rescale the running sum to the new max (exp(-inf) = 0 on the first tile)
                run_sum.mul_((run_max - new_max).exp_())
                run_sum += z.sub_(new_max.unsqueeze(1)).exp_().sum(1)
                run_max = new_max
            lse[t0:t1] = run_sum.log_().add_(run_max)
            target[t0:t1] = tgt
        if group is not None:
            # Combine the ranks' partial logsumexps (max, then sum of rescaled exps) and target logits.
            m = lse.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            total = (lse - m).exp_()
            dist.all_reduce(total, group=group)
            lse = total.log_().add_(m)
            dist.all_reduce(target, group=group)
        loss = lse - target
        if z_coeff:
            loss += z_coeff * lse.square()
        ctx.save_for_backward(hidden, weight, labels_local, idx, lse)
        ctx.tiling = (chunk, vchunk, z_coeff)
        ctx.group = group
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, labels, idx, lse = ctx.saved_tensors
        chunk, vchunk, z_coeff = ctx.tiling
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cdt = lse.dtype
        w = weight.to(cdt)
        n, vocab, hsize = labels.shape[0], w.shape[0], w.shape[1]
        g = grad_loss.to(cdt)
        scale = g * (1.0 + 2.0 * z_coeff * lse) if z_coeff else g
        # rows of ignored tokens are never written: they must start at zero
        grad_h = (torch.empty_like if idx is None else torch.zeros_like)(hidden) if need_h else None
        grad_w = torch.zeros(vocab, hsize, dtype=cdt, device=w.device) if need_w else None
        buf = torch.empty(min(chunk, n) * min(vchunk, vocab), dtype=cdt, device=w.device)
        for t0, t1 in _tiles(n, chunk):
            h = _rows(hidden, idx, t0, t1).to(cdt)
            y, g_c = labels[t0:t1], g[t0:t1].unsqueeze(1)
            h_scaled = h * scale[t0:t1].unsqueeze(1) if need_w else None
            pw = torch.zeros(t1 - t0, hsize, dtype=cdt, device=w.device) if need_h else None
            for v0, v1 in _tiles(vocab, vchunk):
                z = torch.mm(h, w[v0:v1].t(), out=_tile_view(buf, t1 - t0, v1 - v0))
                p = z.sub_(lse[t0:t1].unsqueeze(1)).exp_()
                if pw is not None:  # need_h
                    pw.addmm_(p, w[v0:v1])
                if grad_w is not None and h_scaled is not None:  # need_w
                    grad_w[v0:v1].addmm_(p.t(), h_scaled)
            owned = (y >= 0) & (y < vocab)
            y_own = y.clamp(0, vocab - 1)
            g_own = g_c * owned.unsqueeze(1).to(cdt)
            if pw is not None and grad_h is not None:  # need_h
                dh = pw.mul_(scale[t0:t1].unsqueeze(1)).sub_(w.index_select(0, y_own) * g_own)
                if idx is None:
                    grad_h[t0:t1] = dh
                else:
                    grad_h.index_copy_(0, idx[t0:t1], dh.to(grad_h.dtype))
            if grad_w is not None:  # need_w
                # index_put_ rather than index_add_: the latter is ~10x slower on CPU (torch 2.x)
                grad_w.index_put_((y_own,), h * -g_own, accumulate=True)
        if grad_w is not None:  # need_w
            grad_w = grad_w.to(weight.dtype)
        if need_h and ctx.group is not None:
            # hidden is replicated over the vocabulary-parallel ranks, each saw only its vocabulary slice
            dist.all_reduce(grad_h, group=ctx.group)
        return grad_h, grad_w, None, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    z_loss_coeff: float = 0.0,
    vocab_chunk_size: int | None = None,
    vocab_parallel_group: object | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    trusted_labels: bool = False,
) -> Tensor:
    """Per-token cross-entropy of the output layer, ``l[t] = logsumexp(z[t]) - z[t, y[t]] + z_loss_coeff ·
    logsumexp(z[t])²`` with ``z = hidden @ weight.T``, and ``l[t] = 0`` where ``labels[t] == ignore_index``,
    computed without ever materializing the ``[T, V]`` logits (forward or backward). ``hidden`` is
    ``[T, H]`` with ``labels [T]`` (returns ``[T]``) or ``[B, S, H]`` with ``labels [B, S]`` (returns
    ``[B, S]``); ``weight`` is ``[V, H]``. The logits are formed in tiles of ``chunk_size`` tokens ×
    ``vocab_chunk_size`` vocabulary rows with a streaming logsumexp over the vocabulary tiles; a missing
    size is chosen by :func:`default_tiling` (tiles of ~8 Mi logits; pass ``vocab_chunk_size >= V`` to
    chunk over tokens only). Differentiable w.r.t. ``hidden`` and ``weight`` for any per-token incoming
    gradient. Losses are float32 for float32/bf16/fp16 inputs (float64 if an input is float64);
    gradients have the dtype of their input. Vocabulary parallel (tensor-parallel output head): with
    ``vocab_parallel_group``, ``weight`` holds rows ``[vocab_start, vocab_start + V_local)`` of the
    ``vocab_size``-row head on this rank; the partial logsumexps and target logits are combined over the
    group (three all-reduces of ``[T]``), so every rank returns the same per-token losses, and the
    gradient of the replicated ``hidden`` is summed over the group.

    Host reads: by default the labels' range is checked (:func:`check_label_values`) and the ignored
    positions are left out of the matmuls, which reads the device once per call (a synchronization on an
    accelerator). ``trusted_labels=True`` (labels validated before the transfer, e.g. once per step on
    the host-side batch) reads nothing: the ignored positions are computed with label 0 and their losses
    zeroed (their gradient is zero), at the cost of their matmul work.
    """
    if vocab_parallel_group is not None and vocab_size is None:
        raise ValueError("vocab_parallel_group needs vocab_size (the rows of the whole output head)")
    check_int("vocab_start", vocab_start, minimum=0)
    _check_inputs(hidden, weight, labels, ignore_index, chunk_size, z_loss_coeff, vocab_chunk_size, vocab_size)
    out_shape = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    chunk, vchunk = default_tiling(weight.shape[0], chunk_size, vocab_chunk_size)
    if not trusted_labels:
        check_label_values(labels, weight.shape[0] if vocab_size is None else vocab_size, ignore_index)
    valid = flat != ignore_index
    if trusted_labels:  # no host read: ignored positions are computed with label 0, then zeroed
        loss = _ChunkedCrossEntropy.apply(
            hidden2d,
            weight,
            torch.where(valid, flat, 0).long(),
            None,
            chunk,
            vchunk,
            float(z_loss_coeff),
            vocab_parallel_group,
            vocab_start,
        )
        return torch.where(valid, loss, torch.zeros_like(loss)).view(out_shape)
    if bool(valid.all()):
        return _ChunkedCrossEntropy.apply(
            hidden2d, weight, flat.long(), None, chunk, vchunk, float(z_loss_coeff), vocab_parallel_group, vocab_start
        ).view(out_shape)
    idx = valid.nonzero().squeeze(1)
    loss = _ChunkedCrossEntropy.apply(
        hidden2d, weight, flat[idx].long(), idx, chunk, vchunk, float(z_loss_coeff), vocab_parallel_group, vocab_start
    )
    return loss.new_zeros(flat.shape[0]).index_copy(0, idx, loss).view(out_shape)


def naive_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    z_loss_coeff: float = 0.0,
) -> Tensor:
    """Reference per-token cross-entropy that materializes the logits: ``z = hidden @ weight.T`` (in
    float32 for bf16/fp16 inputs), ``l = F.cross_entropy(z, labels, reduction='none') + z_loss_coeff ·
    logsumexp(z)²`` and 0 where ``labels == ignore_index``. Same shapes and semantics as
    :func:`chunked_cross_entropy`; it is the baseline of the benchmark and costs several ``[T, V]``
    tensors of memory.
    """
    _check_inputs(hidden, weight, labels, ignore_index, None, z_loss_coeff, None)
    cdt = _compute_dtype(hidden, weight)
    logits = hidden.reshape(-1, hidden.shape[-1]).to(cdt) @ weight.to(cdt).t()
    flat = labels.reshape(-1).long()
    loss = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="none")
    if z_loss_coeff:
        loss = loss + z_loss_coeff * torch.logsumexp(logits, dim=-1).square() * (flat != ignore_index)
    return loss.view(labels.shape)
