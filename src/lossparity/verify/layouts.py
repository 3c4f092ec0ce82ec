"""The layouts ``lossparity verify`` runs, and their names: ``D2xC2xT2+SPxK2`` and the rest of
:data:`LAYOUT_GRAMMAR`, parsed into a :class:`Layout` and checked against the trainer's rules before any
process starts. The default, quick and full sets of ``lossparity verify`` are here too.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ..training.config import TrainConfig

__all__ = [
    "Layout",
    "DEFAULT_LAYOUTS",
    "QUICK_LAYOUTS",
    "FULL_LAYOUTS",
    "LAYOUT_GRAMMAR",
    "parse_layout",
    "parse_layouts",
    "check_layout",
]

LAYOUT_GRAMMAR = "[DnX][CnX][Tn[+SP]X][Pn[xVn]X][EnX][Kn][+recompute][+fsdp]"


@dataclass(frozen=True)
class Layout:
    """A parallel layout of the same global batch: ``D`` data-parallel × ``C`` context-parallel × ``T``
    tensor-parallel (``sp``: sequence parallel) × ``P`` pipeline (``V`` virtual chunks each) ranks,
    ``E`` expert-parallel ranks carved out of ``D × C``, ``K`` microbatches per rank."""

    name: str
    dp: int
    ga: int
    recompute: bool = False
    cp: int = 1
    indexer: bool = True
    pp: int = 1
    pp_virtual: int = 1
    engine: str = "ddp"
    tp: int = 1
    sp: bool = False
    ep: int = 1

    @property
    def world(self) -> int:
        """Number of ranks ``D·C·T·P``."""
        return self.dp * self.cp * self.tp * self.pp


# One grammar token per dimension, in the order of the grammar; "x" separates them.
_TOKEN = re.compile(
    r"^(?:D(?P<dp>\d+)|C(?P<cp>\d+)|T(?P<tp>\d+)(?P<sp>\+SP)?|P(?P<pp>\d+)|V(?P<v>\d+)|"
    r"E(?P<ep>\d+)|K(?P<ga>\d+))$"
)
_ORDER = ("dp", "cp", "tp", "pp", "v", "ep", "ga")


def parse_layout(name: str) -> Layout:
    """The :class:`Layout` named by ``name`` in the grammar :data:`LAYOUT_GRAMMAR` (``x`` separates the
    dimensions; each appears at most once, in the grammar's order or any other; ``Vn`` only right after
    ``Pn``; omitted sizes are 1, except an omitted ``K`` under ``Pn``, which is ``n`` (a pipeline needs
    at least ``P`` microbatches)), plus the legacy names ``1x1`` and ``K=n``. Raises ``ValueError``
    naming the layout and the grammar for anything else, and for layouts the trainer cannot run (see
    :func:`check_layout`)."""
    if name == "1x1" or re.fullmatch(r"K=\d+", name):
        layout = Layout(name, 1, 1 if name == "1x1" else int(name[2:]))
        check_layout(layout)
        return layout
    body, flags = name, set()
    while True:
        m = re.search(r"\+(recompute|fsdp)$", body)
        if not m:
            break
        if m.group(1) in flags:
            raise ValueError(f"layout {name!r}: +{m.group(1)} given twice")
        flags.add(m.group(1))
        body = body[: m.start()]
    sizes: dict[str, int] = {}
    sp = False
    prev = None
    for part in body.split("x") if body else []:
        m = _TOKEN.match(part)
        key = next((k for k in _ORDER if m and m.group(k)), None)
        if m is None or key is None or key in sizes or (key == "v" and prev != "pp") or int(m.group(key)) < 1:
            raise ValueError(
                f"layout {name!r}: cannot read {part!r}; layouts are named {LAYOUT_GRAMMAR} "
                "(each dimension at most once, Vn right after Pn), e.g. D2xC2xT2+SPxK2"
            )
        sizes[key] = int(m.group(key))
        sp = sp or bool(m.group("sp"))
        prev = key
    if not sizes:
        raise ValueError(f"layout {name!r}: empty; layouts are named {LAYOUT_GRAMMAR}")
    # A pipeline needs at least P microbatches in flight: an omitted K is P there, 1 elsewhere.
    ga = sizes.get("ga", sizes.get("pp", 1))
    layout = Layout(
        name,
        sizes.get("dp", 1),
        ga,
        recompute="recompute" in flags,
        cp=sizes.get("cp", 1),
        pp=sizes.get("pp", 1),
        pp_virtual=sizes.get("v", 1),
        engine="fsdp" if "fsdp" in flags else "ddp",
        tp=sizes.get("tp", 1),
        sp=sp,
        ep=sizes.get("ep", 1),
    )
    if not _indexer_supported(layout):
        layout = dataclasses.replace(layout, indexer=False)
    check_layout(layout)
    return layout


def _indexer_supported(layout: Layout) -> bool:
    """Layouts whose runs keep the indexer head on (the others are compared with a no-indexer 1x1)."""
    return True


def check_layout(layout: Layout, global_batch: int = 8, seq_len: int = 32) -> None:
    """Raise ``ValueError`` (naming the layout) when the trainer cannot run ``layout`` on the verify
    batch: the layout's own consistency (:class:`ParallelDims`) and the trainer's rules for it."""
    base = TrainConfig(global_batch=global_batch, seq_len=seq_len, steps=1)
    cfg = dataclasses.replace(base, **_layout_fields(layout))
    try:
        cfg.validate()
    except ValueError as e:
        raise ValueError(f"layout {layout.name!r} cannot run: {e}") from None


def parse_layouts(names: str) -> tuple[Layout, ...]:
    """Comma-separated layout names (:func:`parse_layout`), duplicates removed, order kept."""
    out = []
    for n in dict.fromkeys(x.strip() for x in names.split(",") if x.strip()):
        out.append(parse_layout(n))
    if not out:
        raise ValueError("--layouts: give at least one layout name")
    return tuple(out)


def _layout_fields(layout: Layout) -> dict[str, Any]:
    return {
        "dp": layout.dp,
        "cp": layout.cp,
        "ga": layout.ga,
        "pp": layout.pp,
        "pp_virtual": layout.pp_virtual,
        "recompute": layout.recompute,
        "engine": layout.engine,
        "tp": layout.tp,
        "sp": layout.sp,
        "ep": layout.ep,
    }


def _L(name: str) -> Layout:  # noqa: N802 - short constructor for the tables below
    return parse_layout(name)


# The default set keeps `./dev.sh main` within its time budget: the 2-D rows that a composed row
# contains (T2xK2 in T2xC2/T2xP2, plain 1F1B P2xK2 in C2xP2/T2xP2) run in --full only.
DEFAULT_LAYOUTS = tuple(
    _L(n)
    for n in (
        "1x1",
        "K=4",
        "D2xK2",
        "D4",
        "D2xK2+recompute",
        "D2xK2+fsdp",
        "C2xK2",
        "D2xC2+recompute",
        "T2+SPxK2",
        "P2xV2xK2",
        "D2xP2xK2+recompute",
        "T2xC2",
        "T2+SPxC2",
        "C2xP2",
        "T2xP2",
        "D2xC2xT2+SP",
        "D2xE2xK2",
    )
)
QUICK_LAYOUTS = tuple(_L(n) for n in ("1x1", "K=4", "D2xK2+recompute", "C2xK2", "P2xV2xK2", "T2+SPxC2"))
FULL_LAYOUTS = DEFAULT_LAYOUTS + tuple(
    _L(n) for n in ("T2xK2", "P2xK2", "D2xT2xP2xV2", "C2xT2+SPxP2", "D4xE2+recompute", "D2xE2xP2", "D2xT2xE2")
)
