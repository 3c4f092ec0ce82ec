"""The one table of the normalization modes (docs/semantics.md §1), importable without torch or JAX.

Every mode is ``J = Σ_mb numerator(mb) / denominator``. A mode is fully described by four entries:

| mode             | unit       | numerator of a microbatch   | denominator   |
|------------------|------------|-----------------------------|---------------|
| per_token        | token      | sum:       Σ s              | max(Ntok, 1)  |
| per_sample       | sample     | unit_mean: Σ_i s_i/max(n_i,1) | max(N, 1)   |
| per_microbatch   | microbatch | unit_mean: s_mb/max(n_mb,1) | max(D·K, 1)   |
| per_document     | document   | unit_mean: Σ_j s_j/max(n_j,1) | max(Ndoc, 1) |
| sample_sum       | sample     | sum:       Σ s              | max(N, 1)     |
| sample_sum_norm  | sample     | sum_over_length: Σ s / L    | max(N, 1)     |
| token_sum        | token      | sum:       Σ s              | 1             |
| per_group        | group      | unit_mean: Σ_g s_g/max(n_g,1) | max(Ngrp, 1) |

A **group** (semantics §1, GRPO: the completions of one prompt) is a set of rows given by a row-level group
id; its rows may lie in several microbatches and ranks, so ``n_g`` is a global count (pre-counted like
``Ntok``), and a microbatch's numerator holds ``Σ_{i∈mb} s_i / max(n_{g(i)}, 1)``.

**Empty-unit rule** (one for every mode): a unit without a loss-bearing token (``n_u = 0``) contributes
``s_u / max(n_u, 1) = 0`` to the numerator and still counts in the denominator; an empty global count
gives the denominator 1, so an empty batch gives ``J = 0``.

A **document** (semantics §0) is a maximal run of equal non-zero segment ids within one row (id 0 is
padding): a restart opens a new document, as with Hugging Face/TRL padding-free ``position_ids``, Megatron's
``cu_seqlens`` and torchtitan's EOS-delimited documents. :func:`document_starts` is that rule on plain
lists (the reference the tensor ports are tested against).

The torch losses (``losses.modes``, ``losses.token_weights``), the integrations, the JAX port
(``jax.modes``) and the log tools (``parity.gap``) read this table; :func:`reduce_units` is the numerator's
reduction written once for any array library whose arrays have ``.sum()`` and ``.clip(min=...)``
(PyTorch, NumPy, JAX).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..options import MODE_INFO, MODES, Mode, check_option

__all__ = [
    "MODE_TABLE",
    "ModeSpec",
    "Unit",
    "Reduction",
    "Count",
    "mode_spec",
    "check_mode",
    "check_fixed_length",
    "check_no_fixed_length",
    "reduce_units",
    "document_starts",
    "count_document_runs",
]

Unit = Literal["token", "sample", "microbatch", "document", "group"]
# sum: Σ s over the microbatch; unit_mean: Σ_u s_u / max(n_u, 1); sum_over_length: Σ s / L (Dr. GRPO).
Reduction = Literal["sum", "unit_mean", "sum_over_length"]
# The field of the step's global counts (``Normalizers``) that divides the numerators.
# "one": no global count (token_sum divides by 1).
Count = Literal["tokens", "samples", "microbatches", "documents", "groups", "one"]


@dataclass(frozen=True)
class ModeSpec:
    """One row of the mode table: ``unit`` (what a loss is averaged over), ``reduction`` (how a
    microbatch's numerator is formed from its units' sums ``s_u`` and counts ``n_u``), ``count`` (the
    global count whose ``max(·, 1)`` is the denominator), and the formula and frameworks of
    ``options.MODE_INFO``."""

    mode: Mode
    unit: Unit
    reduction: Reduction
    count: Count
    formula: str
    frameworks: str

    @property
    def per_unit(self) -> bool:
        """True when the numerator averages within units (``unit_mean``): the modes that need the unit
        counts of whole rows under context parallelism."""
        return self.reduction == "unit_mean"


_ROWS: dict[Mode, tuple[Unit, Reduction, Count]] = {
    "per_token": ("token", "sum", "tokens"),
    "per_sample": ("sample", "unit_mean", "samples"),
    "per_microbatch": ("microbatch", "unit_mean", "microbatches"),
    "per_document": ("document", "unit_mean", "documents"),
    "sample_sum": ("sample", "sum", "samples"),
    "sample_sum_norm": ("sample", "sum_over_length", "samples"),
    "token_sum": ("token", "sum", "one"),
    "per_group": ("group", "unit_mean", "groups"),
}

MODE_TABLE: Mapping[Mode, ModeSpec] = {
    m: ModeSpec(m, *_ROWS[m], formula=MODE_INFO[m][0], frameworks=MODE_INFO[m][1]) for m in MODES
}


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is one of :data:`MODES`, else raise ``ValueError`` listing the valid ones."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    return mode


def mode_spec(mode: str) -> ModeSpec:
    """The table row of ``mode``; ``ValueError`` listing the valid modes for an unknown one."""
    return MODE_TABLE[check_option("mode", mode, MODES)]


def reduce_units(mode: str, s: Any, n: Any, *, fixed_length: int | None = None) -> Any:
    """The numerator of ``mode`` from its units' sums ``s`` and counts ``n`` (arrays of one library):
    ``Σ_u s_u / max(n_u, 1)`` (unit_mean), ``Σ s`` (sum) or ``Σ s / L`` (sum_over_length, ``L =
    fixed_length > 0``). ``s`` and ``n`` are per unit for unit_mean and may be any partial sums otherwise."""
    spec = mode_spec(mode)
    if spec.reduction == "unit_mean":
        return (s / n.clip(min=1)).sum()
    if spec.reduction == "sum":
        return s.sum()
    return s.sum() / check_fixed_length(fixed_length)


def check_fixed_length(fixed_length: Any) -> int | float:
    """``fixed_length`` (the ``L`` of Dr. GRPO) if it is a number > 0, else a ``ValueError`` naming it."""
    if isinstance(fixed_length, bool) or not isinstance(fixed_length, (int, float)) or not fixed_length > 0:
        raise ValueError(f"mode 'sample_sum_norm' needs fixed_length > 0 (the L of Dr. GRPO), got {fixed_length!r}")
    return fixed_length


def check_no_fixed_length(fixed_length: object) -> None:
    """Raise when ``fixed_length`` is passed to a ``denominator``: the ``L`` of ``sample_sum_norm`` is
    divided in the numerator, and every mode's denominator is a plain count (both ports)."""
    if fixed_length is not None:
        raise ValueError(
            f"denominator takes no fixed_length (got {fixed_length!r}): the L of 'sample_sum_norm' is divided "
            "in numerator(..., fixed_length=L), and the denominator of every mode is a plain count"
        )


def document_starts(row: Sequence[int]) -> list[bool]:
    """The document rule on one row of segment ids: ``True`` where a document starts, i.e. at a non-zero
    id that differs from its left neighbour (or sits in column 0). ``[1, 1, 2, 2, 1, 1]`` → 3 documents."""
    return [s != 0 and (t == 0 or s != row[t - 1]) for t, s in enumerate(row)]


def count_document_runs(rows: Sequence[Sequence[int]]) -> int:
    """``Ndoc`` of a batch of rows under :func:`document_starts` (pure Python reference)."""
    return sum(sum(document_starts(r)) for r in rows)
