"""The lossparity reference model: a small GPT with RoPE, GQA, first-k dense + MoE layers, DeepSeek-V3
MTP and an optional DSA-style indexer. The output head is not applied in :meth:`GPT.forward`: the loss
code computes per-token cross-entropy from ``hidden`` and ``model.output.weight`` (chunked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from .attention import Attention, Indexer, attention_mask
from .block import Block
from .config import ModelConfig
from .context_parallel import ContextParallel
from .moe import MoE
from .mtp import MTPModule, shift_tokens
from .norm import RMSNorm
from .recompute import checkpoint
from .rope import positions_from_segments, rope_cos_sin
from .router import Router, RouterRecord
from .sequence_parallel import sp_gather, sp_shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ModelOutput", "GPT"]

_OUT_PROJ_SUFFIXES = ("attention.wo.weight", "ffn.w2.weight", "experts.w2", "shared.w2.weight")


@dataclass
class ModelOutput:
    """Result of :meth:`GPT.forward`: final-normed ``hidden [B, S, dim]`` of the main model,
    ``mtp_hidden`` (one final-normed ``[B, S, dim]`` per MTP depth), ``routers`` (one record per MoE layer,
    main layers then MTP depths, in forward order) and ``indexer`` = ``(main attention probs
    [B, heads, S, S] detached, indexer logits [B, S, S] with -inf at masked keys)`` or ``None``."""

    hidden: Tensor
    mtp_hidden: list[Tensor]
    routers: list[RouterRecord]
    indexer: tuple[Tensor, Tensor] | None


@dataclass
class ForwardContext:
    """Per-microbatch inputs of the blocks (see :meth:`GPT.prepare`)."""

    tokens: Tensor
    mask: Tensor
    cos: Tensor
    sin: Tensor
    positions: Tensor
    valid: Tensor | None
    mtp_tokens: list[Tensor]


class GPT(nn.Module):
    """Decoder-only transformer configured by :class:`ModelConfig` (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(
            Block(config, i, moe=config.is_moe_layer(i), indexer=i == config.indexer_layer)
            for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.mtp = nn.ModuleList(MTPModule(config, k) for k in range(1, config.mtp_depths + 1))
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.cp: ContextParallel | None = None
        # tensor-parallel mesh when sequence parallelism is on (model/tensor_parallel.py)
        self.sp_mesh: DeviceMesh | None = None
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialize every parameter in ``named_parameters`` order (deterministic given the torch
        seed): norm weights 1, output projections (attention ``wo``, every ``w2``) ``N(0, σ²/(2·n_layers))``,
        everything else ``N(0, σ²)`` with ``σ = init_std``; router buffers are zeroed."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if isinstance(self.get_submodule(name.rsplit(".", 1)[0]), RMSNorm):
                p.fill_(1.0)
            elif name.endswith(_OUT_PROJ_SUFFIXES):
                p.normal_(0.0, std / math.sqrt(2 * self.config.n_layers))
            else:
                p.normal_(0.0, std)
        for router in self.moe_routers():
            router.expert_bias.zero_()
            router.reset_counts()

    def enable_context_parallel(self, cp: ContextParallel | None) -> None:
        """Shard every sequence over ``cp`` (``None`` switches it off). ``forward`` then takes whole rows and
        returns the outputs of this rank's positions ``cp.columns(S)`` only."""
        self.cp = cp
        for m in self.modules():
            if isinstance(m, (Attention, Indexer)):
                m.cp = cp  # keys of every shard are gathered (attention and indexer alike)

    def prepare(
        self,
        tokens: Tensor,
        *,
        segment_ids: Tensor | None = None,
        positions: Tensor | None = None,
        check_values: bool = True,
    ) -> ForwardContext:
        """Everything the blocks need besides the hidden states, from whole rows: attention mask, RoPE
        tables, non-padding map, MTP input tokens (rolled on whole rows), cut to this rank's columns under
        context parallelism. Computed once per microbatch (pipeline stages share it)."""
        self._check_inputs(tokens, segment_ids, positions)
        if check_values:
            self.check_values(tokens, segment_ids, positions)
        c = self.config
        B, S = tokens.shape
        if positions is None:
            positions = (
                positions_from_segments(segment_ids)
                if segment_ids is not None
                else torch.arange(S, device=tokens.device).expand(B, S)
            )
        mask = attention_mask(segment_ids, S, tokens.device)
        mtp_tokens = [shift_tokens(tokens, cast(MTPModule, m).depth, segment_ids) for m in self.mtp]
        cp = self.cp
        if cp is not None:
            # Whole rows in, this shard's columns out: queries are ours, keys come in all_columns order.
            cols, all_cols = cp.columns(S).to(tokens.device), cp.all_columns(S).to(tokens.device)
            mask = mask[:, :, cols][:, :, :, all_cols]
            tokens, positions = tokens[:, cols], positions[:, cols]
            segment_ids = None if segment_ids is None else segment_ids[:, cols]
            mtp_tokens = [t[:, cols] for t in mtp_tokens]
        valid = None if segment_ids is None else segment_ids != 0
        if self.sp_mesh is not None and valid is not None:
            valid = sp_shard(valid, self.sp_mesh)  # routers see this rank's slice of the sequence
        dtype = torch.promote_types(self.tok_embeddings.weight.dtype, torch.float32)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype)
        return ForwardContext(tokens, mask, cos, sin, positions, valid, mtp_tokens)

    def embed(self, tokens: Tensor) -> Tensor:
        """Token embeddings; under sequence parallelism this rank's slice of the sequence."""
        h = self.tok_embeddings(tokens)
        if self.sp_mesh is not None:
            h = sp_shard(h, self.sp_mesh)
        return h

    def _full_sequence(self, h: Tensor) -> Tensor:
        # The loss code applies the (vocabulary-parallel) head to every position on every TP rank.
        if self.sp_mesh is None:
            return h
        return sp_gather(h, self.sp_mesh, 1, partial_grad=False)

    def run_layers(
        self, h: Tensor, ctx: ForwardContext, layer_ids: range, *, recompute: bool = False
    ) -> tuple[Tensor, list[RouterRecord], tuple[Tensor, Tensor] | None]:
        """Main transformer layers ``layer_ids`` on ``h``; returns ``(h, router records, indexer outputs)``."""
        routers: list[RouterRecord] = []
        indexer = None
        for i in layer_ids:
            args = (h, ctx.cos, ctx.sin, ctx.mask, ctx.positions, ctx.valid)
            h, record, idx = checkpoint(self.layers[i], *args) if recompute else self.layers[i](*args)
            if record is not None:
                routers.append(record)
            if idx is not None:
                indexer = idx
        return h, routers, indexer

    def run_head(
        self, h: Tensor, ctx: ForwardContext, *, recompute: bool = False
    ) -> tuple[Tensor, list[Tensor], list[RouterRecord]]:
        """Final norm and the MTP depths on the last layer's output ``h``; returns ``(hidden, mtp_hidden,
        MTP router records)`` (the output head itself is applied by the loss code)."""
        hidden = self._full_sequence(self.norm(h))
        mtp_hidden, routers = [], []
        for module in self.mtp:
            emb = self.embed(ctx.mtp_tokens[cast(MTPModule, module).depth - 1])
            h, normed, record = module(
                h, emb, ctx.cos, ctx.sin, ctx.mask, ctx.positions, ctx.valid, recompute=recompute
            )
            mtp_hidden.append(self._full_sequence(normed))
            if record is not None:
                routers.append(record)
        return hidden, mtp_hidden, routers

    def moe_routers(self) -> list[Router]:
        """Every router module, main layers in order then MTP depths in order (the order of
        ``ModelOutput.routers``)."""
        blocks = [cast(Block, b) for b in self.layers] + [cast(MTPModule, m).block for m in self.mtp]
        return [b.ffn.router for b in blocks if isinstance(b.ffn, MoE)]

    def num_params(self) -> int:
        """Number of distinct parameter elements (a tied embedding/head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def _check_inputs(self, tokens: Tensor, segment_ids: Tensor | None, positions: Tensor | None) -> None:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be an int64/int32 [B, S] tensor, got {tokens.dtype} shape {tuple(tokens.shape)}"
            )
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"tokens sequence length {tokens.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        for name, t in (("segment_ids", segment_ids), ("positions", positions)):
            if t is not None and (t.shape != tokens.shape or t.dtype.is_floating_point or t.dtype == torch.bool):
                raise ValueError(
                    f"{name} must be an integer tensor of tokens' shape {tuple(tokens.shape)}, "
                    f"got {t.dtype} shape {tuple(t.shape)}"
                )

    def check_values(self, tokens: Tensor, segment_ids: Tensor | None = None, positions: Tensor | None = None) -> None:
        """``ValueError`` unless ``0 <= tokens < vocab_size`` and ``segment_ids``/``positions >= 0``.

        Reads the minima/maxima to the host (a synchronization on an accelerator): ``forward`` and
        ``prepare`` call it unless ``check_values=False``; a training loop calls it once per step on the
        host-side batch, before the transfer, and passes ``check_values=False`` per microbatch."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(
                f"tokens values must be in [0, {self.config.vocab_size}), got range "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        for name, t in (("segment_ids", segment_ids), ("positions", positions)):
            if t is not None and t.numel() and int(t.min()) < 0:
                raise ValueError(f"{name} must be >= 0, got min {int(t.min())}")

    def forward(
        self,
        tokens: Tensor,
        *,
        segment_ids: Tensor | None = None,
        positions: Tensor | None = None,
        recompute: bool = False,
        check_values: bool = True,
    ) -> ModelOutput:
        """Run the model on ``tokens [B, S]``.

        ``segment_ids [B, S]`` (optional) marks documents of packed rows (attention and MTP inputs stay
        inside a document; id 0 = padding, excluded from the routers' dispatch counts). ``positions``
        default to the index within the document (``arange(S)`` without segment ids). ``recompute``
        checkpoints every transformer block (main and MTP); the re-runs record and count nothing. Under
        :meth:`enable_context_parallel` the inputs are whole rows and the outputs this shard's columns.
        ``check_values=False`` skips :meth:`check_values` (values validated before the transfer: no host read)."""
        ctx = self.prepare(tokens, segment_ids=segment_ids, positions=positions, check_values=check_values)
        h, routers, indexer = self.run_layers(self.embed(ctx.tokens), ctx, range(len(self.layers)), recompute=recompute)
        hidden, mtp_hidden, mtp_routers = self.run_head(h, ctx, recompute=recompute)
        routers += mtp_routers
        return ModelOutput(hidden=hidden, mtp_hidden=mtp_hidden, routers=routers, indexer=indexer)
