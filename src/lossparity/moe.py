"""Public alias of :mod:`lossparity.losses.moe` (``lossparity.moe.switch_load_balancing_loss`` etc.)."""

from lossparity.losses.moe import (
    SCORE_FUNCTIONS,
    expert_bias_update,
    max_violation,
    router_probs,
    router_scores,
    router_z_loss,
    router_z_loss_sum,
    router_z_loss_sums,
    router_z_loss_sums_and_grad,
    sequence_load_balancing_loss,
    sequence_tokens_per_expert,
    switch_load_balancing_loss,
    switch_load_balancing_terms,
    switch_load_balancing_weights,
    tokens_per_expert,
    topk_routing_map,
)

__all__ = [
    "SCORE_FUNCTIONS",
    "expert_bias_update",
    "max_violation",
    "router_probs",
    "router_scores",
    "router_z_loss",
    "router_z_loss_sum",
    "router_z_loss_sums",
    "router_z_loss_sums_and_grad",
    "sequence_load_balancing_loss",
    "sequence_tokens_per_expert",
    "switch_load_balancing_loss",
    "switch_load_balancing_terms",
    "switch_load_balancing_weights",
    "tokens_per_expert",
    "topk_routing_map",
]
