"""Router conventions as pure functions: expert selection and gate weights (semantics §5).

The scores come from :func:`lossparity.losses.moe.router_scores` (``softmax``, ``sigmoid``, ``sqrtsoftplus``).
These functions reproduce the selection and the gate weights of Megatron-LM's
``topk_routing_with_score_function``, MindFormers' ``TopKRouter`` and DeepSeek's reference ``Gate``, whose
options map onto their arguments (docs/moe.md):

- ``expert_bias`` (aux-loss-free balancing): added to the scores for the selection only;
- ``num_groups``/``group_topk`` (Megatron ``moe_router_num_groups``/``moe_router_group_topk``, DeepSeek
  ``n_groups``/``topk_groups``): group-limited (device- or node-limited) routing, with ``group_score_topk``
  (how many of a group's best experts score it) and ``group_fill`` (what the dropped groups' experts get)
  for the frameworks that differ (docs/moe.md);
- ``normalize`` (HF and MindFormers ``norm_topk_prob``; Megatron: ``sigmoid``/``sqrtsoftplus`` with
  ``k > 1``, or ``softmax`` without ``moe_router_pre_softmax``; DeepSeek: every score function but softmax)
  and ``scaling_factor`` (Megatron/MindFormers ``moe_router_topk_scaling_factor``, DeepSeek ``route_scale``).

Public path: ``lossparity.moe``. Float math in the dtype of the scores; no host synchronization.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ._checks import check_float_tensor as _check_float_tensor

__all__ = ["AUX_COUNTS", "topk_routing", "aux_routing_map", "gate_weights"]

AuxCounts = Literal["topk", "dispatch"]
# What the auxiliary losses count: the plain top-k of the unbiased scores (semantics §5; Megatron, MindFormers
# pynative) or the experts the router dispatched to, bias and group limit included (MindFormers graph mode).
AUX_COUNTS: tuple[AuxCounts, ...] = ("topk", "dispatch")


def _check_groups(num_experts: int, topk: int, num_groups: int | None, group_topk: int | None) -> None:
    if (num_groups is None) != (group_topk is None):
        raise ValueError("num_groups and group_topk: give both (group-limited routing) or neither")
    if num_groups is None or group_topk is None:
        return
    for name, v in (("num_groups", num_groups), ("group_topk", group_topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the number of experts {num_experts}")
    if group_topk > num_groups:
        raise ValueError(f"group_topk={group_topk} must be <= num_groups={num_groups}")
    if topk > group_topk * (num_experts // num_groups):
        raise ValueError(
            f"topk={topk} exceeds the experts of the {group_topk} selected groups ({num_experts // num_groups} each)"
        )


def topk_routing(
    scores: Tensor,
    topk: int,
    *,
    expert_bias: Tensor | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score_topk: int | None = None,
    group_fill: float = -math.inf,
) -> tuple[Tensor, Tensor]:
    """Expert selection: ``(indices [..., k] int64, routing_map [..., E] bool)``.

    The selection values are ``v[x,e] = scores[x,e] + b_e`` (``expert_bias`` ``b [E]``, default 0); the
    selected experts are the ``k`` largest ``v[x,:]`` (``torch.topk`` order and ties). Group-limited routing
    (``num_groups`` ``G``, ``group_topk`` ``g``): the experts form ``G`` contiguous groups of ``E/G``; group
    ``γ`` scores ``S_γ = Σ`` of its ``m`` largest ``v``, ``m = group_score_topk`` (default ``k // g``:
    Megatron, MindFormers graph mode; MindFormers pynative (2.x ``TopKRouter``) and DeepSeek-V3 with a bias
    use 2, DeepSeek-V3's reference without a bias 1, the group maximum); the ``g`` groups of largest ``S_γ``
    stay, every expert of the other groups gets ``v = group_fill``, and the ``k`` largest ``v`` are selected.
    ``group_fill`` is ``-inf`` by default (Megatron, MindFormers pynative, DeepSeek: a dropped group's expert is
    never selected); MindFormers graph mode fills with ``0.0``, which selects a dropped group's expert over a
    kept one whose biased value is negative (the same selection when every kept ``v`` is ``>= 0``). The bias
    only selects: gates use the unbiased scores (:func:`gate_weights`).
    """
    scores = _check_float_tensor("scores", scores)
    if scores.dim() < 1:
        raise ValueError(f"scores must be [..., num_experts], got shape {tuple(scores.shape)}")
    num_experts = scores.shape[-1]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be an int in 1..num_experts={num_experts}, got {topk!r}")
    _check_groups(num_experts, topk, num_groups, group_topk)
    if isinstance(group_fill, bool) or not isinstance(group_fill, (int, float)) or math.isnan(group_fill):
        raise ValueError(f"group_fill must be a number (-inf or 0.0), got {group_fill!r}")
    v = scores.detach()
    if expert_bias is not None:
        _check_float_tensor("expert_bias", expert_bias)
        if expert_bias.shape != (num_experts,):
            raise ValueError(f"expert_bias must have shape ({num_experts},), got {tuple(expert_bias.shape)}")
        v = v + expert_bias.detach().to(device=v.device, dtype=v.dtype)
    if num_groups is not None and group_topk is not None:
        per_group = num_experts // num_groups
        m = topk // group_topk if group_score_topk is None else group_score_topk
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= per_group:
            raise ValueError(f"group_score_topk must be an int in 1..{per_group} (experts per group), got {m!r}")
        grouped = v.reshape(*v.shape[:-1], num_groups, per_group)
        group_scores = grouped.topk(m, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(-1, group_scores.topk(group_topk, dim=-1).indices, True)
        keep_e = keep.unsqueeze(-1).expand_as(grouped).reshape(v.shape)
        v = v.masked_fill(~keep_e, float(group_fill))
    idx = v.topk(topk, dim=-1).indices
    routing_map = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, idx, True)
    return idx, routing_map


def aux_routing_map(
    scores: Tensor,
    topk: int,
    *,
    counts: AuxCounts = "topk",
    expert_bias: Tensor | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    group_score_topk: int | None = None,
    group_fill: float = -math.inf,
) -> Tensor:
    """The routing map ``m [..., E]`` (bool) whose counts ``c_e = Σ_x m[x,e]`` the auxiliary losses use.

    ``counts="topk"`` (default; semantics §5, Megatron, MindFormers pynative): the plain top-``k`` of the unbiased
    ``scores``, ``m[x,e] = (e ∈ top-k of scores[x,:])``, whatever the router dispatched (the routing options are
    ignored; the same map as :func:`~lossparity.losses.moe.topk_routing_map` of the normalized probs, since a
    positive row scale keeps the order). ``counts="dispatch"`` (MindFormers graph mode, whose aux losses count
    the router's ``expert_index``): the map of :func:`topk_routing` with the given ``expert_bias`` and group
    options, i.e. the experts the tokens were sent to. ``scores`` are the router's selection scores
    (``softmax``, ``sigmoid`` or ``sqrtsoftplus``, see :func:`~lossparity.losses.moe.router_scores`).
    """
    if counts not in AUX_COUNTS:
        raise ValueError(f"counts must be one of {AUX_COUNTS} (what the aux losses count), got {counts!r}")
    if counts == "topk":
        return topk_routing(scores, topk)[1]
    return topk_routing(
        scores,
        topk,
        expert_bias=expert_bias,
        num_groups=num_groups,
        group_topk=group_topk,
        group_score_topk=group_score_topk,
        group_fill=group_fill,
    )[1]


def gate_weights(
    scores: Tensor,
    selected: Tensor,
    *,
    normalize: bool,
    scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> Tensor:
    """Gate weights of the selected experts: ``w = λ · s_sel / (Σ_sel s + ε)`` (``normalize``) or
    ``w = λ · s_sel``.

    ``scores`` ``[..., E]`` are the unbiased scores (``softmax``, ``sigmoid`` or ``sqrtsoftplus``, not the aux
    losses' normalized ``probs``); ``selected`` is either the ``indices [..., k]`` (int) of the selected experts,
    giving ``w [..., k]``, or a bool ``routing_map [..., E]``, giving dense ``w [..., E]`` (0 elsewhere).
    ``normalize`` is HF/MindFormers ``norm_topk_prob`` and is independent of the score function (Megatron
    normalizes ``sigmoid``/``sqrtsoftplus`` when ``k > 1``, and ``softmax`` unless ``moe_router_pre_softmax``;
    DeepSeek's reference every score function but softmax); ``λ = scaling_factor`` (Megatron/MindFormers
    ``moe_router_topk_scaling_factor``, DeepSeek ``route_scale``, 2.5 in DeepSeek-V3); ``ε = eps`` (1e-20 as
    Megatron and MindFormers; 0 for DeepSeek's reference). Gradients flow through ``scores``.
    """
    scores = _check_float_tensor("scores", scores)
    if not isinstance(selected, Tensor):
        raise TypeError(f"selected must be a torch.Tensor (indices or routing map), got {type(selected).__name__}")
    if selected.dtype == torch.bool:
        if selected.shape != scores.shape:
            raise ValueError(f"routing map shape {tuple(selected.shape)} does not match scores {tuple(scores.shape)}")
        w = scores * selected
    elif not (selected.is_floating_point() or selected.is_complex()):
        if selected.shape[:-1] != scores.shape[:-1]:
            raise ValueError(
                f"indices shape {tuple(selected.shape)} does not match the token dims of scores {tuple(scores.shape)}"
            )
        w = scores.gather(-1, selected.long())
    else:
        raise TypeError(f"selected must be int indices or a bool routing map, got dtype {selected.dtype}")
    if normalize:
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    if scaling_factor != 1.0:
        w = w * scaling_factor
    return w
