"""The model of ``lossparity verify --hf`` / ``--model`` and the layouts it can run: :class:`ModelSpec`, the
layout checks (which layouts the model supports, which are skipped with a note) and the model probe. The
runs themselves are :mod:`.hf_run` (one rank, one layout) and :mod:`.hf` (the layouts, the verdict).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from .layouts import Layout, parse_layout

__all__ = ["HF_AUX_SCOPES", "LayoutUnsupported", "ModelSpec", "check_hf_layout", "parse_hf_layouts"]

HF_AUX_SCOPES = ("global_lagged", "microbatch", "hf")
N_ROWS, SEQ, LR = 8, 16, 0.1
_B_DEPENDENT_SCOPES = ("microbatch",)
# The model's own float32 floor: the 1x1 run with the rows of every step in reverse order (the objective,
# the gradients and the update are sums over the rows: only their summation order changes) and its float64
# parameters scaled by 1 + 2^-50 (a change at float64 rounding level, as a different layout's summation
# order makes inside a layer). A float64 model agrees to ~1e-15; one that computes in float32 inside
# (float32 parameters, .float() casts) rounds that change to float32 precision. Each quantity of a layout
# is judged against max(tolerance, FLOOR_FACTOR × its floor).
FLOOR = "1x1 rows reversed"
FLOOR_FACTOR = 10.0
# A floor above this is not float32 rounding (2^-24 ≈ 6e-8 per operation) but a model that does not
# repeat itself (random draws in training mode): it is reported and not used.
FLOOR_MAX = 1e-5
# The 1x1 run once more, its random generator seeded otherwise: run when the floor exceeds FLOOR_MAX, to tell
# random draws (it differs) from a deterministic model that amplifies a change of summation order (it is equal
# bit for bit).
REPEAT = "1x1 repeated"


@dataclass
class ModelSpec:
    """What to build on every rank: ``hf_config`` (a transformers config) or ``build`` (``pkg.module:fn``),
    plus ``parallelize`` (``pkg.module:fn(model, tp_mesh)``) for ``T`` with a ``--model``."""

    name: str
    seed: int = 0
    dtype: str = "float64"
    hf_config: Any = None
    build: str | None = None
    parallelize: str | None = None
    packed: bool = False
    aux_scope: str = "global_lagged"
    vocab: int = 256
    moe: tuple[int, int] | None = None  # (E, k) when the model reports router logits
    aux_coef: float = 0.0
    tp_dir: str | None = field(default=None, repr=False)
    tp_error: str | None = None  # why the model could not be saved for T (its rows are ERROR)
    # The second opinion on a FAIL of a model that computes in float32: its float32 computation done in float64
    keep_float64: bool = False


class LayoutUnsupported(ValueError):
    """A layout that this model does not support (no tensor-parallel plan...): skipped with a note."""


def parse_hf_layouts(names: str, spec: ModelSpec, notes: list[str] | None = None) -> tuple[Layout, ...]:
    """Comma-separated layouts in verify's grammar (``K=n`` may carry ``+recompute``/``+fsdp`` too), each
    checked by :func:`check_hf_layout`; ``ValueError`` naming the first one that cannot run. With ``notes``,
    a layout the model does not support (:class:`LayoutUnsupported`) is left out and its reason appended
    there instead, unless no layout is left."""
    out = []
    for name in dict.fromkeys(x.strip() for x in names.split(",") if x.strip()):
        layout = dataclasses.replace(parse_layout(re.sub(r"^K=(\d+)(?=\+|$)", r"K\1", name)), name=name)
        try:
            check_hf_layout(layout, spec)
        except LayoutUnsupported as e:
            if notes is None:
                raise
            notes.append(f"skipped: {e}")
            continue
        out.append(layout)
    if not out:
        raise ValueError("--layouts: give at least one layout name" + (f" ({notes[-1]})" if notes else ""))
    return tuple(out)


def check_hf_layout(layout: Layout, spec: ModelSpec) -> None:
    """Raise ``ValueError`` (naming the layout) for what verify cannot run on this model, with the reason."""
    why = None
    if layout.cp > 1:
        why = (
            "C: context parallelism needs the flash/efficient SDPA kernels; torch's context_parallel has no "
            "sharding strategy for the CPU attention kernel (and verify --hf does not shard HF attention)"
        )
    elif layout.pp > 1:
        why = "P: transformers' model classes provide no pipeline schedule"
    elif layout.ep > 1:
        why = "E: transformers' model classes provide no expert-parallel plan that verify can run"
    elif layout.sp:
        why = "+SP: transformers' tensor-parallel plans do not wire sequence parallelism"
    elif layout.tp > 1 and layout.dp > 1:
        why = "D×T: transformers builds its own device mesh for its tensor-parallel plan; verify runs T without D"
    elif layout.tp > 1 and spec.hf_config is not None and not _tp_plan(spec.hf_config):
        why = f"T: {type(spec.hf_config).__name__} has no tensor-parallel plan (base_model_tp_plan)"
    elif layout.tp > 1 and spec.build is not None and spec.parallelize is None:
        why = "T: a --model needs --parallelize pkg.module:fn (fn(model, tp_mesh)) to run tensor parallel"
    elif layout.recompute and spec.hf_config is not None and not _supports_recompute(spec.hf_config):
        why = f"+recompute: the {spec.hf_config.model_type} model class does not support activation checkpointing"
    elif layout.engine == "fsdp" and layout.dp < 2:
        why = "+fsdp needs D >= 2"
    elif N_ROWS % (layout.dp * layout.ga):
        why = f"D·K = {layout.dp * layout.ga} does not divide the {N_ROWS} rows of a step"
    if why:
        model_dependent = (layout.tp > 1 and why.startswith("T:")) or why.startswith("+recompute:")
        raise (LayoutUnsupported if model_dependent else ValueError)(f"layout {layout.name!r} cannot run: {why}")


def _supports_recompute(config: Any) -> bool:
    """Whether the family's causal-LM class declares gradient checkpointing support (True when unknown)."""
    from ..integrations.hf_moe import model_class

    cls = model_class(config)
    return bool(getattr(cls, "supports_gradient_checkpointing", True)) if cls is not None else True


def _tp_plan(config: Any) -> bool:
    return bool(getattr(config, "base_model_tp_plan", None))


# ------------------------------------------------------------------ data
