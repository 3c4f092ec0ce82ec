"""The LM head of a Hugging Face causal LM, for a loss computed without its logits tensor.

:class:`~lossparity.integrations.hf.LossParityMixin` computes the per-token cross-entropy with
:func:`~lossparity.losses.fused_cross_entropy.fused_linear_cross_entropy` from the head's input ``h [b, S, H]``
and its weight ``W [V, H]`` (tied to the input embedding or not) instead of ``logits = h @ Wᵀ``. This module
decides whether a model allows it (:func:`plan_head`) and captures ``h`` during the model's own forward
(:class:`HeadCapture`).

Why capture the head's input (a forward pre-hook on ``model.get_output_embeddings()``) rather than pass
``logits_to_keep``: the pre-hook sees exactly what the head multiplies, including what a model does to the
final hidden state before its head (MiniCPM3 divides it by ``logits_scaling``; ``logits_to_keep`` would
leave that to be re-derived per family), it needs no forward argument that some models lack, and it
returns an empty sequence slice ``h[:, :0]`` to the head, so the model computes logits of shape
``[b, 0, V]``: no ``b·S·V`` work and no logits memory. The forward still runs through the wrapper the
Trainer uses (DDP, accelerate), so its gradient hooks see every parameter; the head's weight receives its
gradient from the fused loss. The hooks are registered for the one forward and removed afterwards.

Models whose logits are transformed after the head (:func:`plan_head`):

- a constant scale (``cohere*``: ``logits · logit_scale``; ``granite*``: ``logits / logits_scaling``) is
  applied to ``h`` inside the fused path (``(c·h) @ Wᵀ = c·(h @ Wᵀ)``, gradients included);
- final logit soft-capping (``final_logit_softcapping``, e.g. gemma2/gemma3), a head bias, a head that is
  not a plain ``nn.Linear`` (a custom or adapter head), or sharded weights (FSDP, DeepSpeed ZeRO-3, tensor
  parallel) fall back to the logits path with one printed note naming the model type and the reason.

A transform this module does not know is caught at the first forward: the model's ``logits`` output must
be the head's output itself (the same tensor object, seen by a forward hook on the model inside any
wrapper); otherwise the fused path raises ``ValueError`` before any optimizer step, naming the model type
(pass ``fused_loss=False``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = ["HeadPlan", "HeadCapture", "HeadPlanner", "plan_head"]

# Model types whose causal-LM forward multiplies (cohere family) or divides (granite family) the head's
# output by a constant read from the config: transformers' modeling files, `logits = self.lm_head(...)`
# followed by `logits * self.logit_scale` / `logits / self.config.logits_scaling`.
_MULTIPLY_BY = {"cohere": "logit_scale", "cohere2": "logit_scale", "cohere2_moe": "logit_scale"}
_DIVIDE_BY = {
    k: "logits_scaling"
    for k in ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared")
}


@dataclass(frozen=True)
class HeadPlan:
    """How the loss of a model is computed: ``fused`` (from the head's input, scaled by ``scale``) or, when
    ``reason`` is set, from the logits. ``model_type`` is the config's, for the note."""

    fused: bool
    model_type: str
    scale: float = 1.0
    reason: str | None = None
    scale_source: str | None = None  # the config field a scaled head reads, for the docs and the tests

    def note(self) -> str:
        """The one printed line of a fallback."""
        return (
            f"lossparity: model_type {self.model_type!r}: {self.reason}; the loss is computed from the "
            "logits (the fused cross-entropy needs logits = hidden @ weight.T, up to a constant scale)"
        )


def _fallback(model_type: str, reason: str) -> HeadPlan:
    return HeadPlan(False, model_type, reason=reason)


def plan_head(model: nn.Module, *, sharded: bool = False) -> HeadPlan:
    """Whether the loss of ``model`` (an unwrapped HF causal LM) can be computed from its head's input.

    Fused when ``model.get_output_embeddings()`` is a plain ``nn.Linear`` without bias, its weight a plain
    tensor, no final logit soft-capping is configured, and the forward applies at most a known constant
    scale ``c`` to the head's output (then ``logits = c · h @ Wᵀ``, ``scale = c``). ``sharded``: the
    Trainer shards the parameters (FSDP, DeepSpeed ZeRO-3), so the weight is not whole outside the forward.
    """
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", None) or type(model).__name__)
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        return _fallback(model_type, "the model has no output embeddings (get_output_embeddings() is None)")
    if type(head) is not nn.Linear:
        return _fallback(model_type, f"its LM head is a {type(head).__name__}, not a plain torch.nn.Linear")
    if head.bias is not None:
        return _fallback(model_type, "its LM head has a bias")
    if sharded or hasattr(head.weight, "to_local") or hasattr(head.weight, "ds_id"):
        return _fallback(model_type, "its LM head weight is sharded (FSDP, DeepSpeed ZeRO-3 or tensor parallel)")
    cap = getattr(config, "final_logit_softcapping", None)
    text = getattr(config, "get_text_config", lambda: config)()
    cap = cap if cap is not None else getattr(text, "final_logit_softcapping", None)
    if cap is not None:
        return _fallback(model_type, f"its logits are soft-capped after the head (final_logit_softcapping={cap})")
    if model_type in _MULTIPLY_BY:
        field = _MULTIPLY_BY[model_type]
        return HeadPlan(True, model_type, scale=float(getattr(config, field)), scale_source=field)
    if model_type in _DIVIDE_BY:
        field = _DIVIDE_BY[model_type]
        return HeadPlan(True, model_type, scale=1.0 / float(getattr(config, field)), scale_source=field)
    return HeadPlan(True, model_type)


class HeadCapture:
    """Context manager for one forward of ``model``: the head's input is kept in :attr:`hidden` and the
    head itself receives ``hidden[..., :0, :]`` (no logits are computed); :attr:`output` is what the head
    returned (an empty ``[b, 0, V]`` tensor) and :attr:`calls` how often it ran; :attr:`logits` is the
    ``logits`` of ``model``'s own output, seen by a hook before any wrapper (DDP may clone its outputs)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.head: nn.Linear = model.get_output_embeddings()  # type: ignore[operator]  # plan_head checked it
        self.hidden: Tensor | None = None
        self.output: Tensor | None = None
        self.logits: Any = None
        self.calls = 0
        self._handles: list[Any] = []

    def _pre(self, module: nn.Module, args: tuple) -> tuple | None:
        self.calls += 1
        if self.calls > 1 or not args or not isinstance(args[0], Tensor) or args[0].dim() < 2:
            return None  # checked after the forward (check); later calls run unchanged
        self.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.calls == 1:
            self.output = output

    def _model_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)

    def __enter__(self) -> HeadCapture:
        self._handles = [
            self.head.register_forward_pre_hook(self._pre),
            self.head.register_forward_hook(self._post),
            self.model.register_forward_hook(self._model_post),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def check(self, model_type: str, scaled: bool) -> Tensor | None:
        """The captured ``[b, S, H]`` head input, after checking that the head ran once on the whole
        sequence and (unscaled heads) that the model's ``logits`` output is the head's output itself;
        None when the head did not run (the forward called was not this model's: its logits are whole)."""
        if self.calls == 0:
            return None
        if self.calls != 1 or self.hidden is None:
            raise ValueError(
                f"model: model_type {model_type!r} ran its LM head {self.calls} times in one forward (expected "
                "once, on the final hidden states); pass fused_loss=False to compute the loss from the logits"
            )
        if not scaled and self.logits is not self.output:
            raise ValueError(
                f"model: model_type {model_type!r} transforms the LM head's output before returning it as logits "
                "(an unknown soft-capping or scaling); pass fused_loss=False to compute the loss from the logits"
            )
        return self.hidden


class HeadPlanner:
    """The head-plan methods of :class:`~lossparity.integrations.hf.LossParityMixin` (its base class); its
    ``__init__`` sets ``lp_fused_loss`` and ``_lp_head``."""

    model: Any
    lp_fused_loss: bool
    _lp_head: HeadPlan | None

    def _lp_head_plan(self) -> HeadPlan:
        """The loss path of this trainer's model, decided once (hf_head.plan_head); a fallback prints its note."""
        if self._lp_head is None:
            model = self.model
            if not self.lp_fused_loss:
                kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
                self._lp_head = HeadPlan(False, str(kind))
            else:
                self._lp_head = plan_head(model, sharded=self._lp_sharded())
                if self._lp_head.reason is not None and getattr(self, "is_world_process_zero", lambda: True)():
                    print(self._lp_head.note(), flush=True)
        return self._lp_head

    def _lp_sharded(self) -> bool:
        """Whether the Trainer shards the parameters (FSDP, DeepSpeed ZeRO-3): the head weight is then not
        whole outside the model's forward."""
        if getattr(self, "is_fsdp_enabled", False):
            return True
        if getattr(self, "is_deepspeed_enabled", False):
            from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

            return bool(is_deepspeed_zero3_enabled())
        return False
