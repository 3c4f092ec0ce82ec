"""Refusals and lossparity's own arguments: one line, exit status 2, before MaxText's first step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _runs import BASE_YML, MODEL

import lossparity.maxtext as lpm
from lossparity.maxtext.__main__ import main


def test_vocab_tiling_refused_before_the_first_step(tmp_path, capsys) -> None:  # noqa: ANN001
    metrics = tmp_path / "m.jsonl"
    argv = [BASE_YML, "run_name=r", f"base_output_directory={tmp_path}", f"metrics_file={metrics}", "steps=1"]
    rc = main([*argv, *MODEL, "num_vocab_tiling=2", "--lp-mode", "per_sample"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("lossparity.maxtext --lp-mode per_sample refused: num_vocab_tiling=2 > 1")
    assert not metrics.exists()  # no step ran


@pytest.mark.parametrize(
    ("setting", "text"),
    [
        ({"use_dpo": True}, "use_dpo=true"),
        ({"training_objective": "block_diffusion"}, "block_diffusion"),
        ({"use_indexer": True, "indexer_sparse_training": False}, "indexer dense warm-up"),
        ({"enable_diloco": True}, "enable_diloco=true"),
    ],
)
def test_features_the_hook_cannot_make_exact_are_refused(setting: dict, text: str) -> None:
    config = SimpleNamespace(num_vocab_tiling=1, **setting)
    with pytest.raises(lpm.MaxTextRefusal, match=text):
        lpm.check_config(config, "per_sample")
    lpm.check_config(config, "per_token")  # per_token installs nothing and refuses nothing


def test_calculate_per_token_loss_field_is_detected_by_name() -> None:
    from lossparity.maxtext._hook import _mode_from_config

    assert _mode_from_config(SimpleNamespace(), None) == "per_sample"
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
