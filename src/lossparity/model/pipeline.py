"""Pipeline-parallel stages of the reference model for ``torch.distributed.pipelining``.

The model is cut into ``P·V`` chunks (``V`` virtual chunks per pipeline rank, interleaved: rank ``r``
holds chunks ``r, r+P, ...``): chunk 0 owns the embedding, the last chunk owns the final norm, the MTP
depths, a copy of the embedding (MTP inputs use the shared embedding) and the output head. Layers are
spread as evenly as possible; a chunk may hold no layer, and then no MoE layer either.

What travels between stages is only the hidden state. The per-microbatch inputs of the blocks (mask,
RoPE tables, MTP input tokens) are computed from the whole global batch, which every rank can build
(it is a pure function of the step), and handed to each stage in microbatch order before the schedule
runs: every pipeline schedule runs a stage's forwards in microbatch order.

Auxiliary losses produced inside a non-last stage (MoE load balancing, router z-loss) reach the
optimizer through :class:`AuxInject`: the hidden state passes unchanged and, in backward, the auxiliary
share receives gradient 1 (the role of Megatron's ``MoEAuxLossAutoScaler``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from .block import Block
from .gpt import GPT, ForwardContext
from .moe import MoE
from .mtp import MTPModule
from .router import Router, RouterRecord

__all__ = ["AuxInject", "StageModule", "split_layers", "chunks_of_rank"]


def split_layers(n_layers: int, num_chunks: int) -> list[range]:
    """Contiguous, balanced layer ranges of ``num_chunks`` chunks (earlier chunks get the remainder)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    base, extra = divmod(n_layers, num_chunks)
    out, start = [], 0
    for c in range(num_chunks):
        n = base + (1 if c < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def chunks_of_rank(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    """Chunk indices held by pipeline rank ``pp_rank`` (interleaved placement)."""
    return [pp_rank + v * pp_size for v in range(virtual)]


class AuxInject(torch.autograd.Function):
    """``y = h`` in forward; in backward ``dL/dh = dL/dy`` and ``dL/d aux = 1``, so an auxiliary share
    computed inside a stage is back-propagated with the stage's output gradient."""

    @staticmethod
    def forward(ctx, h: Tensor, aux: Tensor) -> Tensor:  # noqa: D102
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class StageModule(nn.Module):
    """One pipeline chunk of a :class:`GPT` (see the module docstring).

    ``aux_fn(records, microbatch, indexer)`` returns the auxiliary share of this chunk's router records
    and of the indexer head's outputs when the chunk holds the indexer layer (or ``None``); it is called
    once per microbatch forward, never during a recompute re-run (the re-run is inside the blocks'
    checkpoints). The last chunk outputs ``[1 + Dm, b, S, dim]``: the final-normed
    hidden states of the main model and of every MTP depth.
    """

    def __init__(
        self,
        gpt: GPT,
        chunk: int,
        num_chunks: int,
        layer_ids: range,
        *,
        recompute: bool = False,
        aux_fn: Callable[[list[RouterRecord], int, tuple[Tensor, Tensor] | None], Tensor | None] | None = None,
    ) -> None:
        super().__init__()
        self.chunk, self.num_chunks, self.layer_ids = chunk, num_chunks, layer_ids
        self.first, self.last = chunk == 0, chunk == num_chunks - 1
        self.recompute, self.aux_fn = recompute, aux_fn
        self._gpt = [gpt]  # not a child module: only the owned parts below are registered
        self.layers = nn.ModuleList(gpt.layers[i] for i in layer_ids)
        if self.first or (self.last and len(gpt.mtp)):
            self.tok_embeddings = gpt.tok_embeddings
        if self.last:
            self.norm, self.mtp, self.output = gpt.norm, gpt.mtp, gpt.output
        self.contexts: list[ForwardContext] = []
        self._next = 0

    def routers(self) -> list[Router]:
        """Routers of this chunk (its main layers, then the MTP depths for the last chunk)."""
        blocks = [cast(Block, b) for b in self.layers]
        blocks += [cast(MTPModule, m).block for m in self.mtp] if self.last else []
        return [b.ffn.router for b in blocks if isinstance(b.ffn, MoE)]

    def set_microbatches(self, contexts: Sequence[ForwardContext]) -> None:
        """The per-microbatch block inputs of the coming step, in microbatch order."""
        self.contexts, self._next = list(contexts), 0

    def forward(self, x: Tensor) -> Tensor:
        gpt = self._gpt[0]
        if self._next >= len(self.contexts):
            raise RuntimeError(
                f"pipeline chunk {self.chunk}: forward of microbatch {self._next} but only "
                f"{len(self.contexts)} contexts were set for this step"
            )
        mb = self._next
        ctx = self.contexts[mb]
        self._next += 1
        # First chunk: the context's tokens are the microbatch's, cut to this rank's columns under context
        # parallelism (``x`` holds whole rows); ``embed`` keeps this TP rank's slice under SP.
        h = gpt.embed(ctx.tokens) if self.first else x
        h, records, indexer = gpt.run_layers(h, ctx, self.layer_ids, recompute=self.recompute)
        if self.last:
            hidden, mtp_hidden, mtp_records = gpt.run_head(h, ctx, recompute=self.recompute)
            records = records + mtp_records
            out = torch.stack([hidden, *mtp_hidden])
        else:
            out = h
        aux = self.aux_fn(records, mb, indexer) if self.aux_fn is not None else None
        return AuxInject.apply(out, aux) if aux is not None else out
