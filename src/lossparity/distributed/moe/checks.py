"""Argument and input checks of :class:`~lossparity.distributed.moe.accounting.MoEAccounting`: the rules
tying the MoE auxiliary terms to the accountant's normalization and to sharded sequences (semantics §5),
and the shapes of the router records and routers it is handed. Each raises before any state changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from typing import TYPE_CHECKING

from torch import Tensor

from ...options import Z_FORMS, AuxScope, ZForm, check_option, check_sharded_moe
from ..accountant import Accountant
from ..protocol import ProtocolError, StepState

if TYPE_CHECKING:  # the model package imports the losses; these are only types here
    from ...model.router import Router, RouterRecord

__all__ = [
    "check_coeff",
    "check_int",
    "check_z_form",
    "check_per_token_flag",
    "check_normalization",
    "check_records",
    "check_routers",
]


def check_coeff(name: str, value: object) -> float:
    """``value`` as a float, or ``ValueError`` naming ``name`` unless it is a finite real ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value``, or ``ValueError`` naming ``name`` unless it is an int in ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return value


def check_z_form(z_form: str | None, megatron_quirks: bool) -> ZForm:
    """The z-loss form: ``global`` by default, ``microbatch`` (required) with ``megatron_quirks``."""
    if z_form is None:
        return "microbatch" if megatron_quirks else "global"
    form = check_option("z_form", z_form, Z_FORMS)
    if megatron_quirks and form != "microbatch":
        raise ValueError(
            "megatron_quirks=True needs z_form='microbatch' (Megatron's z-loss is a microbatch "
            f"mean), got z_form={z_form!r}"
        )
    return form


def check_per_token_flag(acc: Accountant, flag: bool | None, megatron_quirks: bool) -> bool:
    """Megatron's ``calculate_per_token_loss``: default True exactly under deferred normalization with
    ``megatron_quirks``; True without ``megatron_quirks`` is refused."""
    if flag is None:
        return acc.normalization == "deferred" and megatron_quirks
    if flag and not megatron_quirks:
        raise ValueError("calculate_per_token_loss=True is a Megatron setting: it needs megatron_quirks=True")
    return bool(flag)


def check_normalization(
    acc: Accountant, scope: AuxScope, *, aux_on: bool, z_on: bool, megatron_quirks: bool, per_token: bool
) -> None:
    """Rules tying the scopes to the accountant's normalization and to sharded sequences."""
    deferred = acc.normalization == "deferred"
    if deferred and (aux_on or z_on) and not per_token:
        raise ValueError(
            "MoE auxiliary losses under normalization='deferred' divide every gradient by the token count "
            "known only at the end of the step: use normalization='precount', or megatron_quirks=True with "
            "calculate_per_token_loss=True (Megatron pre-multiplies each term by its token count)"
        )
    if deferred and aux_on and scope == "global_lagged":
        raise ValueError(
            "scope 'global_lagged' needs the global router token count before the first "
            "backward: use normalization='precount'"
        )
    # One statement of the sharded-row rules, shared with TrainConfig.validate (options.check_sharded_moe).
    check_sharded_moe(
        acc.groups.cp_size,
        acc.groups.sequence_parallel,
        megatron_quirks=megatron_quirks,
        aux_on=aux_on,
        z_on=z_on,
        aux_scope=scope,
        mode=acc.mode,
    )


def check_records(
    acc: Accountant, records: Sequence[RouterRecord], valid: Tensor, num_layers: int, num_experts: int
) -> tuple[int, int]:
    """Shapes of one microbatch's router records and valid mask, and the protocol state; returns ``(b, S)``."""
    if not isinstance(valid, Tensor):
        raise TypeError(f"valid must be a torch.Tensor [b, S], got {type(valid).__name__}")
    if valid.dim() not in (1, 2):
        raise ValueError(f"valid must be [b, S] (or [S]), got shape {tuple(valid.shape)}")
    if len(records) != num_layers:
        raise ValueError(f"expected {num_layers} router records (one per MoE layer call), got {len(records)}")
    want = (valid.numel(), num_experts)
    for i, r in enumerate(records):
        for field in ("logits", "probs", "topk_map"):
            x = getattr(r, field, None)
            if not isinstance(x, Tensor):
                raise TypeError(f"router record {i} has no tensor field {field!r}")
            if x.shape != want:
                raise ValueError(
                    f"router record {i}: {field} has shape {tuple(x.shape)}, expected "
                    f"[{want[0]}, {num_experts}] (valid has shape {tuple(valid.shape)}, "
                    f"num_experts={num_experts})"
                )
    if acc.state is not StepState.MICROBATCHES:
        raise ProtocolError(
            f"MoEAccounting.microbatch_loss called outside the microbatches of a step: expected {acc.expected_call()}"
        )
    return (1, valid.numel()) if valid.dim() == 1 else (valid.shape[0], valid.shape[1])


def check_routers(routers: Sequence[Router], num_slots: int, num_experts: int, layer_ids: list[int] | None) -> None:
    """One router per distinct MoE layer with ``[E]`` counts and bias; ``layer_ids``: the logged ids their
    ``layer_id`` must be among (None: logged by position)."""
    if len(routers) != num_slots:
        raise ValueError(f"expected {num_slots} routers (one per distinct MoE layer), got {len(routers)}")
    for i, r in enumerate(routers):
        for field in ("tokens_per_expert", "expert_bias"):
            x = getattr(r, field, None)
            if not isinstance(x, Tensor) or x.shape != (num_experts,):
                shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"router {i}: {field} must be a [{num_experts}] tensor, got {shape}")
        lid = getattr(r, "layer_id", i)
        if layer_ids is not None and lid not in layer_ids:
            raise ValueError(f"router {i} has layer_id {lid}, not among log_layer_ids {layer_ids}")
