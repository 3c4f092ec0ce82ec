"""``LossParityTrainer`` under DeepSpeed (``TrainingArguments(deepspeed=dict)``) on spawned gloo ranks, CPU.

The CPU/gloo multi-process setting is made here, by the test, never by the library: on a machine without
CUDA, accelerate counts one process unless DeepSpeed's state is configured before the arguments are built,
so :func:`configure_deepspeed_state` sets ``ACCELERATE_USE_DEEPSPEED=true``, creates
``PartialState(backend="gloo")`` and the arguments carry ``accelerator_config={"use_configured_state": True}``
(and ``use_cpu=False``: ``use_cpu=True`` would select accelerate's plain CPU state instead of DeepSpeed's).

The gradient of each step is read at the accumulation boundary: the engine's ``step`` (which accelerate calls
only there) is wrapped to keep :func:`lossparity.integrations.deepspeed.full_gradients` first (a test bridge
around the engine, outside the code under test).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def configure_deepspeed_state() -> None:
    """The CPU multi-process DeepSpeed state that accelerate needs before ``TrainingArguments`` is built."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    PartialState(backend="gloo")


def boundary_grads(trainer) -> list[dict[str, torch.Tensor]]:
    """A list that receives the full gradients of every optimizer step (wraps the engine's ``step``)."""
    import transformers

    from lossparity.integrations.deepspeed import full_gradients

    grads: list[dict[str, torch.Tensor]] = []

    class Wrap(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            engine = trainer.model_wrapped  # the DeepSpeedEngine, built by the Trainer before this callback
            real = engine.step

            def step(*a, **k):
                if engine.is_gradient_accumulation_boundary():
                    grads.append(full_gradients(engine))
                return real(*a, **k)

            engine.step = step

    trainer.add_callback(Wrap())
    return grads


def _model_and_rows(spec: dict):
    """``llama``: the tiny Llama on padded (packed for per_document) rows; ``mixtral``: the float32 tiny
    Mixtral of the aux tests (router logits on, coefficient 0.5) on their one global batch of 8 rows."""
    from _hf_common import rows_for, tiny_model

    if spec.get("model", "llama") == "mixtral":
        from _hf_aux_common import moe_model, rows8

        return moe_model("mixtral").float(), rows8()
    return tiny_model(), rows_for("packed" if spec["mode"] == "per_document" else "padded")


def hf_case(rank: int, world: int, specs: list[dict]) -> list[dict]:
    """``LossParityTrainer`` per spec ``{stage, offload, ga, mode, b}`` (optional ``model``, ``steps``,
    ``aux_scope``, ``lr``) from the first rows; returns the last step's full gradients (rank 0) and the logs."""
    configure_deepspeed_state()
    from _hf_common import RowDataset, training_args

    from lossparity.integrations.deepspeed import deepspeed_config
    from lossparity.integrations.hf import LossParityTrainer

    out = []
    for spec in specs:
        cfg = deepspeed_config(
            spec["stage"],
            offload=spec["offload"],
            gradient_accumulation_steps=spec["ga"],
            micro_batch_size=spec["b"],
            world_size=world,
        )
        model, rows = _model_and_rows(spec)
        extra = {"aux_scope": spec["aux_scope"]} if "aux_scope" in spec else {}
        with tempfile.TemporaryDirectory() as tmp:
            args = training_args(
                tmp,
                spec["b"],
                spec["ga"],
                steps=spec.get("steps", 1),
                learning_rate=spec.get("lr", 0.5),
                deepspeed=cfg,
                use_cpu=False,
                accelerator_config={"use_configured_state": True},
            )
            trainer = LossParityTrainer(
                model=model,
                args=args,
                train_dataset=RowDataset(rows),
                loss_mode=spec["mode"],
                fixed_length=12,
                **extra,
            )
            grads = boundary_grads(trainer)
            trainer.train()
            logs = trainer.state.log_history
        out.append({**spec, "grads": grads[-1] if rank == 0 else None, "logs": logs, "world": world})
        # One Accelerator with a DeepSpeed plugin per AcceleratorState: drop it (keep the process state) for the next
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=False)
    return out
