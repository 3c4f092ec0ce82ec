"""MoE auxiliary losses through the accountant, and aux-loss-free expert-bias balancing (semantics §5, §6).

The formulas are those of :mod:`lossparity.losses.moe` (``A(X) = α·E/(k·T²)·Σ_e c_e·Σ_{x in X} p[x,e]``,
router z-loss ``β·lse(x)²``); this module decides *which token set* each one sees and *which weight* its
gradient gets, so that the objective is exactly the one semantics §5 defines. The per-layer work is vectorized
over the MoE layers of a forward (one stacked ``[L, T, E]`` tensor per routing view).

| scope            | objective contribution (per MoE layer, summed over layers)          | layout    |
|------------------|---------------------------------------------------------------------|-----------|
| `micro_batch`    | mean over the `D·K` microbatches of `A(X_mb)`                       | fixed b   |
| `sequence`       | mean over the `N` sequences of `A(X_seq)`                           | any       |
| `global_lagged`  | `α·E/k · Σ_e f_e^prev · Σ_{x in batch} p[x,e] / Tt`                 | any       |
| `global_running` | Megatron: mean over microbatches `m` of `A` with counts summed over | D, K      |
|                  | DP and averaged over microbatches `1..m` (one all-reduce per mb)     | dependent |

Router z-loss: ``global`` form ``β·Σ_x lse(x)² / Tt_global`` (invariant) or Megatron's ``microbatch``
form ``β·mean over microbatches of the microbatch mean``. Logged names follow Megatron: each term
divided by its coefficient and averaged over MoE layers (``load_balancing_loss``,
``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``).

``megatron_quirks=True`` (the ``megatron`` preset only) reproduces Megatron-LM's gradients and logged
numbers instead, including its documented deviations from semantics §5 (see :class:`MoEAccounting`).

Every term is :func:`lossparity.losses.moe.switch_load_balancing_weights` (``A = Σ_e K_e·P_e``) or
:func:`~lossparity.losses.moe.router_z_loss_sums_and_grad` evaluated on the scope's token set (one home per
formula). Both are computed without an autograd graph and their gradients formed in the forward pass
(``A`` is linear in the scores once the counts are fixed; the z-loss gradient is ``2·lse·softmax``); the
returned share hands them to the records' ``probs``/``logits`` in its backward, so the aux path adds no
backward through its own reductions and joins the router's graph where the language-model loss
back-propagates anyway.
Per step the logged values and the objective contribution accumulate on the device and reach the
accountant in :meth:`MoEAccounting.end_step`, together with the module's one collective (dispatch and
top-k counts) and the expert-load metrics ``max_vio``. ``end_step`` is part of the accountant's protocol
(registered with it): it must follow ``acc.finish_step`` and ``acc.logs()`` refuses to run before it.
``microbatch_loss`` has no host synchronization: token counts stay on the device and NaN/Inf router
outputs or shares are device flags that ``acc.logs()`` raises, naming rank, microbatch and layer.
Padding tokens are masked by products with the 0/1 valid mask: router outputs at padding positions
must be finite, as those of a finite model are. Context and sequence parallelism: the token-additive
forms (``global_lagged``, global z) split exactly over the shards of the rows; the per-microbatch and
per-sequence ones (``micro_batch``, ``sequence``, the ``microbatch`` z form) sum their counts and token
numbers over the ranks holding pieces of the same rows (``row_group``, one all-reduce per microbatch) and
each shard back-propagates its own scores, whose terms add up to the whole set's; each shard logs ``1/R``
of a set. ``sequence`` with ``per_document`` documents is refused there (documents are numbered on whole rows).

Recompute safety: the losses are computed from the router records *returned* by the forward, which
a checkpoint re-run never returns, and the routers' dispatch counters skip re-runs themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..losses import moe as F_moe
from ..options import AUX_SCOPES, Z_FORMS, AuxScope, ZForm, check_option
from .accountant import Accountant
from .protocol import ProtocolError, StepState

if TYPE_CHECKING:  # the model package imports the losses; these are only types here
    from ..model.router import Router, RouterRecord

__all__ = ["SCOPES", "Z_FORMS", "LOG_NAMES", "ROUTER_TOKENS", "MoEAccounting"]

SCOPES: tuple[AuxScope, ...] = AUX_SCOPES
LOG_NAMES = {
    "micro_batch": "load_balancing_loss",
    "sequence": "seq_load_balancing_loss",
    "global_lagged": "global_load_balancing_loss",
    "global_running": "global_load_balancing_loss",
}
ROUTER_TOKENS = "router_tokens"


class MoEAccountingState(TypedDict):
    """What :meth:`MoEAccounting.state_dict` returns: ``global_lagged``'s previous-step counts."""

    lagged_counts: Tensor  # [L, E] float64 on the CPU
    lagged_tokens: float


_END_STEP = "MoEAccounting.end_step(routers)"


def _check_coeff(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return value


def _token_sum(x: Tensor, vf: Tensor) -> Tensor:
    """``Σ_t vf[t]·x[..., t, e]`` over the token dim (second to last) of ``x [..., T, E]``: one batched
    ``vf @ x`` (``vf [T]``, or per-sequence ``[b, S]`` against ``x [L, b, S, E]``)."""
    return torch.matmul(vf.unsqueeze(-2), x).squeeze(-2)


class _GradPlan:
    """Gradients of one microbatch's auxiliary share w.r.t. the router records, formed in the forward.

    Scores: ``∂share/∂p[l,x,e] = coef[l, X(x), e] · tokens[x]`` (kept factorized, ``coef [L, E]`` for one
    token set or ``[L, G, E]`` for sets given by rows or an index); logits: ``z_grad [L, T, E]``."""

    def __init__(self) -> None:
        self.p_coef: Tensor | None = None
        self.tokens: Tensor | None = None
        self.rows: tuple[int, int] | None = None
        self.index: Tensor | None = None
        self.z_grad: Tensor | None = None

    def set_scores(
        self,
        K: Tensor,
        layer_scale: Tensor,
        tokens: Tensor,
        *,
        rows: tuple[int, int] | None = None,
        index: Tensor | None = None,
    ) -> None:
        """``coef = K · layer_scale[l]`` (``K [L, E]`` or ``[L, G, E]``); ``tokens`` ``[T]`` (or ``[b, S]``
        with ``rows``: set = row), ``index [T]``: the set of every token."""
        self.p_coef = K * layer_scale.view(-1, *([1] * (K.dim() - 1)))
        self.tokens, self.rows, self.index = tokens, rows, index

    def grads(self, g: Tensor) -> list[Tensor]:
        """The gradients of ``g·share`` for the inputs in order: the ``L`` scores, then the ``L`` logits."""
        out: list[Tensor] = []
        if self.p_coef is not None and self.tokens is not None:
            c = self.p_coef * (g if g.dtype == self.p_coef.dtype else g.to(self.p_coef.dtype))
            if self.rows is not None:  # [L, b, E] x [b, S] -> [L, b·S, E]
                gp = (c.unsqueeze(2) * self.tokens.unsqueeze(-1)).flatten(1, 2)
            elif self.index is not None:
                gp = c.index_select(1, self.index) * self.tokens.unsqueeze(-1)
            else:
                gp = c.unsqueeze(1) * self.tokens.unsqueeze(-1)
            out.extend(gp.unbind(0))
        if self.z_grad is not None:
            out.extend((self.z_grad * (g if g.dtype == self.z_grad.dtype else g.to(self.z_grad.dtype))).unbind(0))
        return out


class _ShareWithGrad(torch.autograd.Function):
    """``share`` (computed without a graph) attached to the router records: its backward returns the
    gradients of the :class:`_GradPlan` times the incoming gradient (a trivial backward, like the fused
    cross-entropy's)."""

    @staticmethod
    def forward(ctx: Any, share: Tensor, plan: _GradPlan, *inputs: Tensor) -> Tensor:  # noqa: ARG004
        ctx.plan = plan
        return share.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.plan.grads(g))


class MoEAccounting:
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
        scope: AuxScope = "micro_batch",
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
        self.L = _check_int("num_layers", num_layers, 0)
        self.E = _check_int("num_experts", num_experts, 1)
        self.k = _check_int(f"topk (num_experts={num_experts})", topk, 1, num_experts)
        self.aux_coeff = _check_coeff("aux_coeff", aux_coeff)
        self.z_coeff = _check_coeff("z_coeff", z_coeff)
        repeated = _check_int(f"repeated_mtp_calls (num_layers={num_layers})", repeated_mtp_calls, 0, num_layers)
        self.megatron_quirks = bool(megatron_quirks)
        self.z_form: ZForm = self._check_z_form(z_form)
        self.calculate_per_token_loss = self._check_per_token_flag(calculate_per_token_loss)
        self._aux_on = self.L > 0 and self.scope != "none" and self.aux_coeff > 0
        self._z_on = self.L > 0 and self.z_coeff > 0
        self._check_normalization()
        self.R = repeated if repeated > 1 else 0
        # Slots = distinct MoE layers (routers): the R calls of a repeated MTP layer share the last slot.
        self.num_slots = self.L - self.R + 1 if self.R else self.L
        if log_layers is not None:  # a chunk of a dense model may pass 0 (it then logs nothing)
            _check_int(f"log_layers (this instance has {self.num_slots} MoE layers)", log_layers, self.num_slots)
        self.log_layers = max(self.num_slots if log_layers is None else log_layers, 1)
        self._den_frac = self.num_slots / self.log_layers
        self.device = acc.device
        self._set_layer_weights()
        self._declare(self.L > 0 if declare is None else bool(declare), log_layer_ids)
        self._set_log_slots()
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
                self.L,
                self.E,
                self.k,
            ),
        )

    def _check_z_form(self, z_form: str | None) -> ZForm:
        if z_form is None:
            return "microbatch" if self.megatron_quirks else "global"
        form = check_option("z_form", z_form, Z_FORMS)
        if self.megatron_quirks and form != "microbatch":
            raise ValueError(
                "megatron_quirks=True needs z_form='microbatch' (Megatron's z-loss is a microbatch "
                f"mean), got z_form={z_form!r}"
            )
        return form

    def _check_per_token_flag(self, flag: bool | None) -> bool:
        if flag is None:
            return self.acc.normalization == "deferred" and self.megatron_quirks
        if flag and not self.megatron_quirks:
            raise ValueError("calculate_per_token_loss=True is a Megatron setting: it needs megatron_quirks=True")
        return bool(flag)

    def _check_normalization(self) -> None:
        """Rules tying the scopes to the accountant's normalization and to sharded sequences."""
        acc, aux_on, z_on = self.acc, self._aux_on, self._z_on
        deferred = acc.normalization == "deferred"
        if deferred and (aux_on or z_on) and not self.calculate_per_token_loss:
            raise ValueError(
                "MoE auxiliary losses under normalization='deferred' divide every gradient by the token count "
                "known only at the end of the step: use normalization='precount', or megatron_quirks=True with "
                "calculate_per_token_loss=True (Megatron pre-multiplies each term by its token count)"
            )
        if deferred and aux_on and self.scope == "global_lagged":
            raise ValueError(
                "scope 'global_lagged' needs the global router token count before the first "
                "backward: use normalization='precount'"
            )
        sharded = acc.groups.cp_size > 1 or acc.groups.sequence_parallel
        if sharded and self.megatron_quirks and (aux_on or z_on):
            # Megatron shards these terms its own way (z coefficient / |TP×CP| on each shard's own mean,
            # per-token scaling by local counts): not reproduced.
            raise ValueError(
                f"megatron_quirks=True is not reproduced under context parallelism (cp={acc.groups.cp_size}) or "
                f"sequence parallelism (sp={acc.groups.sequence_parallel}): Megatron divides the z-loss "
                "coefficient by |TP×CP| on each shard's own mean; use the exact forms (megatron_quirks=False)"
            )
        if sharded and aux_on and self.scope == "sequence" and acc.mode == "per_document":
            # The sequences are then the documents, numbered on whole rows; a shard's local numbering differs.
            raise ValueError(
                f"context parallelism (cp={acc.groups.cp_size}) or sequence parallelism "
                f"(sp={acc.groups.sequence_parallel}) does not combine scope 'sequence' with mode "
                "'per_document' (documents as sequences): use scope micro_batch, global_lagged or global_running"
            )
        # The ranks holding pieces of the same rows: per-microbatch and per-sequence counts are summed over
        # them (one all-reduce per microbatch, Megatron's tp×cp group), and each rank logs 1/R of a unit.
        self._row_group = acc.groups.row_group
        self._row_size = 1 if self._row_group is None else dist.get_world_size(self._row_group)

    def _set_layer_weights(self) -> None:
        w = torch.ones(self.L, dtype=torch.float64)
        if self.R:
            w[self.L - self.R :] = 1.0 / self.R
        self._w_aux = w  # a repeated layer's term is the mean over its calls (Megatron: aux / mtp_num_layers)
        # Megatron divides a repeated MTP layer's z-loss by its calls only in the log (TODO in router.py).
        self._w_zgrad = torch.ones(self.L, dtype=torch.float64) if self.megatron_quirks else w
        self._w_zlog = w
        self._z_split = bool(self.R) and self.megatron_quirks
        self._wcache: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}

    def _declare(self, declare: bool, log_layer_ids: Sequence[int] | None) -> None:
        """Declare the logged metrics and the value checks in the accountant (same layout on every rank)."""
        acc, sp = self.acc, self.acc.groups.sequence_parallel
        self.log_name = LOG_NAMES.get(self.scope) if declare and self.scope != "none" and self.aux_coeff > 0 else None
        self.z_log_name = "z_loss" if declare and self.z_coeff > 0 else None
        if self.log_name:
            # Under sequence parallelism every TP rank routes distinct tokens: its values count (per_rank).
            acc.declare_metric(self.log_name, "sum" if self.scope.startswith("global") else "ratio", per_rank=sp)
        if self.z_log_name:
            acc.declare_metric(self.z_log_name, "ratio", per_rank=sp)
        self._by_position = log_layer_ids is None
        self._vio_ids = list(range(self.num_slots)) if log_layer_ids is None else [int(i) for i in log_layer_ids]
        self._log_vio = declare and bool(self._vio_ids)
        if self._log_vio:
            for lid in self._vio_ids:
                acc.declare_metric(f"max_vio/layer_{lid}", "sum")
            acc.declare_metric("max_vio", "sum")
        acc.register_check(
            "router_nonfinite",
            FloatingPointError,
            "MoE router scores have NaN/Inf at a non-padding token (or the layer's auxiliary term is not finite)",
            "layer",
        )

    def _init_state(self) -> None:
        L, E, dev = self.L, self.E, self.device
        # global_lagged: previous step's global top-k counts and token count (uniform at step 0).
        self.lagged_counts = torch.full((L, E), float(self.k) / E, dtype=torch.float64, device=dev)
        self.lagged_tokens = 1.0
        self._lagged_cache: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}
        self._pair_cache: dict[tuple[object, ...], Tensor] = {}
        self._vio_maps: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
        self._layer_codes: dict[tuple[torch.device, int], Tensor] = {}
        self._topk_counts = torch.zeros(L, E, dtype=torch.float64, device=dev)
        self._running = torch.zeros(self.num_slots, E, dtype=torch.float64, device=dev)
        self._running_n = torch.zeros(self.num_slots, dtype=torch.float64, device=dev)
        self._reset_step()

    def _reset_step(self) -> None:
        # Per-step log values: the tensor ones summed on the device in one float64 vector (order:
        # self._log_slots), the denominators that are host numbers as floats; handed over in end_step.
        self._logvec: Tensor | None = None
        self._lb_den = 0.0
        self._z_den = 0.0
        self._calls = 0

    def _set_log_slots(self) -> None:
        """How the per-microbatch log vector maps onto the accountant's slots. The vector holds
        ``[lb share, lb logged]`` (aux term on), ``[z share, z logged]`` (z-loss on) and the microbatch's
        router tokens (global z form: its logged denominator); ``end_step`` hands over ``M @ Σ vectors``."""
        lb, z = self.log_name, self.z_log_name
        n = 2 * self._aux_on + 2 * self._z_on + (self._z_on and self.z_form == "global")
        rows: list[tuple[str, dict[int, float]]] = []
        i = 0
        objective: dict[int, float] = {}
        if self._aux_on:
            objective[i] = 1.0
            if lb:
                rows.append((f"num:{lb}", {i + 1: 1.0}))
            i += 2
        if self._z_on:
            objective[i] = 1.0
            if z:
                rows.append((f"num:{z}", {i + 1: 1.0}))
                if self.z_form == "global":
                    rows.append((f"den:{z}", {i + 2: self._den_frac}))
        rows.append(("objective_local" if self.acc.groups.sequence_parallel else "objective", objective))
        self._log_slots = [name for name, _ in rows]
        self._log_map = torch.zeros(len(rows), max(n, 1), dtype=torch.float64)
        for r, (_, coeffs) in enumerate(rows):
            for col, c in coeffs.items():
                self._log_map[r, col] = c
        self._log_maps: dict[tuple[torch.device, float], Tensor] = {}

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

    def _weights(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        key = (dtype, device)
        if key not in self._wcache:
            a, zg, zl = (w.to(device=device, dtype=dtype) for w in (self._w_aux, self._w_zgrad, self._w_zlog))
            self._wcache[key] = (a, zg, zl)
        return self._wcache[key]

    def _count(self, name: str) -> float:
        """A step count of the accountant (a host number read once at begin_step: no sync)."""
        try:
            return self.acc.global_count(name)
        except KeyError:
            raise KeyError(
                f"MoEAccounting needs the count {name!r} of this step: pass "
                "extra_counts=MoEAccounting.router_tokens(valids) to acc.begin_step"
            ) from None

    def _local_microbatches(self) -> float:
        """``K``: microbatches of this rank (every data-parallel rank runs the same number)."""
        n = self._count("microbatches")
        return n if self.acc.normalization == "deferred" else n / self.acc.groups.dp_size

    def _check_records(self, records: Sequence[RouterRecord], valid: Tensor) -> tuple[int, int]:
        if not isinstance(valid, Tensor):
            raise TypeError(f"valid must be a torch.Tensor [b, S], got {type(valid).__name__}")
        if valid.dim() not in (1, 2):
            raise ValueError(f"valid must be [b, S] (or [S]), got shape {tuple(valid.shape)}")
        if len(records) != self.L:
            raise ValueError(f"expected {self.L} router records (one per MoE layer call), got {len(records)}")
        want = (valid.numel(), self.E)
        for i, r in enumerate(records):
            for field in ("logits", "probs", "topk_map"):
                x = getattr(r, field, None)
                if not isinstance(x, Tensor):
                    raise TypeError(f"router record {i} has no tensor field {field!r}")
                if x.shape != want:
                    raise ValueError(
                        f"router record {i}: {field} has shape {tuple(x.shape)}, expected "
                        f"[{want[0]}, {self.E}] (valid has shape {tuple(valid.shape)}, "
                        f"num_experts={self.E})"
                    )
        if self.acc.state is not StepState.MICROBATCHES:
            raise ProtocolError(
                f"MoEAccounting.microbatch_loss called outside the microbatches of a step: "
                f"expected {self.acc.expected_call()}"
            )
        return (1, valid.numel()) if valid.dim() == 1 else (valid.shape[0], valid.shape[1])

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
        b, s = self._check_records(records, valid)
        mb, self._calls = self._calls, self._calls + 1
        if not records:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        ref = records[0].probs
        dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
        need_p = self._aux_on or self.scope == "global_lagged"
        if not (need_p or self._z_on):
            return torch.zeros((), dtype=dtype, device=ref.device)
        plan = _GradPlan()
        self._tt_row: Tensor | None = None  # the microbatch's tokens over its row group, once reduced
        with torch.no_grad():
            v = valid.reshape(-1)
            v = v if v.dtype == torch.bool else v > 0
            if v.device != ref.device:
                v = v.to(ref.device)
            vf = v.to(dtype)
            tt = vf.sum()  # stays on the device
            parts: list[Tensor] = []  # this microbatch's log vector, in the order of self._log_slots
            per_layer = None
            # One stack [2L (+L), T, E] of scores, top-k maps (and logits for the z-loss): one batched token
            # sum gives both histograms.
            views = ([r.probs for r in records] + [r.topk_map for r in records] if need_p else []) + (
                [r.logits for r in records] if self._z_on else []
            )
            stacked = torch.stack(views)
            if stacked.dtype != dtype:
                stacked = stacked.to(dtype)
            if need_p:
                both = stacked[: 2 * self.L]
                scope_sums = self.scope in ("micro_batch", "global_lagged", "global_running")
                sums = _token_sum(both, vf) if scope_sums else None
                if sums is not None and self.scope == "global_lagged":
                    self._topk_counts += sums[self.L :].to(self.device, torch.float64)
                if self._aux_on:
                    lb, per_layer = self._aux_share(both, sums, v, vf, b, s, tt, segment_ids, plan)
                    parts.append(lb)
            if self._z_on:
                zv, zsum = self._z_share(stacked[-self.L :], vf, tt, plan)
                parts.append(zv)
                if self.z_form == "global":
                    parts.append(tt.reshape(1))
                per_layer = zsum if per_layer is None else per_layer + zsum
            if per_layer is None:  # global_lagged counting only (aux coefficient 0)
                return torch.zeros((), dtype=dtype, device=ref.device)
            self._flag(records, per_layer, mb)
            vec = torch.cat(parts) if len(parts) > 1 else parts[0]
            total = vec[0] + vec[2] if self._aux_on and self._z_on else vec[0]
            if self._logvec is None:
                self._logvec = vec.to(self.device, torch.float64)
            else:  # float64 += float32 promotes without a conversion kernel; a device move only if needed
                self._logvec = self._logvec + (
                    vec if vec.device == self._logvec.device else vec.to(self._logvec.device)
                )
        inputs = ([r.probs for r in records] if plan.p_coef is not None else []) + (
            [r.logits for r in records] if plan.z_grad is not None else []
        )
        return _ShareWithGrad.apply(total, plan, *inputs)

    def _flag(self, records: Sequence[RouterRecord], per_layer: Tensor, mb: int) -> None:
        """Device flag for acc.logs(): a NaN/Inf router score at a valid token makes its layer's term not
        finite (tested once per step); the share is the weighted sum of the layers' terms."""
        if not self.acc.check_finite:
            return
        key = (per_layer.device, len(records))
        if key not in self._layer_codes:
            ids = [float(getattr(r, "layer", i)) for i, r in enumerate(records)]
            self._layer_codes[key] = torch.tensor(ids, dtype=torch.float64, device=per_layer.device)
        self.acc.flag("router_nonfinite", per_layer, self._layer_codes[key], microbatch=mb)

    def _pre(self, tt: Tensor) -> Tensor | None:
        """Megatron ``calculate_per_token_loss``: ``n_mb`` (deferred) or ``n_mb / Ntok`` (precount)."""
        if not self.calculate_per_token_loss:
            return None
        return tt if self.acc.normalization == "deferred" else tt / max(self._count("tokens"), 1.0)

    def _row_sum(self, *parts: Tensor) -> list[Tensor]:
        """``parts`` summed over the row group (the ranks holding pieces of the same rows: context and
        sequence parallelism) in one all-reduce; unchanged without such a group."""
        if self._row_group is None:
            return list(parts)
        buf = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(buf, group=self._row_group)
        return [x.view(p.shape) for x, p in zip(buf.split([p.numel() for p in parts]), parts)]

    def _switch_weights(
        self, counts: Tensor, t_counts: Tensor | float, t_probs: Tensor | float | None = None
    ) -> Tensor:
        return F_moe.switch_load_balancing_weights(
            counts, t_counts, t_probs, topk=self.k, num_experts=self.E, coeff=self.aux_coeff
        )

    def _pair(self, w: Tensor, a: float, w2: Tensor, c: float) -> Tensor:
        """``[L, 2]`` columns ``w·a`` and ``w2·c``: one matrix-vector product gives (share, logged value)
        of the per-layer terms (cached: the factors are constant within a step)."""
        key = (w.dtype, w.device, id(w), a, id(w2), c)
        out = self._pair_cache.get(key)
        if out is None:
            if len(self._pair_cache) > 64:  # factors that change every step (e.g. their token counts)
                self._pair_cache.clear()
            out = self._pair_cache[key] = torch.stack([w * a, w2 * c], dim=1)
        return out

    def _aux_share(
        self,
        both: Tensor,
        sums: Tensor | None,
        v: Tensor,
        vf: Tensor,
        b: int,
        s: int,
        tt: Tensor,
        seg: Tensor | None,
        plan: _GradPlan,
    ) -> tuple[Tensor, Tensor]:
        """Load-balancing share of the microbatch (all layers): ``x = Σ_l w_l·Σ_{X in scope} A(X)`` with
        ``A(X) = Σ_e K_e(X)·P_e(X)`` (:func:`~lossparity.losses.moe.switch_load_balancing_weights`); the
        scope only chooses the token sets ``X``, the counts and the multiplier ``m`` of the share ``m·x``
        (``both [2L, T, E]``: scores then top-k maps; ``sums``: their ``[2L, E]`` token sums over the
        microbatch). Sets the gradient plan ``∂share/∂p[l,x,e] = m·w_l·K_e(X(x))·valid[x]``.
        Returns ``([share, logged value], the per-layer terms [L])``."""
        probs, topk = both[: self.L], both[self.L :]
        w = self._weights(probs.dtype, probs.device)[0]
        log_scale = 1.0 / (self.aux_coeff * self.log_layers)
        den = self._den_frac
        pre = self._pre(tt)
        m: Tensor | float
        rows: tuple[int, int] | None = None
        index: Tensor | None = None
        tokens = vf
        if self.scope == "micro_batch":
            assert sums is not None  # token sums are taken for this scope
            counts, tt_row = self._row_sum(sums[self.L :], tt.reshape(1))
            self._tt_row = tt_row.reshape(())
            psum, K = sums[: self.L], self._switch_weights(counts, self._tt_row)  # A(X_mb) per layer
            m = 1.0 / self._count("microbatches") if pre is None else pre
            den = den / self._row_size
        elif (
            self.scope == "sequence"
            and self.acc.mode == "per_document"
            and seg is not None
            and not self.megatron_quirks
        ):
            K, psum, index, tokens = self._document_sums(probs, topk, v, seg)
            m = 1.0 / max(self._count("documents"), 1.0)
            den = den * self.acc.documents_of(seg)[1]
        elif self.scope == "sequence":
            tokens, rows = vf.view(b, s), (b, s)
            psum, K = self._sequence_sums(both, tokens, tt)  # [L, b, E]
            den = den / self._row_size
            if self.megatron_quirks:  # Megatron's per-microbatch loss is the mean over its b sequences
                m = 1.0 / (b * self._count("microbatches")) if pre is None else pre / b
                log_scale = log_scale / b
            else:
                m = 1.0 / max(self._count("samples"), 1.0)
                den = den * b
        elif self.scope == "global_lagged":
            assert sums is not None  # token sums are taken for this scope
            psum, K = sums[: self.L], self._lagged_weights(probs.dtype, probs.device)
            m, den = 1.0, 0.0
        else:  # global_running
            assert sums is not None  # token sums are taken for this scope
            avg, t_run = self._running_counts(sums[self.L :], tt)
            psum, K = sums[: self.L], self._switch_weights(avg.to(probs.dtype), t_run.to(probs.dtype))
            kk = self._local_microbatches()
            if pre is not None:
                m = pre
            elif self.megatron_quirks:  # DDP's 1/D on top of the schedule's 1/K: 1/D of the logged value
                m = 1.0 / self._count("microbatches")
            else:
                m = 1.0 / kk
            log_scale, den = log_scale / kk, 0.0
        # A(X) = Σ_e K_e·P_e per set, summed over the sets of each layer
        terms = (psum * K).sum(dim=-1) if K.dim() == 2 else (psum * K).sum(dim=(-2, -1))
        if isinstance(m, Tensor):
            pair = terms @ self._pair(w, 1.0, w, log_scale)
            pair = pair * torch.cat([m.reshape(1), pair.new_ones(1)])
            plan.set_scores(K, w * m, tokens, rows=rows, index=index)
        else:
            wl = self._pair(w, m, w, log_scale)
            pair = terms @ wl
            plan.set_scores(K, wl[:, 0], tokens, rows=rows, index=index)
        self._lb_den += den
        return pair, terms

    def _sequence_sums(self, both: Tensor, tokens: Tensor, tt: Tensor) -> tuple[Tensor, Tensor]:
        """Every row a sequence: ``(P [L, b, E], K [L, b, E])``, the counts and token numbers of each row
        summed over its shards (the row group)."""
        b, s = tokens.shape
        seq_sums = _token_sum(both.view(2 * self.L, b, s, self.E), tokens)  # [2L, b, E]
        counts, n, tt_row = self._row_sum(seq_sums[self.L :], tokens.sum(dim=1), tt.reshape(1))
        self._tt_row = tt_row.reshape(())
        if self.megatron_quirks:
            # Megatron folds the batch into the expert dim: every sequence gets the mean valid length.
            n = (self._tt_row / b).expand(b)
        return seq_sums[: self.L], self._switch_weights(counts, n)

    def _document_sums(
        self, probs: Tensor, topk: Tensor, v: Tensor, seg: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Packed rows under per_document: every document is a sequence (DeepSeek's loss per document).
        Scatter-adds over the documents numbered at begin_step. Returns ``(K [L, G, E], P [L, G, E],
        document of every token [T], token weights [T])``; an empty document gives 0 and still counts."""
        doc, ndoc = self.acc.documents_of(seg)
        idx = doc.reshape(-1).to(probs.device)
        keep = ((idx >= 0) & v).to(probs.dtype)
        d = idx.clamp(min=0)
        g = max(ndoc, 1)
        counts = torch.zeros(self.L, g, self.E, dtype=probs.dtype, device=probs.device).index_add_(
            1, d, topk * keep[None, :, None]
        )
        psum = torch.zeros_like(counts).index_add_(1, d, probs * keep[None, :, None])
        n = torch.zeros(g, dtype=probs.dtype, device=probs.device).index_add_(0, d, keep)
        return self._switch_weights(counts, n), psum, d, keep

    def _lagged_weights(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``K`` of ``global_lagged`` from the previous step's global top-k counts ``c_e^prev`` and this
        step's global router tokens (cached for the step)."""
        key = (dtype, device, self.acc.step_index)
        if key not in self._lagged_cache:
            self._lagged_cache.clear()
            counts = self.lagged_counts.to(device=device, dtype=dtype)
            self._lagged_cache[key] = self._switch_weights(
                counts, self.lagged_tokens, max(self._count(ROUTER_TOKENS), 1.0)
            )
        return self._lagged_cache[key]

    def _running_counts(self, counts_local: Tensor, tt: Tensor) -> tuple[Tensor, Tensor]:
        """Megatron global aux loss: this microbatch's top-k counts and tokens summed over the token group
        (one all-reduce), running mean over the step's microbatches per router (a repeated MTP layer's
        calls accumulate into one running mean, like Megatron's ``ga_steps``). Returns ``(avg [L, E], T)``."""
        L, E = self.L, self.E
        buf = torch.cat(
            [
                counts_local.reshape(-1).to(device=self.device, dtype=torch.float64),
                tt.reshape(1).to(device=self.device, dtype=torch.float64),
            ]
        )
        g = self.acc.groups.token_group
        if g is not None:
            dist.all_reduce(buf, group=g)
        counts = buf[:-1].view(L, E)
        n_main = L - self.R
        self._running[:n_main] += counts[:n_main]
        self._running_n[:n_main] += 1
        avg = self._running[:n_main] / self._running_n[:n_main, None]
        if self.R:
            cum = self._running[n_main] + counts[n_main:].cumsum(0)
            steps = self._running_n[n_main] + torch.arange(1, self.R + 1, dtype=torch.float64, device=self.device)
            avg = torch.cat([avg, cum / steps[:, None]])
            self._running[n_main] = cum[-1]
            self._running_n[n_main] += self.R
        return avg.to(counts_local.device), buf[-1].to(counts_local.device)

    def _z_share(self, logits: Tensor, vf: Tensor, tt: Tensor, plan: _GradPlan) -> tuple[Tensor, Tensor]:
        """Router z-loss share of the microbatch (all layers, ``logits [L, T, E]``) with its gradient plan;
        the per-layer sums are :func:`~lossparity.losses.moe.router_z_loss_sums_and_grad`. Returns
        ``([share, logged value], Σ_x lse² per layer)``."""
        _, w_grad, w_log = self._weights(logits.dtype, logits.device)
        pre = self._pre(tt)
        w_shown = w_log if self._z_split else w_grad
        if self.z_form == "global":
            wz = self._pair(w_grad, self.z_coeff / max(self._count(ROUTER_TOKENS), 1.0), w_shown, 1.0 / self.log_layers)
            zsum, plan.z_grad = F_moe.router_z_loss_sums_and_grad(logits, vf, wz[:, 0])  # [L], [L, T, E]
            return zsum @ wz, zsum
        # Megatron z_loss_func: mean over the microbatch's valid tokens (of every shard of its rows), then
        # over microbatches
        tt_row = self._tt_row if self._tt_row is not None else self._row_sum(tt.reshape(1))[0].reshape(())
        mean = 1.0 / tt_row.clamp(min=1)
        c = mean if pre is None else mean * pre
        wz = self._pair(
            w_grad,
            self.z_coeff * (1.0 / self._count("microbatches") if pre is None else 1.0),
            w_shown,
            1.0 / self.log_layers,
        )
        zsum, plan.z_grad = F_moe.router_z_loss_sums_and_grad(logits, vf, wz[:, 0] * c)
        self._z_den += self._den_frac / self._row_size
        return (zsum @ wz) * torch.cat([c.reshape(1), mean.reshape(1)]), zsum

    # ---------------------------------------------------------------- end of step
    def _flush_logs(self) -> None:
        """Hand the step's accumulated log values and objective contribution to the accountant (one kernel)."""
        vec = self._logvec
        if vec is None:
            return
        acc = self.acc
        # Megatron calculate_per_token_loss under deferred normalization: objective = Σ raw shares / Ntok
        scale = 1.0 / max(acc.global_count("tokens"), 1.0) if acc.normalization == "deferred" else 1.0
        key = (vec.device, scale)
        if key not in self._log_maps:
            m = self._log_map.clone()
            m[-1] *= scale
            self._log_maps = {key: m.to(vec.device)}
        out = self._log_maps[key] @ vec
        slots = list(self._log_slots)
        host: list[float] = []
        if self.log_name and self._aux_on:
            slots.append(f"den:{self.log_name}")
            host.append(self._lb_den)
        if self.z_log_name and self._z_on and self.z_form != "global":
            slots.append(f"den:{self.z_log_name}")
            host.append(self._z_den)
        if host:
            out = torch.cat([out, torch.tensor(host, dtype=torch.float64, device=out.device)])
        acc.record_many(slots, out)

    def _check_routers(self, routers: Sequence[Router]) -> None:
        if len(routers) != self.num_slots:
            raise ValueError(f"expected {self.num_slots} routers (one per distinct MoE layer), got {len(routers)}")
        for i, r in enumerate(routers):
            for field in ("tokens_per_expert", "expert_bias"):
                x = getattr(r, field, None)
                if not isinstance(x, Tensor) or x.shape != (self.E,):
                    shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                    raise ValueError(f"router {i}: {field} must be a [{self.E}] tensor, got {shape}")
            lid = getattr(r, "layer_id", i)
            if self._log_vio and not self._by_position and lid not in self._vio_ids:
                raise ValueError(f"router {i} has layer_id {lid}, not among log_layer_ids {self._vio_ids}")

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
        self._check_routers(routers)
        bias_rate = _check_coeff("bias_rate", bias_rate)
        self.acc.step_end_done(self._end_name)
        self._flush_logs()
        self._reset_step()
        if not self.L:
            return {}
        dispatch, topk_counts = self._reduce_counts(routers)
        with torch.no_grad():
            if bias_rate > 0:  # all layers at once ([layers, E]), then back into every router's buffer
                bias = torch.stack([r.expert_bias for r in routers])
                new = F_moe.expert_bias_update(dispatch, bias, bias_rate, zero_mean=zero_mean)
                for r, row in zip(routers, new):
                    r.expert_bias.copy_(row)
            for r in routers:
                r.reset_counts()
        vio_t = F_moe.max_violation(dispatch)
        self._record_vio(routers, vio_t)
        if self.scope == "global_running":
            self._running.zero_()
            self._running_n.zero_()
        return self._update_lagged(routers, vio_t, topk_counts)

    def _reduce_counts(self, routers: Sequence[Router]) -> tuple[Tensor, Tensor | None]:
        """The step's dispatch counts ``[slots, E]`` (and top-k counts ``[L, E]``) summed over the token group."""
        with torch.no_grad():
            local = torch.stack([r.tokens_per_expert for r in routers])
        if local.device != self.device or local.dtype != torch.float64:
            local = local.to(self.device, torch.float64)
        lagged = self.scope == "global_lagged"
        buf = torch.cat([local.reshape(-1), self._topk_counts.reshape(-1)]) if lagged else local.reshape(-1)
        g = self.acc.groups.token_group
        if g is not None:
            dist.all_reduce(buf, group=g)
        n = self.num_slots * self.E
        return buf[:n].view(self.num_slots, self.E), buf[n:].view(self.L, self.E) if lagged else None

    def _record_vio(self, routers: Sequence[Router], vio: Tensor) -> None:
        """``max_vio`` into the accountant's logging collective: one route, with and without pipelining
        (the first rank of the token group records: the value is the same on all of them)."""
        if not self._log_vio or self.acc.groups.token_rank() != 0:
            return
        ids = (
            self._vio_ids[: len(routers)]
            if self._by_position
            else [getattr(r, "layer_id", i) for i, r in enumerate(routers)]
        )
        names = [f"max_vio/layer_{lid}" for lid in ids] + ["max_vio"]
        key = (vio.shape[0], vio.dtype, vio.device)
        if key not in self._vio_maps:  # [n, n+1] = [identity | 1/layers]: the values and their layer mean
            m = torch.cat([torch.eye(vio.shape[0]), torch.full((vio.shape[0], 1), 1.0 / len(self._vio_ids))], dim=1)
            self._vio_maps[key] = m.to(vio.device, vio.dtype)
        self.acc.record_sums(names, vio @ self._vio_maps[key])

    def _update_lagged(self, routers: Sequence[Router], vio_t: Tensor, topk_counts: Tensor | None) -> dict[str, float]:
        stats = vio_t if topk_counts is None else torch.cat([vio_t, topk_counts[0].sum().reshape(1) / self.k])
        values = stats.tolist()  # the one host sync of end_step
        vio = values[: self.num_slots]
        if topk_counts is not None:
            if values[-1] > 0:  # a step without any token keeps the previous fractions
                self.lagged_counts = topk_counts.clone()
                self.lagged_tokens = values[-1]
                self._lagged_cache.clear()
            self._topk_counts.zero_()
        out = {"max_vio": sum(vio) / len(vio)}
        out.update({f"max_vio/layer_{getattr(r, 'layer_id', i)}": x for i, (r, x) in enumerate(zip(routers, vio))})
        return out

    def state_dict(self) -> MoEAccountingState:
        """State to checkpoint: the previous step's global counts of ``global_lagged`` (CPU float64)."""
        return MoEAccountingState(
            lagged_counts=self.lagged_counts.detach().cpu().clone(), lagged_tokens=self.lagged_tokens
        )

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict` (``lagged_counts [L, E]``, ``lagged_tokens > 0``)."""
        counts = state["lagged_counts"]
        if not isinstance(counts, Tensor) or counts.shape != (self.L, self.E):
            shape = tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__
            raise ValueError(f"state['lagged_counts'] must be a [{self.L}, {self.E}] tensor, got {shape}")
        # an unchecked checkpoint value: float() itself raises on what is not a number (typeshed's float()
        # accepts only SupportsFloat/str/buffers, not ``object``)
        tokens = float(state["lagged_tokens"])  # type: ignore[arg-type]
        if not tokens > 0:
            raise ValueError(f"state['lagged_tokens'] must be > 0, got {tokens}")
        self.lagged_counts = counts.to(device=self.device, dtype=torch.float64).clone()
        self.lagged_tokens = tokens
        self._lagged_cache.clear()
