"""Framework presets: every spec resolves to the documented semantics, bad specs list the valid choices, and the
translation examples of the README (exact / approximate) hold."""

from __future__ import annotations

import argparse

import pytest
import torch

from lossparity.cli.parity import add_modes_arguments, cmd_modes
from lossparity.distributed.accountant import GRAD_REDUCTIONS, NORMALIZATIONS, Accountant
from lossparity.distributed.moe.accounting import SCOPES, Z_FORMS
from lossparity.losses.modes import MODES, objective
from lossparity.losses.mtp import CONVENTIONS
from lossparity.parity.presets import (
    PRESET_NAMES,
    all_presets,
    preset_table,
    resolve_preset,
    translate,
)
from lossparity.training.trainer import TrainConfig

# spec -> (mode, normalization, mtp_convention, mtp_log_estimator, aux_scope, z_form), from semantics §1/§4/§5 and the
# framework facts recorded in the presets' notes
EXPECTED = {
    "megatron:calculate_per_token_loss=false": (
        "per_microbatch",
        "precount",
        "own",
        "microbatch_mean",
        "microbatch",
        "microbatch",
    ),
    "megatron:calculate_per_token_loss=true": (
        "per_token",
        "deferred",
        "main",
        "microbatch_mean",
        "microbatch",
        "microbatch",
    ),
    "megatron:calculate_per_token_loss=false,moe_router_load_balancing_type=seq_aux_loss": (
        "per_microbatch",
        "precount",
        "own",
        "microbatch_mean",
        "sequence",
        "microbatch",
    ),
    "megatron:calculate_per_token_loss=true,moe_router_load_balancing_type=global_aux_loss": (
        "per_token",
        "deferred",
        "main",
        "microbatch_mean",
        "global_running",
        "microbatch",
    ),
    "maxtext": ("per_token", "precount", "pooled", "token_mean", "sequence", "global"),
    "maxtext:calculate_per_token_loss=true": ("per_token", "precount", "main", "token_mean", "sequence", "global"),
    "maxtext:calculate_per_token_loss=false": (
        "per_sample",
        "precount",
        "own",
        "microbatch_mean",
        "sequence",
        "global",
    ),
    "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=true": (
        "per_sample",
        "precount",
        "own",
        "microbatch_mean",
        "sequence",
        "global",
    ),
    "maxtext:calculate_per_token_loss=false,mtp_per_layer_loss_norm=false": (
        "per_sample",
        "precount",
        "pooled",
        "microbatch_mean",
        "sequence",
        "global",
    ),
    "hf-trainer": ("per_token", "precount", "own", "token_mean", "microbatch", "microbatch"),
    "hf-trainer-legacy": ("per_microbatch", "precount", "own", "token_mean", "microbatch", "microbatch"),
    "torchtitan": ("per_token", "precount", "main", "token_mean", "none", "global"),
    "verl:token-mean": ("per_token", "precount", "own", "token_mean", "none", "global"),
    "verl:token-mean,use_legacy_worker_impl=enable": (
        "per_microbatch",
        "precount",
        "own",
        "token_mean",
        "none",
        "global",
    ),
    "verl:token-sum": ("token_sum", "precount", "own", "token_mean", "none", "global"),
    "verl<0.8:token-mean": ("per_microbatch", "precount", "own", "token_mean", "none", "global"),
    "verl<0.8:seq-mean-token-sum-norm": ("sample_sum_norm", "precount", "own", "token_mean", "none", "global"),
    "trl-grpo:grpo": ("per_sample", "precount", "own", "token_mean", "none", "global"),
    "trl-grpo:bnpo": ("per_microbatch", "precount", "own", "token_mean", "none", "global"),
    "trl-grpo:dr_grpo": ("sample_sum_norm", "precount", "own", "token_mean", "none", "global"),
    "trl-grpo:dapo": ("per_token", "precount", "own", "token_mean", "none", "global"),
    "trl-grpo:luspo": ("sample_sum", "precount", "own", "token_mean", "none", "global"),
    "openrlhf:token-mean": ("per_token", "precount", "own", "token_mean", "none", "global"),
    "openrlhf:seq-mean-token-mean": ("per_sample", "precount", "own", "token_mean", "none", "global"),
    "verl:seq-mean-token-mean": ("per_sample", "precount", "own", "token_mean", "none", "global"),
    "verl:seq-mean-token-sum": ("sample_sum", "precount", "own", "token_mean", "none", "global"),
    "verl:seq-mean-token-sum-norm": ("sample_sum_norm", "precount", "own", "token_mean", "none", "global"),
    "verl-seq-mean-token-mean": ("per_sample", "precount", "own", "token_mean", "none", "global"),
    "lossparity": ("per_token", "precount", "own", "token_mean", "global_lagged", "global"),
}


@pytest.mark.parametrize("spec", sorted(EXPECTED))
def test_preset_resolves_to_documented_semantics(spec: str) -> None:
    p = resolve_preset(spec)
    got = (p.mode, p.normalization, p.mtp_convention, p.mtp_log_estimator, p.aux_scope, p.z_form)
    assert got == EXPECTED[spec]
    assert p.megatron_quirks == spec.startswith("megatron")


def test_every_preset_is_valid_and_documented() -> None:
    presets = all_presets()
    assert {p.framework for p in presets} == {
        "megatron",
        "maxtext",
        "hf-trainer",
        "torchtitan",
        "verl",
        "trl",
        "openrlhf",
        "lossparity",
    }
    for p in presets:
        assert p.mode in MODES and p.normalization in NORMALIZATIONS and p.mtp_convention in CONVENTIONS
        assert p.aux_scope in SCOPES and p.z_form in Z_FORMS and p.grad_reduction in GRAD_REDUCTIONS
        assert p.mtp_log_estimator in ("token_mean", "microbatch_mean")
        assert p.description and p.notes and p.settings, p.name
        if p.framework != "lossparity":
            assert any(n.startswith(("verified", "assumed", "checked")) for n in p.notes), p.name
        assert resolve_preset(p.name) == p  # the canonical name round-trips
        kw = p.accountant_kwargs()
        if p.mode == "sample_sum_norm" and "fixed_length" not in kw:
            kw["fixed_length"] = 16
        acc = Accountant(**kw, mtp_depths=1 if p.has_mtp else 0, device="cpu")
        assert acc.mode == p.mode
        cfg = TrainConfig(**p.train_config_fields())
        cfg.validate()
        assert (cfg.mode, cfg.aux_scope, cfg.z_form) == (p.mode, p.aux_scope, p.z_form)


def test_lossparity_preset_overrides() -> None:
    p = resolve_preset("lossparity:mode=sample_sum_norm,fixed_length=128,aux_scope=sequence")
    assert (p.mode, p.fixed_length, p.aux_scope, p.mtp_convention) == ("sample_sum_norm", 128, "sequence", "own")
    assert p.train_config_fields()["fixed_length"] == 128
    assert resolve_preset("verl:seq-mean-token-sum-norm,loss_scale_factor=512").fixed_length == 512


@pytest.mark.parametrize("spec", ["megatrom", "hf", "titan:foo=1", "", "verl:token_mean"])
def test_unknown_names_list_the_valid_ones(spec: str) -> None:
    with pytest.raises(ValueError) as e:
        resolve_preset(spec)
    msg = str(e.value)
    if spec.startswith("verl"):
        assert "token-mean" in msg and "seq-mean-token-sum-norm" in msg
    else:
        assert all(name in msg for name in PRESET_NAMES)


def test_bad_options_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid options: calculate_per_token_loss, moe_router_load_balancing_type"):
        resolve_preset("megatron:micro_batch_size=1")
    with pytest.raises(ValueError, match="expected true or false"):
        resolve_preset("megatron:calculate_per_token_loss=maybe")
    with pytest.raises(ValueError, match="aux_loss, seq_aux_loss, global_aux_loss, none"):
        resolve_preset("megatron:moe_router_load_balancing_type=sinkhorn")
    with pytest.raises(ValueError, match="needs calculate_per_token_loss=false"):
        resolve_preset("maxtext:mtp_per_layer_loss_norm=true")
    with pytest.raises(ValueError, match="needs a loss_agg_mode"):
        resolve_preset("verl")
    with pytest.raises(ValueError, match="needs a loss_type.*grpo, sapo, bnpo, dr_grpo, dapo, cispo, vespo, luspo"):
        resolve_preset("trl-grpo")
    with pytest.raises(ValueError, match="valid values: " + ", ".join(MODES)):
        resolve_preset("lossparity:mode=per_word")
    with pytest.raises(ValueError, match="given twice"):
        resolve_preset("megatron:calculate_per_token_loss=true,calculate_per_token_loss=false")


def test_megatron_false_b1_is_per_sample() -> None:
    # The fact behind the b=1 translations: the mean of one-sample microbatch means is the per-sample mean.
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(6, 10, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 10, generator=g) > 0.4).double()
    mask[2] = 0.0
    per_sample = sum(float((loss[i] * mask[i]).sum() / max(float(mask[i].sum()), 1.0)) for i in range(6)) / 6
    assert float(objective("per_microbatch", loss, mask, microbatch_size=1)) == pytest.approx(per_sample, abs=1e-14)


def test_translation_megatron_false_b1_to_maxtext_is_exact() -> None:
    tr = translate(resolve_preset("megatron:calculate_per_token_loss=false"), "maxtext", microbatch_size=1)
    assert tr.exact and not tr.warnings
    assert tr.target.mode == "per_sample" and tr.target.mtp_convention == "own"
    assert "calculate_per_token_loss=false" in tr.settings and "mtp_per_layer_loss_norm=true" in tr.settings
    assert any("learning/lm_loss" in line for line in tr.logs)
    assert any("router z-loss" in c for c in tr.conditions)  # MaxText has none: a condition, not a mismatch


def test_translation_megatron_false_b4_to_maxtext_warns() -> None:
    tr = translate(resolve_preset("megatron:calculate_per_token_loss=false"), "maxtext", microbatch_size=4)
    assert not tr.exact
    assert any("per_microbatch with b=4" in w for w in tr.warnings)
    unknown_b = translate(resolve_preset("megatron:calculate_per_token_loss=false"), "maxtext")
    assert not unknown_b.exact and any("--microbatch-size" in w for w in unknown_b.warnings)


def test_translation_hf_legacy_to_torchtitan_warns() -> None:
    tr = translate(resolve_preset("hf-trainer-legacy"), "torchtitan")
    assert not tr.exact
    assert any("per_microbatch" in w and "torchtitan" in w for w in tr.warnings)


def test_translation_examples_that_are_exact() -> None:
    tr = translate(resolve_preset("megatron:calculate_per_token_loss=false"), "hf-trainer", microbatch_size=1)
    assert tr.exact and tr.target.name == "hf-trainer-legacy"
    assert "per_device_train_batch_size=1" in tr.settings
    tr = translate(resolve_preset("megatron:calculate_per_token_loss=true"), "torchtitan")
    assert tr.exact and tr.target.mtp_convention == "main"
    tr = translate(resolve_preset("hf-trainer-legacy"), "megatron", microbatch_size=4)
    assert tr.exact and tr.target.mode == "per_microbatch" and "--micro-batch-size 4" in tr.settings
    tr = translate(resolve_preset("maxtext"), "lossparity")
    assert tr.exact and tr.target.mtp_convention == "pooled"


def test_translation_mtp_log_estimators_that_differ_warn() -> None:
    tr = translate(resolve_preset("megatron:calculate_per_token_loss=true"), "maxtext")
    assert tr.target.mode == "per_token" and tr.target.mtp_convention == "main"
    assert not tr.exact and any("MTP log" in w for w in tr.warnings)


def test_translation_bad_input() -> None:
    with pytest.raises(ValueError, match="valid targets: megatron, maxtext, hf-trainer, torchtitan, verl"):
        translate(resolve_preset("lossparity"), "deepspeed")
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        translate(resolve_preset("lossparity"), "maxtext", microbatch_size=0)


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    add_modes_arguments(p)
    return cmd_modes(p.parse_args(argv))


def test_modes_translation_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--from", "megatron:calculate_per_token_loss=false", "--to", "maxtext", "--microbatch-size", "1"]) == 0
    assert "EXACT" in capsys.readouterr().out
    assert _run(["--from", "megatron:calculate_per_token_loss=false", "--to", "maxtext", "--microbatch-size", "4"]) == 1
    out = capsys.readouterr().out
    assert "APPROXIMATE" in out and "warnings:" in out
    assert _run(["--from", "nemo", "--to", "maxtext"]) == 2
    assert "valid presets" in capsys.readouterr().err
    assert _run(["--from", "maxtext"]) == 2
    assert _run(["--presets"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("| preset | mode | normalization | MTP convention |")
    assert len(table.strip().splitlines()) == 2 + len(all_presets())


def test_preset_table_has_one_row_per_preset() -> None:
    table = preset_table()
    for p in all_presets():
        assert f"| `{p.name}` | `{p.mode}` |" in table


def test_rl_presets_state_each_terms_convention() -> None:
    """The conventions read in the frameworks' code (semantics §9): epsilon, empty rows, the entropy's scope."""
    assert resolve_preset("trl-grpo:dr_grpo,max_completion_length=64").fixed_length == 64
    dapo = resolve_preset("trl-grpo:dapo")
    assert dapo.terms == {"policy": "per_token", "kl": "per_token", "entropy": "per_microbatch"}
    o = resolve_preset("openrlhf:seq-mean-token-mean")
    assert (o.epsilon, o.empty_rows) == (1e-8, "drop")
    v = resolve_preset("verl:seq-mean-token-mean")
    assert (v.epsilon, v.empty_rows, v.terms["entropy"]) == (1e-8, "count", "per_sample")
    legacy = resolve_preset("verl<0.8:seq-mean-token-sum-norm")
    assert legacy.empty_rows == "drop" and not any("without a 1/N" in n for n in legacy.notes)
    assert resolve_preset("verl:seq-mean-token-sum-norm,use_legacy_worker_impl=enable").name == (
        "verl<0.8:seq-mean-token-sum-norm"
    )
