"""A guard for custom verl losses (verl >= 0.8, docs/rl.md): verl's ``agg_loss`` is exact only when it is given the
step's global counts (``config.global_batch_info``: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``); a
custom policy loss that calls it without them silently aggregates each micro-batch alone (with one data-parallel
rank verl does not complain), which is the legacy per-micro-batch objective. Imports nothing of verl."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["VERL_COUNT_KEYS", "check_global_batch_info"]

# loss_agg_mode -> the global count its exact aggregation needs (core_algos.agg_loss, verl 0.9.1)
VERL_COUNT_KEYS: dict[str, str | None] = {
    "token-mean": "batch_num_tokens",
    "seq-mean-token-mean": "global_batch_size",
    "seq-mean-token-sum": "global_batch_size",
    "seq-mean-token-sum-norm": "global_batch_size",
    "token-sum": None,  # S: no count (dp_size undoes the ranks' mean)
}


def check_global_batch_info(
    global_batch_info: Mapping[str, object] | None, loss_agg_mode: str, num_micro_batches: int
) -> None:
    """Raise ``ValueError`` when a step of ``num_micro_batches > 1`` micro-batches (per rank) would aggregate
    ``loss_agg_mode`` without the global count it needs (``VERL_COUNT_KEYS``), or without ``dp_size``: each
    micro-batch would then be divided by its own count, ``J = (1/K) Σ_mb J_mb`` instead of ``J`` of the step
    (semantics §9). Call it in a custom loss before ``agg_loss(..., **global_batch_info)``."""
    if loss_agg_mode not in VERL_COUNT_KEYS:
        raise ValueError(f"loss_agg_mode: unknown {loss_agg_mode!r}; valid: {', '.join(VERL_COUNT_KEYS)}")
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")
    if num_micro_batches == 1:
        return
    info = dict(global_batch_info or {})
    need = [k for k in ("dp_size", VERL_COUNT_KEYS[loss_agg_mode]) if k is not None and info.get(k) is None]
    if need:
        raise ValueError(
            f"global_batch_info lacks {', '.join(need)} for loss_agg_mode {loss_agg_mode!r} with {num_micro_batches} "
            "micro-batches: agg_loss would normalize each micro-batch by its own count (the legacy per-micro-batch "
            "objective); pass agg_loss(..., **config.global_batch_info) as verl's ppo_loss does"
        )
