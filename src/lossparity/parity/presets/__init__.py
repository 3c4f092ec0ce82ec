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
    verl:<loss_agg_mode>[,loss_scale_factor=L]    verl >= 0.8 engine workers (also spelled
         verl-<loss_agg_mode>); loss_agg_mode: token-mean, seq-mean-token-mean, seq-mean-token-sum,
         seq-mean-token-sum-norm, token-sum (0.9); use_legacy_worker_impl=enable: the legacy workers
    verl<0.8:<loss_agg_mode>[,loss_scale_factor=L]   verl's legacy per-micro-batch workers (<= 0.7.1)
    trl-grpo:<loss_type>[,max_completion_length=L]    TRL 1.16 GRPOTrainer: grpo, sapo, bnpo, dr_grpo,
         dapo, cispo, vespo, luspo
    openrlhf:<loss_agg_mode>                   OpenRLHF 0.11.2: token-mean, seq-mean-token-mean
    lossparity[:mode=...,normalization=...,mtp_convention=...,mtp_log_estimator=...,aux_scope=...,
               z_form=...,fixed_length=L]     the exact, layout-invariant defaults (and overrides)

:func:`translate` answers "which settings of framework T reproduce the objective and the logs of
preset S?", with the conditions of an exact translation and warnings where none exists.

The package: :mod:`.spec` (the :class:`Preset` record and the parsing of spec options),
:mod:`.registry` (one builder per framework; the RL ones in :mod:`.rl`, :func:`resolve_preset`, :func:`all_presets`,
:func:`preset_table`) and :mod:`.translation` (:func:`translate`). Import from here.
"""

from .registry import all_presets, preset_table, resolve_preset
from .spec import FRAMEWORKS, PRESET_NAMES, Preset
from .translation import Translation, translate

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
