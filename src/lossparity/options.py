"""The option vocabulary of lossparity, shared by the PyTorch port, the JAX port, the presets and the CLI.

Torch-free and JAX-free on purpose: every port and tool imports its spellings from here, so that one
option is spelled one way everywhere (docs/semantics.md §1, §4, §5). Each ``Literal`` alias has a tuple of
its values next to it for run-time checks and CLI choices; :func:`check_option` is the one validator.
Older spellings are accepted through :data:`ALIASES` and mapped to the canonical value.
"""

from __future__ import annotations

from typing import Literal, TypeVar, get_args

__all__ = [
    "Mode",
    "MODES",
    "Normalization",
    "NORMALIZATIONS",
    "GradReduction",
    "GRAD_REDUCTIONS",
    "MTPConvention",
    "MTP_CONVENTIONS",
    "MTPLogEstimator",
    "MTP_LOG_ESTIMATORS",
    "AuxScope",
    "AUX_SCOPES",
    "ZForm",
    "Z_FORMS",
    "ScoreFunction",
    "SCORE_FUNCTIONS",
    "LossImpl",
    "LOSS_IMPLS",
    "ALIASES",
    "check_option",
]

Mode = Literal["per_token", "per_sample", "per_microbatch", "per_document", "sample_sum", "sample_sum_norm"]
MODES: tuple[Mode, ...] = get_args(Mode)

# precount: normalizers counted before the step; deferred: raw sums back-propagated, gradients divided
# by the all-reduced count at the end of the step (Megatron calculate_per_token_loss=True).
Normalization = Literal["precount", "deferred"]
NORMALIZATIONS: tuple[Normalization, ...] = get_args(Normalization)

GradReduction = Literal["sum", "mean"]
GRAD_REDUCTIONS: tuple[GradReduction, ...] = get_args(GradReduction)

MTPConvention = Literal["own", "main", "pooled"]
MTP_CONVENTIONS: tuple[MTPConvention, ...] = get_args(MTPConvention)

MTPLogEstimator = Literal["token_mean", "microbatch_mean"]
MTP_LOG_ESTIMATORS: tuple[MTPLogEstimator, ...] = get_args(MTPLogEstimator)

AuxScope = Literal["micro_batch", "sequence", "global_lagged", "global_running", "none"]
AUX_SCOPES: tuple[AuxScope, ...] = get_args(AuxScope)

ZForm = Literal["global", "microbatch"]
Z_FORMS: tuple[ZForm, ...] = get_args(ZForm)

ScoreFunction = Literal["softmax", "sigmoid"]
SCORE_FUNCTIONS: tuple[ScoreFunction, ...] = get_args(ScoreFunction)

# Output-layer cross-entropy of the reference trainer: fused (gradients formed in the forward from the
# pre-counted per-token weights) or chunked (per-token losses, logits recomputed in the backward).
LossImpl = Literal["fused", "chunked"]
LOSS_IMPLS: tuple[LossImpl, ...] = get_args(LossImpl)

# Spellings accepted for backward compatibility, per option name: old -> canonical.
ALIASES: dict[str, dict[str, str]] = {
    "normalization": {"precounted": "precount"},
    "mtp_log_estimator": {"global": "token_mean", "megatron": "microbatch_mean"},
}

T = TypeVar("T", bound=str)


def check_option(name: str, value: object, valid: tuple[T, ...]) -> T:
    """Return the canonical spelling of ``value`` for option ``name``, or raise ``ValueError``.

    ``value`` must be a string equal to one of ``valid`` or to an alias of one (:data:`ALIASES`);
    the message names the option and lists the valid spellings.
    """
    if isinstance(value, str):
        canonical = ALIASES.get(name, {}).get(value, value)
        if canonical in valid:
            return canonical  # type: ignore[return-value]
    raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
