"""Refusals and lossparity's own arguments: one line, exit status 2, before MaxText's first step.

Every refused setting goes through MaxText's own parser (``pyconfig.initialize``: base.yml, a model config
where named, the command-line overrides, MaxText's validation), so the refused combinations are ones that
MaxText 0.2.5 accepts from a user's command line or shipped model config.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _runs import BASE_YML, INDEXER, MODEL
from maxtext.configs import pyconfig

import lossparity.maxtext as lpm
from lossparity.maxtext.__main__ import main

ARGV = [BASE_YML, "run_name=r", "steps=1", *MODEL]
REFUSED = "lossparity.maxtext --lp-mode per_sample refused: "
TILING = (
    "num_vocab_tiling=2 > 1 returns only the summed loss, not the per-token loss that per_sample needs; "
    "set num_vocab_tiling=1"
)
DILOCO = "enable_diloco=true runs its own inner step, which the hook does not cover"
DIFFUSION = (
    "training_objective='block_diffusion': only the causal LM loss is hooked "
    "(block diffusion weighs tokens by its own corruption mask)"
)
WARMUP = "the indexer dense warm-up (use_indexer=true, indexer_sparse_training=false) has no LM loss"
DPO = "use_dpo=true: DPO's preference loss is not a per-token LM loss"
# what MaxText's validation requires beside them: block diffusion its own attention, a mask token and the hf
# pipeline (hf_path is never opened: the refusal comes first); the indexer MLA with a query LoRA
BLOCK_DIFFUSION = [
    "training_objective=block_diffusion",
    "attention_type=block_diffusion",
    "block_diffusion_mask_id=1",
    "dataset_type=hf",
    "hf_path=unused",
]
DENSE_WARMUP = [*INDEXER, "indexer_sparse_training=false", "indexer_loss_scaling_factor=1.0"]


def parse(*overrides: str) -> Any:
    """MaxText's parsed config of ``ARGV`` plus ``overrides`` (nothing built, nothing written)."""
    return pyconfig.initialize(["train", *ARGV, "base_output_directory=unused", *overrides])


@pytest.mark.parametrize(
    ("overrides", "problems"),
    [
        (["num_vocab_tiling=2"], [TILING]),
        (["enable_diloco=true"], [DILOCO]),
        (BLOCK_DIFFUSION, [DIFFUSION]),
        (DENSE_WARMUP, [WARMUP]),
        (["enable_diloco=true", "num_vocab_tiling=2"], [TILING, DILOCO]),
    ],
    ids=["vocab_tiling", "diloco", "block_diffusion", "indexer_dense_warmup", "two_at_once"],
)
def test_refused_from_maxtexts_parsed_config_before_the_first_step(
    overrides: list[str], problems: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "m.jsonl"
    argv = [*ARGV, f"base_output_directory={tmp_path}", f"metrics_file={metrics}", *overrides]
    rc = main([*argv, "--lp-mode", "per_sample"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == REFUSED + "; ".join(problems)
    assert not metrics.exists()  # no step ran
    lpm.check_config(parse(*overrides), "per_token")  # per_token installs nothing and refuses nothing


def test_dpo_is_refused_by_maxtexts_train_itself_and_by_the_hook(tmp_path) -> None:  # noqa: ANN001
    """MaxText 0.2.5's pre-training ``initialize`` rejects ``use_dpo`` itself (DPO moved to its post-training
    trainer) before lossparity's check runs; the hook's refusal still covers a fork whose train module runs
    DPO (``install(train_module=...)``): the parsed config is refused."""
    metrics = tmp_path / "m.jsonl"
    argv = [*ARGV, f"base_output_directory={tmp_path}", f"metrics_file={metrics}", "use_dpo=true"]
    with pytest.raises(ValueError, match="Legacy DPO implementation in train.py is removed"):
        main([*argv, "--lp-mode", "per_sample"])
    assert not metrics.exists()
    with pytest.raises(lpm.MaxTextRefusal) as refusal:
        lpm.check_config(parse("use_dpo=true"), "per_sample")
    assert str(refusal.value) == REFUSED + DPO


def test_shipped_deepseek32_config_is_refused_until_sparse_training() -> None:
    """MaxText's own DeepSeek-V3.2 model config turns the indexer on and leaves ``indexer_sparse_training`` at
    base.yml's false (the dense warm-up, which trains no LM loss): refused; with the sparse stage, accepted."""
    shipped = ["model_name=deepseek3.2-671b", "attention=dot_product"]  # dot_product: the CPU's attention

    def parsed(*more: str) -> Any:
        return pyconfig.initialize(["train", BASE_YML, "run_name=r", "base_output_directory=unused", *shipped, *more])

    warmup = parsed()
    assert warmup.use_indexer and not warmup.indexer_sparse_training
    with pytest.raises(lpm.MaxTextRefusal) as refusal:
        lpm.check_config(warmup, "per_sample")
    assert str(refusal.value) == REFUSED + WARMUP
    lpm.check_config(parsed("indexer_sparse_training=true"), "per_sample")  # the stage the hook trains


def test_calculate_per_token_loss_field_is_detected_by_name() -> None:
    from lossparity.maxtext._hook import _mode_from_config

    config = parse()
    assert not hasattr(config, "calculate_per_token_loss")  # MaxText 0.2.5 has no such field
    assert _mode_from_config(config, None) == "per_sample"
    assert _mode_from_config(config, "per_document") == "per_document"
    # a release with the field (none installed here, so a stand-in object): the field decides
    assert _mode_from_config(SimpleNamespace(calculate_per_token_loss=False), None) == "per_sample"
    assert _mode_from_config(SimpleNamespace(calculate_per_token_loss=True), None) == "per_token"
    with pytest.raises(lpm.MaxTextRefusal, match="contradicts calculate_per_token_loss=True"):
        _mode_from_config(SimpleNamespace(calculate_per_token_loss=True), "per_sample")


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--lp-mode", "per_row"], "--lp-mode: expected one of per_token, per_sample, per_document"),
        (["--lp-mode"], "--lp-mode needs a value"),
        (["--lp-bogus=1"], "unknown option --lp-bogus"),
    ],
)
def test_bad_lp_arguments_exit_2_with_one_line(argv: list[str], text: str, capsys) -> None:  # noqa: ANN001
    assert main(["base.yml", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0]


def test_split_argv_keeps_maxtext_arguments_in_order() -> None:
    rest, opts = lpm.split_argv(
        ["base.yml", "steps=3", "--lp-mode=per_document", "x=1", "--lp-mtp-convention", "pooled"]
    )
    assert rest == ["base.yml", "steps=3", "x=1"]
    assert opts == {"mode": "per_document", "mtp-convention": "pooled"}
