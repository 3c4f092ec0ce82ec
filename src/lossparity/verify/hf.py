"""``lossparity verify --hf MODEL`` / ``--model pkg.module:build``: layout invariance of the user's own model.

The model (a Hugging Face causal LM from its configuration, or any module from ``build(seed, dtype)``) is
trained for a few SGD steps on a synthetic corpus (8 rows of unequal length per step, padding, or packed
documents with restarting ``position_ids``) under each layout, and every mode's objective, logged metrics,
gradient norm and updated parameters are compared with the single-process run. Every mode goes through
the :class:`~lossparity.Accountant`, computed in float64 from the model's logits (causal shift,
``-100`` ignored); an MoE model's load-balancing term (transformers' ``load_balancing_loss_func``, float64
from the router logits) in the scope ``aux_scope`` (docs/semantics.md §5): ``hf`` (each microbatch's term
added in full, as ``transformers.Trainer`` does), ``microbatch`` (weighted ``1/(D·K)``) or
``global_lagged`` (the global batch's term with the previous step's expert fractions).

Layouts: ``K`` (accumulation), ``D`` (DDP), ``+fsdp`` (FSDP2 per decoder layer, then the model), ``T`` (the
model's own tensor-parallel plan), ``+recompute`` (gradient checkpointing) and their compositions without
``D×T``; ``C``, ``P``, ``E`` and ``+SP`` are refused (:func:`check_hf_layout`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
import traceback
from typing import Any

import torch

from ..losses.modes import MODES
from .hf_compare import compare_runs
from .hf_run import BUFFERS, _dtype, _quiet_transformers, _run_mode, probe_model, synthetic_batch
from .hf_spec import (
    _B_DEPENDENT_SCOPES,
    FLOOR,
    FLOOR_FACTOR,
    FLOOR_MAX,
    HF_AUX_SCOPES,
    REPEAT,
    LayoutUnsupported,
    ModelSpec,
    check_hf_layout,
    parse_hf_layouts,
)
from .layouts import Layout

__all__ = [
    "HF_AUX_SCOPES",
    "LayoutUnsupported",
    "ModelSpec",
    "check_hf_layout",
    "parse_hf_layouts",
    "probe_model",
    "run_verify_hf",
    "run_verify_hf_many",
    "synthetic_batch",
]


def _run_jobs(
    rank: int, world: int, specs: list[ModelSpec], jobs: list[tuple[int, Layout]], modes: list[str], steps: int
) -> Any:
    """Every mode of every job ``(model index, layout)`` (all of ``world`` ranks) in one set of processes:
    ``{(index, layout name): ({mode: record}, wall seconds)}`` on rank 0 (records hold full tensors); on one
    rank, a job that raises has its error line instead of the records."""
    torch.set_num_threads(1)
    out: dict[tuple[int, str], tuple[Any, float]] = {}
    for i, layout in jobs:
        t = time.perf_counter()
        try:
            runs: Any = {mode: _run_mode(rank, specs[i], layout, mode, steps) for mode in modes}
        except Exception as e:
            if world > 1:  # peers may wait in a collective: the launcher stops them and names this rank
                raise
            where = raised_in(traceback.format_exc())
            runs = f"{type(e).__name__}{where}: " + " ".join(str(e).split())[:300]  # this layout's row: ERROR
        out[(i, layout.name)] = (runs, time.perf_counter() - t)
    return out if rank == 0 else None


# ------------------------------------------------------------------ the report
def _reference(layout: Layout, mode: str, spec: ModelSpec) -> Layout:
    """The single-process run of the same microbatch size where the quantity depends on it, else 1x1."""
    if mode == "per_microbatch" or (spec.moe is not None and spec.aux_scope in _B_DEPENDENT_SCOPES):
        k = layout.dp * layout.ga
        return Layout("1x1" if k == 1 else f"K={k}", 1, k)
    return Layout("1x1", 1, 1)


def run_verify_hf(
    spec: ModelSpec,
    layouts: tuple[Layout, ...],
    modes: tuple[str, ...] = ("per_token", "per_sample", "per_document"),
    *,
    steps: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every (layout, mode) and compare each with its reference; the report of :func:`format_hf_table`:
    ``{"rows": [{layout, mode, reference, diffs, pass, first}], "tolerance", "steps", "wall_s", ...}``."""
    return run_verify_hf_many([spec], layouts, modes, steps=steps, progress=progress)[0]


def run_verify_hf_many(
    specs: list[ModelSpec],
    layouts: tuple[Layout, ...],
    modes: tuple[str, ...] = ("per_token", "per_sample", "per_document"),
    *,
    steps: int = 2,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """:func:`run_verify_hf` of several models, sharing one set of processes per world size (the start of
    the processes dominates the wall time of small models); one report per model."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--modes: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    for spec in specs:
        for layout in layouts:
            check_hf_layout(layout, spec)
    t0 = time.perf_counter()
    results: dict[tuple[int, str], Any] = {}
    walls: dict[tuple[int, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        specs = [_with_tp_dir(spec, layouts, os.path.join(tmp, str(i))) for i, spec in enumerate(specs)]
        # Every run needed (the layouts and their references), one set of processes per world size.
        needed: dict[tuple[int, str], Layout] = {}
        for i, spec in enumerate(specs):
            needed[(i, FLOOR)] = Layout(FLOOR, 1, 1)
            needed[(i, "1x1")] = Layout("1x1", 1, 1)  # the floor's reference
            for lay in layouts:
                needed[(i, lay.name)] = lay
                for mode in modes:
                    ref = _reference(lay, mode, spec)
                    needed.setdefault((i, ref.name), ref)
        note = "({n} modes, {w} process(es))".format
        for key, (record, w) in _run_needed(needed, specs, modes, steps, progress, note).items():
            results[key], walls[key] = record, w
        reports = [_report(i, spec, layouts, modes, steps, results, walls, 0.0) for i, spec in enumerate(specs)]
        _second_opinion(specs, layouts, reports, modes, steps, progress)
        _unusable_floor(specs, reports, results, modes, steps, progress)
    wall = time.perf_counter() - t0
    for report in reports:
        report["wall_s"] = wall
        for row in report["rows"]:
            row.pop("_floor", None)
    return reports


def _second_opinion(
    specs: list[ModelSpec],
    layouts: tuple[Layout, ...],
    reports: list[dict[str, Any]],
    modes: tuple[str, ...],
    steps: int,
    progress: bool,
) -> None:
    """A FAIL of a model that computes in float32 (a float32 floor measured, float32 parameters, module
    outputs, casts or operators found) is run again, the layout and its reference, with that computation done
    in float64 (:class:`KeepFloat64`): when
    the difference then vanishes (within the same tolerance and float32 floor), it was the model's float32
    rounding and the row PASSes, saying so (``float64_check``); else the FAIL stands with the second
    opinion's difference. A layout bug does not depend on the precision, so it still FAILs."""
    needed: dict[tuple[int, str], Layout] = {}
    for i, report in enumerate(reports):
        kinds = ("floor", "float32_params", "float32_modules", "float32_casts", "float32_ops")
        if not any(report[k] for k in kinds):
            continue
        for row in report["rows"]:
            if not row["pass"] and "error" not in row:
                lay = next(x for x in layouts if x.name == row["layout"])
                needed[(i, lay.name)] = lay
                ref = _reference(lay, row["mode"], specs[i])
                needed[(i, ref.name)] = ref
    if not needed:
        return
    kept = [dataclasses.replace(spec, keep_float64=True) for spec in specs]
    note = "again, the model's float32 computation in float64 (FAIL rows)".format
    results = {key: record for key, (record, _) in _run_needed(needed, kept, modes, steps, progress, note).items()}
    for i, report in enumerate(reports):
        for row in report["rows"]:
            again, again_ref = results.get((i, row["layout"])), results.get((i, row["reference"]))
            if row["pass"] or "error" in row or not isinstance(again, dict) or not isinstance(again_ref, dict):
                continue
            tol = report["tolerance"]
            check = compare_runs(again[row["mode"]], again_ref[row["mode"]], tol, floor=row["_floor"])
            worst = max(v for k, v in check["diffs"].items() if k != "grads_abs")
            if check["pass"]:
                row.update({"pass": True, "float64_check": worst, "float32_first": row["first"], "first": None})
            else:
                row["float64_check_failed"] = f"{worst:.1e} ({check['first']})"


def _unusable_floor(
    specs: list[ModelSpec],
    reports: list[dict[str, Any]],
    results: dict[tuple[int, str], Any],
    modes: tuple[str, ...],
    steps: int,
    progress: bool,
) -> None:
    """A model whose floor (the 1x1 run against the same run with its rows reversed and its float64
    parameters scaled by ``1 + 2^-50``) exceeds ``FLOOR_MAX`` gives no floor to judge a layout by: each row
    still failing after the second opinion is an ERROR (exit 2), diagnosed by running the 1x1 run once more,
    unchanged but for the random generator's seed. When that repeat differs from the first, the model draws
    random numbers in training mode
    (sampling routers, dropout); when it equals it bit for bit, the model is deterministic and a float64-level
    change of summation order moves it by more than float32 rounding explains (a routing decision flipping,
    or a float32 result cancelling), so that no layout can be judged at this precision."""
    needed = {(i, REPEAT): Layout(REPEAT, 1, 1) for i, report in enumerate(reports) if report["_floor_over"]}
    needed = {key: lay for key, lay in needed.items() if any(not r["pass"] for r in reports[key[0]]["rows"])}
    again = {}
    if needed:
        note = f"again, unchanged (the summation-order floor is above {FLOOR_MAX:.0e})".format
        again = {key: record for key, (record, _) in _run_needed(needed, specs, modes, steps, progress, note).items()}
    for i, report in enumerate(reports):
        worst = report.pop("_floor_over")
        repeat, base = again.get((i, REPEAT)), results.get((i, "1x1"))
        if worst is None or not isinstance(repeat, dict) or not isinstance(base, dict):
            continue
        tol = report["tolerance"]
        diffs = [compare_runs(repeat[m], base[m], tol)["diffs"] for m in modes]
        differ = max(v for d in diffs for k, v in d.items() if k != "grads_abs")
        if differ > 0.0:
            why = (
                f"the model is not deterministic in training mode: the same 1x1 run twice differs by {differ:.1e} "
                f"(random draws: sampling routers, dropout)"
            )
        else:
            why = (
                f"the model repeats its 1x1 run bit for bit, but reversing the rows' summation order (and scaling "
                f"its float64 parameters by 1 + 2^-50) moves it by {worst:.1e}, more than float32 rounding "
                f"explains (a routing decision flipping, or a float32 result cancelling): no layout can be judged "
                f"at this precision"
            )
        for row in report["rows"]:
            if not row["pass"] and "error" not in row:
                row["error"] = f"{why}; first difference {row['first']}"


def _run_needed(
    needed: dict[tuple[int, str], Layout],
    specs: list[ModelSpec],
    modes: tuple[str, ...],
    steps: int,
    progress: bool,
    note: Any,
) -> dict[tuple[int, str], tuple[Any, float]]:
    """Every needed run ``(model index, layout name) -> layout``, one set of processes per world size
    (:func:`_run_world`); with ``progress``, one line per set: the layouts and ``note(n=modes, w=world)``."""
    out: dict[tuple[int, str], tuple[Any, float]] = {}
    for world in sorted({lay.dp * lay.tp for lay in needed.values()}):
        jobs = [(i, lay) for (i, _), lay in needed.items() if lay.dp * lay.tp == world]
        if progress:
            names = ", ".join(dict.fromkeys(lay.name for _, lay in jobs))
            print(f"  running {names} {note(n=len(modes), w=world)}...", flush=True)
        out.update(_run_world(world, jobs, specs, modes, steps))
    return out


def _run_world(
    world: int, jobs: list[tuple[int, Layout]], specs: list[ModelSpec], modes: tuple[str, ...], steps: int
) -> dict[tuple[int, str], tuple[Any, float]]:
    """:func:`_run_jobs` of one world size; a job that raises gives its error as one line (a ``str`` record)
    and the others still run: in-process for 1 rank, else in one set of processes, then, when a rank failed,
    one set per job (so that the failing layout is named and the others keep their rows)."""
    from ..distributed.launch import RankError, spawn

    args = (specs, jobs, list(modes), steps)
    if world == 1:
        return _run_jobs(0, 1, *args)  # type: ignore[no-any-return]
    try:
        return spawn(_run_jobs, world, *args, timeout_s=900)[0]  # type: ignore[no-any-return]
    except RankError as e:
        if len(jobs) > 1:
            out: dict[tuple[int, str], tuple[Any, float]] = {}
            for job in jobs:
                out.update(_run_world(world, [job], specs, modes, steps))
            return out
        first = e.failures[0] if e.failures else None
        where = raised_in(first.traceback) if first else ""
        what = f"rank {first.rank}: {first.kind}{where}: {first.message}" if first else str(e)
        return {(jobs[0][0], jobs[0][1].name): (" ".join(what.split())[:400], 0.0)}


_FRAME_RE = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)


def raised_in(tb: str) -> str:
    """`` (raised in PACKAGE/FILE:LINE)``: where a formatted traceback's error came from when that is an
    installed package (a model's file in transformers, say), so that an ERROR row says whose code raised.
    From the innermost frame outwards, torch's own frames are passed over (the operator that refused the
    model's call); the first other frame is named when it lies in an installed package, else ``""`` (the
    user's or lossparity's code: its message says what it is)."""
    for path, line in reversed(_FRAME_RE.findall(tb)):
        marker = next((m for m in ("site-packages/", "dist-packages/") if m in path), None)
        if marker is None:
            return ""
        where = path.split(marker, 1)[1]
        if not where.startswith("torch/"):
            return f" (raised in {where}:{line})"
    return ""


def _with_tp_dir(spec: ModelSpec, layouts: tuple[Layout, ...], path: str) -> ModelSpec:
    """An HF model run under ``T``: its random initialization saved for ``from_pretrained`` with a TP plan.
    When transformers cannot save it, ``tp_error`` says why and the ``T`` rows are ``ERROR`` with it (the
    other layouts still run)."""
    if not any(lay.tp > 1 for lay in layouts) or spec.hf_config is None:
        return spec
    from .user_models import build_hf_model

    _quiet_transformers()
    model: Any = build_hf_model(spec.hf_config, spec.seed, _dtype(spec))
    try:
        model.save_pretrained(path)
    except Exception as e:  # transformers' own conversion on save: named in the T rows, not a traceback
        what = f"{type(e).__name__}: " + " ".join(str(e).split())[:240]
        return dataclasses.replace(spec, tp_error=f"T: transformers cannot save the model for from_pretrained ({what})")
    # Every buffer too, for _reference_buffers: the T run's model is then the reference model.
    torch.save({n: b.detach().clone() for n, b in model.named_buffers()}, os.path.join(path, BUFFERS))
    return dataclasses.replace(spec, tp_dir=path)


def _report(
    i: int,
    spec: ModelSpec,
    layouts: tuple[Layout, ...],
    modes: tuple[str, ...],
    steps: int,
    results: dict[tuple[int, str], Any],
    walls: dict[tuple[int, str], float],
    wall: float,
) -> dict[str, Any]:
    tol = 1e-10 if spec.dtype == "float64" else 1e-5
    floor_runs, base = results.get((i, FLOOR)), results.get((i, "1x1"))
    float32_params: list[str] = []
    float32_modules: list[str] = []
    float32_ops: list[str] = []
    float32_casts: list[str] = []
    if isinstance(base, dict) and spec.dtype == "float64":
        first = next(iter(base.values()))
        float32_params = [n for n, t in first["params"].items() if t.dtype != torch.float64]
        float32_modules = first.get("float32_modules", [])
        float32_ops = first.get("float32_ops", [])
        float32_casts = first.get("float32_casts", [])
    # Where the model computes in float32 (float32 parameters or module outputs, float64 parameters that
    # reach a float32 operation), a float32 rounding flip is as likely as any other: at least float32's unit
    # roundoff, whatever the perturbed run happened to show.
    least = 2.0**-24 if float32_params or float32_modules or float32_casts else 0.0
    floors: dict[str, dict[str, float]] = {}
    if isinstance(floor_runs, dict) and isinstance(base, dict):
        for mode in modes:
            diffs = compare_runs(floor_runs[mode], base[mode], tol)["diffs"]
            floors[mode] = {k: max(v, least) for k, v in diffs.items() if k != "grads_abs"}
    rows = []
    for layout in layouts:
        for mode in modes:
            ref = _reference(layout, mode, spec)
            if ref.name == layout.name:  # a quantity of this microbatch size: no other layout to compare
                rows.append({"layout": layout.name, "mode": mode, "reference": "itself", "pass": True, "diffs": {}})
                continue
            run, ref_run = results.get((i, layout.name)), results.get((i, ref.name))
            if not isinstance(run, dict) or not isinstance(ref_run, dict):
                error = run if isinstance(run, str) else f"its reference {ref.name}: {ref_run}"
                rows.append({"layout": layout.name, "mode": mode, "reference": ref.name, "pass": False, "diffs": {}})
                rows[-1].update(error=error, first=None)
                continue
            floor = floors.get(mode) if spec.dtype == "float64" else None
            if floor and max(floor.values()) > FLOOR_MAX:
                floor = None
            verdict = compare_runs(run[mode], ref_run[mode], tol, hf_scope=_hf_note(spec, layout), floor=floor)
            rows.append({"layout": layout.name, "mode": mode, "reference": ref.name, **verdict})
            rows[-1]["_floor"] = floor
    worst_floor = max((v for d in floors.values() for v in d.values()), default=0.0)
    return {
        # above FLOOR_MAX: the FAIL rows are judged by _unusable_floor (after the second opinion)
        "_floor_over": worst_floor if worst_floor > FLOOR_MAX else None,
        "rows": rows,
        "floor": worst_floor if tol < worst_floor <= FLOOR_MAX else None,
        "floor_factor": FLOOR_FACTOR,
        "float32_params": float32_params,
        "float32_modules": float32_modules,
        "float32_ops": float32_ops,
        "float32_casts": float32_casts,
        "tolerance": tol,
        "steps": steps,
        "wall_s": wall,
        "layout_wall_s": {name: w for (j, name), w in walls.items() if j == i and name != FLOOR},
        "moe": spec.moe is not None,
    }


def _hf_note(spec: ModelSpec, layout: Layout) -> str | None:
    """Why an ``hf``-scope row differs: the aux term is added once per microbatch (``D·K`` times)."""
    n = layout.dp * layout.ga
    if spec.moe is None or spec.aux_scope != "hf" or n == 1:
        return None
    return f"aux_scope hf adds the aux term once per microbatch: {n} times in this step (D·K = {n}), once in 1x1"
