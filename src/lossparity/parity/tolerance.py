"""Tolerances of a parity comparison: a point passes when ``|c - r| <= abs + rel·|r|`` (``r`` reference,
``c`` candidate), with per-metric defaults (:data:`DEFAULT_TOLERANCES`), user overrides parsed from
``"lm_loss=1e-3,mtp_*_loss=rel:1e-3,grad_norm=abs:0.01,*=rel:5e-3"`` and Megatron-LM's allowed-failures
rule. Used by :mod:`.compare` and the live :mod:`.guard` alike."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["DEFAULT_TOLERANCES", "Tolerance", "megatron_allowed_failures", "parse_tolerances", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """Pass band of one metric: ``|c - r| <= abs + rel·|r|``."""

    rel: float = 0.0
    abs: float = 0.0

    def __post_init__(self) -> None:
        for name, v in (("rel", self.rel), ("abs", self.abs)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"tolerance: {name} must be a finite number >= 0, got {v}")

    def bound(self, ref: np.ndarray) -> np.ndarray:
        """Allowed ``|c - r|`` at each reference value: ``abs + rel·|r|``."""
        return self.abs + self.rel * np.abs(ref)

    def __str__(self) -> str:
        parts = [f"rel {self.rel:.3g}"] if self.rel else []
        parts += [f"abs {self.abs:.3g}"] if self.abs or not self.rel else []
        return " + ".join(parts)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "lm_loss": Tolerance(rel=2e-4),
    "objective": Tolerance(rel=2e-4),
    "mtp_*_loss": Tolerance(rel=2e-3),
    "load_balancing_loss": Tolerance(rel=2e-3),
    "seq_load_balancing_loss": Tolerance(rel=2e-3),
    "global_load_balancing_loss": Tolerance(rel=2e-3),
    "z_loss": Tolerance(rel=2e-3),
    "grad_norm": Tolerance(rel=1e-2),
    "lr": Tolerance(rel=1e-5),
    "tokens": Tolerance(abs=0.5),
    "*": Tolerance(rel=1e-3),
}


def _parse_one_tolerance(text: str, key: str) -> Tolerance:
    rel = abs_ = 0.0
    seen: set[str] = set()
    for part in text.split("+"):
        kind, sep, num = part.strip().partition(":")
        if not sep:
            kind, num = "rel", kind
        kind = kind.strip().lower()
        if kind not in ("rel", "abs") or kind in seen:
            raise ValueError(f"tolerances: {key}={text!r}: expected 'x', 'rel:x', 'abs:x' or 'rel:x+abs:y'")
        seen.add(kind)
        try:
            value = float(num)
        except ValueError:
            raise ValueError(f"tolerances: {key}={text!r}: {num.strip()!r} is not a number") from None
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"tolerances: {key}={text!r}: tolerance must be finite and >= 0")
        rel, abs_ = (value, abs_) if kind == "rel" else (rel, value)
    return Tolerance(rel=rel, abs=abs_)


def parse_tolerances(spec: str) -> dict[str, Tolerance]:
    """Parse ``"lm_loss=1e-3,mtp_1_loss=rel:1e-3,grad_norm=abs:0.01"`` into ``{metric: Tolerance}``.

    Each comma-separated entry is ``name=value`` where ``value`` is ``x`` (relative), ``rel:x``,
    ``abs:x`` or ``rel:x+abs:y``; ``name`` may be a shell-style pattern (``mtp_*_loss``) or ``*``.
    Raises ``ValueError`` naming ``tolerances`` and the bad entry.
    """
    out: dict[str, Tolerance] = {}
    for entry in spec.split(","):
        if not entry.strip():
            continue
        key, sep, text = entry.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise ValueError(f"tolerances: entry {entry.strip()!r} is not of the form 'metric=tolerance'")
        if key in out:
            raise ValueError(f"tolerances: metric {key!r} is given twice")
        out[key] = _parse_one_tolerance(text, key)
    return out


def _normalize_tolerances(
    tolerances: Mapping[str, Tolerance | float | str] | str | None,
) -> dict[str, Tolerance]:
    if tolerances is None:
        return {}
    if isinstance(tolerances, str):
        return parse_tolerances(tolerances)
    out: dict[str, Tolerance] = {}
    for key, tol in tolerances.items():
        if isinstance(tol, Tolerance):
            out[key] = tol
        elif isinstance(tol, str):
            out[key] = _parse_one_tolerance(tol, key)
        elif isinstance(tol, (int, float)) and not isinstance(tol, bool):
            out[key] = Tolerance(rel=float(tol))
        else:
            raise ValueError(f"tolerances: {key}: expected a Tolerance, a number or a string, got {tol!r}")
    return out


def _lookup(metric: str, table: Mapping[str, Tolerance]) -> Tolerance | None:
    if metric in table:
        return table[metric]
    for pattern, tol in table.items():
        if pattern != "*" and fnmatch.fnmatchcase(metric, pattern):
            return tol
    return None


def tolerance_for(metric: str, overrides: Mapping[str, Tolerance] | None = None) -> Tolerance:
    """Tolerance of ``metric``: the overrides' exact name, then their patterns, then their ``*``;
    then the same lookups in :data:`DEFAULT_TOLERANCES` (whose ``*`` is rel 1e-3)."""
    user = overrides or {}
    tol = _lookup(metric, user) or user.get("*") or _lookup(metric, DEFAULT_TOLERANCES)
    return tol if tol is not None else DEFAULT_TOLERANCES["*"]


def megatron_allowed_failures(n: int) -> int:
    """Failing points Megatron-LM's functional tests tolerate among ``n`` compared steps.

    ``min(max(n // 100, 1), 50)`` for ``n > 1`` and 0 for ``n <= 1`` (Megatron-LM
    ``tests/functional_tests/python_test_utils/common.py``: a single step must match; it passes when
    ``mean(is_close) >= 1 - allowed / n``, i.e. ``failures <= allowed``).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return 0 if n <= 1 else min(max(n // 100, 1), 50)
