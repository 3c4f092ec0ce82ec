"""The MoE auxiliary term of :class:`~lossparity.integrations.hf.LossParityMixin` (its base class): the
model's experts, top-k and coefficient through :mod:`.hf_moe`'s name table, the ``global_lagged`` pre-count
entries and per-microbatch share (semantics §5), or the model's own ``aux_loss`` per microbatch
(``microbatch``, ``hf`` scopes). The formulas are :mod:`lossparity.losses.hf_aux`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..losses.hf_aux import hf_lagged_aux, hf_router_sums

__all__ = ["MoEAuxTerms", "ROWS", "PREV_ROWS"]

ROWS, PREV_ROWS = "lossparity_aux_rows", "lossparity_aux_prev_rows"  # extra counts of global_lagged


class MoEAuxTerms:
    """The aux-term methods of the Trainer mixin; its ``__init__`` sets the state below."""

    model: Any
    lp_aux_scope: str
    _lp_acc: Any
    _lp_att: Tensor | None
    _lp_mbs: float
    _lp_aux_local: Tensor | None
    _lp_aux_prev: list[float] | None
    _lp_aux_frac: Tensor
    _lp_aux_tokens: float

    def _lp_moe_shape(self) -> tuple[int, int]:
        """``(E, k)``: routed experts and top-k of the model (:func:`.hf_moe.moe_info`: its router modules,
        and the names transformers' families use for the expert count and top-k)."""
        from .hf_moe import moe_info

        info = moe_info(self.model.config, self.model)
        if info is None:
            raise ValueError("aux_scope: 'global_lagged' needs a model with router modules and an expert count")
        return info.experts, info.top_k

    def _lp_aux_counts(self, batches: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """Pre-count entries of ``global_lagged``: this step's local non-padding tokens (the rows of the
        scores) and the previous step's local expert counts ``c_e`` and rows ``R'`` (zeros in the first step)."""
        if self.lp_aux_scope != "global_lagged" or self._lp_aux_coef() is None:
            return {}
        n, _ = self._lp_moe_shape()
        tokens = 0.0
        for batch in batches:  # once per step, where the labels are read to the host anyway
            att, ids = batch.get("attention_mask"), batch.get("input_ids")
            if isinstance(att, Tensor) and att.dim() == 2:
                tokens += float(att.sum())
            elif isinstance(ids, Tensor):
                tokens += float(ids.numel())
        prev = self._lp_aux_prev if self._lp_aux_prev is not None else [0.0] * (n + 1)
        return {ROWS: tokens, PREV_ROWS: prev[n], **{f"lossparity_aux_c{e}": prev[e] for e in range(n)}}

    def _lp_aux_start(self, acc: Any) -> None:
        n, k = self._lp_moe_shape()
        prev_rows = acc.global_count(PREV_ROWS)
        # f_e = c_e / R' of the previous global batch; k/E each (uniform) when there is none.
        f = [acc.global_count(f"lossparity_aux_c{e}") / prev_rows if prev_rows > 0 else k / n for e in range(n)]
        self._lp_aux_frac = torch.tensor(f, dtype=torch.float64)
        self._lp_aux_tokens = acc.global_count(ROWS)
        self._lp_aux_local = torch.zeros(n + 1, dtype=torch.float64)

    def _lp_aux_share(self, outputs: Any, coef: float, dtype: torch.dtype) -> Tensor:
        """This microbatch's share of ``coef · aux`` in ``aux_scope`` (class docstring); logs ``aux_loss``."""
        acc = self._lp_acc
        if self.lp_aux_scope == "global_lagged":
            router = getattr(outputs, "router_logits", None)
            if not router:
                raise ValueError("model: aux_scope='global_lagged' needs outputs.router_logits (output_router_logits)")
            p, c, r = hf_router_sums(router, self._lp_moe_shape()[1], self._lp_att)
            local = self._lp_aux_local.to(p.device)  # type: ignore[union-attr]
            local[:-1] += c
            local[-1] += r
            self._lp_aux_local = local
            aux = hf_lagged_aux(p, self._lp_aux_frac.to(p.device), len(router) * self._lp_aux_tokens)
            acc.record("aux_loss", aux.detach(), 1.0 / self._lp_mbs)  # Σ over the D·K shares: the global value
        else:
            own = getattr(outputs, "aux_loss", None)
            if not isinstance(own, Tensor):
                raise ValueError("model: its outputs have no 'aux_loss' although config.output_router_logits is set")
            acc.record("aux_loss", own.detach())
            # microbatch: the mean over the step's D·K microbatches; hf: every microbatch's term in full.
            aux = own / self._lp_mbs if self.lp_aux_scope == "microbatch" else own
        share = coef * aux.to(dtype)
        acc.record("objective", share.detach())
        return share

    def _lp_aux_coef(self) -> float | None:
        """The load-balancing coefficient (:func:`.hf_moe.aux_coefficient`: None when router logits are off
        or the model is dense; ``ValueError`` for an MoE model whose coefficient is under no known name)."""
        from .hf_moe import aux_coefficient

        model = getattr(self, "model", None)
        return aux_coefficient(getattr(model, "config", None), model)
