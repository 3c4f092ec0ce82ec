"""``lossparity gap`` over many steps at once: the per-step values and bootstrap replicates of a block of steps
with the same number of samples, as ``[G, N]`` arrays (a 30,000-step dump once took a minute of per-step
NumPy calls). The formulas are those of :func:`lossparity.parity.gap.step_mode_values`,
:func:`~lossparity.parity.gap.covariance_gap` and :func:`~lossparity.parity.gap.bootstrap_gaps`, row by row
(``tests/test_gap_tool.py`` checks them against naive per-step computations).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["block_values", "bootstrap_block", "quantile_rows", "step_blocks", "value_at"]


def block_values(
    n: np.ndarray, s: np.ndarray, microbatch_size: int | None, fixed_length: int | None
) -> dict[str, np.ndarray | None]:
    """Per row of ``[G, N]`` counts ``n`` and sums ``s``: ``tokens``, ``per_token``, ``per_sample``,
    ``per_microbatch`` (``None`` without a ``microbatch_size`` dividing ``N``), ``sample_sum``,
    ``sample_sum_norm`` (``None`` without ``fixed_length``), ``cov``, ``mean_count`` and ``cov_term``."""
    g, size = n.shape
    tokens = n.sum(axis=1)
    total = s.sum(axis=1)
    l = s / np.maximum(n, 1.0)
    out: dict[str, np.ndarray | None] = {
        "tokens": tokens,
        "per_token": total / np.maximum(tokens, 1.0),
        "per_sample": l.sum(axis=1) / size,
        "sample_sum": total / size,
        "sample_sum_norm": total / fixed_length / size if fixed_length else None,
        "per_microbatch": None,
    }
    b = microbatch_size
    if b and size % b == 0:
        blocks = size // b
        ratio = s.reshape(g, blocks, b).sum(axis=2) / np.maximum(n.reshape(g, blocks, b).sum(axis=2), 1.0)
        out["per_microbatch"] = ratio.sum(axis=1) / blocks
    mean_n = n.mean(axis=1)
    cov = ((n - mean_n[:, None]) * (l - l.mean(axis=1)[:, None])).mean(axis=1)
    out["cov"], out["mean_count"] = cov, mean_n
    out["cov_term"] = np.where(mean_n > 0, cov / np.where(mean_n > 0, mean_n, 1.0), 0.0)
    return out


def bootstrap_block(n: np.ndarray, s: np.ndarray, replicates: int, rng: np.random.Generator, out: np.ndarray) -> None:
    """Fill ``out`` (``[G, replicates]``) with the bootstrap values of ``per_token − per_sample`` of each row of
    ``[G, N]`` ``n``, ``s``: resampling the ``N`` samples with replacement, drawn by ``rng.integers`` for as
    many rows at once as keep ``rows · replicates · N`` indices under ``chunk`` (rows in order)."""
    from .gap import _BOOTSTRAP_CHUNK, bootstrap_gaps

    g, size = n.shape
    per_row = replicates * size
    if per_row > _BOOTSTRAP_CHUNK:  # one row is already more than a chunk: bootstrap_gaps cuts it
        for i in range(g):
            out[i] = bootstrap_gaps(n[i], s[i], replicates, rng)
        return
    l = s / np.maximum(n, 1.0)
    step = max(1, _BOOTSTRAP_CHUNK // per_row)
    for lo in range(0, g, step):
        hi = min(g, lo + step)
        idx = rng.integers(0, size, size=(hi - lo, replicates, size))
        ss = np.take_along_axis(s[lo:hi, None, :], idx, axis=2).sum(axis=2)
        nn = np.take_along_axis(n[lo:hi, None, :], idx, axis=2).sum(axis=2)
        out[lo:hi] = ss / np.maximum(nn, 1.0) - np.take_along_axis(l[lo:hi, None, :], idx, axis=2).mean(axis=2)


def quantile_rows(reps: np.ndarray, ci: float) -> tuple[np.ndarray, np.ndarray]:
    """The percentile interval (``(1 − ci)/2``, ``1 − (1 − ci)/2``) of every row of ``reps``, a few thousand rows
    at a time (``numpy.quantile`` copies what it sorts)."""
    lo, hi = np.empty(reps.shape[0]), np.empty(reps.shape[0])
    for a in range(0, reps.shape[0], 4096):
        q = np.quantile(reps[a : a + 4096], [(1.0 - ci) / 2.0, 1.0 - (1.0 - ci) / 2.0], axis=1)
        lo[a : a + 4096], hi[a : a + 4096] = q[0], q[1]
    return lo, hi


def step_blocks(samples: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> list[list[int]]:
    """The steps in order, cut into blocks of consecutive steps with one number of samples and at most
    2**20 samples (8 MiB per stacked array)."""
    out: list[list[int]] = []
    size = -1
    for step in sorted(samples):
        n = int(np.asarray(samples[step][1]).size)
        if n != size or (len(out[-1]) + 1) * n > 1 << 20:
            out.append([])
            size = n
        out[-1].append(step)
    return out


def value_at(values: np.ndarray | None, i: int) -> float | None:
    """``float(values[i])``, or ``None`` for a value not computed."""
    return None if values is None else float(values[i])
