"""Hugging Face ``transformers.Trainer`` (and TRL) integration: every optimizer step optimizes exactly the
chosen lossparity mode, whatever ``per_device_train_batch_size`` × ``gradient_accumulation_steps`` ×
data-parallel size (docs/semantics.md §1, §3).

How (pre-counted normalizers, docs/semantics.md §3): the Trainer fetches the accumulation window's
batches before the step (``get_batch_samples``); the mixin counts the mode's normalizers (``Ntok``,
``N``, ``Ndoc``, ``D·K``) from their shifted labels and sums them over the data-parallel ranks in one
all-reduce (:class:`lossparity.Accountant`). Each microbatch then back-propagates its exact share
``numerator(mb) / denominator`` of ``J``, with the causal shift and ``ignore_index = -100`` that HF causal
LMs use, computed by the fused cross-entropy from the LM head's input and weight (no logits tensor;
``integrations/hf_head.py``) or, for heads that are not a scaled linear map, from the model's logits;
the share is multiplied by the number of data-parallel processes because DDP and DeepSpeed (every ZeRO stage;
the Trainer passes ``scale_wrt_gas=False``) average gradients (so that they are summed, as §3 requires).
``log_history`` gains ``lm_loss`` (global token mean ``S/Ntok``) and ``objective`` (``J``); HF's own ``loss``
is ``J`` too.

Packed rows: ``per_document`` takes the documents from a ``segment_ids`` column (0 = padding) or, as
TRL's padding-free collator emits, from ``position_ids`` restarting at 0 (positions where
``attention_mask`` is 0 are padding). MoE models run with ``output_router_logits`` keep their
auxiliary term ``router_aux_loss_coef · aux``, in the scope ``aux_scope`` (docs/semantics.md §5):
``global_lagged`` (default, layout-invariant: transformers' ``load_balancing_loss_func`` on the whole
global batch, with the expert fractions of the previous step), ``microbatch`` (each microbatch's own
``aux_loss`` weighted ``1/(D·K)``) or ``hf`` (each microbatch's ``aux_loss`` added unweighted, as
``transformers.Trainer`` does: ``D·K`` times per step).

Usage (two lines changed in an existing script)::

    from lossparity.integrations.hf import LossParityTrainer
    trainer = LossParityTrainer(model=model, args=args, train_dataset=ds, loss_mode="per_sample")

    class MySFT(LossParityMixin, trl.SFTTrainer): ...   # TRL: mixin first
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..losses.fused_cross_entropy import fused_linear_cross_entropy
from ..losses.modes import count_normalizers, denominator
from ..losses.modes import objective as _batch_objective
from ..losses.token_weights import token_weights
from ..options import MODES, MTP_CONVENTIONS, Mode, MTPConvention, check_option
from . import require
from .hf_aux_terms import ROWS, MoEAuxTerms
from .hf_head import HeadCapture, HeadPlanner
from .hf_mtp import mtp_forward
from .hf_mtp_terms import MTPTerms, per_token_ce
from .hf_parity import ParityCallback as ParityCallback  # the live parity guard (hf_parity.py)

__all__ = ["IGNORE_INDEX", "LossParityMixin", "LossParityTrainer", "shifted_labels", "segments_of"]  # noqa: F822

IGNORE_INDEX = -100  # the label HF causal-LM losses and Trainer's num_items_in_batch ignore
_LOSS_ONLY_KEYS = ("labels", "shift_labels", "segment_ids")  # columns the model's forward must not see
_BAD = "lossparity_bad_input"  # extra count: a rank flags invalid input inside the pre-count all-reduce
HF_AUX_SCOPES = ("global_lagged", "microbatch", "hf")  # aux_scope of LossParityMixin (semantics §5)


def shifted_labels(batch: Mapping[str, Any], shift: bool = True) -> Tensor:
    """The label predicted at each position, ``[b, S]``: ``batch["shift_labels"]`` when the collator gives
    it (padding-free collators), else ``labels[:, t+1]`` with ``IGNORE_INDEX`` at the last position (HF's
    ``ForCausalLMLoss``), or ``labels`` unchanged when ``shift`` is False."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch.get("labels")
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise ValueError(
            f"labels: every batch needs a [batch, seq] 'labels' tensor (or 'shift_labels'); got {type(labels).__name__}"
        )
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift else labels


def segments_of(batch: Mapping[str, Any], shape: torch.Size) -> Tensor:
    """Document ids of packed rows, ``[b, S]`` (0 = padding): ``batch["segment_ids"]``, or the running count
    of ``position_ids == 0`` (each restart opens a document), zeroed where ``attention_mask`` is 0."""
    if "segment_ids" in batch:
        seg = batch["segment_ids"]
    elif isinstance(batch.get("position_ids"), Tensor):
        pos = batch["position_ids"].expand(shape)
        seg = (pos == 0).long().cumsum(-1)
        mask = batch.get("attention_mask")
        if isinstance(mask, Tensor) and mask.shape == shape:
            seg = seg * (mask != 0)
    else:
        raise ValueError(
            "segment_ids: loss_mode='per_document' needs the documents of packed rows: a 'segment_ids' column "
            "or 'position_ids' that restart at 0 for each document (TRL padding_free/packing)"
        )
    if tuple(seg.shape) != tuple(shape):
        raise ValueError(f"segment_ids: shape {tuple(seg.shape)} does not match labels {tuple(shape)}")
    return seg


class LossParityMixin(MoEAuxTerms, MTPTerms, HeadPlanner):
    """Mix into ``transformers.Trainer`` or a subclass (TRL ``SFTTrainer``...), **first** in the bases.

    Extra constructor keywords: ``loss_mode`` (a mode of docs/semantics.md §1, default ``per_sample``),
    ``fixed_length`` (the ``L`` of ``sample_sum_norm``), ``allow_empty_steps`` (default False: a step
    whose labels are all ``-100`` on every rank raises, since it is almost always a data bug),
    ``aux_scope`` (MoE models with ``output_router_logits``, docs/semantics.md §5; ``E`` experts,
    ``c = router_aux_loss_coef``):

    - ``global_lagged`` (default): ``c · E · Σ_e f_e · P_e / R`` with ``P_e`` the attention-mask weighted
      softmax scores of all MoE layers summed over the step's global batch, ``R`` its rows (layers ×
      non-padding tokens) and ``f_e = c_e / R'`` the fractions of top-k assignments of the *previous*
      step's global batch (``k/E`` in the first step), computed in float64 from ``router_logits``. Each
      microbatch back-propagates its share; the fractions ride in the pre-count all-reduce of the next
      step (no further collective). Invariant under ``D``, ``K`` and the microbatch size.
    - ``microbatch``: ``c · aux(mb) / (D·K)`` with ``aux(mb)`` the model's own ``aux_loss``.
    - ``hf``: ``c · aux(mb)`` for every microbatch, as ``transformers.Trainer`` adds it (``D·K`` times).

    The logged ``aux_loss`` is the term's value: the global value (``global_lagged``), or the mean of
    the microbatches' ``aux_loss`` (``microbatch``, ``hf``).

    ``fused_loss`` (default True): the per-token losses and their gradients come from the LM head's input
    and weight (:func:`~lossparity.losses.fused_cross_entropy.fused_linear_cross_entropy`, weights
    ``Accountant.token_weights``): the model computes no ``[b, S, V]`` logits and no float32 copy of them is
    made. Models whose logits are not ``hidden @ W.T`` up to a constant scale (soft-capping, a head bias, a
    custom head, sharded weights) fall back to the logits path with one printed note
    (:mod:`lossparity.integrations.hf_head`); ``fused_loss=False`` always uses the logits path.

    MTP (docs/semantics.md §4): ``mtp_depths`` ``Dm`` (default: the layers :func:`~lossparity.integrations.
    hf_mtp.attach_mtp` attached, else 0), ``mtp_convention`` (``own``: ``λ·(1/Dm)·Σ_k J_k``; ``main``: every
    depth over the main denominator; ``pooled``: ``λ·J_pooled``) and ``mtp_weight`` ``λ``. The model's output
    carries the depths (``mtp_hidden_states`` or ``mtp_logits``, :mod:`lossparity.integrations.hf_mtp`); depth
    ``k``'s labels are the main shifted labels rolled left by ``k`` within rows and documents.

    Tensor parallelism (``tp_plan``): counts over the ``world / tp`` data-parallel ranks, shares multiplied
    by that size (not by ``tp``); context and sequence parallelism raise ``ValueError`` with the reason.

    Bad input (no labels, ``per_document`` without segment ids or position ids, all labels ignored, a
    model output without ``logits``) raises ``ValueError`` naming the argument before the first optimizer
    step, on every rank: a rank's error is flagged inside the pre-count all-reduce so no rank hangs.
    """

    model: Any  # set by transformers.Trainer, the class this is mixed into

    # Trainer.training_step must not divide our loss by the accumulation steps: it is already J's share.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        loss_mode: Mode = "per_sample",
        fixed_length: int | None = None,
        allow_empty_steps: bool = False,
        aux_scope: str = "global_lagged",
        fused_loss: bool = True,
        mtp_depths: int | None = None,
        mtp_convention: MTPConvention = "own",
        mtp_weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        transformers = require("transformers", "hf")
        if not hasattr(transformers.Trainer, "loss_is_scaled_for_ga"):
            raise ImportError(
                "lossparity.integrations.hf needs transformers >= 5 (Trainer.loss_is_scaled_for_ga): "
                'pip install "lossparity[hf]"'
            )
        self.loss_mode: Mode = check_option("loss_mode", loss_mode, MODES)
        if loss_mode == "sample_sum_norm" and (fixed_length is None or fixed_length <= 0):
            raise ValueError(f"fixed_length: loss_mode 'sample_sum_norm' needs fixed_length > 0, got {fixed_length}")
        self.lp_fixed_length = fixed_length
        self.lp_allow_empty_steps = allow_empty_steps
        self.lp_aux_scope = check_option("aux_scope", aux_scope, HF_AUX_SCOPES)
        if not isinstance(fused_loss, bool):
            raise TypeError(f"fused_loss must be True or False, got {fused_loss!r}")
        self.lp_fused_loss = fused_loss
        self.lp_mtp_convention = check_option("mtp_convention", mtp_convention, MTP_CONVENTIONS)
        if isinstance(mtp_weight, bool) or not isinstance(mtp_weight, (int, float)) or not mtp_weight >= 0:
            raise ValueError(f"mtp_weight: the MTP λ must be a finite number >= 0, got {mtp_weight!r}")
        self.lp_mtp_weight = float(mtp_weight)
        self._lp_head = None  # decided at the first compute_loss (hf_head.plan_head)
        self._lp_aux_local: Tensor | None = None  # [E + 1]: this rank's counts c_e and rows R of the step
        self._lp_aux_prev: list[float] | None = None  # the previous step's local counts and rows (host)
        self._lp_att: Tensor | None = None
        self._lp_acc: Any = None
        self._lp_left = 0  # microbatches of the current step not yet seen by compute_loss
        self._lp_open = False  # a step was begun and not yet closed (finish_step + logs)
        self._lp_in_train = False
        self._lp_step_logs: list[dict[str, float | None]] = []
        super().__init__(*args, **kwargs)
        self.lp_mtp_depths = self._lp_resolve_mtp_depths(mtp_depths)
        # The mixin computes the loss itself: options that would change HF's loss would be silently ignored.
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError("compute_loss_func: LossParityMixin computes the loss of loss_mode itself; drop it")
        if getattr(self.args, "label_smoothing_factor", 0) != 0:  # type: ignore[attr-defined]
            raise ValueError("args.label_smoothing_factor: label smoothing is not supported by LossParityMixin")

    # ------------------------------------------------------------------ step plan
    def _lp_accountant(self) -> Any:
        if self._lp_acc is None:
            from ..distributed.accountant import Accountant

            # Gradients: the loss is multiplied by the data-parallel size (DDP averages over it), so the
            # accountant touches none (grad_reduction="sum"); it counts over the data-parallel ranks only.
            self._lp_acc = Accountant(
                self.loss_mode,
                dims=self._lp_dims(),
                grad_reduction="sum",
                fixed_length=self.lp_fixed_length,
                mtp_depths=self.lp_mtp_depths,
                mtp_convention=self.lp_mtp_convention,
            )
            if self._lp_aux_coef() is not None:
                self._lp_acc.declare_metric("aux_loss")
        return self._lp_acc

    def _lp_segments(self, batch: Mapping[str, Any], shape: torch.Size) -> Tensor | None:
        """The documents of a batch where the loss needs them: ``per_document``, and MTP on rows that carry
        documents (``segment_ids`` or ``position_ids``: the depths' labels are rolled within documents)."""
        if self.loss_mode == "per_document":
            return segments_of(batch, shape)
        if self.lp_mtp_depths and ("segment_ids" in batch or isinstance(batch.get("position_ids"), Tensor)):
            return segments_of(batch, shape)
        return None

    def _lp_masks(self, batches: Sequence[Mapping[str, Any]]) -> tuple[list[Tensor], list[Tensor | None] | None]:
        shift = getattr(self, "_loss_shifts_labels", True)
        masks, segs = [], []
        for batch in batches:
            labels = shifted_labels(batch, shift)
            masks.append((labels != IGNORE_INDEX).float())
            self._lp_warn_packed_rows(batch)
            seg = self._lp_segments(batch, labels.shape)
            # Checked here, inside the pre-count, so that every rank stops (not one rank mid-backward).
            if seg is not None and bool(((seg == 0) & (labels != IGNORE_INDEX)).any()):
                raise ValueError(
                    "segment_ids: a label (not -100) sits at segment id 0 (padding); it would belong to no document"
                )
            segs.append(seg)
        return masks, (segs if any(s is not None for s in segs) else None)

    def _lp_warn_packed_rows(self, batch: Mapping[str, Any]) -> None:
        """Warn once when a row-weighted mode meets rows that pack several examples (padding-free/packing)."""
        pos = batch.get("position_ids")
        if self.loss_mode in ("per_document", "per_token") or getattr(self, "_lp_warned", False):
            return
        if isinstance(pos, Tensor) and bool(((pos == 0).sum(-1) > 1).any()):
            self._lp_warned = True
            warnings.warn(
                f"loss_mode={self.loss_mode!r} weights rows, and these rows pack several examples "
                "(position_ids restart at 0): use loss_mode='per_document' to weight every example once",
                stacklevel=2,
            )

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """Trainer hook: fetch the window's batches (HF), then pre-count the step's normalizers over ranks."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if batches:
            self._lp_begin_step(batches)
        return batches, num_items

    def _lp_begin_step(self, batches: list) -> None:
        if self._lp_open:  # the previous window was cut short (training stopped mid-window): drop it
            self._lp_acc, self._lp_left, self._lp_open = None, 0, False
        acc = self._lp_accountant()
        error: Exception | None = None
        try:
            masks, segs = self._lp_masks(batches)
        except ValueError as e:  # keep the collective: this rank flags, every rank raises below
            error = e
            masks = [torch.zeros(1, 1)]
            segs = [torch.ones(1, 1, dtype=torch.long)] if self.loss_mode == "per_document" else None
        extra = {_BAD: float(error is not None), **self._lp_aux_counts(batches)}
        acc.begin_step(masks, segs, extra_counts=extra, mtp_weight=self.lp_mtp_weight if self.lp_mtp_depths else None)
        if error is not None:
            raise error
        if acc.global_count(_BAD) > 0:
            raise ValueError(
                "another rank reported invalid input (labels/segment_ids) before the first forward of "
                "this step; see its error"
            )
        if acc.global_count("tokens") == 0 and not self.lp_allow_empty_steps:
            raise ValueError(
                f"labels: every label of this step is ignore_index ({IGNORE_INDEX}) on every rank: "
                "nothing to train on (pass allow_empty_steps=True to accept such steps)"
            )
        self._lp_left, self._lp_open = len(masks), True
        self._lp_mbs = acc.global_count("microbatches")
        # DDP (and DeepSpeed) average gradients over the data-parallel ranks: the shares are multiplied back
        # by their count; tensor-parallel ranks compute the same share of the same rows (not averaged).
        self._lp_factor = float(acc.groups.dp_size)
        if ROWS in extra:
            self._lp_aux_start(acc)

    # ------------------------------------------------------------------ loss
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Tensor:
        """Trainer hook: one microbatch; after the window's last one, close the step and keep its logs."""
        self._lp_in_train = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        finally:
            self._lp_in_train = False
        if self._lp_open and self._lp_left == 0:
            self._lp_open = False
            self._lp_acc.finish_step()
            self._lp_step_logs.append(self._lp_acc.logs())
            if self._lp_aux_local is not None:  # global_lagged: this step's counts, pre-counted with the next step
                self._lp_aux_prev, self._lp_aux_local = self._lp_aux_local.tolist(), None
        return loss

    def compute_loss(
        self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """This microbatch's exact share of ``J`` (training) or the batch's own ``J`` (evaluation); with MTP
        depths, ``J`` includes ``λ·(1/Dm)·Σ_k J_k`` (``own``/``main``) or ``λ·J_pooled`` (docs/semantics.md §4)."""
        labels = shifted_labels(inputs, getattr(self, "_loss_shifts_labels", True))
        seg = self._lp_segments(inputs, labels.shape)
        fwd = {k: v for k, v in inputs.items() if k not in _LOSS_ONLY_KEYS}
        if getattr(getattr(self.model, "config", None), "use_cache", None) is not None:
            # As TRL does: no KV cache in a loss forward (it also keeps HF's packed-sequence attention mask on).
            fwd.setdefault("use_cache", False)
        plan = self._lp_head_plan()
        with mtp_forward(self.model):  # attach_mtp's layers run in this forward only (not in generate)
            if plan.fused:
                with HeadCapture(self.model) as capture:
                    outputs = model(**fwd)
            else:
                outputs = model(**fwd)
        self._lp_att = fwd.get("attention_mask")  # the rows transformers' aux term weights (HF's convention)
        logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
        if not isinstance(logits, Tensor):
            raise ValueError(
                "model: its outputs have no 'logits' tensor; LossParityMixin computes the per-token "
                "loss from the logits (a model that fuses the LM head into its loss cannot be used)"
            )
        mtp = self._lp_mtp_inputs(outputs, labels, seg)
        hidden = capture.check(plan.model_type, plan.scale != 1.0) if plan.fused else None
        if hidden is not None:
            if plan.scale != 1.0:
                hidden = hidden * plan.scale
            loss = self._lp_fused_loss(hidden, capture.head.weight, labels, seg, outputs, mtp, plan.scale)
            return (loss, outputs) if return_outputs else loss
        per_token = per_token_ce(logits, labels)
        mask = (labels != IGNORE_INDEX).to(per_token.dtype)
        mtp_losses: list[Tensor] = []
        if mtp is not None:
            kind, xs, mtp_labels, _ = mtp
            head = self.model.get_output_embeddings()
            for x, lab in zip(xs, mtp_labels):
                # hidden states share the main head (and its known constant scale), logits are the model's own
                mtp_losses.append(per_token_ce(head(x) * plan.scale if kind == "hidden" else x, lab))
        if self._lp_in_train and self._lp_left > 0:
            acc = self._lp_acc
            share = acc.lm_loss(per_token, mask, seg)
            if mtp is not None:
                share = share + acc.mtp_loss(mtp_losses, mtp[3], seg)
            loss = self._lp_train_share(share, outputs)
        else:
            loss = _batch_objective(
                self.loss_mode,
                per_token,
                mask,
                segment_ids=seg if self.loss_mode == "per_document" else None,
                microbatch_size=per_token.shape[0],
                fixed_length=self.lp_fixed_length,
            )
            if mtp is not None:
                loss = loss + self._lp_eval_mtp(mtp_losses, mtp[3], mask, seg)
        return (loss, outputs) if return_outputs else loss

    def _lp_fused_loss(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        seg: Tensor | None,
        outputs: Any,
        mtp: tuple[str, list[Tensor], list[Tensor], list[Tensor]] | None = None,
        scale: float = 1.0,
    ) -> Tensor:
        """The fused path: ``Σ_t w[t]·CE_t`` from the head's input with the mode's per-token weights ``w``
        (the accountant's, training; the batch's own ``J``, evaluation), gradients formed in the forward;
        MTP depths given as head inputs likewise (their weights: the MTP term's), as logits from them."""
        labels = labels.to(hidden.device)
        mask = (labels != IGNORE_INDEX).float()
        train = self._lp_in_train and self._lp_left > 0
        if train:
            acc = self._lp_acc
            w = acc.token_weights(mask, seg)
            # the MTP weights read the microbatch index that add_lm_share advances: taken before it
            w_mtp = acc.mtp_token_weights(mtp[3], seg) if mtp is not None else None
        else:  # evaluation: the weights of J on this batch alone (one microbatch: D·K = 1)
            doc_seg = seg if self.loss_mode == "per_document" else None
            norms = count_normalizers(mask, doc_seg)
            den = denominator(self.loss_mode, norms)
            w = token_weights(
                self.loss_mode, mask, segment_ids=doc_seg, fixed_length=self.lp_fixed_length, denominator=den
            ).to(mask.device)
            w_mtp = self._lp_eval_mtp_weights(mtp[3], mask, doc_seg, den) if mtp is not None else None
        share, per_token = fused_linear_cross_entropy(hidden, weight, labels, w, ignore_index=IGNORE_INDEX)
        mtp_share: Tensor | None = None
        mtp_losses: list[Tensor] = []
        if mtp is not None and w_mtp is not None:
            kind, xs, mtp_labels, _ = mtp
            for x, lab, wk in zip(xs, mtp_labels, w_mtp):
                if kind == "hidden":
                    s_k, l_k = fused_linear_cross_entropy(
                        x * scale if scale != 1.0 else x, weight, lab, wk.to(x.device), ignore_index=IGNORE_INDEX
                    )
                else:
                    l_k = per_token_ce(x, lab)
                    s_k = (wk.to(l_k.device, l_k.dtype) * l_k).sum()
                mtp_share = s_k if mtp_share is None else mtp_share + s_k
                mtp_losses.append(l_k)
        if not train:
            return share if mtp_share is None else share + mtp_share
        out = acc.add_lm_share(share, per_token, mask, seg)
        if mtp is not None and mtp_share is not None:
            out = out + acc.add_mtp_share(mtp_share, mtp_losses, mtp[3], seg)
        return self._lp_train_share(out, outputs)

    def _lp_train_share(self, lm_share: Tensor, outputs: Any) -> Tensor:
        loss = lm_share
        coef = self._lp_aux_coef()
        if coef is not None:
            loss = loss + self._lp_aux_share(outputs, coef, loss.dtype)
        self._lp_left -= 1
        return loss * self._lp_factor

    # ------------------------------------------------------------------ logs and columns
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer hook: training logs gain ``lm_loss``, ``objective`` (and ``aux_loss``, ``mtp_<k>_loss``: depth
        ``k``'s global token mean ``S_k/Ntok_k``, without ``λ``), each the plain mean
        of its per-step values over the logging interval (docs/semantics.md §2)."""
        if "loss" in logs and self._lp_step_logs:
            steps, self._lp_step_logs = self._lp_step_logs, []
            mtp = [f"mtp_{k}_loss" for k in range(1, self.lp_mtp_depths + 1)]
            for key in ("lm_loss", "objective", "aux_loss", *mtp):
                values = [v for s in steps if (v := s.get(key)) is not None]
                if values:
                    logs[key] = sum(values) / len(values)
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()  # type: ignore[misc]
        cols = getattr(self, "_signature_columns", None)
        if cols is not None:  # keep the loss-only columns that the model's forward does not name
            self._signature_columns = list(cols) + [k for k in _LOSS_ONLY_KEYS if k not in cols]


def __getattr__(name: str) -> Any:
    # LossParityTrainer is built on first use so that importing this module needs no transformers.
    if name == "LossParityTrainer":
        transformers = require("transformers", "hf")
        cls = type(
            "LossParityTrainer",
            (LossParityMixin, transformers.Trainer),
            {
                "__doc__": "``transformers.Trainer`` optimizing a lossparity mode exactly (see LossParityMixin).",
                "__module__": __name__,
            },
        )
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
