"""The live parity guard in torchtitan's real ``Trainer.train_step`` (the set-up of _titan_workers, with logging
on) and in the Megatron loop hook fed with loss_dicts as Megatron's training loop reduces them."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch

from lossparity.integrations.megatron_parity import parity_check
from lossparity.parity.guard import ParityGuard


def _titan_trainer(steps: int):
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError)
    from _titan_workers import TinyLM, _Optim, global_batch
    from torchtitan.trainer import Trainer

    from lossparity.integrations.titan_parity import ParityTitanMixin
    from lossparity.integrations.torchtitan import LossParityLoss, LossParityTitanMixin

    class T(ParityTitanMixin, LossParityTitanMixin, Trainer):
        pass

    model = TinyLM()
    t = object.__new__(T)
    t.config = SimpleNamespace(
        training=SimpleNamespace(disable_cuda_graphs=False, max_norm=1e6, steps=steps),
        parallelism=SimpleNamespace(spmd_backend="none"),
    )
    t.parallel_dims = SimpleNamespace(
        dp_enabled=False,
        pp_enabled=False,
        cp_enabled=False,
        ep_enabled=False,
        dp_cp_enabled=False,
        get_mesh=lambda name: None,
        get_optional_mesh=lambda name: None,
    )
    t.model_parts, t.model_config, t.device, t.step, t.ntokens_seen = [model], SimpleNamespace(), "cpu", 0, 0
    t.gradient_accumulation_steps, t.num_pipeline_parallel_microbatches = 2, 1
    t.optimizers = _Optim(model, None)
    t.lr_schedulers = SimpleNamespace(get_metrics=lambda: {}, step=lambda: None)
    logged: list[tuple[int, float]] = []
    t.metrics_processor = SimpleNamespace(
        should_log=lambda step: True,
        log=lambda step, loss, max_loss, gn, extra_metrics=None: logged.append((step, loss)),
    )
    saved: list[tuple[int, bool]] = []
    t.checkpointer = SimpleNamespace(
        maybe_wait_for_staging=lambda: None, save=lambda s, last_step: saved.append((s, last_step))
    )
    t.train_context = contextlib.nullcontext
    t.fwd_bwd_fn = t._forward_backward_body
    t.loss_fn = LossParityLoss("per_sample")
    tokens, labels, positions = global_batch(8)
    batches = [
        (
            {"input": tokens[k * 4 : (k + 1) * 4], "positions": positions[k * 4 : (k + 1) * 4]},
            labels[k * 4 : (k + 1) * 4],
        )
        for k in range(2)
    ]
    return t, batches, logged, saved


def _titan_loop(t, batches) -> None:
    """torchtitan's ``Trainer.train`` loop body: step, train_step, the checkpointer's save."""
    while t.should_continue_training():
        t.step += 1
        t.train_step(iter(batches))
        t.checkpointer.save(t.step, last_step=(t.step == t.config.training.steps))


def test_torchtitan_train_step_stops_at_the_first_violation(tmp_path):
    t, batches, logged, _ = _titan_trainer(5)
    _titan_loop(t, batches)  # the reference run: torchtitan's own logged losses
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5]
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in logged))
    raised = tmp_path / "raised.jsonl"
    raised.write_text("".join(json.dumps({"step": s, "loss": v * (1.03 if s >= 3 else 1)}) + "\n" for s, v in logged))

    same, batches, _, saved = _titan_trainer(5)
    same.parity_guard = ParityGuard(ref, report_dir=None)
    _titan_loop(same, batches)
    assert same.step == 5 and same.parity_stop_step is None and len(same.parity_verdicts) == 5

    stop, batches, _, saved = _titan_trainer(5)
    stop.parity_guard = ParityGuard(raised, report_dir=tmp_path)
    _titan_loop(stop, batches)
    assert stop.step == 3 and stop.parity_stop_step == 3 and (3, True) in saved
    report = json.loads((tmp_path / "parity_report.json").read_text())
    assert report["step"] == 3 and report["cand"] == logged[2][1] and report["ref"] == logged[2][1] * 1.03


def test_megatron_hook_with_reduced_loss_dicts(tmp_path):
    # Megatron's loop logs the reduced losses as one-element tensors; names are Megatron's
    lm = {1: 10.5, 2: 9.25, 3: 8.0, 4: 7.5}
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"step": s, "lm_loss": v, "grad_norm": 1.0}) + "\n" for s, v in lm.items()))
    guard = ParityGuard(ref, report_dir=tmp_path)
    stops = [
        parity_check(guard, s, {"lm loss": torch.tensor(v * (1.001 if s == 3 else 1.0))}, grad_norm=1.0)
        for s, v in lm.items()
    ]
    assert stops == [False, False, True, True]  # rel 1e-3 > 2e-4 at iteration 3, the stop stays
    assert json.loads((tmp_path / "parity_report.json").read_text())["ref_name"] == "lm_loss"
    with pytest.raises(ValueError, match=r"loss_dict\['lm loss'\] at iteration 5"):
        parity_check(guard, 5, {"lm loss": torch.tensor([1.0, 2.0])})
