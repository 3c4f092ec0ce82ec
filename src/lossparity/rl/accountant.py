"""The accountant of an RL objective of several per-token terms (docs/semantics.md §9).

One step (the rows its counts are taken over: the optimizer step, or TRL's generation batch)::

    acc = RLAccountant({"policy": Term("per_group"), "kl": Term("per_token", coef=0.04),
                        "entropy": Term("per_token", coef=-0.01)})
    acc.begin_step(masks, group_ids=groups)          # one all-reduce of the counts
    for i, mb in enumerate(microbatches):
        share = acc.share(i, {"policy": pg, "kl": kl, "entropy": ent}, metrics={"clip_fraction": clipped})
        share.backward()                              # Σ_k coef_k · (this microbatch's part of J_k)
    logs = acc.logs()                                 # J, every term's J_k, token means: one all-reduce

``share`` reads only host numbers counted at ``begin_step`` and device tensors: no host synchronization per
microbatch. Invalid input at ``begin_step`` is raised on every rank after the collective (naming argument, rank
and microbatch), before any state changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from ..losses._checks import describe
from ..losses.mode_table import check_fixed_length
from ..losses.rl_weights import EMPTY_ROWS, RL_MODES, StepCounts, row_weights

__all__ = ["Term", "RLAccountant"]

_FIXED = 5  # error flag, tokens, rows, non-empty rows, microbatches


@dataclass(frozen=True)
class Term:
    """One per-token term of ``J = Σ_k coef_k · J_{mode_k}(l_k)``: its mode (``RL_MODES``), coefficient
    (negative for a bonus such as the entropy), per-sequence ``epsilon``, ``empty_rows`` (``count``/``drop``)
    and the fixed length ``L`` of ``sample_sum_norm``."""

    mode: str = "per_token"
    coef: float = 1.0
    epsilon: float = 0.0
    empty_rows: str = "count"
    fixed_length: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in RL_MODES:
            raise ValueError(f"Term.mode: unknown RL mode {self.mode!r}; valid: {', '.join(RL_MODES)}")
        for name in ("coef", "epsilon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Term.{name} must be a finite number, got {v!r}")
        if self.epsilon < 0:
            raise ValueError(f"Term.epsilon must be >= 0, got {self.epsilon!r}")
        if self.empty_rows not in EMPTY_ROWS:
            raise ValueError(f"Term.empty_rows must be one of {', '.join(EMPTY_ROWS)}, got {self.empty_rows!r}")
        if self.mode == "sample_sum_norm":
            check_fixed_length(self.fixed_length)


@dataclass
class _Step:
    counts: StepCounts
    masks: list[Tensor]
    group_index: list[Tensor | None]  # per microbatch: each row's group id
    group_n: Tensor | None  # [num_groups] global token count of each group
    sums: dict[str, Tensor] = field(default_factory=dict)  # detached Σ r·w·l per term, this rank
    metric_sums: dict[str, Tensor] = field(default_factory=dict)  # Σ x·w per metric, this rank
    metric_tokens: Tensor | None = None


class RLAccountant:
    """Exact, layout-invariant accounting of several named per-token terms (module docstring).

    Args:
        terms: name -> :class:`Term`, e.g. ``policy``, ``kl``, ``entropy``, ``value``, ``aux``.
        group: the data-parallel process group (``None``: the default group when initialized, else one process).
        grad_reduction: ``"sum"`` (the gradients are summed over ranks, or one process) or ``"mean"`` (the
            engine averages them, DDP: each share is multiplied by the number of ranks).
    """

    def __init__(
        self, terms: Mapping[str, Term], group: ProcessGroup | None = None, *, grad_reduction: str = "sum"
    ) -> None:
        if not isinstance(terms, Mapping) or not terms:
            raise ValueError(f"terms must be a non-empty mapping of name -> Term, got {describe(terms)}")
        for name, t in terms.items():
            if not isinstance(name, str) or not isinstance(t, Term):
                raise TypeError(f"terms[{name!r}] must be a Term keyed by a string, got {describe(t)}")
        if grad_reduction not in ("sum", "mean"):
            raise ValueError(f"grad_reduction must be 'sum' or 'mean', got {grad_reduction!r}")
        self.terms = dict(terms)
        self.group = group
        self.grad_reduction = grad_reduction
        self._step: _Step | None = None

    # ------------------------------------------------------------------ collectives
    def _world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 1, 0
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def _all_reduce(self, t: Tensor) -> None:
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    # ------------------------------------------------------------------ begin_step
    def begin_step(
        self,
        masks: Sequence[Tensor],
        group_ids: Sequence[Tensor] | None = None,
        *,
        num_groups: int | None = None,
    ) -> None:
        """Count the step's rows: ``masks`` are this rank's microbatch loss masks ``[b, S]`` (in the order of
        ``share``'s index); ``group_ids`` one ``[b]`` integer tensor per microbatch with ids in
        ``[0, num_groups)`` (needed when a term is ``per_group``; ``num_groups`` equal on every rank). One
        all-reduce of ``Ntok``, ``N``, the non-empty rows, ``D·K`` and each group's rows and tokens."""
        _, rank = self._world()
        needs_groups = any(t.mode == "per_group" for t in self.terms.values())
        g = num_groups if needs_groups and isinstance(num_groups, int) and num_groups > 0 else 0
        dev = masks[0].device if masks and isinstance(masks[0], Tensor) else torch.device("cpu")
        buf = torch.zeros(_FIXED + 2 * g, dtype=torch.float64, device=dev)
        error: Exception | None = None
        index: list[Tensor | None] = []
        try:
            index = self._count(masks, group_ids, num_groups, needs_groups, g, buf, rank)
        except (TypeError, ValueError) as e:  # raised on every rank after the collective (semantics §7)
            error = e
            buf.zero_()
            buf[0] = 1.0
        self._all_reduce(buf)
        host = buf[:_FIXED].tolist()  # the step's one read to the host
        if error is not None:
            raise error
        if host[0] > 0:
            raise RuntimeError(f"{int(host[0])} other rank(s) reported invalid input in begin_step; rank {rank} stops")
        groups = float((buf[_FIXED : _FIXED + g] > 0).sum().item()) if g else 0.0
        counts = StepCounts(tokens=host[1], rows=host[2], nonempty_rows=host[3], microbatches=host[4], groups=groups)
        self._step = _Step(counts, [m.detach() for m in masks], index, buf[_FIXED + g :] if g else None)

    def _count(
        self,
        masks: Sequence[Tensor],
        group_ids: Sequence[Tensor] | None,
        num_groups: int | None,
        needs_groups: bool,
        g: int,
        buf: Tensor,
        rank: int,
    ) -> list[Tensor | None]:
        if isinstance(masks, Tensor) or not isinstance(masks, Sequence) or not masks:
            raise ValueError(
                f"masks must be a non-empty sequence of [b, S] tensors (rank {rank}), got {describe(masks)}"
            )
        if needs_groups and (group_ids is None or not g):
            raise ValueError(f"a per_group term needs group_ids and num_groups > 0 (rank {rank}), got {num_groups!r}")
        if group_ids is not None and len(group_ids) != len(masks):
            raise ValueError(f"group_ids has {len(group_ids)} entries for {len(masks)} masks (rank {rank})")
        index: list[Tensor | None] = []
        for i, m in enumerate(masks):
            where = f"rank {rank}, microbatch {i}"
            if not isinstance(m, Tensor) or m.dim() != 2:
                raise ValueError(f"masks[{i}] must be a [b, S] tensor ({where}), got {describe(m)}")
            n = m.to(torch.float64).sum(dim=-1)
            buf[1] += n.sum()
            buf[2] += m.shape[0]
            buf[3] += (n > 0).sum()
            buf[4] += 1
            if not needs_groups:
                index.append(None)
                continue
            ids = group_ids[i]  # type: ignore[index]
            if not isinstance(ids, Tensor) or ids.shape != (m.shape[0],) or ids.is_floating_point():
                raise ValueError(f"group_ids[{i}] must be an integer tensor of shape [{m.shape[0]}] ({where})")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= g):
                raise ValueError(f"group_ids[{i}] must lie in [0, num_groups={g}) ({where})")
            ids = ids.to(buf.device, torch.long)
            buf[_FIXED : _FIXED + g].index_add_(0, ids, torch.ones_like(n))
            buf[_FIXED + g :].index_add_(0, ids, n.to(buf.device))
            index.append(ids)
        return index

    @property
    def counts(self) -> StepCounts:
        """The step's global counts (after ``begin_step``)."""
        if self._step is None:
            raise RuntimeError("RLAccountant.counts: call begin_step first")
        return self._step.counts

    # ------------------------------------------------------------------ microbatches
    def token_weights(self, microbatch: int, name: str) -> Tensor:
        """Float64 ``[b, S]`` weights of term ``name`` in microbatch ``microbatch`` (``mask · r_i``, before
        ``coef``): the microbatch's part of ``J_name`` is ``Σ weights · l``."""
        step = self._require("token_weights")
        if not isinstance(microbatch, int) or not 0 <= microbatch < len(step.masks):
            raise ValueError(f"microbatch must be an int in [0, {len(step.masks)}), got {microbatch!r}")
        t = self.terms[name]
        m = step.masks[microbatch].to(torch.float64)
        idx = step.group_index[microbatch]
        gn = step.group_n[idx] if step.group_n is not None and idx is not None else None
        r = row_weights(
            t.mode,
            m.sum(dim=-1),
            step.counts,
            group_n=gn,
            epsilon=t.epsilon,
            empty_rows=t.empty_rows,
            fixed_length=t.fixed_length,
        )
        return m * r.unsqueeze(-1)

    def share(
        self, microbatch: int, values: Mapping[str, Tensor], *, metrics: Mapping[str, Tensor] | None = None
    ) -> Tensor:
        """This microbatch's exact share of ``J``: ``Σ_k coef_k · Σ token_weights(k) · values[k]`` (times the
        number of ranks under ``grad_reduction="mean"``) over the terms in ``values`` (each ``[b, S]``); a term
        computed elsewhere from :meth:`token_weights` is given to :meth:`record` instead. ``metrics`` (``[b, S]``)
        are logged as global token means. The per-term parts are kept (detached) for ``logs``."""
        step = self._require("share")
        unknown = sorted(set(values) - set(self.terms))
        if unknown or not values:
            raise ValueError(f"share: values must name terms among {sorted(self.terms)}, got {sorted(values)}")
        total: Tensor | None = None
        mask = step.masks[microbatch] if isinstance(microbatch, int) and 0 <= microbatch < len(step.masks) else None
        for name, v in values.items():
            t = self.terms[name]
            if not isinstance(v, Tensor) or mask is None or v.shape != mask.shape:
                shape = None if mask is None else tuple(mask.shape)
                raise ValueError(
                    f"share: values[{name!r}] must be a tensor of the mask's shape {shape} "
                    f"(microbatch {microbatch}), got {describe(v)}"
                )
            w = self.token_weights(microbatch, name).to(v.device)
            part = (torch.where(w > 0, v.to(torch.float64), torch.zeros_like(w)) * w).sum()
            step.sums[name] = step.sums.get(name, torch.zeros((), dtype=torch.float64, device=v.device)) + part.detach()
            term = t.coef * part
            total = term if total is None else total + term
        for name, x in (metrics or {}).items():
            mf = mask.to(torch.float64).to(x.device)  # type: ignore[union-attr]
            s = (torch.where(mf > 0, x.detach().to(torch.float64), torch.zeros_like(mf))).sum()
            step.metric_sums[name] = step.metric_sums.get(name, torch.zeros_like(s)) + s
        assert total is not None
        scale = float(self._world()[0]) if self.grad_reduction == "mean" else 1.0
        return total * scale

    def record(self, name: str, part: Tensor) -> None:
        """Add ``part``, this rank's part of term ``name``'s ``J_name`` computed by the caller from
        :meth:`token_weights` (e.g. inside a framework's own loss), to the logged values (detached)."""
        step = self._require("record")
        if name not in self.terms or not isinstance(part, Tensor) or part.numel() != 1:
            raise ValueError(f"record: name must be a term of {sorted(self.terms)} and part a scalar tensor")
        p = part.detach().to(torch.float64).reshape(())
        step.sums[name] = step.sums.get(name, torch.zeros_like(p)) + p

    # ------------------------------------------------------------------ logs
    def logs(self) -> dict[str, float]:
        """``objective = J``, every term's exact global ``J_k`` (before ``coef``), the token means of the
        metrics over the step's global tokens, ``tokens``, ``samples``, ``groups``: one all-reduce. The values
        cover the shares since ``begin_step`` or the previous ``logs`` (count scope ``generation``: a generation
        batch counted once feeds several optimizer steps, each logged on its own)."""
        step = self._require("logs")
        names, mnames = list(self.terms), sorted(step.metric_sums)
        dev = step.masks[0].device
        parts = [step.sums.get(n, torch.zeros((), dtype=torch.float64, device=dev)).to(dev) for n in names]
        parts += [step.metric_sums[n].to(dev) for n in mnames]
        buf = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64, device=dev)
        self._all_reduce(buf)
        v = buf.tolist()
        out: dict[str, float] = {n: v[i] for i, n in enumerate(names)}
        out["objective"] = sum(self.terms[n].coef * out[n] for n in names)
        for j, n in enumerate(mnames):
            out[n] = v[len(names) + j] / max(step.counts.tokens, 1.0)
        out.update(tokens=step.counts.tokens, samples=step.counts.rows, groups=step.counts.groups)
        step.sums, step.metric_sums = {}, {}  # the counts stay: a generation batch may feed several steps
        return out

    def _require(self, call: str) -> _Step:
        if self._step is None:
            raise RuntimeError(f"RLAccountant.{call}: call begin_step first")
        return self._step
