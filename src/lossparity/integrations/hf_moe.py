"""Mixture-of-experts models of Hugging Face transformers recognised by what they are, not by one field name.

A model is MoE when it records router logits: transformers' ``_can_record_outputs["router_logits"]`` (an
``OutputRecorder`` or a module class) names the router modules whose outputs become ``outputs.router_logits``
(:func:`router_classes`); a configuration alone is MoE when one of :data:`EXPERT_FIELDS` holds an expert count.
The number of routed experts ``E``, the top-k ``k`` and the load-balancing coefficient ``c`` are read from the
configuration through one table of the names transformers' families use (:data:`EXPERT_FIELDS`,
:data:`TOPK_FIELDS`, :data:`COEF_FIELDS`; a dotted name reads a sub-configuration such as DBRX's
``ffn_config``). :func:`moe_info` returns them with the field each came from, so that a report can print
where every number was found.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXPERT_FIELDS",
    "TOPK_FIELDS",
    "COEF_FIELDS",
    "MoEInfo",
    "moe_info",
    "router_classes",
    "aux_coefficient",
    "model_class",
]

# The names under which transformers' configurations store each number, first match wins.
EXPERT_FIELDS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "ffn_config.moe_num_experts",
)
TOPK_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "top_k", "ffn_config.moe_top_k")
# The coefficient by which the family's own ForCausalLM adds load_balancing_loss_func's value to its loss.
COEF_FIELDS = ("router_aux_loss_coef", "aux_loss_coef", "ffn_config.moe_loss_weight")


@dataclass(frozen=True)
class MoEInfo:
    """``E`` routed experts, top-``k`` and the coefficient ``coef`` (None when the configuration has none of
    :data:`COEF_FIELDS`), with the configuration field each was read from, and the router module classes."""

    experts: int
    top_k: int
    coef: float | None
    experts_field: str
    top_k_field: str
    coef_field: str | None
    routers: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for a report header: ``4 experts (num_local_experts), top-2 (...), coefficient ...``."""
        coef = f"coefficient {self.coef:g} ({self.coef_field})" if self.coef is not None else "no coefficient field"
        routers = f", routers {', '.join(self.routers)}" if self.routers else ""
        return f"{self.experts} experts ({self.experts_field}), top-{self.top_k} ({self.top_k_field}), {coef}{routers}"


def _read(config: Any, dotted: str) -> Any:
    obj = config
    for part in dotted.split("."):
        if obj is None:
            return None
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return obj


def _first(config: Any, fields: tuple[str, ...], kind: type | tuple[type, ...]) -> tuple[Any, str | None]:
    for name in fields:
        value = _read(config, name)
        if isinstance(value, kind) and not isinstance(value, bool):
            return value, name
    return None, None


def router_classes(model_or_class: Any) -> tuple[type, ...]:
    """The module classes whose outputs the model records as ``router_logits`` (``_can_record_outputs`` of
    the model class or its bases; empty for a model that records none)."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    out: list[type] = []
    for klass in cls.__mro__:
        spec = (getattr(klass, "_can_record_outputs", None) or {}).get("router_logits")
        for item in spec if isinstance(spec, (list, tuple)) else [spec]:
            target = getattr(item, "target_class", item)
            if isinstance(target, type) and target not in out:
                out.append(target)
    return tuple(out)


_PRESENT: weakref.WeakKeyDictionary[Any, tuple[type, ...]] = weakref.WeakKeyDictionary()


def _present(model: Any, routers: tuple[type, ...]) -> tuple[type, ...]:
    """The router classes that have an instance in ``model`` (walked once per model: the trainer asks for
    every microbatch)."""
    try:
        return _PRESENT[model]
    except KeyError:
        pass
    found = tuple(r for r in routers if any(isinstance(m, r) for m in model.modules()))
    _PRESENT[model] = found
    return found


def model_class(config: Any) -> type | None:
    """The causal-LM class of a transformers configuration (None when transformers has none for it)."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None) or "")
    cls = getattr(transformers, name, None) if name else None
    return cls if isinstance(cls, type) else None


def moe_info(config: Any, model: Any = None) -> MoEInfo | None:
    """``MoEInfo`` of the configuration (and the model when given), or None for a dense model.

    MoE when the model holds router modules whose outputs it records as ``router_logits``
    (:func:`router_classes`), or, without a model, when the configuration has an expert count; ``E`` from
    :data:`EXPERT_FIELDS` (or the router's ``num_experts`` attribute), ``k`` from :data:`TOPK_FIELDS`.
    ``ValueError`` when the model routes tokens but ``E`` or ``k`` cannot be found or ``k`` is not in ``1..E``."""
    cls = type(model) if model is not None else model_class(config)
    routers = router_classes(cls) if cls is not None else ()
    e, e_field = _first(config, EXPERT_FIELDS, int)
    if model is not None:  # the built model: MoE when router modules are in it (a class may allow both)
        routers = _present(model, routers)
        if not routers:
            return None
    elif not (isinstance(e, int) and e > 0):  # a configuration alone: its expert count decides
        return None
    if e is None and model is not None:  # the router module knows its experts when the config names them oddly
        for m in model.modules():
            if isinstance(m, routers) and isinstance(n := getattr(m, "num_experts", None), int):
                e, e_field = n, f"{type(m).__name__}.num_experts"
                break
    k, k_field = _first(config, TOPK_FIELDS, int)
    what = type(config).__name__
    if not isinstance(e, int) or e <= 0 or not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(
            f"{what}: a mixture-of-experts model (router logits recorded) whose expert count and top-k are not "
            f"found or inconsistent: experts {e} (looked up {', '.join(EXPERT_FIELDS)}), top-k {k} (looked up "
            f"{', '.join(TOPK_FIELDS)})"
        )
    coef, c_field = _first(config, COEF_FIELDS, (int, float))
    names = tuple(r.__name__ for r in routers)
    return MoEInfo(e, k, None if coef is None else float(coef), str(e_field), str(k_field), c_field, names)


def aux_coefficient(config: Any, model: Any = None) -> float | None:
    """The load-balancing coefficient to train with when ``config.output_router_logits`` is set: None for a
    dense model or when router logits are off; ``ValueError`` for an MoE model whose coefficient is under
    none of :data:`COEF_FIELDS` (training it without its term would be silent)."""
    if not getattr(config, "output_router_logits", False):
        return None
    info = moe_info(config, model)
    if info is None:
        return None
    if info.coef is None:
        raise ValueError(
            f"model: {type(config).__name__} routes tokens to {info.experts} experts with output_router_logits "
            f"set, but its configuration has no load-balancing coefficient under any of {', '.join(COEF_FIELDS)}: "
            "set one (e.g. config.router_aux_loss_coef) or turn output_router_logits off"
        )
    return info.coef
