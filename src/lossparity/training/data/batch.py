"""The :class:`Batch` of the reference trainer and the special token ids (conventions: the package
docstring)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

__all__ = ["PAD_ID", "BOS_ID", "EOS_ID", "NUM_SPECIAL", "IGNORE_INDEX", "Batch"]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3
IGNORE_INDEX = -100


@dataclass(frozen=True, eq=False)
class Batch:
    """A block of rows: inputs, next-token targets, loss mask, segment ids and positions.

    ``tokens [N, S]`` int64 input ids (``PAD_ID`` at padding); ``labels [N, S]`` int64 targets
    (``labels[i, t] = tokens`` of position ``t+1`` of the same document, ``-100`` where there is none);
    ``mask [N, S]`` float32 with ``mask = (labels != -100)``; ``segment_ids [N, S]`` int64 (packed mode only,
    ``None`` otherwise): ``0`` = padding, ``1, 2, ...`` = documents of the row in order; ``positions [N, S]``
    int64 offset of each token inside its document (restarts at 0 at each document start, 0 at padding).
    """

    tokens: Tensor
    labels: Tensor
    mask: Tensor
    segment_ids: Tensor | None
    positions: Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.tokens.shape)
        if len(shape) != 2:
            raise ValueError(f"Batch.tokens must be [N, S], got shape {shape}")
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None and f.name == "segment_ids":
                continue
            if not isinstance(t, Tensor):
                raise TypeError(f"Batch.{f.name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"Batch.{f.name} shape {tuple(t.shape)} does not match tokens shape {shape}")
            if f.name != "mask" and t.dtype != torch.int64:
                raise TypeError(f"Batch.{f.name} must be int64, got {t.dtype}")
        if not self.mask.is_floating_point():
            raise TypeError(f"Batch.mask must be floating point (0/1), got {self.mask.dtype}")

    @property
    def num_rows(self) -> int:
        """Number of rows ``N``."""
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Row length ``S``."""
        return int(self.tokens.shape[1])

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` of this batch, as views (no copy); ``0 <= start <= stop <= N``."""
        if not (0 <= start <= stop <= self.num_rows):
            raise ValueError(f"rows(start={start}, stop={stop}) out of range for a batch of {self.num_rows} rows")
        return Batch(
            tokens=self.tokens[start:stop],
            labels=self.labels[start:stop],
            mask=self.mask[start:stop],
            segment_ids=None if self.segment_ids is None else self.segment_ids[start:stop],
            positions=self.positions[start:stop],
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch with every tensor moved to ``device`` (dtypes unchanged)."""

        def mv(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        return Batch(
            tokens=mv(self.tokens),
            labels=mv(self.labels),
            mask=mv(self.mask),
            segment_ids=None if self.segment_ids is None else mv(self.segment_ids),
            positions=mv(self.positions),
        )
