"""The token sets of the MoE auxiliary terms: one small strategy per load-balancing scope and per z-loss form
(semantics §5).

Every load-balancing scope evaluates the one formula ``A(X) = Σ_e K_e(X)·P_e(X)``
(:func:`lossparity.losses.moe.switch_load_balancing_weights`, ``K_e = α·E·c_e/(k·T_c·T_p)``,
``P_e = Σ_{x∈X} p[x,e]``) on its own token sets; a scope only says

- which sets ``X`` a microbatch holds and their counts (:meth:`LoadBalancingScope.sets`, returning :class:`ScopeSets`:
  ``P``, ``K``, the multiplier ``m`` of the share ``m·Σ_l w_l·Σ_X A(X)``, the logged value's scale and the
  log denominator it adds),
- what it keeps across microbatches and steps (``global_lagged``'s previous-step counts,
  ``global_running``'s running mean) and what it adds to :meth:`MoEAccounting.end_step`'s one collective.

The z-loss forms (:class:`ZLossForm`) likewise only choose the divisor of ``Σ_x lse(x)²``. The common work
(stacking the records, the token sums, the share and its gradient, the logs) stays in
:class:`~lossparity.distributed.moe.accounting.MoEAccounting`, which owns one scope and one z form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ...losses import moe as F_moe
from ...losses.aux_scopes import global_lagged_weights
from ...options import AuxScope as AuxScopeName
from ...options import ZForm
from ..accountant import Accountant
from .grad import GradPlan, token_sum

# The strategies are the owner's parts: they call its private helpers (counts, row-group sums, switch weights).
# ``ScopeOwner`` names exactly what they use, so this module does not import the accounting that owns them.


class ScopeOwner(Protocol):
    """What a scope or z form reads from its owner (:class:`~lossparity.distributed.moe.accounting.MoEAccounting`)."""

    acc: Accountant
    device: torch.device
    num_layers: int
    num_experts: int
    num_slots: int
    log_layers: int
    topk: int
    aux_coeff: float
    z_coeff: float
    megatron_quirks: bool
    repeated_calls: int
    lagged_counts: Tensor
    lagged_tokens: float
    _den_frac: float
    _row_size: int

    def _count(self, name: str) -> float: ...
    def _local_microbatches(self) -> float: ...
    def _log_scale(self) -> float: ...
    def _row_sum(self, *parts: Tensor) -> list[Tensor]: ...
    def _switch_weights(
        self, counts: Tensor, t_counts: Tensor | float, t_probs: Tensor | float | None = None
    ) -> Tensor: ...
    def _z_weights(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]: ...
    def _pair(self, w: Tensor, a: float, w2: Tensor, c: float) -> Tensor: ...


ROUTER_TOKENS = "router_tokens"  # the accountant's count of the step's non-padding router tokens

__all__ = [
    "ROUTER_TOKENS",
    "ScopeOwner",
    "Microbatch",
    "ScopeSets",
    "LoadBalancingScope",
    "MicrobatchScope",
    "SequenceScope",
    "GlobalLaggedScope",
    "GlobalRunningScope",
    "NoScope",
    "ZLossForm",
    "GlobalZ",
    "MicrobatchZ",
    "SCOPE_CLASSES",
    "make_scope",
    "make_z_form",
]


@dataclass
class Microbatch:
    """What the strategies read of one microbatch (all device tensors, no host sync).

    ``probs``/``topk`` ``[L, T, E]`` (``both`` = the two stacked, ``[2L, T, E]``), ``sums`` their ``[2L, E]``
    token sums when the scope needs them, ``v``/``vf`` the valid mask ``[T]`` (bool / 0-1 in the compute
    dtype), ``b × s`` the rows, ``tt`` the valid token count, ``seg`` the segment ids (packed rows),
    ``pre`` Megatron's ``calculate_per_token_loss`` pre-multiplier, ``tt_row`` the tokens over the row
    group once reduced (shared by the scope and the ``microbatch`` z form: one all-reduce)."""

    both: Tensor
    sums: Tensor | None
    v: Tensor
    vf: Tensor
    b: int
    s: int
    tt: Tensor
    seg: Tensor | None
    pre: Tensor | None
    tt_row: Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.both.shape[0] // 2

    @property
    def probs(self) -> Tensor:
        return self.both[: self.num_layers]

    @property
    def topk(self) -> Tensor:
        return self.both[self.num_layers :]


@dataclass
class ScopeSets:
    """The token sets of one microbatch under a scope: ``psum``/``weights`` ``[L, E]`` (one set) or
    ``[L, G, E]`` (``G`` sets), the share multiplier ``mult`` (``m``), the logged value's scale, the log
    denominator added, and the gradient layout: ``tokens`` ``[T]`` (``[b, S]`` with ``rows``) and
    ``index [T]`` (the set of every token)."""

    psum: Tensor
    weights: Tensor
    mult: Tensor | float
    log_scale: float
    den: float
    tokens: Tensor
    rows: tuple[int, int] | None = None
    index: Tensor | None = None


class LoadBalancingScope:
    """Interface of a load-balancing scope (see the module docstring)."""

    name: ClassVar[AuxScopeName]
    log_name: ClassVar[str | None] = None  # Megatron's logged name
    needs_token_sums: ClassVar[bool] = True  # the sets include the whole microbatch: [2L, E] token sums
    counts_without_aux: ClassVar[bool] = False  # its counts are needed even with aux_coeff 0

    def __init__(self, owner: ScopeOwner) -> None:
        self.owner = owner

    @property
    def log_reduction(self) -> str:
        """How the logging collective reduces its logged value: a plain sum of shares, or a ratio."""
        return "sum" if self.name.startswith("global") else "ratio"

    def observe(self, sums: Tensor) -> None:  # noqa: B027 - optional hook
        """See every microbatch's token sums ``[2L, E]`` (also with the aux term off)."""

    def sets(self, mb: Microbatch) -> ScopeSets:
        """The scope's token sets of microbatch ``mb`` and their counts."""
        raise NotImplementedError

    def step_counts(self) -> Tensor | None:
        """``[L, E]`` float64 counts to sum over the token group in ``end_step``'s one all-reduce."""
        return None

    def end_step(self, reduced: Tensor | None) -> Tensor | None:
        """Called in ``end_step`` with :meth:`step_counts` reduced; returns values for its one host sync."""
        return None

    def after_sync(self, reduced: Tensor | None, values: list[float]) -> None:  # noqa: B027 - optional hook
        """Called with the host values returned by :meth:`end_step` (after them in the host list)."""

    def state_changed(self) -> None:  # noqa: B027 - optional hook
        """The owner's checkpointed ``lagged_counts``/``lagged_tokens`` were restored."""


class NoScope(LoadBalancingScope):
    """``none``: no load-balancing term."""

    name = "none"
    needs_token_sums = False


class MicrobatchScope(LoadBalancingScope):
    """``microbatch``: one set per microbatch (of all the shards of its rows), mean over the ``D·K``
    microbatches: ``(1/(D·K)) Σ_mb A(X_mb)``."""

    name = "microbatch"
    log_name = "load_balancing_loss"

    def sets(self, mb: Microbatch) -> ScopeSets:
        o = self.owner
        assert mb.sums is not None  # token sums are taken for this scope
        counts, tt_row = o._row_sum(mb.sums[o.num_layers :], mb.tt.reshape(1))
        mb.tt_row = tt_row.reshape(())
        weights = o._switch_weights(counts, mb.tt_row)
        m = 1.0 / o._count("microbatches") if mb.pre is None else mb.pre
        return ScopeSets(mb.sums[: o.num_layers], weights, m, o._log_scale(), o._den_frac / o._row_size, mb.vf)


class SequenceScope(LoadBalancingScope):
    """``sequence``: one set per row (its shards summed over the row group), or per document of a packed
    row under mode ``per_document``; mean over the ``N`` sequences (``Ndoc`` documents)."""

    name = "sequence"
    log_name = "seq_load_balancing_loss"
    needs_token_sums = False

    def sets(self, mb: Microbatch) -> ScopeSets:
        o = self.owner
        if o.acc.mode == "per_document" and mb.seg is not None and not o.megatron_quirks:
            return self._documents(mb, mb.seg)
        b = mb.b
        tokens = mb.vf.view(b, mb.s)
        psum, weights = self._rows(mb, tokens)  # [L, b, E]
        den = o._den_frac / o._row_size
        log_scale = o._log_scale()
        m: Tensor | float
        if o.megatron_quirks:  # Megatron's per-microbatch loss is the mean over its b sequences
            m = 1.0 / (b * o._count("microbatches")) if mb.pre is None else mb.pre / b
            log_scale = log_scale / b
        else:
            m = 1.0 / max(o._count("samples"), 1.0)
            den = den * b
        return ScopeSets(psum, weights, m, log_scale, den, tokens, rows=(b, mb.s))

    def _rows(self, mb: Microbatch, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Every row a sequence: ``(P [L, b, E], K [L, b, E])``, the counts and token numbers of each row
        summed over its shards (the row group)."""
        o, nl = self.owner, self.owner.num_layers
        b, s = tokens.shape
        seq_sums = token_sum(mb.both.view(2 * nl, b, s, o.num_experts), tokens)  # [2L, b, E]
        counts, n, tt_row = o._row_sum(seq_sums[nl:], tokens.sum(dim=1), mb.tt.reshape(1))
        mb.tt_row = tt_row.reshape(())
        if o.megatron_quirks:
            # Megatron folds the batch into the expert dim: every sequence gets the mean valid length.
            n = (mb.tt_row / b).expand(b)
        return seq_sums[:nl], o._switch_weights(counts, n)

    def _documents(self, mb: Microbatch, seg: Tensor) -> ScopeSets:
        """Packed rows under per_document: every document is a sequence (DeepSeek's loss per document).
        Scatter-adds over the documents numbered at begin_step; an empty document gives 0 and still counts."""
        o = self.owner
        probs, topk = mb.probs, mb.topk
        doc, ndoc = o.acc.documents_of(seg)
        idx = doc.reshape(-1).to(probs.device)
        keep = ((idx >= 0) & mb.v).to(probs.dtype)
        d = idx.clamp(min=0)
        g = max(ndoc, 1)
        counts = torch.zeros(o.num_layers, g, o.num_experts, dtype=probs.dtype, device=probs.device).index_add_(
            1, d, topk * keep[None, :, None]
        )
        psum = torch.zeros_like(counts).index_add_(1, d, probs * keep[None, :, None])
        n = torch.zeros(g, dtype=probs.dtype, device=probs.device).index_add_(0, d, keep)
        m = 1.0 / max(o._count("documents"), 1.0)
        den = o._den_frac * o.acc.documents_of(seg)[1]
        return ScopeSets(psum, o._switch_weights(counts, n), m, o._log_scale(), den, keep, index=d)


class GlobalLaggedScope(LoadBalancingScope):
    """``global_lagged``: the whole global batch with the previous step's global counts:
    ``α·E/k · Σ_e f_e^prev · Σ_x p[x,e] / Tt`` (``f^prev = k/E`` at step 0). Counts this step's top-k
    maps for the next step (also with the aux term off), sums them in ``end_step``'s collective and
    stores them in the owner's checkpointed ``lagged_counts``/``lagged_tokens``."""

    name = "global_lagged"
    log_name = "global_load_balancing_loss"
    counts_without_aux = True

    def __init__(self, owner: ScopeOwner) -> None:
        super().__init__(owner)
        self._cache: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}
        self._topk_counts = torch.zeros(owner.num_layers, owner.num_experts, dtype=torch.float64, device=owner.device)

    def observe(self, sums: Tensor) -> None:
        self._topk_counts += sums[self.owner.num_layers :].to(self.owner.device, torch.float64)

    def sets(self, mb: Microbatch) -> ScopeSets:
        assert mb.sums is not None  # token sums are taken for this scope
        probs = mb.probs
        return ScopeSets(
            mb.sums[: self.owner.num_layers],
            self._weights(probs.dtype, probs.device),
            1.0,
            self.owner._log_scale(),
            0.0,
            mb.vf,
        )

    def _weights(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``K`` from the previous step's global top-k counts ``c_e^prev`` and this step's global router
        tokens (cached for the step)."""
        o = self.owner
        key = (dtype, device, o.acc.step_index)
        if key not in self._cache:
            self._cache.clear()
            counts = o.lagged_counts.to(device=device, dtype=dtype)
            self._cache[key] = global_lagged_weights(
                counts,
                o.lagged_tokens,
                max(o._count(ROUTER_TOKENS), 1.0),
                topk=o.topk,
                num_experts=o.num_experts,
                coeff=o.aux_coeff,
            )
        return self._cache[key]

    def step_counts(self) -> Tensor | None:
        return self._topk_counts

    def end_step(self, reduced: Tensor | None) -> Tensor | None:
        assert reduced is not None
        return reduced[0].sum().reshape(1) / self.owner.topk  # the global router tokens of the step

    def after_sync(self, reduced: Tensor | None, values: list[float]) -> None:
        assert reduced is not None
        if values[-1] > 0:  # a step without any token keeps the previous fractions
            self.owner.lagged_counts = reduced.clone()
            self.owner.lagged_tokens = values[-1]
            self._cache.clear()
        self._topk_counts.zero_()

    def state_changed(self) -> None:
        self._cache.clear()


class GlobalRunningScope(LoadBalancingScope):
    """``global_running`` (Megatron ``global_aux_loss``): microbatch ``m``'s counts summed over the DP ranks
    (one all-reduce per microbatch) and averaged over microbatches ``1..m``; ``(1/K) Σ_m A_m``."""

    name = "global_running"
    log_name = "global_load_balancing_loss"

    def __init__(self, owner: ScopeOwner) -> None:
        super().__init__(owner)
        slots, ne, dev = owner.num_slots, owner.num_experts, owner.device
        self._running = torch.zeros(slots, ne, dtype=torch.float64, device=dev)
        self._running_n = torch.zeros(slots, dtype=torch.float64, device=dev)

    def sets(self, mb: Microbatch) -> ScopeSets:
        o = self.owner
        assert mb.sums is not None  # token sums are taken for this scope
        dtype = mb.sums.dtype
        avg, t_run = self._running_counts(mb.sums[o.num_layers :], mb.tt)
        weights = o._switch_weights(avg.to(dtype), t_run.to(dtype))
        kk = o._local_microbatches()
        m: Tensor | float
        if mb.pre is not None:
            m = mb.pre
        elif o.megatron_quirks:  # DDP's 1/D on top of the schedule's 1/K: 1/D of the logged value
            m = 1.0 / o._count("microbatches")
        else:
            m = 1.0 / kk
        return ScopeSets(mb.sums[: o.num_layers], weights, m, o._log_scale() / kk, 0.0, mb.vf)

    def _running_counts(self, counts_local: Tensor, tt: Tensor) -> tuple[Tensor, Tensor]:
        """This microbatch's top-k counts and tokens summed over the token group (one all-reduce), running
        mean over the step's microbatches per router (a repeated MTP layer's calls accumulate into one
        running mean, like Megatron's ``ga_steps``). Returns ``(avg [L, E], T)``."""
        o = self.owner
        nl, ne, rep = o.num_layers, o.num_experts, o.repeated_calls
        buf = torch.cat(
            [
                counts_local.reshape(-1).to(device=o.device, dtype=torch.float64),
                tt.reshape(1).to(device=o.device, dtype=torch.float64),
            ]
        )
        g = o.acc.groups.token_group
        if g is not None:
            dist.all_reduce(buf, group=g)
        counts = buf[:-1].view(nl, ne)
        n_main = nl - rep
        self._running[:n_main] += counts[:n_main]
        self._running_n[:n_main] += 1
        avg = self._running[:n_main] / self._running_n[:n_main, None]
        if rep:
            cum = self._running[n_main] + counts[n_main:].cumsum(0)
            steps = self._running_n[n_main] + torch.arange(1, rep + 1, dtype=torch.float64, device=o.device)
            avg = torch.cat([avg, cum / steps[:, None]])
            self._running[n_main] = cum[-1]
            self._running_n[n_main] += rep
        return avg.to(counts_local.device), buf[-1].to(counts_local.device)

    def end_step(self, reduced: Tensor | None) -> Tensor | None:
        self._running.zero_()
        self._running_n.zero_()
        return None


SCOPE_CLASSES: dict[str, type[LoadBalancingScope]] = {
    c.name: c for c in (MicrobatchScope, SequenceScope, GlobalLaggedScope, GlobalRunningScope, NoScope)
}


def make_scope(name: AuxScopeName, owner: ScopeOwner) -> LoadBalancingScope:
    """The strategy of the (validated) scope ``name`` for ``owner``."""
    return SCOPE_CLASSES[name](owner)


# ---------------------------------------------------------------------------------------- z-loss forms
class ZLossForm:
    """Interface of a router z-loss form: the divisor of ``β·Σ_x lse(x)²`` per microbatch."""

    name: ClassVar[ZForm]
    den_on_device: ClassVar[bool]  # the logged denominator is the router-token count (a device value)

    def __init__(self, owner: ScopeOwner) -> None:
        self.owner = owner

    def share(self, logits: Tensor, mb: Microbatch, plan: GradPlan) -> tuple[Tensor, Tensor, float]:
        """Z-loss share of the microbatch (all layers, ``logits [L, T, E]``) with its gradient plan
        (:func:`~lossparity.losses.moe.router_z_loss_sums_and_grad`). Returns ``([share, logged value],
        Σ_x lse² per layer, log denominator added)``."""
        raise NotImplementedError


class GlobalZ(ZLossForm):
    """``global`` (invariant): ``β·Σ_{x in batch} lse(x)² / Tt_global``."""

    name = "global"
    den_on_device = True

    def share(self, logits: Tensor, mb: Microbatch, plan: GradPlan) -> tuple[Tensor, Tensor, float]:
        o = self.owner
        w_grad, w_shown = o._z_weights(logits.dtype, logits.device)
        wz = o._pair(w_grad, o.z_coeff / max(o._count(ROUTER_TOKENS), 1.0), w_shown, 1.0 / o.log_layers)
        zsum, plan.z_grad = F_moe.router_z_loss_sums_and_grad(logits, mb.vf, wz[:, 0])  # [L], [L, T, E]
        return zsum @ wz, zsum, 0.0


class MicrobatchZ(ZLossForm):
    """``microbatch`` (Megatron ``z_loss_func``): ``β·(1/(D·K)) Σ_mb mean_{x∈mb} lse(x)²``, the mean over
    the microbatch's valid tokens of every shard of its rows."""

    name = "microbatch"
    den_on_device = False

    def share(self, logits: Tensor, mb: Microbatch, plan: GradPlan) -> tuple[Tensor, Tensor, float]:
        o = self.owner
        w_grad, w_shown = o._z_weights(logits.dtype, logits.device)
        tt_row = mb.tt_row if mb.tt_row is not None else o._row_sum(mb.tt.reshape(1))[0].reshape(())
        mean = 1.0 / tt_row.clamp(min=1)
        c = mean if mb.pre is None else mean * mb.pre
        wz = o._pair(
            w_grad,
            o.z_coeff * (1.0 / o._count("microbatches") if mb.pre is None else 1.0),
            w_shown,
            1.0 / o.log_layers,
        )
        zsum, plan.z_grad = F_moe.router_z_loss_sums_and_grad(logits, mb.vf, wz[:, 0] * c)
        return (zsum @ wz) * torch.cat([c.reshape(1), mean.reshape(1)]), zsum, o._den_frac / o._row_size


def make_z_form(name: ZForm, owner: ScopeOwner) -> ZLossForm:
    """The strategy of the (validated) z-loss form ``name`` for ``owner``."""
    return (GlobalZ if name == "global" else MicrobatchZ)(owner)
