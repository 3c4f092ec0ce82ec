"""Row weights of the RL terms (docs/semantics.md §1, §9): every mode an RL term uses gives each row one
weight, constant over the row's tokens, so that a term's share of a microbatch is ``Σ_i r_i · Σ_t w[i,t]·l[i,t]``.

| mode             | r_i (row i, group g(i))                                        |
|------------------|----------------------------------------------------------------|
| per_token        | 1 / max(Ntok, 1)                                               |
| token_sum        | 1                                                              |
| per_sample       | 1 / (N' · u_i),  u_i = max(n_i, 1), or n_i + ε with an epsilon |
| sample_sum       | 1 / N'                                                         |
| sample_sum_norm  | 1 / (N' · L)                                                   |
| per_group        | 1 / (Ngrp · max(n_g, 1))                                       |
| per_microbatch   | 1 / (D·K · max(n_mb, 1))                                       |

``N' = max(N, 1)`` with empty rows counted (``empty_rows="count"``, §1) or ``max(N_nonempty, 1)`` with them
dropped (``"drop"``: OpenRLHF, verl's legacy workers). ``per_document`` weighs tokens, not rows: not an RL mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .mode_table import check_fixed_length, check_mode

__all__ = ["RL_MODES", "EMPTY_ROWS", "StepCounts", "row_weights"]

RL_MODES: tuple[str, ...] = (
    "per_token",
    "token_sum",
    "per_sample",
    "sample_sum",
    "sample_sum_norm",
    "per_group",
    "per_microbatch",
)
EMPTY_ROWS: tuple[str, ...] = ("count", "drop")


@dataclass(frozen=True)
class StepCounts:
    """Global counts of the rows a step is normalized over (host numbers): ``tokens = Ntok``, ``rows = N``,
    ``nonempty_rows`` (rows with ``n_i > 0``), ``microbatches = D·K``, ``groups = Ngrp`` (distinct group ids)."""

    tokens: float
    rows: float
    nonempty_rows: float
    microbatches: float
    groups: float


def row_weights(
    mode: str,
    n: Tensor,
    counts: StepCounts,
    *,
    group_n: Tensor | None = None,
    epsilon: float = 0.0,
    empty_rows: str = "count",
    fixed_length: float | None = None,
) -> Tensor:
    """Float64 weights ``r`` of shape ``n.shape`` (module table) from the rows' token counts ``n`` ``[b]``;
    ``group_n`` ``[b]``: the global token count of each row's group (``per_group``). A row without tokens
    gets a finite weight (its tokens are all masked, so it adds 0). No host synchronization."""
    check_mode(mode)
    if mode not in RL_MODES:
        raise ValueError(f"mode {mode!r} is not a row-weighted RL mode; valid: {', '.join(RL_MODES)}")
    if empty_rows not in EMPTY_ROWS:
        raise ValueError(f"empty_rows must be one of {', '.join(EMPTY_ROWS)}, got {empty_rows!r}")
    n = n.to(torch.float64)
    ones = torch.ones_like(n)
    rows = max(counts.nonempty_rows if empty_rows == "drop" else counts.rows, 1.0)
    if mode == "per_token":
        return ones / max(counts.tokens, 1.0)
    if mode == "token_sum":
        return ones
    if mode == "sample_sum":
        return ones / rows
    if mode == "sample_sum_norm":
        return ones / (rows * float(check_fixed_length(fixed_length)))
    if mode == "per_sample":
        unit = torch.where(n > 0, n + epsilon, ones) if epsilon else n.clamp(min=1)
        return 1.0 / (rows * unit)
    if mode == "per_microbatch":
        return ones / (max(counts.microbatches, 1.0) * n.sum().clamp(min=1))
    if group_n is None:
        raise ValueError("mode 'per_group' needs group_n (the global token count of each row's group)")
    return 1.0 / (max(counts.groups, 1.0) * group_n.to(torch.float64).clamp(min=1))
