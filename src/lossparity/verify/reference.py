"""``lossparity verify``: train the embedded tiny MoE+MTP model under several layouts and prove that the
objective, every logged metric, the gradient norm, the updated parameters and the expert biases are
the same as the single-process ``1×1`` float64 run (semantics §3: max relative difference <= 1e-10).

Quantities that depend on the microbatch size ``b`` by definition (the ``per_microbatch`` mode, the
``microbatch`` aux scope, the Megatron z-loss form) are compared with the single-process run that has
the same ``b`` (``D = 1, K = N/b``), as semantics §3 (1) prescribes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from typing import Any

import torch

from ..options import ACCOUNTANT_MODES, DType
from ..training.trainer import TrainConfig, Trainer
from .layouts import (
    DEFAULT_LAYOUTS,
    FULL_LAYOUTS,
    LAYOUT_GRAMMAR,
    QUICK_LAYOUTS,
    Layout,
    _layout_fields,
    parse_layout,
    parse_layouts,
)

__all__ = [
    "Layout",
    "DEFAULT_LAYOUTS",
    "QUICK_LAYOUTS",
    "FULL_LAYOUTS",
    "LAYOUT_GRAMMAR",
    "parse_layout",
    "parse_layouts",
    "run_verify",
    "format_table",
]

TOL = {"float64": 1e-10, "float32": 1e-5}
VERIFY_GROUP_SIZE = 3  # rows per per_group prompt group in verify's batch of 8 (a last group of 2)
# Not layout-invariant by definition, or not numbers of the run.
_SKIP = {"step", "microbatches", "tokens_per_s", "step_time_s"}


def _record(trainer: Trainer) -> dict[str, Any]:
    """History, parameters and expert biases of a run; under pipeline parallelism only what this rank
    owns (``merge_records`` unites the ranks)."""
    pipe = trainer.pipeline
    named: Iterable[tuple[str, torch.Tensor]] = trainer.raw.named_parameters() if pipe is None else pipe.params.items()
    # FSDP2 parameters are DTensors: compare their full values.
    params = [(n, p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in named]
    owned = {id(r) for m in pipe.stages for r in m.routers()} if pipe is not None else None
    return {
        "history": trainer.history,
        "params": {n: p.detach().clone() for n, p in params},
        "bias": {
            i: r.expert_bias.detach().clone() for i, r in enumerate(trainer.routers) if owned is None or id(r) in owned
        },
    }


def merge_records(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from every rank's (pipeline ranks own different parameters; others hold copies)."""
    out: dict[str, Any] = {}
    for mode in per_rank[0]:
        rec = {"history": per_rank[0][mode]["history"], "params": {}, "bias": {}}
        for r in per_rank:
            rec["params"].update(r[mode]["params"])
            rec["bias"].update(r[mode]["bias"])
        out[mode] = rec
    return out


def _run_modes(rank: int, world: int, base: dict[str, Any], modes: list[str], layout: Layout) -> dict[str, Any]:
    out = {}
    overrides = dict(base.get("model_overrides") or {})
    if not layout.indexer:
        overrides.pop("indexer_layer", None)
    for mode in modes:
        cfg = TrainConfig(**{**base, "mode": mode, **_layout_fields(layout), "model_overrides": overrides})
        t = Trainer(cfg)
        t.fit()
        out[mode] = _record(t)
    return out


def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(b), 1e-300)


def _tensor_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return 0.0 if diff == 0 else diff / max(scale, 1e-300)


def compare_records(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Max relative differences of one run against its reference, grouped as in the verify table:
    ``objective``, ``lm_loss``, ``logs`` (every other logged metric), ``grad_norm``, ``params``, ``bias``."""
    res = {"objective": 0.0, "lm_loss": 0.0, "logs": 0.0, "grad_norm": 0.0, "params": 0.0, "bias": 0.0}
    if len(run["history"]) != len(ref["history"]):
        return {k: float("inf") for k in res}
    for line, ref_line in zip(run["history"], ref["history"]):
        keys = (set(line) | set(ref_line)) - _SKIP
        for k in keys:
            d = _rel(line.get(k), ref_line.get(k))
            group = k if k in ("objective", "lm_loss", "grad_norm") else "logs"
            res[group] = max(res[group], d)
    for name, p in ref["params"].items():
        if name in run["params"]:
            res["params"] = max(res["params"], _tensor_rel(run["params"][name], p))
    if set(run["params"]) != set(ref["params"]) or set(run["bias"]) != set(ref["bias"]):
        res["params"] = float("inf")  # a parameter or bias missing: never silently pass
    for i, b in ref["bias"].items():
        res["bias"] = max(res["bias"], _tensor_rel(run["bias"][i], b))
    return res


def _b_dependent(mode: str, base: dict[str, Any]) -> bool:
    return (
        mode == "per_microbatch"
        or base.get("aux_scope") in ("microbatch", "global_running")
        or base.get("z_form") == "microbatch"
    )


def run_verify(
    layouts: tuple[Layout, ...] = DEFAULT_LAYOUTS,
    modes: tuple[str, ...] = ACCOUNTANT_MODES,
    *,
    steps: int = 3,
    dtype: DType = "float64",
    overrides: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every (layout, mode), compare each with its reference and return a JSON-able report:
    ``{"rows": [{layout, mode, reference, diffs: {...}, pass}], "tolerance", "wall_s", "config"}``."""
    from ..distributed.launch import spawn

    t0 = time.perf_counter()
    base = dataclasses.asdict(
        TrainConfig(
            steps=steps,
            dtype=dtype,
            progress=False,
            tensorboard=False,
            global_batch=8,
            seq_len=32,
            packed=True,
            warmup=1,
            model_overrides={"indexer_layer": 1},
            # per_group's prompt groups: 3 rows each, so that groups span microbatches and data-parallel ranks
            # (rows 0-2 | 3-5 | 6-7 of the 8) at every layout; the other modes ignore it
            group_size=VERIFY_GROUP_SIZE,
        )
    )
    base.update(overrides or {})
    base.pop("mode")
    tol = TOL["float64" if dtype == "float64" else "float32"]
    results: dict[str, dict[str, Any]] = {}
    walls: dict[str, float] = {}

    def run(layout: Layout) -> dict[str, Any]:
        if layout.name not in results:
            if progress:
                print(f"  running layout {layout.name} ({len(modes)} modes)...", flush=True)
            world = layout.world
            t1 = time.perf_counter()
            results[layout.name] = (
                _run_modes(0, 1, base, list(modes), layout)
                if world == 1
                else merge_records(spawn(_run_modes, world, base, list(modes), layout, timeout_s=300))
            )
            walls[layout.name] = time.perf_counter() - t1
        return results[layout.name]

    def reference(layout: Layout, mode: str) -> Layout:
        # The single-process run of the same model (indexer on/off) and, where b matters, the same b.
        N = base["global_batch"]
        ga = N // (layout.dp * layout.ga) if _b_dependent(mode, base) else N
        ga = N // ga
        suffix = "" if layout.indexer else "/no-indexer"
        name = ("1x1" if ga == 1 else f"K={ga}") + suffix
        return Layout(name, 1, ga, indexer=layout.indexer)

    for layout in layouts:
        run(layout)
    rows = []
    for layout in layouts:
        for mode in modes:
            ref_layout = reference(layout, mode)
            diffs = compare_records(run(layout)[mode], run(ref_layout)[mode])
            rows.append(
                {
                    "layout": layout.name,
                    "mode": mode,
                    "reference": ref_layout.name,
                    "diffs": diffs,
                    "pass": all(v <= tol for v in diffs.values()),
                }
            )
    return {
        "rows": rows,
        "tolerance": tol,
        "wall_s": time.perf_counter() - t0,
        "steps": steps,
        "layout_wall_s": walls,
        "config": {k: v for k, v in base.items() if k not in ("out",)},
    }


def format_table(report: dict[str, Any]) -> str:
    """The verify report as a Markdown table (layout × quantity → max relative difference)."""
    cols = ["objective", "lm_loss", "logs", "grad_norm", "params", "bias"]
    lines = ["| layout | mode | vs | " + " | ".join(cols) + " | result |", "|" + "---|" * (len(cols) + 4)]
    for r in report["rows"]:
        cells = " | ".join(f"{r['diffs'][c]:.1e}" for c in cols)
        lines.append(
            f"| {r['layout']} | {r['mode']} | {r['reference']} | {cells} | {'PASS' if r['pass'] else 'FAIL'} |"
        )
    n_pass = sum(r["pass"] for r in report["rows"])
    lines.append(
        f"\n{n_pass}/{len(report['rows'])} PASS (tolerance {report['tolerance']:g} relative, "
        f"{report['steps']} steps each, wall {report['wall_s']:.1f} s)"
    )
    walls = report.get("layout_wall_s") or {}
    if walls:
        lines.append("wall per layout (all modes): " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()))
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    """Write the report as JSON (infinities as strings)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and x != x or x in (float("inf"), float("-inf")):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    with open(path, "w") as f:
        json.dump(clean(report), f, indent=1)
