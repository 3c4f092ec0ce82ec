"""Translation between frameworks: :func:`translate` picks the preset of a target framework that
reproduces a source preset's objective and logs, with the conditions and warnings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .registry import _lossparity_settings, resolve_preset
from .rl import OPENRLHF_MODES, TRL_LOSS_TYPES, VERL_LEGACY_MODES
from .spec import _MEGATRON_LB, _QUIRKS, _VERL_MODES, FRAMEWORKS, PRESET_NAMES, Preset

__all__ = ["Translation", "translate"]

# --------------------------------------------------------------------------------------------------
# translation


@dataclass
class Translation:
    """How to reproduce ``source`` in ``target_framework``: the chosen ``target`` preset, the framework
    ``settings``, which logged metrics correspond (``logs``), the ``conditions`` of exactness (optional
    terms such as MTP or aux losses that must be off, same micro-batch size, ...) and ``warnings`` where
    the target cannot reproduce the source. ``exact`` is true when there is no warning."""

    source: Preset
    target_framework: str
    microbatch_size: int | None
    target: Preset
    settings: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    conditions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """True when the target reproduces the source's objective and logs (under ``conditions``)."""
        return not self.warnings

    def format(self) -> str:
        """The text ``lossparity modes --from ... --to ...`` prints."""
        b = f" (micro-batch size {self.microbatch_size})" if self.microbatch_size else ""
        out = [
            f"lossparity modes: {self.source.name}{b} -> {self.target_framework}",
            f"  source: {_describe(self.source, self.microbatch_size)}",
            f"  target: {self.target.name}: {_describe(self.target, None)}",
            f"settings in {self.target.framework}:",
        ]
        out += [f"  - {s}" for s in self.settings]
        if self.logs:
            out.append("logs:")
            out += [f"  - {s}" for s in self.logs]
        if self.conditions:
            out.append("exact only when:")
            out += [f"  - {s}" for s in self.conditions]
        if self.warnings:
            out.append("warnings:")
            out += [f"  ! {s}" for s in self.warnings]
        out.append(
            "result: "
            + (
                "EXACT translation"
                if self.exact
                else f"APPROXIMATE ({len(self.warnings)} warning{'s' * (len(self.warnings) != 1)})"
            )
        )
        return "\n".join(out)


def _describe(p: Preset, b: int | None) -> str:
    mode = p.mode + (" = per_sample (b=1)" if p.mode == "per_microbatch" and b == 1 else "")
    parts = [f"objective {mode}", f"normalization {p.normalization}"]
    parts.append(f"MTP {p.mtp_convention}, MTP log {p.mtp_log_estimator}" if p.has_mtp else "no MTP")
    parts.append(f"aux {p.aux_scope}")
    parts.append(f"router z {p.z_form}" if p.has_router_z_loss else "no router z-loss")
    return ", ".join(parts)


def _eff_mode(mode: str, b: int | None) -> str:
    return "per_sample" if mode == "per_microbatch" and b == 1 else mode


def _eff_scope(scope: str, b: int | None) -> str:
    return "sequence" if scope == "microbatch" and b == 1 else scope


def _eff_conv(conv: str, mode: str) -> str:
    # main and own differ only where the main loss's denominator is the token count
    return "own" if conv == "main" and mode != "per_token" else conv


def _microbatch_setting(p: Preset, b: int | None) -> str:
    size = str(b) if b else "the source's micro-batch size"
    return {
        "megatron": f"--micro-batch-size {size}",
        "hf-trainer": f"per_device_train_batch_size={size}",
        "verl": f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size}",
        "lossparity": f"global_batch / (dp·ga) = {size}",
    }.get(p.framework, f"micro-batch size {size}")


def _candidates(target: str, source: Preset) -> list[Preset]:
    t = target.strip()
    key = t.lower()
    if key == "lossparity":
        # lossparity implements every choice; Megatron's quirks through its own megatron preset.
        base = resolve_preset("lossparity")
        spec = (
            f"lossparity:mode={source.mode},normalization={source.normalization},"
            f"mtp_convention={source.mtp_convention},mtp_log_estimator={source.mtp_log_estimator},"
            f"aux_scope={source.aux_scope},z_form={source.z_form}"
            + (f",fixed_length={source.fixed_length}" if source.fixed_length else "")
        )
        p = replace(
            source,
            name=f"lossparity preset {source.name}" if source.megatron_quirks else spec,
            framework="lossparity",
            grad_reduction="auto",
            settings=[],
            requires=[],
            log_names=base.log_names,
            aux_note=base.aux_note,
            description=base.description,
        )
        p.settings.extend(
            ([f"the lossparity preset {source.name} (reproduces its quirks)"] if source.megatron_quirks else [])
            + _lossparity_settings(p)
        )
        return [p]
    if key == "megatron":
        return [
            resolve_preset(f"megatron:calculate_per_token_loss={f},moe_router_load_balancing_type={lb}")
            for f in ("false", "true")
            for lb in _MEGATRON_LB
        ]
    if key == "maxtext":
        return [
            resolve_preset(s)
            for s in (
                "maxtext",
                "maxtext:calculate_per_token_loss=true",
                "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=true",
                "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=false",
            )
        ]
    if key == "hf-trainer":
        return [resolve_preset("hf-trainer"), resolve_preset("hf-trainer-legacy")]
    if key == "torchtitan":
        return [resolve_preset("torchtitan")]
    if key == "trl":
        L = f",max_completion_length={source.fixed_length}" if source.fixed_length else ""
        return [resolve_preset(f"trl-grpo:{t}" + (L if t == "dr_grpo" else "")) for t in TRL_LOSS_TYPES]
    if key == "openrlhf":
        return [resolve_preset(f"openrlhf:{m}") for m in OPENRLHF_MODES]
    if key == "verl":
        L = f",loss_scale_factor={source.fixed_length}" if source.fixed_length else ""
        return [resolve_preset(f"verl:{m}" + (L if m.endswith("norm") else "")) for m in _VERL_MODES] + [
            resolve_preset(f"verl<0.8:{m}" + (L if m.endswith("norm") else "")) for m in VERL_LEGACY_MODES
        ]
    try:
        return [resolve_preset(t)]
    except ValueError:
        raise ValueError(
            f"unknown target {target!r}; valid targets: {', '.join(FRAMEWORKS)}, or a preset spec "
            f"({', '.join(PRESET_NAMES)})"
        ) from None


@dataclass
class _Assessment:
    """What a candidate translation needs and lacks; ``penalty`` ranks candidates (lower is closer)."""

    settings: list[str]
    conditions: list[str]
    logs: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    penalty: int = 0


def _assess_mode(src: Preset, cand: Preset, b: int | None, acc: _Assessment) -> tuple[str, str, int | None]:
    """The LM objective: ``(source mode, target mode, target micro-batch size)`` as the translation fixes them."""
    smode = _eff_mode(src.mode, b)
    tb: int | None = None  # the target's micro-batch size, when the translation fixes it
    if cand.mode == "per_microbatch" and smode == "per_sample":
        tb = 1
        acc.settings.append(_microbatch_setting(cand, 1))
    elif cand.mode == "per_microbatch" and smode == "per_microbatch":
        tb = b
        acc.settings.append(_microbatch_setting(cand, b))
        acc.conditions.append(
            "the same micro-batch size and the same assignment of rows to microbatches as the "
            "source (per_microbatch depends on b)"
        )
    tmode = _eff_mode(cand.mode, tb)
    if smode == tmode:
        if smode == "sample_sum_norm":
            acc.conditions.append(f"the same fixed length L{f' = {src.fixed_length}' if src.fixed_length else ''}")
    elif smode == "per_microbatch" and tmode == "per_sample" and b is None:
        acc.penalty += 100
        acc.warnings.append(
            f"the source averages microbatch means (per_microbatch); {cand.framework}'s {tmode} "
            "equals it only when the source micro-batch size is 1: give --microbatch-size"
        )
    else:
        acc.penalty += 100
        what = f"per_microbatch with b={b}" if smode == "per_microbatch" and b else smode
        gap = (
            " (the difference is the estimator gap Cov(n,l)/mean(n); measure it with `lossparity gap`)"
            if {smode, tmode} == {"per_token", "per_sample"}
            else ""
        )
        acc.warnings.append(
            f"LM objective: the source optimizes {what}, no setting of {cand.framework} gives it "
            f"(closest: {cand.name}, {tmode}){gap}"
        )
    if src.normalization != cand.normalization:
        acc.settings.append(f"(mechanism: {cand.normalization} instead of {src.normalization}; same objective)")
    return smode, tmode, tb


def _assess_mtp(src: Preset, cand: Preset, smode: str, tmode: str, acc: _Assessment) -> None:
    """The MTP objective convention and the per-depth MTP log."""
    if src.has_mtp != cand.has_mtp:
        acc.penalty += 1
        acc.conditions.append(f"no MTP: {cand.framework if src.has_mtp else src.name} has none")
        return
    if not src.has_mtp:
        return
    if _eff_conv(src.mtp_convention, smode) != _eff_conv(cand.mtp_convention, tmode):
        acc.penalty += 10
        acc.warnings.append(
            f"MTP objective: source convention {src.mtp_convention}, target {cand.mtp_convention} "
            "(exact only without MTP)"
        )
    if "mtp_loss" not in src.log_names:
        return
    if "mtp_loss" not in cand.log_names:
        acc.conditions.append(f"MTP logs are not compared: {cand.framework} logs no per-depth MTP loss")
    elif src.mtp_log_estimator != cand.mtp_log_estimator:
        acc.penalty += 10
        acc.warnings.append(
            f"MTP log: source estimator {src.mtp_log_estimator} ({src.log_names['mtp_loss']}), "
            f"target {cand.mtp_log_estimator} ({cand.log_names['mtp_loss']}): the per-depth MTP "
            "curves differ"
        )
    else:
        acc.logs.append(f"{src.log_names['mtp_loss']} <-> {cand.log_names['mtp_loss']}")


def _assess_logs(src: Preset, cand: Preset, smode: str, tmode: str, acc: _Assessment) -> None:
    """Which logged LM loss / objective of the two frameworks correspond."""
    if "lm_loss" in src.log_names:
        if "lm_loss" in cand.log_names:
            acc.logs.append(f"{src.log_names['lm_loss']} <-> {cand.log_names['lm_loss']} (global token mean S/Ntok)")
        elif tmode == "per_token" and "objective" in cand.log_names:
            acc.logs.append(
                f"{src.log_names['lm_loss']} <-> {cand.log_names['objective']} (the target's objective "
                "is the token mean; equal without MTP and aux terms)"
            )
            acc.conditions.append(
                f"no MTP or aux term in the compared curve: {cand.framework}'s logged loss includes them"
            )
        else:
            acc.penalty += 5
            acc.conditions.append(
                f"the source's {src.log_names['lm_loss']} (global token mean) has no counterpart: "
                f"{cand.framework} logs only its objective ({tmode})"
            )
    if "objective" in src.log_names and "objective" in cand.log_names and smode == tmode:
        acc.logs.append(f"{src.log_names['objective']} <-> {cand.log_names['objective']} (objective {tmode})")


def _assess_moe(src: Preset, cand: Preset, b: int | None, tb: int | None, acc: _Assessment) -> None:
    """The MoE load-balancing scope, the router z-loss form and Megatron's quirks."""
    ss, ts = _eff_scope(src.aux_scope, b), _eff_scope(cand.aux_scope, tb)
    if src.aux_scope == "none":
        if cand.aux_scope != "none":
            acc.settings.append(f"load-balancing loss off in {cand.framework} (coefficient 0)")
    elif cand.aux_scope == "none":
        acc.penalty += 3
        acc.conditions.append(f"no load-balancing loss in the source (coefficient 0): {cand.framework} has none")
    elif ss != ts:
        acc.penalty += 5
        acc.conditions.append(f"no load-balancing loss (coefficient 0): source scope {ss}, target {ts}")
    else:
        acc.conditions.append(f"load-balancing coefficient mapped: source {src.aux_note}; target {cand.aux_note}")
    if src.has_router_z_loss and not cand.has_router_z_loss:
        acc.penalty += 1
        acc.conditions.append(f"no router z-loss in the source: {cand.framework} has none")
    elif src.has_router_z_loss and src.z_form != cand.z_form:
        acc.penalty += 3
        acc.conditions.append(f"no router z-loss: source z form {src.z_form}, target {cand.z_form}")
    if src.megatron_quirks and not cand.megatron_quirks:
        acc.penalty += 1
        acc.conditions.append(_QUIRKS)


def _assess(src: Preset, cand: Preset, b: int | None) -> tuple[int, Translation]:
    """Rank one candidate preset as a translation of ``src`` (micro-batch size ``b``): ``(penalty, translation)``.

    Penalties: a different LM objective 100, a different MTP convention or MTP log estimator 10, an LM-loss
    log without counterpart 5, load-balancing scopes or z forms that differ 5/3, a missing feature 1; among
    equals, fewer conditions win (one point per ten), never over a real difference.
    """
    acc = _Assessment(
        settings=list(cand.settings),
        conditions=[f"source: {r}" for r in src.requires] + [f"target: {r}" for r in cand.requires],
    )
    smode, tmode, tb = _assess_mode(src, cand, b, acc)
    _assess_mtp(src, cand, smode, tmode, acc)
    _assess_logs(src, cand, smode, tmode, acc)
    _assess_moe(src, cand, b, tb, acc)
    penalty = acc.penalty + len(acc.conditions) // 10
    return penalty, Translation(
        source=src,
        target_framework="",
        microbatch_size=b,
        target=cand,
        settings=acc.settings,
        logs=acc.logs,
        conditions=acc.conditions,
        warnings=acc.warnings,
    )


def translate(source: Preset, target_framework: str, microbatch_size: int | None = None) -> Translation:
    """Find the settings of ``target_framework`` that reproduce ``source``'s objective and logs.

    ``target_framework`` is one of :data:`FRAMEWORKS` (every preset of that framework is a candidate and
    the closest is chosen) or a preset spec (only that preset). ``microbatch_size`` is the source's ``b``:
    it decides whether a ``per_microbatch`` source is ``per_sample`` (``b = 1``). The result's ``exact``
    is false, with warnings, when the target cannot reproduce the source (a different LM objective, MTP
    convention or MTP log estimator); optional terms the target handles differently become conditions.
    """
    if not isinstance(source, Preset):
        raise ValueError(f"source must be a Preset (use resolve_preset), got {type(source).__name__}")
    if microbatch_size is not None and microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    cands = _candidates(target_framework, source)
    best = min((_assess(source, c, microbatch_size) for c in cands), key=lambda x: x[0])[1]
    best.target_framework = target_framework.strip()
    return best
