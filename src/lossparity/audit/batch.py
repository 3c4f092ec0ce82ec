"""The batch the audit crafts and the configurations it splits it into.

The rows are chosen so that the normalization modes give different weights: ragged target counts (so a
token mean differs from a mean of row means), one row without any target (so ``N`` counted with or
without empty rows differ), and microbatches whose token counts differ (so a mean of microbatch means
differs from the token mean). Labels follow the Hugging Face causal-LM convention: ``labels[t]`` is the
token that position ``t - 1`` predicts, ``-100`` where nothing is predicted, ``labels[0] = -100``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["AuditBatch", "Config", "craft_batch", "Unit", "split_rows", "CLASSES", "configs_for"]

IGNORE = -100
# (real tokens, prompt tokens) per row: targets = real - prompt; row 3 is prompt only (no target).
_ROW_SHAPES = [(16, 2), (5, 1), (12, 3), (6, 6), (9, 1), (16, 5), (7, 2), (11, 1)]
SEQ_LEN = 16


@dataclass(frozen=True)
class Unit:
    """One document of one row: ``row``, its token span ``[start, end)`` and ``n`` loss-bearing targets."""

    row: int
    start: int
    end: int
    n: int


@dataclass
class AuditBatch:
    """The crafted global batch: ``input_ids``, ``attention_mask``, ``position_ids``, ``labels`` ``[N, S]``
    and its documents (``units``). ``packed`` rows hold several documents (``position_ids`` restart)."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    labels: Tensor
    units: list[Unit]
    packed: bool = False

    @property
    def rows(self) -> int:
        """The number of rows ``N`` of the batch."""
        return int(self.input_ids.shape[0])

    def row(self, i: int) -> dict[str, Tensor]:
        """Row ``i`` as the dict a dataset item holds (``completion_mask``: 1 where a target is)."""
        return {
            "input_ids": self.input_ids[i].clone(),
            "attention_mask": self.attention_mask[i].clone(),
            "position_ids": self.position_ids[i].clone(),
            "labels": self.labels[i].clone(),
            "completion_mask": (self.labels[i] != IGNORE).long(),
        }

    def microbatch(self, rows: list[int]) -> dict[str, Tensor]:
        """The rows ``rows`` stacked into one microbatch dict."""
        idx = torch.tensor(rows, dtype=torch.long)
        return {
            "input_ids": self.input_ids[idx].clone(),
            "attention_mask": self.attention_mask[idx].clone(),
            "position_ids": self.position_ids[idx].clone(),
            "labels": self.labels[idx].clone(),
        }

    def key(self, ids: Tensor) -> tuple[int, ...]:
        """A row's identity: its tokens without padding (id 0) on either side."""
        values = [int(x) for x in ids.tolist()]
        while values and values[-1] == 0:
            values.pop()
        while values and values[0] == 0:
            values.pop(0)
        return tuple(values)

    def row_of(self) -> dict[tuple[int, ...], int]:
        """Map from a row's key to its index (every row's tokens are distinct by construction)."""
        return {self.key(self.input_ids[i]): i for i in range(self.rows)}


def craft_batch(vocab_size: int, *, packed: bool = False, seed: int = 1234) -> AuditBatch:
    """The audit's global batch of 8 rows of 16 tokens (or, ``packed``, the same 8 documents in 4 rows of
    32 tokens). Token ids are drawn from ``[1, vocab_size)``; 0 is padding. Deterministic in ``seed``."""
    if vocab_size < 8:
        raise ValueError(f"audit: the model's vocabulary has {vocab_size} tokens; at least 8 are needed")
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i, (real, prompt) in enumerate(_ROW_SHAPES):
        ids = torch.randint(1, vocab_size, (real,), generator=g)
        ids[0] = 1 + (i % (vocab_size - 1))  # rows differ in their first token: the key never collides
        labels = ids.clone()
        labels[:prompt] = IGNORE
        docs.append((ids, labels))
    if packed:
        return _pack(docs)
    n, s = len(docs), SEQ_LEN
    input_ids = torch.zeros(n, s, dtype=torch.long)
    attention = torch.zeros(n, s, dtype=torch.long)
    labels = torch.full((n, s), IGNORE, dtype=torch.long)
    units = []
    for i, (ids, lab) in enumerate(docs):
        k = len(ids)
        input_ids[i, :k], attention[i, :k], labels[i, :k] = ids, 1, lab
        units.append(Unit(i, 0, k, int((lab[1:] != IGNORE).sum())))
    positions = torch.arange(s).expand(n, s).clone()
    return AuditBatch(input_ids, attention, positions, labels, units)


def _pack(docs: list[tuple[Tensor, Tensor]]) -> AuditBatch:
    """Documents ``2r`` and ``2r + 1`` into row ``r`` (position ids restart at each document)."""
    rows = (len(docs) + 1) // 2
    s = 2 * SEQ_LEN
    input_ids = torch.zeros(rows, s, dtype=torch.long)
    attention = torch.zeros(rows, s, dtype=torch.long)
    positions = torch.zeros(rows, s, dtype=torch.long)
    labels = torch.full((rows, s), IGNORE, dtype=torch.long)
    units = []
    for r in range(rows):
        at = 0
        for ids, lab in docs[2 * r : 2 * r + 2]:
            k = len(ids)
            input_ids[r, at : at + k], attention[r, at : at + k] = ids, 1
            positions[r, at : at + k] = torch.arange(k)
            labels[r, at : at + k] = lab
            labels[r, at] = IGNORE  # a document's first token is predicted by nothing of its own
            units.append(Unit(r, at, at + k, int((lab[1:] != IGNORE).sum())))
            at += k
    return AuditBatch(input_ids, attention, positions, labels, units, packed=True)


@dataclass(frozen=True)
class Config:
    """One configuration of an equivalence class: ``dp`` ranks × ``ga`` microbatches of ``micro`` rows,
    ``recompute`` (activation checkpointing), ``packed`` rows. ``klass`` names its class."""

    name: str
    klass: str
    dp: int = 1
    ga: int = 1
    micro: int = 8
    recompute: bool = False
    packed: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)


def split_rows(n_rows: int, cfg: Config) -> list[list[list[int]]]:
    """``[rank][microbatch] -> rows``: microbatch ``k`` of rank ``r`` holds rows ``(k·D + r)·b ...``, the
    order a sequential sampler sharded over ranks gives (Hugging Face accelerate, Megatron)."""
    if cfg.dp * cfg.ga * cfg.micro != n_rows:
        raise ValueError(f"audit config {cfg.name}: {cfg.dp} x {cfg.ga} x {cfg.micro} rows != {n_rows}")
    return [
        [list(range((k * cfg.dp + r) * cfg.micro, (k * cfg.dp + r + 1) * cfg.micro)) for k in range(cfg.ga)]
        for r in range(cfg.dp)
    ]


# The equivalence classes, each a list of configurations that must give the reference's update.
CLASSES: dict[str, str] = {
    "ga": "gradient accumulation 2 and 4 at the same global batch",
    "microbatch": "one row per microbatch (micro-batch size 1, GA 8)",
    "dp": "2 data-parallel ranks (GA 1 and 2)",
    "recompute": "activation checkpointing on",
    "packing": "the same documents packed two per row",
    "zero": "DeepSpeed ZeRO-1, 2, 3 and ZeRO-2 with optimizer offload at 2 ranks x GA 2",
}
_ZERO = (("ZeRO-1", 1, False), ("ZeRO-2", 2, False), ("ZeRO-3", 3, False), ("ZeRO-2+offload", 2, True))
DEFAULT_CLASSES = ("ga", "microbatch", "dp", "recompute")


def configs_for(classes: list[str], n_rows: int = 8) -> list[Config]:
    """The reference configuration (1 rank, GA 1) followed by the configurations of ``classes``."""
    out = [Config("D1 K1 b8", "reference", micro=n_rows)]
    for c in classes:
        if c == "ga":
            out += [Config("K2 b4", c, ga=2, micro=n_rows // 2), Config("K4 b2", c, ga=4, micro=n_rows // 4)]
        elif c == "microbatch":
            out.append(Config("K8 b1", c, ga=n_rows, micro=1))
        elif c == "dp":
            out += [
                Config("D2 K1 b4", c, dp=2, micro=n_rows // 2),
                Config("D2 K2 b2", c, dp=2, ga=2, micro=n_rows // 4),
            ]
        elif c == "recompute":
            out.append(Config("K2 b4 +recompute", c, ga=2, micro=n_rows // 2, recompute=True))
        elif c == "zero":  # DeepSpeed: ZeRO stages and optimizer offload at 2 ranks x GA 2
            for name, stage, offload in _ZERO:
                extra: dict[str, object] = {"zero_stage": stage, "offload": offload}
                out.append(Config(f"D2 K2 b2 {name}", c, dp=2, ga=2, micro=n_rows // 4, extra=extra))
        elif c == "packing":
            out.append(Config("packed K1 b4", c, micro=n_rows // 2, packed=True))
        else:
            raise ValueError(f"audit: unknown class {c!r}; valid classes: {', '.join(CLASSES)}")
    return out
