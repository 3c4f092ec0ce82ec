"""One pre-norm transformer block: ``h = x + Attn(norm(x))``, ``out = h + FFN(norm(h))``, where FFN is a
dense SwiGLU or an MoE layer; optionally the indexer head on the attention input."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import Attention, Indexer
from .config import ModelConfig
from .mlp import SwiGLU
from .moe import MoE
from .norm import RMSNorm
from .router import RouterRecord

__all__ = ["Block"]


class Block(nn.Module):
    """Transformer block ``layer_id`` (MTP blocks continue the numbering after the main layers)."""

    def __init__(self, config: ModelConfig, layer_id: int, *, moe: bool, indexer: bool = False) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c.dim, c.n_heads, c.kv_heads)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn: nn.Module = (
            MoE(c.dim, c.moe_ffn_hidden, c.num_experts, c.topk, c.score_function, c.shared_expert, layer_id)
            if moe
            else SwiGLU(c.dim, c.ffn_hidden)
        )
        self.indexer = Indexer(c.dim, c.indexer_heads, c.indexer_dim, c.rope_theta) if indexer else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, positions: Tensor, valid: Tensor | None
    ) -> tuple[Tensor, RouterRecord | None, tuple[Tensor, Tensor] | None]:
        """Run the block on ``x [B, S, dim]``. Returns ``(out, router record or None,
        (main attention probs [B, heads, S, S] detached, indexer logits [B, S, S]) or None)``."""
        a_in = self.attention_norm(x)
        attn, probs = self.attention(a_in, cos, sin, mask, return_probs=self.indexer is not None)
        indexer = None
        if self.indexer is not None:
            indexer = (self.indexer.target(probs), self.indexer(a_in, positions, mask))
        h = x + attn
        record = None
        if isinstance(self.ffn, MoE):
            f, record = self.ffn(self.ffn_norm(h), valid)
        else:
            f = self.ffn(self.ffn_norm(h))
        return h + f, record, indexer
