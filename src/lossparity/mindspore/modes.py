"""The normalization modes of the language-model objective in MindSpore (docs/semantics.md §1).

Every mode is ``J = Σ_mb numerator(mb) / denominator``: a microbatch's numerator from its own rows and one
global denominator counted from the masks of the whole step (all microbatches, all data-parallel ranks)
before the first backward. The table (unit, reduction, count, empty-unit rule) is the torch-free
:mod:`lossparity.losses.mode_table`, shared with the PyTorch and JAX ports.

Supported here: ``per_token``, ``per_sample``, ``per_document``, ``sample_sum`` (the modes a MindFormers
language-model run can name); the others are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import Tensor, ops

from ..losses.mode_table import mode_spec
from ..options import Mode, check_option
from .stats import _as_2d, _check_tensor, _same_shape, document_sums, sample_stats

__all__ = [
    "MODES",
    "Normalizers",
    "count_normalizers",
    "numerator",
    "denominator",
    "share",
    "token_weights",
    "objective",
]

MODES: tuple[Mode, ...] = ("per_token", "per_sample", "per_document", "sample_sum")


def check_mode(mode: str) -> Mode:
    """``mode`` if it is one of :data:`MODES`, else ``ValueError`` naming the valid ones."""
    return check_option("mode", mode, MODES)


@dataclass(frozen=True)
class Normalizers:
    """Global counts of one optimizer step as int32 scalar tensors (no host read): ``tokens = Ntok``,
    ``samples = N``, ``documents = Ndoc`` (0 without segment ids). ``a + b`` adds field by field (the sum
    over microbatches; over ranks: ``all_reduce`` of :meth:`stacked`, then :meth:`from_stacked`)."""

    tokens: Tensor
    samples: Tensor
    documents: Tensor

    def __add__(self, other: Normalizers) -> Normalizers:
        return Normalizers(self.tokens + other.tokens, self.samples + other.samples, self.documents + other.documents)

    def stacked(self) -> Tensor:
        """``[tokens, samples, documents]`` as one int32 tensor (one collective reduces all three)."""
        return ops.stack([c.astype(ms.int32) for c in (self.tokens, self.samples, self.documents)])

    @staticmethod
    def from_stacked(x: Tensor) -> Normalizers:
        """The inverse of :meth:`stacked`."""
        return Normalizers(x[0], x[1], x[2])


def count_normalizers(mask: Tensor, segment_ids: Tensor | None = None) -> Normalizers:
    """The counts of rows ``[b, S]``: ``Ntok = #{mask != 0}``, ``N = b`` (a row without a loss-bearing token
    still counts), ``Ndoc`` = documents of ``segment_ids`` (0 when ``None``)."""
    w = _as_2d(_check_tensor("mask", mask, (1, 2))) != 0
    tokens = w.astype(ms.int32).sum()
    samples = ops.fill(ms.int32, (), int(w.shape[0]))
    if segment_ids is None:
        documents = ops.zeros((), ms.int32)
    else:
        _same_shape("mask", mask, "segment_ids", _check_tensor("segment_ids", segment_ids))
        zeros = ops.zeros(mask.shape, ms.float32)
        documents = document_sums(zeros, zeros, segment_ids)[2]
    return Normalizers(tokens.astype(ms.int32), samples, documents.astype(ms.int32))


def denominator(mode: str, norms: Normalizers) -> Tensor:
    """``max(count, 1)`` of the mode's global count (``Ntok``, ``N`` or ``Ndoc``) as a float32 tensor; the
    ``max`` makes an empty batch give ``J = 0``."""
    count = getattr(norms, mode_spec(check_mode(mode)).count)
    return ops.maximum(count.astype(ms.float32), ops.ones((), ms.float32))


def numerator(mode: str, per_token_loss: Tensor, mask: Tensor, *, segment_ids: Tensor | None = None) -> Tensor:
    """A microbatch's numerator: ``Σ_t w·l`` (per_token, sample_sum), ``Σ_i s_i / max(n_i, 1)`` (per_sample)
    or ``Σ_j s_j / max(n_j, 1)`` over the documents of ``segment_ids`` (per_document). Differentiable
    w.r.t. ``per_token_loss``; a unit without a loss-bearing token contributes 0."""
    spec = mode_spec(check_mode(mode))
    if spec.unit == "document":
        if segment_ids is None:
            raise ValueError("mode 'per_document' needs segment_ids (packed rows; see segment_ids_from_actual_seq_len)")
        s, n, _ = document_sums(per_token_loss, mask, segment_ids)
    else:
        s, n = sample_stats(per_token_loss, mask)
    if spec.reduction == "sum":
        return s.sum()
    return (s / ops.maximum(n, ops.ones_like(n))).sum()


def share(
    mode: str, per_token_loss: Tensor, mask: Tensor, norms: Normalizers, *, segment_ids: Tensor | None = None
) -> Tensor:
    """This microbatch's share of the objective: ``numerator(mb) / denominator(norms)``, where ``norms`` are
    the counts of the whole step (every microbatch on every data-parallel rank). ``Σ_mb share = J``."""
    return numerator(mode, per_token_loss, mask, segment_ids=segment_ids) / denominator(mode, norms)


def token_weights(mode: str, mask: Tensor, norms: Normalizers, *, segment_ids: Tensor | None = None) -> Tensor:
    """The weight of every position in the objective, ``[b, S]`` float32: ``share = Σ_t weight_t · l_t``.
    ``w_t / max(Ntok, 1)`` (per_token), ``w_t / (max(n_i, 1)·N)`` (per_sample), ``w_t / (max(n_j, 1)·Ndoc)``
    (per_document), ``w_t / N`` (sample_sum); ``w_t = (mask_t != 0)``. The gradient of the objective w.r.t. a
    position's loss, and what a logged estimator needs."""
    spec = mode_spec(check_mode(mode))
    w = (_as_2d(mask) != 0).astype(ms.float32)
    if spec.reduction == "unit_mean":
        if spec.unit == "document":
            if segment_ids is None:
                raise ValueError("mode 'per_document' needs segment_ids")
            seg = _as_2d(segment_ids)
            _, n, _ = document_sums(ops.zeros(w.shape, ms.float32), w, seg)
            from .stats import document_starts  # noqa: PLC0415 (a sibling helper)

            slot = ops.cumsum(document_starts(seg).reshape(-1).astype(ms.int32), 0) - 1
            slot = ops.maximum(slot, ops.zeros_like(slot))
            per_pos = ops.gather(n, slot, 0).reshape(w.shape)
            w = ops.where(seg != 0, w, ops.zeros_like(w))
        else:
            per_pos = w.sum(-1, keepdims=True).broadcast_to(w.shape)
        w = w / ops.maximum(per_pos, ops.ones_like(per_pos))
    return (w / denominator(mode, norms)).reshape(mask.shape)


def objective(mode: str, per_token_loss: Tensor, mask: Tensor, *, segment_ids: Tensor | None = None) -> Tensor:
    """``J`` of a whole global batch ``[N, S]`` held in one process: ``numerator / denominator`` with the
    batch's own counts."""
    norms = count_normalizers(mask, segment_ids if check_mode(mode) == "per_document" else None)
    return share(mode, per_token_loss, mask, norms, segment_ids=segment_ids)
