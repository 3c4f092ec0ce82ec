"""The megatron-core adapter of the audit: your ``forward_step`` and ``loss_func`` on megatron-core's own
schedule.

``model()`` builds the model (wrapped in Megatron's ``DistributedDataParallel`` as in your training; its
``.config`` is the ``TransformerConfig`` whose ``calculate_per_token_loss`` and ``finalize_model_grads_func``
the schedule reads), ``forward_step(data_iterator, model)`` is your forward step: it takes the next
microbatch from the iterator and returns ``(output_tensor, partial(loss_func, ...))`` with
``output_tensor`` the per-token losses ``[b, S]`` (what Megatron's GPT model returns given labels). A
microbatch is a dict in Megatron's convention: ``tokens``, ``labels`` (``labels[:, t]`` is token ``t + 1``;
0 where nothing is predicted), ``loss_mask``, ``position_ids``, ``attention_mask`` (``None``: causal).

One configuration runs ``get_forward_backward_func()`` with ``num_microbatches = GA`` and
``micro_batch_size = b`` (the schedule calls ``finalize_model_grads_func``, so the gradient read after it
is the one the optimizer would apply: ``main_grad`` where Megatron's DDP keeps it, else ``grad``), and the
logged value is reduced as Megatron-LM's ``train_step`` does: a report of two numbers ``[Σ loss, Σ tokens]``
is summed over microbatches and ranks, then divided (whatever ``calculate_per_token_loss``); a report of one
number is averaged over microbatches and ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .batch import IGNORE, AuditBatch, Config, split_rows
from .stack import RunResult, ensure_process_group, resolve

__all__ = ["MegatronStep", "megatron_microbatch", "run_megatron", "megatron_token_losses"]


@dataclass
class MegatronStep:
    """A megatron-core training step: ``model`` builds the model, ``forward_step`` is yours (module doc),
    ``vocab_size`` the model's vocabulary (the crafted tokens are drawn below it). Either callable may be a
    ``MODULE:NAME`` spec (2-rank classes need specs or module-level callables)."""

    model: Callable[[], nn.Module] | str
    forward_step: Callable[[Any, nn.Module], tuple[Tensor, Callable[[Tensor], Any]]] | str
    vocab_size: int
    kind: str = field(default="megatron-core", init=False)


def megatron_microbatch(mb: Mapping[str, Tensor]) -> dict[str, Any]:
    """A microbatch of the audit (Hugging Face labels) in Megatron's convention: ``labels`` shifted left by
    one (0 where nothing is predicted) and ``loss_mask`` 1 where a target is."""
    hf = mb["labels"]
    labels = torch.zeros_like(hf)
    mask = torch.zeros(hf.shape, dtype=torch.float32)
    labels[:, :-1] = hf[:, 1:].clamp(min=0)
    mask[:, :-1] = (hf[:, 1:] != IGNORE).float()
    return {
        "tokens": mb["input_ids"],
        "labels": labels,
        "loss_mask": mask,
        "position_ids": mb["position_ids"],
        "attention_mask": None,
    }


def _forward_step(stack: MegatronStep) -> Callable[..., Any]:
    return resolve(stack.forward_step) if isinstance(stack.forward_step, str) else stack.forward_step


def megatron_token_losses(stack: MegatronStep) -> Callable[[nn.Module, Mapping[str, Tensor]], Tensor]:
    """The per-token losses ``ℓ[:, t]`` of the audit's positions (the loss of predicting ``labels[:, t]``)
    from your ``forward_step``'s ``output_tensor`` (Megatron's ``[:, t]`` predicts token ``t + 1``)."""
    fwd = _forward_step(stack)

    def losses(model: nn.Module, mb: Mapping[str, Tensor]) -> Tensor:
        meg = megatron_microbatch(mb)
        out, _ = fwd(iter([meg]), model)
        out = out.reshape(meg["labels"].shape) * meg["loss_mask"].to(out.dtype)
        return torch.cat([out.new_zeros(out.shape[0], 1), out[:, :-1]], dim=1)

    return losses


def _ensure_groups() -> bool:
    """A 1-process group and Megatron's parallel state when the caller has none; returns whether this call
    created the default group (so that the caller destroys it)."""
    from megatron.core import parallel_state

    created = ensure_process_group(60.0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    return created


def _logged(reports: list[dict[str, Tensor]], world: int) -> float | None:
    """The first reported metric reduced as Megatron's ``train_step`` reduces it (module doc)."""
    import torch.distributed as dist

    if not reports or not isinstance(reports[0], dict) or not reports[0]:
        return None
    key = next(iter(reports[0]))
    vals = torch.vstack([torch.as_tensor(r[key]).double().reshape(-1) for r in reports])
    if vals.shape[1] == 2:  # [Σ loss, Σ tokens]: summed, then divided, whatever calculate_per_token_loss
        tot = vals.sum(dim=0)
        if world > 1:
            dist.all_reduce(tot)
        return float(tot[0] / tot[1].clamp(min=1))
    mean = vals[:, 0].mean().reshape(1)
    if world > 1:
        dist.all_reduce(mean)
        mean /= world
    return float(mean)


def run_megatron(
    stack: MegatronStep, cfg: Config, batch: AuditBatch, rank: int, world: int, model: nn.Module
) -> RunResult:
    """One step of ``stack`` on megatron-core's schedule on this rank (``model`` freshly built)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    created = _ensure_groups()
    try:
        initial = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        parts = split_rows(batch.rows, cfg)
        mbs = [megatron_microbatch(batch.microbatch(rows)) for rows in parts[rank]]
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("audit: the Megatron model has no .config (a TransformerConfig)")
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step(stack),
            data_iterator=iter(mbs),
            model=model,
            num_microbatches=cfg.ga,
            seq_length=batch.input_ids.shape[1],
            micro_batch_size=cfg.micro,
            forward_only=False,
        )
        logged = _logged(list(reports), world)
        grads = {}
        for n, p in model.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads[n] = g.detach().double().clone()
        assignment = {row: (r, k) for r, ks in enumerate(parts) for k, rows in enumerate(ks) for row in rows}
        note = ""
        if cfg.recompute:  # megatron-core's recomputation is a TransformerConfig field the user sets
            note = "megatron-core: recomputation is your TransformerConfig's (recompute_granularity); run as configured"
        return RunResult(grads, logged, assignment, initial, note)
    finally:
        if created:
            import torch.distributed as dist

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
