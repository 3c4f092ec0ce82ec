"""The loss forward of the reference trainer: the model plus its output head applied by the fused linear
cross-entropy (gradients formed in the forward from the accountant's per-token weights) or the chunked one,
shared by the plain step (``trainer.py``) and the pipeline step (``pipeline.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..distributed.accountant import Accountant
from ..distributed.moe.accounting import ROUTER_TOKENS
from ..losses.cross_entropy import chunked_cross_entropy
from ..losses.fused_cross_entropy import fused_linear_cross_entropy
from ..losses.indexer import indexer_kl
from ..model import GPT

__all__ = [
    "LossForward",
    "RunDtypes",
    "run_dtypes",
    "head_loss_fn",
    "head_fused_fn",
    "head_losses",
    "head_weights",
    "microbatch_share",
    "indexer_share",
    "upcast",
]


@dataclass(frozen=True)
class RunDtypes:
    """The torch dtypes of a run's ``dtype`` setting: parameters, per-token losses and token weights, and the
    autocast dtype of the forward (``None``: no autocast)."""

    params: torch.dtype
    loss: torch.dtype
    autocast: torch.dtype | None


# The one mapping from TrainConfig.dtype: float64 runs (verify) stay float64; bf16 keeps float32 weights
# and losses and runs the forward under bf16 autocast.
_DTYPES = {
    "float64": RunDtypes(torch.float64, torch.float64, None),
    "float32": RunDtypes(torch.float32, torch.float32, None),
    "bf16": RunDtypes(torch.float32, torch.float32, torch.bfloat16),
}


def run_dtypes(name: str) -> RunDtypes:
    """The :class:`RunDtypes` of ``TrainConfig.dtype`` ``name`` (``float64``, ``float32`` or ``bf16``)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def upcast(x: Tensor) -> Tensor:
    """Low-precision losses are accumulated in float32; float64 runs (verify) stay float64. Never a view:
    FSDP2 hooks the module's outputs and warns about (and cannot protect) views."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous().clone() if x._is_view() else x


def head_loss_fn(gpt: GPT) -> Callable[[Tensor, Tensor], Tensor]:
    """Per-token cross-entropy ``ce(hidden [b,S,dim], labels [b,S]) -> [b,S]`` of ``gpt``'s output head:
    the chunked cross-entropy, vocabulary-parallel when tensor parallelism shards the head's rows (a
    ``DTensor``: each rank's partial logsumexps are combined over the head's mesh). The labels are trusted
    (the trainer checks them once per step on the host-side batch): no host read per microbatch."""

    local, vocab_parallel = _head_rows(gpt)
    return lambda h, lab: chunked_cross_entropy(h, local, lab, trusted_labels=True, **vocab_parallel)


def head_fused_fn(gpt: GPT) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``(h, labels, token_weights) -> (Σ w·l, l.detach())`` of ``gpt``'s output head by the fused linear
    cross-entropy (gradients formed in the forward), vocabulary-parallel like :func:`head_loss_fn`."""
    local, vocab_parallel = _head_rows(gpt)
    return lambda h, lab, w: fused_linear_cross_entropy(h, local, lab, w, trusted_labels=True, **vocab_parallel)


def _head_rows(gpt: GPT) -> tuple[Tensor, dict[str, Any]]:
    """The output head's rows held here and the vocabulary-parallel arguments of the cross-entropy
    functions: a TP-sharded head (``DTensor``) gives its local rows, its mesh group, first row and the
    full vocabulary size; a replicated head gives itself and no arguments."""
    weight = gpt.output.weight
    if not isinstance(weight, DTensor):
        return weight, {}
    mesh = weight.device_mesh
    local = weight.to_local()
    return local, {
        "vocab_parallel_group": mesh.get_group(),
        "vocab_start": mesh.get_local_rank() * local.shape[0],
        "vocab_size": weight.shape[0],
    }


def head_weights(
    acc: Accountant,
    loss_impl: str,
    dtype: torch.dtype,
    mask: Tensor,
    seg: Tensor,
    mtp_masks: list[Tensor],
    cols: Tensor | None,
) -> tuple[Tensor, list[Tensor]] | None:
    """The accountant's per-token weights of its next microbatch (main, per MTP depth) in the loss
    ``dtype``, for the fused head (``Σ w·l`` is exactly the microbatch's share of ``J``); ``None`` for the
    chunked head."""
    if loss_impl != "fused":
        return None
    main = acc.token_weights(mask, seg, columns=cols).to(dtype)
    mtp = acc.mtp_token_weights(mtp_masks, seg, columns=cols) if mtp_masks else []
    return main, [w.to(dtype) for w in mtp]


def head_losses(
    gpt: GPT,
    hidden: Tensor,
    mtp_hidden: list[Tensor],
    labels: Tensor,
    mtp_labels: list[Tensor],
    weights: tuple[Tensor, list[Tensor]] | None,
) -> tuple[Tensor, list[Tensor], tuple[Tensor, Tensor] | None]:
    """The output head on the final hidden states of the main head and of each MTP depth:
    ``(per_token_loss, [per_token_loss_k], shares)``. Chunked head (``weights`` ``None``): the losses carry
    the gradients and ``shares`` is ``None``. Fused head: ``shares = (Σ w·l, Σ_k Σ w_k·l_k)`` carry them
    (formed in the forward from the accountant's weights, :func:`head_weights`) and the losses are detached."""
    if weights is None:
        ce = head_loss_fn(gpt)
        return ce(hidden, labels), [ce(h, lab) for h, lab in zip(mtp_hidden, mtp_labels)], None
    fce = head_fused_fn(gpt)
    main_share, main = fce(hidden, labels, weights[0])
    parts = [fce(h, lab, w) for h, lab, w in zip(mtp_hidden, mtp_labels, weights[1])]
    mtp_share = sum((p[0] for p in parts), torch.zeros_like(main_share))
    return main, [p[1] for p in parts], (main_share, mtp_share)


def microbatch_share(
    acc: Accountant,
    head: tuple[Tensor, list[Tensor], tuple[Tensor, Tensor] | None],
    mask: Tensor,
    seg: Tensor,
    mtp_masks: list[Tensor],
    cols: Tensor | None,
) -> Tensor:
    """One microbatch's share of ``J`` from its head outputs (:func:`head_losses`), the language-model term
    plus the MTP term, accounted by ``acc``: ``lm_loss``/``mtp_loss`` of the per-token losses (chunked head)
    or ``add_lm_share``/``add_mtp_share`` of the fused head's shares. The one loss function of the plain
    and the pipelined step (``mask``/``seg``/``mtp_masks``: this rank's columns under context parallelism)."""
    per_tok, mtp_losses, shares = head
    if shares is None:
        loss = acc.lm_loss(per_tok, mask, seg, columns=cols)
        if mtp_losses:
            loss = loss + acc.mtp_loss(mtp_losses, mtp_masks, seg, columns=cols)
        return loss
    loss = acc.add_lm_share(shares[0], per_tok, mask, seg, columns=cols)
    if mtp_losses:
        loss = loss + acc.add_mtp_share(shares[1], mtp_losses, mtp_masks, seg, columns=cols)
    return loss


class LossForward(nn.Module):
    """The model plus its output head, as one module, so that an engine wrapping it (DDP) sees every
    parameter used inside its ``forward``.

    Returns ``(per_token_loss [b,S], [per_token_loss_k for MTP depths], [(logits, probs, topk_map,
    dispatch_map) per MoE layer], indexer outputs or None, shares)``; router records are flattened to
    tuples so DDP can walk them. ``weights = (main [b,S], [per MTP depth])`` (the accountant's per-token
    weights, :func:`head_weights`) selects the fused head: ``shares = (Σ w·l main, Σ_k Σ w_k·l_k)`` carry
    the gradients and the per-token losses are detached; without ``weights`` (chunked head) ``shares`` is
    ``None``."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(
        self,
        tokens: Tensor,
        labels: Tensor,
        mtp_labels: list[Tensor],
        segment_ids: Tensor,
        positions: Tensor,
        recompute: bool = False,
        autocast_dtype: torch.dtype | None = None,
        weights: tuple[Tensor, list[Tensor]] | None = None,
    ) -> tuple[
        Tensor, list[Tensor], list[tuple[Tensor, ...]], tuple[Tensor, Tensor] | None, tuple[Tensor, Tensor] | None
    ]:
        """Forward of whole rows ``tokens [b,S]``; under context parallelism the losses are those of this
        rank's columns (the labels are cut alike)."""
        if self.gpt.cp is not None:
            cols = self.gpt.cp.columns(tokens.shape[1]).to(tokens.device)
            labels, mtp_labels = labels[:, cols], [lab[:, cols] for lab in mtp_labels]
        with torch.autocast(tokens.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            # values were checked once per step on the host-side batch (Trainer.train_step): no host read here
            out = self.gpt(
                tokens, segment_ids=segment_ids, positions=positions, recompute=recompute, check_values=False
            )
            main, mtp, shares = head_losses(self.gpt, out.hidden, list(out.mtp_hidden), labels, mtp_labels, weights)
        routers: list[tuple[Tensor, ...]] = [(r.logits, r.probs, r.topk_map, r.dispatch_map) for r in out.routers]
        return upcast(main), [upcast(x) for x in mtp], routers, out.indexer, shares


def indexer_share(
    acc: Accountant, coeff: float, indexer: tuple[Tensor, Tensor], valid: Tensor, *, per_rank: bool = False
) -> Tensor:
    """DeepSeek-V3.2 indexer loss share of one microbatch in its invariant form ``c·Σ_t KL_t / Tq_global``
    (docs/semantics.md §5): ``indexer = (target probs, indexer logits)`` of this rank's queries, ``valid``
    their non-padding map, ``Tq_global`` the step's non-padding query tokens. Logged as the global mean of
    ``KL_t``; ``per_rank``: this rank's queries are distinct from its TP peers' (sequence parallelism)."""
    probs, logits = indexer
    kl = indexer_kl(probs, logits, valid)
    tq = max(acc.global_count(ROUTER_TOKENS), 1.0)
    share = coeff * kl / tq
    acc.record("indexer_loss", kl.detach(), valid.sum())  # a device count: no host sync per microbatch
    acc.record("objective_local" if per_rank else "objective", share)
    return share
