"""A built-in example that checks every mode of semantics §1 against a naive formula (`lossparity modes --check`).

The reference is written with plain Python loops over lists of floats, sharing no code with the
library, and the library side runs through the :class:`Accountant` with gradient accumulation
(``K = 4`` microbatches of ``b = 2``), so a wrong share or denominator shows up here. ``per_group`` runs through
the :class:`~lossparity.rl.RLAccountant` (its groups of 3 rows span microbatches: ``GROUPS``).
"""

from __future__ import annotations

import torch

from .distributed.accountant import Accountant
from .losses.modes import MODES
from .rl.accountant import RLAccountant, Term

GROUPS = [0, 0, 0, 1, 1, 1, 2, 2]  # the per_group groups of the example's rows (they span microbatches)

__all__ = ["example_batch", "naive_objective", "run_selfcheck"]


def example_batch() -> tuple[list[list[float]], list[list[int]], list[list[int]]]:
    """Eight rows of length 6 with uneven lengths, one all-padding row and two packed documents per row."""
    g = torch.Generator().manual_seed(1234)
    losses = (torch.rand(8, 6, generator=g, dtype=torch.float64) * 3).tolist()
    lengths = [6, 1, 0, 4, 2, 6, 3, 5]
    masks = [[1 if t < n else 0 for t in range(6)] for n in lengths]
    segs = [[(1 if t < 3 else 2) if t < max(n, 1) else 0 for t in range(6)] for n in lengths]
    return losses, masks, segs


def naive_objective(mode: str, losses, masks, segs, b: int, length: int) -> float:
    """semantics §1 computed with Python loops, for the self-check (float64 via Python floats)."""
    rows = range(len(losses))
    s = [sum(l * w for l, w in zip(losses[i], masks[i])) for i in rows]
    n = [sum(masks[i]) for i in rows]
    N = len(losses)
    if mode == "per_token":
        return sum(s) / max(sum(n), 1)
    if mode == "per_sample":
        return sum(si / max(ni, 1) for si, ni in zip(s, n)) / N
    if mode == "per_microbatch":
        mbs = [range(i, i + b) for i in range(0, N, b)]
        return sum(sum(s[i] for i in mb) / max(sum(n[i] for i in mb), 1) for mb in mbs) / len(mbs)
    if mode == "per_document":
        docs: dict[tuple[int, int], list[float]] = {}
        for i in rows:
            for t, seg in enumerate(segs[i]):
                if seg:
                    d = docs.setdefault((i, seg), [0.0, 0.0])
                    d[0] += losses[i][t] * masks[i][t]
                    d[1] += masks[i][t]
        return sum(a / max(c, 1) for a, c in docs.values()) / len(docs)
    if mode == "sample_sum":
        return sum(s) / N
    if mode == "sample_sum_norm":
        return sum(s) / (N * length)
    if mode == "token_sum":
        return sum(s)
    if mode == "per_group":
        ids = sorted(set(GROUPS))
        sg = [sum(s[i] for i in rows if GROUPS[i] == g) for g in ids]
        ng = [sum(n[i] for i in rows if GROUPS[i] == g) for g in ids]
        return sum(a / max(c, 1) for a, c in zip(sg, ng)) / len(ids)
    raise ValueError(mode)


def run_selfcheck(tol: float = 1e-12) -> list[tuple[str, float, float, bool]]:
    """Compute every mode through the accountant (K=4, b=2) and the naive formula; returns
    ``(mode, library, naive, ok)`` rows with ``ok = |library − naive| <= tol·max(1, |naive|)``."""
    losses, masks, segs = example_batch()
    L = torch.tensor(losses, dtype=torch.float64)
    W = torch.tensor(masks, dtype=torch.float64)
    G = torch.tensor(segs, dtype=torch.long)
    rows: list[tuple[str, float, float, bool]] = []
    for mode in MODES:
        if mode == "per_group":
            rl = RLAccountant({"lm": Term("per_group")})
            gid = torch.tensor(GROUPS)
            rl.begin_step(
                [W[i : i + 2] for i in range(0, 8, 2)], [gid[i : i + 2] for i in range(0, 8, 2)], num_groups=3
            )
            total = sum(float(rl.share(k, {"lm": L[2 * k : 2 * k + 2]})) for k in range(4))
            ref = naive_objective(mode, losses, masks, segs, 2, 6)
            rl_logged = rl.logs()["objective"]
            ok = abs(total - ref) <= tol * max(1.0, abs(ref)) and abs(rl_logged - ref) <= tol * max(1.0, abs(ref))
            rows.append((mode, total, ref, ok))
            continue
        acc = Accountant(mode, fixed_length=6)
        acc.begin_step([W[i : i + 2] for i in range(0, 8, 2)], [G[i : i + 2] for i in range(0, 8, 2)])
        total = sum(float(acc.lm_loss(L[i : i + 2], W[i : i + 2], G[i : i + 2])) for i in range(0, 8, 2))
        acc.finish_step()
        logged = acc.logs()["objective"]
        ref = naive_objective(mode, losses, masks, segs, 2, 6)
        ok = (
            abs(total - ref) <= tol * max(1.0, abs(ref))
            and logged is not None
            and abs(logged - ref) <= tol * max(1.0, abs(ref))
        )
        rows.append((mode, total, ref, ok))
    return rows
