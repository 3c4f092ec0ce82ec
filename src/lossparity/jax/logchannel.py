"""Log-channel estimators in JAX (docs/semantics.md §2).

The log channel keeps its own estimators whatever the objective's mode. A metric that can be missing
(``lm_loss = S / Ntok`` when ``Ntok = 0``) is a :class:`LogValue` ``(value, valid)``: inside a traced step
a value cannot be ``None``, and it must not be NaN either (it may be summed or averaged over steps under
``jit``), so ``value`` holds a placeholder 0 when ``valid`` is false. The placeholder never reaches a
log as a number: a ``LogValue`` is a pair, not a scalar (``float(lv)`` raises), :meth:`LogValue.get`
gives ``None`` when missing, and :func:`host_logs` writes ``None``, as the PyTorch accountant's
``logs()`` reports ``lm_loss = None`` when ``Ntok = 0`` (JSON ``null``; scalar writers skip it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .stats import _masked_sums, prepare

__all__ = ["LogValue", "ratio_or_missing", "lm_loss", "host_logs"]


class LogValue(NamedTuple):
    """A log metric that may be missing: ``value`` is meaningful only where ``valid`` is true (else it is
    a NaN-free placeholder 0). A pytree, so it passes through ``jit`` and ``lax.scan``."""

    value: jax.Array
    valid: jax.Array

    def get(self) -> float | None:
        """Host side (synchronizes): the value as a Python float, or ``None`` when missing."""
        return float(self.value) if bool(self.valid) else None


def ratio_or_missing(num: jax.Array, den: jax.Array) -> LogValue:
    """``LogValue(num / den, True)``, or ``LogValue(0, False)`` (missing) when ``den == 0``; never NaN from
    an empty count. The value has the dtype of ``num`` (at least float32)."""
    num = jnp.asarray(num)
    if not jnp.issubdtype(num.dtype, jnp.floating):
        num = num.astype(jnp.float32)
    den = jnp.asarray(den)
    valid = den != 0
    value = num / jnp.where(valid, den, jnp.ones_like(den)).astype(num.dtype)
    return LogValue(jnp.where(valid, value, jnp.zeros_like(value)), valid)


def lm_loss(per_token_loss: jax.Array, mask: jax.Array) -> LogValue:
    """The logged language-model loss of docs/semantics.md §2: the global token mean ``S / Ntok`` over the
    whole ``[N, S]`` batch, whatever the objective's mode; missing when ``Ntok = 0``. Inputs are
    validated as in ``check_inputs`` (NaN/Inf at a loss-bearing token raises)."""
    loss, bearing, _, _ = prepare(per_token_loss, mask)
    s, n = _masked_sums(loss, bearing)
    return ratio_or_missing(s.sum(), n.sum())


def host_logs(logs: Mapping[str, Any]) -> dict[str, float | int | None]:
    """Turn a step's logs (e.g. ``accumulate_gradients``' third result, after ``jit``) into Python values
    for a logger, the same shape as the PyTorch ``Accountant.logs()``: scalars become ``float`` (``int``
    for integer counts), a :class:`LogValue` becomes its value, or ``None`` when missing (JSON ``null``,
    skipped by scalar writers; never 0 or NaN). Synchronizes; call it once per logged step, outside
    ``jit``."""
    out: dict[str, float | int | None] = {}
    for key, value in logs.items():
        if isinstance(value, LogValue):
            out[key] = value.get()
            continue
        arr = np.asarray(value)
        if arr.shape != ():
            raise ValueError(f"host_logs: log {key!r} is not a scalar (shape {arr.shape})")
        out[key] = int(arr) if np.issubdtype(arr.dtype, np.integer) else float(arr)
    return out
