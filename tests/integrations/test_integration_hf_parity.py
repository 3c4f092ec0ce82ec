"""ParityCallback in real Hugging Face Trainer runs (tiny Llama from a config, CPU): an identical run trains to
the end; against a reference whose loss is raised 3% from step 4 it stops at step 4 with a report naming it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from _hf_common import RowDataset, rows_for, tiny_model, training_args  # noqa: E402

STEPS = 6


def _train(out, callbacks=(), mode=None):
    import transformers

    from lossparity.integrations.hf import LossParityTrainer

    kw = dict(
        model=tiny_model("llama"),
        args=training_args(str(out), 2, 2, STEPS),
        train_dataset=RowDataset(rows_for("padded")),
    )
    trainer = (
        transformers.Trainer(**kw, callbacks=list(callbacks))
        if mode is None
        else LossParityTrainer(**kw, callbacks=list(callbacks), loss_mode=mode)
    )
    trainer.train()
    return trainer


def _losses(state) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in state.log_history if "loss" in e}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden")
    trainer = _train(out)
    trainer.state.save_to_json(str(out / "trainer_state.json"))
    return out / "trainer_state.json", _losses(trainer.state)


def test_identical_run_trains_to_the_end(golden, tmp_path):
    from lossparity.integrations.hf import ParityCallback

    path, losses = golden
    cb = ParityCallback(str(path))
    trainer = _train(tmp_path, [cb])
    assert trainer.state.global_step == STEPS and cb.stopped_at is None and cb.guard.violation is None
    assert len(cb.verdicts) == STEPS and all(v.ok and v.checks for v in cb.verdicts)
    assert _losses(trainer.state) == losses  # the identical run really is identical
    assert not (tmp_path / "parity_report.md").exists()


def test_raised_reference_stops_at_step_4_with_a_report(golden, tmp_path):
    import transformers

    from lossparity.integrations.hf import ParityCallback

    path, losses = golden
    data = json.loads(path.read_text())
    for entry in data["log_history"]:
        if "loss" in entry and entry["step"] >= 4:
            entry["loss"] = entry["loss"] * 1.03
    raised = tmp_path / "raised_state.json"
    raised.write_text(json.dumps(data))
    cb = ParityCallback(str(raised))
    assert isinstance(cb, transformers.TrainerCallback)
    trainer = _train(tmp_path / "run", [cb])
    assert trainer.state.global_step == 4 and cb.stopped_at == 4  # not later
    report = json.loads((tmp_path / "run" / "parity_report.json").read_text())
    assert report["step"] == 4 and report["metric"] == "objective" and report["cand_name"] == "loss"
    assert report["cand"] == losses[4] and report["ref"] == pytest.approx(losses[4] * 1.03, rel=1e-12)
    assert report["difference"] == pytest.approx(losses[4] - losses[4] * 1.03, rel=1e-9)
    md = (tmp_path / "run" / "parity_report.md").read_text()
    assert "step 4" in md and "`loss`" in md and f"{losses[4]:.8g}" in md


def test_loss_parity_trainer_against_its_own_earlier_run(tmp_path):
    from lossparity.integrations.hf import ParityCallback

    first = _train(tmp_path / "a", mode="per_sample")
    first.state.save_to_json(str(tmp_path / "state.json"))
    # its trainer_state.json logs J twice ('loss' and 'objective'); the log reader accepts one name per metric,
    # so HF's 'loss' keeps its own name here and 'objective' is compared
    cb = ParityCallback(str(tmp_path / "state.json"), tol="lm_loss=1e-6", name_map={"loss": "loss"})
    second = _train(tmp_path / "b", [cb], mode="per_sample")
    assert second.state.global_step == STEPS and cb.guard.violation is None
    compared = {c.metric for v in cb.verdicts for c in v.checks}
    assert {"objective", "lm_loss"} <= compared


def test_evaluation_and_summary_logs_are_not_steps(tmp_path):
    from types import SimpleNamespace

    from lossparity.integrations.hf import ParityCallback

    ref = tmp_path / "ref.jsonl"
    ref.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    cb = ParityCallback(str(ref), report_dir=tmp_path)
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    cb.on_log(None, state, control, logs={"eval_loss": 9.0, "epoch": 0.1})  # evaluation before training
    cb.on_log(None, state, control, logs={"loss": 2.0, "learning_rate": 0.1, "epoch": 0.1})
    state.global_step = 2
    cb.on_log(None, state, control, logs={"train_runtime": 1.0, "train_loss": 9.0, "epoch": 0.2})
    assert len(cb.verdicts) == 1 and cb.verdicts[0].ok and not control.should_training_stop
    cb.on_log(None, state, control, logs={"loss": 1.6, "epoch": 0.2})  # rel 0.067 > 2e-4
    assert control.should_training_stop and cb.stopped_at == 2 and (tmp_path / "parity_report.md").exists()


@pytest.mark.slow
def test_two_processes_stop_at_the_same_step(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from lossparity.distributed.launch import free_port

    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[1] / "src"), str(here)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += [
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(here / "_hf_parity_worker.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["golden_losses"] == ranks[1]["golden_losses"]  # the same logs on both processes
    for r in ranks:
        assert r["global_step"] == 4 and r["stopped_at"] == 4 and r["verdict_steps"] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "report" / "parity_report.json").read_text())["step"] == 4
