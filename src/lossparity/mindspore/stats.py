"""Per-token cross-entropy and the per-sample / per-document sums of semantics §0–§1, in MindSpore.

Only ``mindspore.ops`` functions that have CPU kernels in MindSpore 2.10 are used (several ``mint`` ops have
none there), so the same code runs on a CPU and on an accelerator.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

__all__ = ["token_nll", "sample_stats", "document_starts", "document_sums", "segment_ids_from_actual_seq_len"]


def _check_tensor(name: str, x: Any, dims: tuple[int, ...] | None = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a mindspore Tensor, got {type(x).__name__}")
    if dims is not None and x.ndim not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, got shape {tuple(x.shape)}")
    return x


def _same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{name_b} shape {tuple(b.shape)} does not match {name_a} shape {tuple(a.shape)}")


def token_nll(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token cross-entropy ``l_t = logsumexp(z_t) − z_t[y_t]`` in float32, shape of ``labels``.

    ``logits`` ``[..., V]``, ``labels`` ``[...]`` integer ids in ``0..V-1`` (positions that carry no loss must
    still hold a valid id; the mask decides what counts). Differentiable w.r.t. ``logits``:
    ``∂l_t/∂z_t = softmax(z_t) − onehot(y_t)``. Equal to ``torch.nn.functional.cross_entropy(...,
    reduction="none")``."""
    _check_tensor("logits", logits)
    _check_tensor("labels", labels)
    if logits.ndim < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits shape {tuple(logits.shape)} must be labels shape {tuple(labels.shape)} + (vocab,)")
    z = logits.astype(ms.float32)
    # logsumexp written out (max-shifted): MindSpore 2.10's CPU log_softmax is off by up to ~5e-6 relative,
    # this form stays within a few float32 ulps of the exact value (tests/mindformers)
    top = ops.stop_gradient(z.max(-1, keepdims=True))
    lse = ops.log(ops.exp(z - top).sum(-1)) + top.squeeze(-1)
    picked = ops.gather_elements(z, -1, labels.astype(ms.int64).expand_dims(-1)).squeeze(-1)
    return lse - picked


def _as_2d(x: Tensor) -> Tensor:
    return x if x.ndim == 2 else x.reshape(1, -1)


def sample_stats(per_token_loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row sums ``s_i = Σ_t w_t·l_t`` and counts ``n_i = Σ_t w_t`` of ``[b, S]`` (``[S]``: one row), with
    ``w = (mask != 0)`` in the loss's float dtype (a masked position's loss is dropped, not multiplied:
    a NaN there cannot leak)."""
    _check_tensor("per_token_loss", per_token_loss, (1, 2))
    _check_tensor("mask", mask, (1, 2))
    _same_shape("per_token_loss", per_token_loss, "mask", mask)
    loss, w = _as_2d(per_token_loss), _as_2d(mask) != 0
    contrib = ops.where(w, loss, ops.zeros_like(loss))
    return contrib.sum(-1), w.astype(loss.dtype).sum(-1)


def document_starts(segment_ids: Tensor) -> Tensor:
    """``True`` where a document starts: a non-zero segment id that differs from its left neighbour in the row
    (or sits in column 0); the rule of ``lossparity.losses.mode_table.document_starts`` (0 = padding)."""
    seg = _as_2d(_check_tensor("segment_ids", segment_ids, (1, 2))).astype(ms.int32)
    left = ops.concat([ops.zeros_like(seg[:, :1]), seg[:, :-1]], 1)
    return (seg != 0) & (seg != left)


def document_sums(per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-document sums of packed rows ``[b, S]`` without a host synchronization: ``(s, n, ndoc)`` with
    ``s[j] = Σ_{t∈j} w·l`` and ``n[j] = Σ_{t∈j} w`` in ``b·S`` slots (slot ``j`` = the ``j``-th document in
    row-major order of appearance, unused slots 0) and ``ndoc`` the document count (int32 scalar tensor).
    A document is a maximal run of equal non-zero ids in a row; a loss-bearing position at id 0 belongs to no
    document and is dropped (MindFormers marks padding with ``loss_mask = 0``, so none arises from its data).
    """
    _check_tensor("per_token_loss", per_token_loss, (1, 2))
    _same_shape("per_token_loss", per_token_loss, "mask", _check_tensor("mask", mask))
    _same_shape("per_token_loss", per_token_loss, "segment_ids", _check_tensor("segment_ids", segment_ids))
    loss = _as_2d(per_token_loss).reshape(-1)
    seg = _as_2d(segment_ids).reshape(-1)
    starts = document_starts(segment_ids).reshape(-1)
    inside = seg != 0
    w = (_as_2d(mask).reshape(-1) != 0) & inside
    slot = ops.cumsum(starts.astype(ms.int32), 0) - 1
    slot = ops.where(inside, slot, ops.zeros_like(slot))
    total = int(loss.shape[0])
    s = ops.unsorted_segment_sum(ops.where(w, loss, ops.zeros_like(loss)), slot, total)
    n = ops.unsorted_segment_sum(w.astype(loss.dtype), slot, total)
    return s, n, starts.astype(ms.int32).sum()


def segment_ids_from_actual_seq_len(actual_seq_len: Tensor, seq_length: int) -> Tensor:
    """lossparity's segment ids ``[b, S]`` from MindFormers' packed-row metadata ``actual_seq_len`` ``[b, M]``.

    Each row of ``actual_seq_len`` lists the cumulative end positions of its documents (MindFormers'
    ``_get_eod_attention_mask``: an end after every EOD token, padded with ``S``), either within the row
    (``0 < e ≤ S``) or offset by the row's start in the microbatch (``asl_batch_wrapper``: row ``r`` holds
    ``r·S < e ≤ (r+1)·S``); ``((e − 1) mod S) + 1`` maps both to the row. Position ``t`` gets id
    ``1 + #{e ≤ t}``: document ``j`` of a row is the id ``j + 1``, and repeated ends (the padding) make no
    document."""
    asl = _check_tensor("actual_seq_len", actual_seq_len, (1, 2))
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length must be a positive int, got {seq_length!r}")
    ends = _as_2d(asl).astype(ms.int32)
    ends = (ends - 1) % seq_length + 1
    # a host constant (the shape is static): Arange has no CPU kernel in MindSpore 2.10
    pos = Tensor(np.arange(seq_length, dtype=np.int32).reshape(1, seq_length, 1))
    before = (ends.expand_dims(1) <= pos).astype(ms.int32).sum(-1)
    return before + 1
