"""lossparity semantics in JAX: pure, ``jit``-able functions on global (possibly sharded) arrays.

Optional extra (``pip install lossparity[jax]``); imports only ``jax``, ``jax.numpy``, NumPy and the
torch-free ``lossparity.options``, never torch, and ``import lossparity`` never imports it. Names and
semantics follow the PyTorch modules:

- :mod:`.stats`: ``sample_stats``, ``document_stats`` (static ``num_segments`` slots per row).
- :mod:`.modes`: ``MODES``, ``objective``, ``numerator`` / ``denominator``, ``share``, ``Normalizers``.
- :mod:`.logchannel`: ``lm_loss`` as a ``LogValue(value, valid)``, ``host_logs``; :mod:`.gap`: ``estimator_gap``.
- :mod:`.mtp`: ``roll_mtp`` and the ``own`` / ``main`` / ``pooled`` MTP objective.
- :mod:`.moe`: Switch load balancing, router z-loss, expert-bias update.
- :mod:`.cross_entropy`: ``chunked_cross_entropy`` (``custom_vjp``, never materializes ``[T, V]``).
- :mod:`.cross_entropy`: also ``fused_linear_cross_entropy`` (gradients formed in the forward).
- :mod:`.accumulate`: ``accumulate_gradients`` over ``lax.scan`` with pre-counted normalizers.
- ``checked(fn)`` / ``throw(err)``: run the value checks under ``jit`` too (``jax.experimental.checkify``)
  and raise them as an eager call would.

Option spellings come from ``lossparity.options`` (shared with the PyTorch port).
"""

from __future__ import annotations

from ._checks import checked, throw
from .accumulate import accumulate_gradients, split_microbatches
from .cross_entropy import chunked_cross_entropy, fused_linear_cross_entropy, naive_cross_entropy
from .gap import GapResult, estimator_gap
from .logchannel import LogValue, host_logs, lm_loss, ratio_or_missing
from .modes import MODES, Normalizers, count_normalizers, denominator, numerator, objective, share
from .moe import expert_bias_update, router_z_loss, switch_load_balancing_loss
from .mtp import CONVENTIONS, mtp_objective, roll_mtp
from .stats import check_inputs, document_stats, sample_stats

__all__ = [
    "CONVENTIONS",
    "GapResult",
    "LogValue",
    "MODES",
    "Normalizers",
    "accumulate_gradients",
    "check_inputs",
    "checked",
    "chunked_cross_entropy",
    "count_normalizers",
    "denominator",
    "document_stats",
    "estimator_gap",
    "expert_bias_update",
    "fused_linear_cross_entropy",
    "host_logs",
    "lm_loss",
    "mtp_objective",
    "naive_cross_entropy",
    "numerator",
    "objective",
    "ratio_or_missing",
    "roll_mtp",
    "router_z_loss",
    "sample_stats",
    "share",
    "split_microbatches",
    "switch_load_balancing_loss",
    "throw",
]
