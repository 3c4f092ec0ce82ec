"""The DeepSpeed adapter of the audit: your loss on a real DeepSpeed engine, ZeRO stage and offload as classes.

``model()`` builds the model; ``loss(engine, microbatch)`` is your forward and loss on one microbatch
(call ``engine(...)`` for the forward) and returns the loss your loop hands to ``engine.backward``, which the
audit calls with DeepSpeed's defaults (``scale_wrt_gas=True``: DeepSpeed divides by GA, and its data-parallel
reduction averages), then ``engine.step()``. The gradient read is the one DeepSpeed applies at the
accumulation boundary (:func:`lossparity.integrations.deepspeed.step_gradients`). The engine is built from
``config`` (yours; the audit sets the batch sizes, the ZeRO stage and offload of the configuration, a torch
SGD optimizer and no clipping). The class ``zero`` runs 2 ranks × GA 2 under ZeRO 1, 2, 3 and ZeRO-2 with
optimizer offload; the other classes keep the stack's own ``zero_stage``/``offload``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from .batch import AuditBatch, Config, split_rows
from .stack import RunResult, build_model, ensure_process_group, resolve

__all__ = ["DeepSpeedStep", "run_deepspeed"]


@dataclass
class DeepSpeedStep:
    """A DeepSpeed training step: ``model`` builds the model, ``loss(engine, microbatch)`` gives the loss your
    loop passes to ``engine.backward`` (module doc); ``zero_stage``/``offload`` of your run; ``config``
    entries of your DeepSpeed config to keep. Callables may be ``MODULE:NAME`` specs."""

    model: Callable[[], nn.Module] | str
    loss: Callable[[Any, Mapping[str, Tensor]], Tensor] | str
    zero_stage: int = 0
    offload: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    kind: str = field(default="deepspeed", init=False)


def run_deepspeed(stack: DeepSpeedStep, cfg: Config, batch: AuditBatch, rank: int, world: int) -> RunResult:
    """One optimizer step of ``stack`` through a real DeepSpeed engine on this rank."""
    from ..integrations.deepspeed import step_gradients

    created = ensure_process_group()
    import os

    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed asserts it even on an initialized group
    try:
        model = build_model(stack)
        initial = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        parts = split_rows(batch.rows, cfg)
        mbs = [batch.microbatch(rows) for rows in parts[rank]]
        user_loss = resolve(stack.loss) if isinstance(stack.loss, str) else stack.loss
        stage = int(cfg.extra.get("zero_stage", stack.zero_stage))  # type: ignore[call-overload]
        offload = bool(cfg.extra.get("offload", stack.offload))

        def loss(engine: Any, mb: Mapping[str, Tensor]) -> Tensor:
            # the engine itself says which stage and offload it runs: a configuration that did not reach the
            # engine would make the class ``zero`` compare a stage with itself
            ran = (int(engine.zero_optimization_stage()), bool(engine.zero_cpu_offload()) if stage else False)
            if ran != (stage, offload):
                raise RuntimeError(f"audit: asked for ZeRO-{stage} offload={offload}, the engine runs {ran}")
            return user_loss(engine, mb)

        grads = step_gradients(
            model,
            mbs,
            loss,
            zero_stage=stage,
            offload=offload,
            micro_batch_size=cfg.micro,
            config=stack.config,
        )
        assignment = {row: (r, k) for r, ks in enumerate(parts) for k, rows in enumerate(ks) for row in rows}
        return RunResult(grads, None, assignment, initial)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
