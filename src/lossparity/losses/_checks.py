"""Argument checks shared by the public functions of :mod:`lossparity.losses` (docs/semantics.md §7).

Every check names the argument, what was expected and what was given, and raises ``TypeError`` for a
wrong kind of object (a list where a tensor is expected, ``2.5`` where an int is) and ``ValueError`` for a
wrong value or shape. They only look at Python values and at tensor metadata (type, dtype, shape, device),
never at tensor values: no host synchronization, so they may run in a per-microbatch hot path. Checks of
tensor values (a 0/1 mask, labels in range) live with the functions that need them and say so.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch
from torch import Tensor

__all__ = [
    "check_tensor",
    "check_float_tensor",
    "check_int_tensor",
    "check_same_shape",
    "check_int",
    "check_real",
    "describe",
]


def describe(x: object) -> str:
    """What ``x`` is, for a message: ``tensor of dtype torch.int64 and shape (2, 5)``, ``list``, ``2.5``."""
    if isinstance(x, Tensor):
        return f"a tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    if isinstance(x, (bool, int, float, str)) or x is None:
        return repr(x)
    return type(x).__name__


def check_tensor(
    name: str, x: object, *, dims: tuple[int, ...] | None = None, shape_text: str = "", kind: str = ""
) -> Tensor:
    """``x`` when it is a ``torch.Tensor`` (with ``x.dim()`` in ``dims`` when given), else ``TypeError``
    (not a tensor) or ``ValueError`` (wrong number of dimensions; ``shape_text`` says which, e.g. ``[b, S]``).
    ``kind`` (``"floating-point"``) completes the message about a non-tensor."""
    if not isinstance(x, Tensor):
        what = f"{kind} torch.Tensor" if kind else "a torch.Tensor"
        if kind:
            what = ("an " if kind[0] in "aeiou" else "a ") + what
        raise TypeError(f"{name} must be {what}{f' {shape_text}' if shape_text else ''}, got {describe(x)}")
    if dims is not None and x.dim() not in dims:
        want = shape_text or " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")
    return x


def check_float_tensor(name: str, x: object, **kwargs: object) -> Tensor:
    """:func:`check_tensor`, and a floating-point dtype (else ``TypeError``)."""
    x = check_tensor(name, x, kind="floating-point", **kwargs)  # type: ignore[arg-type]
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_int_tensor(name: str, x: object, **kwargs: object) -> Tensor:
    """:func:`check_tensor`, and an integer dtype (not bool, floating point or complex; else ``TypeError``)."""
    x = check_tensor(name, x, kind="integer", **kwargs)  # type: ignore[arg-type]
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x


def check_same_shape(name: str, x: Tensor, other_name: str, other: Tensor) -> None:
    """``ValueError`` unless ``x`` has the shape of ``other``."""
    if x.shape != other.shape:
        raise ValueError(f"{name} must have the shape of {other_name} {tuple(other.shape)}, got shape {tuple(x.shape)}")


def check_int(name: str, value: object, *, minimum: int | None = None, optional: bool = False) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool; ``None`` too when ``optional``); ``ValueError``
    when it is below ``minimum``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, Integral):
        kind = "an int" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {kind}, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")


def check_real(name: str, value: object, *, minimum: float | None = None, positive: bool = False) -> None:
    """``TypeError`` unless ``value`` is a real Python number (not a bool, not a tensor: reading a tensor's
    value would synchronize); ``ValueError`` unless it is finite, ``>= minimum`` and (``positive``) ``> 0``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {describe(value)}")
    v = float(value)
    if not math.isfinite(v) or (minimum is not None and v < minimum) or (positive and v <= 0):
        bound = " > 0" if positive else (f" >= {minimum:g}" if minimum is not None else "")
        raise ValueError(f"{name} must be a finite number{bound}, got {value}")
