"""The tiny configuration of any Hugging Face causal-LM family that ``lossparity verify --hf MODEL_TYPE`` builds.

The sizes go *into* ``AutoConfig.for_model(model_type, **tiny)``, so that the fields a configuration derives
from others in its own constructor (per-layer lists such as ``layer_types`` or ``mlp_layer_types`` from
``num_hidden_layers``, ``qk_head_dim`` from the MLA sizes) agree with them. Only the fields that the family's
default configuration has are passed. The family-specific sizes that must agree with each other are derived
from which of those fields the configuration has (:func:`tiny_fields`):

- attention: 4 heads of 8 (``hidden_size`` 32), 2 key/value heads;
- MLA (``kv_lora_rank``): LoRA ranks 16, ``qk_nope_head_dim`` 8, ``qk_rope_head_dim`` 4, ``v_head_dim`` 8;
- Mamba / SSM (``mamba_*``, ``ssm_*``): expansion 2 and heads of 8, so heads × head size = 2 × hidden;
- MoE: 4 routed experts, top-2, one shared expert where the family has any, one group, the first layer dense
  and the second sparse where the family has leading dense layers, every other layer sparse otherwise;
- hybrid stacks (``attn_layer_period`` ...): one attention layer among the two;
- other sizes of the vocabulary (``unpadded_vocab_size``, ``vocab_size_per_layer_input``): the tiny one;
- a sliding window (``sliding_window``) of 13 tokens: shorter than the 16-token rows, long enough that every
  query on padding sees a key;
- no randomness in training mode: every ``*dropout*`` / ``*pdrop*`` field and router jitter set to 0, so
  that a layout comparison is not a comparison of random draws. :func:`no_randomness_note` names them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY", "tiny_fields", "tiny_config", "randomness_fields", "zero_randomness", "no_randomness_note"]

HIDDEN, HEADS, HEAD_DIM = 32, 4, 8

# Generic sizes: a family's configuration gets those of its fields (attribute_map aliases included).
TINY: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "intermediate_size_mlp": 64,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "head_dim": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # MoE: routed experts and top-k under every name transformers uses (hf_moe.EXPERT_FIELDS / TOPK_FIELDS).
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "d_head": HEAD_DIM,
    "n_group": 1,
    "topk_group": 1,
    "decoder_sparse_step": 1,
    "interleave_moe_layer_step": 1,
    "mlp_only_layers": [],
    # Shorter than the 16-token rows (a full-length row sees its effect), and the shortest window with which
    # every query on padding still sees a key (rows are 4 to 16 tokens: position 15 of a 4-token row needs
    # 15 - w < 3, w >= 13). With 8, such a query had no key, its attention output was NaN, and the NaN keys
    # of the next layer reached every loss (gemma2: every row ERROR "per_token_loss has NaN").
    "sliding_window": 13,
    "attention_chunk_size": 8,
    "rotary_dim": HEAD_DIM,
}

# What a family's configuration cannot derive and lossparity cannot read from it: the value, and why.
_FAMILY: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # a run-length list of its own
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # its default None breaks its own model
    "zaya": {"num_experts_per_tok": 1},  # its validation accepts top-1 only
    # its validation: NVFP4 rounding of K/V needs head_dim a multiple of 16; indexer heads <= query heads per K/V head
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 2},
}

_MOE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_topk",
    "moe_k",
    "top_k_experts",
)

# Fields whose value is a layer count or index that must stay inside 2 layers when the family uses them.
_FIRST_DENSE = ("first_k_dense_replace", "num_dense_layers", "first_k_dense", "moe_layer_start_index")
_SHARED = ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts")
_JITTER = ("router_jitter_noise", "input_jitter_noise", "jitter_noise", "router_z_loss_coef_jitter")


def randomness_fields(config: Any) -> list[str]:
    """The nonzero fields of ``config`` (and of its sub-configurations, dotted) that draw random numbers in
    training mode: every name containing ``dropout`` or ``pdrop``, and the router jitter names transformers
    uses."""
    out = []
    for name, value in config.to_dict().items():
        low = name.lower()
        if isinstance(value, dict):
            sub = _get(config, name)
            if hasattr(sub, "to_dict"):
                out += [f"{name}.{n}" for n in randomness_fields(sub)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            if "dropout" in low or "pdrop" in low or name in _JITTER:
                out.append(name)
    return out


def zero_randomness(config: Any) -> list[str]:
    """Set every field of :func:`randomness_fields` to 0 (in its own type); returns their names."""
    names = randomness_fields(config)
    for name in names:
        *path, last = name.split(".")
        obj = config
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, type(getattr(obj, last))(0))
    return names


_SSM_SIZES = (
    ("mamba_n_groups", 1),
    ("n_groups", 1),
    ("mamba_d_state", 16),
    ("ssm_state_size", 16),
    ("state_size", 16),
    ("mamba_chunk_size", 16),
    ("chunk_size", 16),
    ("mamba_dt_rank", 8),
    ("time_step_rank", 8),
    ("mamba_d_ssm", 2 * HIDDEN),
    ("linear_key_head_dim", HEAD_DIM),
    ("linear_value_head_dim", HEAD_DIM),
    ("linear_num_key_heads", 2),
    ("linear_num_value_heads", HEADS),
)
# Mamba / SSM mixers: heads × head size must be expand × hidden.
_SSM_HEADS = (
    ("mamba_expand", "mamba_n_heads", "mamba_d_head"),
    ("mamba_expand", "mamba_num_heads", "mamba_head_dim"),
    ("expand", "mamba_num_heads", "mamba_head_dim"),
    ("expand", "num_heads", "head_dim"),
)


def tiny_fields(default: Any) -> dict[str, Any]:
    """The keyword arguments of ``AutoConfig.for_model`` for the family whose default configuration is
    ``default``: :data:`TINY` restricted to its fields, plus the family-specific sizes (module docstring)."""
    kw = {k: v for k, v in TINY.items() if _has(default, k)}
    if any(n.startswith(("enable_moe", "use_moe")) and v is False for n, v in default.to_dict().items()):
        for name in _MOE_FIELDS:  # a family whose default is its dense variant stays dense
            kw.pop(name, None)
    kw.update(_vocab_sizes(default))
    kw.update(_mla_sizes(default))
    kw.update(_ssm_sizes(default))
    kw.update(_moe_layout(default))
    for name in randomness_fields(default):
        if "." not in name:
            kw[name] = type(_get(default, name))(0)  # some families type them int
    kw |= _FAMILY.get(getattr(default, "model_type", ""), {})
    # The family's own field names: an alias (attribute_map) may be applied after the fields derived from it.
    alias = getattr(default, "attribute_map", {}) or {}
    return {alias.get(k, k): v for k, v in kw.items()}


def _vocab_sizes(default: Any) -> dict[str, Any]:
    """Other sizes of the same vocabulary: every field naming ``vocab_size`` whose default lies between half
    the default ``vocab_size`` and all of it becomes the tiny vocabulary. Inkling-2's ``unpadded_vocab_size``
    (its head's rows; left at 200058 with a 256 vocabulary, the head had ``256 - 200058`` rows), Gemma-3n's
    and Gemma-4's ``vocab_size_per_layer_input`` (a 262144-row float64 table per layer: the runs' recorded
    gradients and parameters outgrew the memory). Vocabularies of their own (``type_vocab_size`` 2) stay."""
    full = _get(default, "vocab_size")
    if not isinstance(full, int) or full <= 0 or not _has(default, "vocab_size"):
        return {}
    kw: dict[str, Any] = {}
    for name, value in default.to_dict().items():
        if name != "vocab_size" and "vocab_size" in name and isinstance(value, int):
            if not isinstance(value, bool) and full / 2 < value <= full:
                kw[name] = TINY["vocab_size"]
    return kw


def _mla_sizes(default: Any) -> dict[str, Any]:
    """DeepSeek-style multi-head latent attention: LoRA ranks and head sizes that agree."""
    if not _has(default, "kv_lora_rank"):
        return {}
    kw: dict[str, Any] = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    if _has(default, "num_key_value_heads"):
        kw["num_key_value_heads"] = HEADS  # the latent is expanded to every head
    if _get(default, "q_lora_rank") is not None:
        kw["q_lora_rank"] = 16
    if _has(default, "qk_head_dim"):
        kw["qk_head_dim"] = 12
    if _has(default, "head_dim") and _get(default, "head_dim") == _get(default, "qk_rope_head_dim"):
        kw["head_dim"] = 4  # the rotary part's size, as the family defines it
    return kw


def _ssm_sizes(default: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for expand, heads, head in _SSM_HEADS:
        if _has(default, expand) and _has(default, heads) and _has(default, head):
            kw.update({expand: 2, heads: 2 * HIDDEN // HEAD_DIM, head: HEAD_DIM})
    for name, value in _SSM_SIZES:
        if _has(default, name) and isinstance(_get(default, name), int):
            kw[name] = value
    return kw


def _moe_layout(default: Any) -> dict[str, Any]:
    """Shared experts, leading dense layers and hybrid patterns that fit 2 layers with both kinds in them."""
    kw: dict[str, Any] = {}
    for name in _SHARED:
        if _has(default, name) and (_get(default, name) is None or _get(default, name)):
            kw[name] = 1
    for name in _FIRST_DENSE:
        if isinstance(v := _get(default, name), int) and v > 0:
            kw[name] = 1  # layer 0 dense, layer 1 MoE: both kinds are exercised
    if isinstance(v := _get(default, "zero_expert_num"), int) and v > 0:
        kw["zero_expert_num"] = 2  # LongCat-Flash's zero-computation experts: 256 beside 4 routed ones otherwise
    if isinstance(_get(default, "num_kv_shared_layers"), int):
        kw["num_kv_shared_layers"] = 0  # Gemma-3n: the last n layers reuse earlier caches; 2 layers have none
    if _has(default, "expert_layer_period"):  # Jamba: experts on every layer, attention on the second
        kw.update(expert_layer_period=1, expert_layer_offset=0)
    if _has(default, "attn_layer_period"):
        kw.update(attn_layer_period=2, attn_layer_offset=1)
    if _get(default, "attn_layer_indices") is not None:
        kw["attn_layer_indices"] = [1]
    if _get(default, "ffn_config") is not None:  # DBRX: the MoE sizes live in a sub-configuration
        kw["ffn_config"] = {"hidden_size": HIDDEN, "ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}
        # Its attention reads rope_theta and clip_qkv from attn_config, which by default has neither.
        theta = (_get(default, "rope_parameters") or {}).get("rope_theta", 10000.0)
        kw["attn_config"] = {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": theta}
    return kw


def _has(config: Any, name: str) -> bool:
    """Whether the configuration has the field: attribute_map aliases and per-layer fields count, fields
    whose reading raises (a family without a sequence-length limit) do not."""
    try:
        getattr(config, name)
    except (AttributeError, NotImplementedError):
        return False
    except Exception:  # a per-layer field that the global accessor refuses to read: it exists
        return True
    return not isinstance(getattr(type(config), name, None), property) or name in getattr(config, "attribute_map", {})


def _get(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except Exception:  # see _has
        return None


def tiny_config(model_type: str, sets: dict[str, Any] | None = None) -> Any:
    """``AutoConfig.for_model(model_type, **tiny_fields(default), **sets)``: the user's ``--hf-set`` fields go
    in with the tiny sizes, so that derived fields follow them too. ``ValueError`` naming the field (or the
    family) when the configuration refuses the values."""
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception as e:  # the family's own default does not validate: nothing lossparity can size
        raise ValueError(
            f"--hf: {model_type}: transformers cannot build its default configuration: {_line(e)}"
        ) from None
    for field in sets or {}:
        if not hasattr(default, field):
            raise ValueError(f"--hf-set: {cls.__name__} has no field {field!r}")
    kw = tiny_fields(default) | dict(sets or {})
    zeroed = [n for n in randomness_fields(default) if "." not in n]
    try:
        config = transformers.AutoConfig.for_model(model_type, **kw)
    except Exception as e:  # the configuration's own validation: name what it refused
        config, first = None, e
    if config is None and "num_hidden_layers" in kw and "num_hidden_layers" not in (sets or {}):
        # A per-layer list the constructor does not derive (its default has the default depth): its first
        # layer and the first of another kind; else a pattern that needs 3 or 4 layers (Zamba's).
        lists = _layer_lists(default)
        for extra in ([lists] if lists else []) + [{"num_hidden_layers": 3}, {"num_hidden_layers": 4}]:
            try:
                config = transformers.AutoConfig.for_model(model_type, **(kw | extra))
                break
            except Exception:  # the first refusal is the one reported
                continue
    if config is None:
        raise ValueError(f"--hf: {model_type}: its configuration refuses the tiny sizes: {_line(first)}") from None
    config.lossparity_zeroed = zeroed
    return config


def _layer_lists(default: Any) -> dict[str, list[Any]]:
    """2-layer versions of the default's per-layer lists of strings (one entry per layer): the first layer's
    kind and the first other kind (both kinds run), or the first two."""
    depth = _get(default, "num_hidden_layers")
    out: dict[str, list[Any]] = {}
    for name, value in default.to_dict().items():
        if isinstance(value, list) and len(value) == depth and value and all(isinstance(v, str) for v in value):
            other = next((v for v in value if v != value[0]), value[1] if len(value) > 1 else value[0])
            out[name] = [value[0], other]
    return out


def no_randomness_note(names: list[str]) -> str | None:
    """One line naming the dropout / jitter fields set to 0 (None when none)."""
    return "set to 0 (no randomness in training mode): " + ", ".join(names) if names else None


def _line(e: BaseException) -> str:
    """An exception as one line: its type and its message's lines joined."""
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:300]
