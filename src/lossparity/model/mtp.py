"""Multi-token prediction module after DeepSeek-V3 (one per depth ``k = 1..mtp_depths``).

Depth ``k`` at position ``t`` combines the previous depth's hidden state ``h^{k-1}_t`` (the main model's
last hidden state, before its final norm, for ``k = 1``) with the embedding of token ``t + k``:
``h' = W_k [RMSNorm(h^{k-1}); RMSNorm(Emb(tok[t + k]))]``, runs one transformer block, and final-norms
the block output for the shared output head. Labels (token ``t + 1 + k``) are built by the loss code.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..losses.stats import document_ids
from .block import Block
from .config import ModelConfig
from .norm import RMSNorm
from .recompute import checkpoint
from .router import RouterRecord

__all__ = ["shift_tokens", "MTPModule"]


def shift_tokens(tokens: Tensor, k: int, segment_ids: Tensor | None = None) -> Tensor:
    """Tokens rolled left by ``k`` within each row and document: ``out[b, t] = tokens[b, t + k]`` when
    ``t + k < S`` and (with ``segment_ids``) ``t + k`` lies in the document of ``t`` (the same run of
    ids, docs/semantics.md §0), else 0 (those positions'
    labels are masked by the loss code)."""
    if k < 0:
        raise ValueError(f"MTP shift k must be >= 0, got {k}")
    out = torch.zeros_like(tokens)
    S = tokens.shape[-1]
    if k >= S:
        return out
    out[..., : S - k] = tokens[..., k:]
    if segment_ids is not None:
        same = torch.zeros_like(tokens, dtype=torch.bool)
        doc = document_ids(segment_ids)
        same[..., : S - k] = doc[..., k:] == doc[..., : S - k]
        out = torch.where(same, out, torch.zeros_like(out))
    return out


class MTPModule(nn.Module):
    """MTP depth ``depth`` (1-based): ``hnorm``, ``enorm``, projection ``eh_proj`` (``2·dim -> dim``), one
    :class:`Block` (MoE when the main model has MoE layers) and its own final ``norm``."""

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.hnorm = RMSNorm(config.dim, config.norm_eps)
        self.enorm = RMSNorm(config.dim, config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.block = Block(config, config.n_layers + depth - 1, moe=config.has_moe)
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self,
        h_prev: Tensor,
        emb: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        positions: Tensor,
        valid: Tensor | None,
        *,
        recompute: bool = False,
    ) -> tuple[Tensor, Tensor, RouterRecord | None]:
        """``h_prev [B, S, dim]`` (previous depth, un-normed) and ``emb [B, S, dim]`` (embedding of the
        tokens ``depth`` ahead) -> ``(h_k un-normed, norm(h_k), router record or None)``; the block is
        checkpointed when ``recompute``."""
        x = self.eh_proj(torch.cat((self.hnorm(h_prev), self.enorm(emb)), dim=-1))
        args = (x, cos, sin, mask, positions, valid)
        h, record, _ = checkpoint(self.block, *args) if recompute else self.block(*args)
        return h, self.norm(h), record
