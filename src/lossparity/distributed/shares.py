"""The per-microbatch calls of the accountant: a microbatch's exact share of the objective ``J``
(``lm_loss``, ``mtp_loss``), or, for a fused output head, its per-token weights before the forward and the
accounting of the share after it (``token_weights``/``mtp_token_weights``, ``add_lm_share``/``add_mtp_share``).

Nothing here synchronizes with the host: the denominators and unit counts were read at ``begin_step``
(:mod:`~lossparity.distributed.precount`), value checks are device flags. The weights come from the one
formula of :mod:`lossparity.losses.token_weights`, fed with the step's counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..losses.stats import check_inputs
from ..losses.token_weights import mtp_token_weights, token_weights
from .objective import Objective
from .precount import as_2d
from .protocol import ProtocolError, StepState
from .step_protocol import StepProtocol

__all__ = ["MicrobatchShares"]


def _check_mask_arg(name: str, mask: object, loss: Tensor) -> Tensor:
    """Type and device of a mask given with a loss (no value scan: those are device flags)."""
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(mask).__name__} (convert lists and NumPy "
            "arrays with torch.as_tensor)"
        )
    if mask.device != loss.device:
        raise ValueError(f"{name} is on {mask.device} but the losses are on {loss.device}: move it to {loss.device}")
    return mask


def _lm_inputs(
    per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor | None, where: str
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Types and shapes of ``lm_loss``'s arguments (values are device flags), as ``[b, S]``."""
    if not isinstance(per_token_loss, Tensor):
        raise TypeError(f"per_token_loss must be a torch.Tensor, got {type(per_token_loss).__name__}")
    _check_mask_arg("mask", mask, per_token_loss)
    loss, w = as_2d(per_token_loss), as_2d(mask)
    seg = None if segment_ids is None else as_2d(segment_ids)
    same_device = seg if seg is None or seg.device == loss.device else None
    check_inputs(
        loss, w, same_device, where=where, check_finite=False, check_mask_values=False, check_segment_values=False
    )
    return loss, w, seg


def _mtp_inputs(
    losses: Sequence[Tensor], masks: Sequence[Tensor], segment_ids: Tensor | None, depths: int, where: str
) -> tuple[list[Tensor], list[Tensor], Tensor | None]:
    """Types and shapes of ``mtp_loss``'s arguments, as ``[b, S]``."""
    if depths == 0:
        raise ValueError("mtp_loss called but the accountant was built with mtp_depths=0")
    if len(losses) != depths or len(masks) != depths:
        raise ValueError(
            f"mtp_loss needs {depths} losses and masks (one per depth), got {len(losses)} and {len(masks)} ({where})"
        )
    for k, (x, w) in enumerate(zip(losses, masks), start=1):
        if not isinstance(x, Tensor):
            raise TypeError(f"losses[{k - 1}] must be a torch.Tensor, got {type(x).__name__} ({where})")
        _check_mask_arg(f"masks[{k - 1}]", w, x)
    ls, ws = [as_2d(x) for x in losses], [as_2d(x) for x in masks]
    seg = None if segment_ids is None else as_2d(segment_ids)
    for k, (x, w) in enumerate(zip(ls, ws), start=1):
        check_inputs(
            x,
            w,
            seg,
            where=f"{where}, MTP depth {k}",
            check_finite=False,
            check_mask_values=False,
            check_segment_values=False,
        )
    return ls, ws, seg


class MicrobatchShares(StepProtocol):
    """The microbatch calls of :class:`~lossparity.distributed.accountant.Accountant` (its base class): the
    step's state machine is :class:`StepProtocol`; ``objective`` is set by the accountant."""

    objective: Objective

    def _check_columns(self, columns: Tensor | None) -> None:
        if self.groups.cp_size > 1 and columns is None:
            raise ValueError(
                f"context parallelism (cp={self.groups.cp_size}) needs columns= (the positions of the whole rows "
                f"this shard holds) in lm_loss/mtp_loss ({self.where})"
            )

    # ------------------------------------------------------------------ microbatches: the objective shares

    def lm_loss(
        self, per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor | None = None, *, columns: Tensor | None = None
    ) -> Tensor:
        """This microbatch's share of the language-model objective; call once per microbatch, in order.

        ``precount``: returns ``numerator(mb) / denominator`` so that the shares of all microbatches and
        ranks sum to ``J`` (semantics §1, §3). ``deferred``: returns the raw ``numerator(mb)``; ``finish_step``
        divides the gradients. ``per_token_loss`` and ``mask`` are ``[b, S]``; with context parallelism they
        are this rank's shard and ``columns`` (``[S_shard]``) are its positions in the whole rows. The mask
        (and segment ids) must be those given to ``begin_step``, the loss finite where the mask is 1:
        both are checked on the device and reported by ``logs()``.
        """
        step = self._step
        if step.state is not StepState.MICROBATCHES:
            raise ProtocolError(f"lm_loss called outside the microbatches of a step: expected {self.expected_call()}")
        if step.mb >= step.n_mbs:
            raise ProtocolError(
                f"lm_loss called for microbatch {step.mb} but begin_step received only {step.n_mbs} masks "
                f"(rank {self.groups.token_rank()}): expected {self.expected_call()}"
            )
        inputs = _lm_inputs(per_token_loss, mask, segment_ids, self.where)
        self._check_columns(columns)
        share = self.objective.lm_share(
            step.counts(), step.buffer(), step.mb, inputs, columns, first_shard=self.groups.cp_rank == 0
        )
        step.mb += 1
        step.mtp_seen.append(False)
        return share

    def mtp_loss(
        self,
        losses: Sequence[Tensor],
        masks: Sequence[Tensor],
        segment_ids: Tensor | None = None,
        *,
        columns: Tensor | None = None,
    ) -> Tensor:
        """This microbatch's share of the MTP objective term ``λ·(1/Dm)·Σ_k J_k`` (or the pooled form).

        ``losses[k-1]``/``masks[k-1]`` are depth ``k``'s per-token losses and rolled masks (see
        :func:`lossparity.losses.mtp.roll_mtp`). Call once per microbatch, after ``lm_loss`` of the same
        microbatch (with ``mtp_depths > 0`` it is required: ``finish_step`` raises :class:`ProtocolError`
        naming a microbatch without it). With context parallelism, ``losses``/``masks`` are this shard's
        columns (``columns``) of the depth masks rolled on whole rows (rolling crosses shard boundaries
        exactly).
        """
        step = self._step
        if step.state is not StepState.MICROBATCHES or step.mb == 0 or step.mtp_seen[-1]:
            what = "twice for one microbatch" if step.mb and step.mtp_seen[-1] else "before lm_loss"
            if step.state is not StepState.MICROBATCHES:
                what = "outside the microbatches of a step"
            raise ProtocolError(f"mtp_loss called {what} ({self.where}): expected {self.expected_call()}")
        mb = step.mb - 1
        where = f"rank {self.groups.token_rank()}, microbatch {mb}"
        inputs = _mtp_inputs(losses, masks, segment_ids, self.mtp_depths, where)
        self._check_columns(columns)
        share = self.objective.mtp_share(step.counts(), step.buffer(), mb, inputs, columns, self.mtp_weight)
        step.mtp_seen[-1] = True
        return share

    # ------------------------------------------------------------------ fused head (weights known up front)
    def token_weights(
        self, mask: Tensor, segment_ids: Tensor | None = None, *, columns: Tensor | None = None
    ) -> Tensor:
        """Per-token weights ``w`` of the next microbatch's main loss (the one the next ``lm_loss`` or
        ``add_lm_share`` accounts): ``Σ w·l`` equals the value ``lm_loss(l, mask, ...)`` returns for any
        ``l`` (``precount``: the share ``numerator / denominator``; ``deferred``: the raw numerator).
        Float64, shape of ``mask``; see :mod:`lossparity.losses.token_weights`."""
        self._require_step("token_weights")
        self._check_columns(columns)
        pre, ob = self._step.counts(), self.objective
        counts = pre.unit_counts(self._step.mb, 0, columns, whole=True)  # the counts in, the weights out
        return token_weights(
            ob.mode,
            mask,
            segment_ids=segment_ids,
            fixed_length=ob.fixed_length,
            unit_counts=counts,
            denominator=ob.denominator(pre),
        )

    def mtp_token_weights(
        self, masks: Sequence[Tensor], segment_ids: Tensor | None = None, *, columns: Tensor | None = None
    ) -> list[Tensor]:
        """Per-depth weights of the next microbatch's MTP term (call before its ``add_lm_share``):
        ``Σ_k Σ w_k·l_k`` equals the value ``mtp_loss(losses, masks, ...)`` returns (λ, ``1/Dm`` and the
        convention's denominators included)."""
        self._require_step("mtp_token_weights")
        if self.mtp_depths == 0 or len(masks) != self.mtp_depths:
            raise ValueError(
                f"mtp_token_weights needs {self.mtp_depths} masks (one per MTP depth), got {len(masks)} ({self.where})"
            )
        self._check_columns(columns)
        pre, mb, ob = self._step.counts(), self._step.mb, self.objective
        pooled = ob.mtp_convention == "pooled"  # pooled: one denominator, counts pooled over the depths
        counts = None if pooled else [pre.unit_counts(mb, k, columns, whole=True) for k in range(1, len(masks) + 1)]
        return mtp_token_weights(
            ob.mode,
            list(masks),
            convention=ob.mtp_convention,
            segment_ids=segment_ids,
            fixed_length=ob.fixed_length,
            unit_counts=counts,
            denominators=ob.mtp_denominators(pre),
            scale=self.mtp_weight / (1 if pooled else self.mtp_depths),
        )

    def add_lm_share(
        self,
        share: Tensor,
        per_token_loss: Tensor,
        mask: Tensor,
        segment_ids: Tensor | None = None,
        *,
        columns: Tensor | None = None,
    ) -> Tensor:
        """Account a main-loss share computed outside (``Σ token_weights·l``, e.g. by the fused head) and
        return it for backward: the detached per-token losses feed the logs exactly as ``lm_loss`` would."""
        self.lm_loss(per_token_loss.detach(), mask, segment_ids, columns=columns)
        return share

    def add_mtp_share(
        self,
        share: Tensor,
        losses: Sequence[Tensor],
        masks: Sequence[Tensor],
        segment_ids: Tensor | None = None,
        *,
        columns: Tensor | None = None,
    ) -> Tensor:
        """As :meth:`add_lm_share` for the MTP term (``Σ_k Σ mtp_token_weights_k·l_k``); after ``add_lm_share``."""
        self.mtp_loss([x.detach() for x in losses], masks, segment_ids, columns=columns)
        return share
