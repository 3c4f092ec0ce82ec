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

Per step the logged values and the objective contribution accumulate on the device and reach the
accountant in :meth:`MoEAccounting.end_step` (which therefore precedes ``acc.logs()``), together with the
module's one collective (dispatch and top-k counts); ``microbatch_loss`` has one host sync (its token
count). Padding tokens are masked by products with the 0/1 valid mask: router outputs at padding positions
must be finite, as those of a finite model are. Context parallelism: only the token-additive forms
(``global_lagged``, global z) split exactly over sequence shards; the others are refused.

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
from ..losses.stats import rows_documents
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


def _token_sum(x: Tensor, vf: Tensor | None) -> Tensor:
    """``Σ_t vf[t]·x[..., t, e]`` over the token dim (second to last) of ``x [..., T, E]``: a batched
    ``vf @ x`` (``vf [T]`` or per-sequence ``[b, S]`` against ``x [L, b, S, E]``), a plain sum without mask."""
    if vf is None:
        return x.sum(dim=-2)
    return torch.matmul(vf.unsqueeze(-2), x).squeeze(-2)


class MoEAccounting:
    """Auxiliary MoE losses of one model (or of one pipeline chunk) for one accountant (see the module docstring).

    Protocol per step: pass :meth:`router_tokens` of the step's microbatches to
    ``acc.begin_step(..., extra_counts=...)``; per microbatch add :meth:`microbatch_loss` to the loss
    before ``backward``; after the last backward (and after ``acc.finish_step`` under deferred
    normalization) call :meth:`end_step` on every rank, every step, before ``optimizer.step()`` and before
    ``acc.logs()``: it runs the step's one collective of this module (dispatch counts for the expert bias,
    top-k counts for ``global_lagged``) and hands the step's logged values and objective contribution to
    the accountant (accumulated on the device until then).

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
        log_layers: int | None = None,
        declare: bool | None = None,
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
        aux_on = num_layers > 0 and scope != "none" and aux_coeff > 0
        z_on = num_layers > 0 and z_coeff > 0
        if deferred and (aux_on or z_on) and not calculate_per_token_loss:
            raise ValueError(
                "MoE auxiliary losses under normalization='deferred' divide every gradient by the token count "
                "known only at the end of the step: use normalization='precount', or megatron_quirks=True with "
                "calculate_per_token_loss=True (Megatron pre-multiplies each term by its token count)")
        if deferred and aux_on and scope == "global_lagged":
            raise ValueError("scope 'global_lagged' needs the global router token count before the first "
                             "backward: use normalization='precount'")
        sharded = acc.groups.cp_size > 1 or acc.groups.sequence_parallel
        if sharded and ((aux_on and scope != "global_lagged") or (z_on and z_form != "global")):
            # A context- or sequence-parallel rank holds a shard of every sequence: per-microbatch and
            # per-sequence token sets span the shards, only the token-additive forms split exactly.
            raise ValueError(f"context parallelism (cp={acc.groups.cp_size}) or sequence parallelism "
                             f"(sp={acc.groups.sequence_parallel}) supports scope 'global_lagged' or 'none' and "
                             f"z_form 'global', got scope={scope!r}, z_form={z_form!r}")
        self.acc, self.L, self.E, self.k = acc, num_layers, num_experts, topk
        self.scope, self.aux_coeff, self.z_coeff, self.z_form = scope, aux_coeff, z_coeff, z_form
        self.megatron_quirks = bool(megatron_quirks)
        self.calculate_per_token_loss = bool(calculate_per_token_loss)
        self.R = repeated_mtp_calls if repeated_mtp_calls > 1 else 0
        # Slots = distinct MoE layers (routers): the R calls of a repeated MTP layer share the last slot.
        self.num_slots = num_layers - self.R + 1 if self.R else num_layers
        if log_layers is not None:  # a chunk of a dense model may pass 0 (it then logs nothing)
            _check_int(f"log_layers (this instance has {self.num_slots} MoE layers)", log_layers, self.num_slots)
        self.log_layers = max(self.num_slots if log_layers is None else log_layers, 1)
        self._den_frac = self.num_slots / self.log_layers
        self._aux_on, self._z_on = aux_on, z_on
        self.device = acc.device
        w = torch.ones(num_layers, dtype=torch.float64)
        if self.R:
            w[num_layers - self.R:] = 1.0 / self.R
        self._w_aux = w  # a repeated layer's term is the mean over its calls (Megatron: aux / mtp_num_layers)
        # Megatron divides a repeated MTP layer's z-loss by its calls only in the log (TODO in router.py).
        self._w_zgrad = torch.ones(num_layers, dtype=torch.float64) if self.megatron_quirks else w
        self._w_zlog = w
        self._z_split = bool(self.R) and self.megatron_quirks
        self._wcache: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}
        self._lagged_cache: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        declare = num_layers > 0 if declare is None else bool(declare)
        self.log_name = LOG_NAMES.get(scope) if declare and scope != "none" and aux_coeff > 0 else None
        self.z_log_name = "z_loss" if declare and z_coeff > 0 else None
        if self.log_name:
            # Under sequence parallelism every TP rank routes distinct tokens: its values count (per_rank).
            acc.declare_metric(self.log_name, "sum" if scope.startswith("global") else "ratio",
                               per_rank=acc.groups.sequence_parallel)
        if self.z_log_name:
            acc.declare_metric(self.z_log_name, "ratio", per_rank=acc.groups.sequence_parallel)
        # global_lagged: previous step's global top-k counts and token count (uniform at step 0).
        self.lagged_counts = torch.full((num_layers, num_experts), float(topk) / num_experts, dtype=torch.float64,
                                        device=self.device)
        self.lagged_tokens = 1.0
        self._topk_counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=self.device)
        self._running = torch.zeros(self.num_slots, num_experts, dtype=torch.float64, device=self.device)
        self._running_n = torch.zeros(self.num_slots, dtype=torch.float64, device=self.device)
        self._reset_step()

    def _reset_step(self) -> None:
        # Per-step log accumulators: detached 0-d tensors with their host-side scale, summed in end_step.
        self._lb: list[tuple[Tensor, float]] = []
        self._z: list[tuple[Tensor, float]] = []
        self._objective: list[Tensor] = []
        self._lb_den = 0.0
        self._z_den = 0.0
        self._segment_ids: Tensor | None = None
        self._counts_key: int = -1
        self._counts_cache: dict[str, float] = {}

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
        """A step count of the accountant, read once per step (each read is a host sync on a GPU)."""
        key = self.acc.step_index
        if key is not self._counts_key:
            self._counts_key, self._counts_cache = key, {}
        if name not in self._counts_cache:
            try:
                self._counts_cache[name] = self.acc.global_count(name)
            except KeyError:
                raise KeyError(f"MoEAccounting needs the count {name!r} of this step: pass "
                               "extra_counts=MoEAccounting.router_tokens(valids) to acc.begin_step") from None
        return self._counts_cache[name]

    def _local_microbatches(self) -> float:
        """``K``: microbatches of this rank (every data-parallel rank runs the same number)."""
        n = self._count("microbatches")
        return n if self.acc.normalization == "deferred" else n / self.acc.groups.dp_size

    def _check_records(self, records: Sequence[object], valid: Tensor) -> tuple[int, int]:
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
                    raise ValueError(f"router record {i}: {field} has shape {tuple(x.shape)}, expected "
                                     f"[{want[0]}, {self.E}] (valid has shape {tuple(valid.shape)}, "
                                     f"num_experts={self.E})")
        return (1, valid.numel()) if valid.dim() == 1 else (valid.shape[0], valid.shape[1])

    def microbatch_loss(self, records: Sequence[object], valid: Tensor, segment_ids: Tensor | None = None) -> Tensor:
        """The auxiliary objective share of one microbatch, summed over its MoE layers (semantics §5).

        ``records`` are the ``L`` router records of this forward (``logits``, ``probs``, ``topk_map``, each
        ``[b·S, E]`` in row-major token order), ``valid [b, S]`` marks non-padding tokens. Returns the share
        ``Σ_l w_l·term_l`` whose sum over the step's microbatches and ranks is the auxiliary objective
        (a raw, token-pre-multiplied share under deferred normalization). A zero-token microbatch
        contributes 0 and still counts. The logged values accumulate until :meth:`end_step`. With the
        accountant in mode ``per_document`` and packed rows (``segment_ids``), the ``sequence`` scope's
        sequences are the documents (semantics §5) and its mean runs over the global ``Ndoc``.
        """
        b, s = self._check_records(records, valid)
        self._segment_ids = segment_ids
        if not records:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        ref = records[0].probs
        dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
        dev = ref.device
        w_aux, w_zgrad, w_zlog = self._weights(dtype, dev)
        v = valid.reshape(-1)
        v = (v if v.dtype == torch.bool else v > 0).to(dev)
        tt = int(v.sum())  # the one host sync per microbatch
        full = tt == v.numel()
        pre = None  # Megatron calculate_per_token_loss: n_mb (deferred), n_mb / Ntok (precount)
        if self.calculate_per_token_loss:
            pre = float(tt) if self.acc.normalization == "deferred" else tt / max(self._count("tokens"), 1.0)
        total = None
        # Masked token sums are products with the 0/1 valid vector (one batched matmul each): padding
        # scores must be finite, as any output of a finite router is.
        vf = None if full else v.to(dtype)
        if self._aux_on or (self.scope == "global_lagged" and self.L):
            probs = torch.stack([r.probs for r in records]).to(dtype)  # [L, T, E]
            topk = torch.stack([r.topk_map for r in records]).to(dtype)
            if self.scope == "global_lagged":
                self._topk_counts += _token_sum(topk, vf).to(self.device)
            if self._aux_on:
                total = self._aux_share(probs, topk, v, vf, b, s, tt, pre, w_aux)
        if self._z_on:
            z = self._z_share(records, vf, dtype, tt, pre, w_zgrad, w_zlog)
            total = z if total is None else total + z
        if total is None:
            return torch.zeros((), dtype=dtype, device=dev)
        self._objective.append(total.detach())
        return total

    def _aux_share(self, probs: Tensor, topk: Tensor, v: Tensor, vf: Tensor | None, b: int, s: int, tt: int,
                   pre: float | None, w: Tensor) -> Tensor:
        """Load-balancing share of the microbatch (all layers): ``x = Σ_l w_l·Σ_e coef[l,e]·Σ_x p[l,x,e]``
        (one weighted reduction), scaled by host-side constants; ``x`` is also what the log accumulates."""
        L, E, alpha = self.L, self.E, self.aux_coeff
        scale = alpha * E / self.k
        log_scale = 1.0 / (alpha * self.log_layers)
        den = self._den_frac
        if self.scope == "micro_batch":
            coef = _token_sum(topk, vf) * w[:, None]
            x = (_token_sum(probs, vf) * coef).sum() * (scale / max(tt, 1) ** 2)  # Σ_l w_l·A(X_mb)
            share = x * (1.0 / self._count("microbatches") if pre is None else pre)
        elif self.scope == "sequence" and self.acc.mode == "per_document" and self._segment_ids is not None \
                and not self.megatron_quirks:
            # Packed rows under per_document: every document is a sequence (DeepSeek's loss per document).
            doc, ndoc = rows_documents(self._segment_ids.to(probs.device))
            idx = doc.reshape(-1)
            keep = (idx >= 0) & v
            pos = keep.nonzero().squeeze(1)
            d = idx.index_select(0, pos)
            counts = torch.zeros(L, max(ndoc, 1), E, dtype=probs.dtype, device=probs.device).index_add_(
                1, d, topk.index_select(1, pos))
            psum = torch.zeros_like(counts).index_add_(1, d, probs.index_select(1, pos))
            n = torch.zeros(max(ndoc, 1), dtype=probs.dtype, device=probs.device).index_add_(
                0, d, torch.ones_like(d, dtype=probs.dtype))
            inv = torch.where(n > 0, 1.0 / (n * n).clamp(min=1.0), 0.0)  # an empty document gives 0, counts
            x = (psum * counts * (inv[None, :, None] * w[:, None, None])).sum() * scale  # Σ_l w_l·Σ_doc A
            share = x * (1.0 / max(self._count("documents"), 1.0))
            den = den * ndoc
        elif self.scope == "sequence":
            vs = None if vf is None else vf.view(b, s)
            counts = _token_sum(topk.view(L, b, s, E), vs)  # [L, b, E]
            n = v.view(b, s).sum(dim=1, dtype=probs.dtype)  # tokens per sequence
            if self.megatron_quirks:
                # Megatron folds the batch into the expert dim: every sequence gets the mean valid length.
                n = torch.full_like(n, tt / b)
            inv = torch.where(n > 0, 1.0 / (n * n).clamp(min=1.0), 0.0)  # an empty sequence gives 0, still counts
            coef = counts * (inv[None, :, None] * w[:, None, None])
            x = (_token_sum(probs.view(L, b, s, E), vs) * coef).sum() * scale  # Σ_l w_l·Σ_j A(X_j)
            if self.megatron_quirks:  # Megatron's per-microbatch loss is the mean over its b sequences
                share = x * (1.0 / (b * self._count("microbatches")) if pre is None else pre / b)
                log_scale = log_scale / b
            else:
                share = x * (1.0 / max(self._count("samples"), 1.0))
                den = den * b
        elif self.scope == "global_lagged":
            x = (_token_sum(probs, vf) * self._lagged_coef(probs.dtype, probs.device, w)).sum() * scale
            share = x * (1.0 / max(self._count(ROUTER_TOKENS), 1.0))
            log_scale, den = log_scale / max(self._count(ROUTER_TOKENS), 1.0), 0.0
        else:  # global_running
            avg, t_run = self._running_counts(_token_sum(topk, vf), tt)
            x = (_token_sum(probs, vf) * (avg.to(probs.dtype) * w[:, None])).sum() * (scale / max(t_run, 1.0) ** 2)
            kk = self._local_microbatches()
            if pre is not None:
                share = x * pre
            elif self.megatron_quirks:  # DDP's 1/D on top of the schedule's 1/K: 1/D of the logged value
                share = x * (1.0 / self._count("microbatches"))
            else:
                share = x * (1.0 / kk)
            log_scale, den = log_scale / kk, 0.0
        self._lb.append((x.detach(), log_scale))
        self._lb_den += den
        return share

    def _lagged_coef(self, dtype: torch.dtype, device: torch.device, w: Tensor) -> Tensor:
        """``w_l·f_e`` with ``f_e = c_e/T`` of the previous step (cached until the next ``end_step``)."""
        key = (dtype, device)
        if key not in self._lagged_cache:
            frac = (self.lagged_counts / self.lagged_tokens).to(device=device, dtype=dtype)
            self._lagged_cache[key] = frac * w[:, None]
        return self._lagged_cache[key]

    def _running_counts(self, counts_local: Tensor, tt: int) -> tuple[Tensor, float]:
        """Megatron global aux loss: this microbatch's top-k counts and tokens summed over the token group
        (one all-reduce), running mean over the step's microbatches per router (a repeated MTP layer's
        calls accumulate into one running mean, like Megatron's ``ga_steps``). Returns ``(avg [L, E], T)``."""
        L, E = self.L, self.E
        buf = torch.cat([counts_local.reshape(-1).to(device=self.device, dtype=torch.float64),
                         torch.full((1,), float(tt), dtype=torch.float64, device=self.device)])
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
        return avg, float(buf[-1])

    def _z_share(self, records: Sequence[object], vf: Tensor | None, dtype: torch.dtype, tt: int,
                 pre: float | None, w_grad: Tensor, w_log: Tensor) -> Tensor:
        """Router z-loss share of the microbatch (all layers) and its log accumulation."""
        # Experts-major [L, E, T]: the reduction over E runs along contiguous token rows (faster on CPU).
        lse = torch.logsumexp(torch.stack([r.logits.t() for r in records]).to(dtype), dim=1)  # [L, T]
        z2 = lse * lse
        zsum = z2.sum(dim=1) if vf is None else z2 @ vf  # Σ_x lse² per layer
        x = (zsum * w_grad).sum()
        x_log = (zsum * w_log).sum().detach() if self._z_split else x.detach()
        if self.z_form == "global":
            share = x * (self.z_coeff / max(self._count(ROUTER_TOKENS), 1.0))
            self._z.append((x_log, 1.0 / self.log_layers))
            self._z_den += tt * self._den_frac
        else:
            mean = 1.0 / max(tt, 1)  # Megatron z_loss_func: mean over the microbatch's valid tokens
            share = x * (self.z_coeff * mean * (1.0 / self._count("microbatches") if pre is None else pre))
            self._z.append((x_log, mean / self.log_layers))
            self._z_den += self._den_frac
        return share

    # ---------------------------------------------------------------- end of step
    def _flush_logs(self) -> None:
        """Hand the step's accumulated log values and objective contribution to the accountant."""
        acc = self.acc
        for name, items, den in ((self.log_name, self._lb, self._lb_den), (self.z_log_name, self._z, self._z_den)):
            if name and items:
                vals = torch.stack([x for x, _ in items]).to(self.device, torch.float64)
                scales = torch.tensor([c for _, c in items], dtype=torch.float64, device=self.device)
                acc.record(name, vals @ scales, den)
        if self._objective:
            obj = torch.stack(self._objective).to(self.device, torch.float64).sum()
            if acc.normalization == "deferred":
                obj = obj / max(acc.global_count("tokens"), 1.0)
            acc.add_objective(obj, per_rank=acc.groups.sequence_parallel)

    def end_step(self, routers: Sequence[object], *, bias_rate: float = 0.0, zero_mean: bool = False
                 ) -> dict[str, float]:
        """End-of-step MoE state update, before ``optimizer.step()`` and ``acc.logs()``; one all-reduce over
        the token group.

        Records the step's logged values and auxiliary objective in the accountant (under deferred
        normalization, Megatron ``calculate_per_token_loss``, it must follow ``acc.finish_step``: the
        objective is ``Σ raw shares / Ntok``). Sums the routers' dispatch counts ``tokens_per_expert``
        (aux-loss-free balancing) and this step's top-k counts (``global_lagged``) over the ranks holding
        distinct tokens; updates every router's ``expert_bias`` by ``b_e += rate·sign(mean(c) − c_e)``
        (optionally zero-mean) when ``bias_rate > 0``; resets the counters. Returns ``max_vio`` (mean over
        layers of ``(max c − mean c)/mean c`` of the dispatch counts) and per-layer ``max_vio/layer_<id>``.
        Every rank must call it every step (it is a collective).
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
        if acc.normalization == "deferred" and self._objective and not acc.finished:
            raise RuntimeError("under normalization='deferred' call acc.finish_step() before end_step(): the "
                               "auxiliary objective is divided by the step's global token count")
        self._flush_logs()
        self._reset_step()
        if not self.L:
            return {}
        local = torch.stack([r.tokens_per_expert.detach() for r in routers]).to(self.device, torch.float64)
        lagged = self.scope == "global_lagged"
        buf = torch.cat([local.reshape(-1), self._topk_counts.reshape(-1)]) if lagged else local.reshape(-1)
        g = acc.groups.token_group
        if g is not None:
            dist.all_reduce(buf, group=g)
        n = self.num_slots * self.E
        dispatch = buf[:n].view(self.num_slots, self.E)
        if bias_rate > 0:  # all layers at once ([layers, E]), then back into every router's buffer
            bias = torch.stack([r.expert_bias.detach() for r in routers])
            new = F_moe.expert_bias_update(dispatch.to(bias.device), bias, bias_rate, zero_mean=zero_mean)
            with torch.no_grad():
                for r, row in zip(routers, new):
                    r.expert_bias.copy_(row)
        for r in routers:
            r.reset_counts()
        stats = F_moe.max_violation(dispatch)
        if lagged:
            topk_counts = buf[n:].view(self.L, self.E)
            stats = torch.cat([stats, topk_counts[0].sum().reshape(1) / self.k])
        values = stats.tolist()  # the one host sync of end_step
        vio = values[:self.num_slots]
        if lagged:
            if values[-1] > 0:  # a step without any token keeps the previous fractions
                self.lagged_counts = topk_counts.clone()
                self.lagged_tokens = values[-1]
                self._lagged_cache.clear()
            self._topk_counts.zero_()
        self._running.zero_()
        self._running_n.zero_()
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
        self._lagged_cache.clear()
