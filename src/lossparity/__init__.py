"""lossparity: exact, layout-invariant language-model losses and loss-parity tools.

Layout of the package (a formula of SPEC.md lives in exactly one place):

- ``lossparity.losses``: pure semantics on tensors, no process groups (modes, statistics, MTP, MoE
  auxiliary losses, indexer loss, chunked cross-entropy, estimator gap, log estimators).
- ``lossparity.distributed``: process-group plumbing: the :class:`Accountant`, trackers, groups.
- ``lossparity.model`` / ``lossparity.training``: the reference MoE+MTP GPT and its trainer.
- ``lossparity.parity``: log readers, ``compare``, ``gap``, framework presets; ``lossparity.cli``.
- ``lossparity.jax``: the same semantics in JAX (optional extra, never imported from here).
"""

from __future__ import annotations

from .distributed.accountant import Accountant
from .losses.gap import GapResult, estimator_gap
from .losses.modes import MODES, Normalizers, denominator, numerator, objective
from .losses.mtp import roll_mtp
from .losses.stats import document_stats, sample_stats

__version__ = "0.1.0"

__all__ = [
    "Accountant",
    "MODES",
    "Normalizers",
    "GapResult",
    "chunked_cross_entropy",
    "denominator",
    "document_stats",
    "estimator_gap",
    "numerator",
    "objective",
    "roll_mtp",
    "sample_stats",
]


def __getattr__(name: str):
    # Imported lazily so that `import lossparity` stays cheap for the CLI's log tools.
    if name == "chunked_cross_entropy":
        from .losses.cross_entropy import chunked_cross_entropy

        return chunked_cross_entropy
    raise AttributeError(f"module 'lossparity' has no attribute {name!r}")
