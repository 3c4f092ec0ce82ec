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
- the MTP depths' calls of ``compute_language_model_loss`` (unmasked, from ``process_mtp_loss``): MindFormers'
  per-token values with the gradient of lossparity's ``own`` MTP term, ``λ·(1/D)·Σ_d J_d``.
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
    mtp_masks: list[Tensor] = field(default_factory=list)  # depth d's loss mask of the whole batch (rolled left d)
    mtp_norms: list[lpm.Normalizers] = field(default_factory=list)
    mtp_calls: int = 0  # MTP-depth calls since the last main-loss call: the depth index
    mtp_shares: list[Tensor] = field(default_factory=list)


def _roll_left(x: Tensor, d: int) -> Tensor:
    """``x [b, S]`` shifted left by ``d`` along the sequence, zero-filled: MindFormers' ``roll_tensor(shifts=-1)``
    applied ``d`` times, as ``process_mtp_loss`` rolls the labels and the loss mask of MTP depth ``d``."""
    return ops.concat([x[:, d:], ops.zeros((x.shape[0], min(d, x.shape[1])), x.dtype)], 1)[:, : x.shape[1]]


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
        depths = self._mtp_depths()
        masks = [mask] + [_roll_left(mask, d) for d in range(1, depths + 1)]
        counts = [lpm.count_normalizers(m, seg) for m in masks]
        if getattr(trainer, "enable_parallel", False):
            from mindspore.mint.distributed import all_reduce  # noqa: PLC0415 (only with several ranks)

            stacked = ops.stack([c.stacked() for c in counts])  # one all-reduce for the main loss and every depth
            all_reduce(stacked, group=self._dp_group())
            counts = [lpm.Normalizers.from_stacked(stacked[i]) for i in range(len(counts))]
        return _Step(counts[0], k / self._sense(k), rows // k, seg, mtp_masks=masks[1:], mtp_norms=counts[1:])

    def _mtp_depths(self) -> int:
        """MTP depths of the model (``config.mtp_num_layers`` of a cell that runs the MTP block), else 0."""
        for cell in self._lm_cells:
            if getattr(cell, "mtp_process", False):
                return int(getattr(cell.config, "mtp_num_layers", 0) or 0)
        return 0

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
            if step_ctx.mtp_shares:  # (1/D) Σ_d J_d, without MindFormers' λ
                mtp = ops.stack(step_ctx.mtp_shares).sum()
                if getattr(self.trainer, "enable_parallel", False):
                    from mindspore.mint.distributed import all_reduce  # noqa: PLC0415

                    all_reduce(mtp, group=self._dp_group())
                self.logs["lossparity/mtp_objective"] = mtp
            return out

        return training_step

    def lm_loss(self, cell: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        """The cell's ``compute_language_model_loss`` with the gradient of this microbatch's objective share.

        GPTModel calls it once per forward for the main loss with the loss mask. MindFormers' MTP depths call
        it before, without a mask (``process_mtp_loss`` masks the per-token losses, divides by the depth's
        microbatch token count and feeds ``λ/D ·`` that to its MTP auto-scaler): their per-token values keep
        MindFormers' numbers and get the gradient of lossparity's ``own`` MTP term, ``λ·(1/D)·Σ_d J_d`` with
        ``J_d`` the mode's objective on depth ``d``'s rolled mask with its own global counts."""

        def compute_language_model_loss(labels: Tensor, logits: Tensor, loss_mask: Tensor = None) -> Any:
            value = original(labels, logits, loss_mask)
            step = self._step
            if step is None:  # evaluation, or a forward outside training_step
                return value
            if loss_mask is None:
                return self._mtp_depth(step, labels, logits, value)
            if isinstance(value, tuple):  # calculate_per_token_loss: (numerator, denominator)
                raise MindFormersRefusal("lossparity.mindformers: calculate_per_token_loss=True is not hooked")
            micro = step.calls
            step.calls += 1
            step.mtp_calls = 0
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

    def _mtp_depth(self, step: _Step, labels: Tensor, logits: Tensor, value: Tensor) -> Tensor:
        """One MTP depth's per-token losses (MindFormers' ``compute_language_model_loss`` without a mask)."""
        d = step.mtp_calls
        if d >= len(step.mtp_masks):  # not an MTP depth this hook counted: MindFormers' own numbers
            return value
        step.mtp_calls += 1
        rows = slice(step.calls * step.micro_rows, (step.calls + 1) * step.micro_rows)
        mask = step.mtp_masks[d][rows]
        seg = None if step.segment_ids is None else step.segment_ids[rows]
        nll = lpm.token_nll(logits.reshape(tuple(labels.shape) + (logits.shape[-1],)), labels)
        weights = lpm.token_weights(self.mode, mask, step.mtp_norms[d], segment_ids=seg)
        if d == 0:
            step.mtp_shares.append(ops.zeros((), ms.float32))
        step.mtp_shares[-1] = step.mtp_shares[-1] + ops.stop_gradient((weights * nll).sum()) / len(step.mtp_masks)
        # MindFormers back-propagates (loss_scale·λ/D)·mask'_t/num_tokens' into value_t (loss_scale = sense/K),
        # with its own depth mask mask': 2.0.0's process_mtp_loss flattens the mask after depth 1, so depth d+1
        # rolls the flattened depth-1 mask by d across rows. mask' ⊇ mask where mask is 1, so dividing out
        # num_tokens' leaves exactly lossparity's weights (the extra positions of mask' get no gradient).
        flat = (step.mtp_masks[0][rows] != 0).astype(ms.float32).reshape(-1)
        num_tokens = ops.concat([flat[d:], ops.zeros((d,), ms.float32)]).sum() if d else flat.sum()
        g = (nll * weights * num_tokens * step.factor).reshape(value.shape)
        return ops.stop_gradient(value) + (g - ops.stop_gradient(g))

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
        # GPTModel's method; not MindFormers' MultiTokenPredictionBlock, whose attribute of that name is a
        # CrossEntropyLoss sub-cell that its loss path never calls (process_mtp_loss is given GPTModel's method)
        cells = [
            c
            for m in _models(self.trainer)
            for c in _cells(m)
            if hasattr(c, "compute_language_model_loss") and not isinstance(c.compute_language_model_loss, ms.nn.Cell)
        ]
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
    With MTP (``mtp_num_layers = D``) the MTP term's gradient becomes lossparity's ``own`` convention,
    ``λ·(1/D)·Σ_d J_d`` (``J_d``: the mode on depth ``d``'s rolled mask with its own global counts; logged as
    ``"lossparity/mtp_objective"`` without ``λ``). The MoE terms keep MindFormers' gradients (their accounting
    agrees with lossparity's except the fixed defects). Raises :class:`MindFormersRefusal` for a run the hook
    cannot make exact (pipeline or context parallelism, ``calculate_per_token_loss``, ``chunk_loss_num > 1``),
    before anything is rebound.
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
