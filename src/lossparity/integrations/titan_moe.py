"""torchtitan MoE models (DeepSeek-V3, Qwen3-MoE, ...) with lossparity's router terms (docs/semantics.md §5).

torchtitan 0.3.0's ``MoE`` layers have no auxiliary loss: they route with an aux-loss-free expert bias
(``expert_bias_E``) that an optimizer pre-step hook updates from ``tokens_per_expert_E``, a counter the
forward adds to (twice per token under activation checkpointing; the hook halves it for full AC only, and
the MTP layers' MoE are never updated). :class:`TitanMoETerms` adds the exact terms, with PyTorch forward
hooks on the routers (no torchtitan file is edited):

``J = J_lm + Σ_l A_l + β · Σ_l Σ_x lse_l(x)² / T``

with ``T`` the router tokens of the step's global batch (every token the router sees, padding included,
as torchtitan routes it), ``lse_l(x)`` the log-sum-exp of layer ``l``'s gate logits and ``A_l`` the Switch
term ``α·E/k·Σ_e f_e·P_e`` of the chosen scope (``c_e`` plain top-k counts of the unbiased scores ``p``,
``P_e = Σ_x p[x,e]``, :func:`lossparity.losses.moe.switch_load_balancing_weights`):

| aux_scope        | ``A_l``                                                                          |
|------------------|----------------------------------------------------------------------------------|
| ``microbatch``   | mean over the step's ``M`` microbatches (all ranks) of ``A(X_mb)``               |
| ``sequence``     | mean over the ``N`` rows of the global batch of ``A(row)``                       |
| ``global_lagged``| ``α·E/k · Σ_e f_e^prev · Σ_{x in batch} p[x,e] / T``, ``f^prev`` the previous     |
|                  | step's global top-k fractions (``k/E`` at the first step)                        |
| ``none``         | 0                                                                                |

Each router forward attaches its share of these terms to its ``topk_scores`` output (an identity whose
backward adds the share's gradient), so the gradient torchtitan sums over microbatches and ranks is
``∇J`` for any gradient accumulation and data-parallel layout. The gate logits are those of the router's
own ``gate`` (a forward hook reads them), so the gradient reaches the gate and the layers below.

Activation checkpointing counts once: a checkpoint re-run executes inside the backward pass (autograd's
current graph task), where the hook recomputes the same share (non-reentrant checkpointing needs the
same saved tensors) but counts nothing; a reentrant checkpoint's first, gradient-free pass counts and
attaches nothing, its re-run attaches.

Expert bias: lossparity owns the update when the MoE has ``load_balance_coeff`` (the rate ``u``):
``b_e += u·sign(mean(c) − c_e)`` centred to mean 0 (torchtitan's formula,
:func:`lossparity.losses.moe.expert_bias_update` with ``zero_mean``), once per step, from the dispatch
counts ``c`` (top-k of the biased scores) of the whole global batch, each token counted once, for every
MoE layer including MTP layers. torchtitan's counter is emptied after each MoE forward, so its own hook
adds ``u·sign(0) = 0``.

Protocol per step (done by :class:`~lossparity.integrations.torchtitan.LossParityTitanMixin` when the
trainer has ``moe_terms``): ``begin_step(labels, group)`` before the first forward, then torchtitan's
forward/backward, then ``end_step(group)`` (one all-reduce), which returns the logs under lossparity's
names: ``load_balancing_loss`` / ``seq_load_balancing_loss`` / ``global_load_balancing_loss`` (``A_l/α``
averaged over MoE layers), ``z_loss`` (``Σ_x lse²/T`` averaged over layers), ``max_vio`` (of the step's
dispatch counts, averaged over layers) and ``moe_terms`` (``Σ_l A_l + β·Σ_l z_l``, what the objective adds to
torchtitan's ``loss``). ``end_step`` refuses a step in which a layer's router did not route each of the
``T`` tokens exactly once (a forward outside the step's microbatches would bias ``f`` and the bias update).

Pipeline parallelism: each rank's ``TitanMoETerms`` holds its stages' MoE layers; ``T``, ``N`` and ``M`` come
from the step's labels, which every stage fetches. At their first step torch's pipeline stages infer tensor
metadata with one extra forward and backward (gradients on; the first microbatch on the first stage,
uninitialized tensors of the received shapes on the others): forwards inside :meth:`paused` are left out,
and the mixin runs that inference there. ``end_step(group, pipeline_group)`` sums the logs over the stages.
Not supported (refused by the mixin): tensor, expert and context parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..losses.moe import (
    expert_bias_update,
    max_violation,
    router_scores,
    router_z_loss_sums,
    switch_load_balancing_weights,
    topk_routing_map,
)
from ..options import ALIASES
from . import require
from ._common import AttachGrad

__all__ = ["TITAN_SCOPES", "TitanMoETerms"]

TITAN_SCOPES = ("microbatch", "sequence", "global_lagged", "none")
_AUX_LOG = {
    "microbatch": "load_balancing_loss",
    "sequence": "seq_load_balancing_loss",
    "global_lagged": "global_load_balancing_loss",
}


def _in_backward() -> bool:
    """True while autograd executes a backward pass on this thread: where a checkpoint re-runs a forward."""
    return bool(torch._C._current_graph_task_id() != -1)


def _check_coeff(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)


class TitanMoETerms:
    """Router load-balancing and z-loss terms and the expert-bias update for torchtitan MoE models
    (module docstring).

    Args:
        model_parts: torchtitan's ``model_parts`` (a list of modules) or one module; every
            ``torchtitan.models.common.moe.MoE`` inside (main and MTP layers) is a layer ``l``.
        aux_scope: one of :data:`TITAN_SCOPES` (aliases of ``lossparity.options.ALIASES`` accepted).
        aux_coeff: ``α`` (torchtitan has no aux-loss coefficient of its own).
        z_coeff: ``β``.
        expert_bias: lossparity updates the expert biases (module docstring); False leaves torchtitan's own hook.
    """

    def __init__(
        self,
        model_parts: Any,
        aux_scope: str = "global_lagged",
        aux_coeff: float = 1e-3,
        z_coeff: float = 0.0,
        *,
        expert_bias: bool = True,
    ) -> None:
        require("torchtitan", "torchtitan")
        from torchtitan.models.common.moe import MoE

        scope = ALIASES["aux_scope"].get(aux_scope, aux_scope) if isinstance(aux_scope, str) else aux_scope
        if scope not in TITAN_SCOPES:
            raise ValueError(f"aux_scope: {aux_scope!r} is not one TitanMoETerms feeds; choose one of {TITAN_SCOPES}")
        self.aux_scope = scope
        self.alpha = _check_coeff("aux_coeff", aux_coeff) if scope != "none" else 0.0
        self.beta = _check_coeff("z_coeff", z_coeff)
        parts = list(model_parts) if isinstance(model_parts, (list, tuple)) else [model_parts]
        named = [(n, m) for p in parts for n, m in p.named_modules() if isinstance(m, MoE)]
        self.moes: list[Any] = [m for _, m in named]
        self._names = [n for n, _ in named]  # for the errors: slot l is the model's module of that name
        if not self.moes:
            raise ValueError("model_parts: no torchtitan MoE layer found; TitanMoETerms needs a MoE model")
        routers = [m.router for m in self.moes]
        self.num_experts, self.topk = int(routers[0].num_experts), int(routers[0].top_k)
        for i, r in enumerate(routers):
            if (int(r.num_experts), int(r.top_k)) != (self.num_experts, self.topk):
                raise ValueError(
                    f"model_parts: MoE layer {i} has (experts, top_k) ({r.num_experts}, {r.top_k}); "
                    f"layer 0 has ({self.num_experts}, {self.topk})"
                )
            if r.score_func not in ("softmax", "sigmoid"):
                raise ValueError(f"model_parts: MoE layer {i} router score_func {r.score_func!r} is not supported")
            if getattr(r, "_debug_force_load_balance", False):
                raise ValueError(
                    f"model_parts: MoE layer {i} forces round-robin routing (debug.moe_force_load_balance)"
                )
        self._slot = {id(r): i for i, r in enumerate(routers)}
        self.n_layers = len(self.moes)
        self.own_bias = expert_bias and any(m.load_balance_coeff is not None for m in self.moes)
        self._frac_prev = torch.full(
            (self.n_layers, self.num_experts), self.topk / self.num_experts, dtype=torch.float64
        )
        self._logits: dict[int, Tensor] = {}
        self._begun = False
        self._paused = 0
        self._handles = []
        for r in routers:
            self._handles.append(r.gate.register_forward_hook(self._gate_hook(self._slot[id(r)])))
            self._handles.append(r.register_forward_hook(self._router_hook))
        if self.own_bias:
            for m in self.moes:
                self._handles.append(m.register_forward_hook(_empty_titan_counter))

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Router forwards inside this context are not part of the step's objective: they count nothing and
        attach nothing (torch's pipeline stages run one such forward, and its backward, to infer the tensor
        metadata of their first step; :class:`~lossparity.integrations.torchtitan.LossParityTitanMixin`
        runs that inference inside this context)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ------------------------------------------------------------------ step protocol
    def begin_step(self, labels: Sequence[Tensor], group: Any = None) -> None:
        """Before the first forward of a step: the global router tokens ``T``, rows ``N`` and microbatches
        ``M`` of the step from this rank's microbatch ``labels`` (``[b, S]`` each, before any context-parallel
        split), summed over the data-parallel ``group`` (a process group or None) in one all-reduce."""
        if self._begun:
            raise RuntimeError("TitanMoETerms.begin_step: the previous step was not ended (call end_step)")
        if not labels:
            raise ValueError("labels: begin_step needs the labels of at least one microbatch")
        for i, lab in enumerate(labels):
            if not isinstance(lab, Tensor) or lab.dim() != 2:
                raise ValueError(f"labels[{i}]: expected a [b, S] tensor, got {getattr(lab, 'shape', lab)!r}")
        stats = torch.tensor(
            [sum(lab.numel() for lab in labels), sum(lab.shape[0] for lab in labels), len(labels)],
            dtype=torch.float64,
            device=labels[0].device,
        )
        if group is not None:
            dist.all_reduce(stats, group=group)
        self._tokens, self._rows, self._microbatches = (float(x) for x in stats.tolist())  # once per step
        dev = labels[0].device
        self._frac_prev = self._frac_prev.to(dev)
        self._lagged = switch_load_balancing_weights(
            self._frac_prev, 1.0, self._tokens, topk=self.topk, num_experts=self.num_experts, coeff=self.alpha
        )
        # per layer: aux/α, z sum/T, plain top-k counts [E], dispatch counts [E]
        self._acc = torch.zeros(self.n_layers, 2 + 2 * self.num_experts, dtype=torch.float64, device=dev)
        self._begun = True

    def end_step(self, group: Any = None, pipeline_group: Any = None) -> dict[str, float]:
        """After the step's backward passes: one all-reduce of the step's records over the data-parallel
        ``group``, a check that every layer routed the step's ``T`` tokens once, the expert-bias update, the
        next ``global_lagged`` fractions, and the logs (module docstring). ``pipeline_group``: the pipeline
        stages (each holding its own MoE layers), over which the logs are summed in a second all-reduce so
        that every stage logs the whole model's terms."""
        if not self._begun:
            raise RuntimeError("TitanMoETerms.end_step: begin_step was not called for this step")
        self._begun = False
        acc = self._acc
        if group is not None:
            dist.all_reduce(acc, group=group)
        e = self.num_experts
        aux, z = acc[:, 0], acc[:, 1]
        top, disp = acc[:, 2 : 2 + e], acc[:, 2 + e :]
        # every token of the step routed once per layer: an extra forward (counted) would bias f and c
        routed = (disp.sum(dim=1) / self.topk).tolist()  # once per step
        for layer, n in enumerate(routed):
            if n != self._tokens:
                raise RuntimeError(
                    f"MoE layer {layer} ({self._names[layer]}): its router routed {n:g} tokens in this step, "
                    f"the step's batch has T = {self._tokens:g} (a router forward outside the step's microbatches, "
                    "or a microbatch missed); the expert biases and the global_lagged fractions are left as they were"
                )
        self._frac_prev = top / self._tokens
        if self.own_bias:
            with torch.no_grad():
                for layer, m in enumerate(self.moes):
                    if m.load_balance_coeff is not None:
                        new = expert_bias_update(disp[layer], m.expert_bias_E, m.load_balance_coeff, zero_mean=True)
                        m.expert_bias_E.copy_(new)
        # [terms, Σ_l aux_l/α, Σ_l z_l, Σ_l max_vio_l, layers]: summed over the pipeline stages' layers
        sums = torch.stack(
            [
                self.alpha * aux.sum() + self.beta * z.sum(),
                aux.sum(),
                z.sum(),
                max_violation(disp).sum().to(acc.dtype),
                torch.tensor(float(self.n_layers), dtype=acc.dtype, device=acc.device),
            ]
        )
        if pipeline_group is not None:
            dist.all_reduce(sums, group=pipeline_group)
        terms, aux_sum, z_sum, vio_sum, layers = sums.tolist()  # once per step
        logs = {"moe_terms": terms}
        if self.aux_scope != "none":
            logs[_AUX_LOG[self.aux_scope]] = aux_sum / layers
        logs["z_loss"] = z_sum / layers
        logs["max_vio"] = vio_sum / layers
        return logs

    # ------------------------------------------------------------------ hooks
    def _gate_hook(self, slot: int) -> Any:
        def hook(module: Any, args: tuple, output: Tensor) -> None:
            if module.training and torch.is_grad_enabled() and not self._paused:
                self._logits[slot] = output

        return hook

    def _router_hook(self, router: Any, args: tuple, output: Any) -> Any:
        if not router.training or self._paused:
            return None
        slot = self._slot[id(router)]
        if not self._begun:
            raise RuntimeError(f"MoE router {slot}: TitanMoETerms.begin_step was not called for this step")
        topk_scores, expert_ids, scores = output
        e = self.num_experts
        counting = not _in_backward()  # a checkpoint re-run (inside backward) counts nothing
        if counting:
            with torch.no_grad():
                disp = torch.zeros(e, dtype=torch.float64, device=expert_ids.device)
                disp.index_add_(0, expert_ids.reshape(-1), torch.ones_like(expert_ids.reshape(-1), dtype=disp.dtype))
                self._acc[slot, 2 + e :] += disp
        if not torch.is_grad_enabled():  # a reentrant checkpoint's first pass: its re-run attaches the term
            if counting:  # sigmoid or softmax scores: the same top-k as their normalized p
                self._acc[slot, 2 : 2 + e] += topk_routing_map(scores.reshape(-1, e), self.topk).sum(dim=0).double()
            return None
        logits = self._logits.pop(slot).reshape(-1, e)
        _, p = router_scores(logits, router.score_func)
        top = topk_routing_map(p, self.topk)  # plain top-k of the unbiased scores: what the aux term counts
        aux = self._aux(p, top, slot, topk_scores.shape[0])
        z = router_z_loss_sums(logits) / self._tokens
        if counting:
            row = self._acc[slot]
            row[0] += aux.detach().to(torch.float64) / (self.alpha or 1.0)
            row[1] += z.detach().to(torch.float64)
            row[2 : 2 + e] += top.sum(dim=0).to(torch.float64)
        term = aux + self.beta * z
        return AttachGrad.apply(topk_scores, term, 1.0, None), expert_ids, scores

    def _aux(self, p: Tensor, top: Tensor, slot: int, rows: int) -> Tensor:
        """This forward's share of ``A_l`` (module docstring) from its scores ``p [T_mb, E]``."""
        e, k = self.num_experts, self.topk
        if self.aux_scope == "global_lagged":
            return (self._lagged[slot].to(p.dtype) * p.sum(dim=0)).sum()
        if self.aux_scope == "microbatch":
            counts = top.sum(dim=0).to(p.dtype)
            w = switch_load_balancing_weights(counts, float(p.shape[0]), topk=k, num_experts=e, coeff=self.alpha)
            return (w * p.sum(dim=0)).sum() / self._microbatches
        if self.aux_scope == "sequence":
            length = p.shape[0] // rows
            counts = top.view(rows, length, e).sum(dim=1).to(p.dtype)
            w = switch_load_balancing_weights(counts, float(length), topk=k, num_experts=e, coeff=self.alpha)
            return (w * p.view(rows, length, e).sum(dim=1)).sum() / self._rows
        return p.sum() * 0.0


def _empty_titan_counter(moe: Any, args: tuple, output: Any) -> None:
    """Empty torchtitan's ``tokens_per_expert_E`` after each forward: lossparity updates the expert bias, and
    torchtitan's pre-step hook then adds ``rate·sign(0) = 0`` (never a second update)."""
    with torch.no_grad():
        moe.tokens_per_expert_E.zero_()
