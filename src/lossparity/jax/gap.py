"""The estimator gap between the per-token and per-sample means in JAX (docs/semantics.md §1).

With per-sample means ``l_i = s_i / max(n_i, 1)`` and counts ``n_i``::

    per_token − per_sample = Σ n_i l_i / Σ n_i − (1/N) Σ l_i = Cov(n, l) / mean(n)

(population covariance over the ``N`` samples; zero-token samples included with ``l_i = 0``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["GapResult", "estimator_gap"]


class GapResult(NamedTuple):
    """Both sides of the gap identity, as scalars: ``gap = per_token − per_sample`` and
    ``cov_term = Cov(n, l) / mean(n)`` with ``cov`` the population covariance, ``mean_count = mean(n)``."""

    per_token: jax.Array
    per_sample: jax.Array
    gap: jax.Array
    cov: jax.Array
    mean_count: jax.Array
    cov_term: jax.Array


def estimator_gap(sample_sums: jax.Array, sample_counts: jax.Array) -> GapResult:
    """Compute ``per_token``, ``per_sample``, their difference and ``Cov(n, l)/mean(n)`` from ``s_i`` and
    ``n_i`` (``[N]`` each, the whole global batch), both sides independently so that their agreement is a
    check. ``jit``-able; computed in the promoted float dtype of the inputs (float64 needs
    ``jax_enable_x64``). With ``Ntok = 0`` the per-token mean and the covariance side are 0."""
    s = jnp.ravel(jnp.asarray(sample_sums))
    n = jnp.ravel(jnp.asarray(sample_counts))
    if s.shape != n.shape:
        raise ValueError(f"sample_sums shape {tuple(s.shape)} != sample_counts shape {tuple(n.shape)}")
    if s.shape[0] == 0:
        raise ValueError("estimator_gap needs at least one sample (sample_sums is empty)")
    dtype = jnp.result_type(s.dtype, n.dtype, jnp.float32)
    s, n = s.astype(dtype), n.astype(dtype)
    l = s / jnp.maximum(n, 1)
    per_token = s.sum() / jnp.maximum(n.sum(), 1)
    per_sample = l.mean()
    mean_n = n.mean()
    cov = ((n - mean_n) * (l - l.mean())).mean()
    cov_term = jnp.where(mean_n > 0, cov / jnp.where(mean_n > 0, mean_n, 1), 0)
    return GapResult(per_token, per_sample, per_token - per_sample, cov, mean_n, cov_term)
