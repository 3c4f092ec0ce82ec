"""The models that ``lossparity verify --hf`` / ``--model`` checks: a Hugging Face causal LM built from a
configuration (random initialization, nothing downloaded), or any PyTorch module returned by a user's
``build(seed, dtype)`` function.

Every function here raises ``ValueError`` naming the bad input (unknown ``model_type``, missing config path,
a ``--hf-set`` field the config lacks, a target that is not importable) before anything runs.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .hf_tiny import TINY  # the tiny sizes of every family, re-exported

__all__ = ["TINY", "hf_config", "parse_sets", "build_hf_model", "is_moe", "moe_shape", "import_target"]


def parse_sets(sets: Sequence[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` overrides; ``VALUE`` is read as a Python literal (``3``, ``0.5``, ``True``, ``None``,
    ``[1, 2]``) and kept as a string otherwise."""
    out: dict[str, Any] = {}
    for item in sets:
        field, eq, raw = item.partition("=")
        if not eq or not field.strip():
            raise ValueError(f"--hf-set: expected FIELD=VALUE, got {item!r}")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[field.strip()] = value
    return out


def hf_config(model: str, sets: dict[str, Any] | None = None) -> Any:
    """The configuration named by ``model``: a ``config.json``, a model directory holding one (its config
    only: no weights are read), or a ``model_type`` known to ``AutoConfig.for_model`` with :data:`TINY`
    sizes. ``sets`` override fields, each of which the configuration must already have. MoE families get
    ``output_router_logits=True`` and eager experts (the grouped kernel refuses float64 on CPU)."""
    import transformers

    if os.path.sep in model or model.endswith(".json") or os.path.exists(model):
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise ValueError(f"--hf: {path} does not exist (give a model_type, a config.json or a model directory)")
        with open(path) as f:
            data = json.load(f)  # JSON only: nothing from the directory is executed or unpickled
        kind = data.get("model_type")
        if kind not in transformers.CONFIG_MAPPING:
            raise ValueError(f"--hf: {path}: model_type {kind!r} is not known to this transformers")
        config = transformers.CONFIG_MAPPING[kind].from_dict(data)
    else:
        if model not in transformers.CONFIG_MAPPING:
            raise ValueError(
                f"--hf: unknown model_type {model!r} (transformers {transformers.__version__} knows e.g. "
                "llama, mixtral, qwen3_moe, qwen2_moe, olmoe), and no such file"
            )
        from .hf_tiny import tiny_config

        # The sizes go into the constructor, so that the fields it derives (per-layer lists) follow them.
        config = tiny_config(model, sets)
        sets = None
    for field, value in (sets or {}).items():
        if not hasattr(config, field):
            raise ValueError(f"--hf-set: {type(config).__name__} has no field {field!r}")
        setattr(config, field, value)
    from .hf_tiny import zero_randomness

    # A layout comparison must not compare random draws; the names are kept for the report's header.
    config.lossparity_zeroed = zero_randomness(config) + list(getattr(config, "lossparity_zeroed", []))
    if is_moe(config):
        config.output_router_logits = True
    # Eager experts for every family (the grouped kernel refuses float64 on CPU); a no-op for dense ones.
    config._experts_implementation = "eager"
    config.use_cache = False
    return config


def is_moe(config: Any) -> bool:
    """Whether the configuration routes tokens to experts (it has an expert count and a top-k)."""
    return moe_shape(config) is not None


def moe_shape(config: Any) -> tuple[int, int] | None:
    """``(E, k)`` of an HF MoE configuration or model family (:func:`lossparity.integrations.hf_moe.moe_info`:
    router modules recorded by the model class, expert count and top-k under transformers' field names)."""
    from ..integrations.hf_moe import moe_info

    info = moe_info(config)
    return (info.experts, info.top_k) if info is not None else None


def build_hf_model(config: Any, seed: int, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` with ``torch.manual_seed(seed)``: identical on every rank."""
    import transformers

    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"--hf: {type(config).__name__} has no causal-LM class: {e}") from None
    return model


def import_target(target: str, what: str) -> Callable[..., Any]:
    """The callable named ``pkg.module:name`` (``what`` names the option in errors)."""
    module, colon, name = target.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"{what}: expected pkg.module:function, got {target!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot import {target!r}: {e}") from None
    if not callable(obj):
        raise ValueError(f"{what}: {target!r} is not callable")
    return obj  # type: ignore[no-any-return]
