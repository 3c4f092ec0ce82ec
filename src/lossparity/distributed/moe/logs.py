"""The logged values of :class:`~lossparity.distributed.moe.accounting.MoEAccounting` (semantics §5, §6).

Logged names follow Megatron: each term divided by its coefficient and averaged over the model's MoE layers
(``load_balancing_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``) and the
expert-load imbalance ``max_vio`` (``max_vio/layer_<id>``). Per step the microbatches' log vectors (and the
objective contribution) are summed on the device in one float64 vector, with the denominators that are host
numbers as floats, and handed to the accountant's logging collective once, in ``end_step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..accountant import Accountant

if TYPE_CHECKING:  # the model package imports the losses; these are only types here
    from ...model.router import Router, RouterRecord

__all__ = ["MoEStepLog"]


class MoEStepLog:
    """Declares the MoE metrics in the accountant and accumulates one step's values for it.

    The per-microbatch vector holds ``[lb share, lb logged]`` (aux term on), ``[z share, z logged]`` (z-loss
    on) and the microbatch's router tokens (``z_den_on_device``: the global z form's logged denominator);
    :meth:`flush` hands ``M @ Σ vectors`` (and the host denominators) to the accountant's slots.

    Args:
        acc: the accountant. log_name / z_log_name: the logged names (None: not logged on this instance).
        log_reduction: ``"sum"`` or ``"ratio"`` (how the logging collective reduces the load-balancing value).
        aux_on / z_on: whether the terms are computed. den_frac: this instance's share of the model's MoE
            layers (the weight of its log denominators). num_slots: its distinct MoE layers.
        log_layer_ids: the model's MoE layer ids naming ``max_vio/layer_<id>`` (None: by router position).
        declare: declare the ``max_vio`` metrics.
    """

    def __init__(
        self,
        acc: Accountant,
        *,
        log_name: str | None,
        z_log_name: str | None,
        log_reduction: str,
        aux_on: bool,
        z_on: bool,
        z_den_on_device: bool,
        den_frac: float,
        num_slots: int,
        log_layer_ids: Sequence[int] | None,
        declare: bool,
    ) -> None:
        self.acc = acc
        self.log_name, self.z_log_name = log_name, z_log_name
        self._aux_on, self._z_on, self._z_den_on_device = aux_on, z_on, z_den_on_device
        sp = acc.groups.sequence_parallel
        if log_name:
            # Under sequence parallelism every TP rank routes distinct tokens: its values count (per_rank).
            acc.declare_metric(log_name, log_reduction, per_rank=sp)
        if z_log_name:
            acc.declare_metric(z_log_name, "ratio", per_rank=sp)
        self.by_position = log_layer_ids is None
        self.vio_ids = list(range(num_slots)) if log_layer_ids is None else [int(i) for i in log_layer_ids]
        self.log_vio = declare and bool(self.vio_ids)
        if self.log_vio:
            for lid in self.vio_ids:
                acc.declare_metric(f"max_vio/layer_{lid}", "sum")
            acc.declare_metric("max_vio", "sum")
        acc.register_check(
            "router_nonfinite",
            FloatingPointError,
            "MoE router scores have NaN/Inf at a non-padding token (or the layer's auxiliary term is not finite)",
            "layer",
        )
        self._set_slots(den_frac)
        self._vio_maps: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
        self._layer_codes: dict[tuple[torch.device, int], Tensor] = {}
        self.reset()

    def _set_slots(self, den_frac: float) -> None:
        """How the per-microbatch log vector maps onto the accountant's slots (the matrix ``M``)."""
        lb, z = self.log_name, self.z_log_name
        z_den = self._z_on and self._z_den_on_device
        n = 2 * self._aux_on + 2 * self._z_on + z_den
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
                if z_den:
                    rows.append((f"den:{z}", {i + 2: den_frac}))
        rows.append(("objective_local" if self.acc.groups.sequence_parallel else "objective", objective))
        self._slots = [name for name, _ in rows]
        self._map = torch.zeros(len(rows), max(n, 1), dtype=torch.float64)
        for r, (_, coeffs) in enumerate(rows):
            for col, c in coeffs.items():
                self._map[r, col] = c
        self._maps: dict[tuple[torch.device, float], Tensor] = {}

    def reset(self) -> None:
        """Start a step: no values yet."""
        self.step_values: Tensor | None = None  # Σ of the microbatches' log vectors (float64, on the device)
        self.lb_den = 0.0
        self.z_den = 0.0

    def add(self, vec: Tensor, device: torch.device) -> None:
        """Add one microbatch's log vector (kept on ``device`` in float64; no host sync)."""
        if self.step_values is None:
            self.step_values = vec.to(device, torch.float64)
        else:  # float64 += float32 promotes without a conversion kernel; a device move only if needed
            sv = self.step_values
            self.step_values = sv + (vec if vec.device == sv.device else vec.to(sv.device))

    def flush(self) -> None:
        """Hand the step's accumulated log values and objective contribution to the accountant (one kernel)."""
        vec = self.step_values
        if vec is None:
            return
        acc = self.acc
        # Megatron calculate_per_token_loss under deferred normalization: objective = Σ raw shares / Ntok
        scale = 1.0 / max(acc.global_count("tokens"), 1.0) if acc.normalization == "deferred" else 1.0
        key = (vec.device, scale)
        if key not in self._maps:
            m = self._map.clone()
            m[-1] *= scale
            self._maps = {key: m.to(vec.device)}
        out = self._maps[key] @ vec
        slots = list(self._slots)
        host: list[float] = []
        if self.log_name and self._aux_on:
            slots.append(f"den:{self.log_name}")
            host.append(self.lb_den)
        if self.z_log_name and self._z_on and not self._z_den_on_device:
            slots.append(f"den:{self.z_log_name}")
            host.append(self.z_den)
        if host:
            out = torch.cat([out, torch.tensor(host, dtype=torch.float64, device=out.device)])
        acc.record_many(slots, out)

    def flag(self, records: Sequence[RouterRecord], per_layer: Tensor, mb: int) -> None:
        """Device flag for acc.logs(): a NaN/Inf router score at a valid token makes its layer's term not
        finite (tested once per step); the share is the weighted sum of the layers' terms."""
        if not self.acc.check_finite:
            return
        key = (per_layer.device, len(records))
        if key not in self._layer_codes:
            ids = [float(getattr(r, "layer_id", i)) for i, r in enumerate(records)]
            self._layer_codes[key] = torch.tensor(ids, dtype=torch.float64, device=per_layer.device)
        self.acc.flag("router_nonfinite", per_layer, self._layer_codes[key], microbatch=mb)

    def layer_ids(self, routers: Sequence[Router]) -> list[int]:
        """The ids naming ``max_vio/layer_<id>`` of ``routers`` (by position, or their ``layer_id``)."""
        if self.by_position:
            return self.vio_ids[: len(routers)]
        return [getattr(r, "layer_id", i) for i, r in enumerate(routers)]

    def record_vio(self, routers: Sequence[Router], vio: Tensor) -> None:
        """``max_vio`` into the accountant's logging collective: one route, with and without pipelining
        (the first rank of the token group records: the value is the same on all of them)."""
        if not self.log_vio or self.acc.groups.token_rank() != 0:
            return
        names = [f"max_vio/layer_{lid}" for lid in self.layer_ids(routers)] + ["max_vio"]
        key = (vio.shape[0], vio.dtype, vio.device)
        if key not in self._vio_maps:  # [n, n+1] = [identity | 1/layers]: the values and their layer mean
            m = torch.cat([torch.eye(vio.shape[0]), torch.full((vio.shape[0], 1), 1.0 / len(self.vio_ids))], dim=1)
            self._vio_maps[key] = m.to(vio.device, vio.dtype)
        self.acc.record_sums(names, vio @ self._vio_maps[key])
