"""A drop-in for TRL's ``GRPOTrainer`` (TRL 1.16): the update is the exact lossparity objective (docs/semantics.md
§9) of the chosen mode for the policy, KL and entropy terms, at any gradient accumulation, ``steps_per_generation``
and number of processes::

    class Trainer(LossParityGRPOMixin, GRPOTrainer): ...
    trainer = Trainer(model=..., args=GRPOConfig(...), lossparity_mode="per_group", kl_mode="per_token")

How, without copying TRL's ``_compute_loss`` (it changes often): TRL's ``dr_grpo`` reduction is linear in the
per-token loss with the weight ``1 / (b · max_completion_length · GA)`` per token (the processes' gradients are
then averaged). The clipped surrogate ``-min(ρ·A, clip(ρ)·A)`` is homogeneous in the advantage ``A`` for a positive
factor, so multiplying each row's advantage by ``c_i = r_i · b · L · GA · P`` (``r_i`` the row weight of the chosen
mode, :mod:`lossparity.losses.rl_weights`, ``P`` processes) makes TRL's own loss the policy term's exact share.
The KL and entropy terms are taken out of TRL's loss (``beta`` and the entropy bonus are switched off around the
call) and added from the per-token log-probabilities and entropies TRL computed, each with its own mode.

The normalizers are pre-counted once per optimizer step (``count_scope="step"``) or per generation batch
(``"generation"``) from the buffered micro-batches' completion masks, in one all-reduce; the group ids
(``per_group``) are the prompt groups of the gathered generation batch (``num_generations`` consecutive rows).
Logged each optimizer step: ``objective``, ``lossparity/policy``, ``lossparity/kl``, ``lossparity/entropy``
(each term's exact value before its coefficient).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .accountant import RLAccountant, Term

__all__ = ["LossParityGRPOMixin"]

_GROUP_KEY = "lossparity_group_ids"


class LossParityGRPOMixin:
    """Mix in before ``trl.GRPOTrainer`` (module docstring).

    Keyword arguments (the rest go to ``GRPOTrainer``): ``lossparity_mode`` (the policy term's mode: per_token,
    per_sample, sample_sum, sample_sum_norm, token_sum, per_group, per_microbatch), ``kl_mode`` and
    ``entropy_mode`` (default: the policy's mode), ``count_scope`` (``"step"`` or ``"generation"``),
    ``epsilon`` and ``empty_rows`` (semantics §9), ``fixed_length`` (the ``L`` of sample_sum_norm; default
    ``max_completion_length``). The KL coefficient is ``args.beta``, the entropy term's ``-args.entropy_coef``.
    """

    def __init__(
        self,
        *args: Any,
        lossparity_mode: str = "per_token",
        kl_mode: str | None = None,
        entropy_mode: str | None = None,
        count_scope: str = "step",
        epsilon: float = 0.0,
        empty_rows: str = "count",
        fixed_length: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        t: Any = self
        if count_scope not in ("step", "generation"):
            raise ValueError(f"count_scope must be 'step' or 'generation', got {count_scope!r}")
        if t.use_adaptive_entropy:
            raise ValueError("LossParityGRPOMixin: use_adaptive_entropy is not supported (a fixed entropy_coef is)")
        if t.top_entropy_quantile < 1.0 or t.importance_sampling_level != "token":
            raise ValueError(
                "LossParityGRPOMixin: top_entropy_quantile < 1 and importance_sampling_level='sequence' are not "
                "supported (their masks and ratios are not row-homogeneous)"
            )
        if t.args.steps_per_generation % t.args.gradient_accumulation_steps:
            raise ValueError(
                "LossParityGRPOMixin: steps_per_generation must be a multiple of gradient_accumulation_steps"
            )
        if t.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(
                f"LossParityGRPOMixin: loss_type {t.loss_type!r} has another surrogate; use grpo, bnpo, dr_grpo or "
                "dapo (the clipped surrogate; lossparity_mode sets its normalization)"
            )
        t.loss_type = "dr_grpo"  # the reduction whose token weight is known: Σ / (b · L · GA)
        L = fixed_length if fixed_length is not None else float(t.max_completion_length)
        common = {"epsilon": epsilon, "empty_rows": empty_rows}
        terms = {
            "policy": Term(lossparity_mode, 1.0, fixed_length=L, **common),  # type: ignore[arg-type]
            "kl": Term(kl_mode or lossparity_mode, float(t.beta), fixed_length=L, **common),  # type: ignore[arg-type]
            "entropy": Term(
                entropy_mode or lossparity_mode,
                -float(t.entropy_coef),
                fixed_length=L,
                **common,  # type: ignore[arg-type]
            ),
        }
        self._lp_count_scope = count_scope
        self._lp_acc = RLAccountant(terms, grad_reduction="sum")
        self._lp_mb = 0  # index of the current micro-batch in the counted set

    # ------------------------------------------------------------------ generation: the prompt groups
    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        t: Any = self
        out: dict[str, Any] = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        rows = out["completion_ids"].shape[0]
        start = t.accelerator.process_index * rows  # the gathered generation batch is in process order
        ids = torch.arange(start, start + rows, device=out["completion_ids"].device) // t.num_generations
        out[_GROUP_KEY] = ids  # rides along TRL's shuffle and split of the generation batch
        return out

    # ------------------------------------------------------------------ the loss
    def _lp_begin(self) -> None:
        """At the first micro-batch of a step (or of a generation batch): count its micro-batches' rows."""
        t: Any = self
        spg, ga = t.args.steps_per_generation, t.current_gradient_accumulation_steps
        k = t._step % spg
        scope_start = 0 if self._lp_count_scope == "generation" else k - (t._step % ga)
        first = (k == 0) if self._lp_count_scope == "generation" else (t._step % ga == 0)
        if first:
            end = spg if self._lp_count_scope == "generation" else scope_start + ga
            batches = t._buffered_inputs[scope_start:end]
            masks = [_loss_mask(b) for b in batches]
            num_groups = int(t.args.generation_batch_size // t.num_generations)
            self._lp_acc.begin_step(masks, [b[_GROUP_KEY] for b in batches], num_groups=num_groups)
        self._lp_mb = k - scope_start

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Tensor:
        t: Any = self
        if not t.model.training:  # evaluation: TRL's own loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]
        self._lp_begin()
        acc, mb = self._lp_acc, self._lp_mb
        mask = _loss_mask(inputs)
        b = mask.shape[0]
        P = t.accelerator.num_processes
        r = acc.token_weights(mb, "policy").amax(dim=-1)  # the row weight r_i (0 for an empty row)
        scale = r * (b * float(t.max_completion_length) * t.current_gradient_accumulation_steps * P)
        adv = inputs["advantages"]
        scaled = dict(inputs)
        scaled["advantages"] = adv * scale.to(adv.dtype).view(-1, *([1] * (adv.dim() - 1)))
        captured: dict[str, Tensor] = {}
        original = t._get_per_token_logps_and_entropies

        def capture(*a: Any, **k: Any) -> Any:
            logps, ent, aux = original(*a, **k)
            captured["logps"], captured["entropy"] = logps, ent
            return logps, ent, aux

        beta, bonus = t.beta, t._entropy_bonus_enabled
        t._get_per_token_logps_and_entropies, t.beta, t._entropy_bonus_enabled = capture, 0.0, False
        try:
            policy_loss = super().compute_loss(model, scaled, return_outputs, num_items_in_batch)  # type: ignore[misc]
        finally:
            del t._get_per_token_logps_and_entropies
            t.beta, t._entropy_bonus_enabled = beta, bonus
        logps, ent = captured["logps"], captured["entropy"]
        kl = torch.zeros_like(logps)
        if beta != 0.0:
            d = inputs["ref_per_token_logps"] - logps
            kl = torch.exp(d) - d - 1  # TRL's k3 estimator of KL(π_θ ‖ π_ref)
        ent = ent if ent is not None else torch.zeros_like(logps)
        # policy_loss = P · (this micro-batch's part of J_policy): the processes' mean undoes the P
        old = inputs.get("old_per_token_logps")
        ratio = torch.exp(logps.detach() - (logps.detach() if old is None else old))
        a = adv.view(-1, 1) if adv.dim() == 1 else adv
        clipped = ((ratio < 1 - t.epsilon_low) & (a < 0)) | ((ratio > 1 + t.epsilon_high) & (a > 0))
        metrics = {"clip_fraction": clipped.to(torch.float64), "kl_mean": kl, "entropy_mean": ent}
        extra = acc.share(mb, {"kl": kl, "entropy": ent}, metrics=metrics)
        acc.record("policy", policy_loss.detach().to(torch.float64) / P)
        if t._step % t.current_gradient_accumulation_steps == t.current_gradient_accumulation_steps - 1:
            self._lp_log()
        return policy_loss + (extra * P).to(policy_loss.dtype)

    def _lp_log(self) -> None:
        t: Any = self
        logs = self._lp_acc.logs()
        metrics = t._metrics["train"]
        metrics["objective"].append(logs["objective"])
        for name in ("policy", "kl", "entropy", "clip_fraction", "kl_mean", "entropy_mean"):
            metrics[f"lossparity/{name}"].append(logs[name])


def _loss_mask(inputs: dict[str, Any]) -> Tensor:
    """TRL's loss mask of a micro-batch: the completion mask, times the tool mask when tools are used."""
    m = inputs["completion_mask"]
    return m * inputs["tool_mask"] if "tool_mask" in inputs else m
