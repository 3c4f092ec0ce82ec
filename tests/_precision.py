"""Tolerances derived from the documented precision of float32 sums (docs/semantics.md §2, "Precision").

A float32 sum of ``n`` non-negative terms, added in any order (any tree of additions: sequential, pairwise,
vectorized lanes of any width, threads), is within ``(n-1)·u`` of the exact sum relative to it, to first
order, with ``u = 2**-24`` the float32 unit roundoff (Higham, *Accuracy and Stability of Numerical
Algorithms*, §4.2: each of the ``n-1`` additions rounds once and every partial sum is at most the total).
Two such sums of the same terms in two orders (another CPU's kernels, another thread count, the per-sample
sums of ``lm_loss`` against the masked total of the ``per_token`` objective) therefore differ by at most
``2(n-1)·u`` relative; :func:`float32_sums_rtol` rounds that up to ``2n·u`` to cover the second order.
"""

from __future__ import annotations

FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def float32_sums_rtol(n: int | float) -> float:
    """Relative tolerance between two float32 sums of the same ``n`` non-negative terms: ``2n·2**-24``."""
    return 2.0 * max(float(n), 1.0) * FLOAT32_UNIT_ROUNDOFF
