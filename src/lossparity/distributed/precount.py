"""The accountant's pre-count (docs/semantics.md §3, §7): one step's normalizers, counted from the masks.

At ``begin_step`` every rank counts its microbatches' units (tokens, samples, documents, microbatches,
MTP depth tokens and named extra counts) into one fixed-length float64 buffer that also carries a
configuration fingerprint and an error flag; the buffer is summed over the data-parallel ranks in one
all-reduce (``precount``) and read to the host once. Everything the microbatch calls need afterwards
(denominators, per-microbatch unit maps, the numbered documents) is kept here, so that ``lm_loss`` and
``mtp_loss`` never read the device.

An invalid input on one rank is returned, not raised, before the collective: the rank still enters it
with its error flag set, so that its peers stop with a message instead of hanging (semantics §7).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..losses.mtp import roll_mask
from ..losses.stats import check_inputs, count_documents, rows_documents, unit_count_map
from .protocol import BufferSlots, fingerprint_slots, fingerprint_values

__all__ = ["UNIT_COUNTS", "MicrobatchCounts", "PreCount", "as_2d", "same_storage"]

UNIT_COUNTS = ("tokens", "samples", "documents", "microbatches")
# Fixed length of the pre-count buffer: ranks must reduce buffers of one length even when their
# configurations differ, so that the fingerprint can report the difference (a length mismatch aborts).
_COUNT_CAPACITY = 256


def as_2d(x: Tensor) -> Tensor:
    """``[S]`` (one row) as ``[1, S]``; ``[b, S]`` as it is."""
    return x if x.dim() == 2 else x.unsqueeze(0)


def same_storage(a: object, b: Tensor) -> bool:
    """``a`` and ``b`` view the same elements (the same tensor, or an identical view of it): no sync."""
    if a is b:
        return True
    return (
        isinstance(a, Tensor)
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


@dataclass
class MicrobatchCounts:
    """Host-side counts of one microbatch of this rank (whole rows), read once at ``begin_step``."""

    tokens: int
    docs: int
    documents: tuple[Tensor, int] | None  # rows_documents(segment_ids) in mode per_document
    depth_tokens: list[float]


def _count_slots(mtp_depths: int, extra: Sequence[str], num_groups: int = 0) -> BufferSlots:
    """The buffer's slots: ``_COUNT_CAPACITY`` fixed ones, then (``per_group``) each group's rows and its tokens
    at the main loss and at every MTP depth (their length follows ``num_groups``, equal on every rank)."""
    slots = BufferSlots()
    slots.add("fingerprint", fingerprint_slots())
    slots.add("error")
    for name in UNIT_COUNTS:
        slots.add(name)
    slots.add("mtp_tokens", mtp_depths)
    for name in extra:
        slots.add(f"extra:{name}")
    if slots.size > _COUNT_CAPACITY:
        raise ValueError(
            f"too many counts ({slots.size} > {_COUNT_CAPACITY}): mtp_depths={mtp_depths}, {len(extra)} extra_counts"
        )
    slots.add("pad", _COUNT_CAPACITY - slots.size)
    if num_groups:
        slots.add("group_rows", num_groups)
        slots.add("group_tokens", num_groups * (1 + mtp_depths))  # depth-major: [depth 0 groups, depth 1 ...]
    return slots


@dataclass
class PreCount:
    """One step's pre-count on this rank: the buffer (local, then reduced), its host copy and the
    per-microbatch inputs the microbatch calls compare against."""

    mode: str
    mtp_depths: int
    slots: BufferSlots
    buffer: Tensor
    masks: list = field(default_factory=list)
    segs: list = field(default_factory=list)
    microbatches: list[MicrobatchCounts] = field(default_factory=list)
    host: dict[str, list[float]] = field(default_factory=dict)
    fp_fields: dict[str, object] = field(default_factory=dict)
    _unit_maps: dict[tuple[int, int], Tensor | None] = field(default_factory=dict)
    num_groups: int = 0  # per_group: the id range [0, num_groups) of begin_step's group_ids
    group_ids: list[Tensor] = field(default_factory=list)  # per_group: each microbatch's [b] row group ids

    @property
    def extra_names(self) -> list[str]:
        """Names of this step's ``extra_counts``."""
        return [n[len("extra:") :] for n in self.slots.names() if n.startswith("extra:")]

    # ------------------------------------------------------------------ counting (host syncs allowed)
    @classmethod
    def count_local(
        cls,
        mode: str,
        mtp_depths: int,
        device: torch.device,
        rank: int,
        masks: object,
        segment_ids: object,
        extra_counts: object,
        fields: Callable[[tuple[str, ...]], dict[str, object]],
        group_ids: object = None,
        num_groups: object = None,
    ) -> tuple[PreCount, Exception | None]:
        """This rank's counts of ``masks``/``segment_ids`` (and ``extra_counts``; ``per_group``: each group's
        rows and tokens from ``group_ids``) with the fingerprint of ``fields(count names)``; an invalid input
        comes back as the exception, flagged in the buffer."""
        groups = num_groups if isinstance(num_groups, int) and not isinstance(num_groups, bool) else 0
        groups = groups if mode == "per_group" and groups > 0 else 0
        slots = _count_slots(mtp_depths, [], groups)
        pc = cls(mode, mtp_depths, slots, slots.zeros(device), num_groups=groups)
        error: Exception | None = None
        try:
            pc.masks = list(masks)  # type: ignore[call-overload]
            pc.segs = pc._check_args(segment_ids)
            pc.group_ids = pc._check_groups(group_ids, num_groups, rank)
            extra = dict(extra_counts or {})  # type: ignore[call-overload]
            pc.slots = _count_slots(mtp_depths, list(extra), groups)
            pc.buffer = pc.slots.zeros(device)
            for name, value in extra.items():
                pc.buffer[pc.slots.sl(f"extra:{name}")] = float(value)
            for i, (w, seg) in enumerate(zip(pc.masks, pc.segs)):
                pc._count_microbatch(i, w, seg, f"rank {rank}, microbatch {i}")
        except Exception as e:  # noqa: BLE001 - any failure must reach the peers as a flag, not a hang
            pc.buffer[pc.slots.sl("error")] = 1.0
            error = e
        pc.fp_fields = fields(pc.slots.names())
        pc.buffer[pc.slots.sl("fingerprint")] = torch.tensor(fingerprint_values(pc.fp_fields), dtype=torch.float64)
        return pc, error

    def _check_args(self, segment_ids: object) -> list:
        if not self.masks:
            raise ValueError("begin_step needs the masks of at least one microbatch (masks is empty)")
        segs = list(segment_ids) if segment_ids is not None else [None] * len(self.masks)  # type: ignore[call-overload]
        if len(segs) != len(self.masks):
            raise ValueError(f"segment_ids has {len(segs)} entries but masks has {len(self.masks)}")
        if self.mode == "per_document" and any(s is None for s in segs):
            raise ValueError("mode 'per_document' needs segment_ids for every microbatch in begin_step")
        return segs

    def _check_groups(self, group_ids: object, num_groups: object, rank: int) -> list[Tensor]:
        """``per_group``: one integer ``[b]`` tensor of ids in ``[0, num_groups)`` per microbatch (values read
        here, once per step); the other modes take none."""
        if self.mode != "per_group":
            if group_ids is not None:
                raise ValueError(f"group_ids is given but mode is {self.mode!r}: only 'per_group' takes group ids")
            return []
        if group_ids is None or isinstance(group_ids, Tensor):
            raise ValueError(
                f"mode 'per_group' needs group_ids and num_groups in begin_step: one integer [b] tensor per "
                f"microbatch, the group of each row in [0, num_groups) (rank {rank}), got group_ids="
                f"{'None' if group_ids is None else 'one tensor'}; a caller that passes no groups (an integration "
                "of a framework's trainer) cannot run per_group: lossparity.rl (RLAccountant, the TRL drop-in)"
            )
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(
                f"mode 'per_group' needs num_groups, an int >= 1 equal on every rank (rank {rank}), got {num_groups!r}"
            )
        ids = list(group_ids)  # type: ignore[call-overload]
        if len(ids) != len(self.masks):
            raise ValueError(f"group_ids has {len(ids)} entries but masks has {len(self.masks)} (rank {rank})")
        for i, (g, w) in enumerate(zip(ids, self.masks)):
            where = f"rank {rank}, microbatch {i}"
            rows = as_2d(w).shape[0] if isinstance(w, Tensor) else None
            if not isinstance(g, Tensor) or g.is_floating_point() or g.is_complex() or g.dtype == torch.bool:
                raise TypeError(f"group_ids[{i}] must be an integer torch.Tensor ({where}), got {type(g).__name__}")
            if g.dim() != 1 or (rows is not None and g.shape[0] != rows):
                raise ValueError(
                    f"group_ids[{i}] must have shape [{rows}] (one id per row of masks[{i}]) ({where}), "
                    f"got {tuple(g.shape)}"
                )
            if g.numel():
                low, high = int(g.min()), int(g.max())
                if low < 0 or high >= num_groups:
                    bad = low if low < 0 else high
                    raise ValueError(
                        f"group_ids[{i}] holds the id {bad} ({where}): ids must lie in [0, num_groups={num_groups})"
                    )
        return ids

    def _count_microbatch(self, i: int, w: object, seg: object, where: str) -> None:
        """Validate microbatch ``i``'s mask (and segment ids) and add its counts."""
        for name, x in (("masks", w), ("segment_ids", seg)):
            if x is not None and not isinstance(x, Tensor):
                raise TypeError(
                    f"{name}[{i}] must be a torch.Tensor, got {type(x).__name__} ({where}): convert "
                    "lists and NumPy arrays with torch.as_tensor"
                )
        w2 = as_2d(w)  # type: ignore[arg-type]
        seg2 = None if seg is None else as_2d(seg)  # type: ignore[arg-type]
        check_inputs(w2.to(torch.float32), w2, seg2, where=where, check_finite=False)
        docs = None
        if seg2 is not None and self.mode == "per_document":
            docs = rows_documents(seg2)
            if bool(((docs[0] < 0) & (w2 > 0)).any()):
                raise ValueError(
                    f"masks[{i}] has loss-bearing tokens at segment_ids == 0 (padding); they "
                    f"belong to no document ({where})"
                )
        ndoc = docs[1] if docs is not None else (count_documents(seg2) if seg2 is not None else 0)
        ntok = w2.sum().to(torch.float64)
        depth_tokens = [float(roll_mask(w2, seg2, k).sum()) for k in range(1, self.mtp_depths + 1)]
        self.microbatches.append(MicrobatchCounts(int(ntok.item()), ndoc, docs, depth_tokens))
        buf, slots = self.buffer, self.slots
        buf[slots.sl("tokens")] += ntok
        buf[slots.sl("samples")] += w2.shape[0]
        buf[slots.sl("microbatches")] += 1
        buf[slots.sl("documents")] += ndoc
        if self.mtp_depths:
            buf[slots.sl("mtp_tokens")] += torch.tensor(depth_tokens, dtype=torch.float64, device=buf.device)
        if self.num_groups:
            ids = self.group_ids[i].to(buf.device, torch.long)
            ones = torch.ones(ids.shape, dtype=torch.float64, device=buf.device)
            buf[slots.sl("group_rows")].index_add_(0, ids, ones)
            per_depth = [w2] + [roll_mask(w2, seg2, k) for k in range(1, self.mtp_depths + 1)]
            tokens = buf[slots.sl("group_tokens")].view(1 + self.mtp_depths, self.num_groups)
            for d, wd in enumerate(per_depth):
                tokens[d].index_add_(0, ids, wd.to(buf.device, torch.float64).sum(dim=-1))

    def read(self, error: Exception | None, peers: int, rank: int, raise_fingerprint: Callable[..., None]) -> None:
        """Host copy of the (reduced over ``peers`` ranks) buffer: the step's one read; raise on any rank's
        error or a fingerprint mismatch."""
        values = self.buffer.tolist()
        if error is not None:
            raise error
        flagged = values[self.slots.sl("error")][0]
        if flagged > 0:
            raise RuntimeError(
                f"{int(flagged)} other rank(s) reported invalid input in begin_step (see their "
                f"error); rank {rank} stops too"
            )
        raise_fingerprint(
            self.fp_fields,
            values[self.slots.sl("fingerprint")],
            peers,
            f"{peers} data-parallel ranks",
            rank,
            "Accountant and MoEAccounting with the same arguments and declare the same metrics",
        )
        skip = ("pad", "group_rows", "group_tokens")
        self.host = {name: values[self.slots.sl(name)] for name in self.slots.names() if name not in skip}
        if self.num_groups:  # Ngrp: the ids that hold at least one row of the global batch
            self.host["groups"] = [float(sum(1 for r in values[self.slots.sl("group_rows")] if r > 0))]

    # ------------------------------------------------------------------ reads (no host sync)
    def denominator(self, key: str) -> float:
        """The step's count ``key`` (at least 1: an empty unit set gives a zero objective, not a NaN);
        ``one`` (``token_sum``) is 1."""
        return 1.0 if key == "one" else max(self.host[key][0], 1.0)

    def global_count(self, name: str) -> float:
        """A count of this step by name (see ``Accountant.global_count``)."""
        c = self.host
        if name == "groups" and "groups" in c:
            return c["groups"][0]
        if name in UNIT_COUNTS:
            return c[name][0]
        if name.startswith("mtp_") and name.endswith("_tokens") and name[4:-7].isdigit():
            k = int(name[4:-7])
            if 1 <= k <= self.mtp_depths:
                return c["mtp_tokens"][k - 1]
        if f"extra:{name}" in c:
            return c[f"extra:{name}"][0]
        raise KeyError(f"unknown count {name!r}; extra counts of this step: {self.extra_names}")

    def documents_of(self, segment_ids: Tensor) -> tuple[Tensor, int] | None:
        """The documents numbered at ``begin_step`` for ``segment_ids`` (the same tensor), else ``None``."""
        for seg, info in zip(self.segs, self.microbatches):
            if info.documents is not None and same_storage(seg, segment_ids):
                return info.documents
        return None

    def expected(self, mb: int, columns: Tensor | None, segments: bool = False) -> Tensor | None:
        """The mask (or segment ids) of microbatch ``mb`` given to ``begin_step``, restricted to ``columns``."""
        rows = (self.segs if segments else self.masks)[mb]
        if rows is None:
            return None
        full = as_2d(rows)
        return full if columns is None else full[:, columns]

    def unit_counts(self, mb: int, depth: int, columns: Tensor | None, *, whole: bool = False) -> Tensor | None:
        """Whole-row unit counts of microbatch ``mb`` (depth 0 = main loss) restricted to ``columns``;
        ``None`` without context parallelism (local counts are then the whole-row counts) unless ``whole``
        (the map of the rows given to ``begin_step``: the token weights take it instead of numbering the
        documents again, which would read them to the host every microbatch)."""
        if columns is None and not whole and not self.num_groups:
            return None
        if mb >= len(self.masks):
            return None  # more microbatches than counted: the accounting call that follows names it
        key = (mb, depth)
        if key not in self._unit_maps and self.num_groups:
            # per_group: the global n_g of each row's group (groups span microbatches and ranks), read from
            # the reduced buffer on the device: no host sync
            tokens = self.buffer[self.slots.sl("group_tokens")].view(1 + self.mtp_depths, self.num_groups)
            w = as_2d(self.masks[mb])
            n_row = tokens[depth].index_select(0, self.group_ids[mb].to(tokens.device, torch.long))
            self._unit_maps[key] = n_row.unsqueeze(-1).expand(w.shape)
        if key not in self._unit_maps:
            w, seg = as_2d(self.masks[mb]), self.segs[mb]
            if depth:
                w = roll_mask(w, seg, depth)
            # the documents numbered at begin_step: no host sync here (per microbatch)
            docs = self.microbatches[mb].documents
            self._unit_maps[key] = unit_count_map(self.mode, w, seg, documents=docs)  # type: ignore[arg-type]
        full = self._unit_maps[key]
        if full is None or columns is None:
            return full
        return full[:, columns]
