"""The option vocabulary of lossparity, shared by the PyTorch port, the JAX port, the presets and the CLI.

Torch-free and JAX-free on purpose: every port and tool imports its spellings from here, so that one
option is spelled one way everywhere (docs/semantics.md §1, §4, §5). Each ``Literal`` alias has a tuple of
its values next to it for run-time checks and CLI choices; :func:`check_option` is the one validator.
Older spellings are accepted through :data:`ALIASES` and mapped to the canonical value.
"""

from __future__ import annotations

import warnings
from typing import Literal, TypeVar, get_args

__all__ = [
    "Mode",
    "MODES",
    "ACCOUNTANT_MODES",
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
    "Align",
    "ALIGNS",
    "MissingSteps",
    "MISSING_STEPS",
    "Engine",
    "ENGINES",
    "DType",
    "DTYPES",
    "LossImpl",
    "LOSS_IMPLS",
    "ALIASES",
    "FRAMEWORK_AUX_SCOPES",
    "deprecated_padding_mask",
    "check_cp_seq_len",
    "check_sharded_moe",
    "check_option",
    "MODE_INFO",
]

Mode = Literal[
    "per_token",
    "per_sample",
    "per_microbatch",
    "per_document",
    "sample_sum",
    "sample_sum_norm",
    "token_sum",
    "per_group",
]
MODES: tuple[Mode, ...] = get_args(Mode)

# The modes of the LM Accountant, the reference trainer and `verify`: all of them (per_group takes the rows'
# group ids at begin_step; the trainer numbers its rows' groups by --group-size).
ACCOUNTANT_MODES: tuple[Mode, ...] = MODES

# precount: normalizers counted before the step; deferred: raw sums back-propagated, gradients divided
# by the all-reduced count at the end of the step (Megatron calculate_per_token_loss=True).
Normalization = Literal["precount", "deferred"]
NORMALIZATIONS: tuple[Normalization, ...] = get_args(Normalization)

# auto: detect DDP/FSDP (mean) or all-reduce a plain module's gradients (allreduce) in finish_step.
GradReduction = Literal["auto", "sum", "mean", "allreduce"]
GRAD_REDUCTIONS: tuple[GradReduction, ...] = get_args(GradReduction)

MTPConvention = Literal["own", "main", "pooled"]
MTP_CONVENTIONS: tuple[MTPConvention, ...] = get_args(MTPConvention)

MTPLogEstimator = Literal["token_mean", "microbatch_mean"]
MTP_LOG_ESTIMATORS: tuple[MTPLogEstimator, ...] = get_args(MTPLogEstimator)

# "microbatch" is spelled as the z-loss form and the mode "per_microbatch" ("micro_batch" is an alias).
AuxScope = Literal["microbatch", "sequence", "global_lagged", "global_running", "none"]
AUX_SCOPES: tuple[AuxScope, ...] = get_args(AuxScope)

ZForm = Literal["global", "microbatch"]
Z_FORMS: tuple[ZForm, ...] = get_args(ZForm)

# sqrtsoftplus: sqrt(softplus(logits)), the DeepSeek-V4 default (Megatron-LM main supports it too).
ScoreFunction = Literal["softmax", "sigmoid", "sqrtsoftplus"]
SCORE_FUNCTIONS: tuple[ScoreFunction, ...] = get_args(ScoreFunction)

# How `compare` pairs the points of two logs: by optimizer step, or by consumed samples.
Align = Literal["step", "samples"]
ALIGNS: tuple[Align, ...] = get_args(Align)

# When reference steps the candidate lacks make `compare` fail: span = the candidate must cover the
# reference's first to last step, all = every reference step must be in the candidate, ignore = only
# reported (docs/parity-tools.md).
MissingSteps = Literal["span", "all", "ignore"]
MISSING_STEPS: tuple[MissingSteps, ...] = get_args(MissingSteps)

# mode -> (objective formula, frameworks whose objective it matches); printed by `lossparity modes`.
# Kept here, torch-free, so that the log tools print the table without importing torch (docs/semantics.md §1).
MODE_INFO: dict[Mode, tuple[str, str]] = {
    "per_token": (
        "S / max(Ntok, 1)",
        "Megatron calculate_per_token_loss=True; MaxText default; HF Trainer >= 4.46; torchtitan; "
        "verl token-mean; DAPO",
    ),
    "per_sample": (
        "(1/N) Σ_i s_i / max(n_i, 1)",
        "MaxText RFC-0032 calculate_per_token_loss=False; Megatron =False with b=1; verl seq-mean-token-mean; GRPO",
    ),
    "per_microbatch": (
        "(1/(D·K)) Σ_mb s_mb / max(n_mb, 1)",
        "Megatron =False with any b; HF Trainer < 4.46 (legacy GA); DDP mean of local means",
    ),
    "per_document": ("(1/Ndoc) Σ_j s_j / max(n_j, 1)", "packed SFT: every conversation counts once"),
    "sample_sum": ("(1/N) Σ_i s_i", "verl seq-mean-token-sum"),
    "sample_sum_norm": ("S / (N · L)", "Dr. GRPO; verl seq-mean-token-sum-norm; TRL dr_grpo"),
    "token_sum": ("S", "verl token-sum (0.9)"),
    "per_group": (
        "(1/Ngrp) Σ_g s_g / max(n_g, 1)",
        "GRPO prompt groups: each prompt's completions weigh the same (no framework does it exactly)",
    ),
}

# Gradient engine of the trainer: DistributedDataParallel, FSDP2 (fully_shard) or a plain module whose
# gradients the accountant sums itself.
Engine = Literal["ddp", "fsdp", "plain"]
ENGINES: tuple[Engine, ...] = get_args(Engine)

# Parameter dtype of the reference trainer (bf16: float32 weights, bf16 autocast).
DType = Literal["float32", "float64", "bf16"]
DTYPES: tuple[DType, ...] = get_args(DType)

# Output-layer cross-entropy of the reference trainer: fused (gradients formed in the forward from the
# pre-counted per-token weights) or chunked (per-token losses, logits recomputed in the backward).
LossImpl = Literal["fused", "chunked"]
LOSS_IMPLS: tuple[LossImpl, ...] = get_args(LossImpl)

# Spellings accepted for backward compatibility, per option name: old -> canonical.
ALIASES: dict[str, dict[str, str]] = {
    "normalization": {"precounted": "precount"},
    "mtp_log_estimator": {"global": "token_mean", "megatron": "microbatch_mean"},
    # micro_batch: an older spelling; the rest: Megatron's and MindFormers' moe_router_load_balancing_type names
    # (FRAMEWORK_AUX_SCOPES below), accepted wherever an aux_scope is
    "aux_scope": {
        "micro_batch": "microbatch",
        "aux_loss": "microbatch",
        "seq_aux_loss": "sequence",
        "global_aux_loss": "global_running",
        "gbs_aux_loss": "global_running",
        "sub_seq_aux_loss": "microbatch",
    },
}

# The load-balancing option names of each framework -> lossparity's scope (docs/moe.md). Torch-free, so that
# the preset parser reads it; public as ``lossparity.moe.FRAMEWORK_AUX_SCOPES`` / ``aux_scope_for``.
FRAMEWORK_AUX_SCOPES: dict[str, dict[str, AuxScope]] = {
    # Megatron-LM moe_router_load_balancing_type
    "megatron": {
        "aux_loss": "microbatch",
        "seq_aux_loss": "sequence",
        "global_aux_loss": "global_running",
        "none": "none",
    },
    # MindSpore MindFormers moe_router_load_balancing_type: the pynative TopKRouter's Megatron-style names (its
    # global running counts summed over CP (2.0.0) or TP x CP (2.1.0), not DP) and the graph-mode router's
    # gbs_aux_loss (global over DP) and sub_seq_aux_loss (the config default: one Switch term per rank's
    # microbatch slice, the microbatch scope at TP = CP = 1); docs/moe.md has a row per mode
    "mindformers": {
        "aux_loss": "microbatch",
        "seq_aux_loss": "sequence",
        "global_aux_loss": "global_running",
        "gbs_aux_loss": "global_running",
        "sub_seq_aux_loss": "microbatch",
        "none": "none",
    },
}

T = TypeVar("T", bound=str)


def deprecated_padding_mask(where: str, keep_mask: object, stacklevel: int = 3) -> None:
    """The one message of the deprecated MoE ``padding_mask`` keyword (``True`` = padding), for the PyTorch and
    JAX functions alike: ``ValueError`` when ``keep_mask`` is given too, else a ``DeprecationWarning`` naming
    ``keep_mask=~padding_mask``. ``stacklevel`` points the warning at the caller of the public function."""
    if keep_mask is not None:
        raise ValueError(f"{where}: pass keep_mask or the deprecated padding_mask, not both")
    warnings.warn(
        f"{where}: padding_mask (True = padding) is deprecated and will be removed in the next release; "
        "pass keep_mask=~padding_mask (True = the tokens that count, as every lossparity mask)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


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


# ---------------------------------------------------------------------------------------------------------
# Layout rules stated once, for TrainConfig.validate() and for the library objects that enforce them at
# run time (model/context_parallel.py, distributed/moe/accounting.py): one condition, one message.


def check_cp_seq_len(seq_len: int, cp: int, zigzag: bool = True) -> None:
    """Context parallelism cuts every row into ``2·cp`` chunks (zig-zag) or ``cp`` chunks (contiguous):
    ``seq_len`` must be divisible by that number. Raises ``ValueError`` naming both."""
    parts = 2 * cp if zigzag else cp
    if seq_len % parts:
        raise ValueError(
            f"seq_len={seq_len} must be divisible by {parts} for cp={cp} "
            f"({'zig-zag' if zigzag else 'contiguous'} sharding)"
        )


def check_sharded_moe(
    cp: int, sp: bool, *, megatron_quirks: bool, aux_on: bool, z_on: bool, aux_scope: str, mode: str
) -> None:
    """MoE accounting on rows sharded over context parallelism (``cp > 1``) or sequence parallelism
    (``sp``): Megatron's quirks are not reproduced there (it divides the z coefficient by ``|TP×CP|`` on each
    shard's own mean), and the ``sequence`` aux scope does not combine with mode ``per_document`` (the
    sequences are then the documents, numbered on whole rows; a shard's local numbering differs).
    ``aux_on``/``z_on``: the load-balancing / z term is active. Raises ``ValueError``."""
    if not (cp > 1 or sp):
        return
    if megatron_quirks and (aux_on or z_on):
        raise ValueError(
            f"megatron_quirks=True is not reproduced under context parallelism (cp={cp}) or sequence "
            f"parallelism (sp={sp}): Megatron divides the z-loss coefficient by |TP×CP| on each shard's own "
            "mean; use the exact forms (megatron_quirks=False)"
        )
    if aux_on and aux_scope == "sequence" and mode == "per_document":
        who = " with ".join(([f"cp={cp}"] if cp > 1 else []) + (["sp"] if sp else []))
        raise ValueError(
            f"{who} does not combine aux_scope 'sequence' with mode 'per_document' (the documents are the "
            "sequences then, numbered on whole rows): use aux_scope microbatch, global_lagged or global_running"
        )
