"""How the user hands over a training stack, and one configuration's run of it.

Two adapters run the user's own code unchanged:

- :class:`HandLoop`: ``model()`` builds the model (the audit seeds torch with 0 before each call) and
  ``step(model, microbatches, ctx)`` runs one optimizer step's forward and backward on the microbatches
  it is given, with the user's loss, scaling and reduction, leaving the gradients in the parameters; it
  may return the loss it would log. Under 2 ranks the model arrives wrapped in
  ``DistributedDataParallel`` (``wrap_ddp=False``: the bare model, the default process group initialized).
- :class:`TrainerFactory`: ``factory(ctx)`` returns a ``transformers.Trainer`` (TRL's trainers are
  Trainers) built with ``ctx.args(**your_arguments)`` (the audit's overrides win: batch size, GA, one step,
  no clipping, sequential sampling) on ``ctx.train_dataset`` (or ``ctx.dataset(...)``).

A run returns the gradient the step applied (rank 0's, after the stack's own reduction), the logged loss,
which rows went to which rank and microbatch, and the parameters at the first forward.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .batch import AuditBatch, Config, split_rows

__all__ = [
    "HandLoop",
    "TrainerFactory",
    "StepContext",
    "TrainerContext",
    "RunResult",
    "resolve",
    "spec_of",
    "run_config",
]


def resolve(spec: str) -> Any:
    """The object named ``"package.module:attr"`` or ``"path/to/file.py:attr"`` (``ValueError`` naming the
    spec when it does not resolve)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not attr or not mod_name:
        raise ValueError(f"audit: {spec!r} is not MODULE:NAME or FILE.py:NAME")
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise ValueError(f"audit: {spec!r}: no file {mod_name}")
        name = f"_lossparity_audit_user_{abs(hash(str(path.resolve())))}"
        if name not in sys.modules:
            spec_obj = importlib.util.spec_from_file_location(name, path)
            assert spec_obj is not None and spec_obj.loader is not None
            module = importlib.util.module_from_spec(spec_obj)
            sys.modules[name] = module
            spec_obj.loader.exec_module(module)
        module = sys.modules[name]
    else:
        module = importlib.import_module(mod_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"audit: {spec!r}: {mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def spec_of(obj: Any) -> str | None:
    """The ``MODULE:NAME`` (or ``FILE.py:NAME`` for ``__main__``) a worker process can import ``obj`` by,
    ``None`` for a lambda or a function defined inside another."""
    if isinstance(obj, str):
        return obj
    qual = getattr(obj, "__qualname__", None)
    mod = getattr(obj, "__module__", None)
    if not qual or not mod or "<" in qual:
        return None
    if mod == "__main__":
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        return f"{path}:{qual}" if path else None
    return f"{mod}:{qual}"


@dataclass
class StepContext:
    """What a hand loop's ``step`` is told: this ``rank`` of ``world_size``, ``ga`` microbatches of
    ``micro`` rows, ``global_batch`` rows in the step, ``recompute`` (activation checkpointing asked)."""

    rank: int
    world_size: int
    ga: int
    micro: int
    global_batch: int
    recompute: bool


@dataclass
class HandLoop:
    """A hand-written training step: ``model`` builds the model, ``step(model, microbatches, ctx)`` runs
    one optimizer step's forward/backward (module doc). Each may be a callable or a ``MODULE:NAME`` spec;
    2-rank classes need specs (or module-level callables) that a worker process can import."""

    model: Callable[[], nn.Module] | str
    step: Callable[[nn.Module, list[dict[str, Tensor]], StepContext], Any] | str
    wrap_ddp: bool = True
    logits: Callable[[nn.Module, Mapping[str, Tensor]], Tensor] | str | None = None
    kind: str = field(default="hand loop", init=False)


class TrainerContext:
    """What a Trainer factory is given: :meth:`args` (``TrainingArguments`` with the audit's overrides),
    ``train_dataset`` (the crafted rows: ``input_ids``, ``attention_mask``, ``labels``) and
    :meth:`dataset` for other column sets (TRL's ``completion_mask``)."""

    def __init__(self, overrides: dict[str, Any], batch: AuditBatch) -> None:
        self.overrides = overrides
        self.batch = batch
        self.recompute = bool(overrides.get("gradient_checkpointing"))

    def args(self, args_class: type | None = None, **kwargs: Any) -> Any:
        """``args_class(**kwargs)`` with the audit's overrides applied on top; ``args_class`` defaults to
        ``transformers.TrainingArguments`` (TRL: ``trl.SFTConfig``, ``trl.GRPOConfig``, ...)."""
        import transformers

        cls = args_class or transformers.TrainingArguments
        return cls(**{**kwargs, **self.overrides})

    def dataset(
        self, columns: tuple[str, ...] = ("input_ids", "attention_mask", "labels"), *, unpadded: bool = False
    ) -> Any:
        """The crafted rows as a ``datasets.Dataset`` of ``columns`` (any of ``input_ids``,
        ``attention_mask``, ``position_ids``, ``labels``, ``completion_mask``), in the audit's order;
        ``unpadded``: each row cut to its real tokens (for trainers whose collator pads, e.g. TRL's)."""
        import datasets

        rows = []
        for i in range(self.batch.rows):
            r = self.batch.row(i)
            k = int(r["attention_mask"].sum()) if unpadded else r["input_ids"].numel()
            rows.append({c: r[c][:k].tolist() for c in columns})
        return datasets.Dataset.from_list(rows)

    @property
    def train_dataset(self) -> Any:
        """The crafted rows (``input_ids``, ``attention_mask``, ``labels``) as a ``datasets.Dataset``."""
        return self.dataset()


@dataclass
class TrainerFactory:
    """A function ``factory(ctx: TrainerContext) -> transformers.Trainer`` (module doc), or its spec."""

    factory: Callable[[TrainerContext], Any] | str
    logits: Callable[[nn.Module, Mapping[str, Tensor]], Tensor] | str | None = None
    kind: str = field(default="trainer", init=False)


@dataclass
class RunResult:
    """One configuration's run on rank 0: the applied ``grads`` (float64), the ``logged`` loss (``None``:
    none), ``assignment[row] = (rank, microbatch)`` over all ranks, and the ``initial`` parameters."""

    grads: dict[str, Tensor]
    logged: float | None
    assignment: dict[int, tuple[int, int]]
    initial: dict[str, Tensor]
    note: str = ""
    model: nn.Module | None = None  # the trained module (in-process runs only), for the basis


def _as_float(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, Tensor):
        return float(x.detach().double().reshape(-1)[0]) if x.numel() == 1 else None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


_PRISTINE: dict[int, tuple[Any, nn.Module]] = {}


def build_model(stack: Any) -> nn.Module:
    """The hand loop's model, seeded so that every call (every rank, every configuration) is the same: the
    factory runs once per process (``torch.manual_seed(0)`` first) and each call gets a deep copy."""
    cached = _PRISTINE.get(id(stack))
    if cached is None or cached[0] is not stack:
        torch.manual_seed(0)
        factory = resolve(stack.model) if isinstance(stack.model, str) else stack.model
        out = factory()
        if not isinstance(out, nn.Module):
            raise TypeError(f"audit: the model factory returned {type(out).__name__}, not a torch.nn.Module")
        _PRISTINE.clear()  # one stack at a time: the audit of another stack drops this one's model
        cached = _PRISTINE[id(stack)] = (stack, out)
    return copy.deepcopy(cached[1])


def _enable_recompute(model: nn.Module) -> bool:
    fn = getattr(model, "gradient_checkpointing_enable", None)
    if fn is None:
        return False
    fn()
    return True


def run_hand_loop(stack: HandLoop, cfg: Config, batch: AuditBatch, rank: int, world: int) -> RunResult:
    """One step of the hand loop on this rank (the default group initialized when ``world > 1``)."""
    model = build_model(stack)
    model.train()
    note = ""
    if cfg.recompute and not _enable_recompute(model):
        note = "the model has no gradient_checkpointing_enable(); ctx.recompute=True was passed to the step"
    initial = _snapshot(model)
    parts = split_rows(batch.rows, cfg)
    mbs = [batch.microbatch(rows) for rows in parts[rank]]
    wrapped: nn.Module = model
    if world > 1 and stack.wrap_ddp:
        wrapped = nn.parallel.DistributedDataParallel(model)
    step = resolve(stack.step) if isinstance(stack.step, str) else stack.step
    ctx = StepContext(rank, world, cfg.ga, cfg.micro, batch.rows, cfg.recompute)
    logged = _as_float(step(wrapped, mbs, ctx))
    assignment = {row: (r, k) for r, per_rank in enumerate(parts) for k, rows in enumerate(per_rank) for row in rows}
    return RunResult(_grads(model), logged, assignment, initial, note)


def trainer_overrides(cfg: Config, out_dir: str) -> dict[str, Any]:
    """The ``TrainingArguments`` the audit imposes: this configuration's batch and GA, one optimizer step,
    no gradient clipping (a clip rescales the gradient being identified), sequential sampling (the audit
    still records which rows each microbatch saw), CPU, nothing saved or reported."""
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=cfg.micro,
        gradient_accumulation_steps=cfg.ga,
        max_steps=1,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=cfg.recompute,
    )


def run_trainer(stack: TrainerFactory, cfg: Config, batch: AuditBatch, rank: int, world: int) -> RunResult:
    """One optimizer step of the user's Trainer: gradients read just before the optimizer step
    (``on_pre_optimizer_step``, after the stack's reduction), the logged ``loss``, the rows each forward saw."""
    import tempfile

    import transformers

    factory = resolve(stack.factory) if isinstance(stack.factory, str) else stack.factory
    keys = batch.row_of()
    seen: list[list[int]] = []
    probe: dict[str, Any] = {"initial": None, "grads": None, "logged": None}

    class _Probe(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if probe["grads"] is None:
                probe["grads"] = _grads(trainer.model)

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs")
            if probe["logged"] is None and logs and "loss" in logs:
                probe["logged"] = float(logs["loss"])

    def _record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("audit: the Trainer's model was called without input_ids")
        if probe["initial"] is None:
            probe["initial"] = _snapshot(module)
        rows = []
        for r in ids:
            key = batch.key(r)
            if key not in keys:
                raise ValueError(
                    "audit: a microbatch held a row the audit did not craft (the factory must train on ctx's rows)"
                )
            rows.append(keys[key])
        seen.append(rows)

    with tempfile.TemporaryDirectory() as tmp:
        ctx = TrainerContext(trainer_overrides(cfg, tmp), batch)
        torch.manual_seed(0)
        trainer = factory(ctx)
        if not isinstance(trainer, transformers.Trainer):
            raise TypeError(f"audit: the factory returned {type(trainer).__name__}, not a transformers.Trainer")
        trainer.remove_callback(transformers.PrinterCallback)  # its log lines would interleave with the report
        trainer.add_callback(_Probe())
        model = trainer.model
        assert isinstance(model, nn.Module)
        hook = model.register_forward_pre_hook(_record, with_kwargs=True)
        try:
            trainer.train()
        finally:
            hook.remove()
    if probe["grads"] is None:
        raise ValueError("audit: the Trainer made no optimizer step (empty dataset or max_steps overridden?)")
    assignment = _gather_assignment(seen, rank, world)
    return RunResult(probe["grads"], probe["logged"], assignment, probe["initial"] or {}, "", trainer.model)


def _gather_assignment(seen: list[list[int]], rank: int, world: int) -> dict[int, tuple[int, int]]:
    """Every rank's ``row -> (rank, microbatch)`` on every rank (one ``all_gather_object`` when ``world > 1``)."""
    local = {row: (rank, k) for k, rows in enumerate(seen) for row in rows}
    if world == 1:
        return local
    import torch.distributed as dist

    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, local)
    out: dict[int, tuple[int, int]] = {}
    for p in parts:
        out.update(p)
    return out


def basis_model(stack: Any, result: RunResult) -> nn.Module:
    """A model with the step's initial parameters, for the documents' gradients: the hand loop's factory
    again, or (Trainer) a copy of the trained model with the initial parameters put back and activation
    checkpointing off."""
    if not isinstance(stack, TrainerFactory):
        model = build_model(stack)
    else:
        if result.model is None:
            raise ValueError("audit: the reference run kept no model")
        model = copy.deepcopy(result.model)
        model._forward_pre_hooks.clear()
        for mod in model.modules():
            # accelerate rebinds ``forward`` on the instance through a closure over the *original* module
            # (mixed-precision output conversion): the copy would compute with the trained parameters
            mod.__dict__.pop("forward", None)
        off = getattr(model, "gradient_checkpointing_disable", None)
        if off is not None:
            off()
    experts = getattr(model, "set_experts_implementation", None)
    if experts is not None:  # transformers' grouped expert kernels have no float64 form; eager is the same math
        try:
            experts("eager")
        except (ValueError, TypeError):
            pass
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in result.initial:
                p.copy_(result.initial[n].to(p.dtype))
    return model


def ensure_process_group(timeout_s: float = 120.0) -> bool:
    """Initialize a 1-process gloo group when the caller has none (megatron-core and DeepSpeed need one even
    for one rank); returns whether this call created it (so that the caller destroys it)."""
    import datetime

    import torch.distributed as dist

    from ..distributed.launch import free_port

    if dist.is_initialized():
        return False
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return True


def run_config(stack: Any, cfg: Config, batch: AuditBatch, rank: int, world: int) -> RunResult:
    """Run ``cfg`` of ``stack`` (a :class:`HandLoop`, :class:`TrainerFactory` or
    :class:`~lossparity.audit.megatron.MegatronStep`) on this rank."""
    if isinstance(stack, HandLoop):
        return run_hand_loop(stack, cfg, batch, rank, world)
    if isinstance(stack, TrainerFactory):
        return run_trainer(stack, cfg, batch, rank, world)
    if getattr(stack, "kind", "") == "torchtitan":
        from .torchtitan import run_titan

        return run_titan(stack, cfg, batch, rank, world)
    if getattr(stack, "kind", "") == "deepspeed":
        from .deepspeed import run_deepspeed

        return run_deepspeed(stack, cfg, batch, rank, world)
    from .megatron import run_megatron

    return run_megatron(stack, cfg, batch, rank, world, build_model(stack))
