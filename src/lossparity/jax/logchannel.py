"""Log-channel estimators in JAX (semantics §2).

The log channel keeps its own estimators whatever the objective's mode. Inside a traced step a value
cannot be ``None``, so "reported as missing" is a ``(value, valid)`` pair: ``valid`` is false when the
denominator is 0, and ``value`` is then 0 (never NaN), so that it can be summed or averaged safely and
the host drops it when it writes the log.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .stats import _as_2d, check_inputs

__all__ = ["ratio_or_missing", "lm_loss"]


def ratio_or_missing(num: jax.Array, den: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(num / den, True)``, or ``(0, False)`` (missing) when ``den == 0``; never NaN from an empty count.
    The value has the dtype of ``num`` (at least float32)."""
    num = jnp.asarray(num)
    if not jnp.issubdtype(num.dtype, jnp.floating):
        num = num.astype(jnp.float32)
    den = jnp.asarray(den)
    valid = den != 0
    value = num / jnp.where(valid, den, jnp.ones_like(den)).astype(num.dtype)
    return jnp.where(valid, value, jnp.zeros_like(value)), valid


def lm_loss(per_token_loss: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The logged language-model loss of semantics §2: the global token mean ``S / Ntok`` over the whole
    ``[N, S]`` batch, whatever the objective's mode, as ``(value, valid)`` (missing when ``Ntok = 0``)."""
    check_inputs(per_token_loss, mask, check_finite=False)
    loss, w = _as_2d(per_token_loss), _as_2d(mask).astype(per_token_loss.dtype)
    return ratio_or_missing(jnp.sum(jnp.where(w > 0, loss, jnp.zeros_like(loss))), jnp.sum(w))
