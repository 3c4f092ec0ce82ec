"""Install lossparity's objective and accounting fixes into a MindFormers 2.x pynative ``Trainer`` instance.

What is rebound, on the objects of the running process only (``Installed.uninstall`` restores them):

- ``trainer.training_step``: before MindFormers' own gradient-accumulation loop, the step's global counts
  (``Ntok``, ``N``, ``Ndoc``) are taken from the whole batch of this rank (labels, loss mask, packed-row
  ``actual_seq_len``) and summed over the data-parallel ranks (one all-reduce of three integers); after it,
  the step's objective is summed over the microbatches and ranks and stored in :attr:`Installed.logs`.
- ``compute_language_model_loss`` of every language-model cell: returns MindFormers' own value (its token mean,
  so MindFormers' logged ``loss`` is unchanged) whose gradient is replaced by that of this microbatch's share
  of lossparity's objective, ``J_mb = numerator(mb) / denominator(step)``, scaled by ``K / sense`` (``K``
  microbatches, ``sense`` MindFormers' backward sense ``1/(world/pp)``) so that MindFormers' ``loss / K``
  and its summed data-parallel gradients leave ``Σ ∇J_mb = ∇J``. The value is
  ``v + (c·J_mb − stop_gradient(c·J_mb))``: the bracket is exactly 0 forward.
- the fixes (:data:`FIXES`): ``global_aux_dp`` (the routers' ``_apply_global_aux_loss`` sums the running
  counts and tokens over the data-parallel ranks too), ``global_aux_reset`` (the running buffer reset at the
  start of every step, on every stage, as Megatron does), ``indexer_layers`` (one indexer tracker slot per
  decoder layer, so ``get_index_loss()`` is the mean over the layers).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mindspore as ms
from mindspore import Tensor, ops

from .. import mindspore as lpm
from ..options import check_option

__all__ = ["FIXES", "MINDFORMERS_MODES", "PRESETS", "Installed", "MindFormersRefusal", "install"]

MINDFORMERS_MODES = ("per_token", "per_sample", "per_document")
FIXES = ("global_aux_dp", "global_aux_reset", "indexer_layers")
# the parity presets: MindFormers as released (every fix off) and lossparity's accounting (every fix on)
PRESETS: dict[str, tuple[str, ...]] = {"mindformers-2.0.0": (), "lossparity": FIXES}


class MindFormersRefusal(ValueError):
    """A MindFormers setting under which lossparity cannot make the objective exact (raised at install)."""


@dataclass
class _Step:
    """What one training step knows: the global counts, the GA/DP gradient factor, the rows' segment ids,
    and the shares recorded by the microbatches."""

    norms: lpm.Normalizers
    factor: float
    micro_rows: int
    segment_ids: Tensor | None
    shares: list[Tensor] = field(default_factory=list)
    calls: int = 0  # main-loss calls so far: the microbatch index


def _cells(model: Any) -> Iterable[Any]:
    if hasattr(model, "cells_and_names"):
        return [cell for _, cell in model.cells_and_names()]
    return [model]


def _models(trainer: Any) -> list[Any]:
    model = trainer.model
    return list(model) if isinstance(model, (list, tuple)) else [model]


@dataclass
class Installed:
    """Handle of an installation: ``mode``, ``fixes``, the last step's ``logs`` (tensors, read to the host only
    by whoever prints them) and ``uninstall()``."""

    trainer: Any
    mode: str
    fixes: tuple[str, ...]
    logs: dict[str, Tensor] = field(default_factory=dict)
    _saved: list[tuple[Any, str, Any, bool]] = field(default_factory=list)
    _step: _Step | None = None

    def uninstall(self) -> None:
        """Put back every attribute this installation rebound."""
        for owner, name, value, had in reversed(self._saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self._saved.clear()

    def _rebind(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        self._saved.append((owner, name, vars(owner).get(name), had))
        setattr(owner, name, value)

    # -- the step's counts ------------------------------------------------------------------------------

    def _mask(self, cell: Any, inputs: dict[str, Tensor]) -> Tensor:
        """The loss mask MindFormers' GPTModel forms (``_preprocess_input_labels_and_masks``): the given
        ``loss_mask`` (else ``input_ids != pad_token_id``) times ``labels != ignore_token_id``."""
        labels = inputs["labels"]
        if inputs.get("loss_mask") is not None:
            mask = inputs["loss_mask"].astype(ms.float32)
        else:
            mask = (inputs["input_ids"] != getattr(cell, "pad_token_id", 0)).astype(ms.float32)
        ignore = getattr(cell, "ignore_token_id", -100)
        return mask * (labels != ignore).astype(ms.float32)

    def begin_step(self, inputs: dict[str, Tensor]) -> _Step:
        """The step's global counts from this rank's whole batch, summed over the data-parallel ranks."""
        trainer = self.trainer
        k = int(trainer.num_accumulation_steps)
        labels = inputs.get("labels")
        if labels is None:
            raise MindFormersRefusal("lossparity.mindformers: the batch has no 'labels' column")
        rows, seq = int(labels.shape[0]), int(labels.shape[1])
        if rows % k:
            raise MindFormersRefusal(f"lossparity.mindformers: {rows} rows do not split into {k} microbatches")
        cell = self._lm_cells[0]
        mask = self._mask(cell, inputs)
        seg = None
        if self.mode == "per_document":
            asl = inputs.get("actual_seq_len")
            if asl is None:
                raise MindFormersRefusal(
                    "lossparity.mindformers: per_document needs the packed-row column 'actual_seq_len'"
                )
            seg = lpm.segment_ids_from_actual_seq_len(asl.reshape(rows, -1), seq)
        norms = lpm.count_normalizers(mask, seg)
        if getattr(trainer, "enable_parallel", False):
            from mindspore.mint.distributed import all_reduce  # noqa: PLC0415 (only with several ranks)

            stacked = norms.stacked()
            all_reduce(stacked, group=self._dp_group())
            norms = lpm.Normalizers.from_stacked(stacked)
        return _Step(norms, k / self._sense(k), rows // k, seg)

    def _dp_group(self) -> Any:
        return getattr(self.trainer, "metric_reduce_group", None)

    def _sense(self, k: int) -> float:
        """MindFormers' backward sense of the main loss (``get_loss_sense``): ``1/(world/pp)``, 1 on one rank."""
        from mindformers.pynative.distributed.utils import get_loss_sense  # noqa: PLC0415

        sense = get_loss_sense(
            parallelism=self.trainer.config.parallelism,
            enable_parallel=bool(getattr(self.trainer, "enable_parallel", False)),
            gradient_accumulation_steps=k,
            apply_gradient_accumulation=False,
        )
        return float(sense.asnumpy().reshape(-1)[0]) if isinstance(sense, Tensor) else float(sense)

    # -- the rebound functions --------------------------------------------------------------------------

    def training_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """MindFormers' ``training_step`` with the step's counts taken first and the objective logged after."""

        def training_step(inputs: dict[str, Tensor], loss: Any, grad_norm: Any, step: int) -> Any:
            if "global_aux_reset" in self.fixes:
                for model in _models(self.trainer):  # every stage (chunk) of this rank, every step
                    if hasattr(model, "reset_model_temporary_tensors"):
                        model.reset_model_temporary_tensors()
            self._step = self.begin_step(inputs)
            try:
                out = original(inputs, loss, grad_norm, step)
            finally:
                step_ctx, self._step = self._step, None
            objective = ops.stack(step_ctx.shares).sum() if step_ctx.shares else ops.zeros((), ms.float32)
            if getattr(self.trainer, "enable_parallel", False):
                from mindspore.mint.distributed import all_reduce  # noqa: PLC0415

                all_reduce(objective, group=self._dp_group())
            units = {"per_token": "tokens", "per_sample": "samples", "per_document": "documents"}[self.mode]
            self.logs = {
                "lossparity/lm_objective": objective,
                "lossparity/units": getattr(step_ctx.norms, units),
            }
            return out

        return training_step

    def lm_loss(self, cell: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        """The cell's ``compute_language_model_loss`` with the gradient of this microbatch's objective share.

        GPTModel calls it once per forward for the main loss with the loss mask; MindFormers' MTP depths call
        it without a mask (``process_mtp_loss``, which masks and averages the per-token losses itself): those
        calls keep MindFormers' value and gradient."""

        def compute_language_model_loss(labels: Tensor, logits: Tensor, loss_mask: Tensor = None) -> Any:
            value = original(labels, logits, loss_mask)
            step = self._step
            if step is None or loss_mask is None:  # evaluation, a forward outside training_step, an MTP depth
                return value
            if isinstance(value, tuple):  # calculate_per_token_loss: (numerator, denominator)
                raise MindFormersRefusal("lossparity.mindformers: calculate_per_token_loss=True is not hooked")
            micro = step.calls
            step.calls += 1
            nll = lpm.token_nll(logits.reshape(tuple(labels.shape) + (logits.shape[-1],)), labels)
            mask = loss_mask.reshape(labels.shape)
            seg = None
            if step.segment_ids is not None:
                seg = step.segment_ids[micro * step.micro_rows : (micro + 1) * step.micro_rows]
            share = lpm.share(self.mode, nll, mask, step.norms, segment_ids=seg)
            step.shares.append(ops.stop_gradient(share))
            scaled = share * step.factor
            return ops.stop_gradient(value) + (scaled - ops.stop_gradient(scaled))

        return compute_language_model_loss

    # -- the fixes --------------------------------------------------------------------------------------

    def fix_global_aux_dp(self, router: Any) -> Callable[..., Any]:
        """``_apply_global_aux_loss`` with the running counts and token count summed over the data-parallel
        ranks as well (MindFormers 2.0.0 sums them over its aux-loss group only): the ``global_running``
        scope of lossparity (``c̄^{(m)}`` and ``T_m`` global over DP)."""
        mod = sys.modules[type(router).__module__]

        def _apply_global_aux_loss(
            top_scores: Tensor, scores_for_aux_loss: Tensor, routing_map: Tensor, seq_length: int = 0, bsz: int = 0
        ) -> Tensor:
            counts, _, total = mod.get_tokens_per_expert_and_token_count(
                routing_map=routing_map, reduce_group=mod.get_moe_aux_loss_group(), topk=router.top_k
            )
            if getattr(self.trainer, "enable_parallel", False):
                from mindspore.mint.distributed import all_reduce  # noqa: PLC0415

                t = total if isinstance(total, Tensor) else Tensor([total], ms.float32)  # MindFormers: a Python int
                both = ops.concat([counts.astype(ms.float32).reshape(-1), t.astype(ms.float32).reshape(1)])
                all_reduce(both, group=self._dp_group())
                counts, total = both[:-1].astype(counts.dtype), both[-1]
            router.global_tokens_per_expert += counts
            router.ga_steps += 1
            averaged = router.global_tokens_per_expert / router.ga_steps
            loss = mod.switch_load_balancing_loss_func(
                probs=scores_for_aux_loss,
                tokens_per_expert=averaged,
                total_num_tokens=total,
                topk=router.top_k,
                num_experts=router.config.num_moe_experts,
                moe_aux_loss_coeff=router.moe_aux_loss_coeff,
            )
            return router._attach_and_log_aux_loss(top_scores, loss, router.moe_aux_loss_coeff)

        return _apply_global_aux_loss

    def fix_indexer_layers(self) -> int:
        """Give every attention core with an indexer tracker its own slot, ``1..L`` in model order (MindFormers
        2.0.0: ``layer_index = max(1, layer_number)`` puts decoder layers 0 and 1 in one slot, and the mean
        over slots is then not the mean over layers). Returns the number of cores renumbered."""
        cores = []
        for model in _models(self.trainer):
            for cell in _cells(model):
                core = getattr(cell, "core_attention", None)
                if hasattr(cell, "layer_index") and core is not None and hasattr(core, "layer_number"):
                    cores.append((cell, core))
        for slot, (cell, core) in enumerate(cores, start=1):
            self._rebind(cell, "layer_index", slot)
            self._rebind(core, "layer_number", slot)
        return len(cores)

    @property
    def _lm_cells(self) -> list[Any]:
        cells = [c for m in _models(self.trainer) for c in _cells(m) if hasattr(c, "compute_language_model_loss")]
        if not cells:
            raise MindFormersRefusal("lossparity.mindformers: the model has no compute_language_model_loss")
        return cells


def install(
    trainer: Any,
    mode: str = "per_sample",
    *,
    fixes: Iterable[str] | str = "lossparity",
) -> Installed:
    """Make a built MindFormers 2.x pynative ``Trainer`` optimize lossparity's objective of ``mode`` and apply
    ``fixes``; returns the :class:`Installed` handle (``.uninstall()`` restores MindFormers).

    ``mode``: ``per_token``: ``J = Σ_t l_t / max(Ntok, 1)`` over the global batch (MindFormers as released
    averages per-microbatch token means instead, which differs with ragged microbatches); ``per_sample``:
    ``J = (1/N) Σ_i s_i / max(n_i, 1)`` over the ``N`` rows of the global batch; ``per_document``:
    ``J = (1/max(Ndoc, 1)) Σ_j s_j / max(n_j, 1)`` over the packed documents (from ``actual_seq_len``).
    ``fixes``: a preset name of :data:`PRESETS` (``"lossparity"``: all fixes; ``"mindformers-2.0.0"``: none)
    or names from :data:`FIXES`. MindFormers' logged ``loss`` stays its token mean; the objective of the step
    is ``handle.logs["lossparity/lm_objective"]`` (with ``"lossparity/units"``, the global unit count).
    The MTP and MoE terms keep MindFormers' own gradients (their accounting agrees with lossparity's except
    the fixed defects). Raises :class:`MindFormersRefusal` for a run the hook cannot make exact (pipeline
    parallelism, context parallelism, ``calculate_per_token_loss``), before anything is rebound.
    """
    mode = check_option("mode", mode, MINDFORMERS_MODES)
    chosen = PRESETS[check_option("fixes", fixes, tuple(PRESETS))] if isinstance(fixes, str) else tuple(fixes)
    for name in chosen:
        check_option("fixes", name, FIXES)
    parallelism = getattr(getattr(trainer, "config", None), "parallelism", None)
    problems = []
    if int(getattr(parallelism, "pipeline_parallel", 1) or 1) > 1:
        problems.append("pipeline_parallel > 1 (the loss is computed in the pipeline schedule, not hooked)")
    if int(getattr(parallelism, "context_parallel", 1) or 1) > 1:
        problems.append("context_parallel > 1 (rows are split over ranks; per-row counts would need a reduction)")
    handle = Installed(trainer, mode, chosen)
    cells = handle._lm_cells
    if any(getattr(c, "calculate_per_token_loss", False) for c in cells):
        problems.append("calculate_per_token_loss=true (the loss is a (sum, count) pair)")
    if any(int(getattr(getattr(c, "config", None), "chunk_loss_num", 0) or 0) > 1 for c in cells):
        problems.append("chunk_loss_num > 1 (the chunked loss passes transposed logits)")
    if problems:
        raise MindFormersRefusal("lossparity.mindformers refused: " + "; ".join(problems))
    handle._rebind(trainer, "training_step", handle.training_step(trainer.training_step))
    for cell in cells:
        handle._rebind(cell, "compute_language_model_loss", handle.lm_loss(cell, cell.compute_language_model_loss))
    if "global_aux_dp" in chosen:
        for model in _models(trainer):
            for cell in _cells(model):
                if getattr(cell, "aux_loss_type", None) == "global_aux_loss":
                    handle._rebind(cell, "_apply_global_aux_loss", handle.fix_global_aux_dp(cell))
    if "indexer_layers" in chosen:
        handle.fix_indexer_layers()
    return handle
