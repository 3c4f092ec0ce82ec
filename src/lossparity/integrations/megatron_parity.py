"""Megatron-LM: compare each logged iteration with a reference log from the training loop.

Call :func:`parity_check` where Megatron's ``training_log`` gets the iteration's ``loss_dict`` (the losses
reduced over the microbatches and data-parallel ranks: with :class:`~lossparity.integrations.megatron.LossFunc`
``{"lm loss": S/Ntok, "objective": J}``; with ``pretrain_gpt``'s own loss ``{"lm loss": ...}``)::

    guard = ParityGuard("golden_values.json", write_report=torch.distributed.get_rank() == 0)
    ...
    if parity_check(guard, iteration, loss_dict, grad_norm=grad_norm, learning_rate=learning_rate):
        save_checkpoint(...)   # the ordinary checkpoint of this iteration, then leave the loop
        break

The names are Megatron's (``lm loss``, ``grad norm``, ``learning rate``), so they pair with a Megatron
reference log, golden values, or any other log ``lossparity compare`` reads. Multi-rank: without pipeline
parallelism every rank holds the same reduced ``loss_dict`` and the same ``grad_norm``, so every rank returns
the same answer at the same iteration; under pipeline parallelism only the last stage holds the losses, and
the caller shares the flag as Megatron shares its own exit conditions (``exit_duration_in_mins``: one
``all_reduce(MAX)`` of a one-element tensor over the world).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["parity_check"]


def _value(v: Any) -> float | None:
    """A logged value as a float: a number or a one-element tensor (read once per logged iteration)."""
    if v is None:
        return None
    if hasattr(v, "numel"):
        if v.numel() != 1:
            return None  # Megatron's [sum, count] pairs are reduced before logging; anything else is not a scalar
        return float(v.detach().float().cpu().item())
    return float(v)


def parity_check(
    guard: Any,
    iteration: int,
    loss_dict: Mapping[str, Any],
    *,
    grad_norm: float | None = None,
    learning_rate: float | None = None,
) -> bool:
    """Compare iteration ``iteration``'s reduced ``loss_dict`` (and ``grad_norm``, ``learning_rate`` when
    given) with ``guard``'s reference; return True when the loop must stop (``guard.update(...).stop``).
    Raises ``ValueError`` naming ``loss_dict[name]`` for a value that is not a scalar."""
    values: dict[str, float] = {}
    for name, v in loss_dict.items():
        number = _value(v)
        if number is None and v is not None:
            raise ValueError(f"loss_dict[{name!r}] at iteration {iteration}: expected a scalar, got {v!r}")
        if number is not None:
            values[name] = number
    for name, v in (("grad norm", grad_norm), ("learning rate", learning_rate)):
        if v is not None:
            values[name] = float(v)
    return bool(guard.update(iteration, values).stop)
