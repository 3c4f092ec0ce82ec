"""MoE load-balancing terms in MindSpore (docs/semantics.md §5), as ``lossparity.losses.moe`` /
``lossparity.losses.aux_scopes`` compute them: the Switch term and the ``global_running`` scope (Megatron's
and MindFormers' ``global_aux_loss``)."""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops

from .stats import _check_tensor

__all__ = ["switch_load_balancing_loss", "GlobalRunningCounts", "global_running_load_balancing_loss"]


def _check_ints(topk: int, num_experts: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be an int in 1..num_experts={num_experts}, got {topk!r}")


def switch_load_balancing_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total_num_tokens: Tensor | float,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """``A = coeff · E/(k·T²) · Σ_e c_e · Σ_x p[x,e]`` (float32 scalar): ``probs`` ``[tokens, E]`` the local
    router scores, ``tokens_per_expert`` ``[E]`` the counts ``c`` and ``total_num_tokens`` ``T`` at the
    scope's level (reduced over ranks by the caller). Gradient only through ``probs`` (counts are
    constants), as in Megatron's and MindFormers' ``switch_load_balancing_loss_func``."""
    _check_ints(topk, num_experts)
    _check_tensor("probs", probs, (2,))
    if int(probs.shape[-1]) != num_experts:
        raise ValueError(f"probs has {probs.shape[-1]} experts (shape {tuple(probs.shape)}), num_experts={num_experts}")
    c = ops.stop_gradient(_check_tensor("tokens_per_expert", tokens_per_expert, (1,)).astype(ms.float32))
    if int(c.shape[0]) != num_experts:
        raise ValueError(f"tokens_per_expert must have shape ({num_experts},), got {tuple(c.shape)}")
    t = (
        ops.stop_gradient(total_num_tokens.astype(ms.float32))
        if isinstance(total_num_tokens, Tensor)
        else total_num_tokens
    )
    p = probs.astype(ms.float32).sum(0)
    return (p * c).sum() * (num_experts * coeff) / (topk * t * t)


class GlobalRunningCounts:
    """The ``global_running`` scope's state within a step: ``Σ_{m'≤m} c^{(m')}`` and ``m``. :meth:`reset` at
    the start of every step, on every pipeline stage (Megatron's rule; MindFormers 2.0.0 resets only on
    logging steps on the last stage, defect 2 of docs/mindformers.md)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.microbatches = 0

    def update(self, tokens_per_expert: Tensor) -> Tensor:
        """Add microbatch ``m``'s counts (already summed over the data-parallel ranks) and return the running
        mean ``c̄^{(m)} = (1/m) Σ_{m'≤m} c^{(m')}`` (float32)."""
        c = ops.stop_gradient(_check_tensor("tokens_per_expert", tokens_per_expert).astype(ms.float32))
        if self.total is not None and tuple(self.total.shape) != tuple(c.shape):
            raise ValueError(
                f"tokens_per_expert shape {tuple(c.shape)} differs from the step's {tuple(self.total.shape)}"
            )
        self.total = c if self.total is None else self.total + c
        self.microbatches += 1
        return self.total / self.microbatches

    def reset(self) -> None:
        """Start a new step."""
        self.total, self.microbatches = None, 0


def global_running_load_balancing_loss(
    probs: Tensor,
    tokens_per_expert: Tensor,
    total_num_tokens: Tensor | float,
    state: GlobalRunningCounts,
    *,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """The ``global_running`` term of microbatch ``m``: ``A_m = coeff·E/(k·T_m²)·Σ_e c̄_e^{(m)}·Σ_x p[x,e]``
    with ``c̄^{(m)}`` the running mean of the DP-summed counts (this call updates ``state``) and ``T_m`` this
    microbatch's DP-summed token count; ``probs`` are this rank's scores. The step's term is
    ``(1/K) Σ_m A_m``. Same argument order as the torch ``global_running_load_balancing_loss``."""
    if not isinstance(state, GlobalRunningCounts):
        raise TypeError(f"state must be a GlobalRunningCounts, got {type(state).__name__}")
    avg = state.update(tokens_per_expert)
    return switch_load_balancing_loss(probs, avg, total_num_tokens, topk, num_experts, coeff)
