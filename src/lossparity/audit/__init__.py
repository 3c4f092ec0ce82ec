"""``lossparity audit``: does *your* training stack compute the normalization you think it does?

The audit runs the user's own training step (a hand-written loop, a ``transformers.Trainer`` / TRL trainer,
megatron-core, DeepSpeed, torchtitan) under configurations that must give the same update (gradient
accumulation, micro-batch size, data-parallel ranks, recompute, packing), on a batch crafted so that the
modes differ, identifies the weight the stack gave every document (the named mode of ``lossparity modes``
and its factor) and compares the logged loss with the objective it optimized. :func:`audit_kernel` checks a
cross-entropy kernel against float64 autograd. See docs/audit.md.
"""

from .batch import CLASSES, DEFAULT_CLASSES, AuditBatch, Config, craft_batch
from .core import AuditError, AuditReport, ConfigRow, audit
from .deepspeed import DeepSpeedStep
from .identify import Identification, identify
from .kernel import KernelReport, audit_kernel
from .megatron import MegatronStep
from .report import render
from .stack import HandLoop, StepContext, TrainerContext, TrainerFactory
from .torchtitan import TitanStep

__all__ = [
    "audit",
    "audit_kernel",
    "render",
    "AuditError",
    "AuditReport",
    "ConfigRow",
    "KernelReport",
    "HandLoop",
    "TrainerFactory",
    "MegatronStep",
    "DeepSpeedStep",
    "TitanStep",
    "StepContext",
    "TrainerContext",
    "Identification",
    "identify",
    "AuditBatch",
    "Config",
    "craft_batch",
    "CLASSES",
    "DEFAULT_CLASSES",
]
