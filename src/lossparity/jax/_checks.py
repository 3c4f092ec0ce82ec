"""Input validation shared by the JAX modules (docs/semantics.md §7).

Where each check runs:

- Shape, dtype and option checks are static: they always raise, also while ``jax.jit`` traces.
- Value checks (mask in {0, 1}, segment ids in range, no loss-bearing token in padding, finite losses at
  loss-bearing tokens, labels in range) need values:

  * eager call (concrete arrays): they raise ``ValueError`` / ``FloatingPointError`` at once;
  * traced inside :func:`checked` (``jax.experimental.checkify``): the same exception with the same
    message (offending value and index) is raised by :func:`throw` after the compiled program ran;
  * traced without :func:`checked`: a program cannot raise, so an invalid mask or segment id makes the
    result NaN (value and gradient), never a plausible number; a NaN loss propagates by itself.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = ["checked", "throw", "checking", "concrete", "loc", "value_check", "poison", "check_positive_int"]

# jax.core.Tracer is the public name today; if it ever moves, the conversion error below still catches tracers.
_TRACER = getattr(jax.core, "Tracer", ())

_STATE = threading.local()


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


def checking() -> bool:
    """True while a function wrapped by :func:`checked` is being traced."""
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def _checking() -> Iterator[None]:
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def checked(fn: Callable[..., Any]) -> Callable[..., tuple[checkify.Error, Any]]:
    """Wrap ``fn`` so that the value checks of ``lossparity.jax`` also run under ``jit``.

    ``checked(fn)(*args)`` returns ``(err, out)`` as ``jax.experimental.checkify.checkify`` does;
    ``lpj.throw(err)`` (outside ``jit``) raises the first failed check as an eager call does (same
    exception type and message); ``err.throw()`` raises it as checkify's ``JaxRuntimeError``.
    Use ``jax.jit(lpj.checked(step))``. The checks are emitted while ``fn`` is traced, and JAX's trace
    cache does not know about it: an inner ``jax.jit``-ed function already traced without checks is
    reused unchecked (invalid input then gives the NaN result, not an error), and one first traced
    under ``checked`` fails when later called outside it (checkify's "not functionalized" error). Wrap
    the outermost function and do not share inner jitted helpers between checked and unchecked steps.
    Under ``checked`` the outputs are not NaN-poisoned: read them only when ``err`` is empty.
    """

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with _checking():
            return fn(*args, **kwargs)

    return checkify.checkify(traced, errors=checkify.user_checks)


# the exception type of every value check, by the text of its message before the first field: lets
# :func:`throw` raise what an eager call raises
_EXCEPTIONS: dict[str, type[Exception]] = {}


def throw(err: checkify.Error) -> None:
    """Raise the first failed check of a :func:`checked` program as the eager call would (``ValueError``,
    ``FloatingPointError``, same message); return ``None`` when every check passed. Host side."""
    message = err.get()
    if message is None:
        return
    message = message.split(" (`check` failed)")[0]
    matches = [prefix for prefix in _EXCEPTIONS if message.startswith(prefix)]
    if not matches:
        err.throw()  # not a lossparity check: checkify's own error
    raise _EXCEPTIONS[max(matches, key=len)](message)


def _index_text(ndim: int) -> str:
    return "[" + ", ".join(["{}"] * ndim) + "]"


def value_check(
    exc: type[Exception],
    message: str,
    bad_fn: Callable[..., Any],
    arrays: tuple[Any, ...],
    *,
    shown: int | None = 0,
    where: str = "",
    index_text: str | None = None,
    index_order: tuple[int, ...] | None = None,
    at: str = " at index ",
) -> jax.Array | None:
    """Check ``bad_fn(xp, *arrays)`` (a boolean map of offending positions, ``xp`` NumPy or ``jax.numpy``).

    ``message`` has one ``{}`` field for the offending value ``arrays[shown]`` (none when ``shown`` is
    None); ``at`` (``" at index "``) and ``"[i, j]"`` of the first offending position and ``where`` are appended
    (``index_text`` with ``{}`` fields filled by the index components in ``index_order`` replaces
    ``"[i, j]"``, e.g. ``"[{}, {}] (microbatch {})"`` with order ``(1, 2, 0)``). Eager: raise ``exc``.
    Under :func:`checked`: a ``checkify.check`` with the same text. Otherwise return a traced boolean
    scalar "some position is bad" for :func:`poison` (``None`` when checked).
    """
    _EXCEPTIONS.setdefault(message.split("{")[0], exc)
    values = [concrete(a) for a in arrays]
    ndim = np.ndim(arrays[0])
    order = index_order or tuple(range(ndim))
    where_text = loc(where).replace("{", "{{").replace("}", "}}")
    text = message + at + (index_text or _index_text(ndim)) + where_text
    present = [v for v in values if v is not None]
    if len(present) == len(values):  # every input concrete: check eagerly
        bad = np.asarray(bad_fn(np, *present))
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            shown_value = () if shown is None else (present[shown][idx],)
            raise exc(text.format(*shown_value, *(idx[i] for i in order)))
        return None
    bad = bad_fn(jnp, *(jnp.asarray(a) for a in arrays))
    if bad.size == 0:
        return None
    if not checking():
        return jnp.any(bad)
    flat = jnp.argmax(bad.ravel())
    traced_idx = jnp.unravel_index(flat, bad.shape)
    shown_value = () if shown is None else (jnp.asarray(arrays[shown]).ravel()[flat],)
    checkify.check(~jnp.any(bad), text, *shown_value, *(traced_idx[i] for i in order))
    return None


def poison(x: jax.Array, *bad: jax.Array | None) -> jax.Array:
    """``x`` times NaN where any traced ``bad`` flag is set, else ``x`` unchanged: the value and the
    gradient of an unchecked traced program with invalid input become NaN (module docstring)."""
    flags = [b for b in bad if b is not None]
    if not flags:
        return x
    any_bad = functools.reduce(jnp.logical_or, flags)
    return x * jnp.where(any_bad, jnp.nan, 1).astype(x.dtype)


def check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int > 0 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
