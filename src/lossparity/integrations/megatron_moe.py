"""Megatron-core MoE and MTP terms with lossparity's semantics (docs/semantics.md §4, §5), both channels.

:class:`MoETerms` replaces megatron-core's own application of the router load-balancing loss, the router
z-loss and the multi-token-prediction (MTP) loss. It reads their coefficients from the model config
(``moe_aux_loss_coeff`` = α, ``moe_z_loss_coeff`` = β, ``mtp_loss_scaling_factor`` = λ) and then sets
them to zero on that config, so Megatron computes none of them in the gradient (never twice). Per forward
it captures, with PyTorch forward hooks (Megatron is not patched):

- each ``TopKRouter``'s input; the router logits are re-evaluated from it with Megatron's own
  ``router_gating_linear`` (the same weights, so the gradient reaches the router and the layer below),
  giving the scores ``p`` (:func:`lossparity.losses.moe.router_scores`) and the plain top-k map;
- the MTP logits of every depth (the first ``Dm`` calls of the output layer in a forward) and the labels
  passed to the model, whose per-token losses are Megatron's own ``compute_language_model_loss``; Megatron
  gets those logits detached, so its own (zero-weighted) MTP term stays out of the graph (megatron-core
  0.16.1 divides it by the shard's MTP token count: NaN on a context-parallel shard without MTP tokens).

The objective of the step is ``J = J_lm + λ/Dm · Σ_k J_k + Σ_l A_l + β · Σ_l Σ_x lse_l(x)² / T``
(``T`` the router tokens of the global batch, ``J_k`` the active mode on depth ``k`` with the
accountant's ``own`` convention, ``A_l`` the Switch term of layer ``l`` at the chosen scope:

| aux_scope       | ``A_l``                                                                       |
|-----------------|-------------------------------------------------------------------------------|
| ``microbatch`` | mean over the ``D·M`` microbatches of ``A(X_mb)``, ``X_mb`` with its TP-SP    |
|                 | and CP shards (counts all-reduced over that row group)                        |
| ``sequence``     | mean over the ``N`` rows of the global batch of ``A(row)``, each row's counts |
|                 | all-reduced over its TP-SP and CP shards (Megatron's ``seq_aux_loss``)        |
| ``global_lagged``| ``α·E/k · Σ_e f_e^prev · Σ_{x in batch} p[x,e] / T``; ``f^prev`` the previous |
|                 | step's global top-k fractions (``k/E`` at the first step)                     |
| ``none``        | 0                                                                             |

Gradients: Megatron divides every gradient by ``R = M·dp·cp`` (``calculate_per_token_loss=True``: the
summed returned counts, 1 per microbatch here) or averages them over ``dp·cp`` and divides the returned
loss by ``M`` (``False``). The language-model and MTP shares are returned by ``LossFunc`` multiplied by
``R``; the router shares are attached to the router's output (as Megatron's ``MoEAuxLossAutoScaler``
does) with the weight ``R`` or ``dp·cp``; so the step's gradient is ``∇J`` for either flag, any
micro-batch size, number of microbatches and data, tensor-sequence and context-parallel layout
and pipeline stages (the MoE layers are numbered over the whole model once, at construction).
Context parallelism, every mode: ``begin_step`` takes the whole rows (and segment ids), computes the
row, document and depth counts there and hands each rank the coefficients of its zig-zag shard (see
:meth:`MoETerms.begin_step`); the MTP labels are rolled with Megatron's CP-aware ``roll_tensor``.
The ``microbatch`` scope under TP-SP or CP all-reduces each router forward's counts over the ranks
holding the microbatch's shards (as Megatron does). A forward without gradients
(the first pass of a reentrant recompute, evaluation) records nothing: the recomputed forward, which
back-propagates, records the terms once.

Logs (:meth:`MoETerms.end_step`, one all-reduce over the world): ``lm_loss`` (``S/Ntok``),
``objective`` (``J``), the scope's aux loss (``load_balancing_loss`` or ``global_load_balancing_loss``:
``A_l/α`` averaged over MoE layers), ``z_loss`` (``Σ_x lse²/T`` averaged over layers), ``mtp_<k>_loss``
(``S_k/Ntok_k``) and ``max_vio`` (of the step's dispatch counts, averaged over layers), identical on
every rank. Aux-loss-free expert biases are left to Megatron's own update in ``finalize_model_grads``,
which already counts each token once from counts summed over TP×DP×CP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..losses.moe import (
    max_violation,
    router_scores,
    router_z_loss_sums,
    switch_load_balancing_weights,
    topk_routing_map,
)
from ..losses.mtp import mtp_denominators, roll_mask
from ..options import ALIASES
from ._common import AttachGrad, mode_coefficients, mode_numerator, unit_count
from .megatron_pipeline import check_model_chunks

__all__ = ["TERMS_SCOPES", "MoETerms", "zigzag_positions"]

TERMS_SCOPES = ("microbatch", "sequence", "global_lagged", "none")
_AUX_LOG = {
    "microbatch": "load_balancing_loss",
    "sequence": "seq_load_balancing_loss",
    "global_lagged": "global_load_balancing_loss",
}
# why a scope of docs/semantics.md §5 is not fed by MoETerms (one error on every rank, at construction)
_REFUSED = {
    "global_running": "it is Megatron's running mean over the step's microbatches, which depends on the "
    "microbatch order and the layout by construction (docs/semantics.md §5); MoETerms applies layout-invariant "
    "scopes: use 'global_lagged' (or Megatron's own moe_router_load_balancing_type='global_aux_loss' for parity)",
}


def _chunks(model: Any) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.nn.Module):
            raise TypeError(f"model: chunk {i} is a {type(c).__name__}, expected a torch.nn.Module")
    return chunks


def zigzag_positions(rank: int, cp: int, seq: int, device: Any = None) -> Tensor:
    """The positions of a whole row held by context-parallel rank ``rank`` in Megatron's
    ``get_batch_on_this_cp_rank`` layout: the row cut into ``2·cp`` chunks, rank ``r`` holding chunks ``r``
    and ``2·cp-1-r`` (in that order)."""
    c = seq // (2 * cp)
    idx = torch.arange(seq, device=device).view(2 * cp, c)
    return torch.cat([idx[rank], idx[2 * cp - 1 - rank]])


def _router_slots(chunks: list[torch.nn.Module], router_cls: Any, pp: int) -> tuple[dict[int, int], int]:
    """A slot per MoE layer of the whole model, the same on every rank: with pipeline stages, the
    routers' (MTP?, global layer number) keys are gathered once over the world."""
    local = [
        (id(m), ("mtp" in name.split("."), int(m.layer_number)))
        for c in chunks
        for name, m in c.named_modules()
        if isinstance(m, router_cls)
    ]
    if pp == 1:
        return {rid: i for i, (rid, _) in enumerate(local)}, len(local)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [key for _, key in local])
    keys = sorted({tuple(k) for ks in gathered for k in ks})
    return {rid: keys.index(key) for rid, key in local}, len(keys)


def _row_size(ps: Any) -> int:
    return int(ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size())


class MoETerms:
    """Exact MoE (router aux, z-loss) and MTP terms for megatron-core training (module docstring).

    Protocol per step: ``begin_step(loss_masks)`` → Megatron's ``forward_backward_func`` with
    ``LossFunc(mode, config=config, terms=terms)`` → ``finalize_model_grads`` → ``end_step()``.

    Args:
        model: the model chunks (a list, as Megatron's schedules take them) or one module.
        config: the model's ``TransformerConfig``; α, β, λ are read from it, then zeroed on it.
        aux_scope: one of :data:`TERMS_SCOPES`.
    """

    def __init__(self, model: Any, config: Any, aux_scope: str = "global_lagged") -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        scope = ALIASES["aux_scope"].get(aux_scope, aux_scope) if isinstance(aux_scope, str) else aux_scope
        if scope in _REFUSED:
            raise ValueError(f"aux_scope: {aux_scope!r} is not fed by MoETerms: {_REFUSED[scope]}")
        if scope not in TERMS_SCOPES:
            raise ValueError(
                f"aux_scope: {aux_scope!r} is not one MoETerms can feed from Megatron's router; "
                f"choose one of {TERMS_SCOPES}"
            )
        self.aux_scope = scope
        self.config = config
        chunks = _chunks(model)
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        check_model_chunks(chunks, config)
        self._check_config(config, ps)
        # (with pipeline stages one collective: a stage without MoE layers is fine, a model without any is not)
        self._slot, self.n_layers = _router_slots(chunks, TopKRouter, ps.get_pipeline_model_parallel_world_size())
        if not self.n_layers:
            raise ValueError("model: no MoE layer (megatron TopKRouter) found; MoETerms needs a MoE model")
        self.alpha = float(config.moe_aux_loss_coeff or 0.0) if aux_scope != "none" else 0.0
        self.beta = float(config.moe_z_loss_coeff or 0.0)
        self.depths = int(config.mtp_num_layers or 0)
        self.lam = float(config.mtp_loss_scaling_factor or 0.0) if self.depths else 0.0
        self.topk, self.num_experts = int(config.moe_router_topk), int(config.num_moe_experts)
        self.score_function = config.moe_router_score_function
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp, self.cp = ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp > 1 else None
        self.row_group = ps.get_tensor_and_context_parallel_group() if _row_size(ps) > 1 else None
        # Megatron's own application is replaced: zero its coefficients (routers share this config).
        for cfg in {id(c): c for c in [config] + [r.config for r in self.routers]}.values():
            cfg._lossparity_moe_terms = True
            cfg.moe_aux_loss_coeff = 0.0
            cfg.moe_z_loss_coeff = None
            if self.depths:
                cfg.mtp_loss_scaling_factor = 0.0
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        n_layers = self.n_layers
        self._frac_prev = torch.full((n_layers, self.num_experts), self.topk / self.num_experts, dtype=torch.float64)
        self.mode: str | None = None
        self.fixed_length: int | None = None
        self._begun = False
        self._handles = [r.register_forward_hook(self._router_hook, with_kwargs=True) for r in self.routers]
        self._gpt = [m for c in chunks for m in c.modules() if getattr(m, "mtp_process", False)]
        if self.depths and self._gpt:
            for g in self._gpt:
                self._handles.append(g.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
                out_layer: Any = g.output_layer
                self._handles.append(out_layer.register_forward_hook(self._output_hook))
        self._mtp_logits: list[Tensor] = []
        self._labels: Tensor | None = None
        # context parallelism: per microbatch, per depth (0 = the LM term), (shard mask, shard coefficients)
        self._cp_tables: list[list[tuple[Tensor, Tensor]]] | None = None

    def remove(self) -> None:
        """Remove the forward hooks (Megatron's coefficients stay zero on the config)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ configuration
    def _check_config(self, config: Any, ps: Any) -> None:
        if isinstance(getattr(config, "moe_aux_loss_coeff", 0.0), (list, tuple)):
            raise ValueError("config.moe_aux_loss_coeff: a list (several aux types) is not supported by MoETerms")
        if getattr(config, "moe_input_jitter_eps", None) or getattr(config, "moe_router_force_load_balancing", False):
            raise ValueError(
                "config.moe_input_jitter_eps / moe_router_force_load_balancing: the router logits would not be "
                "reproducible from the router input"
            )
        if any(getattr(c, "_lossparity_moe_terms", False) for c in [config] + [r.config for r in self.routers]):
            raise ValueError("config: its MoE/MTP coefficients were already taken over by another MoETerms")
        if ps.get_tensor_model_parallel_world_size() > 1 and not config.sequence_parallel:
            raise ValueError("config.sequence_parallel: MoE with tensor parallelism needs sequence parallelism")

    def bind(self, mode: str, fixed_length: int | None) -> None:
        """Called by ``LossFunc(..., terms=self)``: the mode of ``J_lm`` and ``J_k``."""
        if self.mode is not None and self.mode != mode:
            raise ValueError(f"terms: already bound to a LossFunc of mode {self.mode!r}, got {mode!r}")
        if self.aux_scope == "sequence" and mode == "per_document":
            raise ValueError(
                "mode: 'per_document' with aux_scope 'sequence' would make each document a sequence (docs/"
                "semantics.md §5), but Megatron's router sees rows: use aux_scope 'microbatch' or 'global_lagged'"
            )
        self.mode, self.fixed_length = mode, fixed_length

    # ------------------------------------------------------------------ protocol
    def begin_step(self, loss_masks: Sequence[Tensor], segment_ids: Sequence[Tensor] | None = None) -> None:
        """Start a step from this rank's microbatch loss masks (``[b, s]`` each; with ``per_document``
        also their segment ids): one all-reduce of the global unit, token and MTP-depth counts.

        Under context parallelism the masks and segment ids are the *whole* rows (``[b, S]``, before
        Megatron's ``get_batch_on_this_cp_rank``), while ``LossFunc`` receives this rank's zig-zag shard
        (chunks ``r`` and ``2cp-1-r`` of ``2cp``): the rows' and documents' counts ``n_i``, ``n_j`` (and
        those of every MTP depth) are then whole-row counts with no extra collective, and each shard's
        numerator is ``Σ_t c_t·s_t`` with ``c = ∂num/∂s`` of the whole row (the numerators are linear in
        the per-token losses), sliced to the shard.
        Raises ``RuntimeError`` if the previous step was not ended, ``ValueError`` on bad masks."""
        if self.mode is None:
            raise RuntimeError("terms.begin_step: build LossFunc(mode, config=config, terms=terms) first")
        if self._begun:
            raise RuntimeError("terms.begin_step: the previous step was not ended (call terms.end_step())")
        masks = list(loss_masks)
        if not masks:
            raise ValueError("loss_masks: need the mask of at least one microbatch")
        if self.mode == "per_document" and (segment_ids is None or len(segment_ids) != len(masks)):
            raise ValueError("segment_ids: mode 'per_document' needs one segment-id tensor per microbatch mask")
        segs = list(segment_ids) if segment_ids is not None else [None] * len(masks)
        for i, m in enumerate(masks):
            if not isinstance(m, Tensor) or m.dim() != 2:
                raise ValueError(f"loss_masks[{i}]: expected a [b, s] tensor, got {getattr(m, 'shape', m)!r}")
            if self.cp > 1 and m.shape[1] % (2 * self.cp):
                raise ValueError(
                    f"loss_masks[{i}]: under context parallelism (cp={self.cp}) begin_step takes the whole rows, "
                    f"whose length must be a multiple of 2·cp; got shape {tuple(m.shape)}"
                )
        stats = torch.zeros(3 + self.depths, dtype=torch.float64, device=masks[0].device)
        doc_ids = self.mode == "per_document"
        self._cp_tables = [] if self.cp > 1 else None
        for m, s in zip(masks, segs):
            w = m.to(torch.float64)
            stats[0] += unit_count(self.mode, w, s).to(torch.float64)
            stats[1] += w.sum()
            stats[2] += w.numel()
            rolled = [roll_mask(w, s if doc_ids else None, k) for k in range(1, self.depths + 1)]
            for k, w_k in enumerate(rolled, start=1):
                stats[2 + k] += w_k.sum()
            if self._cp_tables is not None:  # this rank's shard of each depth's mask and coefficients
                pos = zigzag_positions(self.cp_rank, self.cp, w.shape[1], w.device)
                self._cp_tables.append(
                    [(x[:, pos], mode_coefficients(self.mode, x, s, self.fixed_length)[:, pos]) for x in [w, *rolled]]
                )
        # TP ranks, PP stages and (whole rows) CP ranks hold the same rows: count them once
        if self.tp_rank != 0 or self.pp_rank != 0 or self.cp_rank != 0:
            stats.zero_()
        dist.all_reduce(stats)
        units, ntok, self._tokens = (float(x) for x in stats[:3].tolist())
        self._rows = self._tokens / masks[0].shape[1]  # whole rows of the global batch (sequence scope)
        self._ntok = ntok
        self._den = max(ntok, 1.0) if self.mode == "per_token" else max(units, 1.0)
        self._depth_tokens = [float(x) for x in stats[3:].tolist()]
        self._mtp_den = mtp_denominators(self.mode, "own", self._den, self._depth_tokens) if self.depths else []
        self.num_microbatches = len(masks)
        r = self.num_microbatches * self.dp * self.cp
        self.loss_weight = float(r)
        self.router_weight = float(r if self.config.calculate_per_token_loss else self.dp * self.cp)
        n_layers, e = self.n_layers, self.num_experts
        dev = masks[0].device
        self._frac_prev = self._frac_prev.to(dev)
        self._lagged_k = switch_load_balancing_weights(
            self._frac_prev, 1.0, self._tokens, topk=self.topk, num_experts=e, coeff=self.alpha
        )
        self._acc = torch.zeros(2 + 2 * self.depths + 2 * n_layers + 2 * n_layers * e, dtype=torch.float64, device=dev)
        self._loss_calls = 0
        self._begun = True

    def _require_begun(self, where: str) -> None:
        if not self._begun:
            raise RuntimeError(f"{where}: MoETerms.begin_step(loss_masks) was not called for this step")

    # ------------------------------------------------------------------ router terms
    def _router_hook(self, router: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if not (router.training and torch.is_grad_enabled()):
            return None  # evaluation, or the no-grad first pass of a recompute: the re-run records
        self._require_begun(f"router of layer {router.layer_number}")
        if (len(args) > 1 and args[1] is not None) or kwargs.get("padding_mask") is not None:
            raise ValueError(f"padding_mask: router of layer {router.layer_number}: MoETerms counts every token")
        from megatron.core.transformer.moe.moe_utils import router_gating_linear

        hidden = args[0] if args else kwargs["input"]
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, hidden.dtype)
        logits = router_gating_linear(hidden, router.weight, router.bias, dtype).reshape(-1, self.num_experts)
        probs_out, routing_map = output
        slot, e, n_layers = self._slot[id(router)], self.num_experts, self.n_layers
        _, p = router_scores(logits, self.score_function)
        top = topk_routing_map(p, self.topk)  # the plain top-k the aux loss counts
        counts = top.sum(dim=0).to(torch.float64)
        sums = p.sum(dim=0)
        if self.aux_scope == "global_lagged":
            weights = self._lagged_k[slot].to(sums.dtype)
            aux = (weights * sums).sum()
        elif self.aux_scope == "microbatch":
            ct = torch.cat([counts, counts.new_full((1,), float(logits.shape[0]))])
            if self.row_group is not None:  # the microbatch's tokens are split over TP-SP and CP
                dist.all_reduce(ct, group=self.row_group)
            weights = switch_load_balancing_weights(ct[:e], ct[e], topk=self.topk, num_experts=e, coeff=self.alpha).to(
                sums.dtype
            )
            aux = (weights * sums).sum() / (self.dp * self.num_microbatches)
        elif self.aux_scope == "sequence":
            aux = _sequence_aux(self, hidden, top, p)
        else:
            aux = sums.sum() * 0.0
        z_sum = router_z_loss_sums(logits) / self._tokens
        term = aux + self.beta * z_sum
        base = 2 + 2 * self.depths
        acc = self._acc
        acc[base + slot] += aux.detach().to(torch.float64) / (self.alpha or 1.0)
        acc[base + n_layers + slot] += z_sum.detach().to(torch.float64)
        off = base + 2 * n_layers
        acc[off + slot * e : off + (slot + 1) * e] += counts
        off += n_layers * e
        acc[off + slot * e : off + (slot + 1) * e] += routing_map.reshape(-1, e).sum(dim=0).to(torch.float64)
        probs_out = AttachGrad.apply(probs_out, term, self.router_weight, self.config)
        return probs_out, routing_map

    # ------------------------------------------------------------------ MTP capture
    def _model_pre_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._mtp_logits = []
        self._labels = kwargs.get("labels", args[4] if len(args) > 4 else None)

    def _output_hook(self, module: Any, args: tuple, output: Any) -> Any:
        if not (torch.is_grad_enabled() and len(self._mtp_logits) < self.depths):
            return None
        logits = output[0] if isinstance(output, tuple) else output
        self._mtp_logits.append(logits)
        # Megatron computes its own MTP term from these logits, weighted 0 by __init__, but e.g. 0.16.1 with
        # calculate_per_token_loss=False divides it by the shard's MTP token count: 0·(0/0) = NaN in the
        # forward and in every gradient on a context-parallel shard without MTP tokens. Megatron gets
        # detached logits, so its term stays out of the graph on every release (the gradient comes from ours).
        detached = logits.detach()
        return (detached, *output[1:]) if isinstance(output, tuple) else detached

    def loss_share(
        self, mode: str, loss: Tensor, mask: Tensor, segment_ids: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """This microbatch's returned loss ``R·(num_lm/G + λ/Dm·Σ_k num_k/G_k)`` (module docstring), with
        its LM numerator and token sum for the logs. Called by ``LossFunc``."""
        self._require_begun("LossFunc")
        table = self._cp_table(loss)
        if table is None:
            num, _ = mode_numerator(mode, loss, mask, segment_ids, self.fixed_length)
        else:  # context parallelism: whole-row coefficients of this shard (begin_step)
            mask = table[0][0].to(loss.dtype)
            num = (loss * table[0][1].to(loss.dtype)).sum()
        share = num / self._den
        acc = self._acc
        s_tok = (loss.detach() * mask).sum().to(torch.float64)
        own = 1.0 if self.tp_rank == 0 else 0.0
        acc[0] += own * s_tok
        acc[1] += own * num.detach().to(torch.float64)
        if self.depths:
            share = share + self._mtp_share(mode, loss, mask, segment_ids, own, table)
        self._loss_calls += 1
        return share * self.loss_weight, num, s_tok

    def _cp_table(self, loss: Tensor) -> list[tuple[Tensor, Tensor]] | None:
        """Under context parallelism: this microbatch's (shard mask, shard coefficients) per depth."""
        if self._cp_tables is None:
            return None
        if self._loss_calls >= len(self._cp_tables):
            raise RuntimeError(
                f"LossFunc: call {self._loss_calls + 1} of a step begun with {len(self._cp_tables)} microbatch masks"
            )
        table = self._cp_tables[self._loss_calls]
        if table[0][0].shape != loss.shape:
            raise ValueError(
                f"output_tensor: shape {tuple(loss.shape)} on context-parallel rank {self.cp_rank}, microbatch "
                f"{self._loss_calls}: expected {tuple(table[0][0].shape)}, this rank's zig-zag shard of the whole "
                "rows given to terms.begin_step (which takes the rows before get_batch_on_this_cp_rank)"
            )
        return table

    def _mtp_share(
        self,
        mode: str,
        loss: Tensor,
        mask: Tensor,
        segment_ids: Tensor | None,
        own: float,
        table: list[tuple[Tensor, Tensor]] | None,
    ) -> Tensor:
        if len(self._mtp_logits) != self.depths or self._labels is None:
            raise RuntimeError(
                f"LossFunc: the forward produced {len(self._mtp_logits)} MTP logits for mtp_num_layers="
                f"{self.depths} (labels {'missing' if self._labels is None else 'given'}); pass labels= to the model"
            )
        model: Any = self._gpt[0]
        labels = self._labels
        share = loss.new_zeros(())
        rolled = labels
        for k, logits in enumerate(self._mtp_logits, start=1):
            if table is not None:  # the rows are split over CP: Megatron's own CP-aware roll of the labels
                from megatron.core.transformer.multi_token_prediction import roll_tensor

                rolled = roll_tensor(rolled, shifts=-1, dims=-1, cp_group=self.cp_group)[0]
                loss_k = model.compute_language_model_loss(rolled, logits).view_as(loss)
                w_k = table[k][0].to(loss.dtype)  # the whole row's depth-k mask, this shard of it
                num_k = (loss_k * table[k][1].to(loss.dtype)).sum()
            else:
                rolled = torch.zeros_like(labels)
                rolled[:, : labels.shape[1] - k] = labels[:, k:]
                w_k = roll_mask(mask, segment_ids if mode == "per_document" else None, k)
                loss_k = model.compute_language_model_loss(rolled, logits).view_as(loss)
                num_k, _ = mode_numerator(mode, loss_k, w_k, segment_ids, self.fixed_length)
            share = share + num_k * (self.lam / self.depths / self._mtp_den[k - 1])
            self._acc[1 + 2 * k - 1] += own * (loss_k.detach() * w_k).sum().to(torch.float64)
            self._acc[1 + 2 * k] += own * num_k.detach().to(torch.float64)
        self._mtp_logits, self._labels = [], None
        return share

    # ------------------------------------------------------------------ end of step
    def end_step(self) -> dict[str, float]:
        """The step's logs (module docstring), identical on every rank: one all-reduce over the world.
        Also stores this step's global top-k fractions for the next ``global_lagged`` step."""
        self._require_begun("terms.end_step")
        if self._loss_calls != (self.num_microbatches if self.last_stage else 0):
            self._begun = False
            raise RuntimeError(
                f"terms.end_step: LossFunc ran {self._loss_calls} times for {self.num_microbatches} microbatch masks"
            )
        acc = self._acc
        dist.all_reduce(acc)
        self._begun = False
        n_layers, e, d = self.n_layers, self.num_experts, self.depths
        base = 2 + 2 * d
        aux_l, z_l = acc[base : base + n_layers], acc[base + n_layers : base + 2 * n_layers]
        top = acc[base + 2 * n_layers : base + 2 * n_layers + n_layers * e].view(n_layers, e)
        disp = acc[base + 2 * n_layers + n_layers * e :].view(n_layers, e)
        self._frac_prev = top / self._tokens
        logs = {"lm_loss": float(acc[0]) / max(self._ntok, 1.0)}
        objective = float(acc[1]) / self._den
        for k in range(1, d + 1):
            logs[f"mtp_{k}_loss"] = float(acc[1 + 2 * k - 1]) / max(self._depth_tokens[k - 1], 1.0)
            objective += self.lam / d * float(acc[1 + 2 * k]) / self._mtp_den[k - 1]
        objective += self.alpha * float(aux_l.sum()) + self.beta * float(z_l.sum())
        logs["objective"] = objective
        if self.aux_scope != "none":
            logs[_AUX_LOG[self.aux_scope]] = float(aux_l.mean())
        logs["z_loss"] = float(z_l.mean())
        logs["max_vio"] = float(max_violation(disp).mean())
        return logs


def _sequence_aux(terms: MoETerms, hidden: Tensor, top: Tensor, p: Tensor) -> Tensor:
    """This shard's part of ``Σ_rows A(row) / N``: the router input is ``[s, b, H]`` (``s`` this rank's
    TP-SP and CP part of each row), each row's top-k counts are all-reduced over the row group, and
    ``A(row) = α·E/(k·L²)·Σ_e c_e(row)·Σ_{x in row} p[x,e]`` with ``L`` the whole row's length."""
    if hidden.dim() != 3:
        raise ValueError(f"router input: shape {tuple(hidden.shape)}; the sequence scope needs [s, b, H] rows")
    s_loc, b, e = hidden.shape[0], hidden.shape[1], terms.num_experts
    counts = top.view(s_loc, b, e).sum(dim=0).to(torch.float64)  # [b, E]
    length = torch.full((1,), float(s_loc), dtype=torch.float64, device=counts.device)
    ct = torch.cat([counts.reshape(-1), length])
    if terms.row_group is not None:  # a row's tokens are split over TP-SP and CP
        dist.all_reduce(ct, group=terms.row_group)
    weights = switch_load_balancing_weights(
        ct[:-1].view(b, e), ct[-1], topk=terms.topk, num_experts=e, coeff=terms.alpha
    ).to(p.dtype)
    return (weights * p.view(s_loc, b, e).sum(dim=0)).sum() / terms._rows
