"""lossparity: exact, layout-invariant language-model losses and loss-parity tools.

Layout of the package (a formula of docs/semantics.md lives in exactly one place):

- ``lossparity.losses``: pure semantics on tensors, no process groups (the mode table, modes, statistics,
  MTP, MoE auxiliary losses, indexer loss, chunked cross-entropy, estimator gap, log estimators).
- ``lossparity.moe``: the public MoE toolkit (a re-export of ``lossparity.losses.moe``, ``.router`` and
  ``.aux_scopes``, their implementation); ``lossparity.mtp``: the same for ``lossparity.losses.mtp``.
- ``lossparity.distributed``: process-group plumbing: the :class:`Accountant`, MoE accounting, groups.
- ``lossparity.model`` / ``lossparity.training``: the reference MoE+MTP GPT and its trainer.
- ``lossparity.parity``: log readers, ``compare``, ``gap``, framework presets; ``lossparity.cli``.
- ``lossparity.jax``: the same semantics in JAX (optional extra; needs no torch).

The names below are imported lazily, so that ``import lossparity.jax`` works without torch installed
and the log tools start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__ as __version__  # the one source of the version

_EXPORTS = {
    "Accountant": "lossparity.distributed.accountant",
    "MoEAccounting": "lossparity.distributed.moe.accounting",
    "ParallelDims": "lossparity.distributed.parallel_dims",
    "ProtocolError": "lossparity.distributed.protocol",
    "MODES": "lossparity.losses.modes",
    "Normalizers": "lossparity.losses.modes",
    "denominator": "lossparity.losses.modes",
    "numerator": "lossparity.losses.modes",
    "objective": "lossparity.losses.modes",
    "GapResult": "lossparity.losses.gap",
    "estimator_gap": "lossparity.losses.gap",
    "roll_mtp": "lossparity.losses.mtp",
    "document_stats": "lossparity.losses.stats",
    "sample_stats": "lossparity.losses.stats",
    "chunked_cross_entropy": "lossparity.losses.cross_entropy",
    "fused_linear_cross_entropy": "lossparity.losses.fused_cross_entropy",
    "token_weights": "lossparity.losses.token_weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lossparity' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
