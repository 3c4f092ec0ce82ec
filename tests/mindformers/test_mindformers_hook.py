"""lossparity.mindformers.install on MindFormers 2.0.0's own loss path (``_tiny.py``): the objective of every mode,
its log and its gradient w.r.t. the logits against lossparity's torch reference (float64) at GA 1, 2 and 4;
MindFormers' logged loss left as released; the global_aux_loss reset defect reproduced and fixed; the indexer
slot defect reproduced and fixed with MindFormers' own tracker functions."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from _data import ASL, B, S, batch, lm_jobs
from _torch_ref import run
from mindspore import Tensor

import lossparity.mindformers as lpmf
import lossparity.mindspore as lpm

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")

import _cpu_ops  # noqa: E402 (after the context is set)

_cpu_ops.enable()
from _tiny import TinyLM, TinyMoELM, TinyMTPLM, TinyTrainer, moe_config  # noqa: E402 (imports MindFormers)

MODES = ("per_token", "per_sample", "per_document")


def _inputs() -> dict[str, Tensor]:
    x = batch()
    return {
        "input_ids": Tensor(np.ones((B, S), np.int32)),
        "labels": Tensor(x["labels"]),
        "loss_mask": Tensor(x["mask"]),
        "row_index": Tensor(np.arange(B, dtype=np.int32)),
        "actual_seq_len": Tensor(ASL),
    }


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return run(lm_jobs(lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S).asnumpy()))


def _released_loss(micro: int) -> float:
    """MindFormers' logged loss, computed independently in float64: the mean over the K microbatches of each
    one's ``Σ w·l / (Σ w + 1e-8)`` (CrossEntropyLoss with a mask; Trainer.training_step's ``Σ loss/K``)."""
    x = batch()
    z = x["logits"].astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, x["labels"][..., None].astype(np.int64), -1)[..., 0]
    k = B // micro
    means = [
        (nll[r : r + micro] * x["mask"][r : r + micro]).sum() / (x["mask"][r : r + micro].sum() + 1e-8)
        for r in range(0, B, micro)
    ]
    return float(sum(means) / k)


@pytest.mark.parametrize("micro", [8, 4, 2])  # GA 1, 2, 4
@pytest.mark.parametrize("mode", MODES)
def test_objective_log_and_logit_gradient_match_torch(reference, mode: str, micro: int) -> None:
    trainer = TinyTrainer(TinyLM(batch()["logits"]), B // micro, B)
    handle = lpmf.install(trainer, mode)
    loss, _ = trainer.training_step(_inputs(), 0.0, 0.0, 0)
    np.testing.assert_allclose(
        handle.logs["lossparity/lm_objective"].asnumpy(), reference[f"lm{micro}/{mode}/objective"], rtol=1e-6
    )
    np.testing.assert_allclose(trainer.grad.asnumpy(), reference[f"lm{micro}/{mode}/grad"], rtol=1e-5, atol=1e-6)
    # MindFormers' own logged loss is left as released: its per-microbatch token means, averaged
    np.testing.assert_allclose(np.asarray(loss.asnumpy()).reshape(()), _released_loss(micro), rtol=1e-6)
    units = {"per_token": sum(batch()["mask"].reshape(-1) > 0), "per_sample": B, "per_document": 12}[mode]
    assert int(handle.logs["lossparity/units"].asnumpy()) == units


def test_docs_page_block_runs(reference) -> None:
    """docs/mindformers.md's block, run as written on the stand-in trainer, then one step."""
    import pathlib  # noqa: PLC0415
    import re  # noqa: PLC0415

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "mindformers.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, re.S)
    ns = {"trainer": TinyTrainer(TinyLM(batch()["logits"]), 2, B)}
    exec(compile(code, "docs/mindformers.md", "exec"), ns)
    ns["trainer"].training_step(_inputs(), 0.0, 0.0, 0)
    np.testing.assert_allclose(
        ns["handle"].logs["lossparity/lm_objective"].asnumpy(), reference["lm4/per_sample/objective"], rtol=1e-6
    )


DEPTHS, LAMBDA = 2, 0.3


def _mtp_logits() -> np.ndarray:
    return np.random.default_rng(7).normal(0.0, 2.0, (DEPTHS, B, S, batch()["logits"].shape[-1])).astype(np.float32)


@pytest.fixture(scope="module")
def mtp_reference() -> dict[str, np.ndarray]:
    x = batch()
    seg = lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S).asnumpy()
    jobs: dict[str, np.ndarray] = {}
    for mode in MODES:
        jobs.update(
            {
                f"job/{mode}/kind": np.array("mtp"),
                f"job/{mode}/mtp_logits": _mtp_logits(),
                f"job/{mode}/labels": x["labels"],
                f"job/{mode}/mask": x["mask"],
                f"job/{mode}/segment_ids": seg,
                f"job/{mode}/mode": np.array(mode),
                f"job/{mode}/scale": np.array(LAMBDA),
            }
        )
    return run(jobs)


@pytest.mark.parametrize("mode", MODES)
def test_mtp_term_gradient_and_log_match_torch_own_convention(reference, mtp_reference, mode: str) -> None:
    # GA 2 through MindFormers' own process_mtp_loss and MTP auto-scaler
    trainer = TinyTrainer(TinyMTPLM(batch()["logits"], _mtp_logits(), LAMBDA), 2, B)
    z, zm = trainer.model[0].z, trainer.model[0].zm
    handle = lpmf.install(trainer, mode)
    inputs = _inputs()
    k = trainer.num_accumulation_steps
    grad_z, grad_zm = ms.ops.zeros(z.shape, ms.float32), ms.ops.zeros(zm.shape, ms.float32)
    handle._step = handle.begin_step(inputs)  # what the rebound training_step does, here with both parameters
    for micro in range(k):
        mi = trainer._split_micro_batch(inputs, micro)
        _, (gz, gzm) = ms.value_and_grad(lambda mi=mi: trainer.compute_loss(trainer.model, mi) / k, None, [z, zm])()
        grad_z, grad_zm = grad_z + gz, grad_zm + gzm
    mtp_log = ms.ops.stack(handle._step.mtp_shares).sum().asnumpy()
    np.testing.assert_allclose(grad_z.asnumpy(), reference[f"lm4/{mode}/grad"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_zm.asnumpy(), mtp_reference[f"{mode}/grad"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(LAMBDA * mtp_log, mtp_reference[f"{mode}/objective"], rtol=1e-6)


def test_released_gradient_is_the_mean_of_microbatch_token_means(reference) -> None:
    # without lossparity, GA 2 on ragged rows trains the mean of two token means, not the global token mean
    trainer = TinyTrainer(TinyLM(batch()["logits"]), 2, B)
    trainer.training_step(_inputs(), 0.0, 0.0, 0)
    grad = trainer.grad.asnumpy()
    lp = TinyTrainer(TinyLM(batch()["logits"]), 2, B)
    lpmf.install(lp, "per_token")
    lp.training_step(_inputs(), 0.0, 0.0, 0)
    np.testing.assert_allclose(lp.grad.asnumpy(), reference["lm4/per_token/grad"], rtol=1e-5, atol=1e-6)
    assert np.abs(grad - reference["lm4/per_token/grad"]).max() > 1e-3


def test_uninstall_restores_mindformers() -> None:
    trainer = TinyTrainer(TinyLM(batch()["logits"]), 2, B)
    released = trainer.training_step
    handle = lpmf.install(trainer, "per_sample")
    assert trainer.training_step is not released
    handle.uninstall()
    assert trainer.training_step == released
    assert "compute_language_model_loss" not in vars(trainer.model[0])


def test_refusals_name_the_setting() -> None:
    trainer = TinyTrainer(TinyLM(batch()["logits"]), 2, B)
    with pytest.raises(ValueError, match="mode"):
        lpmf.install(trainer, "per_group")
    with pytest.raises(ValueError, match="fixes"):
        lpmf.install(trainer, "per_sample", fixes=("global_aux_loss_reset",))
    trainer.config.parallelism.pipeline_parallel = 2
    with pytest.raises(lpmf.MindFormersRefusal, match="pipeline_parallel"):
        lpmf.install(trainer, "per_sample")
    trainer.config.parallelism.pipeline_parallel = 1
    assert "training_step" not in vars(trainer)  # nothing rebound by the refused calls
    handle = lpmf.install(trainer, "per_document")
    inputs = _inputs()
    del inputs["actual_seq_len"]
    with pytest.raises(lpmf.MindFormersRefusal, match="actual_seq_len"):
        trainer.training_step(inputs, 0.0, 0.0, 0)
    handle.uninstall()


# -- defect 2: the global_aux_loss running buffer -----------------------------------------------------------

E, TOPK, COEFF, K = 4, 2, 0.01, 2


def _router_tables(steps: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(E), (steps, B, S)).astype(np.float32)
    top = np.argsort(-probs, -1)[..., :TOPK]
    routing = np.zeros_like(probs, dtype=np.int32)
    np.put_along_axis(routing, top, 1, -1)
    return probs, routing


def _aux_run(log_interval: int, fixes: str, steps: int = 2) -> np.ndarray:
    """``A_m`` of every microbatch of ``steps`` steps as MindFormers' tracker records them. Without the fix the
    buffer is reset as MindFormers 2.0.0's LossCallback.on_step_end does: after the step, only when
    ``global_step % log_interval == 0`` (and only on the last stage, which this one-stage run is)."""
    probs, routing = _router_tables(steps)
    model = TinyMoELM(batch()["logits"], probs[0], routing[0], moe_config(E, TOPK, COEFF))
    trainer = TinyTrainer(model, K, B)
    lpmf.install(trainer, "per_sample", fixes=fixes)
    for step in range(steps):
        model.set_tables(probs[step], routing[step])
        trainer.training_step(_inputs(), 0.0, 0.0, step)
        if (step + 1) % log_interval == 0:  # loss_callback.py: the reset after the log-interval early return
            model.reset_model_temporary_tensors()
    return np.array(model.aux)


@pytest.fixture(scope="module")
def running_reference() -> dict[str, np.ndarray]:
    probs, routing = _router_tables(2)
    per_micro = B // K
    jobs: dict[str, np.ndarray] = {}
    # per step (reset every step), and both steps as one run of 2K microbatches (a buffer never reset)
    for name, steps in (("step0", [0]), ("step1", [1]), ("both", [0, 1])):
        p = np.concatenate([probs[s].reshape(K, per_micro * S, E) for s in steps])
        r = np.concatenate([routing[s].reshape(K, per_micro * S, E) for s in steps])
        jobs.update(
            {
                f"job/{name}/kind": np.array("moe"),
                f"job/{name}/probs": p,
                f"job/{name}/counts": r.sum(1).astype(np.float32),
                f"job/{name}/tokens": np.full(len(p), per_micro * S, np.float32),
                f"job/{name}/topk": np.array(TOPK),
                f"job/{name}/coeff": np.array(COEFF),
            }
        )
    return run(jobs)


@pytest.mark.parametrize("log_interval", [1, 2])
def test_global_aux_loss_reset_every_step_matches_global_running(running_reference, log_interval: int) -> None:
    fixed = _aux_run(log_interval, "lossparity")
    expected = np.concatenate([running_reference["step0/global_running"], running_reference["step1/global_running"]])
    np.testing.assert_allclose(fixed, expected, rtol=1e-6)


def test_global_aux_loss_reset_defect_reproduced_with_the_fix_off(running_reference) -> None:
    expected = np.concatenate([running_reference["step0/global_running"], running_reference["step1/global_running"]])
    np.testing.assert_allclose(_aux_run(1, "mindformers-2.0.0"), expected, rtol=1e-6)  # log_interval 1: no defect
    released = _aux_run(2, "mindformers-2.0.0")
    # log_interval 2: step 1's running mean still holds step 0's counts (one run of 2K microbatches)
    np.testing.assert_allclose(released, running_reference["both/global_running"], rtol=1e-6)
    assert np.abs(released[K:] - expected[K:]).max() > 1e-7 * np.abs(expected).max()


# -- defect 3: the indexer tracker slots --------------------------------------------------------------------


class _Core(ms.nn.Cell):
    """An attention core with an indexer, as CompressedSparseAttention keeps it: ``layer_number`` is the slot it
    passes to MindFormers' ``save_to_indexer_losses_tracker``."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.enable_indexer = True


class _Attention(ms.nn.Cell):
    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.layer_index = max(1, layer_number)  # MLASelfAttention.__init__ in MindFormers 2.0.0
        self.core_attention = _Core(self.layer_index)


class _Decoder(ms.nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.layers = ms.nn.CellList([_Attention(n) for n in range(3)])  # decoder layers 0, 1, 2


def _index_loss(fixes: str, losses: list[float]) -> float:
    from mindformers.pynative.transformers.experimental_attention_variant import utils  # noqa: PLC0415

    trainer = TinyTrainer(TinyLM(batch()["logits"]), 1, B)
    decoder = _Decoder()
    trainer.model = [decoder, trainer.model[0]]
    lpmf.install(trainer, "per_sample", fixes=fixes)
    utils.get_indexer_loss_tracker().clear()
    for layer, value in zip(decoder.layers, losses):
        utils.save_to_indexer_losses_tracker(Tensor(np.float32(value)), layer.core_attention.layer_number, 3)
    return float(utils.track_indexer_metrics().asnumpy())  # what GPTModel.get_index_loss() returns


def test_index_loss_is_the_mean_over_the_layers() -> None:
    losses = [2.0e-4, 3.2e-4, 2.48e-4]
    np.testing.assert_allclose(_index_loss("lossparity", losses), np.mean(losses), rtol=1e-6)
    # released: layers 0 and 1 share slot 1, and the sum is divided by the 2 slots: 3/2 of the mean
    np.testing.assert_allclose(_index_loss("mindformers-2.0.0", losses), sum(losses) / 2, rtol=1e-6)
