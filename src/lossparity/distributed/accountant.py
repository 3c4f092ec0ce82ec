"""The accountant: exact, layout-invariant loss accounting inside a training loop (semantics §2, §3).

One optimizer step::

    acc.begin_step(masks)                 # pre-count normalizers: one all-reduce
    for mb in microbatches:
        loss = acc.lm_loss(per_token_loss, mask)  # this microbatch's exact share of J
        (loss + acc.mtp_loss(...)).backward()
    acc.finish_step(model)                # engine-dependent gradient scaling
    optimizer.step()
    logs = acc.logs()                     # every logged scalar of the step, one all-reduce

Two mechanisms make the objective layout-invariant (semantics §3). ``normalization="precount"`` (default):
the global denominators are counted from the masks before the first forward, and each microbatch
back-propagates ``numerator / denominator``. ``normalization="deferred"`` (Megatron
``calculate_per_token_loss=True``): raw numerators are back-propagated, the denominator is summed
as microbatches pass, and ``finish_step`` divides every gradient by it. In both, gradients must be
*summed* over data-parallel ranks: ``finish_step`` multiplies by ``D`` when the engine averages (DDP,
FSDP), or all-reduces them itself for a plain module.

The log channel is independent of the mode: per step ``lm_loss = S / Ntok``, ``objective = J``,
``tokens``, ``samples``, MTP per-depth losses and any declared auxiliary metric, all reduced in one
collective (torchmetrics style: state, update, one synchronised reduction, compute).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..losses.logchannel import ratio_or_none
from ..losses.modes import DENOMINATOR_KEY as _DEN_KEY
from ..losses.modes import MODES, check_mode, numerator, unit_count_map
from ..losses.mtp import check_convention, mtp_numerator, roll_mask
from ..losses.stats import check_inputs, count_documents, sample_stats
from ..losses.token_weights import mtp_token_weights, token_weights
from .groups import ParallelGroups, resolve_groups

__all__ = ["Accountant", "NORMALIZATIONS", "GRAD_REDUCTIONS"]

NORMALIZATIONS = ("precount", "deferred")
GRAD_REDUCTIONS = ("auto", "sum", "mean", "allreduce")

# Layout of the per-step count vector reduced in begin_step / finish_step.
_C_TOKENS, _C_SAMPLES, _C_DOCS, _C_MBS = range(4)
_COUNT_KEYS = {"tokens": _C_TOKENS, "samples": _C_SAMPLES, "documents": _C_DOCS, "microbatches": _C_MBS}


def _is_averaging_engine(model: object) -> bool:
    """DDP and FSDP (1 and 2) divide gradients by the data-parallel size."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule  # FSDP2, torch >= 2.6

        if isinstance(model, FSDPModule):
            return True
    except ImportError:  # pragma: no cover - older torch
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return isinstance(model, FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        return False


def _unique_grads(model: nn.Module | Iterable[Tensor] | None, fill_missing: bool = False) -> list[Tensor]:
    """Gradients of the distinct parameters; with ``fill_missing``, parameters that require grad but got
    none (e.g. an expert that received no token on this rank) get zeros, so that every rank reduces a
    buffer of the same layout."""
    if model is None:
        return []
    params = model.parameters() if isinstance(model, nn.Module) else model
    seen: set[int] = set()
    grads = []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad is None:
            if not (fill_missing and p.requires_grad):
                continue
            p.grad = torch.zeros_like(p)
        g = p.grad
        # DTensor gradients (tensor parallel, FSDP2): scale/reduce the local shard in place.
        grads.append(g.to_local() if hasattr(g, "to_local") else g)
    return grads


class Accountant:
    """Exact loss accounting for one training loop (see the module docstring for the protocol).

    Args:
        mode: normalization mode of the language-model objective (semantics §1), one of :data:`MODES`.
        group: data-parallel process group (``None``: the default group if initialized, else single
            process). Mutually exclusive with ``mesh``.
        mesh: ``DeviceMesh`` with named dimensions among ``dp, cp, tp, pp``.
        normalization: ``"precount"`` (default) or ``"deferred"`` (semantics §3).
        grad_reduction: how gradients are reduced over data-parallel ranks: ``"auto"`` (detect DDP/FSDP
            from the module given to ``finish_step``, else all-reduce plain modules), ``"mean"`` (the
            engine averages: multiply by ``D``), ``"sum"`` (already summed, or one process),
            ``"allreduce"`` (``finish_step`` sums the gradients itself).
        fixed_length: the ``L`` of ``sample_sum_norm``.
        mtp_depths: number of MTP depths ``Dm`` (0: no MTP); their masks are pre-counted by rolling.
        mtp_convention: ``own`` | ``main`` | ``pooled`` (semantics §4).
        mtp_log_estimator: ``"token_mean"`` (``S_k/Ntok_k``, default) or ``"microbatch_mean"``
            (Megatron: mean over microbatches and ranks of local means).
        check_finite: raise on NaN/Inf losses, naming rank and microbatch (costs one sync per call).
    """

    def __init__(
        self,
        mode: str = "per_token",
        group: object | None = None,
        *,
        mesh: object | None = None,
        sequence_parallel: bool = False,
        normalization: str = "precount",
        grad_reduction: str = "auto",
        fixed_length: int | None = None,
        mtp_depths: int = 0,
        mtp_convention: str = "own",
        mtp_log_estimator: str = "token_mean",
        check_finite: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        self.mode = check_mode(mode)
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {normalization!r}; valid: {', '.join(NORMALIZATIONS)}")
        if grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"unknown grad_reduction {grad_reduction!r}; valid: {', '.join(GRAD_REDUCTIONS)}")
        if mode == "sample_sum_norm" and (fixed_length is None or fixed_length <= 0):
            raise ValueError(f"mode 'sample_sum_norm' needs fixed_length > 0, got fixed_length={fixed_length}")
        if mtp_depths < 0:
            raise ValueError(f"mtp_depths must be >= 0, got {mtp_depths}")
        check_convention(mtp_convention)
        if mtp_log_estimator not in ("token_mean", "microbatch_mean"):
            raise ValueError(
                f"unknown mtp_log_estimator {mtp_log_estimator!r}; valid: token_mean, microbatch_mean"
            )
        if normalization == "deferred" and mtp_depths and mode == "per_token" and mtp_convention != "main":
            # One division of all gradients by one count cannot give each depth its own count.
            raise ValueError(
                "normalization='deferred' with mode 'per_token' divides every gradient by the main token "
                f"count, so it needs mtp_convention='main' (got {mtp_convention!r})"
            )
        self.normalization = normalization
        self.grad_reduction = grad_reduction
        self.fixed_length = fixed_length
        self.mtp_depths = mtp_depths
        self.mtp_convention = mtp_convention
        self.mtp_log_estimator = mtp_log_estimator
        self.check_finite = check_finite
        self.groups: ParallelGroups = resolve_groups(group, mesh, sequence_parallel=sequence_parallel)
        self.device = torch.device(device) if device is not None else self._default_device()
        self.mtp_weight = 1.0
        self._metrics: list[str] = []  # declared auxiliary metrics (name -> (num, den) slots)
        self._metric_reduce: dict[str, str] = {}
        self._per_rank: set[str] = set()
        self._extra_names: list[str] = []
        self.step_index = 0  # number of begin_step calls: lets companions cache per-step reads
        self._in_step = False
        self._counts: Tensor | None = None
        self._local_mb_tokens: list[int] = []
        self._mb = 0
        self._acc: Tensor | None = None
        self._objective_direct: Tensor | None = None
        self._finished = False

    # ------------------------------------------------------------------ setup
    def _default_device(self) -> torch.device:
        g = self.groups.log_group
        if g is not None and dist.get_backend(g) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def declare_metric(self, name: str, reduce: str = "ratio", *, per_rank: bool = False) -> None:
        """Declare an auxiliary log metric: ``reduce="ratio"`` reports ``Σ num / Σ den`` (``None`` when
        ``Σ den = 0``), ``reduce="sum"`` reports ``Σ num``, sums over all ranks and microbatches.
        ``per_rank=True``: every tensor-parallel rank records distinct tokens (sequence parallelism), so
        its values are summed over TP too; by default TP ranks hold copies and only the first counts.

        Must be called identically on every rank (it fixes the layout of the logging collective); a
        rank that has nothing to record still takes part with zeros (semantics §6).
        """
        if self._in_step:
            raise RuntimeError(f"declare_metric({name!r}) must be called outside a step")
        if reduce not in ("ratio", "sum"):
            raise ValueError(f"declare_metric: reduce must be 'ratio' or 'sum', got {reduce!r}")
        if name not in self._metrics:
            self._metrics.append(name)
            self._metric_reduce[name] = reduce
        if per_rank:
            self._per_rank.add(name)

    @property
    def finished(self) -> bool:
        """True between ``finish_step`` and ``logs`` (gradients of the step are final)."""
        return self._finished

    @property
    def where(self) -> str:
        return f"rank {self.groups.token_rank()}, microbatch {self._mb}"

    # ------------------------------------------------------------------ step
    def _slots(self) -> int:
        # S, Ntok, N, Ndoc, mbs, lm numerator | per depth: S_k, Ntok_k, local means, numerator | pooled num
        return 6 + 4 * self.mtp_depths + 1 + 2 * len(self._metrics)

    def begin_step(
        self,
        masks: Sequence[Tensor],
        segment_ids: Sequence[Tensor | None] | None = None,
        *,
        mtp_weight: float | None = None,
        extra_counts: Mapping[str, float] | None = None,
    ) -> None:
        """Start a step: pre-count the normalizers of every microbatch of this rank and sum them over
        the token group in one all-reduce (``precount``), or only remember the local counts (``deferred``).

        ``masks`` are this rank's microbatch loss masks ``[b, S]`` of whole rows (with context parallelism:
        the rows before sharding, identical on the CP peers) in the order ``lm_loss`` will see them;
        ``segment_ids`` (packed rows) likewise, needed by ``per_document`` and by MTP rolling within
        documents. ``mtp_weight`` is the MTP ``λ`` of this step. ``extra_counts`` are further local
        counts (e.g. the router's non-padding tokens) summed in the same all-reduce; read them back
        with :meth:`global_count`. Their names must be the same on every rank.
        """
        if self._in_step and not self._finished:
            raise RuntimeError("begin_step called twice without finish_step")
        masks = list(masks)
        if not masks:
            raise ValueError("begin_step needs the masks of at least one microbatch (masks is empty)")
        segs = list(segment_ids) if segment_ids is not None else [None] * len(masks)
        if len(segs) != len(masks):
            raise ValueError(f"segment_ids has {len(segs)} entries but masks has {len(masks)}")
        if self.mode == "per_document" and any(s is None for s in segs):
            raise ValueError("mode 'per_document' needs segment_ids for every microbatch in begin_step")
        if mtp_weight is not None:
            if mtp_weight < 0:
                raise ValueError(f"mtp_weight must be >= 0, got {mtp_weight}")
            self.mtp_weight = float(mtp_weight)
        # The last slot flags bad input: every rank still enters the all-reduce, so a rank with bad
        # masks raises its own error and the others raise too instead of hanging (semantics §7).
        extra = dict(extra_counts or {})
        self._extra_names = list(extra)
        counts = torch.zeros(5 + self.mtp_depths + len(extra), dtype=torch.float64, device=self.device)
        for j, value in enumerate(extra.values()):
            counts[4 + self.mtp_depths + j] = float(value)
        self._local_mb_tokens = []
        self._mb_docs: list[int] = []
        error: Exception | None = None
        try:
            for i, (w, seg) in enumerate(zip(masks, segs)):
                w2 = w if w.dim() == 2 else w.unsqueeze(0)
                seg2 = seg if seg is None or seg.dim() == 2 else seg.unsqueeze(0)
                check_inputs(w2.to(torch.float32), w2, seg2,
                             where=f"rank {self.groups.token_rank()}, microbatch {i}", check_finite=False)
                ntok = w2.sum()
                self._local_mb_tokens.append(int(ntok.item()))
                self._mb_docs.append(count_documents(seg2) if seg2 is not None else 0)
                counts[_C_TOKENS] += ntok.to(torch.float64)
                counts[_C_SAMPLES] += w2.shape[0]
                counts[_C_MBS] += 1
                counts[_C_DOCS] += self._mb_docs[-1]
                for k in range(1, self.mtp_depths + 1):
                    counts[3 + k] += roll_mask(w2, seg2, k).sum().to(torch.float64)
        except (ValueError, TypeError) as e:
            error = e
            counts[-1] = 1.0
        if self.normalization == "precount":  # deferred has no collective here: errors stay local
            # Whole rows: context-parallel peers count the same rows, so the sum runs over DP only.
            self._all_reduce(counts, self.groups.dp_group)
        if error is not None:
            raise error
        if counts[-1] > 0:
            raise RuntimeError(
                f"{int(counts[-1].item())} other rank(s) reported invalid input in begin_step (see their error); "
                f"rank {self.groups.token_rank()} stops too"
            )
        self._counts = counts
        self.step_index += 1
        self._masks, self._segs = masks, segs
        self._unit_maps: dict[tuple[int, int], Tensor | None] = {}
        self._n_mbs = len(masks)
        self._mb = 0
        self._acc = torch.zeros(self._slots(), dtype=torch.float64, device=self.device)
        # [replicated over TP, distinct per TP rank] objective contributions added directly
        self._objective_direct = torch.zeros(2, dtype=torch.float64, device=self.device)
        self._in_step = True
        self._finished = False
        self._grad_factor: float | None = None

    def global_count(self, name: str) -> float:
        """A count of this step: ``tokens``, ``samples``, ``documents``, ``microbatches``, ``mtp_<k>_tokens``
        or an ``extra_counts`` name, summed over the token group (``precount``; local in ``deferred``
        until ``finish_step``)."""
        self._require_step("global_count")
        assert self._counts is not None
        if name in _COUNT_KEYS:
            return float(self._counts[_COUNT_KEYS[name]].item())
        if name.startswith("mtp_") and name.endswith("_tokens"):
            k = int(name[4:-7])
            if 1 <= k <= self.mtp_depths:
                return float(self._counts[3 + k].item())
        if name in self._extra_names:
            return float(self._counts[4 + self.mtp_depths + self._extra_names.index(name)].item())
        raise KeyError(f"unknown count {name!r}; extra counts of this step: {self._extra_names}")

    @property
    def num_microbatches(self) -> int:
        """``D·K`` of this step (pre-counted)."""
        return int(self.global_count("microbatches"))

    def _all_reduce(self, t: Tensor, group: object | None) -> None:
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

    def _denominator(self, key: str) -> float:
        assert self._counts is not None
        return float(max(self._counts[_COUNT_KEYS[key]].item(), 1.0))

    def _unit_counts(self, mb: int, depth: int, columns: Tensor | None) -> Tensor | None:
        """Whole-row unit counts of microbatch ``mb`` (depth 0 = main loss) restricted to ``columns``;
        ``None`` without context parallelism (local counts are then the whole-row counts)."""
        if columns is None:
            return None
        key = (mb, depth)
        if key not in self._unit_maps:
            w, seg = self._masks[mb], self._segs[mb]
            w = w if w.dim() == 2 else w.unsqueeze(0)
            if depth:
                w = roll_mask(w, seg, depth)
            self._unit_maps[key] = unit_count_map(self.mode, w, seg)
        full = self._unit_maps[key]
        return None if full is None else full[:, columns]

    def _check_columns(self, columns: Tensor | None) -> None:
        if self.groups.cp_size > 1 and columns is None:
            raise ValueError(
                f"context parallelism (cp={self.groups.cp_size}) needs columns= (the positions of the whole rows "
                f"this shard holds) in lm_loss/mtp_loss ({self.where})"
            )

    def lm_loss(self, per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor | None = None, *,
                columns: Tensor | None = None) -> Tensor:
        """This microbatch's share of the language-model objective; call once per microbatch, in order.

        ``precount``: returns ``numerator(mb) / denominator`` so that the shares of all microbatches and
        ranks sum to ``J`` (semantics §1, §3). ``deferred``: returns the raw ``numerator(mb)``; ``finish_step``
        divides the gradients. ``per_token_loss`` and ``mask`` are ``[b, S]``; with context parallelism they
        are this rank's shard and ``columns`` (``[S_shard]``) are its positions in the whole rows.
        """
        self._require_step("lm_loss")
        if self._mb >= self._n_mbs:
            raise RuntimeError(
                f"lm_loss called for microbatch {self._mb} but begin_step received only {self._n_mbs} masks "
                f"(rank {self.groups.token_rank()})"
            )
        loss = per_token_loss if per_token_loss.dim() == 2 else per_token_loss.unsqueeze(0)
        w = mask if mask.dim() == 2 else mask.unsqueeze(0)
        seg = segment_ids if segment_ids is None or segment_ids.dim() == 2 else segment_ids.unsqueeze(0)
        check_inputs(loss, w, seg, where=self.where, check_finite=self.check_finite, check_mask_values=False)
        self._check_columns(columns)
        ntok = int(w.sum().item())
        full = self._masks[self._mb]
        if columns is not None:
            full = (full if full.dim() == 2 else full.unsqueeze(0))[:, columns]
        expected = int(full.sum())
        if ntok != expected:
            raise ValueError(
                f"mask of microbatch {self._mb} has {ntok} tokens but begin_step counted {expected} for it "
                f"(rank {self.groups.token_rank()}): pass the same masks, in the same order"
            )
        num = numerator(self.mode, loss, w, segment_ids=seg, fixed_length=self.fixed_length,
                        unit_counts=self._unit_counts(self._mb, 0, columns))
        s, n = sample_stats(loss.detach(), w)
        acc = self._acc
        assert acc is not None
        acc[0] += s.sum().to(torch.float64)
        acc[1] += n.sum().to(torch.float64)
        if self.groups.cp_rank == 0:  # units are counted once, by the first shard of the rows
            acc[2] += w.shape[0]
            acc[3] += self._mb_docs[self._mb]
            acc[4] += 1
        acc[5] += num.detach().to(torch.float64)
        self._mb += 1
        if self.normalization == "deferred":
            return num
        return num / self._denominator(_DEN_KEY[self.mode])

    def _mtp_denominators(self) -> list[float]:
        """Per-depth denominators (precount) of the MTP term (semantics §4)."""
        assert self._counts is not None
        key = _DEN_KEY[self.mode]
        if self.mode != "per_token" or self.mtp_convention == "main":
            return [self._denominator(key)] * self.mtp_depths
        if self.mtp_convention == "own":
            return [float(max(self._counts[3 + k].item(), 1.0)) for k in range(1, self.mtp_depths + 1)]
        pooled = float(max(self._counts[4 : 4 + self.mtp_depths].sum().item(), 1.0))
        return [pooled]

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
        :func:`lossparity.losses.mtp.roll_mtp`). Call after ``lm_loss`` of the same microbatch.
        With context parallelism, ``losses``/``masks`` are this shard's columns (``columns``) of the depth
        masks rolled on whole rows (rolling crosses shard boundaries exactly).
        """
        self._require_step("mtp_loss")
        if self.mtp_depths == 0:
            raise RuntimeError("mtp_loss called but the accountant was built with mtp_depths=0")
        if len(losses) != self.mtp_depths or len(masks) != self.mtp_depths:
            raise ValueError(
                f"mtp_loss needs {self.mtp_depths} losses and masks (one per depth), got {len(losses)} and "
                f"{len(masks)} ({self.where})"
            )
        mb = self._mb - 1  # lm_loss of this microbatch came first
        where = f"rank {self.groups.token_rank()}, microbatch {mb}"
        losses = [x if x.dim() == 2 else x.unsqueeze(0) for x in losses]
        masks = [x if x.dim() == 2 else x.unsqueeze(0) for x in masks]
        for k, (x, w) in enumerate(zip(losses, masks), start=1):
            check_inputs(x, w, segment_ids, where=f"{where}, MTP depth {k}", check_finite=self.check_finite)
        self._check_columns(columns)
        if columns is not None and self.mtp_convention == "pooled" and self.mode != "per_token":
            raise ValueError("mtp_convention='pooled' with a per-unit mode is not supported under context "
                             "parallelism (its units pool several depths)")
        if columns is not None and self.mtp_convention != "pooled":
            nums = [numerator(self.mode, x, w, segment_ids=segment_ids, fixed_length=self.fixed_length,
                              unit_counts=self._unit_counts(mb, k, columns))
                    for k, (x, w) in enumerate(zip(losses, masks), start=1)]
        else:
            nums = mtp_numerator(self.mode, losses, masks, convention=self.mtp_convention,
                                 segment_ids=segment_ids, fixed_length=self.fixed_length)
        acc = self._acc
        assert acc is not None
        base = 6
        for k, (x, w) in enumerate(zip(losses, masks)):
            s, n = sample_stats(x.detach(), w)
            s_sum, n_sum = s.sum().to(torch.float64), n.sum().to(torch.float64)
            acc[base + 4 * k] += s_sum
            acc[base + 4 * k + 1] += n_sum
            acc[base + 4 * k + 2] += s_sum / n_sum.clamp(min=1)
            if self.mtp_convention != "pooled":
                acc[base + 4 * k + 3] += nums[k].detach().to(torch.float64)
        if self.mtp_convention == "pooled":
            acc[base + 4 * self.mtp_depths] += nums[0].detach().to(torch.float64)
        scale = self.mtp_weight / (1 if self.mtp_convention == "pooled" else self.mtp_depths)
        if self.normalization == "deferred":
            return scale * torch.stack(nums).sum()
        dens = self._mtp_denominators()
        return scale * sum(num / den for num, den in zip(nums, dens))

    # ------------------------------------------------------------------ fused head (weights known up front)
    def token_weights(self, mask: Tensor, segment_ids: Tensor | None = None, *,
                      columns: Tensor | None = None) -> Tensor:
        """Per-token weights ``w`` of the next microbatch's main loss (the one the next ``lm_loss`` or
        ``add_lm_share`` accounts): ``Σ w·l`` equals the value ``lm_loss(l, mask, ...)`` returns for any
        ``l`` (``precount``: the share ``numerator / denominator``; ``deferred``: the raw numerator).
        Float64, shape of ``mask``; see :mod:`lossparity.losses.token_weights`."""
        self._require_step("token_weights")
        self._check_columns(columns)
        den = 1.0 if self.normalization == "deferred" else self._denominator(_DEN_KEY[self.mode])
        return token_weights(self.mode, mask, segment_ids=segment_ids, fixed_length=self.fixed_length,
                             unit_counts=self._unit_counts(self._mb, 0, columns), denominator=den)

    def mtp_token_weights(self, masks: Sequence[Tensor], segment_ids: Tensor | None = None, *,
                          columns: Tensor | None = None) -> list[Tensor]:
        """Per-depth weights of the next microbatch's MTP term (call before its ``add_lm_share``):
        ``Σ_k Σ w_k·l_k`` equals the value ``mtp_loss(losses, masks, ...)`` returns (λ, ``1/Dm`` and the
        convention's denominators included)."""
        self._require_step("mtp_token_weights")
        if self.mtp_depths == 0 or len(masks) != self.mtp_depths:
            raise ValueError(f"mtp_token_weights needs {self.mtp_depths} masks (one per MTP depth), got "
                             f"{len(masks)} ({self.where})")
        self._check_columns(columns)
        pooled = self.mtp_convention == "pooled"
        dens = [1.0] * self.mtp_depths if self.normalization == "deferred" else self._mtp_denominators()
        counts = None if pooled else [self._unit_counts(self._mb, k, columns) for k in range(1, self.mtp_depths + 1)]
        return mtp_token_weights(self.mode, masks, convention=self.mtp_convention, segment_ids=segment_ids,
                                 fixed_length=self.fixed_length, unit_counts=counts, denominators=dens,
                                 scale=self.mtp_weight / (1 if pooled else self.mtp_depths))

    def add_lm_share(self, share: Tensor, per_token_loss: Tensor, mask: Tensor, segment_ids: Tensor | None = None,
                     *, columns: Tensor | None = None) -> Tensor:
        """Account a main-loss share computed outside (``Σ token_weights·l``, e.g. by the fused head) and
        return it for backward: the detached per-token losses feed the logs exactly as ``lm_loss`` would."""
        self.lm_loss(per_token_loss.detach(), mask, segment_ids, columns=columns)
        return share

    def add_mtp_share(self, share: Tensor, losses: Sequence[Tensor], masks: Sequence[Tensor],
                      segment_ids: Tensor | None = None, *, columns: Tensor | None = None) -> Tensor:
        """As :meth:`add_lm_share` for the MTP term (``Σ_k Σ mtp_token_weights_k·l_k``); after ``add_lm_share``."""
        self.mtp_loss([x.detach() for x in losses], masks, segment_ids, columns=columns)
        return share

    def record(self, name: str, num: Tensor | float, den: Tensor | float = 1.0) -> None:
        """Add ``num``/``den`` to the declared log metric ``name`` (reported as ``Σ num / Σ den``)."""
        self._require_step("record")
        try:
            i = self._metrics.index(name)
        except ValueError:
            raise KeyError(f"metric {name!r} was not declared; declared: {self._metrics}") from None
        base = 6 + 4 * self.mtp_depths + 1 + 2 * i
        acc = self._acc
        assert acc is not None
        acc[base] += torch.as_tensor(num, dtype=torch.float64).detach().to(acc.device)
        acc[base + 1] += torch.as_tensor(den, dtype=torch.float64).detach().to(acc.device)

    def add_objective(self, value: Tensor | float, *, per_rank: bool = False) -> None:
        """Add an already-normalized objective contribution (e.g. an auxiliary loss share) to the logged
        ``objective``; summed over ranks and microbatches (``per_rank``: see :meth:`declare_metric`)."""
        self._require_step("add_objective")
        assert self._objective_direct is not None
        slot = 1 if per_rank else 0
        self._objective_direct[slot] += torch.as_tensor(value, dtype=torch.float64).detach().to(self.device)

    def _require_step(self, what: str) -> None:
        if not self._in_step:
            raise RuntimeError(f"{what} called outside a step: call begin_step(masks) first")

    # ------------------------------------------------------------------ gradients
    def finish_step(self, model: nn.Module | Iterable[Tensor] | None = None) -> float:
        """Scale (and, for plain modules, reduce) the gradients so that they are those of ``J``.

        Checks that every pre-counted microbatch was seen. ``deferred``: all-reduces the step's
        denominator over the data-parallel group and divides all gradients by it. Averaging engines
        (DDP, FSDP, over DP × CP) get a factor ``D·C``; ``grad_reduction="allreduce"`` (or ``auto`` with a
        plain module and ``D·C > 1``) sums the gradients over DP × CP. Returns the factor applied.
        """
        self._require_step("finish_step")
        if self._finished:
            raise RuntimeError("finish_step called twice in one step")
        if self._mb != self._n_mbs and self.groups.loss_stage:
            raise RuntimeError(
                f"begin_step received {self._n_mbs} masks but lm_loss was called for {self._mb} microbatches "
                f"(rank {self.groups.token_rank()})"
            )
        reduction = self.grad_reduction
        if reduction == "auto":
            if model is not None and _is_averaging_engine(model):
                reduction = "mean"
            elif model is not None and self.groups.grad_size > 1:
                reduction = "allreduce"
            else:
                reduction = "sum"
        factor = 1.0
        if reduction == "mean":
            factor *= self.groups.grad_size
        if self.normalization == "deferred":
            assert self._counts is not None and self._acc is not None
            self._all_reduce(self._counts, self.groups.dp_group)
            factor /= self._denominator(_DEN_KEY[self.mode])
        needs_reduce = reduction == "allreduce" and self.groups.grad_group is not None
        if not needs_reduce and factor == 1.0:
            self._finished = True
            self._grad_factor = factor
            return factor  # nothing to touch: skip the walk over the parameters
        grads = _unique_grads(model, fill_missing=reduction == "allreduce")
        if needs_reduce and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.groups.grad_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if factor != 1.0:
            torch._foreach_mul_(grads, factor) if grads else None
        self._finished = True
        self._grad_factor = factor
        return factor

    # ------------------------------------------------------------------ logs
    def logs(self) -> dict[str, float | None]:
        """All log-channel scalars of the step, reduced over every rank in one collective (semantics §2).

        ``lm_loss = S/Ntok`` (``None`` when ``Ntok = 0``), ``objective = J`` (language model plus MTP plus
        added auxiliary contributions), ``tokens``, ``samples``, ``microbatches``, ``documents`` (packed),
        ``mtp_<k>_loss`` and every declared metric. Ends the step.
        """
        self._require_step("logs")
        if self._mb != self._n_mbs and self.groups.loss_stage:
            raise RuntimeError(
                f"logs() called after {self._mb} of {self._n_mbs} microbatches (rank {self.groups.token_rank()})"
            )
        acc, direct = self._acc, self._objective_direct
        assert acc is not None and direct is not None
        buf = torch.cat([acc, direct])
        if not self.groups.log_owner:
            # tensor-parallel replicas hold copies of the owner's numbers, except per-rank metrics
            keep = buf.clone()
            buf.zero_()
            base = 6 + 4 * self.mtp_depths + 1
            for i, name in enumerate(self._metrics):
                if name in self._per_rank:
                    buf[base + 2 * i: base + 2 * i + 2] = keep[base + 2 * i: base + 2 * i + 2]
            buf[-1] = keep[-1]
        self._all_reduce(buf, self.groups.log_group)
        v = buf.tolist()
        S, ntok, nsamp, ndoc, nmb, lm_num = v[:6]
        out: dict[str, float | None] = {
            "lm_loss": ratio_or_none(S, ntok),
            "tokens": ntok,
            "samples": nsamp,
            "microbatches": nmb,
        }
        if ndoc:
            out["documents"] = ndoc
        dens = {"tokens": max(ntok, 1.0), "samples": max(nsamp, 1.0), "microbatches": max(nmb, 1.0),
                "documents": max(ndoc, 1.0)}
        objective = lm_num / dens[_DEN_KEY[self.mode]]
        base = 6
        if self.mtp_depths:
            term = 0.0
            pooled_tokens = 0.0
            for k in range(self.mtp_depths):
                s_k, n_k, means_k, num_k = v[base + 4 * k : base + 4 * k + 4]
                pooled_tokens += n_k
                if self.mtp_log_estimator == "token_mean":
                    out[f"mtp_{k + 1}_loss"] = ratio_or_none(s_k, n_k)
                else:
                    out[f"mtp_{k + 1}_loss"] = means_k / max(nmb, 1.0)
                out[f"mtp_{k + 1}_tokens"] = n_k
                if self.mtp_convention == "own" and self.mode == "per_token":
                    term += num_k / max(n_k, 1.0)
                elif self.mtp_convention != "pooled":
                    term += num_k / dens[_DEN_KEY[self.mode]]
            if self.mtp_convention == "pooled":
                pooled_num = v[base + 4 * self.mtp_depths]
                den = max(pooled_tokens, 1.0) if self.mode == "per_token" else dens[_DEN_KEY[self.mode]]
                term = pooled_num / den
            else:
                term /= self.mtp_depths
            out["mtp_weight"] = self.mtp_weight
            objective += self.mtp_weight * term
        base = 6 + 4 * self.mtp_depths + 1
        for i, name in enumerate(self._metrics):
            if self._metric_reduce[name] == "sum":
                out[name] = v[base + 2 * i]
            else:
                out[name] = ratio_or_none(v[base + 2 * i], v[base + 2 * i + 1])
        objective += v[-2] + v[-1]
        out["objective"] = objective
        self._in_step = False
        return out


assert set(_DEN_KEY) == set(MODES)
