"""Model configuration: the :class:`ModelConfig` dataclass and the named presets.

The presets span a CPU test model (``tiny``: one forward+backward of an 8x64 batch in a few tens of
milliseconds) up to a ~100M-parameter MoE+MTP model for one GPU (``100m``). Byte-level vocabulary
(256) everywhere, so the embedding is a negligible part of every preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..options import ScoreFunction

__all__ = ["ModelConfig", "PRESETS", "SCORE_FUNCTIONS", "get_config"]

SCORE_FUNCTIONS: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass(kw_only=True)
class ModelConfig:
    """Hyper-parameters of :class:`lossparity.model.GPT` (validated on construction).

    Layers ``0 .. n_dense_layers-1`` use a dense SwiGLU MLP (``ffn_hidden``), the others an MoE layer
    (``num_experts`` routed SwiGLU experts of width ``moe_ffn_hidden``, ``topk`` per token, plus an
    optional shared expert of the same width); ``num_experts = 0`` makes every layer dense. Each of the
    ``mtp_depths`` MTP blocks is MoE when the main model has at least one MoE layer. ``indexer_layer``
    puts a DeepSeek-V3.2-style indexer (``indexer_heads`` heads of width ``indexer_dim``) on that layer.
    """

    vocab_size: int = 256
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    ffn_hidden: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    n_dense_layers: int = 1
    num_experts: int = 4
    topk: int = 2
    moe_ffn_hidden: int
    score_function: ScoreFunction = "softmax"
    shared_expert: bool = False
    mtp_depths: int = 1
    indexer_layer: int | None = None
    tie_embeddings: bool = False
    indexer_heads: int = 2
    indexer_dim: int = 16
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "ffn_hidden",
            "max_seq_len",
            "moe_ffn_hidden",
            "indexer_heads",
            "indexer_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim dim/n_heads={self.dim // self.n_heads} must be even for RoPE")
        if self.indexer_dim % 2:
            raise ValueError(f"ModelConfig.indexer_dim={self.indexer_dim} must be even for RoPE")
        kv = self.kv_heads
        if kv <= 0 or self.n_heads % kv:
            raise ValueError(f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"ModelConfig.n_dense_layers={self.n_dense_layers} must be in [0, n_layers={self.n_layers}]"
            )
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0 and not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"ModelConfig.topk={self.topk} must be in [1, num_experts={self.num_experts}]")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"ModelConfig.score_function={self.score_function!r}; valid: {', '.join(SCORE_FUNCTIONS)}")
        if self.mtp_depths < 0:
            raise ValueError(f"ModelConfig.mtp_depths must be >= 0, got {self.mtp_depths}")
        if self.indexer_layer is not None and not 0 <= self.indexer_layer < self.n_layers:
            raise ValueError(f"ModelConfig.indexer_layer={self.indexer_layer} must be in [0, n_layers={self.n_layers})")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("ModelConfig.rope_theta, norm_eps and init_std must be > 0")

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads``, or ``n_heads`` when unset: plain multi-head)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``dim / n_heads``."""
        return self.dim // self.n_heads

    @property
    def has_moe(self) -> bool:
        """True when at least one main layer is an MoE layer (so the MTP blocks are MoE too)."""
        return self.num_experts > 0 and self.n_dense_layers < self.n_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        """True when main layer ``layer_id`` (0-based) is an MoE layer: ``layer_id >= n_dense_layers``."""
        return self.num_experts > 0 and layer_id >= self.n_dense_layers


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=64,
        max_seq_len=128,
        n_dense_layers=1,
        num_experts=4,
        topk=2,
        moe_ffn_hidden=32,
        mtp_depths=1,
    ),
    "small": ModelConfig(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=192,
        max_seq_len=256,
        n_dense_layers=1,
        num_experts=8,
        topk=2,
        moe_ffn_hidden=64,
        score_function="sigmoid",
        shared_expert=True,
        mtp_depths=2,
    ),
    "medium": ModelConfig(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=768,
        max_seq_len=512,
        n_dense_layers=1,
        num_experts=8,
        topk=2,
        moe_ffn_hidden=256,
        score_function="sigmoid",
        shared_expert=True,
        mtp_depths=1,
    ),
    "100m": ModelConfig(
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=2048,
        max_seq_len=1024,
        n_dense_layers=1,
        num_experts=8,
        topk=2,
        moe_ffn_hidden=768,
        score_function="sigmoid",
        shared_expert=True,
        mtp_depths=1,
    ),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:  # field types vary; __post_init__ validates
    """A fresh copy of preset ``name`` with ``overrides`` applied (re-validated). Raises ``ValueError``
    listing the valid names on an unknown preset or an unknown field."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}")
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid: {', '.join(fields)}")
    return dataclasses.replace(PRESETS[name], **overrides)
