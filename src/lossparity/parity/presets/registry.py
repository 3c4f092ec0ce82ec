"""The registry of presets: one builder per framework from a parsed spec, :func:`resolve_preset`,
:func:`all_presets` and :func:`preset_table`."""

from __future__ import annotations

from dataclasses import replace

from ...options import AUX_SCOPES, MODES, MTP_CONVENTIONS, MTP_LOG_ESTIMATORS, NORMALIZATIONS, Z_FORMS, Mode
from . import rl
from .spec import (
    _MEGATRON_LB,
    _VERL_MODES,
    PRESET_NAMES,
    Preset,
    _check_options,
    _choice,
    _no_positional,
    _parse_bool,
    _positive,
    _split_spec,
)

__all__ = ["all_presets", "preset_table", "resolve_preset"]

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


def _maxtext_lossparity(spec: str, options: dict[str, str], common_notes: list[str], aux_note: str) -> Preset:
    """``maxtext:lossparity=per_sample|per_document``: MaxText 0.2.5 run by ``python -m lossparity.maxtext``."""
    choice = options["lossparity"]
    if len(options) > 1 or choice not in ("per_sample", "per_document"):
        raise ValueError(f"preset {spec!r}: lossparity=per_sample or lossparity=per_document, and no other option")
    mode: Mode = "per_sample" if choice == "per_sample" else "per_document"
    return Preset(
        name=f"maxtext:lossparity={mode}",
        framework="maxtext",
        mode=mode,
        normalization="precount",
        mtp_convention="own",
        mtp_log_estimator="token_mean",
        aux_scope="sequence",
        z_form="global",
        grad_reduction="sum",
        has_router_z_loss=False,
        description=f"MaxText 0.2.5 under python -m lossparity.maxtext --lp-mode {mode}"
        + (" (= Megatron calculate_per_token_loss=False, micro-batch 1)" if mode == "per_sample" else ""),
        notes=[
            "tested (tests/maxtext, MaxText 0.2.5 on CPU): the objective of the mode at GA 1/2/4 and on the tunix GA "
            "path, equal to a float64 recomputation from MaxText's logits; learning/lm_loss and total_weights "
            "bit-identical to an unpatched run; MTP own convention (--lp-mtp-convention pooled for pooled).",
            "learning/loss is the objective at every GA (LM term + MTP + MaxText's MoE/indexer terms); "
            "learning/mtp_loss is the MTP term of the objective; lossparity/lm_objective the LM term alone.",
            *common_notes,
        ],
        settings=[f"python -m lossparity.maxtext ... --lp-mode {mode}", "num_vocab_tiling=1"],
        requires=["num_vocab_tiling=1", "no DPO, block diffusion, indexer warm-up or DiLoCo (refused)"],
        log_names={
            "lm_loss": "learning/lm_loss",
            "objective": "learning/loss",
            "mtp_loss": "learning/mtp_loss (the MTP term of the objective, × mtp_loss_scaling_factor)",
        },
        aux_note=aux_note,
    )


def _maxtext(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    _no_positional(spec, "maxtext", positional)
    _check_options(spec, "maxtext", options, ("calculate_per_token_loss", "mtp_per_layer_loss_norm", "lossparity"))
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
    if "lossparity" in options:
        return _maxtext_lossparity(spec, options, common_notes, aux_note)
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
    "verl": rl.verl,
    "verl<0.8": rl.verl_legacy,
    "trl-grpo": rl.trl_grpo,
    "openrlhf": rl.openrlhf,
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
    """One preset per documented spec (the rows of the table in docs/parity-tools.md)."""
    specs = [
        "megatron:calculate_per_token_loss=false",
        "megatron:calculate_per_token_loss=true",
        "maxtext",
        "maxtext:calculate_per_token_loss=true",
        "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=true",
        "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=false",
        "maxtext:lossparity=per_sample",
        "hf-trainer",
        "hf-trainer-legacy",
        "torchtitan",
        *(f"verl:{m}" for m in rl.VERL_MODES),
        *(f"verl<0.8:{m}" for m in rl.VERL_LEGACY_MODES),
        *(f"trl-grpo:{m}" for m in rl.TRL_LOSS_TYPES),
        *(f"openrlhf:{m}" for m in rl.OPENRLHF_MODES),
        "lossparity",
    ]
    return [resolve_preset(s) for s in specs]


def preset_table() -> str:
    """Markdown table of :func:`all_presets` for docs/parity-tools.md: preset, mode, normalization, MTP convention,
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
