"""The owner's side of :class:`~lossparity.distributed.moe.scopes.ScopeOwner`: what every load-balancing scope
and z-loss form reads from :class:`~lossparity.distributed.moe.accounting.MoEAccounting` (its base class): the
step's counts (host numbers read at ``begin_step``), the per-layer weights of the terms (a repeated MTP layer's
calls share one slot), the Switch weights ``K_e`` and the one row-group all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...losses import moe as F_moe
from ..accountant import Accountant

__all__ = ["ScopeHelpers"]


class ScopeHelpers:
    """Counts, per-layer weights and row sums of one MoE accounting (set up by its ``__init__``)."""

    acc: Accountant
    num_layers: int
    num_experts: int
    topk: int
    aux_coeff: float
    log_layers: int
    repeated_calls: int
    megatron_quirks: bool
    calculate_per_token_loss: bool
    _row_group: Any
    _pair_cache: dict[tuple[object, ...], Tensor]

    def _set_layer_weights(self) -> None:
        nl, rep = self.num_layers, self.repeated_calls
        w = torch.ones(nl, dtype=torch.float64)
        if rep:
            w[nl - rep :] = 1.0 / rep
        self._w_aux = w  # a repeated layer's term is the mean over its calls (Megatron: aux / mtp_num_layers)
        # Megatron divides a repeated MTP layer's z-loss by its calls only in the log (TODO in router.py).
        self._w_zgrad = torch.ones(nl, dtype=torch.float64) if self.megatron_quirks else w
        self._w_zlog = w
        self._z_split = bool(rep) and self.megatron_quirks
        self._wcache: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}

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
            counts, t_counts, t_probs, topk=self.topk, num_experts=self.num_experts, coeff=self.aux_coeff
        )

    def _log_scale(self) -> float:
        """The logged load-balancing value per unit of share: ``1/(α·layers)`` (each term divided by its
        coefficient, mean over the model's MoE layers)."""
        return 1.0 / (self.aux_coeff * self.log_layers)

    def _z_weights(self, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """Per-layer z-loss weights ``(gradient, logged)`` (they differ only for Megatron's repeated MTP layer)."""
        _, w_grad, w_log = self._weights(dtype, device)
        return w_grad, (w_log if self._z_split else w_grad)

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
