"""Reference trainer: verify --quick, exact resume, recompute invariance, atomic checkpoints, CLI errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lossparity.checkpoint.checkpointer import atomic_save, load_latest, save_checkpoint
from lossparity.cli import main
from lossparity.options import MODES
from lossparity.training.trainer import TrainConfig, Trainer
from lossparity.verify.reference import QUICK_LAYOUTS, format_table, run_verify


def small_cfg(**kw) -> TrainConfig:
    base = dict(steps=4, global_batch=4, seq_len=32, packed=True, progress=False, tensorboard=False, warmup=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.slow
def test_verify_quick_all_pass(tmp_path):
    report = run_verify(QUICK_LAYOUTS, steps=2, progress=False)
    table = format_table(report)
    assert all(r["pass"] for r in report["rows"]), table
    # the multi-rank recompute layout really ran every mode
    modes = set(MODES)  # every mode, per_group (groups of 3 rows spanning ranks and microbatches) included
    assert {r["mode"] for r in report["rows"] if r["layout"] == "D2xK2+recompute"} == modes
    assert {r["mode"] for r in report["rows"] if r["layout"] == "C2xK2"} == modes  # context parallel
    assert {r["mode"] for r in report["rows"] if r["layout"] == "P2xV2xK2"} == modes  # interleaved pipeline


def test_resume_is_bit_exact(tmp_path):
    ref = Trainer(small_cfg(out=str(tmp_path / "a"), ckpt_interval=1))
    ref.fit()
    crashed = Trainer(small_cfg(out=str(tmp_path / "b"), ckpt_interval=1))
    with pytest.raises(KeyboardInterrupt):
        crashed.fit(crash_after=2)
    resumed = Trainer(small_cfg(out=str(tmp_path / "b"), ckpt_interval=1, resume=True))
    assert resumed.step == 0
    resumed.fit()
    assert resumed.step == 4
    for name, p in ref.raw.named_parameters():
        assert torch.equal(p, dict(resumed.raw.named_parameters())[name]), name
    for a, b in zip(ref.routers, resumed.routers):
        assert torch.equal(a.expert_bias, b.expert_bias)
    lines_a = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    lines_b = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert [x["step"] for x in lines_b] == [1, 2, 3, 4]
    skip = {"tokens_per_s", "step_time_s"}
    for x, y in zip(lines_a, lines_b):
        assert {k: v for k, v in x.items() if k not in skip} == {k: v for k, v in y.items() if k not in skip}


def test_recompute_changes_no_count_and_no_metric():
    runs = []
    for recompute in (False, True):
        t = Trainer(small_cfg(steps=2, ga=2, dtype="float64", recompute=recompute, bias_rate=1e-2))
        t.fit()
        runs.append(t)
    a, b = runs
    skip = {"tokens_per_s", "step_time_s"}
    for x, y in zip(a.history, b.history):
        for k in x:
            if k not in skip:
                assert x[k] == pytest.approx(y[k], rel=1e-12, abs=1e-15), k
    for ra, rb in zip(a.routers, b.routers):
        assert torch.equal(ra.expert_bias, rb.expert_bias)  # from integer dispatch counts: exact
    assert a.history[-1]["max_vio"] == b.history[-1]["max_vio"]


def test_atomic_save_keeps_previous_checkpoint_on_crash(tmp_path, monkeypatch):
    d = str(tmp_path)
    save_checkpoint(d, 1, {"x": torch.ones(3)})

    def broken_save(obj, f, *a, **k):
        f.write(b"partial garbage")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(d, 2, {"x": torch.zeros(3)})
    monkeypatch.undo()
    state = load_latest(d)
    assert torch.equal(state["x"], torch.ones(3))
    assert not [f for f in os.listdir(d) if f.startswith(".tmp-")]
    assert not os.path.exists(os.path.join(d, "step_00000002.pt"))
    atomic_save({"y": 1}, os.path.join(d, "z.pt"))
    assert torch.load(os.path.join(d, "z.pt"))["y"] == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--mode", "token_mean"], "unknown mode 'token_mean'; valid: per_token"),
        (["train", "--global-batch", "6", "--ga", "4"], "global_batch=6 is not divisible by dp*ga=1*4"),
        (["train", "--data", "no_such_file.jsonl"], "data file not found: no_such_file.jsonl"),
        (["train", "--model", "huge"], "unknown model preset 'huge'"),
        (["verify", "--modes", "per_token,bogus"], "unknown mode 'bogus'"),
        (["train", "--cp", "2", "--seq-len", "30"], "seq_len=30 must be divisible by 4 for cp=2"),
        (
            ["train", "--cp", "2", "--aux-scope", "sequence", "--mode", "per_document"],
            "cp=2 does not combine aux_scope 'sequence' with mode 'per_document'",
        ),
    ],
)
def test_bad_cli_input_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_train_writes_jsonl_schema(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--ga", "2", "--out", str(out), "--no-progress"]) == 0
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [x["step"] for x in lines] == [1, 2]
    for key in (
        "lm_loss",
        "objective",
        "tokens",
        "samples",
        "mtp_1_loss",
        "global_load_balancing_loss",
        "z_loss",
        "max_vio",
        "grad_norm",
        "lr",
        "tokens_per_s",
    ):
        assert key in lines[0], key


def test_dump_samples_matches_logged_lm_loss(tmp_path):
    from lossparity.parity.sample_dump import read_sample_dump

    t = Trainer(small_cfg(steps=2, ga=2, out=str(tmp_path), dump_samples=True, dtype="float64"))
    t.fit()
    dump = read_sample_dump(str(tmp_path / "samples"))
    assert sorted(dump) == [1, 2]
    for line in t.history:
        rows, n, s = dump[line["step"]]
        assert rows.tolist() == list(range(4))
        assert float(n.sum()) == line["tokens"]
        assert float(s.sum() / n.sum()) == pytest.approx(line["lm_loss"], rel=1e-12)


def test_trainer_run_compared_with_itself_under_two_layouts_passes(tmp_path, capsys):
    # Two layouts of the same run (K=1 vs K=4, float64) through `lossparity compare`: parity, exit 0.
    for name, ga in (("a", 1), ("b", 4)):
        assert (
            main(
                [
                    "train",
                    "--steps",
                    "3",
                    "--ga",
                    str(ga),
                    "--dtype",
                    "float64",
                    "--packed",
                    "--seq-len",
                    "32",
                    "--out",
                    str(tmp_path / name),
                    "--no-progress",
                ]
            )
            == 0
        )
    capsys.readouterr()
    rc = main(
        [
            "compare",
            str(tmp_path / "a" / "metrics.jsonl"),
            str(tmp_path / "b" / "metrics.jsonl"),
            "--tol",
            "*=1e-10",
            "--report",
            str(tmp_path / "report"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "lm_loss" in out and (tmp_path / "report" / "summary.md").exists()


def test_mtp_weight_schedule_and_bias_freeze():
    t = Trainer(
        small_cfg(steps=3, mtp_weight=0.3, mtp_weight_after=0.1, mtp_switch_step=2, bias_freeze_step=1, bias_rate=0.5)
    )
    t.fit(steps=1)
    bias_after_1 = [r.expert_bias.clone() for r in t.routers]
    t.fit()
    assert [line["mtp_weight"] for line in t.history] == [0.3, 0.3, 0.1]
    assert any(b.abs().sum() > 0 for b in bias_after_1)  # updated at step 0 with rate 0.5
    assert all(torch.equal(a, r.expert_bias) for a, r in zip(bias_after_1, t.routers))  # frozen from step 1


def _sharded_resume(rank: int, world: int, out: str, engine: str, tp: int) -> dict:
    kw = dict(engine=engine, tp=tp, dp=world // tp, ckpt_interval=1, dtype="float64")
    ref = Trainer(small_cfg(out=out + "/a", **kw))
    ref.fit()
    crashed = Trainer(small_cfg(out=out + "/b", **kw))
    try:
        crashed.fit(crash_after=2)
    except KeyboardInterrupt:
        pass
    resumed = Trainer(small_cfg(out=out + "/b", resume=True, **kw))
    resumed.fit()
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in resumed.raw.named_parameters()
    }
    full_ref = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in ref.raw.named_parameters()
    }
    skip = {"tokens_per_s", "step_time_s"}
    return {
        "params_equal": all(torch.equal(full[n], full_ref[n]) for n in full),
        "resumed_from": 2,
        "logs_equal": [{k: v for k, v in x.items() if k not in skip} for x in ref.history[2:]]
        == [{k: v for k, v in x.items() if k not in skip} for x in resumed.history],
    }


@pytest.mark.slow
@pytest.mark.parametrize("engine, tp", [("fsdp", 1), ("plain", 2)])
def test_sharded_checkpoint_resume_is_exact(tmp_path, engine, tp):
    from lossparity.distributed.launch import spawn

    out = spawn(_sharded_resume, 2, str(tmp_path), engine, tp, timeout_s=120)
    for r in out:
        assert r["params_equal"] and r["logs_equal"], r


def test_megatron_quirks_under_cp_or_sp_are_refused_by_the_config():
    # Megatron shards its MoE terms its own way (z coefficient / |TP×CP| on each shard's mean): the exact
    # forms run under CP/SP, the quirks preset does not pretend to.
    from lossparity.training.config import TrainConfig

    for kw in ({"cp": 2}, {"tp": 2, "sp": True}):
        with pytest.raises(ValueError, match="megatron_quirks=True is not reproduced under context parallelism"):
            TrainConfig(megatron_quirks=True, z_form="microbatch", **kw).validate()
    TrainConfig(cp=2, megatron_quirks=True, aux_scope="none", z_coeff=0.0).validate()  # no MoE term: nothing to refuse


def test_trainer_refuses_dims_of_another_layout():
    # Before: Trainer(cfg, dims) ran the layout of dims while config.json recorded the one of cfg.
    from lossparity.distributed.parallel_dims import ParallelDims

    with pytest.raises(
        ValueError, match=r"dims does not describe the layout of cfg \(engine: config 'ddp', dims 'fsdp'\)"
    ):
        Trainer(small_cfg(), ParallelDims(engine="fsdp"))


def test_trainer_reads_the_layout_only_from_parallel_dims():
    import re
    from pathlib import Path

    import lossparity.training.trainer as trainer_module

    text = Path(trainer_module.__file__).read_text()
    assert not re.findall(r"\bcfg\.(dp|cp|tp|pp|ep|sp)\b", text)


def test_validate_states_the_library_rules_with_the_library_messages():
    # Before: TrainConfig.validate() restated these rules with its own wording, and the indexer rule was
    # checked only when a Trainer was built.
    from lossparity.model.context_parallel import shard_columns

    with pytest.raises(ValueError) as lib:
        shard_columns(30, 2, 0)
    with pytest.raises(ValueError) as cfg:
        small_cfg(cp=2, seq_len=30).validate()
    assert str(cfg.value) == str(lib.value) == "seq_len=30 must be divisible by 4 for cp=2 (zig-zag sharding)"
    with pytest.raises(ValueError, match="normalization='deferred' knows only after the backward"):
        small_cfg(normalization="deferred", model_overrides={"indexer_layer": 0}, indexer_coeff=0.1).validate()
    small_cfg(normalization="deferred", model_overrides={"indexer_layer": 0}, indexer_coeff=0.0).validate()


def test_field_types_come_from_the_type_hints(capsys):
    from lossparity.training.config import check_field, field_type

    assert field_type("mtp_switch_step") == (int, True)
    assert field_type("lr") == (float, False)
    assert field_type("mode") == (str, False)  # a Literal option
    assert field_type("model_overrides") == (dict, False)
    with pytest.raises(TypeError, match=r"mtp_switch_step must be int \| None, got 1.5"):
        check_field("mtp_switch_step", 1.5)
    with pytest.raises(TypeError, match="sp must be bool, got 1"):
        check_field("sp", 1)
    assert main(["train", "--mtp-switch-step", "x"]) == 2  # the CLI converts with the hinted type
    assert "--mtp-switch-step: invalid int value: 'x'" in capsys.readouterr().err
