"""The lossparity reference model (nanoGPT-style MoE + MTP GPT), one file per concept."""

from .attention import Attention, Indexer, attention_mask
from .config import PRESETS, ModelConfig, get_config
from .gpt import GPT, ModelOutput
from .mlp import SwiGLU
from .moe import GroupedExperts, MoE
from .mtp import MTPModule, shift_tokens
from .norm import RMSNorm
from .recompute import checkpoint, is_recomputing
from .rope import apply_rope, positions_from_segments, rope_cos_sin
from .router import Router, RouterRecord, topk_map

__all__ = [
    "GPT",
    "ModelOutput",
    "ModelConfig",
    "PRESETS",
    "get_config",
    "Attention",
    "Indexer",
    "attention_mask",
    "SwiGLU",
    "MoE",
    "GroupedExperts",
    "MTPModule",
    "shift_tokens",
    "RMSNorm",
    "checkpoint",
    "is_recomputing",
    "apply_rope",
    "positions_from_segments",
    "rope_cos_sin",
    "Router",
    "RouterRecord",
    "topk_map",
]
