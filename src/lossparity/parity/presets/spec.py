"""The :class:`Preset` record of a framework's loss semantics, and the parsing of preset spec options
(``name:key=value,...``; the grammar is in the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ...options import (
    FRAMEWORK_AUX_SCOPES,
    AuxScope,
    GradReduction,
    Mode,
    MTPConvention,
    MTPLogEstimator,
    Normalization,
    ZForm,
    check_option,
)

__all__ = ["FRAMEWORKS", "PRESET_NAMES", "Preset"]

FRAMEWORKS: tuple[str, ...] = (
    "megatron",
    "maxtext",
    "hf-trainer",
    "torchtitan",
    "verl",
    "trl",
    "openrlhf",
    "lossparity",
)
PRESET_NAMES: tuple[str, ...] = (
    "megatron",
    "maxtext",
    "hf-trainer",
    "hf-trainer-legacy",
    "torchtitan",
    "verl",
    "verl<0.8",
    "trl-grpo",
    "openrlhf",
    "lossparity",
)
_VERL_MODES: dict[str, Mode] = {  # verl >= 0.8 (engine workers); the presets live in presets/rl.py
    "token-mean": "per_token",
    "seq-mean-token-mean": "per_sample",
    "seq-mean-token-sum": "sample_sum",
    "seq-mean-token-sum-norm": "sample_sum_norm",
    "token-sum": "token_sum",
}
_MEGATRON_LB: dict[str, AuxScope] = FRAMEWORK_AUX_SCOPES["megatron"]  # public: lossparity.moe.aux_scope_for
_QUIRKS = (
    "Megatron parity quirks (semantics §5) are reproduced only by lossparity's megatron preset: they "
    "matter with global_aux_loss (aux gradient 1/D of its logged value), with a router z-loss in MTP "
    "layers, and with calculate_per_token_loss=true plus aux/z losses (pre-multiplication by local token "
    "counts)"
)


@dataclass(frozen=True)
class Preset:
    """One framework's loss semantics in lossparity's terms (see the module docstring).

    ``mode``/``normalization``/``grad_reduction``/``mtp_convention``/``mtp_log_estimator`` are
    :class:`~lossparity.distributed.accountant.Accountant` arguments, ``aux_scope``/``z_form`` those of
    :class:`~lossparity.distributed.moe.accounting.MoEAccounting`. ``has_mtp``/``has_router_z_loss``: the
    framework implements the feature at all. ``log_names``: the framework's names for lossparity's
    ``lm_loss`` (global token mean), ``objective`` and ``mtp_loss`` (per depth) when it logs them.
    ``aux_note``: how its load-balancing coefficient maps to lossparity's ``aux_coeff``.
    RL presets (semantics §9): ``terms`` the mode of each term (policy, kl, entropy), ``epsilon`` the
    per-sequence epsilon, ``empty_rows`` ``count``/``drop``; ``log_names`` then also names each term's log.
    """

    name: str
    framework: str
    mode: Mode
    normalization: Normalization
    mtp_convention: MTPConvention
    mtp_log_estimator: MTPLogEstimator
    aux_scope: AuxScope
    z_form: ZForm
    grad_reduction: GradReduction | Literal["auto"] = "auto"
    megatron_quirks: bool = False
    description: str = ""
    notes: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    has_mtp: bool = True
    has_router_z_loss: bool = True
    log_names: dict[str, str] = field(default_factory=dict)
    aux_note: str = ""
    fixed_length: int | None = None
    epsilon: float = 0.0
    empty_rows: str = "count"
    terms: dict[str, str] = field(default_factory=dict)

    def accountant_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``Accountant(...)`` that this preset fixes."""
        kw: dict[str, Any] = {
            "mode": self.mode,
            "normalization": self.normalization,
            "grad_reduction": self.grad_reduction,
            "mtp_convention": self.mtp_convention,
            "mtp_log_estimator": self.mtp_log_estimator,
        }
        if self.fixed_length is not None:
            kw["fixed_length"] = self.fixed_length
        return kw

    def moe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``MoEAccounting(...)`` that this preset fixes (``scope``, ``z_form``,
        ``megatron_quirks``)."""
        return {"scope": self.aux_scope, "z_form": self.z_form, "megatron_quirks": self.megatron_quirks}

    def train_config_fields(self) -> dict[str, Any]:
        """The ``TrainConfig`` fields this preset sets: mode, normalization, MTP convention, aux scope, z form
        (and ``fixed_length``). ``mtp_log_estimator`` is an ``Accountant`` argument, see :meth:`accountant_kwargs`."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "normalization": self.normalization,
            "mtp_convention": self.mtp_convention,
            "aux_scope": self.aux_scope,
            "z_form": self.z_form,
            "megatron_quirks": self.megatron_quirks,
        }
        if self.fixed_length is not None:
            out["fixed_length"] = self.fixed_length
        return out


# --------------------------------------------------------------------------------------------------
# option parsing


def _parse_bool(value: str, option: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"option {option}={value!r}: expected true or false")


def _choice(value: str, option: str, valid: tuple[str, ...]) -> Any:
    """``value`` checked against ``valid`` with :func:`lossparity.options.check_option` (its aliases too)."""
    try:
        return check_option(option, value, valid)
    except ValueError:
        raise ValueError(f"option {option}={value!r}: valid values: {', '.join(valid)}") from None


def _positive(value: str, option: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"option {option}={value!r}: expected a positive integer") from None
    if v < 1:
        raise ValueError(f"option {option}={value!r}: expected a positive integer")
    return v


def _split_spec(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """``name:a,k=v,...`` -> (name, positional items, options); raises on a repeated option."""
    text = spec.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    if name.startswith("verl-") and name[5:] in _VERL_MODES:  # semantics §8 spells verl-<loss_agg_mode>
        rest = name[5:] + ("," + rest if rest else "")
        name = "verl"
    positional: list[str] = []
    options: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            positional.append(item)
            continue
        key = key.strip().lower().replace("-", "_")
        if key in options:
            raise ValueError(f"preset {spec!r}: option {key} given twice")
        options[key] = value.strip()
    return name, positional, options


def _check_options(spec: str, name: str, options: dict[str, str], valid: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(valid))
    if unknown:
        allowed = ", ".join(valid) if valid else "none"
        raise ValueError(
            f"preset {spec!r}: unknown option(s) {', '.join(unknown)} for {name}; valid options: {allowed}"
        )


def _no_positional(spec: str, name: str, positional: list[str]) -> None:
    if positional:
        raise ValueError(f"preset {spec!r}: {name} options are KEY=VALUE, got {', '.join(positional)}")
