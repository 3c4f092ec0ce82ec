"""lossparity semantics in MindSpore: the formulas the MindFormers hook (:mod:`lossparity.mindformers`) needs.

Optional (a MindSpore install); imports ``mindspore``, NumPy and the torch-free ``lossparity.options`` /
``lossparity.losses.mode_table``, never torch, and ``import lossparity`` never imports it. Names and semantics
follow the PyTorch modules (``lossparity.losses``), against which the tests check every function:

- :mod:`.stats`: ``token_nll`` (per-token cross-entropy), ``sample_stats``, ``document_sums``,
  ``segment_ids_from_actual_seq_len`` (MindFormers' packed-row metadata to lossparity's segment ids).
- :mod:`.modes`: ``Normalizers``, ``count_normalizers``, ``numerator``, ``denominator``, ``share``,
  ``token_weights``, ``objective``: the mode table of semantics §1.
- :mod:`.moe`: the Switch load-balancing term and the ``global_running`` scope (``GlobalRunningCounts``).

Every function runs in MindSpore's pynative mode without a host synchronization (counts stay tensors), so
it can sit in a per-microbatch path.
"""

from __future__ import annotations

from .modes import MODES, Normalizers, count_normalizers, denominator, numerator, objective, share, token_weights
from .moe import GlobalRunningCounts, global_running_load_balancing_loss, switch_load_balancing_loss
from .stats import document_sums, sample_stats, segment_ids_from_actual_seq_len, token_nll

__all__ = [
    "MODES",
    "GlobalRunningCounts",
    "Normalizers",
    "count_normalizers",
    "denominator",
    "document_sums",
    "global_running_load_balancing_loss",
    "numerator",
    "objective",
    "sample_stats",
    "segment_ids_from_actual_seq_len",
    "share",
    "switch_load_balancing_loss",
    "token_nll",
    "token_weights",
]
