"""MoE auxiliary losses through the accountant, and aux-loss-free expert-bias balancing (SPEC §5, §6).

The formulas live in :mod:`lossparity.losses.moe`; this module decides *which token set* each one
sees and *which weight* its gradient gets, so that the objective is exactly the one SPEC §5 defines:

| scope            | objective contribution (per MoE layer, summed over layers)         | layout   |
|------------------|--------------------------------------------------------------------|----------|
| `micro_batch`    | mean over the `D·K` microbatches of `A(X_mb)`                      | fixed b  |
| `sequence`       | mean over the `N` sequences of `A(X_seq)`                          | any      |
| `global_lagged`  | `α·E/k · Σ_e f_e^prev · Σ_{x in batch} p[x,e] / Tt`                | any      |
| `global_running` | Megatron: mean over microbatches `m` of `A` with counts summed over | D, K     |
|                  | DP and averaged over microbatches `1..m` (one all-reduce per mb)    | dependent|

Router z-loss: ``global`` form ``β·Σ_x lse(x)² / Tt_global`` (invariant) or Megatron's ``microbatch``
form ``β·mean over microbatches of the microbatch mean``. Logged names follow Megatron: each term
divided by its coefficient and averaged over MoE layers.

Recompute safety: the losses are computed from the router records *returned* by the forward, which
a checkpoint re-run never returns, and the routers' dispatch counters skip re-runs themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..losses import moe as F_moe
from .accountant import Accountant

__all__ = ["SCOPES", "Z_FORMS", "LOG_NAMES", "MoEAccounting"]

SCOPES = ("micro_batch", "sequence", "global_lagged", "global_running", "none")
Z_FORMS = ("global", "microbatch")
LOG_NAMES = {
    "micro_batch": "load_balancing_loss",
    "sequence": "seq_load_balancing_loss",
    "global_lagged": "global_load_balancing_loss",
    "global_running": "global_load_balancing_loss",
}
ROUTER_TOKENS = "router_tokens"


class MoEAccounting:
    """Auxiliary MoE losses of one model for one accountant (see module docstring).

    Protocol per step: pass :meth:`router_tokens` of the step's microbatches to
    ``acc.begin_step(..., extra_counts=...)``; per microbatch add :meth:`microbatch_loss` to the loss
    before ``backward``; after the last backward call :meth:`end_step` (one all-reduce: dispatch counts
    for the expert bias and top-k counts for ``global_lagged``), before ``optimizer.step()``.
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
        z_form: str = "global",
    ) -> None:
        if scope not in SCOPES:
            raise ValueError(f"unknown aux scope {scope!r}; valid: {', '.join(SCOPES)}")
        if z_form not in Z_FORMS:
            raise ValueError(f"unknown z_form {z_form!r}; valid: {', '.join(Z_FORMS)}")
        if aux_coeff < 0 or z_coeff < 0:
            raise ValueError(f"aux_coeff and z_coeff must be >= 0, got {aux_coeff} and {z_coeff}")
        if num_layers < 0 or num_experts < 1 or not 1 <= topk <= num_experts:
            raise ValueError(f"need num_layers >= 0 and 1 <= topk <= num_experts, got {num_layers}, {topk}, "
                             f"{num_experts}")
        if acc.normalization == "deferred" and num_layers and (scope != "none" or z_coeff):
            raise ValueError("MoE auxiliary losses need normalization='precount': under 'deferred' every gradient "
                             "is divided by the token count only known at the end of the step")
        self.acc, self.L, self.E, self.k = acc, num_layers, num_experts, topk
        self.scope, self.aux_coeff, self.z_coeff, self.z_form = scope, aux_coeff, z_coeff, z_form
        self.log_name = LOG_NAMES.get(scope)
        if self.log_name and num_layers:
            acc.declare_metric(self.log_name, "sum" if scope.startswith("global") else "ratio")
        if z_coeff and num_layers:
            acc.declare_metric("z_loss", "ratio")
        # global_lagged: previous step's global top-k counts and token count (uniform at step 0).
        self.lagged_counts = torch.full((num_layers, num_experts), float(topk) / num_experts, dtype=torch.float64)
        self.lagged_tokens = 1.0
        self._topk_counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._running = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._running_mbs = 0

    # ---------------------------------------------------------------- per step
    @staticmethod
    def router_tokens(valid_masks: Sequence[Tensor]) -> dict[str, float]:
        """``extra_counts`` for ``begin_step``: this rank's non-padding router tokens of the step."""
        return {ROUTER_TOKENS: float(sum(float(v.sum()) for v in valid_masks))}

    def microbatch_loss(self, records: Sequence[object], valid: Tensor) -> Tensor:
        """The auxiliary objective share of one microbatch (summed over its MoE layers).

        ``records`` are the model's ``RouterRecord``s of this forward, ``valid [b, S]`` marks non-padding
        tokens. Records the logged values in the accountant and the objective contribution.
        """
        if len(records) != self.L:
            raise ValueError(f"expected {self.L} router records (one per MoE layer), got {len(records)}")
        if not records:
            return torch.zeros(())
        acc = self.acc
        v = valid.reshape(-1) > 0
        pad = ~v
        dtype = records[0].probs.dtype
        total = torch.zeros((), dtype=dtype, device=records[0].probs.device)
        aux_log = 0.0
        z_log_num = 0.0
        tt_global = max(acc.global_count(ROUTER_TOKENS), 1.0)
        n_mb = float(acc.num_microbatches)
        b = valid.shape[0]
        tt_local = int(v.sum())
        run_counts = None
        if self.scope == "global_running":
            # Megatron global aux loss: this microbatch's counts summed over the token group, running mean.
            buf = torch.zeros(self.L * self.E + 1, dtype=torch.float64)
            for i, r in enumerate(records):
                buf[i * self.E:(i + 1) * self.E] = r.topk_map[v].sum(0).to(torch.float64)
            buf[-1] = tt_local
            g = acc.groups.token_group
            if g is not None:
                dist.all_reduce(buf, group=g)
            self._running += buf[:-1].view(self.L, self.E)
            self._running_mbs += 1
            run_counts = self._running / self._running_mbs
            run_tokens = max(float(buf[-1]), 1.0)
        for i, r in enumerate(records):
            probs = r.probs[v]
            counts = r.topk_map[v].sum(0)
            self._topk_counts[i] += counts.to(torch.float64)
            if self.scope == "micro_batch":
                a = F_moe.switch_load_balancing_loss(probs, counts.to(probs.dtype), max(tt_local, 1), self.k, self.E,
                                                     self.aux_coeff)
                share = a / n_mb
                aux_log += float(a.detach()) / self.aux_coeff if self.aux_coeff else 0.0
            elif self.scope == "sequence":
                seq_sum, _ = F_moe.sequence_load_balancing_loss(
                    r.probs.view(b, -1, self.E), r.topk_map.view(b, -1, self.E), topk=self.k,
                    num_experts=self.E, coeff=self.aux_coeff, padding_mask=pad.view(b, -1))
                share = seq_sum / max(acc.global_count("samples"), 1.0)
                aux_log += float(seq_sum.detach()) / self.aux_coeff if self.aux_coeff else 0.0
            elif self.scope == "global_lagged":
                frac = self.lagged_counts[i] / self.lagged_tokens  # f_e of the previous step
                share = F_moe.switch_load_balancing_loss(
                    probs, (frac * tt_global).to(probs.dtype), tt_global, self.k, self.E, self.aux_coeff)
                aux_log += float(share.detach()) / self.aux_coeff if self.aux_coeff else 0.0
            elif self.scope == "global_running":
                assert run_counts is not None
                a = F_moe.switch_load_balancing_loss(probs, run_counts[i].to(probs.dtype), run_tokens, self.k,
                                                     self.E, self.aux_coeff)
                share = a / (n_mb / self._dp_cp())
                aux_log += float(share.detach()) / self.aux_coeff if self.aux_coeff else 0.0
            else:
                share = None
            if share is not None and self.aux_coeff:
                total = total + share
            if self.z_coeff:
                lse2, _ = F_moe.router_z_loss_sum(r.logits, padding_mask=pad)
                if self.z_form == "global":
                    total = total + self.z_coeff * lse2 / tt_global
                    z_log_num += float(lse2.detach())
                else:
                    total = total + self.z_coeff * lse2 / max(tt_local, 1) / n_mb
                    z_log_num += float(lse2.detach()) / max(tt_local, 1)
        if self.log_name and self.aux_coeff:
            if self.scope == "micro_batch":
                acc.record(self.log_name, aux_log / self.L, 1.0)
            elif self.scope == "sequence":
                acc.record(self.log_name, aux_log / self.L, float(b))
            else:
                acc.record(self.log_name, aux_log / self.L, 0.0)
        if self.z_coeff:
            acc.record("z_loss", z_log_num / self.L, tt_local if self.z_form == "global" else 1.0)
        acc.add_objective(total.detach())
        return total

    def _dp_cp(self) -> float:
        g = self.acc.groups.token_group
        return float(dist.get_world_size(g)) if g is not None else 1.0

    def end_step(self, routers: Sequence[object], *, bias_rate: float = 0.0, zero_mean: bool = False
                 ) -> dict[str, float]:
        """End-of-step MoE state update, before ``optimizer.step()``; one all-reduce over the token group.

        Sums the routers' dispatch counts (aux-loss-free balancing) and this step's top-k counts
        (``global_lagged``) over the ranks holding distinct tokens; updates every router's
        ``expert_bias`` by ``rate·sign(mean(c) − c)`` (when ``bias_rate > 0``); resets the counters.
        Returns ``max_vio`` (mean over layers of ``(max c − mean c)/mean c`` of the dispatch counts) and
        per-layer ``max_vio/layer_<l>``. Every rank must call it every step (no skipped collective).
        """
        if len(routers) != self.L:
            raise ValueError(f"expected {self.L} routers, got {len(routers)}")
        if not self.L:
            return {}
        dispatch = torch.stack([r.tokens_per_expert.detach().to(torch.float64).cpu() for r in routers])
        buf = torch.cat([dispatch.flatten(), self._topk_counts.flatten()])
        g = self.acc.groups.token_group
        if g is not None:
            dev = self.acc.device
            t = buf.to(dev)
            dist.all_reduce(t, group=g)
            buf = t.cpu()
        n = self.L * self.E
        dispatch = buf[:n].view(self.L, self.E)
        topk_counts = buf[n:].view(self.L, self.E)
        if bias_rate > 0:
            for i, r in enumerate(routers):
                new = F_moe.expert_bias_update(dispatch[i].to(r.expert_bias.dtype).to(r.expert_bias.device),
                                               r.expert_bias.detach(), bias_rate, zero_mean=zero_mean)
                r.expert_bias.copy_(new)
        for r in routers:
            r.reset_counts()
        tokens = float(topk_counts[0].sum()) / self.k
        if tokens > 0:
            self.lagged_counts = topk_counts.clone()
            self.lagged_tokens = tokens
        self._topk_counts.zero_()
        self._running.zero_()
        self._running_mbs = 0
        vio = F_moe.max_violation(dispatch)
        out = {"max_vio": float(vio.mean())}
        out.update({f"max_vio/layer_{r.layer_id}": float(x) for r, x in zip(routers, vio.tolist())})
        return out

    def state_dict(self) -> dict[str, object]:
        """State to checkpoint: the previous step's global counts of ``global_lagged``."""
        return {"lagged_counts": self.lagged_counts.clone(), "lagged_tokens": self.lagged_tokens}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        self.lagged_counts = state["lagged_counts"].clone()  # type: ignore[union-attr]
        self.lagged_tokens = float(state["lagged_tokens"])  # type: ignore[arg-type]
