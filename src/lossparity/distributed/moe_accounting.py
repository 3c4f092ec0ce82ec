"""MoE auxiliary losses through the accountant, and aux-loss-free expert-bias balancing (SPEC §5, §6).

The formulas are those of :mod:`lossparity.losses.moe` (``A(X) = α·E/(k·T²)·Σ_e c_e·Σ_{x in X} p[x,e]``,
router z-loss ``β·lse(x)²``); this module decides *which token set* each one sees and *which weight* its
gradient gets, so that the objective is exactly the one SPEC §5 defines. The per-layer work is vectorized
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
numbers instead, including its documented deviations from SPEC §5 (see :class:`MoEAccounting`).

Recompute safety: the losses are computed from the router records *returned* by the forward, which
a checkpoint re-run never returns, and the routers' dispatch counters skip re-runs themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch
import torch.distributed as dist
from torch import Tensor

from ..losses import moe as F_moe
from .accountant import Accountant

__all__ = ["SCOPES", "Z_FORMS", "LOG_NAMES", "ROUTER_TOKENS", "MoEAccounting"]

SCOPES = ("micro_batch", "sequence", "global_lagged", "global_running", "none")
Z_FORMS = ("global", "microbatch")
LOG_NAMES = {
    "micro_batch": "load_balancing_loss",
    "sequence": "seq_load_balancing_loss",
    "global_lagged": "global_load_balancing_loss",
    "global_running": "global_load_balancing_loss",
}
ROUTER_TOKENS = "router_tokens"


def _check_coeff(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return value


class MoEAccounting:
    """Auxiliary MoE losses of one model for one accountant (see the module docstring).

    Protocol per step: pass :meth:`router_tokens` of the step's microbatches to
    ``acc.begin_step(..., extra_counts=...)``; per microbatch add :meth:`microbatch_loss` to the loss
    before ``backward``; after the last backward (and after ``acc.finish_step`` under deferred
    normalization) call :meth:`end_step` on every rank, every step (one all-reduce: dispatch counts for
    the expert bias and top-k counts for ``global_lagged``), before ``optimizer.step()``.

    Args:
        acc: the step's :class:`~lossparity.distributed.accountant.Accountant`.
        num_layers: ``L``, the number of router records per forward (main MoE layers then MTP ones).
        num_experts: ``E`` routed experts. topk: ``k`` experts per token (``1 <= k <= E``).
        scope: one of :data:`SCOPES`. aux_coeff: ``α >= 0``. z_coeff: ``β >= 0`` (0 disables the z-loss).
        z_form: ``"global"`` (invariant, default) or ``"microbatch"`` (Megatron); with
            ``megatron_quirks`` it defaults to, and must be, ``"microbatch"``.
        megatron_quirks: reproduce Megatron-LM (``megatron`` preset): the ``global_running`` gradient is
            ``1/D`` of its logged value; ``sequence`` divides every sequence by the microbatch's mean
            valid length; the z-loss of a repeated MTP layer is not divided by its number of calls in the
            gradient; with ``calculate_per_token_loss`` every term is pre-multiplied by the microbatch's
            router-token count (Megatron: local count × |TP×CP|) and divided by the global LM token count.
        calculate_per_token_loss: Megatron's flag (only with ``megatron_quirks``); ``None`` = True exactly
            when ``acc.normalization == "deferred"`` (which requires it).
        repeated_mtp_calls: ``R``: the last ``R`` records are ``R`` calls of one shared MTP MoE layer
            (Megatron ``mtp_use_repeated_layer``). That layer's terms are the mean over its calls and it
            counts once in the layer mean of the logs and in ``end_step``'s routers. 0 or 1: no sharing.
    """

    def __init__(
        self,
        acc: Accountant,
        num_layers: int,
        num_experts: int,
        topk: int,
        *,
        scope: str = "micro_batch",
        aux_coeff: float = 1e-2,
        z_coeff: float = 0.0,
        z_form: str | None = None,
        megatron_quirks: bool = False,
        calculate_per_token_loss: bool | None = None,
        repeated_mtp_calls: int = 0,
    ) -> None:
        if not isinstance(acc, Accountant):
            raise TypeError(f"acc must be an Accountant, got {type(acc).__name__}")
        if scope not in SCOPES:
            raise ValueError(f"unknown aux scope {scope!r}; valid: {', '.join(SCOPES)}")
        num_layers = _check_int("num_layers", num_layers, 0)
        num_experts = _check_int("num_experts", num_experts, 1)
        topk = _check_int(f"topk (num_experts={num_experts})", topk, 1, num_experts)
        aux_coeff = _check_coeff("aux_coeff", aux_coeff)
        z_coeff = _check_coeff("z_coeff", z_coeff)
        repeated_mtp_calls = _check_int(f"repeated_mtp_calls (num_layers={num_layers})", repeated_mtp_calls, 0,
                                        num_layers)
        if z_form is None:
            z_form = "microbatch" if megatron_quirks else "global"
        if z_form not in Z_FORMS:
            raise ValueError(f"unknown z_form {z_form!r}; valid: {', '.join(Z_FORMS)}")
        if megatron_quirks and z_form != "microbatch":
            raise ValueError("megatron_quirks=True needs z_form='microbatch' (Megatron's z-loss is a microbatch "
                             f"mean), got z_form={z_form!r}")
        deferred = acc.normalization == "deferred"
        if calculate_per_token_loss is None:
            calculate_per_token_loss = deferred and megatron_quirks
        if calculate_per_token_loss and not megatron_quirks:
            raise ValueError("calculate_per_token_loss=True is a Megatron setting: it needs megatron_quirks=True")
        active = num_layers > 0 and ((scope != "none" and aux_coeff > 0) or z_coeff > 0)
        if deferred and active and not calculate_per_token_loss:
            raise ValueError(
                "MoE auxiliary losses under normalization='deferred' divide every gradient by the token count "
                "known only at the end of the step: use normalization='precount', or megatron_quirks=True with "
                "calculate_per_token_loss=True (Megatron pre-multiplies each term by its token count)")
        if deferred and active and scope == "global_lagged" and aux_coeff > 0:
            raise ValueError("scope 'global_lagged' needs the global router token count before the first "
                             "backward: use normalization='precount'")
        self.acc, self.L, self.E, self.k = acc, num_layers, num_experts, topk
        self.scope, self.aux_coeff, self.z_coeff, self.z_form = scope, aux_coeff, z_coeff, z_form
        self.megatron_quirks = bool(megatron_quirks)
        self.calculate_per_token_loss = bool(calculate_per_token_loss)
        self.R = repeated_mtp_calls if repeated_mtp_calls > 1 else 0
        # Slots = distinct MoE layers (routers): the R calls of a repeated MTP layer share the last slot.
        self.num_slots = num_layers - self.R + 1 if self.R else num_layers
        self.device = acc.device
        w = torch.ones(num_layers, dtype=torch.float64)
        if self.R:
            w[num_layers - self.R:] = 1.0 / self.R
        self._w_aux = w  # a repeated layer's term is the mean over its calls (Megatron: aux / mtp_num_layers)
        # Megatron divides a repeated MTP layer's z-loss by its calls only in the log (TODO in router.py).
        self._w_zgrad = torch.ones(num_layers, dtype=torch.float64) if self.megatron_quirks else w
        self._w_zlog = w
        self._wcache: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}
        self.log_name = LOG_NAMES.get(scope) if (num_layers and aux_coeff > 0) else None
        if self.log_name:
            acc.declare_metric(self.log_name, "sum" if scope.startswith("global") else "ratio")
        if z_coeff > 0 and num_layers:
            acc.declare_metric("z_loss", "ratio")
        # global_lagged: previous step's global top-k counts and token count (uniform at step 0).
        self.lagged_counts = torch.full((num_layers, num_experts), float(topk) / num_experts, dtype=torch.float64,
                                        device=self.device)
        self.lagged_tokens = 1.0
        self._topk_counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=self.device)
        self._running = torch.zeros(self.num_slots, num_experts, dtype=torch.float64, device=self.device)
        self._running_n = torch.zeros(self.num_slots, dtype=torch.float64, device=self.device)
        self._deferred_objective = torch.zeros((), dtype=torch.float64, device=self.device)

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
            self._wcache[key] = tuple(w.to(device=device, dtype=dtype)  # type: ignore[assignment]
                                      for w in (self._w_aux, self._w_zgrad, self._w_zlog))
        return self._wcache[key]

    def _count(self, name: str) -> float:
        try:
            return self.acc.global_count(name)
        except KeyError:
            raise KeyError(f"MoEAccounting needs the count {name!r} of this step: pass "
                           "extra_counts=MoEAccounting.router_tokens(valids) to acc.begin_step") from None

    def _local_microbatches(self) -> float:
        """``K``: microbatches of this rank (all ranks of the token group run the same number)."""
        n = self.acc.global_count("microbatches")
        g = self.acc.groups.token_group
        if self.acc.normalization == "deferred" or g is None:
            return n
        return n / dist.get_world_size(g)

    def _check_records(self, records: Sequence[object], valid: Tensor) -> tuple[int, int]:
        if not isinstance(valid, Tensor):
            raise TypeError(f"valid must be a torch.Tensor [b, S], got {type(valid).__name__}")
        if valid.dim() not in (1, 2):
            raise ValueError(f"valid must be [b, S] (or [S]), got shape {tuple(valid.shape)}")
        if len(records) != self.L:
            raise ValueError(f"expected {self.L} router records (one per MoE layer call), got {len(records)}")
        t = valid.numel()
        for i, r in enumerate(records):
            for field in ("logits", "probs", "topk_map"):
                x = getattr(r, field, None)
                if not isinstance(x, Tensor):
                    raise TypeError(f"router record {i} has no tensor field {field!r}")
                if x.shape != (t, self.E):
                    raise ValueError(f"router record {i}: {field} has shape {tuple(x.shape)}, expected "
                                     f"[{t}, {self.E}] (valid has shape {tuple(valid.shape)}, num_experts={self.E})")
        return (1, t) if valid.dim() == 1 else (valid.shape[0], valid.shape[1])

    def microbatch_loss(self, records: Sequence[object], valid: Tensor) -> Tensor:
        """The auxiliary objective share of one microbatch, summed over its MoE layers (SPEC §5).

        ``records`` are the ``L`` router records of this forward (``logits``, ``probs``, ``topk_map``, each
        ``[b·S, E]`` in row-major token order), ``valid [b, S]`` marks non-padding tokens. Returns the share
        ``Σ_l w_l·term_l`` whose sum over the step's microbatches and ranks is the auxiliary objective
        (a raw, token-pre-multiplied share under deferred normalization); records the logged values and
        the objective contribution in the accountant. A zero-token microbatch contributes 0 and counts.
        """
        b, s = self._check_records(records, valid)
        acc = self.acc
        if not records:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        ref = records[0].probs
        dtype = ref.dtype if ref.dtype == torch.float64 else torch.float32
        dev = ref.device
        w_aux, w_zgrad, w_zlog = self._weights(dtype, dev)
        v = valid.reshape(-1).to(dev) > 0  # [T]
        tt_local = int(v.sum())  # the only host sync of the common path
        pre = self._per_token_factor(tt_local)
        total = torch.zeros((), dtype=dtype, device=dev)
        do_aux = self.scope != "none" and self.aux_coeff > 0
        if do_aux or self.scope == "global_lagged":
            probs = torch.stack([r.probs for r in records]).to(dtype)  # [L, T, E]
            topk = torch.stack([r.topk_map for r in records]).bool() & v[None, :, None]
            probs = torch.where(v[None, :, None], probs, torch.zeros((), dtype=dtype, device=dev))
            if self.scope == "global_lagged":
                self._topk_counts += topk.sum(dim=1).to(device=self.device, dtype=torch.float64)
            if do_aux:
                total = total + self._aux_share(probs, topk, v, b, s, tt_local, pre, w_aux)
        if self.z_coeff > 0:
            total = total + self._z_share(records, v, dtype, tt_local, pre, w_zgrad, w_zlog)
        if acc.normalization == "deferred":
            self._deferred_objective += total.detach().to(device=self.device, dtype=torch.float64)
        else:
            acc.add_objective(total.detach())
        return total

    def _per_token_factor(self, tt_local: int) -> float | None:
        """Megatron ``calculate_per_token_loss``: ``n_mb`` (÷ ``Ntok`` under precount), else ``None``."""
        if not self.calculate_per_token_loss:
            return None
        if self.acc.normalization == "deferred":
            return float(tt_local)
        return tt_local / max(self.acc.global_count("tokens"), 1.0)

    def _aux_share(self, probs: Tensor, topk: Tensor, v: Tensor, b: int, s: int, tt_local: int,
                   pre: float | None, w: Tensor) -> Tensor:
        """Load-balancing share of the microbatch (all layers), and its log record."""
        acc, L, E, k, alpha = self.acc, self.L, self.E, self.k, self.aux_coeff
        dtype, dev = probs.dtype, probs.device
        scale = alpha * E / k
        if self.scope == "micro_batch":
            psum = probs.sum(dim=1)  # [L, E]
            counts = topk.sum(dim=1).to(dtype)
            a = (psum * counts).sum(-1) * (scale / max(tt_local, 1) ** 2)  # A(X_mb) per layer
            share = a / acc.num_microbatches if pre is None else a * pre
            acc.record(self.log_name, (a * w).sum() / (alpha * self.num_slots), 1.0)
        elif self.scope == "sequence":
            psum = probs.view(L, b, s, E).sum(dim=2)  # [L, b, E]
            counts = topk.view(L, b, s, E).sum(dim=2).to(dtype)
            n = v.view(b, s).sum(dim=1).to(dtype)  # tokens per sequence
            if self.megatron_quirks:
                # Megatron folds the batch into the expert dim: every sequence gets the mean valid length.
                n = torch.full_like(n, tt_local / b)
            safe = torch.where(n > 0, n, torch.ones_like(n))
            per_seq = torch.where(n > 0, (psum * counts).sum(-1) * scale / (safe * safe), torch.zeros_like(n))
            seq_sum = per_seq.sum(dim=1)  # Σ_j A(X_j) per layer
            if self.megatron_quirks:
                mean = seq_sum / b  # Megatron's per-microbatch loss: mean over its b sequences
                share = mean / acc.num_microbatches if pre is None else mean * pre
                acc.record(self.log_name, (mean * w).sum() / (alpha * self.num_slots), 1.0)
            else:
                share = seq_sum / max(acc.global_count("samples"), 1.0)
                acc.record(self.log_name, (seq_sum * w).sum() / (alpha * self.num_slots), float(b))
        elif self.scope == "global_lagged":
            tt_global = max(self._count(ROUTER_TOKENS), 1.0)
            frac = (self.lagged_counts / self.lagged_tokens).to(device=dev, dtype=dtype)  # f_e of last step
            share = (probs.sum(dim=1) * frac).sum(-1) * (scale / tt_global)
            acc.record(self.log_name, (share * w).sum() / (alpha * self.num_slots), 0.0)
        else:  # global_running
            a = self._running_local(probs, topk, tt_local)
            kk = self._local_microbatches()
            if pre is not None:
                share = a * pre
            elif self.megatron_quirks:
                share = a / acc.num_microbatches  # DDP's 1/D on top of the 1/K: 1/D of the logged value
            else:
                share = a / kk
            acc.record(self.log_name, (a * w).sum() / (kk * alpha * self.num_slots), 0.0)
        return (share * w).sum()

    def _running_local(self, probs: Tensor, topk: Tensor, tt_local: int) -> Tensor:
        """Megatron global aux loss of this rank's tokens: counts of this microbatch summed over the token
        group, running mean over the step's microbatches (per router: a repeated MTP layer's calls
        accumulate into one running mean, like Megatron's ``ga_steps``); ``T`` = the microbatch's tokens
        over the token group. Returns ``[L]`` (local part: the sum over ranks is ``A``)."""
        L, E = self.L, self.E
        buf = torch.empty(L * E + 1, dtype=torch.float64, device=self.device)
        buf[:-1] = topk.sum(dim=1).reshape(-1).to(device=self.device, dtype=torch.float64)
        buf[-1] = float(tt_local)
        g = self.acc.groups.token_group
        if g is not None:
            dist.all_reduce(buf, group=g)
        counts = buf[:-1].view(L, E)
        t_run = float(buf[-1])
        n_main = L - self.R
        avg = torch.empty_like(counts)
        self._running[:n_main] += counts[:n_main]
        self._running_n[:n_main] += 1
        avg[:n_main] = self._running[:n_main] / self._running_n[:n_main, None]
        if self.R:
            cum = self._running[n_main] + counts[n_main:].cumsum(0)
            steps = self._running_n[n_main] + torch.arange(1, self.R + 1, dtype=torch.float64, device=self.device)
            avg[n_main:] = cum / steps[:, None]
            self._running[n_main] = cum[-1]
            self._running_n[n_main] += self.R
        if t_run <= 0:
            return torch.zeros(L, dtype=probs.dtype, device=probs.device)
        c = avg.to(device=probs.device, dtype=probs.dtype)
        return (probs.sum(dim=1) * c).sum(-1) * (self.aux_coeff * E / (self.k * t_run * t_run))

    def _z_share(self, records: Sequence[object], v: Tensor, dtype: torch.dtype, tt_local: int, pre: float | None,
                 w_grad: Tensor, w_log: Tensor) -> Tensor:
        """Router z-loss share of the microbatch (all layers), and its log record."""
        acc, beta = self.acc, self.z_coeff
        logits = torch.stack([r.logits for r in records]).to(dtype)  # [L, T, E]
        lse = torch.logsumexp(logits, dim=-1)
        # where(), not a product: a padding row's NaN/Inf logits never reach the graph.
        zsum = torch.where(v[None, :], lse * lse, torch.zeros((), dtype=dtype, device=lse.device)).sum(dim=1)
        if self.z_form == "global":
            share = zsum * (beta / max(self._count(ROUTER_TOKENS), 1.0))
            acc.record("z_loss", (zsum * w_log).sum() / self.num_slots, float(tt_local))
        else:
            zmean = zsum / max(tt_local, 1)  # Megatron z_loss_func: mean over the microbatch's valid tokens
            share = zmean * (beta / acc.num_microbatches if pre is None else beta * pre)
            acc.record("z_loss", (zmean * w_log).sum() / self.num_slots, 1.0)
        return (share * w_grad).sum()

    # ---------------------------------------------------------------- end of step
    def end_step(self, routers: Sequence[object], *, bias_rate: float = 0.0, zero_mean: bool = False
                 ) -> dict[str, float]:
        """End-of-step MoE state update, before ``optimizer.step()``; one all-reduce over the token group.

        Sums the routers' dispatch counts ``tokens_per_expert`` (aux-loss-free balancing) and this step's
        top-k counts (``global_lagged``) over the ranks holding distinct tokens; updates every router's
        ``expert_bias`` by ``b_e += rate·sign(mean(c) − c_e)`` (optionally zero-mean) when ``bias_rate > 0``;
        resets the counters. Under deferred normalization (Megatron ``calculate_per_token_loss``) it must
        follow ``acc.finish_step`` and adds the step's auxiliary objective ``Σ raw shares / Ntok`` to the log.
        Returns ``max_vio`` (mean over layers of ``(max c − mean c)/mean c`` of the dispatch counts) and
        per-layer ``max_vio/layer_<id>``. Every rank must call it every step (it is a collective).
        """
        if len(routers) != self.num_slots:
            raise ValueError(f"expected {self.num_slots} routers (one per distinct MoE layer), got {len(routers)}")
        bias_rate = _check_coeff("bias_rate", bias_rate)
        for i, r in enumerate(routers):
            for field in ("tokens_per_expert", "expert_bias"):
                x = getattr(r, field, None)
                if not isinstance(x, Tensor) or x.shape != (self.E,):
                    shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                    raise ValueError(f"router {i}: {field} must be a [{self.E}] tensor, got {shape}")
        acc = self.acc
        if acc.normalization == "deferred" and self.L:
            if not getattr(acc, "_finished", False):
                raise RuntimeError("under normalization='deferred' call acc.finish_step() before end_step(): the "
                                   "auxiliary objective is divided by the step's global token count")
            acc.add_objective(self._deferred_objective / max(acc.global_count("tokens"), 1.0))
            self._deferred_objective.zero_()
        if not self.L:
            return {}
        parts = [torch.stack([r.tokens_per_expert.detach().to(device=self.device, dtype=torch.float64)
                              for r in routers]).reshape(-1)]
        lagged = self.scope == "global_lagged"
        if lagged:
            parts.append(self._topk_counts.reshape(-1))
        buf = torch.cat(parts)
        g = acc.groups.token_group
        if g is not None:
            dist.all_reduce(buf, group=g)
        n = self.num_slots * self.E
        dispatch = buf[:n].view(self.num_slots, self.E)
        if bias_rate > 0:
            for i, r in enumerate(routers):
                new = F_moe.expert_bias_update(dispatch[i].to(r.expert_bias.device), r.expert_bias.detach(),
                                               bias_rate, zero_mean=zero_mean)
                with torch.no_grad():
                    r.expert_bias.copy_(new)
        for r in routers:
            r.reset_counts()
        if lagged:
            topk_counts = buf[n:].view(self.L, self.E)
            tokens = float(topk_counts[0].sum()) / self.k
            if tokens > 0:  # a step without any token keeps the previous fractions
                self.lagged_counts = topk_counts.clone()
                self.lagged_tokens = tokens
            self._topk_counts.zero_()
        self._running.zero_()
        self._running_n.zero_()
        vio = F_moe.max_violation(dispatch).tolist()
        out = {"max_vio": sum(vio) / len(vio)}
        out.update({f"max_vio/layer_{getattr(r, 'layer_id', i)}": x for i, (r, x) in enumerate(zip(routers, vio))})
        return out

    def state_dict(self) -> dict[str, object]:
        """State to checkpoint: the previous step's global counts of ``global_lagged`` (CPU float64)."""
        return {"lagged_counts": self.lagged_counts.detach().cpu().clone(), "lagged_tokens": self.lagged_tokens}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` (``lagged_counts [L, E]``, ``lagged_tokens > 0``)."""
        counts = state["lagged_counts"]
        if not isinstance(counts, Tensor) or counts.shape != (self.L, self.E):
            shape = tuple(counts.shape) if isinstance(counts, Tensor) else type(counts).__name__
            raise ValueError(f"state['lagged_counts'] must be a [{self.L}, {self.E}] tensor, got {shape}")
        tokens = float(state["lagged_tokens"])  # type: ignore[arg-type]
        if not tokens > 0:
            raise ValueError(f"state['lagged_tokens'] must be > 0, got {tokens}")
        self.lagged_counts = counts.to(device=self.device, dtype=torch.float64).clone()
        self.lagged_tokens = tokens
