"""The estimator gap between the per-token and per-sample means (semantics §1).

With per-sample means ``l_i = s_i / max(n_i, 1)`` and counts ``n_i``::

    per_token − per_sample = Σ n_i l_i / Σ n_i − (1/N) Σ l_i = Cov(n, l) / mean(n)

(population covariance over the ``N`` samples). Longer samples with higher mean loss make the
per-token mean larger. The identity is exact, zero-token samples included (they have ``l_i = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_tensor

__all__ = ["GapResult", "estimator_gap"]


@dataclass(frozen=True)
class GapResult:
    """Both sides of the gap identity. ``gap = per_token − per_sample``; ``cov_term = Cov(n,l)/mean(n)``;
    ``cov`` the population covariance and ``mean_count`` = mean(n)."""

    per_token: float
    per_sample: float
    gap: float
    cov: float
    mean_count: float
    cov_term: float


def estimator_gap(sample_sums: Tensor, sample_counts: Tensor) -> GapResult:
    """Compute ``per_token``, ``per_sample``, their difference and ``Cov(n, l)/mean(n)`` in float64.

    ``sample_sums`` (``s_i``) and ``sample_counts`` (``n_i``) are ``[N]`` over the whole global batch.
    Both sides are computed independently (the difference of the two means, and the covariance
    formula), so that their agreement is a check, not a tautology. With ``Ntok = 0`` the per-token
    mean is 0 (semantics §1) and the covariance side is reported as 0 as well.
    """
    check_tensor("sample_sums", sample_sums)
    check_tensor("sample_counts", sample_counts)
    s = sample_sums.detach().to(torch.float64).flatten()
    n = sample_counts.detach().to(torch.float64).flatten()
    if s.shape != n.shape:
        raise ValueError(f"sample_sums shape {tuple(s.shape)} != sample_counts shape {tuple(n.shape)}")
    if s.numel() == 0:
        raise ValueError("estimator_gap needs at least one sample (sample_sums is empty)")
    l = s / n.clamp(min=1)
    per_token = float(s.sum() / n.sum().clamp(min=1))
    per_sample = float(l.mean())
    mean_n = float(n.mean())
    cov = float(((n - n.mean()) * (l - l.mean())).mean())
    cov_term = cov / mean_n if mean_n > 0 else 0.0
    return GapResult(per_token, per_sample, per_token - per_sample, cov, mean_n, cov_term)
