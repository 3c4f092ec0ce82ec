"""RL post-training objectives of several per-token terms (docs/semantics.md §9, docs/rl.md).

- :class:`RLAccountant`, :class:`Term`: the exact share of ``J = Σ_k coef_k · J_{mode_k}(l_k)`` of every
  microbatch, and the exact logs of ``J`` and of every term.
- :class:`LossParityGRPOMixin` (``lossparity.rl.trl``, imports nothing of TRL itself): the drop-in that makes
  TRL's ``GRPOTrainer`` optimize that objective at any layout.
- :func:`check_global_batch_info` (``lossparity.rl.verl``): the guard of a custom verl loss against the
  per-micro-batch fallback of verl's ``agg_loss``.
"""

from .accountant import RLAccountant, Term
from .trl import LossParityGRPOMixin
from .verl import check_global_batch_info

__all__ = ["RLAccountant", "Term", "LossParityGRPOMixin", "check_global_batch_info"]
