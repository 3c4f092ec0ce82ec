"""The torchtitan adapter of the audit: your loss and your ``Trainer`` subclass on torchtitan's own ``train_step``.

``model()`` builds the model: torchtitan's convention, ``model(tokens, positions=...)`` returns the logits
``[b, S, V]`` (a torchtitan ``Decoder`` does). ``loss`` is a loss with torchtitan's signature
``loss(pred, labels, global_valid_tokens, **kwargs) -> (loss, metrics)`` (``None``: torchtitan's own
``CrossEntropyLoss``: the local sum over the global valid-token count); ``trainer`` is your ``Trainer``
subclass (``None``: ``torchtitan.trainer.Trainer``), e.g. one with lossparity's ``LossParityTitanMixin``.

A configuration runs the class's real ``train_step`` on the crafted microbatches (``GA`` batches fetched
from the data iterator, ``global_valid_tokens`` summed over the ``batch`` mesh, the loss and backward per
microbatch, gradient clipping with no bound, the optimizer step). The Trainer's ``__init__`` is not run (it
builds a model from torchtitan's registry, a tokenizer, a dataloader and a checkpointer): the audit sets the
attributes ``train_step`` reads, with stand-ins for the optimizer (it keeps the gradient it would apply), the
LR scheduler, the checkpointer and the metrics processor (every step logs; its ``global_avg_loss`` is the
logged value). Data parallelism is torchtitan's: FSDP2 ``fully_shard`` over the ``batch`` mesh (every block of
``model.layers``, then the model) with FSDP's gradient division disabled as torchtitan does, or your own
``parallelize(model, mesh)``. The recompute class applies torchtitan's ``FullAC`` to ``model.layers``.
Microbatches are torchtitan's: ``labels[:, t]`` is the target of position ``t`` (-100: none) and ``positions``
restart at 0 in every document of a packed row (passed to the model and, as torchtitan does, to the loss).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from .batch import IGNORE, AuditBatch, Config, split_rows
from .stack import RunResult, build_model, resolve

__all__ = ["TitanStep", "titan_microbatch", "titan_logits", "run_titan", "uses_float32_loss"]

_WRAPPED = "_checkpoint_wrapped_module."  # the name part torch's checkpoint wrapper inserts


@dataclass
class TitanStep:
    """A torchtitan training step (module doc): ``model`` builds the model, ``loss`` is your loss (``None``:
    torchtitan's cross-entropy), ``trainer`` your ``Trainer`` subclass, ``parallelize(model, mesh)`` your
    data-parallel wrapping (``None``: torchtitan's FSDP2 with gradient division off), ``model_config`` what
    the Trainer's ``model_config`` should be. Callables and classes may be ``MODULE:NAME`` specs (2-rank
    classes need specs or module-level objects)."""

    model: Callable[[], nn.Module] | str
    loss: Callable[..., Any] | str | None = None
    trainer: type | str | None = None
    parallelize: Callable[[nn.Module, Any], Any] | str | None = None
    model_config: Any = None
    kind: str = field(default="torchtitan", init=False)


def uses_float32_loss(stack: TitanStep) -> bool:
    """Whether the step's loss is torchtitan's cross-entropy, which computes in float32 (``pred.float()``)
    whatever the model's dtype: the audit's tolerance is then float32's."""
    return stack.loss is None


def titan_microbatch(mb: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Tensor]:
    """An audit microbatch (Hugging Face labels: ``labels[:, t]`` is token ``t``) as torchtitan's
    ``(input_dict, labels)``: ``labels[:, t]`` the target of position ``t`` (the next token; -100 where none)
    and ``positions`` (per-document positions of a packed row)."""
    hf = mb["labels"]
    labels = torch.full_like(hf, IGNORE)
    labels[:, :-1] = hf[:, 1:]
    return {"input": mb["input_ids"], "positions": mb["position_ids"]}, labels


def titan_logits(model: nn.Module, mb: Mapping[str, Tensor]) -> Tensor:
    """The logits ``[b, S, V]`` of a torchtitan model: ``model(tokens, positions=...)``."""
    out = model(mb["input_ids"], positions=mb["position_ids"])
    if not isinstance(out, Tensor) or out.dim() != 3:
        raise TypeError("audit: the torchtitan model must return logits [b, S, vocab] from model(tokens, positions=)")
    return out


class _Optimizers:
    """torchtitan's ``OptimizersContainer`` as far as ``train_step`` calls it; ``step`` keeps the gradient."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.grads: dict[str, Tensor] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self) -> None:
        grads = {}
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad
            if hasattr(g, "full_tensor"):  # FSDP2's sharded gradient (a DTensor)
                g = g.full_tensor()
            grads[n.replace(_WRAPPED, "")] = g.detach().double().clone()
        self.grads = grads


class _Metrics:
    """The metrics processor: every step logs; ``global_avg_loss`` kept."""

    def __init__(self) -> None:
        self.logged: float | None = None

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> None:
        self.logged = float(global_avg_loss)


def _parallel_dims(mesh: Any) -> SimpleNamespace:
    """The ``parallel_dims`` ``train_step`` reads: data parallelism over one ``batch`` mesh (also the loss
    mesh of its logging), nothing else."""
    dp = mesh is not None
    names = ("batch", "loss", "fsdp", "dp_shard", "dp")
    return SimpleNamespace(
        dp_enabled=dp,
        pp_enabled=False,
        cp_enabled=False,
        ep_enabled=False,
        dp_cp_enabled=dp,
        get_mesh=lambda name: mesh,
        get_optional_mesh=lambda name: mesh if dp and name in names else None,
    )


def _data_parallel(model: nn.Module, mesh: Any, stack: TitanStep) -> None:
    """torchtitan's data parallelism on ``model`` (module doc), or the stack's own ``parallelize``."""
    if stack.parallelize is not None:
        fn = resolve(stack.parallelize) if isinstance(stack.parallelize, str) else stack.parallelize
        fn(model, mesh)
        return
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        for block in layers.children():
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    disable_fsdp_gradient_division(model)


def _trainer_class(stack: TitanStep) -> type:
    from torchtitan.trainer import Trainer

    cls = Trainer if stack.trainer is None else stack.trainer
    cls = resolve(cls) if isinstance(cls, str) else cls
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"audit: the trainer {cls!r} is not a subclass of torchtitan.trainer.Trainer")
    return cls


def _loss(stack: TitanStep) -> Callable[..., Any]:
    if stack.loss is None:
        from torchtitan.components.loss import CrossEntropyLoss

        return CrossEntropyLoss(CrossEntropyLoss.Config())  # type: ignore[no-any-return]
    return resolve(stack.loss) if isinstance(stack.loss, str) else stack.loss


def run_titan(stack: TitanStep, cfg: Config, batch: AuditBatch, rank: int, world: int) -> RunResult:
    """One optimizer step of ``stack`` through torchtitan's ``Trainer.train_step`` on this rank (the default
    process group initialized when ``world > 1``)."""
    model = build_model(stack)
    model.train()
    initial = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    note = ""
    if cfg.recompute:
        if isinstance(getattr(model, "layers", None), (nn.ModuleDict, nn.ModuleList)):
            from torchtitan.distributed.activation_checkpoint import FullAC

            FullAC(FullAC.Config()).apply(model)
        else:
            note = "the model has no .layers: torchtitan's activation checkpointing (per block) not applied"
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("batch",))
        _data_parallel(model, mesh, stack)
    trainer: Any = object.__new__(_trainer_class(stack))
    trainer.config = SimpleNamespace(
        training=SimpleNamespace(disable_cuda_graphs=False, max_norm=math.inf),
        parallelism=SimpleNamespace(spmd_backend="none"),
    )
    trainer.parallel_dims = _parallel_dims(mesh)
    trainer.model_parts = [model]
    trainer.model_config = stack.model_config if stack.model_config is not None else SimpleNamespace()
    trainer.device, trainer.step, trainer.ntokens_seen = torch.device("cpu"), 1, 0
    trainer.gradient_accumulation_steps, trainer.num_pipeline_parallel_microbatches = cfg.ga, 1
    trainer.optimizers = _Optimizers(model)
    trainer.lr_schedulers = SimpleNamespace(get_metrics=lambda: {}, step=lambda: None)
    trainer.metrics_processor = _Metrics()
    trainer.checkpointer = SimpleNamespace(maybe_wait_for_staging=lambda: None)
    trainer.train_context = contextlib.nullcontext
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    trainer.loss_fn = _loss(stack)
    parts = split_rows(batch.rows, cfg)
    trainer.train_step(iter([titan_microbatch(batch.microbatch(rows)) for rows in parts[rank]]))
    if trainer.optimizers.grads is None:
        raise ValueError("audit: the torchtitan train_step made no optimizer step")
    assignment = {row: (r, k) for r, ks in enumerate(parts) for k, rows in enumerate(ks) for row in rows}
    return RunResult(trainer.optimizers.grads, trainer.metrics_processor.logged, assignment, initial, note)
