"""The accountant's objective concern (docs/semantics.md §1, §3, §4): one microbatch's share of ``J``.

:class:`Objective` holds the settings of the objective (mode, normalization, MTP convention) and turns a
microbatch's per-token losses into its share of the step's objective from the step's pre-count
(:class:`~lossparity.distributed.precount.PreCount`), adding the log states and the device-side value
checks to the step's buffer (:class:`~lossparity.distributed.log_metrics.StepLogs`). It never reads the
device: the denominators are host numbers of the pre-count. The protocol (which call may come when) is
the :class:`~lossparity.distributed.accountant.Accountant`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from ..losses.logchannel import ratio_or_none
from ..losses.modes import DENOMINATOR_KEY, numerator
from ..losses.mtp import mtp_denominators, mtp_log_value, mtp_numerator, mtp_scale
from ..losses.stats import sample_stats
from .log_metrics import MB_CODE, StepLogs
from .precount import PreCount

__all__ = ["Objective"]


@dataclass(frozen=True)
class Objective:
    """Settings of the objective (validated by the accountant) and the per-microbatch shares of ``J``."""

    mode: str
    normalization: str
    fixed_length: int | None
    mtp_depths: int
    mtp_convention: str
    mtp_log_estimator: str
    check_finite: bool

    # ------------------------------------------------------------------ denominators (host numbers)
    def denominator(self, pre: PreCount) -> float:
        """The main loss's global denominator (``precount``), or 1 (``deferred``: ``finish_step`` divides)."""
        return 1.0 if self.normalization == "deferred" else pre.denominator(DENOMINATOR_KEY[self.mode])

    def mtp_denominators(self, pre: PreCount) -> list[float]:
        """Denominators of the MTP term's numerators (semantics §4, :func:`mtp_denominators`); 1 when deferred."""
        if self.normalization == "deferred":
            return [1.0] * (1 if self.mtp_convention == "pooled" else self.mtp_depths)
        main = pre.denominator(DENOMINATOR_KEY[self.mode])
        return mtp_denominators(self.mode, self.mtp_convention, main, pre.host["mtp_tokens"])

    def _flag_nonfinite(self, logs: StepLogs, check: str, sample_sums: Tensor, code: float) -> None:
        """NaN/Inf where the mask is 1 shows in the per-sample masked sums ``s_i`` (computed anyway for the
        logs): ``s - s`` is NaN exactly there. Two kernels on ``[b]``."""
        if self.check_finite:
            logs.checks.flag(check, (sample_sums - sample_sums) != 0, code)

    # ------------------------------------------------------------------ shares
    def lm_share(
        self,
        pre: PreCount,
        logs: StepLogs,
        mb: int,
        inputs: tuple[Tensor, Tensor, Tensor | None],
        columns: Tensor | None,
        first_shard: bool,
    ) -> Tensor:
        """Microbatch ``mb``'s main-loss share ``numerator / denominator`` (``deferred``: the numerator);
        adds its log states and value checks to ``logs``. ``first_shard``: this rank counts the units of
        the rows (the first context-parallel shard)."""
        loss, w, seg = inputs
        code = float(mb * MB_CODE)
        expected, full_seg = pre.expected(mb, columns), pre.expected(mb, columns, segments=True)
        assert expected is not None  # begin_step's masks are tensors
        logs.checks.flag("lm_mask", w != expected.to(w.device, w.dtype), code)
        if seg is not None and full_seg is not None:
            logs.checks.flag("lm_segments", seg != full_seg.to(seg.device, seg.dtype), code)
        counts = pre.microbatches[mb]
        num = numerator(
            self.mode,
            loss,
            w,
            segment_ids=seg if full_seg is None else full_seg,
            fixed_length=self.fixed_length,
            unit_counts=pre.unit_counts(mb, 0, columns),
            documents=counts.documents if columns is None else None,
        )
        s, n = sample_stats(loss.detach(), w)
        self._flag_nonfinite(logs, "lm_nonfinite", s, code)
        logs.add("S", s.sum())
        logs.add("Ntok", n.sum())
        if first_shard:  # units are counted once, by the first shard of the rows
            logs.add("samples", w.shape[0])
            logs.add("documents", counts.docs)
            logs.add("microbatches", 1)
        logs.add("lm_num", num)
        return num if self.normalization == "deferred" else num / self.denominator(pre)

    def mtp_share(
        self,
        pre: PreCount,
        logs: StepLogs,
        mb: int,
        inputs: tuple[list[Tensor], list[Tensor], Tensor | None],
        columns: Tensor | None,
        weight: float,
    ) -> Tensor:
        """Microbatch ``mb``'s MTP share ``λ·(1/Dm)·Σ_k numerator_k / den_k`` (or the pooled form), with its
        log states and value checks (masks 0/1 holding the pre-counted depth tokens, finite losses)."""
        losses, masks, seg = inputs
        code = float(mb * MB_CODE)
        for k, w in enumerate(masks, start=1):
            bad = (w != 0) & (w != 1)
            if columns is None:
                bad = bad | (w.sum() != pre.microbatches[mb].depth_tokens[k - 1])
            logs.checks.flag("mtp_mask", bad, code + k)
        nums = self._mtp_numerators(pre, mb, losses, masks, seg, columns)
        self._log_mtp(logs, losses, masks, nums, code)
        scale = mtp_scale(weight, self.mtp_convention, self.mtp_depths)
        if self.normalization == "deferred":
            return scale * torch.stack(nums).sum()
        # nums holds one tensor per depth (mtp_depths >= 1 here), so the sum is a tensor
        return cast(Tensor, scale * sum(num / den for num, den in zip(nums, self.mtp_denominators(pre))))

    def _mtp_numerators(
        self,
        pre: PreCount,
        mb: int,
        losses: list[Tensor],
        masks: list[Tensor],
        seg: Tensor | None,
        columns: Tensor | None,
    ) -> list[Tensor]:
        if columns is not None and self.mtp_convention == "pooled" and self.mode != "per_token":
            raise ValueError(
                "mtp_convention='pooled' with a per-unit mode is not supported under context "
                "parallelism (its units pool several depths)"
            )
        # per_group: the groups' token counts span microbatches, so the pre-counted maps always come in
        if (columns is not None or self.mode == "per_group") and self.mtp_convention != "pooled":
            return [
                numerator(
                    self.mode,
                    x,
                    w,
                    segment_ids=seg,
                    fixed_length=self.fixed_length,
                    unit_counts=pre.unit_counts(mb, k, columns),
                )
                for k, (x, w) in enumerate(zip(losses, masks), start=1)
            ]
        docs = pre.microbatches[mb].documents if columns is None else None
        return mtp_numerator(
            self.mode,
            losses,
            masks,
            convention=self.mtp_convention,
            segment_ids=seg,
            fixed_length=self.fixed_length,
            documents=docs,
        )

    def _log_mtp(
        self, logs: StepLogs, losses: list[Tensor], masks: list[Tensor], nums: list[Tensor], code: float
    ) -> None:
        for k, (x, w) in enumerate(zip(losses, masks), start=1):
            s, n = sample_stats(x.detach(), w)
            self._flag_nonfinite(logs, "mtp_nonfinite", s, code + k)
            s_sum, n_sum = s.sum().to(torch.float64), n.sum().to(torch.float64)
            logs.add(f"mtp_{k}", s_sum, 0)  # S_k, Ntok_k, Σ local means, numerator
            logs.add(f"mtp_{k}", n_sum, 1)
            logs.add(f"mtp_{k}", s_sum / n_sum.clamp(min=1), 2)
            if self.mtp_convention != "pooled":
                logs.add(f"mtp_{k}", nums[k - 1], 3)
        if self.mtp_convention == "pooled":
            logs.add("mtp_pooled_num", nums[0])

    # ------------------------------------------------------------------ logged values
    def log_values(
        self, get: dict[str, list[float]], metrics: dict[str, float | None], weight: float, groups: float = 0.0
    ) -> dict[str, float | None]:
        """The step's logged values from the reduced states ``get`` (semantics §2, §4): ``lm_loss``, the unit
        counts, the MTP depths' values, the declared ``metrics`` and ``objective`` (language model, MTP and
        recorded shares). ``groups``: ``Ngrp`` of ``per_group`` (pre-counted: a group spans microbatches)."""
        S, ntok, nsamp, ndoc, nmb, lm_num = (
            get[n][0] for n in ("S", "Ntok", "samples", "documents", "microbatches", "lm_num")
        )
        out: dict[str, float | None] = {
            "lm_loss": ratio_or_none(S, ntok),
            "tokens": ntok,
            "samples": nsamp,
            "microbatches": nmb,
        }
        if ndoc:
            out["documents"] = ndoc
        if self.mode == "per_group":
            out["groups"] = groups
        counts = {"tokens": ntok, "samples": nsamp, "microbatches": nmb, "documents": ndoc, "one": 1.0}
        counts["groups"] = groups
        main_den = max(counts[DENOMINATOR_KEY[self.mode]], 1.0)
        lm_term = objective = lm_num / main_den
        if self.mtp_depths:
            objective += self._mtp_logs(get, out, main_den, nmb, weight)
        out.update(metrics)
        added = get["objective"][0] + get["objective_local"][0]
        out["objective"] = objective + added
        if self.mtp_depths or added or self.mode != "per_token":
            # J's parts, so that a reader sees what the objective is made of (semantics §2)
            out["objective_lm"] = lm_term
            out["objective_aux"] = added
        return out

    def _mtp_logs(
        self, get: dict[str, list[float]], out: dict[str, float | None], main_den: float, nmb: float, weight: float
    ) -> float:
        """Per-depth MTP logs into ``out``; returns ``λ·term`` of the objective (semantics §4)."""
        depth = [get[f"mtp_{k}"] for k in range(1, self.mtp_depths + 1)]
        for k, (s_k, n_k, means_k, _) in enumerate(depth, start=1):
            out[f"mtp_{k}_loss"] = mtp_log_value(self.mtp_log_estimator, s_k, n_k, means_k, nmb)
            out[f"mtp_{k}_tokens"] = n_k
        dens = mtp_denominators(self.mode, self.mtp_convention, main_den, [d[1] for d in depth])
        if self.mtp_convention == "pooled":
            term = get["mtp_pooled_num"][0] / dens[0]
        else:
            term = 0.0
            for d, den in zip(depth, dens):
                term += d[3] / den
            term /= self.mtp_depths
        out["mtp_weight"] = weight
        out["objective_mtp"] = term  # J's MTP part before λ
        return weight * term
