"""Framework presets (semantics §8): named bundles of lossparity's choices that reproduce one framework's numbers.

A :class:`Preset` holds what the accountant, the MoE accounting and the trainer take (objective mode,
normalization mechanism, MTP count convention and log estimator, MoE aux-loss scope, router z-loss
form, gradient-reduction hint, Megatron quirks) plus what was checked against the framework's source
and what was assumed (``notes``), the framework settings that select it (``settings``) and the
conditions under which it is exact (``requires``).

Spec strings (:func:`resolve_preset`)::

    megatron[:calculate_per_token_loss=false|true][,moe_router_load_balancing_type=aux_loss|seq_aux_loss|
             global_aux_loss|none]
    maxtext                                    upstream MaxText
    maxtext:calculate_per_token_loss=true      RFC-0032 fork, per-token objective, MTP over the main count
    maxtext:calculate_per_token_loss=false[,mtp_per_layer_loss_norm=true|false]   RFC-0032 per-sample
    hf-trainer[:average_tokens_across_devices=true|false]    transformers >= 4.46 (num_items_in_batch)
    hf-trainer-legacy                          transformers < 4.46 (mean of microbatch means)
    torchtitan
    verl:<loss_agg_mode>[,use_legacy_worker_impl=auto|enable|disable][,loss_scale_factor=L]
         (also spelled verl-<loss_agg_mode>); loss_agg_mode: token-mean, seq-mean-token-mean,
         seq-mean-token-sum, seq-mean-token-sum-norm
    lossparity[:mode=...,normalization=...,mtp_convention=...,mtp_log_estimator=...,aux_scope=...,
               z_form=...,fixed_length=L]     the exact, layout-invariant defaults (and overrides)

:func:`translate` answers "which settings of framework T reproduce the objective and the logs of
preset S?", with the conditions of an exact translation and warnings where none exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..options import (
    AUX_SCOPES,
    MODES,
    MTP_CONVENTIONS,
    MTP_LOG_ESTIMATORS,
    NORMALIZATIONS,
    Z_FORMS,
    AuxScope,
    GradReduction,
    Mode,
    MTPConvention,
    MTPLogEstimator,
    Normalization,
    ZForm,
    check_option,
)

__all__ = [
    "FRAMEWORKS",
    "PRESET_NAMES",
    "Preset",
    "Translation",
    "all_presets",
    "preset_table",
    "resolve_preset",
    "translate",
]

FRAMEWORKS: tuple[str, ...] = ("megatron", "maxtext", "hf-trainer", "torchtitan", "verl", "lossparity")
PRESET_NAMES: tuple[str, ...] = (
    "megatron",
    "maxtext",
    "hf-trainer",
    "hf-trainer-legacy",
    "torchtitan",
    "verl",
    "lossparity",
)
_VERL_MODES: dict[str, Mode] = {
    "token-mean": "per_token",
    "seq-mean-token-mean": "per_sample",
    "seq-mean-token-sum": "sample_sum",
    "seq-mean-token-sum-norm": "sample_sum_norm",
}
_MEGATRON_LB: dict[str, AuxScope] = {
    "aux_loss": "microbatch",
    "seq_aux_loss": "sequence",
    "global_aux_loss": "global_running",
    "none": "none",
}
_QUIRKS = (
    "Megatron parity quirks (semantics §5) are reproduced only by lossparity's megatron preset: they "
    "matter with global_aux_loss (aux gradient 1/D of its logged value), with a router z-loss in MTP "
    "layers, and with calculate_per_token_loss=true plus aux/z losses (pre-multiplication by local token "
    "counts)"
)


@dataclass(frozen=True)
class Preset:
    """One framework's loss semantics in lossparity's terms (see the module docstring).

    ``mode``/``normalization``/``grad_reduction``/``mtp_convention``/``mtp_log_estimator`` are
    :class:`~lossparity.distributed.accountant.Accountant` arguments, ``aux_scope``/``z_form`` those of
    :class:`~lossparity.distributed.moe_accounting.MoEAccounting`. ``has_mtp``/``has_router_z_loss``: the
    framework implements the feature at all. ``log_names``: the framework's names for lossparity's
    ``lm_loss`` (global token mean), ``objective`` and ``mtp_loss`` (per depth) when it logs them.
    ``aux_note``: how its load-balancing coefficient maps to lossparity's ``aux_coeff``.
    """

    name: str
    framework: str
    mode: Mode
    normalization: Normalization
    mtp_convention: MTPConvention
    mtp_log_estimator: MTPLogEstimator
    aux_scope: AuxScope
    z_form: ZForm
    grad_reduction: GradReduction | Literal["auto"] = "auto"
    megatron_quirks: bool = False
    description: str = ""
    notes: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    has_mtp: bool = True
    has_router_z_loss: bool = True
    log_names: dict[str, str] = field(default_factory=dict)
    aux_note: str = ""
    fixed_length: int | None = None

    def accountant_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``Accountant(...)`` that this preset fixes."""
        kw: dict[str, Any] = {
            "mode": self.mode,
            "normalization": self.normalization,
            "grad_reduction": self.grad_reduction,
            "mtp_convention": self.mtp_convention,
            "mtp_log_estimator": self.mtp_log_estimator,
        }
        if self.fixed_length is not None:
            kw["fixed_length"] = self.fixed_length
        return kw

    def moe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``MoEAccounting(...)`` that this preset fixes (``scope``, ``z_form``,
        ``megatron_quirks``)."""
        return {"scope": self.aux_scope, "z_form": self.z_form, "megatron_quirks": self.megatron_quirks}

    def train_config_fields(self) -> dict[str, Any]:
        """The ``TrainConfig`` fields this preset sets: mode, normalization, MTP convention, aux scope, z form
        (and ``fixed_length``). ``mtp_log_estimator`` is an ``Accountant`` argument, see :meth:`accountant_kwargs`."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "normalization": self.normalization,
            "mtp_convention": self.mtp_convention,
            "aux_scope": self.aux_scope,
            "z_form": self.z_form,
            "megatron_quirks": self.megatron_quirks,
        }
        if self.fixed_length is not None:
            out["fixed_length"] = self.fixed_length
        return out


# --------------------------------------------------------------------------------------------------
# option parsing


def _parse_bool(value: str, option: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"option {option}={value!r}: expected true or false")


def _choice(value: str, option: str, valid: tuple[str, ...]) -> Any:
    """``value`` checked against ``valid`` with :func:`lossparity.options.check_option` (its aliases too)."""
    try:
        return check_option(option, value, valid)
    except ValueError:
        raise ValueError(f"option {option}={value!r}: valid values: {', '.join(valid)}") from None


def _positive(value: str, option: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"option {option}={value!r}: expected a positive integer") from None
    if v < 1:
        raise ValueError(f"option {option}={value!r}: expected a positive integer")
    return v


def _split_spec(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """``name:a,k=v,...`` -> (name, positional items, options); raises on a repeated option."""
    text = spec.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    if name.startswith("verl-") and name[5:] in _VERL_MODES:  # semantics §8 spells verl-<loss_agg_mode>
        rest = name[5:] + ("," + rest if rest else "")
        name = "verl"
    positional: list[str] = []
    options: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            positional.append(item)
            continue
        key = key.strip().lower().replace("-", "_")
        if key in options:
            raise ValueError(f"preset {spec!r}: option {key} given twice")
        options[key] = value.strip()
    return name, positional, options


def _check_options(spec: str, name: str, options: dict[str, str], valid: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(valid))
    if unknown:
        allowed = ", ".join(valid) if valid else "none"
        raise ValueError(
            f"preset {spec!r}: unknown option(s) {', '.join(unknown)} for {name}; valid options: {allowed}"
        )


def _no_positional(spec: str, name: str, positional: list[str]) -> None:
    if positional:
        raise ValueError(f"preset {spec!r}: {name} options are KEY=VALUE, got {', '.join(positional)}")


# --------------------------------------------------------------------------------------------------
# the presets


def _megatron(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _no_positional(spec, "megatron", positional)
    _check_options(spec, "megatron", options, ("calculate_per_token_loss", "moe_router_load_balancing_type"))
    per_token = _parse_bool(options.get("calculate_per_token_loss", "false"), "calculate_per_token_loss")
    lb = _choice(
        options.get("moe_router_load_balancing_type", "aux_loss"), "moe_router_load_balancing_type", tuple(_MEGATRON_LB)
    )
    name = f"megatron:calculate_per_token_loss={'true' if per_token else 'false'}"
    if lb != "aux_loss":
        name += f",moe_router_load_balancing_type={lb}"
    notes = [
        "verified (Megatron-LM main, core/pipeline_parallel/schedules.py): with calculate_per_token_loss=False each "
        "microbatch's loss sum is divided by its own token count (clamped to 1) and by the number of microbatches, "
        "and DDP averages over data-parallel ranks: the mean of the D·K microbatch means (per_microbatch; equal to "
        "per_sample when --micro-batch-size is 1).",
        "verified (core/distributed/finalize_model_grads.py): with calculate_per_token_loss=True DDP applies no 1/D "
        "and finalize_model_grads divides every gradient by the global non-padded token count (deferred "
        "normalization, summed gradients).",
        "verified (core/transformer/multi_token_prediction.py): the MTP term is mtp_loss_scaling_factor/mtp_num_layers "
        "times the sum over depths; with =False each depth's microbatch sum is divided by its own rolled count "
        "(own, per microbatch); the mtp_<k> loss log is the mean over microbatches and DP×CP ranks of the local "
        "means (microbatch_mean), whatever the flag.",
        "verified (core/transformer/transformer_config.py): moe_router_load_balancing_type default aux_loss "
        "(micro-batch level), seq_aux_loss (per sequence), global_aux_loss (global batch through a running buffer); "
        "moe_aux_loss_coeff default 0.0, moe_z_loss_coeff default None; the router z-loss is a per-microbatch mean "
        "(z_form microbatch).",
        "the lm loss log is the global Σs/Σn of the (sum, count) reporting channel, independent of the flag "
        "(semantics §2); the objective itself is not logged.",
        "with context parallelism > 1 and =False Megatron averages each CP shard's own local mean, a shard-level "
        "estimator (semantics §1) that only this preset reproduces.",
    ]
    if per_token:
        notes += [
            "verified (core/transformer/moe/router.py): with =True the aux and z losses are pre-multiplied by the "
            "local token count × |TP×CP|, so after finalize's division by the global token count each microbatch "
            "weighs its router tokens / the global LM token count (reproduced with megatron_quirks).",
            "verified: releases before Megatron-LM PR #3159 (2026-02) inject raw MTP sums that finalize divides by the "
            "main token count (main); since then each microbatch's depth-k sum is first rescaled by n_mb/n_k,mb "
            "(local counts), between main and own. The preset keeps main; lossparity does not reproduce the newer "
            "local rescaling exactly.",
        ]
    return Preset(
        name=name,
        framework="megatron",
        mode="per_token" if per_token else "per_microbatch",
        normalization="deferred" if per_token else "precount",
        mtp_convention="main" if per_token else "own",
        mtp_log_estimator="microbatch_mean",
        aux_scope=_MEGATRON_LB[lb],
        z_form="microbatch",
        grad_reduction="sum" if per_token else "mean",
        megatron_quirks=True,
        description=(
            "Megatron-LM, per-token objective over the global token count"
            if per_token
            else "Megatron-LM default: mean of microbatch means (per-sample when micro-batch size is 1)"
        ),
        notes=notes,
        settings=(["--calculate-per-token-loss"] if per_token else ["no --calculate-per-token-loss (the default)"])
        + [f"--moe-router-load-balancing-type {lb}"],
        log_names={"lm_loss": "lm loss", "mtp_loss": "mtp_<k> loss"},
        aux_note="moe_aux_loss_coeff = lossparity aux_coeff (both add the per-layer terms over MoE layers)",
    )


def _maxtext(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _no_positional(spec, "maxtext", positional)
    _check_options(spec, "maxtext", options, ("calculate_per_token_loss", "mtp_per_layer_loss_norm"))
    common_notes = [
        "verified (MaxText main, layers/moe.py load_balance_loss): per-sequence share of top-k slots × per-sequence "
        "mean router probability, averaged over sequences and experts, × E² × load_balance_loss_weight (default "
        "0.0): k times the Switch form of semantics §5 per sequence (sequence scope); padding positions are included; "
        "trainers/pre_train/train.py averages it over MoE layers instead of summing.",
        "verified: MaxText has no router z-loss; z_loss_multiplier is the output-logit z-loss, part of l[i,t] "
        "(semantics §1) and normalized with the cross-entropy.",
        "verified (trainers/pre_train/train.py): learning/lm_loss = Σ xent / total_weights (global token mean); "
        "learning/loss is the objective when gradient_accumulation_steps = 1.",
        "verified (utils/gradient_accumulation.py): with gradient_accumulation_steps > 1 raw sums are accumulated and "
        "every gradient is divided by the total token count, including the already normalized MTP and load-balance "
        "terms (their gradients shrink by 1/Ntok), and learning/loss becomes lm_loss + aux/K: with those terms "
        "this preset reproduces MaxText only with GA = 1.",
    ]
    aux_note = (
        "load_balance_loss_weight w = lossparity aux_coeff·(number of MoE layers)/k (MaxText averages over "
        "layers and its per-sequence loss is k× the Switch form); exact without padding"
    )
    log = {"lm_loss": "learning/lm_loss", "objective": "learning/loss (GA = 1)"}
    if "calculate_per_token_loss" not in options:
        if "mtp_per_layer_loss_norm" in options:
            raise ValueError(
                f"preset {spec!r}: mtp_per_layer_loss_norm needs calculate_per_token_loss=false (RFC-0032 fork)"
            )
        return Preset(
            name="maxtext",
            framework="maxtext",
            mode="per_token",
            normalization="precount",
            mtp_convention="pooled",
            mtp_log_estimator="token_mean",
            aux_scope="sequence",
            z_form="global",
            grad_reduction="sum",
            has_router_z_loss=False,
            description="upstream MaxText: global token mean; MTP depths pooled",
            notes=[
                "verified (trainers/pre_train/train.py): objective Σ xent / total_weights over the whole global batch "
                "(GA = 1, one jit over all devices, hence per_token and no data-parallel averaging).",
                "verified (layers/multi_token_prediction.py calculate_mtp_loss): MTP term mtp_loss_scaling_factor "
                "(default 0.1) × Σ_k S_k / Σ_k Ntok_k (pooled, no 1/Dm); learning/mtp_loss logs that scaled value with "
                "the depths pooled (lossparity's mtp_1_loss × the factor when there is one depth).",
                "checked: calculate_per_token_loss and mtp_per_layer_loss_norm do not exist in upstream MaxText (main, "
                "2026-08); they belong to the fork described by RFC-0032 (maxtext:calculate_per_token_loss=...).",
                *common_notes,
            ],
            settings=["defaults (no calculate_per_token_loss in upstream MaxText)"],
            requires=["gradient_accumulation_steps=1 when MTP or the load-balancing loss is used"],
            log_names={**log, "mtp_loss": "learning/mtp_loss (× mtp_loss_scaling_factor, depths pooled)"},
            aux_note=aux_note,
        )
    per_token = _parse_bool(options["calculate_per_token_loss"], "calculate_per_token_loss")
    fork = "assumed from RFC-0032 (a MaxText fork; not in upstream MaxText, so not verifiable against public code): "
    if per_token:
        if "mtp_per_layer_loss_norm" in options:
            raise ValueError(
                f"preset {spec!r}: mtp_per_layer_loss_norm only applies with calculate_per_token_loss=false"
            )
        return Preset(
            name="maxtext:calculate_per_token_loss=true",
            framework="maxtext",
            mode="per_token",
            normalization="precount",
            mtp_convention="main",
            mtp_log_estimator="token_mean",
            aux_scope="sequence",
            z_form="global",
            grad_reduction="sum",
            has_router_z_loss=False,
            description="MaxText RFC-0032 fork, =true: per-token objective, MTP over the main token count",
            notes=[
                fork + "=true keeps the per-token objective for any GA, and calculate_mtp_loss divides the MTP sums by "
                "the global main token count (main, Megatron =True), overriding mtp_per_layer_loss_norm.",
                fork + "the MTP log is coupled to the objective (Σ_k S_k over the main count), not a per-depth token "
                "mean: lossparity's token_mean log differs by the factor Ntok_k/Ntok; Megatron's microbatch_mean log "
                "is not reproduced in this mode.",
                *common_notes,
            ],
            settings=["calculate_per_token_loss=true"],
            requires=["gradient_accumulation_steps=1 when the load-balancing loss is used"],
            log_names={**log, "mtp_loss": "learning/mtp_loss"},
            aux_note=aux_note,
        )
    norm = _parse_bool(options.get("mtp_per_layer_loss_norm", "true"), "mtp_per_layer_loss_norm")
    return Preset(
        name=f"maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm={'true' if norm else 'false'}",
        framework="maxtext",
        mode="per_sample",
        normalization="precount",
        mtp_convention="own" if norm else "pooled",
        mtp_log_estimator="microbatch_mean",
        aux_scope="sequence",
        z_form="global",
        grad_reduction="sum",
        has_router_z_loss=False,
        description="MaxText RFC-0032 fork, =false: per-sample objective (Megatron =False with b=1)",
        notes=[
            fork + "objective = mean over the global batch of s_i / max(n_i, 1) for any GA (each GA micro-step holds "
            "N/K samples and the steps weigh equally), i.e. per_sample; learning/lm_loss stays the global token mean.",
            fork + "mtp_per_layer_loss_norm=true weighs every (depth, sample) pair equally (own) — the combination "
            "RFC-0032 maps to Megatron =False; false pools the depths per sample, Σ_k s_ki / max(Σ_k n_ki, 1) "
            "(pooled). The default of mtp_per_layer_loss_norm is assumed to be true.",
            fork + "the MTP log is the per-sample mean, which lossparity's microbatch_mean estimator equals when b = 1 "
            "(and Megatron's mtp_<k> loss with micro-batch size 1).",
            fork + "num_vocab_tiling > 1 is rejected with =false.",
            *common_notes,
        ],
        settings=["calculate_per_token_loss=false", f"mtp_per_layer_loss_norm={'true' if norm else 'false'}"],
        requires=["num_vocab_tiling=1", "gradient_accumulation_steps=1 when the load-balancing loss is used"],
        log_names={**log, "mtp_loss": "learning/mtp_loss"},
        aux_note=aux_note,
    )


_HF_AUX_NOTE = (
    "router_aux_loss_coef: HF models compute one load_balancing_loss_func over all layers' router "
    "logits pooled (not a per-layer sum): equal to lossparity's microbatch term only with one MoE layer"
)
_HF_AUX_FACT = (
    "verified (HF MoE causal-LM forwards, e.g. Qwen3-MoE, GraniteMoE): the router aux loss is one "
    "load_balancing_loss_func over the concatenated router logits of all layers, per forward "
    "(microbatch scope, padding excluded with the attention mask), added to the model loss"
)


def _hf(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _no_positional(spec, "hf-trainer", positional)
    _check_options(spec, "hf-trainer", options, ("average_tokens_across_devices",))
    across = _parse_bool(options.get("average_tokens_across_devices", "true"), "average_tokens_across_devices")
    requires = ["transformers >= 4.46 and a model whose forward accepts **kwargs (num_items_in_batch reaches the loss)"]
    if across:
        requires.append("average_tokens_across_devices=True (the default since transformers 4.54) or one process")
    else:
        requires.append(
            "one process: with D > 1 and average_tokens_across_devices=False every rank divides by its "
            "own token count (mean over ranks of per-rank token means), which no lossparity mode is"
        )
    return Preset(
        name="hf-trainer" + ("" if across else ":average_tokens_across_devices=false"),
        framework="hf-trainer",
        mode="per_token",
        normalization="precount",
        mtp_convention="own",
        mtp_log_estimator="token_mean",
        aux_scope="microbatch",
        z_form="microbatch",
        grad_reduction="mean",
        has_mtp=False,
        has_router_z_loss=False,
        description="Hugging Face Trainer >= 4.46: Σ s / num_items_in_batch (pre-counted token normalizer)",
        notes=[
            "verified (Trainer.compute_loss): since 4.46 the Trainer counts num_items_in_batch, the loss tokens of all "
            "gradient-accumulation microbatches of the step, before their forwards and passes it to models whose "
            "forward accepts loss kwargs: each microbatch back-propagates Σ s_mb / num_items_in_batch.",
            "verified (TrainingArguments.average_tokens_across_devices, default True since 4.54, False in 4.46-4.53): "
            "the count is summed over processes and the loss multiplied by the number of processes to undo DDP's "
            "averaging, which makes it exactly per_token.",
            "assumed: a model whose forward takes no loss kwargs, or a compute_loss that ignores num_items_in_batch, "
            "falls back to the legacy behaviour (hf-trainer-legacy).",
            _HF_AUX_FACT + " after the num_items_in_batch normalization; verified (Trainer.training_step): the "
            "division by the accumulation steps is skipped when num_items_in_batch reaches the model, so the aux term "
            "is summed over the step's microbatches (and, with average_tokens_across_devices, multiplied by the number "
            "of processes) rather than averaged.",
            "no MTP and no router z-loss in the Trainer (Switch Transformers' router z-loss lives in that model).",
            "assumed: the logged loss is the objective, averaged over the logging steps; no separate global "
            "token-mean log.",
        ],
        settings=[
            "transformers >= 4.46",
            "a model forward with **kwargs (num_items_in_batch)",
            f"average_tokens_across_devices={'True' if across else 'False'}",
        ],
        requires=requires,
        log_names={"objective": "loss"},
        aux_note=_HF_AUX_NOTE,
    )


def _hf_legacy(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _no_positional(spec, "hf-trainer-legacy", positional)
    _check_options(spec, "hf-trainer-legacy", options, ())
    return Preset(
        name="hf-trainer-legacy",
        framework="hf-trainer",
        mode="per_microbatch",
        normalization="precount",
        mtp_convention="own",
        mtp_log_estimator="token_mean",
        aux_scope="microbatch",
        z_form="microbatch",
        grad_reduction="mean",
        has_mtp=False,
        has_router_z_loss=False,
        description="Hugging Face Trainer < 4.46 (legacy GA): mean of microbatch token means",
        notes=[
            "verified (Trainer.training_step): without num_items_in_batch the model's loss, the token mean of its "
            "microbatch, is divided by gradient_accumulation_steps and DDP averages the ranks: the mean of the D·K "
            "microbatch means (per_microbatch, b = per_device_train_batch_size) — the gradient-accumulation bug "
            "fixed in 4.46 (transformers issue #34242).",
            "a microbatch without loss tokens gives NaN in HF (mean over an empty set); lossparity gives 0 "
            "(semantics §1).",
            _HF_AUX_FACT + "; divided by the accumulation steps like the rest of the loss (microbatch scope).",
            "assumed: the logged loss is the objective, averaged over the logging steps.",
        ],
        settings=["transformers < 4.46, or a model forward without **kwargs (no num_items_in_batch)"],
        log_names={"objective": "loss"},
        aux_note=_HF_AUX_NOTE,
    )


def _torchtitan(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _no_positional(spec, "torchtitan", positional)
    _check_options(spec, "torchtitan", options, ())
    return Preset(
        name="torchtitan",
        framework="torchtitan",
        mode="per_token",
        normalization="precount",
        mtp_convention="main",
        mtp_log_estimator="token_mean",
        aux_scope="none",
        z_form="global",
        grad_reduction="sum",
        has_router_z_loss=False,
        description="torchtitan: Σ s / global valid tokens counted before the step; aux-loss-free MoE balancing",
        notes=[
            "verified (torchtitan main, trainer.py): the loss tokens of all gradient-accumulation microbatches are "
            "counted and summed over the batch mesh before the first forward (global_valid_tokens); each microbatch "
            "back-propagates its summed cross-entropy / global_valid_tokens; FSDP's gradient division is disabled "
            "(distributed/fsdp.py set_gradient_divide_factor(1.0)): per_token, pre-counted, summed gradients.",
            "verified: the logged loss (loss_metrics/global_avg_loss) is the sum over ranks and microbatches of "
            "local sum / global tokens, i.e. the whole objective (MTP included).",
            "verified (models/deepseek_v3/mtp.py): loss = (main sum + mtp_scale · mean over depths of S_k) / "
            "global_valid_tokens (main convention, mtp_scale default 0.3); no per-depth MTP log; MTP is not "
            "supported with context or pipeline parallelism yet.",
            "verified (models/common/moe.py, components/optimizer/optimizer.py): no load-balancing loss; aux-loss-free "
            "expert bias with load_balance_coeff (default 1e-3), updated in an optimizer step-pre hook by "
            "coeff·sign(mean(c) − c_e) with the mean of the update removed (zero-mean correction); no router z-loss.",
        ],
        settings=["defaults (loss normalized by global_valid_tokens)"],
        log_names={"objective": "loss (loss_metrics/global_avg_loss)"},
        aux_note="no load-balancing loss (aux-loss-free bias: lossparity bias_rate = load_balance_coeff, "
        "bias_zero_mean=True)",
    )


def _verl(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _check_options(spec, "verl", options, ("use_legacy_worker_impl", "loss_scale_factor", "loss_agg_mode"))
    agg = options.get("loss_agg_mode")
    if positional:
        if len(positional) > 1 or (agg is not None and agg != positional[0]):
            raise ValueError(f"preset {spec!r}: give one loss_agg_mode; valid: {', '.join(_VERL_MODES)}")
        agg = positional[0]
    if agg is None:
        raise ValueError(
            f"preset {spec!r}: verl needs a loss_agg_mode, e.g. verl:token-mean; valid: {', '.join(_VERL_MODES)}"
        )
    agg = _choice(agg, "loss_agg_mode", tuple(_VERL_MODES))
    impl = _choice(
        options.get("use_legacy_worker_impl", "auto"), "use_legacy_worker_impl", ("auto", "enable", "disable")
    )
    legacy = impl != "disable"
    L = _positive(options["loss_scale_factor"], "loss_scale_factor") if "loss_scale_factor" in options else None
    if L is not None and agg != "seq-mean-token-sum-norm":
        raise ValueError(f"preset {spec!r}: loss_scale_factor only applies to seq-mean-token-sum-norm")
    mode = _VERL_MODES[agg]
    requires: list[str] = []
    notes = [
        "verified (verl main, trainer/ppo/core_algos.py agg_loss): token-mean = masked sum / token count, "
        "seq-mean-token-mean = mean over sequences of their token means, seq-mean-token-sum = mean over sequences "
        "of their sums, seq-mean-token-sum-norm = sum of the sequence sums / loss_scale_factor (default: the "
        "response length of the batch).",
        "verified (trainer/main_ppo.py, workers/actor/dp_actor.py): with the default use_legacy_worker_impl=auto the "
        "legacy actor aggregates each micro-batch on its own (its own token or sequence count), scales it by "
        "1/gradient_accumulation and FSDP averages the ranks; with use_legacy_worker_impl=disable the engine workers "
        "pass the global token count (all-reduced) and the global batch size (workers/utils/losses.py), which makes "
        "the aggregation global.",
        "verl is an RL trainer: the loss is the policy loss and its log actor/pg_loss; no MTP, no MoE aux loss of its "
        "own (a Megatron backend brings Megatron's MoE settings).",
    ]
    if agg == "token-mean" and legacy:
        mode = "per_microbatch"
        notes.append(
            "legacy workers: token-mean is the mean over micro-batches of their token means (per_microbatch, "
            "b = ppo_micro_batch_size_per_gpu); exact per_token needs use_legacy_worker_impl=disable."
        )
        requires.append("use_dynamic_bsz=False (dynamic micro-batches weigh micro-batch means by their row counts)")
    elif agg in ("seq-mean-token-mean", "seq-mean-token-sum") and legacy:
        requires += [
            "every response has at least one loss token (the legacy aggregation drops empty responses "
            "from the micro-batch's sequence count)",
            "use_dynamic_bsz=False and a fixed ppo_micro_batch_size_per_gpu",
        ]
    elif agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        notes.append(
            "assumed: the engine's global_batch_size counts every sequence, empty ones included, so a "
            "response without loss tokens counts in the denominator (semantics §1)."
        )
    if agg == "seq-mean-token-sum-norm":
        requires.append(
            "the same L (loss_scale_factor) in both runs; verl divides a micro-batch's *sum* of sequence "
            "sums by L without a 1/N, so its value is lossparity's sample_sum_norm times a constant (b "
            "with the legacy workers): same gradient direction, the learning rate absorbs the factor"
        )
    name = f"verl:{agg}" + ("" if impl == "auto" else f",use_legacy_worker_impl={impl}")
    if L is not None:
        name += f",loss_scale_factor={L}"
    settings = [f"actor_rollout_ref.actor.loss_agg_mode={agg}"]
    if impl != "auto":
        settings.append(f"trainer.use_legacy_worker_impl={impl}")
    if L is not None:
        settings.append(f"actor_rollout_ref.actor.loss_scale_factor={L}")
    return Preset(
        name=name,
        framework="verl",
        mode=mode,
        normalization="precount",
        mtp_convention="own",
        mtp_log_estimator="token_mean",
        aux_scope="none",
        z_form="global",
        grad_reduction="mean",
        has_mtp=False,
        has_router_z_loss=False,
        fixed_length=L,
        description=f"verl loss_agg_mode={agg} ({'legacy' if legacy else 'engine'} workers)",
        notes=notes,
        settings=settings,
        requires=requires,
        log_names={"objective": "actor/pg_loss"},
    )


def _lossparity(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _no_positional(spec, "lossparity", positional)
    keys = ("mode", "normalization", "mtp_convention", "mtp_log_estimator", "aux_scope", "z_form", "fixed_length")
    _check_options(spec, "lossparity", options, keys)
    mode = _choice(options.get("mode", "per_token"), "mode", MODES)
    L = _positive(options["fixed_length"], "fixed_length") if "fixed_length" in options else None
    if mode == "sample_sum_norm" and L is None:
        raise ValueError(f"preset {spec!r}: mode sample_sum_norm needs fixed_length=L")
    p = Preset(
        name="lossparity",
        framework="lossparity",
        mode=mode,
        normalization=_choice(options.get("normalization", "precount"), "normalization", NORMALIZATIONS),
        mtp_convention=_choice(options.get("mtp_convention", "own"), "mtp_convention", MTP_CONVENTIONS),
        mtp_log_estimator=_choice(
            options.get("mtp_log_estimator", "token_mean"), "mtp_log_estimator", MTP_LOG_ESTIMATORS
        ),
        aux_scope=_choice(options.get("aux_scope", "global_lagged"), "aux_scope", AUX_SCOPES),
        z_form=_choice(options.get("z_form", "global"), "z_form", Z_FORMS),
        grad_reduction="auto",
        fixed_length=L,
        description="lossparity: exact, layout-invariant defaults",
        notes=[
            "the defaults of Accountant/MoEAccounting/TrainConfig: every number is the same for every layout "
            "(semantics §3)"
        ],
        log_names={"lm_loss": "lm_loss", "objective": "objective", "mtp_loss": "mtp_<k>_loss"},
        aux_note="aux_coeff (summed over MoE layers)",
    )
    changed = [f"{k}={options[k]}" for k in keys if k in options]
    if changed:
        p = replace(p, name="lossparity:" + ",".join(changed), description="lossparity with overrides")
    p.settings.extend(_lossparity_settings(p))
    return p


def _lossparity_settings(p: Preset) -> list[str]:
    line = (
        f"--mode {p.mode} --normalization {p.normalization} --mtp-convention {p.mtp_convention} "
        f"--aux-scope {p.aux_scope}"
    )
    out = [line, f"z_form={p.z_form}, mtp_log_estimator={p.mtp_log_estimator} (TrainConfig / Accountant)"]
    if p.fixed_length is not None:
        out.append(f"fixed_length={p.fixed_length}")
    return out


_BUILDERS = {
    "megatron": _megatron,
    "maxtext": _maxtext,
    "hf-trainer": _hf,
    "hf-trainer-legacy": _hf_legacy,
    "torchtitan": _torchtitan,
    "verl": _verl,
    "lossparity": _lossparity,
}


def resolve_preset(spec: str) -> Preset:
    """Parse a preset spec (module docstring) into a :class:`Preset`.

    ``spec`` is ``NAME`` or ``NAME:OPTIONS`` with comma-separated ``KEY=VALUE`` options (``verl`` takes its
    ``loss_agg_mode`` as a bare item). Raises ``ValueError`` listing the valid names, options or values
    on anything unknown.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"preset spec must be a non-empty string, got {spec!r}; valid presets: {', '.join(PRESET_NAMES)}"
        )
    name, positional, options = _split_spec(spec)
    if name not in _BUILDERS:
        raise ValueError(
            f"unknown preset {name!r} (from {spec!r}); valid presets: {', '.join(PRESET_NAMES)} "
            f"(verl:<loss_agg_mode> with {', '.join(_VERL_MODES)})"
        )
    return _BUILDERS[name](spec, positional, options)


def all_presets() -> list[Preset]:
    """One preset per documented spec (the README table's rows)."""
    specs = [
        "megatron:calculate_per_token_loss=false",
        "megatron:calculate_per_token_loss=true",
        "maxtext",
        "maxtext:calculate_per_token_loss=true",
        "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=true",
        "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=false",
        "hf-trainer",
        "hf-trainer-legacy",
        "torchtitan",
        *(f"verl:{m}" for m in _VERL_MODES),
        "verl:token-mean,use_legacy_worker_impl=disable",
        "lossparity",
    ]
    return [resolve_preset(s) for s in specs]


def preset_table() -> str:
    """Markdown table of :func:`all_presets` for the README: preset, mode, normalization, MTP convention,
    MTP log estimator, aux scope, z form and a one-line description."""
    head = (
        "preset",
        "mode",
        "normalization",
        "MTP convention",
        "MTP log estimator",
        "aux scope",
        "z form",
        "description",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in all_presets():
        mtp = (f"`{p.mtp_convention}`", f"`{p.mtp_log_estimator}`") if p.has_mtp else ("—", "—")
        z = f"`{p.z_form}`" if p.has_router_z_loss else "—"
        lines.append(
            f"| `{p.name}` | `{p.mode}` | `{p.normalization}` | {mtp[0]} | {mtp[1]} | `{p.aux_scope}` | {z} "
            f"| {p.description} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# translation


@dataclass
class Translation:
    """How to reproduce ``source`` in ``target_framework``: the chosen ``target`` preset, the framework
    ``settings``, which logged metrics correspond (``logs``), the ``conditions`` of exactness (optional
    terms such as MTP or aux losses that must be off, same micro-batch size, ...) and ``warnings`` where
    the target cannot reproduce the source. ``exact`` is true when there is no warning."""

    source: Preset
    target_framework: str
    microbatch_size: int | None
    target: Preset
    settings: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    conditions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """True when the target reproduces the source's objective and logs (under ``conditions``)."""
        return not self.warnings

    def format(self) -> str:
        """The text ``lossparity modes --from ... --to ...`` prints."""
        b = f" (micro-batch size {self.microbatch_size})" if self.microbatch_size else ""
        out = [
            f"lossparity modes: {self.source.name}{b} -> {self.target_framework}",
            f"  source: {_describe(self.source, self.microbatch_size)}",
            f"  target: {self.target.name}: {_describe(self.target, None)}",
            f"settings in {self.target.framework}:",
        ]
        out += [f"  - {s}" for s in self.settings]
        if self.logs:
            out.append("logs:")
            out += [f"  - {s}" for s in self.logs]
        if self.conditions:
            out.append("exact only when:")
            out += [f"  - {s}" for s in self.conditions]
        if self.warnings:
            out.append("warnings:")
            out += [f"  ! {s}" for s in self.warnings]
        out.append(
            "result: "
            + (
                "EXACT translation"
                if self.exact
                else f"APPROXIMATE ({len(self.warnings)} warning{'s' * (len(self.warnings) != 1)})"
            )
        )
        return "\n".join(out)


def _describe(p: Preset, b: int | None) -> str:
    mode = p.mode + (" = per_sample (b=1)" if p.mode == "per_microbatch" and b == 1 else "")
    parts = [f"objective {mode}", f"normalization {p.normalization}"]
    parts.append(f"MTP {p.mtp_convention}, MTP log {p.mtp_log_estimator}" if p.has_mtp else "no MTP")
    parts.append(f"aux {p.aux_scope}")
    parts.append(f"router z {p.z_form}" if p.has_router_z_loss else "no router z-loss")
    return ", ".join(parts)


def _eff_mode(mode: str, b: int | None) -> str:
    return "per_sample" if mode == "per_microbatch" and b == 1 else mode


def _eff_scope(scope: str, b: int | None) -> str:
    return "sequence" if scope == "microbatch" and b == 1 else scope


def _eff_conv(conv: str, mode: str) -> str:
    # main and own differ only where the main loss's denominator is the token count
    return "own" if conv == "main" and mode != "per_token" else conv


def _microbatch_setting(p: Preset, b: int | None) -> str:
    size = str(b) if b else "the source's micro-batch size"
    return {
        "megatron": f"--micro-batch-size {size}",
        "hf-trainer": f"per_device_train_batch_size={size}",
        "verl": f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size}",
        "lossparity": f"global_batch / (dp·ga) = {size}",
    }.get(p.framework, f"micro-batch size {size}")


def _candidates(target: str, source: Preset) -> list[Preset]:
    t = target.strip()
    key = t.lower()
    if key == "lossparity":
        # lossparity implements every choice; Megatron's quirks through its own megatron preset.
        base = resolve_preset("lossparity")
        spec = (
            f"lossparity:mode={source.mode},normalization={source.normalization},"
            f"mtp_convention={source.mtp_convention},mtp_log_estimator={source.mtp_log_estimator},"
            f"aux_scope={source.aux_scope},z_form={source.z_form}"
            + (f",fixed_length={source.fixed_length}" if source.fixed_length else "")
        )
        p = replace(
            source,
            name=f"lossparity preset {source.name}" if source.megatron_quirks else spec,
            framework="lossparity",
            grad_reduction="auto",
            settings=[],
            requires=[],
            log_names=base.log_names,
            aux_note=base.aux_note,
            description=base.description,
        )
        p.settings.extend(
            ([f"the lossparity preset {source.name} (reproduces its quirks)"] if source.megatron_quirks else [])
            + _lossparity_settings(p)
        )
        return [p]
    if key == "megatron":
        return [
            resolve_preset(f"megatron:calculate_per_token_loss={f},moe_router_load_balancing_type={lb}")
            for f in ("false", "true")
            for lb in _MEGATRON_LB
        ]
    if key == "maxtext":
        return [
            resolve_preset(s)
            for s in (
                "maxtext",
                "maxtext:calculate_per_token_loss=true",
                "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=true",
                "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=false",
            )
        ]
    if key == "hf-trainer":
        return [resolve_preset("hf-trainer"), resolve_preset("hf-trainer-legacy")]
    if key == "torchtitan":
        return [resolve_preset("torchtitan")]
    if key == "verl":
        L = f",loss_scale_factor={source.fixed_length}" if source.fixed_length else ""
        return [
            resolve_preset(f"verl:{m},use_legacy_worker_impl={impl}" + (L if m.endswith("norm") else ""))
            for impl in ("disable", "auto")
            for m in _VERL_MODES
        ]
    try:
        return [resolve_preset(t)]
    except ValueError:
        raise ValueError(
            f"unknown target {target!r}; valid targets: {', '.join(FRAMEWORKS)}, or a preset spec "
            f"({', '.join(PRESET_NAMES)})"
        ) from None


@dataclass
class _Assessment:
    """What a candidate translation needs and lacks; ``penalty`` ranks candidates (lower is closer)."""

    settings: list[str]
    conditions: list[str]
    logs: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    penalty: int = 0


def _assess_mode(src: Preset, cand: Preset, b: int | None, acc: _Assessment) -> tuple[str, str, int | None]:
    """The LM objective: ``(source mode, target mode, target micro-batch size)`` as the translation fixes them."""
    smode = _eff_mode(src.mode, b)
    tb: int | None = None  # the target's micro-batch size, when the translation fixes it
    if cand.mode == "per_microbatch" and smode == "per_sample":
        tb = 1
        acc.settings.append(_microbatch_setting(cand, 1))
    elif cand.mode == "per_microbatch" and smode == "per_microbatch":
        tb = b
        acc.settings.append(_microbatch_setting(cand, b))
        acc.conditions.append(
            "the same micro-batch size and the same assignment of rows to microbatches as the "
            "source (per_microbatch depends on b)"
        )
    tmode = _eff_mode(cand.mode, tb)
    if smode == tmode:
        if smode == "sample_sum_norm":
            acc.conditions.append(f"the same fixed length L{f' = {src.fixed_length}' if src.fixed_length else ''}")
    elif smode == "per_microbatch" and tmode == "per_sample" and b is None:
        acc.penalty += 100
        acc.warnings.append(
            f"the source averages microbatch means (per_microbatch); {cand.framework}'s {tmode} "
            "equals it only when the source micro-batch size is 1: give --microbatch-size"
        )
    else:
        acc.penalty += 100
        what = f"per_microbatch with b={b}" if smode == "per_microbatch" and b else smode
        gap = (
            " (the difference is the estimator gap Cov(n,l)/mean(n); measure it with `lossparity gap`)"
            if {smode, tmode} == {"per_token", "per_sample"}
            else ""
        )
        acc.warnings.append(
            f"LM objective: the source optimizes {what}, no setting of {cand.framework} gives it "
            f"(closest: {cand.name}, {tmode}){gap}"
        )
    if src.normalization != cand.normalization:
        acc.settings.append(f"(mechanism: {cand.normalization} instead of {src.normalization}; same objective)")
    return smode, tmode, tb


def _assess_mtp(src: Preset, cand: Preset, smode: str, tmode: str, acc: _Assessment) -> None:
    """The MTP objective convention and the per-depth MTP log."""
    if src.has_mtp != cand.has_mtp:
        acc.penalty += 1
        acc.conditions.append(f"no MTP: {cand.framework if src.has_mtp else src.name} has none")
        return
    if not src.has_mtp:
        return
    if _eff_conv(src.mtp_convention, smode) != _eff_conv(cand.mtp_convention, tmode):
        acc.penalty += 10
        acc.warnings.append(
            f"MTP objective: source convention {src.mtp_convention}, target {cand.mtp_convention} "
            "(exact only without MTP)"
        )
    if "mtp_loss" not in src.log_names:
        return
    if "mtp_loss" not in cand.log_names:
        acc.conditions.append(f"MTP logs are not compared: {cand.framework} logs no per-depth MTP loss")
    elif src.mtp_log_estimator != cand.mtp_log_estimator:
        acc.penalty += 10
        acc.warnings.append(
            f"MTP log: source estimator {src.mtp_log_estimator} ({src.log_names['mtp_loss']}), "
            f"target {cand.mtp_log_estimator} ({cand.log_names['mtp_loss']}): the per-depth MTP "
            "curves differ"
        )
    else:
        acc.logs.append(f"{src.log_names['mtp_loss']} <-> {cand.log_names['mtp_loss']}")


def _assess_logs(src: Preset, cand: Preset, smode: str, tmode: str, acc: _Assessment) -> None:
    """Which logged LM loss / objective of the two frameworks correspond."""
    if "lm_loss" in src.log_names:
        if "lm_loss" in cand.log_names:
            acc.logs.append(f"{src.log_names['lm_loss']} <-> {cand.log_names['lm_loss']} (global token mean S/Ntok)")
        elif tmode == "per_token" and "objective" in cand.log_names:
            acc.logs.append(
                f"{src.log_names['lm_loss']} <-> {cand.log_names['objective']} (the target's objective "
                "is the token mean; equal without MTP and aux terms)"
            )
            acc.conditions.append(
                f"no MTP or aux term in the compared curve: {cand.framework}'s logged loss includes them"
            )
        else:
            acc.penalty += 5
            acc.conditions.append(
                f"the source's {src.log_names['lm_loss']} (global token mean) has no counterpart: "
                f"{cand.framework} logs only its objective ({tmode})"
            )
    if "objective" in src.log_names and "objective" in cand.log_names and smode == tmode:
        acc.logs.append(f"{src.log_names['objective']} <-> {cand.log_names['objective']} (objective {tmode})")


def _assess_moe(src: Preset, cand: Preset, b: int | None, tb: int | None, acc: _Assessment) -> None:
    """The MoE load-balancing scope, the router z-loss form and Megatron's quirks."""
    ss, ts = _eff_scope(src.aux_scope, b), _eff_scope(cand.aux_scope, tb)
    if src.aux_scope == "none":
        if cand.aux_scope != "none":
            acc.settings.append(f"load-balancing loss off in {cand.framework} (coefficient 0)")
    elif cand.aux_scope == "none":
        acc.penalty += 3
        acc.conditions.append(f"no load-balancing loss in the source (coefficient 0): {cand.framework} has none")
    elif ss != ts:
        acc.penalty += 5
        acc.conditions.append(f"no load-balancing loss (coefficient 0): source scope {ss}, target {ts}")
    else:
        acc.conditions.append(f"load-balancing coefficient mapped: source {src.aux_note}; target {cand.aux_note}")
    if src.has_router_z_loss and not cand.has_router_z_loss:
        acc.penalty += 1
        acc.conditions.append(f"no router z-loss in the source: {cand.framework} has none")
    elif src.has_router_z_loss and src.z_form != cand.z_form:
        acc.penalty += 3
        acc.conditions.append(f"no router z-loss: source z form {src.z_form}, target {cand.z_form}")
    if src.megatron_quirks and not cand.megatron_quirks:
        acc.penalty += 1
        acc.conditions.append(_QUIRKS)


def _assess(src: Preset, cand: Preset, b: int | None) -> tuple[int, Translation]:
    """Rank one candidate preset as a translation of ``src`` (micro-batch size ``b``): ``(penalty, translation)``.

    Penalties: a different LM objective 100, a different MTP convention or MTP log estimator 10, an LM-loss
    log without counterpart 5, load-balancing scopes or z forms that differ 5/3, a missing feature 1; among
    equals, fewer conditions win (one point per ten), never over a real difference.
    """
    acc = _Assessment(
        settings=list(cand.settings),
        conditions=[f"source: {r}" for r in src.requires] + [f"target: {r}" for r in cand.requires],
    )
    smode, tmode, tb = _assess_mode(src, cand, b, acc)
    _assess_mtp(src, cand, smode, tmode, acc)
    _assess_logs(src, cand, smode, tmode, acc)
    _assess_moe(src, cand, b, tb, acc)
    penalty = acc.penalty + len(acc.conditions) // 10
    return penalty, Translation(
        source=src,
        target_framework="",
        microbatch_size=b,
        target=cand,
        settings=acc.settings,
        logs=acc.logs,
        conditions=acc.conditions,
        warnings=acc.warnings,
    )


def translate(source: Preset, target_framework: str, microbatch_size: int | None = None) -> Translation:
    """Find the settings of ``target_framework`` that reproduce ``source``'s objective and logs.

    ``target_framework`` is one of :data:`FRAMEWORKS` (every preset of that framework is a candidate and
    the closest is chosen) or a preset spec (only that preset). ``microbatch_size`` is the source's ``b``:
    it decides whether a ``per_microbatch`` source is ``per_sample`` (``b = 1``). The result's ``exact``
    is false, with warnings, when the target cannot reproduce the source (a different LM objective, MTP
    convention or MTP log estimator); optional terms the target handles differently become conditions.
    """
    if not isinstance(source, Preset):
        raise ValueError(f"source must be a Preset (use resolve_preset), got {type(source).__name__}")
    if microbatch_size is not None and microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    cands = _candidates(target_framework, source)
    best = min((_assess(source, c, microbatch_size) for c in cands), key=lambda x: x[0])[1]
    best.target_framework = target_framework.strip()
    return best
