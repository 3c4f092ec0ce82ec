"""MoE auxiliary losses through the accountant, and aux-loss-free expert-bias balancing (semantics §5, §6).

The formulas are those of :mod:`lossparity.losses.moe` (``A(X) = α·E/(k·T²)·Σ_e c_e·Σ_{x in X} p[x,e]``,
router z-loss ``β·lse(x)²``); this module decides *which token set* each one sees and *which weight* its
gradient gets, so that the objective is exactly the one semantics §5 defines. The per-layer work is vectorized
over the MoE layers of a forward (one stacked ``[L, T, E]`` tensor per routing view).

Which token sets and counts each scope and z-loss form uses is one strategy each in
:mod:`lossparity.distributed.moe.scopes` (``microbatch``: the microbatch; ``sequence``: each row or
document; ``global_lagged``: the global batch with the previous step's counts; ``global_running``: Megatron's
running-mean counts); this class does the work common to all of them.

Router z-loss: ``global`` form ``β·Σ_x lse(x)² / Tt_global`` (invariant) or Megatron's ``microbatch``
form ``β·mean over microbatches of the microbatch mean``. Logged names follow Megatron: each term
divided by its coefficient and averaged over MoE layers (``load_balancing_loss``,
``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``).

``megatron_quirks=True`` (the ``megatron`` preset only) reproduces Megatron-LM's gradients and logged
numbers instead, including its documented deviations from semantics §5 (see :class:`MoEAccounting`).

Every term is :func:`lossparity.losses.moe.switch_load_balancing_weights` (``A = Σ_e K_e·P_e``) or
:func:`~lossparity.losses.moe.router_z_loss_sums_and_grad` evaluated on the scope's token set (one home per
formula). Both are computed without an autograd graph and their gradients formed in the forward pass
(:mod:`lossparity.distributed.moe.grad`).
Per step the logged values and the objective contribution accumulate on the device and reach the
accountant in :meth:`MoEAccounting.end_step`, together with the module's one collective (dispatch and
top-k counts) and the expert-load metrics ``max_vio``. ``end_step`` is part of the accountant's protocol
(registered with it): it must follow ``acc.finish_step`` and ``acc.logs()`` refuses to run before it.
``microbatch_loss`` has no host synchronization: token counts stay on the device and NaN/Inf router
outputs or shares are device flags that ``acc.logs()`` raises, naming rank, microbatch and layer.
Padding tokens are masked by products with the 0/1 valid mask: router outputs at padding positions
must be finite, as those of a finite model are. Context and sequence parallelism: the token-additive
forms (``global_lagged``, global z) split exactly over the shards of the rows; the per-microbatch and
per-sequence ones (``microbatch``, ``sequence``, the ``microbatch`` z form) sum their counts and token
numbers over the ranks holding pieces of the same rows (``row_group``, one all-reduce per microbatch) and
each shard back-propagates its own scores, whose terms add up to the whole set's; each shard logs ``1/R``
of a set. ``sequence`` with ``per_document`` documents is refused there (documents are numbered on whole rows).

Recompute safety: the losses are computed from the router records *returned* by the forward, which
a checkpoint re-run never returns, and the routers' dispatch counters skip re-runs themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist
from torch import Tensor

from ...losses import moe as F_moe
from ...options import AUX_SCOPES, Z_FORMS, AuxScope, ZForm, check_option
from ..accountant import Accountant
from .checks import (
    check_coeff,
    check_int,
    check_normalization,
    check_per_token_flag,
    check_records,
    check_routers,
    check_z_form,
)
from .grad import GradPlan, ShareWithGrad, token_sum
from .helpers import ScopeHelpers
from .logs import MoEStepLog
from .scopes import ROUTER_TOKENS, SCOPE_CLASSES, Microbatch, make_scope, make_z_form

if TYPE_CHECKING:  # the model package imports the losses; these are only types here
    from ...model.router import Router, RouterRecord

__all__ = ["SCOPES", "Z_FORMS", "LOG_NAMES", "ROUTER_TOKENS", "MoEAccounting"]

SCOPES: tuple[AuxScope, ...] = AUX_SCOPES
LOG_NAMES: dict[str, str] = {s: c.log_name for s, c in SCOPE_CLASSES.items() if c.log_name}


class MoEAccountingState(TypedDict):
    """What :meth:`MoEAccounting.state_dict` returns: ``global_lagged``'s previous-step counts."""

    lagged_counts: Tensor  # [L, E] float64 on the CPU
    lagged_tokens: float


_END_STEP = "MoEAccounting.end_step(routers)"


class MoEAccounting(ScopeHelpers):
    """Auxiliary MoE losses of one model (or of one pipeline chunk) for one accountant (see the module docstring).

    Protocol per step: pass :meth:`router_tokens` of the step's microbatches to
    ``acc.begin_step(..., extra_counts=...)``; per microbatch add :meth:`microbatch_loss` to the loss
    before ``backward``; after ``acc.finish_step`` call :meth:`end_step` on every rank, every step, before
    ``optimizer.step()`` and ``acc.logs()`` (the accountant enforces this order: it raises
    :class:`~lossparity.distributed.protocol.ProtocolError` otherwise). ``end_step`` runs the step's one
    collective of this module (dispatch counts for the expert bias, top-k counts for ``global_lagged``)
    and hands the step's logged values (``max_vio`` included) and objective contribution to the accountant.

    Args:
        acc: the step's :class:`~lossparity.distributed.accountant.Accountant`.
        num_layers: ``L``, the number of router records per forward (main MoE layers then MTP ones).
        num_experts: ``E`` routed experts. topk: ``k`` experts per token (``1 <= k <= E``).
        scope: one of :data:`SCOPES`. aux_coeff: ``α >= 0``. z_coeff: ``β >= 0`` (0 disables the z-loss).
        z_form: ``"global"`` (invariant, default) or ``"microbatch"`` (Megatron); with
            ``megatron_quirks`` it defaults to, and must be, ``"microbatch"``.
        megatron_quirks: reproduce Megatron-LM (``megatron`` preset): the ``global_running`` gradient is
            ``1/D`` of its logged value; ``sequence`` divides every sequence by the microbatch's mean
            valid length and averages per microbatch; the z-loss of a repeated MTP layer is not divided by
            its number of calls in the gradient; with ``calculate_per_token_loss`` every term is
            pre-multiplied by the microbatch's router-token count (Megatron: local count × |TP×CP|) and
            divided by the global LM token count.
        calculate_per_token_loss: Megatron's flag (only with ``megatron_quirks``); ``None`` = True exactly
            when ``acc.normalization == "deferred"`` (which requires it).
        repeated_mtp_calls: ``R``: the last ``R`` records are ``R`` calls of one shared MTP MoE layer
            (Megatron ``mtp_use_repeated_layer``). That layer's terms are the mean over its calls and it
            counts once in the layer mean of the logs and in ``end_step``'s routers. 0 or 1: no sharing.
        log_layers: the number of distinct MoE layers of the whole model, the divisor of the logged layer
            mean (default: this instance's). A pipeline chunk owning some of the layers passes the model's
            total; its log denominators are weighted by its share of the layers, so that the sums over the
            chunks (the logging collective spans the pipeline) give the model's layer mean.
        declare: declare the logged metrics even without MoE layers (pipeline chunks without MoE layers
            must take part in the same logging layout); default: when ``num_layers > 0``.
        log_layer_ids: the ``layer_id`` of every distinct MoE layer of the whole model, naming the logged
            ``max_vio/layer_<id>`` (default: ``0..num_slots-1``, by router position); a pipeline chunk
            passes the model's list and records the layers its routers hold.
    """

    def __init__(
        self,
        acc: Accountant,
        num_layers: int,
        num_experts: int,
        topk: int,
        *,
        scope: AuxScope = "microbatch",
        aux_coeff: float = 1e-2,
        z_coeff: float = 0.0,
        z_form: ZForm | None = None,
        megatron_quirks: bool = False,
        calculate_per_token_loss: bool | None = None,
        repeated_mtp_calls: int = 0,
        log_layers: int | None = None,
        declare: bool | None = None,
        log_layer_ids: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(acc, Accountant):
            raise TypeError(f"acc must be an Accountant, got {type(acc).__name__}")
        self.acc = acc
        self.scope: AuxScope = check_option("aux_scope", scope, SCOPES)
        self.num_layers = check_int("num_layers", num_layers, 0)
        self.num_experts = check_int("num_experts", num_experts, 1)
        self.topk = check_int(f"topk (num_experts={num_experts})", topk, 1, num_experts)
        self.aux_coeff = check_coeff("aux_coeff", aux_coeff)
        self.z_coeff = check_coeff("z_coeff", z_coeff)
        repeated = check_int(f"repeated_mtp_calls (num_layers={num_layers})", repeated_mtp_calls, 0, num_layers)
        self.megatron_quirks = bool(megatron_quirks)
        self.z_form: ZForm = check_z_form(z_form, self.megatron_quirks)
        self.calculate_per_token_loss = check_per_token_flag(acc, calculate_per_token_loss, self.megatron_quirks)
        self._aux_on = self.num_layers > 0 and self.scope != "none" and self.aux_coeff > 0
        self._z_on = self.num_layers > 0 and self.z_coeff > 0
        check_normalization(
            acc,
            self.scope,
            aux_on=self._aux_on,
            z_on=self._z_on,
            megatron_quirks=self.megatron_quirks,
            per_token=self.calculate_per_token_loss,
        )
        # The ranks holding pieces of the same rows: per-microbatch and per-sequence counts are summed over
        # them (one all-reduce per microbatch, Megatron's tp×cp group), and each rank logs 1/R of a unit.
        self._row_group = acc.groups.row_group
        self._row_size = 1 if self._row_group is None else dist.get_world_size(self._row_group)
        # the calls of one repeated MTP layer (0: none); they share the last slot (distinct MoE layer, router)
        self.repeated_calls = repeated if repeated > 1 else 0
        self.num_slots = self.num_layers - self.repeated_calls + 1 if self.repeated_calls else self.num_layers
        if log_layers is not None:  # a chunk of a dense model may pass 0 (it then logs nothing)
            check_int(f"log_layers (this instance has {self.num_slots} MoE layers)", log_layers, self.num_slots)
        self.log_layers = max(self.num_slots if log_layers is None else log_layers, 1)
        # a chunk's share of the model's MoE layers: the weight of its log denominators
        self._den_frac = self.num_slots / self.log_layers
        self.device = acc.device
        self._scope = make_scope(self.scope, self)
        self._z = make_z_form(self.z_form, self)
        self._set_layer_weights()
        declared = self.num_layers > 0 if declare is None else bool(declare)
        self._log = MoEStepLog(
            acc,
            log_name=self._scope.log_name if declared and self.aux_coeff > 0 else None,
            z_log_name="z_loss" if declared and self.z_coeff > 0 else None,
            log_reduction=self._scope.log_reduction,
            aux_on=self._aux_on,
            z_on=self._z_on,
            z_den_on_device=self._z.den_on_device,
            den_frac=self._den_frac,
            num_slots=self.num_slots,
            log_layer_ids=log_layer_ids,
            declare=declared,
        )
        self._init_state()
        n = sum(name.startswith(_END_STEP) for name in acc.registered_step_ends)
        self._end_name = _END_STEP if n == 0 else f"{_END_STEP} [instance {n}]"
        acc.register_step_end(
            self._end_name,
            fingerprint=(
                self.scope,
                self.z_form,
                self.aux_coeff,
                self.z_coeff,
                self.megatron_quirks,
                self.num_layers,
                self.num_experts,
                self.topk,
            ),
        )

    def _init_state(self) -> None:
        nl, ne = self.num_layers, self.num_experts
        # global_lagged: previous step's global top-k counts and token count (uniform at step 0); the
        # module's checkpointed state whatever the scope.
        self.lagged_counts = torch.full((nl, ne), float(self.topk) / ne, dtype=torch.float64, device=self.device)
        self.lagged_tokens = 1.0
        self._pair_cache: dict[tuple[object, ...], Tensor] = {}
        self._calls = 0  # microbatches of this step

    # ---------------------------------------------------------------- per step
    @staticmethod
    def router_tokens(valid_masks: Sequence[Tensor]) -> dict[str, float]:
        """``extra_counts`` for ``begin_step``: ``{"router_tokens": Σ_mb Σ valid}``, this rank's non-padding
        router tokens of the step (``valid_masks``: one ``[b, S]`` bool or 0/1 mask per microbatch)."""
        total = 0.0
        for i, v in enumerate(valid_masks):
            if not isinstance(v, Tensor):
                raise TypeError(f"valid_masks[{i}] must be a torch.Tensor, got {type(v).__name__}")
            total += float((v > 0).sum())
        return {ROUTER_TOKENS: total}

    def microbatch_loss(
        self, records: Sequence[RouterRecord], valid: Tensor, segment_ids: Tensor | None = None
    ) -> Tensor:
        """The auxiliary objective share of one microbatch, summed over its MoE layers (semantics §5).

        ``records`` are the ``L`` router records of this forward (``logits``, ``probs``, ``topk_map``, each
        ``[b·S, E]`` in row-major token order), ``valid [b, S]`` marks non-padding tokens. Returns the share
        ``Σ_l w_l·term_l`` whose sum over the step's microbatches and ranks is the auxiliary objective
        (a raw, token-pre-multiplied share under deferred normalization). A zero-token microbatch
        contributes 0 and still counts. The logged values accumulate until :meth:`end_step`. With the
        accountant in mode ``per_document`` and packed rows (``segment_ids``), the ``sequence`` scope's
        sequences are the documents (semantics §5) and its mean runs over the global ``Ndoc``.

        The share's gradient is formed here, without an autograd graph: the load-balancing term is linear
        in the scores (``∂A/∂p[x,e] = K_e``, :func:`~lossparity.losses.moe.switch_load_balancing_weights`)
        and the z-loss gradient is ``2·lse·softmax``
        (:func:`~lossparity.losses.moe.router_z_loss_sums_and_grad`). The backward of the returned share
        multiplies them by its incoming gradient and hands them to the records' ``probs`` and ``logits``,
        whose own graphs (the router's score normalization and matmul) the language-model loss
        back-propagates through anyway. No host synchronization: NaN/Inf router scores or shares are
        flagged for ``acc.logs()``.
        """
        b, s = check_records(self.acc, records, valid, self.num_layers, self.num_experts)
        mb, self._calls = self._calls, self._calls + 1
        if not records:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        ref = records[0].probs
        dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
        need_p = self._aux_on or self._scope.counts_without_aux
        if not (need_p or self._z_on):
            return torch.zeros((), dtype=dtype, device=ref.device)
        plan = GradPlan()
        with torch.no_grad():
            total = self._share(records, valid, segment_ids, b, s, dtype, need_p, plan, mb)
        if total is None:  # global_lagged counting only (aux coefficient 0)
            return torch.zeros((), dtype=dtype, device=ref.device)
        inputs = ([r.probs for r in records] if plan.p_coef is not None else []) + (
            [r.logits for r in records] if plan.z_grad is not None else []
        )
        return ShareWithGrad.apply(total, plan, *inputs)

    def _share(
        self,
        records: Sequence[RouterRecord],
        valid: Tensor,
        seg: Tensor | None,
        b: int,
        s: int,
        dtype: torch.dtype,
        need_p: bool,
        plan: GradPlan,
        mb: int,
    ) -> Tensor | None:
        """The microbatch's share (no graph) with its gradient plan; accumulates its log vector. None when
        only counting (``global_lagged`` with the aux coefficient 0)."""
        ref = records[0].probs
        nl = self.num_layers
        v = valid.reshape(-1)
        v = v if v.dtype == torch.bool else v > 0
        if v.device != ref.device:
            v = v.to(ref.device)
        vf = v.to(dtype)
        tt = vf.sum()  # stays on the device
        # One stack [2L (+L), T, E] of scores, top-k maps (and logits for the z-loss): one batched token
        # sum gives both histograms.
        views = ([r.probs for r in records] + [r.topk_map for r in records] if need_p else []) + (
            [r.logits for r in records] if self._z_on else []
        )
        stacked = torch.stack(views)
        if stacked.dtype != dtype:
            stacked = stacked.to(dtype)
        both = stacked[: 2 * nl] if need_p else stacked[:0]
        sums = token_sum(both, vf) if need_p and self._scope.needs_token_sums else None
        m = Microbatch(both, sums, v, vf, b, s, tt, seg, self._pre(tt))
        if sums is not None:
            self._scope.observe(sums)
        parts: list[Tensor] = []  # this microbatch's log vector, in the order of self._log_slots
        per_layer = None
        if self._aux_on:
            lb, per_layer = self._aux_share(m, plan)
            parts.append(lb)
        if self._z_on:
            zv, zsum, den = self._z.share(stacked[-nl:], m, plan)
            self._log.z_den += den
            parts.append(zv)
            if self._z.den_on_device:
                parts.append(tt.reshape(1))
            per_layer = zsum if per_layer is None else per_layer + zsum
        if per_layer is None:
            return None
        self._log.flag(records, per_layer, mb)
        vec = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._log.add(vec, self.device)
        return vec[0] + vec[2] if self._aux_on and self._z_on else vec[0]

    def _aux_share(self, m: Microbatch, plan: GradPlan) -> tuple[Tensor, Tensor]:
        """Load-balancing share of the microbatch (all layers): ``x = Σ_l w_l·Σ_{X in scope} A(X)`` with
        ``A(X) = Σ_e K_e(X)·P_e(X)`` (:func:`~lossparity.losses.moe.switch_load_balancing_weights`); the
        scope strategy chooses the token sets ``X``, their counts and the multiplier ``mult`` of the share
        ``mult·x``. Sets the gradient plan ``∂share/∂p[l,x,e] = mult·w_l·K_e(X(x))·valid[x]``.
        Returns ``([share, logged value], the per-layer terms [L])``."""
        sets = self._scope.sets(m)
        w = self._weights(m.both.dtype, m.both.device)[0]
        psum, weights, mult = sets.psum, sets.weights, sets.mult
        # A(X) = Σ_e K_e·P_e per set, summed over the sets of each layer
        terms = (psum * weights).sum(dim=-1) if weights.dim() == 2 else (psum * weights).sum(dim=(-2, -1))
        if isinstance(mult, Tensor):
            pair = terms @ self._pair(w, 1.0, w, sets.log_scale)
            pair = pair * torch.cat([mult.reshape(1), pair.new_ones(1)])
            plan.set_scores(weights, w * mult, sets.tokens, rows=sets.rows, index=sets.index)
        else:
            wl = self._pair(w, mult, w, sets.log_scale)
            pair = terms @ wl
            plan.set_scores(weights, wl[:, 0], sets.tokens, rows=sets.rows, index=sets.index)
        self._log.lb_den += sets.den
        return pair, terms

    # ---------------------------------------------------------------- end of step
    def end_step(
        self, routers: Sequence[Router], *, bias_rate: float = 0.0, zero_mean: bool = False
    ) -> dict[str, float]:
        """End-of-step MoE state update, after ``acc.finish_step`` and before ``optimizer.step()`` and
        ``acc.logs()`` (the accountant enforces this order); one all-reduce over the token group.

        Records the step's logged values and auxiliary objective in the accountant (under deferred
        normalization, Megatron ``calculate_per_token_loss``, the objective is ``Σ raw shares / Ntok``).
        Sums the routers' dispatch counts ``tokens_per_expert`` (aux-loss-free balancing) and this step's
        top-k counts (``global_lagged``) over the ranks holding distinct tokens; updates every router's
        ``expert_bias`` by ``b_e += rate·sign(mean(c) − c_e)`` (optionally zero-mean) when ``bias_rate > 0``;
        resets the counters. Records ``max_vio`` (mean over the model's layers of ``(max c − mean c)/mean c``
        of the dispatch counts) and ``max_vio/layer_<id>`` in the accountant's logs, and returns this
        instance's values. Every rank must call it every step (it is a collective).
        """
        log = self._log
        check_routers(
            routers, self.num_slots, self.num_experts, None if log.by_position or not log.log_vio else log.vio_ids
        )
        bias_rate = check_coeff("bias_rate", bias_rate)
        self.acc.step_end_done(self._end_name)
        self._log.flush()
        self._log.reset()
        self._calls = 0
        if not self.num_layers:
            return {}
        dispatch, scope_counts = self._reduce_counts(routers)
        with torch.no_grad():
            if bias_rate > 0:  # all layers at once ([layers, E]), then back into every router's buffer
                bias = torch.stack([r.expert_bias for r in routers])
                new = F_moe.expert_bias_update(dispatch, bias, bias_rate, zero_mean=zero_mean)
                for r, row in zip(routers, new):
                    r.expert_bias.copy_(row)
            for r in routers:
                r.reset_counts()
        vio_t = F_moe.max_violation(dispatch)
        self._log.record_vio(routers, vio_t)
        extra = self._scope.end_step(scope_counts)
        values = (vio_t if extra is None else torch.cat([vio_t, extra])).tolist()  # the one host sync of end_step
        self._scope.after_sync(scope_counts, values)
        vio = values[: self.num_slots]
        out = {"max_vio": sum(vio) / len(vio)}
        out.update({f"max_vio/layer_{getattr(r, 'layer_id', i)}": x for i, (r, x) in enumerate(zip(routers, vio))})
        return out

    def _reduce_counts(self, routers: Sequence[Router]) -> tuple[Tensor, Tensor | None]:
        """The step's dispatch counts ``[slots, E]`` (and the scope's counts, ``global_lagged``'s top-k counts
        ``[L, E]``) summed over the token group in one all-reduce."""
        with torch.no_grad():
            local = torch.stack([r.tokens_per_expert for r in routers])
        if local.device != self.device or local.dtype != torch.float64:
            local = local.to(self.device, torch.float64)
        extra = self._scope.step_counts()
        buf = local.reshape(-1) if extra is None else torch.cat([local.reshape(-1), extra.reshape(-1)])
        g = self.acc.groups.token_group
        if g is not None:
            dist.all_reduce(buf, group=g)
        n = self.num_slots * self.num_experts
        reduced = None if extra is None else buf[n:].view(extra.shape)
        return buf[:n].view(self.num_slots, self.num_experts), reduced

    def state_dict(self) -> MoEAccountingState:
        """State to checkpoint: the previous step's global counts of ``global_lagged`` (CPU float64)."""
        return MoEAccountingState(
            lagged_counts=self.lagged_counts.detach().cpu().clone(), lagged_tokens=self.lagged_tokens
        )

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict` (``lagged_counts [L, E]``, ``lagged_tokens > 0``)."""
        counts = state["lagged_counts"]
        if not isinstance(counts, Tensor) or counts.shape != (self.num_layers, self.num_experts):
            shape = tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__
            raise ValueError(
                f"state['lagged_counts'] must be a [{self.num_layers}, {self.num_experts}] tensor, got {shape}"
            )
        # an unchecked checkpoint value: float() itself raises on what is not a number (typeshed's float()
        # accepts only SupportsFloat/str/buffers, not ``object``)
        tokens = float(state["lagged_tokens"])  # type: ignore[arg-type]
        if not tokens > 0:
            raise ValueError(f"state['lagged_tokens'] must be > 0, got {tokens}")
        self.lagged_counts = counts.to(device=self.device, dtype=torch.float64).clone()
        self.lagged_tokens = tokens
        self._scope.state_changed()
