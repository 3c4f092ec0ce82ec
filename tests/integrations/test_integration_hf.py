"""lossparity.integrations.hf with the real ``transformers.Trainer`` (CPU, models built from configs).

Layouts of one global batch of 8 rows: (a) batch 8 × GA 1, (b) batch 2 × GA 4 (one process), (c) 2 gloo
ranks × batch 2 × GA 2 (``torchrun``). Expected values come from naive loops over the rows written out
here (per-row cross-entropy from the logits, per-sample / per-document means), never from lossparity.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_common import naive_step1_objective, packed_rows, padded_rows, run, tiny_model  # noqa: E402

from lossparity.distributed.launch import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
RTOL = 1e-6  # fp32, 5 steps


@pytest.fixture(autouse=True)
def _one_thread():
    # Bit-for-bit comparisons and speed on 2 shared cores: one intra-op thread, restored afterwards.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _param_rel(a: dict, b: dict, p0: dict) -> tuple[float, float]:
    """(max over tensors of |a-b|∞/|b|∞, max |a-b|∞ / max |b-p0|∞): parameters, and the same difference
    relative to the largest update of the 5 steps."""
    par = max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b)
    upd = max(float((a[n] - b[n]).abs().max()) for n in b) / max(float((b[n] - p0[n]).abs().max()) for n in b)
    return par, upd


def _torchrun(tmp_path: Path, runs: list[dict]) -> list[dict]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HERE / "_hf_common.py"),
        str(tmp_path / "out"),
        json.dumps(runs),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(tmp_path / f"out.rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_objective_is_layout_invariant_across_batch_ga_and_ranks(tmp_path):
    specs = [("per_sample", "padded"), ("per_document", "packed")]
    runs = [{"name": f"{m}-{d}", "kind": "llama", "mode": m, "b": 2, "ga": 2, "data": d} for m, d in specs]
    runs.append({"name": "ignored", "kind": "llama", "mode": "per_sample", "b": 2, "ga": 2, "data": "ignored"})
    runs.append({"name": "segbad", "kind": "llama", "mode": "per_document", "b": 2, "ga": 2, "data": "segbad"})
    runs.append({"name": "noseg", "kind": "llama", "mode": "per_document", "b": 2, "ga": 2, "data": "padded"})
    runs.append({"name": "nologits", "kind": "nologits", "mode": "per_sample", "b": 2, "ga": 2, "data": "padded"})
    ranks = _torchrun(tmp_path, runs)
    p0 = {n: p.detach().clone() for n, p in tiny_model().named_parameters()}
    for mode, data in specs:
        pa, la, _ = run(str(tmp_path), "llama", mode, 8, 1, data=data)
        pb, lb, _ = run(str(tmp_path), "llama", mode, 2, 4, data=data)
        pc, lc = ranks[0][f"{mode}-{data}"]["params"], ranks[0][f"{mode}-{data}"]["logs"]
        for name, other in (("2x4", pb), ("2 ranks x 2 x 2", pc)):
            par, upd = _param_rel(other, pa, p0)
            print(f"measured: HF Trainer {mode} {name} vs 8x1 after 5 steps: params {par:.1e}, updates {upd:.1e}")
            assert par <= RTOL and upd <= RTOL, (mode, par, upd)
        naive = naive_step1_objective(mode, packed_rows() if data == "packed" else padded_rows())
        worst = max(abs(x[0]["objective"] - naive) / naive for x in (la, lb, lc))
        print(f"measured: HF Trainer {mode} step-1 objective vs naive float64: {worst:.1e}")
        for logs in (la, lb, lc):
            assert logs[0]["step"] == 1
            assert logs[0]["objective"] == pytest.approx(naive, rel=1e-5), (mode, logs[0])
            assert logs[0]["loss"] == pytest.approx(naive, rel=1e-5)  # HF's own logged loss is J too
            assert "lm_loss" in logs[0]
        for key in ("objective", "lm_loss"):
            assert [x[key] for x in lc if key in x] == pytest.approx([x[key] for x in la if key in x], rel=1e-5)
    # Bad input on every rank, before the first optimizer step, without a hang.
    for rank in ranks:
        assert "labels" in rank["ignored"]["error"] and "ignore_index" in rank["ignored"]["error"]
        assert "segment_ids" in rank["noseg"]["error"] and rank["nologits"]["error"].startswith("model:")
    assert "segment id 0" in ranks[1]["segbad"]["error"]
    assert "another rank" in ranks[0]["segbad"]["error"]


@pytest.mark.parametrize("fused", [False, True])
def test_per_token_reproduces_plain_trainer_gradients_exactly(tmp_path, fused):
    # The logits path does HF's own arithmetic (bit for bit); the fused path (the default) sums the same
    # terms in another order (tiles, gradients formed in the forward): equal to float32 rounding.
    import functools

    from lossparity.integrations.hf import LossParityTrainer

    cls = functools.partial(LossParityTrainer, fused_loss=fused)
    _, _, plain = run(str(tmp_path), "llama", None, 2, 4, steps=2, record_grads=True)
    _, _, ours = run(str(tmp_path), "llama", "per_token", 2, 4, steps=2, record_grads=True, trainer_cls=cls)
    assert len(plain) == len(ours) == 2
    worst = max(
        float((g_ours[n] - g).abs().max() / g.abs().max())
        for g_plain, g_ours in zip(plain, ours)
        for n, g in g_plain.items()
        if g.abs().max() > 0
    )
    print(
        f"measured: HF Trainer per_token {'fused' if fused else 'logits'} path vs plain Trainer gradients: {worst:.1e}"
    )
    for g_plain, g_ours in zip(plain, ours):
        for name, g in g_plain.items():
            if fused:
                torch.testing.assert_close(g_ours[name], g, rtol=1e-5, atol=1e-7, msg=name)
            else:
                assert torch.equal(g, g_ours[name]), name


def test_moe_aux_loss_is_added_once_per_step(tmp_path):
    """Mixtral with output_router_logits, aux_scope="microbatch", batch 4 × GA 2: the step-1 gradient is that
    of J_per_sample + coef · mean over the 2 microbatches of the model's aux_loss."""
    import functools

    from lossparity.integrations.hf import LossParityTrainer

    micro = functools.partial(LossParityTrainer, aux_scope="microbatch")
    _, logs, grads = run(str(tmp_path), "mixtral", "per_sample", 4, 2, steps=1, record_grads=True, trainer_cls=micro)
    rows = padded_rows()[:8]
    model = tiny_model("mixtral")
    coef, auxes = model.config.router_aux_loss_coef, []
    for k in range(2):
        batch = {key: torch.stack([r[key] for r in rows[4 * k : 4 * k + 4]]) for key in rows[0]}
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        logp = torch.log_softmax(out.logits.float(), -1)
        term = 0.0
        for i in range(4):
            y = batch["labels"][i, 1:]
            keep = y != -100
            nll = -logp[i, :-1].gather(-1, y.clamp(min=0)[:, None])[:, 0]
            term = term + (nll * keep).sum() / max(int(keep.sum()), 1)
        (term / 8 + coef * out.aux_loss / 2).backward()
        auxes.append(float(out.aux_loss))
    worst = max(float((grads[0][n] - p.grad).abs().max() / p.grad.abs().max()) for n, p in model.named_parameters())
    print(f"measured: HF Trainer Mixtral per_sample + aux, step-1 gradients vs naive: {worst:.1e}")
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[0][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert logs[0]["aux_loss"] == pytest.approx(sum(auxes) / 2, rel=1e-6)


@pytest.mark.parametrize("case", ["per_document_without_segments", "all_labels_ignored", "no_logits"])
def test_bad_input_raises_before_the_first_optimizer_step(tmp_path, case):
    import transformers
    from _hf_common import RowDataset, rows_for, training_args

    from lossparity.integrations.hf import LossParityTrainer

    mode = "per_document" if case == "per_document_without_segments" else "per_sample"
    rows = rows_for("ignored" if case == "all_labels_ignored" else "padded")
    model = tiny_model("nologits" if case == "no_logits" else "llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = LossParityTrainer(
        model=model, args=training_args(str(tmp_path), 2, 2), train_dataset=RowDataset(rows), loss_mode=mode
    )
    match = {
        "per_document_without_segments": "segment_ids",
        "all_labels_ignored": "labels",
        "no_logits": "model: .*logits",
    }[case]
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert isinstance(trainer, transformers.Trainer)


def test_bad_options_are_rejected_at_construction(tmp_path):
    from _hf_common import RowDataset, training_args

    from lossparity.integrations.hf import LossParityTrainer

    with pytest.raises(ValueError, match="loss_mode"):
        LossParityTrainer(
            model=tiny_model(),
            args=training_args(str(tmp_path), 2, 1),
            train_dataset=RowDataset(padded_rows()),
            loss_mode="per_row",
        )
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        LossParityTrainer(
            model=tiny_model(),
            args=training_args(str(tmp_path), 2, 1, label_smoothing_factor=0.1),
            train_dataset=RowDataset(padded_rows()),
        )
    with pytest.raises(ValueError, match="compute_loss_func"):
        LossParityTrainer(
            model=tiny_model(),
            args=training_args(str(tmp_path), 2, 1),
            train_dataset=RowDataset(padded_rows()),
            compute_loss_func=lambda *a, **k: 0.0,
        )


def test_evaluate_reports_the_batch_objective(tmp_path):
    from _hf_common import RowDataset, training_args

    from lossparity.integrations.hf import LossParityTrainer

    rows = padded_rows()[:8]
    args = training_args(str(tmp_path), 2, 1, per_device_eval_batch_size=8)
    trainer = LossParityTrainer(
        model=tiny_model(),
        args=args,
        train_dataset=RowDataset(rows),
        eval_dataset=RowDataset(rows),
        loss_mode="per_sample",
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(naive_step1_objective("per_sample", rows), rel=1e-5)


def test_per_document_from_a_segment_ids_column(tmp_path):
    """A ``segment_ids`` column survives the Trainer's column pruning and is not passed to the model; with
    one document per row (ids = attention mask) per_document equals the naive per-sample mean."""
    from _hf_common import RowDataset, training_args

    from lossparity.integrations.hf import LossParityTrainer

    rows = padded_rows()
    for r in rows:
        r["segment_ids"] = r["attention_mask"].clone()
    trainer = LossParityTrainer(
        model=tiny_model(),
        args=training_args(str(tmp_path), 4, 2, steps=1),
        train_dataset=RowDataset(rows),
        loss_mode="per_document",
    )
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["objective"] == pytest.approx(naive_step1_objective("per_sample", padded_rows()), rel=1e-5)


def test_row_weighted_mode_on_packed_rows_warns(tmp_path):
    from _hf_common import RowDataset, training_args

    from lossparity.integrations.hf import LossParityTrainer

    trainer = LossParityTrainer(
        model=tiny_model(),
        args=training_args(str(tmp_path), 4, 1, steps=1),
        train_dataset=RowDataset(packed_rows()),
        loss_mode="per_sample",
    )
    with pytest.warns(UserWarning, match="per_document"):
        trainer.train()


def test_logging_interval_averages_the_per_step_values(tmp_path):
    """logging_steps=2: lm_loss and objective are the plain means of the per-step values (semantics §2)."""
    from _hf_common import RowDataset, training_args

    from lossparity.integrations.hf import LossParityTrainer

    logs = {}
    for every in (1, 2):
        trainer = LossParityTrainer(
            model=tiny_model(),
            train_dataset=RowDataset(padded_rows()),
            loss_mode="per_sample",
            args=training_args(str(tmp_path), 4, 2, steps=4, logging_steps=every),
        )
        trainer.train()
        logs[every] = [x for x in trainer.state.log_history if "objective" in x]
    for key in ("objective", "lm_loss"):
        per_step = [x[key] for x in logs[1]]
        pairs = [(per_step[0] + per_step[1]) / 2, (per_step[2] + per_step[3]) / 2]
        assert [x[key] for x in logs[2]] == pytest.approx(pairs, rel=1e-12)
