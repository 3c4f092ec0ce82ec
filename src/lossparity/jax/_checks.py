"""Input validation shared by the JAX modules (semantics §7).

Shape and dtype checks are static and always run, also under ``jax.jit``. Value checks (mask in
{0, 1}, finite losses, segment ids in range, labels in range) need concrete values: they run when the
function is called eagerly and are skipped on tracers, because a traced program cannot raise. Call the
public ``check_*`` functions eagerly on a batch before ``jit`` when values must be checked.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["concrete", "loc", "check_mode_name", "check_positive_int"]

# jax.core.Tracer is the public name today; if it ever moves, the conversion error below still catches tracers.
_TRACER = getattr(jax.core, "Tracer", ())


def concrete(x: object) -> np.ndarray | None:
    """``x`` as a NumPy array when its values are known now (eager call), ``None`` under tracing."""
    if isinstance(x, _TRACER):
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def loc(where: str) -> str:
    """The ``" (where)"`` suffix of an error message, or ``""``."""
    return f" ({where})" if where else ""


def check_mode_name(mode: str, modes: tuple[str, ...], what: str = "mode") -> str:
    """Return ``mode`` if it is in ``modes``, else raise ``ValueError`` naming ``what`` and the valid values."""
    if mode not in modes:
        raise ValueError(f"unknown {what} {mode!r}; valid: {', '.join(modes)}")
    return mode


def check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int > 0 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
