"""The RL post-training presets (semantics §8, §9): TRL's ``GRPOTrainer`` per ``loss_type``, verl's engine
workers (>= 0.8) and legacy workers (< 0.8) per ``loss_agg_mode``, and OpenRLHF per ``loss_agg_mode``.

Each preset states the mode of every term (policy surrogate, KL, entropy bonus), the conventions of §9
(empty rows, per-sequence epsilon, fixed length, count scope) and the framework's log names, with the
release and the code it was read from. Built by :func:`resolve_preset` (``registry``)."""

from __future__ import annotations

from ...options import Mode
from .spec import Preset, _check_options, _choice, _positive

__all__ = ["TRL_LOSS_TYPES", "VERL_MODES", "VERL_LEGACY_MODES", "OPENRLHF_MODES", "trl_grpo", "verl", "verl_legacy"]

# TRL 1.16.0 GRPOConfig.loss_type -> the mode of the policy term (trl/trainer/grpo_trainer.py, _compute_loss)
TRL_LOSS_TYPES: dict[str, Mode] = {
    "grpo": "per_sample",
    "sapo": "per_sample",
    "bnpo": "per_microbatch",
    "dr_grpo": "sample_sum_norm",
    "dapo": "per_token",
    "cispo": "per_token",
    "vespo": "per_token",
    "luspo": "sample_sum",
}
# verl >= 0.8 (engine workers) actor.loss_agg_mode -> mode (verl/trainer/ppo/core_algos.py agg_loss)
VERL_MODES: dict[str, Mode] = {
    "token-mean": "per_token",
    "seq-mean-token-mean": "per_sample",
    "seq-mean-token-sum": "sample_sum",
    "seq-mean-token-sum-norm": "sample_sum_norm",
    "token-sum": "token_sum",
}
# verl <= 0.7.x legacy workers (workers/actor/dp_actor.py): each micro-batch aggregated on its own
VERL_LEGACY_MODES: dict[str, Mode] = {
    "token-mean": "per_microbatch",
    "seq-mean-token-mean": "per_sample",
    "seq-mean-token-sum": "sample_sum",
    "seq-mean-token-sum-norm": "sample_sum_norm",
}
# OpenRLHF 0.11.2 --actor.loss_agg_mode -> mode (openrlhf/models/loss.py aggregate_loss)
OPENRLHF_MODES: dict[str, Mode] = {"token-mean": "per_token", "seq-mean-token-mean": "per_sample"}

_TRL_CODE = "TRL 1.16.0, trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss"
_VERL_CODE = "verl 0.9.1, verl/trainer/ppo/core_algos.py agg_loss and verl/workers/utils/losses.py ppo_loss"
_VERL_LEGACY_CODE = "verl 0.7.1, verl/workers/actor/dp_actor.py update_policy and core_algos.py agg_loss"
_OPENRLHF_CODE = "OpenRLHF 0.11.2, openrlhf/models/loss.py aggregate_loss and openrlhf/utils/loss_utils.py"


def _one_positional(spec: str, name: str, positional: list[str], valid: tuple[str, ...], key: str | None) -> str:
    if len(positional) != 1:
        raise ValueError(
            f"preset {spec!r}: {name} needs a {key or 'mode'} (one), e.g. {name}:{valid[0]}; valid: {', '.join(valid)}"
        )
    return str(_choice(positional[0], key or "mode", valid))


def _rl_preset(name: str, framework: str, mode: Mode, **kw: object) -> Preset:
    return Preset(
        name=name,
        framework=framework,
        mode=mode,
        normalization="precount",
        mtp_convention="own",
        mtp_log_estimator="token_mean",
        aux_scope="none",
        z_form="global",
        has_mtp=False,
        has_router_z_loss=False,
        **kw,  # type: ignore[arg-type]
    )


def trl_grpo(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    """``trl-grpo:<loss_type>[,max_completion_length=L]``: TRL 1.16.0 ``GRPOTrainer``."""
    _check_options(spec, "trl-grpo", options, ("max_completion_length",))
    lt = _one_positional(spec, "trl-grpo", positional, tuple(TRL_LOSS_TYPES), "loss_type")
    mode = TRL_LOSS_TYPES[lt]
    L = None
    if lt == "dr_grpo":
        # 512: GRPOConfig's default max_completion_length
        L = _positive(options.get("max_completion_length", "512"), "max_completion_length")
    elif "max_completion_length" in options:
        raise ValueError(f"preset {spec!r}: max_completion_length only sets the L of dr_grpo")
    policy = {
        "grpo": "each row's token mean, averaged over the micro-batch's rows, / gradient_accumulation_steps, "
        "DDP mean over processes: per_sample (every micro-batch holds the same number of rows)",
        "sapo": "as grpo (soft gate instead of the clip): per_sample",
        "bnpo": "each micro-batch's token mean / gradient_accumulation_steps, DDP mean: per_microbatch",
        "dr_grpo": "Σ over the micro-batch / (rows · max_completion_length) / gradient_accumulation_steps, DDP "
        "mean: sample_sum_norm with L = max_completion_length",
        "dapo": "Σ over the micro-batch / (num_items_in_batch / processes · gradient_accumulation_steps / "
        "steps_per_generation), num_items_in_batch = the generation batch's tokens over all processes: per_token "
        "when steps_per_generation = gradient_accumulation_steps; with steps_per_generation = k · "
        "gradient_accumulation_steps a step divides its sum by the generation batch's mean step count, not its "
        "own (count_scope generation, times k)",
        "luspo": "each row's token sum, averaged over the micro-batch's rows, / gradient_accumulation_steps: "
        "sample_sum",
    }
    policy["cispo"] = policy["vespo"] = policy["dapo"]
    notes = [
        f"verified ({_TRL_CODE}): {policy[lt]}.",
        "verified: with beta != 0 the KL term beta · k3(ref, policy) is added to the per-token loss before the "
        "aggregation, so it has the policy term's mode.",
        "verified: the entropy bonus (entropy_coef != 0) is each micro-batch's token mean of the entropy / "
        "gradient_accumulation_steps for every loss_type: per_microbatch, whatever the policy mode.",
        "verified: empty completions count in the row count of grpo/sapo/luspo/dr_grpo (clamp(min=1) on their "
        "own count); the aux loss of MoE models is the micro-batch's own, / gradient_accumulation_steps.",
        "verified: the logged policy_loss is the micro-batch's aggregated policy term before the division by "
        "gradient_accumulation_steps, averaged over the processes and the logging window (appended only when the "
        "entropy bonus is on); for dapo/cispo/vespo that value already holds the 1/GA and is J/GA; kl, entropy and "
        "clip_ratio/region_mean are global token means of each micro-batch, averaged over micro-batches.",
        "lossparity.rl.LossParityGRPOMixin makes any mode (per_token, per_sample, sample_sum_norm, per_group, ...) "
        "exact for the policy, KL and entropy terms at any GA, steps_per_generation and number of processes.",
    ]
    requires = ["use_adaptive_entropy=False"]
    if mode == "per_microbatch":
        requires.append("the same per_device_train_batch_size in both runs (per_microbatch)")
    if lt in ("dapo", "cispo", "vespo"):
        requires.append("steps_per_generation = gradient_accumulation_steps (else a step's count is the mean step's)")
    settings = [f"GRPOConfig(loss_type={lt!r})"] + ([f"max_completion_length={L}"] if L else [])
    return _rl_preset(
        f"trl-grpo:{lt}" + (f",max_completion_length={L}" if L and "max_completion_length" in options else ""),
        "trl",
        mode,
        fixed_length=L,
        description=f"TRL 1.16 GRPOTrainer loss_type={lt} (entropy bonus per micro-batch)",
        notes=notes,
        settings=settings,
        requires=requires,
        log_names={
            "objective": "loss",
            "policy": "policy_loss",
            "kl": "kl",
            "entropy": "entropy",
            "clip_fraction": "clip_ratio/region_mean",
        },
        terms={"policy": mode, "kl": mode, "entropy": "per_microbatch"},
    )


def verl(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    """``verl:<loss_agg_mode>[,loss_scale_factor=L]``: verl >= 0.8 engine workers (``use_legacy_worker_impl=
    enable`` selects the legacy workers, :func:`verl_legacy`)."""
    _check_options(spec, "verl", options, ("use_legacy_worker_impl", "loss_scale_factor", "loss_agg_mode"))
    impl = _choice(
        options.pop("use_legacy_worker_impl", "auto"), "use_legacy_worker_impl", ("auto", "enable", "disable")
    )
    if "loss_agg_mode" in options:
        agg = options.pop("loss_agg_mode")
        if positional and positional != [agg]:
            raise ValueError(f"preset {spec!r}: give one loss_agg_mode; valid: {', '.join(VERL_MODES)}")
        positional = [agg]
    if impl == "enable":
        return verl_legacy(spec, positional, options)
    agg = _one_positional(spec, "verl", positional, tuple(VERL_MODES), "loss_agg_mode")
    mode = VERL_MODES[agg]
    L = _positive(options["loss_scale_factor"], "loss_scale_factor") if "loss_scale_factor" in options else None
    if L is not None and agg != "seq-mean-token-sum-norm":
        raise ValueError(f"preset {spec!r}: loss_scale_factor only applies to seq-mean-token-sum-norm")
    notes = [
        f"verified ({_VERL_CODE}): every micro-batch is aggregated with the global counts of the mini-batch "
        "(batch_num_tokens all-reduced over the data-parallel group, global_batch_size = ppo_mini_batch_size · "
        "rollout.n, every row including empty ones) and multiplied by dp_size to undo the ranks' gradient mean: "
        "exact and layout-invariant.",
        "verified: token-mean = S/Ntok, seq-mean-token-mean = (1/N) Σ s_i/(n_i + 1e-8) (epsilon 1e-8, empty rows "
        "count in N), seq-mean-token-sum = (1/N) Σ s_i, seq-mean-token-sum-norm = S/(N·L) (L = loss_scale_factor, "
        "else the padded response length of the micro-batch), token-sum (verl 0.9.0) = S.",
        "verified: the entropy (actor/entropy_loss) and KL (actor/kl_loss) terms use agg_loss with the same mode "
        "and global counts; the logs are summed over micro-batches (metric aggregation SUM): each is its term's J.",
        "trainer.use_legacy_worker_impl is gone in 0.9; verl<0.8:<loss_agg_mode> describes the legacy workers.",
    ]
    requires = []
    if agg == "seq-mean-token-sum-norm" and L is None:
        requires.append("a fixed actor.loss_scale_factor (else L is each micro-batch's padded response length)")
    name = f"verl:{agg}" + (f",loss_scale_factor={L}" if L is not None else "")
    return _rl_preset(
        name,
        "verl",
        mode,
        fixed_length=L,
        grad_reduction="mean",
        epsilon=1e-8 if mode == "per_sample" else 0.0,
        description=f"verl >= 0.8 loss_agg_mode={agg} (engine workers, global counts)",
        notes=notes,
        settings=[f"actor_rollout_ref.actor.loss_agg_mode={agg}"]
        + ([f"actor_rollout_ref.actor.loss_scale_factor={L}"] if L is not None else []),
        requires=requires,
        log_names={
            "objective": "actor/pg_loss",
            "policy": "actor/pg_loss",
            "entropy": "actor/entropy_loss",
            "kl": "actor/kl_loss",
        },
        terms={"policy": mode, "kl": mode, "entropy": mode},
    )


def verl_legacy(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    """``verl<0.8:<loss_agg_mode>[,loss_scale_factor=L]``: verl's legacy per-micro-batch workers (<= 0.7.1)."""
    _check_options(spec, "verl<0.8", options, ("loss_scale_factor",))
    agg = _one_positional(spec, "verl<0.8", positional, tuple(VERL_LEGACY_MODES), "loss_agg_mode")
    mode = VERL_LEGACY_MODES[agg]
    L = _positive(options["loss_scale_factor"], "loss_scale_factor") if "loss_scale_factor" in options else None
    if L is not None and agg != "seq-mean-token-sum-norm":
        raise ValueError(f"preset {spec!r}: loss_scale_factor only applies to seq-mean-token-sum-norm")
    notes = [
        f"verified ({_VERL_LEGACY_CODE}): each micro-batch is aggregated alone (its own token count, or its own "
        "count of non-empty rows), scaled by 1/gradient_accumulation, and FSDP averages the ranks: the mean over "
        "the D·K micro-batches of the micro-batch's aggregate.",
        "verified: seq-mean-token-sum-norm is Σ_i s_i / (non-empty rows of the micro-batch) / L per micro-batch, "
        "i.e. exactly sample_sum_norm when every response is non-empty (it is not a sum without 1/N since 0.7.1).",
        "verified: the entropy and KL terms use the same per-micro-batch aggregation; actor/pg_loss and "
        "actor/kl_loss are the sums over micro-batches of the aggregate / gradient_accumulation (per rank).",
    ]
    requires = ["use_dynamic_bsz=False and a fixed ppo_micro_batch_size_per_gpu (equal micro-batches)"]
    if mode != "per_microbatch":
        requires.append(
            "every response has at least one loss token (the legacy aggregation drops empty responses from the "
            "micro-batch's row count)"
        )
    if agg == "seq-mean-token-sum-norm" and L is None:
        requires.append("a fixed actor.loss_scale_factor (else L is each micro-batch's padded response length)")
    return _rl_preset(
        f"verl<0.8:{agg}" + (f",loss_scale_factor={L}" if L is not None else ""),
        "verl",
        mode,
        fixed_length=L,
        grad_reduction="mean",
        epsilon=1e-8 if mode == "per_sample" else 0.0,
        empty_rows="drop" if mode != "per_microbatch" else "count",
        description=f"verl <= 0.7 loss_agg_mode={agg} (legacy workers: per micro-batch)",
        notes=notes,
        settings=[f"actor_rollout_ref.actor.loss_agg_mode={agg}", "trainer.use_legacy_worker_impl=auto (<= 0.7)"]
        + ([f"actor_rollout_ref.actor.loss_scale_factor={L}"] if L is not None else []),
        requires=requires,
        log_names={"policy": "actor/pg_loss", "entropy": "actor/entropy", "kl": "actor/kl_loss"},
        terms={"policy": mode, "kl": mode, "entropy": mode},
    )


def openrlhf(spec: str, positional: list[str], options: dict[str, str]) -> Preset:
    """``openrlhf:<loss_agg_mode>``: OpenRLHF 0.11.2 (``--actor.loss_agg_mode``)."""
    _check_options(spec, "openrlhf", options, ())
    agg = _one_positional(spec, "openrlhf", positional, tuple(OPENRLHF_MODES), "loss_agg_mode")
    mode = OPENRLHF_MODES[agg]
    notes = [
        f"verified ({_OPENRLHF_CODE}): the normalizers of an optimizer step are counted over its micro-batches "
        "and all-reduced over the data-parallel group before the first backward (iter_grad_accum_global_norm), "
        "then divided by gas to pre-compensate DeepSpeed's 1/gas, and the loss is multiplied by dp_size: exact "
        "gradients (since 0.10.4).",
        "verified: seq-mean-token-mean divides by the number of non-empty responses (empty rows dropped from N) "
        "and each row's mean is s_i/(n_i + 1e-8).",
        "verified: the KL (kl) and entropy (entropy_loss) terms are aggregated with the same mode and counts.",
        "verified: the logged policy_loss is each micro-batch's aggregate (which holds dp_size·gas) weighted by "
        "its tokens over the step (status reduction): not the objective when a rank runs more than one "
        "micro-batch per step.",
    ]
    return _rl_preset(
        f"openrlhf:{agg}",
        "openrlhf",
        mode,
        grad_reduction="mean",
        epsilon=1e-8 if mode == "per_sample" else 0.0,
        empty_rows="drop" if mode == "per_sample" else "count",
        description=f"OpenRLHF 0.11.2 --actor.loss_agg_mode {agg} (step-global counts)",
        notes=notes,
        settings=[f"--actor.loss_agg_mode {agg}"],
        requires=["micro-batches of one optimizer step fed in DeepSpeed's accumulation order (the default)"],
        log_names={"policy": "policy_loss", "kl": "kl", "entropy": "entropy_loss"},
        terms={"policy": mode, "kl": mode, "entropy": mode},
    )
