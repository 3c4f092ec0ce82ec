"""Causal self-attention with document masking (GQA optional), and the DSA-style indexer head.

The mask is an explicit boolean ``[B, 1, S, S]`` tensor (``True`` = may attend): key ``s`` is visible to
query ``t`` iff ``s <= t`` and both carry the same segment id. Every query sees at least itself, so no
softmax row is empty (padding, id 0, attends within its own padding run).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses.stats import document_ids
from .rope import apply_rope, rope_cos_sin
from .sequence_parallel import sp_gather, sp_shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .context_parallel import ContextParallel

__all__ = ["attention_mask", "Attention", "Indexer"]


def attention_mask(segment_ids: Tensor | None, seq_len: int, device: torch.device | None = None) -> Tensor:
    """Boolean mask ``[B, 1, S, S]`` (``[1, 1, S, S]`` without segment ids):
    ``m[b, 0, t, s] = (s <= t) and doc[b, t] == doc[b, s]`` with ``doc = document_ids(seg)``: a query
    sees the keys of its own document, a maximal run of equal ids (docs/semantics.md §0); padding
    positions (id 0) see the padding before them."""
    if segment_ids is not None:
        device = segment_ids.device
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if segment_ids is None:
        return causal[None, None]
    doc = document_ids(segment_ids)
    same = doc[:, :, None] == doc[:, None, :]
    return (causal[None] & same)[:, None]


class Attention(nn.Module):
    """Multi-head (or grouped-query) causal attention with RoPE, no biases.

    ``out = Wo · concat_h softmax(q_h k_h^T / sqrt(d) + mask) v_h``, where with GQA each key/value
    head serves ``n_heads / n_kv_heads`` consecutive query heads.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.cp: ContextParallel | None = None  # keys/values are all-gathered over its group (set by GPT)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, *, return_probs: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Attend over ``x [B, S, dim]`` under ``mask``; returns ``(out [B, S, dim], probs)`` where
        ``probs`` is ``None`` unless ``return_probs``: then the attention probabilities
        ``[B, n_heads, S, S]`` (detached, in ``max(dtype, float32)``, exactly 0 at masked keys)."""
        B, S, _ = x.shape
        q = apply_rope(self.wq(x).view(B, S, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, S, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.cp is not None:  # context parallelism: keys/values of every shard, in all_columns order
            k, v = self.cp.gather(k, dim=2), self.cp.gather(v, dim=2)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        probs = None
        if return_probs:
            with torch.no_grad():
                dtype = torch.promote_types(q.dtype, torch.float32)
                scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / math.sqrt(self.head_dim)
                probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1)), probs


class Indexer(nn.Module):
    """Lightning-indexer head after DeepSeek-V3.2 (DSA), trained only by the indexer KL loss.

    ``I[b, t, s] = Σ_h w_h(x_t) · relu(q_h(x_t) · k(x_s))`` with ``H`` small query heads, one shared
    key head (both RoPE-rotated, width ``d``) and per-query head weights ``w(x_t) = W_w x_t / sqrt(H)``;
    the dot products are scaled by ``1/sqrt(d)``. Masked keys get ``-inf``. The input is detached so the
    indexer loss does not reach the main model.
    """

    def __init__(self, dim: int, n_heads: int, head_dim: int, rope_theta: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_theta = n_heads, head_dim, rope_theta
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.ww = nn.Linear(dim, n_heads, bias=False)
        # Layout of the main attention around it (set by GPT.enable_context_parallel and by tensor
        # parallelism): keys are gathered over CP; the target heads over TP; under SP this rank scores
        # only its slice of the queries.
        self.cp: ContextParallel | None = None
        self.tp_mesh: DeviceMesh | None = None
        self.sequence_parallel = False

    def target(self, probs: Tensor) -> Tensor:
        """The KL target for this rank's queries from the main attention probabilities of its heads
        ``[B, H_local, Sq, Sk]``: every head (all-gathered over TP, in head order: column-wise sharding
        gives rank ``r`` a contiguous block of heads), queries cut to this rank's SP slice."""
        if self.tp_mesh is None:
            return probs
        group = self.tp_mesh.get_group()
        parts = [torch.empty_like(probs) for _ in range(self.tp_mesh.size())]
        dist.all_gather(parts, probs.contiguous(), group=group)
        full = torch.cat(parts, dim=1)
        return sp_shard(full, self.tp_mesh, dim=2) if self.sequence_parallel else full

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """Indexer logits ``[B, Sq, Sk]`` in ``max(dtype, float32)`` for the attention input ``x [B, S, dim]``
        (detached here), with ``-inf`` where ``mask [B|1, 1, S, Sk]`` is False. ``positions [B, S]`` are
        those of the attention's queries. Under context parallelism the keys of every shard are gathered
        (``Sk`` in the mask's key order); under sequence parallelism ``x`` is this TP rank's slice of the
        queries, and the keys are scored from the all-gathered sequence."""
        x = x.detach()
        B, Sq, _ = x.shape
        dtype = torch.promote_types(self.wq.weight.dtype, torch.float32)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, dtype)
        x_keys, cos_q, sin_q = x, cos, sin
        if self.sequence_parallel:
            mesh = self.tp_mesh
            assert mesh is not None  # tensor parallelism sets sequence_parallel together with tp_mesh
            x_keys = sp_gather(x, mesh, 1, partial_grad=False)
            cos_q, sin_q = sp_shard(cos, mesh), sp_shard(sin, mesh)
            mask = sp_shard(mask, mesh, dim=2)
        q = apply_rope(self.wq(x).view(B, Sq, self.n_heads, self.head_dim), cos_q, sin_q)
        k = apply_rope(self.wk(x_keys).view(B, x_keys.shape[1], 1, self.head_dim), cos, sin)
        if self.cp is not None:
            k = self.cp.gather(k, dim=1)  # with autograd: each shard's keys get their gradient back
        w = self.ww(x) / math.sqrt(self.n_heads)
        # The scores feed a KL against float32 attention probabilities: keep them out of bf16 autocast.
        with torch.autocast(device_type=x.device.type, enabled=False):
            qk = torch.einsum("bthd,bsd->bhts", q.to(dtype), k[:, :, 0].to(dtype)) / math.sqrt(self.head_dim)
            logits = torch.einsum("bth,bhts->bts", w.to(dtype), torch.relu(qk))
        return logits.masked_fill(~mask[:, 0], float("-inf"))
