"""Reliability of the reference trainer (issue 18): run logs, the run-folder contract, checkpoint file
management, config validation and the train CLI. Each test reproduces a failure seen before the fix."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import numpy as np
import pytest
import torch

from lossparity.checkpoint.checkpointer import load_latest, save_checkpoint
from lossparity.checkpoint.folder import RunDirError, list_checkpoints, rotate_checkpoints
from lossparity.cli import main
from lossparity.parity.sample_dump import RECORD_BYTES, SampleDumpWriter, read_sample_dump
from lossparity.training.config import TrainConfig, numbers_mismatch
from lossparity.training.runlog import MetricsLog, truncate_metrics
from lossparity.training.trainer import Trainer

SKIP = {"tokens_per_s", "step_time_s"}


def small_cfg(**kw) -> TrainConfig:
    base = dict(steps=3, global_batch=4, seq_len=32, packed=True, progress=False, tensorboard=False, warmup=1)
    base.update(kw)
    return TrainConfig(**base)


def metrics(path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in SKIP} for x in open(path)]


def _write_lines(path, steps, torn: str = "") -> None:
    with open(path, "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "lm_loss": 1.0 / s}) + "\n")
        f.write(torn)


# ---------------------------------------------------------------- metrics log
def test_resume_truncation_failure_keeps_every_line(tmp_path, monkeypatch):
    # Before: the log was reopened with "w" and the kept lines written back: a crash or a full disk in
    # that window left 0 of 17 lines. Now the kept lines go to a temporary file renamed over the old one.
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, range(1, 18))
    before = path.read_bytes()

    def full_disk(fd):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        MetricsLog(str(tmp_path), 10, tensorboard=False)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [f for f in os.listdir(tmp_path) if f != "metrics.jsonl"] == []  # no temporary file left behind


def test_torn_last_line_is_dropped_with_a_note(tmp_path):
    # Before: a kill in the middle of a write made --resume fail with JSONDecodeError.
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, range(1, 6), torn='{"step": 6, "lm_lo')
    with pytest.warns(UserWarning, match="torn last line"):
        log = MetricsLog(str(tmp_path), 4, tensorboard=False)
    log.write({"step": 5, "lm_loss": 0.5})
    log.close()
    assert [x["step"] for x in metrics(path)] == [1, 2, 3, 4, 5]
    # a broken line in the middle is not a torn write: it is named with file:line
    _write_lines(path, [1], torn="garbage\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics line"):
        truncate_metrics(str(path), 2)


def test_sample_dump_resume_drops_torn_record_atomically(tmp_path):
    with SampleDumpWriter(tmp_path, 0) as w:
        for step in (1, 2, 3):
            w.write(step, np.arange(2), np.array([3, 4]), np.array([1.5, 2.5]))
    path = tmp_path / "samples_rank0.bin"
    with open(path, "ab") as f:
        f.write(b"\x00" * (RECORD_BYTES // 2))  # a kill mid-record
    with pytest.warns(UserWarning, match="torn last record"):
        w = SampleDumpWriter(tmp_path, 0, resume_step=2)
    w.write(3, np.arange(2), np.array([5, 6]), np.array([0.5, 0.25]))
    w.close()
    dump = read_sample_dump(str(tmp_path))
    assert sorted(dump) == [1, 2, 3]
    assert dump[3][1].tolist() == [5.0, 6.0]


def test_logs_and_sample_records_are_on_disk_when_a_checkpoint_is_written(tmp_path, monkeypatch):
    # Before: --dump-samples records were buffered and never flushed before a checkpoint: a crash after
    # the checkpoint lost records of steps the resume does not recompute.
    seen = []
    original = Trainer.save

    def spy(self, ckpt_dir):
        n_lines = sum(1 for _ in open(tmp_path / "metrics.jsonl"))
        size = os.path.getsize(tmp_path / "samples" / "samples_rank0.bin")
        seen.append((self.step, n_lines, size // RECORD_BYTES))
        original(self, ckpt_dir)

    monkeypatch.setattr(Trainer, "save", spy)
    Trainer(small_cfg(out=str(tmp_path), ckpt_interval=1, dump_samples=True)).fit()
    assert seen == [(s, s, 4 * s) for s in (1, 2, 3)]


# ---------------------------------------------------------------- the run folder
def test_new_run_into_a_non_empty_folder_refuses_and_overwrite_replaces(tmp_path):
    out = str(tmp_path / "run")
    Trainer(small_cfg(out=out, steps=2, ckpt_interval=1)).fit()
    with pytest.raises(RunDirError, match="is not empty .*--resume.*--overwrite"):
        Trainer(small_cfg(out=out, steps=1)).fit()
    assert len(metrics(os.path.join(out, "metrics.jsonl"))) == 2  # untouched
    Trainer(small_cfg(out=out, steps=1, overwrite=True)).fit()
    assert [x["step"] for x in metrics(os.path.join(out, "metrics.jsonl"))] == [1]
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # the old run's checkpoints are gone


def test_resume_refuses_a_numbers_mismatch_naming_the_fields_and_accepts_a_layout_change(tmp_path):
    out = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        Trainer(small_cfg(out=out, ckpt_interval=1, dtype="float64")).fit(crash_after=2)
    with pytest.raises(RunDirError, match=r"mode: 'per_token' -> 'per_sample'; seed: 0 -> 1"):
        Trainer(small_cfg(out=out, ckpt_interval=1, dtype="float64", mode="per_sample", seed=1, resume=True)).fit()
    # another layout (K=2) resumes and gives the numbers of the uninterrupted K=1 run
    resumed = Trainer(small_cfg(out=out, ckpt_interval=1, dtype="float64", ga=2, resume=True))
    resumed.fit()
    ref = Trainer(small_cfg(dtype="float64"))
    ref.fit()
    got = metrics(os.path.join(out, "metrics.jsonl"))
    assert [x["step"] for x in got] == [1, 2, 3]
    for a, b in zip(ref.history, got):
        for k in ("lm_loss", "objective", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-10), k


def test_per_microbatch_resume_compares_the_microbatch_size():
    saved = dataclasses.asdict(small_cfg(mode="per_microbatch", ga=2).resolved())
    assert numbers_mismatch(saved, small_cfg(mode="per_microbatch", dp=2).resolved()) == []  # b = 2 both
    diffs = numbers_mismatch(saved, small_cfg(mode="per_microbatch", ga=4).resolved())
    assert len(diffs) == 1 and diffs[0].startswith("microbatch_size")
    assert numbers_mismatch(dataclasses.asdict(small_cfg().resolved()), small_cfg(ga=2).resolved()) == []


def test_rotation_by_step_number_keeps_the_new_checkpoint(tmp_path):
    # Before: a new run into a folder holding a longer run's step_..10/20 checkpoints deleted its own
    # newest one (rotation sorted by file name) and left `latest` dangling.
    d = str(tmp_path)
    for step in (10, 20):
        save_checkpoint(d, step, {"step": step})
    save_checkpoint(d, 2, {"step": 2})
    assert [s for s, _ in list_checkpoints(d)] == [2]
    assert load_latest(d)["step"] == 2
    # folders (sharded checkpoints) rotate the same way, and 100 sorts after 99
    for step in (7, 99, 100):
        os.makedirs(os.path.join(d, f"step_{step}"))
    assert rotate_checkpoints(d, keep=2, current_step=100) == ["step_7", "step_00000002.pt"]  # newest first
    assert [s for s, _ in list_checkpoints(d)] == [100, 99]


def test_corrupt_or_empty_checkpoint_falls_back_to_the_previous_intact_one(tmp_path):
    d = str(tmp_path)
    save_checkpoint(d, 1, {"step": 1})
    save_checkpoint(d, 2, {"step": 2})
    open(os.path.join(d, "latest"), "w").close()  # empty `latest`: before IsADirectoryError
    with pytest.warns(UserWarning, match="latest is empty"):
        assert load_latest(d)["step"] == 2
    open(os.path.join(d, "step_00000002.pt"), "w").close()  # zero-length: before EOFError
    with pytest.warns(UserWarning, match="step_00000002.pt cannot be read"):
        assert load_latest(d)["step"] == 1
    with open(os.path.join(d, "step_00000001.pt"), "r+b") as f:
        f.truncate(100)  # corrupt: before a torch traceback
    with pytest.raises(RunDirError, match="no intact checkpoint"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_latest(d)


def test_resume_from_a_corrupt_latest_is_still_exact_and_stale_temporaries_are_removed(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        Trainer(small_cfg(out=str(out), ckpt_interval=1, dump_samples=True)).fit(crash_after=2)
    ckpt = out / "checkpoints"
    (ckpt / "step_00000002.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    (ckpt / ".tmp-abc123").write_bytes(b"partial")
    (ckpt / ".tmp-step_00000003").mkdir()
    (out / "samples" / ".tmp-xyz").write_bytes(b"partial")
    with pytest.warns(UserWarning, match="falling back"):
        resumed = Trainer(small_cfg(out=str(out), ckpt_interval=1, dump_samples=True, resume=True))
        resumed.fit()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    assert not (out / "samples" / ".tmp-xyz").exists()
    ref = Trainer(small_cfg(out=str(tmp_path / "ref"), dump_samples=True))
    ref.fit()
    assert metrics(out / "metrics.jsonl") == metrics(tmp_path / "ref" / "metrics.jsonl")
    a, b = read_sample_dump(str(out)), read_sample_dump(str(tmp_path / "ref"))
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert all(np.array_equal(x, y) for s in a for x, y in zip(a[s], b[s]))


# ---------------------------------------------------------------- config validation
def test_validate_never_mutates_and_rejects_nan_weights():
    cfg = small_cfg(mode="sample_sum_norm", tp=2, engine="ddp", seq_len=32)
    before = dataclasses.asdict(cfg)
    cfg.validate()
    resolved = cfg.resolved()
    assert dataclasses.asdict(cfg) == before
    assert resolved.fixed_length == 32
    # The engine that reduces gradients under TP is derived by the layout object, not written into the config.
    assert (resolved.engine, resolved.parallel_dims().grad_engine) == ("ddp", "plain")
    # Before: --mtp-weight nan passed validation; the next step blamed per_token_loss microbatch 0.
    for name in ("mtp_weight", "aux_coeff", "lr", "bias_rate"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0, got nan"):
            Trainer(small_cfg(**{name: float("nan")}))
    with pytest.raises(TypeError, match="steps must be int, got '3'"):
        small_cfg(steps="3").validate()


def test_non_finite_gradient_norm_names_the_cause_and_updates_nothing():
    # Before: a NaN gradient reached AdamW; the *next* step then blamed per_token_loss microbatch 0.
    t = Trainer(small_cfg(steps=1))
    t.raw.output.weight.register_hook(lambda g: g * float("nan"))  # finite losses, a NaN gradient
    before = {n: p.detach().clone() for n, p in t.raw.named_parameters()}
    with pytest.raises(
        FloatingPointError,
        match=r"step 1 \(rank 0\): the gradient norm is nan; the optimizer "
        "step was not taken",
    ):
        t.fit()
    assert all(torch.equal(p, before[n]) for n, p in t.raw.named_parameters())


# ---------------------------------------------------------------- the train CLI
def test_explicit_flag_wins_over_the_preset_even_as_a_prefix():
    from lossparity.cli import build_parser
    from lossparity.cli.train import train_config_from_args

    parser = build_parser()
    for flag in ("--norm", "--normalization"):
        args = parser.parse_args(["train", "--preset", "megatron:calculate_per_token_loss=false", flag, "deferred"])
        cfg = train_config_from_args(args)
        assert (cfg.mode, cfg.normalization, cfg.megatron_quirks) == ("per_microbatch", "deferred", True)


def test_config_file_sets_fields_and_flags_win(tmp_path):
    from lossparity.cli import build_parser
    from lossparity.cli.train import train_config_from_args

    run = tmp_path / "run.yaml"
    run.write_text("preset: torchtitan\nsteps: 7\nga: 2\nmodel_overrides:\n  mtp_depths: 0\n")
    cfg = train_config_from_args(
        build_parser().parse_args(["train", "--config", str(run), "--ga", "4", "--set", "n_layers=3"])
    )
    assert (cfg.steps, cfg.ga, cfg.mtp_convention, cfg.aux_scope) == (7, 4, "main", "none")
    assert cfg.model_overrides == {"mtp_depths": 0, "n_layers": 3}
    js = tmp_path / "run.json"
    js.write_text('{\n  "steps": 5,\n  "mode": "per_sample"\n}\n')
    cfg = train_config_from_args(build_parser().parse_args(["train", "--config", str(js)]))
    assert (cfg.steps, cfg.mode) == (5, "per_sample")


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps: 7\nmodee: per_token\n", "run.yaml:2: unknown field 'modee' (did you mean 'mode'?)"),
        ("steps: ten\n", "run.yaml:1: steps must be int, got 'ten'"),
        ("seed: 1\nmtp_weight: .nan\n", "run.yaml:2: mtp_weight must be a finite number >= 0, got nan"),
        ("steps: [1,\n", "run.yaml:2: invalid YAML"),
        ("- 1\n", "run.yaml:1: expected a mapping"),
    ],
)
def test_config_file_errors_name_file_and_line(tmp_path, capsys, text, message):
    (tmp_path / "run.yaml").write_text(text)
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_input_errors_are_one_line_exit_2_and_debug_shows_the_traceback(tmp_path, capsys):
    binary = tmp_path / "corpus.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["train", "--data", str(binary)]) == 2
    err = capsys.readouterr().err
    assert f"corpus file '{binary}' is not UTF-8 text" in err and len(err.strip().splitlines()) == 1
    assert main(["train", "--mtp-weight", "nan"]) == 2
    assert "mtp_weight must be a finite number >= 0, got nan" in capsys.readouterr().err
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    assert main(["train", "--steps", "1", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match="mtp_weight"):
        main(["train", "--mtp-weight", "nan", "--debug"])


def test_data_file_works_with_the_model_presets(tmp_path, capsys):
    # Before: every model preset had vocab_size 256 < the byte tokenizer's 259.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i} " + "word " * (i % 7 + 1) for i in range(40)))
    assert (
        main(
            [
                "train",
                "--data",
                str(corpus),
                "--steps",
                "1",
                "--global-batch",
                "2",
                "--seq-len",
                "16",
                "--no-progress",
                "--out",
                str(tmp_path / "run"),
                "--no-tensorboard",
            ]
        )
        == 0
    )
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model_overrides"]["vocab_size"] == 259


def test_truncated_sharded_checkpoint_is_skipped(tmp_path):
    # Sharded (torch.distributed.checkpoint) folders: a truncated data file or a missing .metadata is
    # detected from the sizes the metadata records, and the previous folder is used.
    import torch.distributed.checkpoint as dcp

    from lossparity.checkpoint.folder import load_newest_intact, sharded_checkpoint_intact

    for step in (1, 2):
        path = tmp_path / f"step_{step:08d}"
        dcp.save({"w": torch.full((64,), float(step))}, checkpoint_id=str(path), no_dist=True)
        torch.save({"step": step}, path / "extra_rank0.pt")
    sharded_checkpoint_intact(str(tmp_path / "step_00000002"))
    data = next(p for p in (tmp_path / "step_00000002").iterdir() if p.suffix == ".distcp")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(ValueError, match="the metadata needs"):
        sharded_checkpoint_intact(str(tmp_path / "step_00000002"))
    with pytest.warns(UserWarning, match="step_00000002 cannot be read"):
        step, path = load_newest_intact(str(tmp_path), lambda p: (sharded_checkpoint_intact(p), p)[1])
    assert step == 1
    (tmp_path / "step_00000001" / ".metadata").unlink()
    with pytest.raises(RunDirError, match="no intact checkpoint"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_newest_intact(str(tmp_path), sharded_checkpoint_intact)


def test_resume_hides_the_abandoned_tensorboard_steps(tmp_path):
    # Before: a resume from step 3 of a run that had logged up to step 5 left TensorBoard showing steps
    # 4 and 5 twice (old and recomputed values); metrics.jsonl was already cut at the checkpoint.
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log = MetricsLog(str(tmp_path), 0, tensorboard=True)
    for s in range(1, 6):
        log.write({"step": s, "lm_loss": float(s)})
    log.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the truncation note of metrics.jsonl
        log = MetricsLog(str(tmp_path), 3, tensorboard=True)
    for s in (4, 5):
        log.write({"step": s, "lm_loss": 10.0 * s})
    log.close()
    acc = ea.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("lm_loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["lm_loss"] for line in f] == [1.0, 2.0, 3.0, 40.0, 50.0]
