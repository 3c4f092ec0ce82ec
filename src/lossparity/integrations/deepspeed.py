"""DeepSpeed engine integration: every optimizer step of a ``deepspeed.DeepSpeedEngine`` optimizes exactly the
chosen lossparity mode, whatever the gradient accumulation ``K``, the data-parallel size ``D``, the ZeRO stage
(0-3), the optimizer offload and the precision (docs/semantics.md §1, §3).

What DeepSpeed does with a loss (measured, deepspeed 0.19.8): ``engine.backward(loss)`` divides it by
``K`` (``scale_wrt_gas=True``, the default; a direct ``loss.backward()`` is divided by ``K`` by the engine's
output hooks too), and the data-parallel reduction *averages* the gradients over the ``D`` ranks, at every
ZeRO stage. A per-microbatch mean therefore becomes a mean of the ``D·K`` microbatch means, which is the
objective only when every microbatch has the same number of loss tokens.

The exact step (pre-counted normalizers, semantics §3): the accountant sums the mode's denominator over the
data-parallel ranks before the first forward; each microbatch's share ``numerator(mb) / denominator`` is handed
to ``engine.backward(share · D, scale_wrt_gas=False)``. The engine's average over ``D`` then gives
``Σ_ranks Σ_mb share = J`` exactly, and nothing depends on DeepSpeed's default for ``scale_wrt_gas``.

Usage (a hand-written DeepSpeed loop; docs/integrations.md has the complete recipe)::

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    acc = DeepSpeedAccountant(engine, mode="per_sample")
    acc.begin_step([mb["mask"] for mb in microbatches])  # K = gradient_accumulation_steps masks
    for mb in microbatches:
        acc.backward(acc.lm_loss(per_token_loss(engine, mb), mb["mask"]))
        acc.step()  # engine.step(); after the K-th microbatch: finish_step, then the optimizer step
    logs = acc.logs()

The audit helpers :func:`deepspeed_config`, :func:`full_gradients` and :func:`step_gradients` run a user's
model and loss through a real engine and return the gradients DeepSpeed would apply.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed.accountant import Accountant
from ..distributed.protocol import ProtocolError, StepState
from ..options import Mode
from . import require

__all__ = ["DeepSpeedAccountant", "deepspeed_config", "full_gradients", "step_gradients", "DTYPES"]

DTYPES = ("float32", "bfloat16")  # the precisions of deepspeed_config / step_gradients
_BAD_MASKS = "lossparity_deepspeed_bad_masks"  # extra count: a rank's mask count is not the engine's K
_MB = TypeVar("_MB")


def _engine_size(engine: Any, name: str) -> int:
    value = getattr(engine, name, 1)
    return int(value) if isinstance(value, int) else 1


def _check_engine(engine: Any) -> None:
    for attr in ("backward", "step", "gradient_accumulation_steps", "is_gradient_accumulation_boundary"):
        if not callable(getattr(engine, attr, None)):
            raise TypeError(
                f"engine: expected a deepspeed.DeepSpeedEngine (from deepspeed.initialize), got "
                f"{type(engine).__name__} without {attr}()"
            )
    # Sequence (Ulysses) and model parallelism average over other groups than the data-parallel one.
    for name in ("sequence_parallel_size", "mp_world_size"):
        if _engine_size(engine, name) > 1:
            raise ValueError(
                f"engine: {name}={getattr(engine, name)}; DeepSpeedAccountant supports data parallelism (ZeRO 0-3) only"
            )


class DeepSpeedAccountant(Accountant):
    """An :class:`~lossparity.Accountant` whose microbatch shares drive a DeepSpeed engine.

    ``J`` is the mode's objective over the whole global batch (every rank's ``K`` microbatches); the
    gradient the engine's optimizer receives at the accumulation boundary is ``∇J`` exactly:
    :meth:`backward` calls ``engine.backward(loss · D, scale_wrt_gas=False)`` (``D`` the engine's
    data-parallel size, which its reduction divides by), so ``Σ_ranks Σ_mb share(mb) = J``.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine`` (data parallelism, any ZeRO stage, offload, bf16/fp16).
        mode: the objective's mode (docs/semantics.md §1).
        **kwargs: further :class:`~lossparity.Accountant` arguments (``fixed_length``, ``mtp_depths``,
            ``check_finite``...). ``group``/``mesh``/``dims`` (the engine's data-parallel group is used),
            ``grad_reduction`` (the engine reduces) and ``normalization="deferred"`` (the engine's
            partitioned gradients are not rescaled after the backward) are refused.

    The step: :meth:`begin_step` with the engine's ``K`` masks (checked), per microbatch ``lm_loss`` (and
    ``mtp_loss``, MoE terms...) then :meth:`backward` of their sum and :meth:`step`; after the ``K``-th,
    :meth:`step` closes the accountant's step (``finish_step``) before the engine's optimizer step; then
    ``logs()``.
    """

    def __init__(self, engine: Any, mode: Mode = "per_token", **kwargs: Any) -> None:
        _check_engine(engine)
        for bad in ("group", "mesh", "dims", "grad_reduction"):
            if bad in kwargs:
                raise ValueError(f"{bad}: DeepSpeedAccountant takes the engine's data-parallel group and reduction")
        if kwargs.get("normalization", "precount") != "precount":
            raise ValueError(
                "normalization: DeepSpeedAccountant needs 'precount' (the engine's partitioned gradients cannot "
                "be divided after the backward, as 'deferred' would)"
            )
        group = getattr(engine, "data_parallel_group", None) if dist.is_initialized() else None
        super().__init__(mode, group=group, grad_reduction="sum", **kwargs)
        self.engine = engine
        # D: what the engine's reduction divides by (its data-parallel world size).
        self.dp_factor = float(_engine_size(engine, "dp_world_size") if dist.is_initialized() else 1)
        self._backwards = 0  # backward calls of this step (host counter: no synchronization)
        self._steps = 0

    def begin_step(
        self, masks: Sequence[Tensor], segment_ids: Sequence[Tensor | None] | None = None, **kwargs: Any
    ) -> None:
        """:meth:`Accountant.begin_step` (one all-reduce), checking that ``masks`` holds one mask per microbatch
        of the engine's accumulation window (``gradient_accumulation_steps``) on every rank: a rank's wrong
        count travels in the same all-reduce, so every rank raises ``ValueError`` instead of one hanging."""
        k = int(self.engine.gradient_accumulation_steps())
        bad = float(len(masks) != k)
        extra = {**dict(kwargs.pop("extra_counts", None) or {}), _BAD_MASKS: bad}
        super().begin_step(masks, segment_ids, extra_counts=extra, **kwargs)
        self._backwards = self._steps = 0
        if bad or self.global_count(_BAD_MASKS) > 0:
            self._step.state = StepState.IDLE  # the step is not run: the next begin_step may follow
            rank = self.groups.token_rank()
            raise ValueError(
                f"masks: {len(masks)} microbatch masks on rank {rank} but the engine accumulates "
                f"gradient_accumulation_steps={k} microbatches per optimizer step; give one mask per microbatch "
                "of the step"
                if bad
                else f"masks: another rank gave a number of masks other than gradient_accumulation_steps={k}"
            )

    def backward(self, loss: Tensor, *, scale_wrt_gas: bool = False, retain_graph: bool = False) -> Tensor:
        """Back-propagate this microbatch's share of ``J`` through the engine: ``engine.backward(loss · D ·
        c, scale_wrt_gas=scale_wrt_gas)`` with ``c = K`` when ``scale_wrt_gas`` (the engine divides by ``K``)
        else 1, so the gradient of the step is ``∇J`` either way. ``loss`` is the sum of the microbatch's
        shares (``lm_loss``, ``mtp_loss``, MoE terms) returned by this accountant. Returns the engine's
        return value (the loss it back-propagated, divided by ``K`` when ``scale_wrt_gas``)."""
        step = self._step
        if step.state is not StepState.MICROBATCHES or self._backwards >= step.n_mbs:
            raise ProtocolError(
                f"backward called for microbatch {self._backwards} of a step of {step.n_mbs} microbatches "
                f"(rank {self.groups.token_rank()}): expected {self.expected_call()}"
            )
        if self._backwards >= step.mb:
            raise ProtocolError(
                f"backward called for microbatch {self._backwards} before its lm_loss "
                f"(rank {self.groups.token_rank()}): "
                "compute the share with lm_loss (or add_lm_share) first"
            )
        factor = self.dp_factor * (float(self.engine.gradient_accumulation_steps()) if scale_wrt_gas else 1.0)
        out = self.engine.backward(loss * factor, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        self._backwards += 1
        return out

    def step(self) -> None:
        """``engine.step()`` after each microbatch's :meth:`backward`. After the step's last microbatch the
        engine must be at its accumulation boundary (else ``ValueError``: its ``gradient_accumulation_steps``
        and this step disagree) and the accountant's ``finish_step`` runs first (it touches no gradient:
        the engine reduced them)."""
        step = self._step
        if step.state is not StepState.MICROBATCHES or self._steps >= self._backwards:
            raise ProtocolError(
                f"step called without a backward before it (rank {self.groups.token_rank()}, microbatch "
                f"{self._steps}): expected backward"
            )
        last = self._steps + 1 == step.n_mbs
        if last != bool(self.engine.is_gradient_accumulation_boundary()):
            raise ValueError(
                f"engine: microbatch {self._steps} of {step.n_mbs} (rank {self.groups.token_rank()}) but the engine "
                f"{'is' if not last else 'is not'} at its gradient accumulation boundary: call begin_step at "
                "the engine's boundary with one mask per accumulated microbatch"
            )
        if last:
            self.finish_step()
        self.engine.step()
        self._steps += 1


# ---------------------------------------------------------------------- the audit's helpers


def deepspeed_config(
    zero_stage: int = 0,
    *,
    offload: bool = False,
    gradient_accumulation_steps: int = 1,
    micro_batch_size: int = 1,
    dtype: str = "float32",
    world_size: int | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config dict for a gradient check: ZeRO ``zero_stage`` (0-3), optimizer state offloaded to
    the CPU (``offload``, stages 1-3; a torch optimizer is kept: ``zero_force_ds_cpu_optimizer=false``),
    ``train_batch_size = micro_batch_size · gradient_accumulation_steps · world_size`` (default: the
    initialized world size), ``bf16`` when ``dtype="bfloat16"``, no gradient clipping, no printing."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if offload and zero_stage == 0:
        raise ValueError("offload: optimizer offload needs ZeRO stage 1, 2 or 3 (got zero_stage=0)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    for name, v in (
        ("gradient_accumulation_steps", gradient_accumulation_steps),
        ("micro_batch_size", micro_batch_size),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    world = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,  # torch's SGD/Adam under ZeRO (DeepSpeed tests its own only)
        "bf16": {"enabled": dtype == "bfloat16"},
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def full_gradients(engine: Any) -> dict[str, Tensor]:
    """The whole (unpartitioned) gradient of every trainable parameter of ``engine.module``, float64 on the
    CPU, by name: ``deepspeed.utils.safe_get_full_grad`` (fp32 accumulation buffers of ZeRO/bf16). Read it
    at the accumulation boundary, after the last microbatch's backward and before ``engine.step()``. A
    collective under ZeRO 1-3: call it on every rank (every rank gets the same dict)."""
    utils = require("deepspeed.utils", "deepspeed")
    grads = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        g = utils.safe_get_full_grad(p)
        if g is None:
            raise RuntimeError(f"engine: parameter {name!r} has no gradient at this point (read it at the boundary)")
        grads[name] = g.detach().to("cpu", torch.float64).clone()
    return grads


def step_gradients(
    model: nn.Module,
    microbatches: Sequence[_MB],
    loss_fn: Callable[[Any, _MB], Tensor],
    *,
    zero_stage: int = 0,
    offload: bool = False,
    micro_batch_size: int = 1,
    dtype: str = "float32",
    scale_wrt_gas: bool = True,
    lr: float = 0.0,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Tensor]:
    """Run ONE optimizer step of a copy of ``model`` through a real DeepSpeed engine and return the gradients
    DeepSpeed applies at the accumulation boundary, ``{name: float64 tensor}`` (every rank gets them).

    This rank's ``microbatches`` are the accumulation window (``gradient_accumulation_steps =
    len(microbatches)``); for each, ``loss = loss_fn(engine, microbatch)`` (call ``engine(...)`` for the forward)
    is back-propagated as a user's loop does, ``engine.backward(loss, scale_wrt_gas=scale_wrt_gas)``. With the
    engine's defaults the result is ``(1/(D·K)) Σ_ranks Σ_mb ∇loss(mb)``: compare it with the gradient of the
    objective you mean. The engine is built with ``deepspeed_config(zero_stage, offload=..., dtype=...)``
    (``config`` entries override it) and ``torch.optim.SGD(lr=lr)``; it is destroyed before returning, and
    ``model`` itself is not touched (a deep copy is partitioned). Every rank of the initialized process group
    (the data-parallel ranks) must call it with its own microbatches."""
    deepspeed = require("deepspeed", "deepspeed")
    if not dist.is_initialized():
        raise RuntimeError(
            "step_gradients: torch.distributed is not initialized; initialize the process group (gloo on CPU) on "
            "every rank first, also for one process"
        )
    if not microbatches:
        raise ValueError("microbatches: give at least one microbatch (the accumulation window of this rank)")
    cfg = deepspeed_config(
        zero_stage,
        offload=offload,
        gradient_accumulation_steps=len(microbatches),
        micro_batch_size=micro_batch_size,
        dtype=dtype,
    )
    cfg.update(dict(config or {}))
    module = copy.deepcopy(model)
    if dtype == "bfloat16":
        module = module.to(torch.bfloat16)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=lr)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg)
    try:
        grads: dict[str, Tensor] = {}
        for i, mb in enumerate(microbatches):
            engine.backward(loss_fn(engine, mb), scale_wrt_gas=scale_wrt_gas)
            if i == len(microbatches) - 1:
                if not engine.is_gradient_accumulation_boundary():
                    raise RuntimeError("engine: the last microbatch is not at the accumulation boundary")
                grads = full_gradients(engine)
            engine.step()
        return grads
    finally:
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):
            destroy()
