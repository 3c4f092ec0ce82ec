"""Comparison and table of ``lossparity verify --hf`` / ``--model``: max relative differences of one run against
its reference, and the first quantity that differs (the objective, a logged metric, the gradient norm or the
parameter with the largest difference)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compare_runs", "format_hf_table"]

_LOGGED = ("objective", "lm_loss", "aux_loss", "grad_norm")


def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return 0.0 if a == b else abs(a - b) / max(abs(b), 1e-300)


# A tensor's difference is relative to its own largest entry, or to this fraction of the largest entry of
# every tensor of the same quantity when that is larger (a near-zero gradient tensor: scale of the whole).
REL_FLOOR = 1e-6


def _tensor_rel(a: torch.Tensor, b: torch.Tensor, least: float = 0.0) -> float:
    """``max|a - b| / max(max|b|, least)`` (0 when equal; 0 for an empty tensor)."""
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return 0.0 if diff == 0 else diff / max(float(b.abs().max()), least, 1e-300)


def compare_runs(
    run: dict[str, Any],
    ref: dict[str, Any],
    tol: float,
    *,
    hf_scope: str | None = None,
    floor: dict[str, float] | None = None,
    floor_factor: float = 10.0,
) -> dict[str, Any]:
    """``{"diffs": {quantity: max relative difference}, "pass": bool, "first": str | None}``. Per step, in this
    order: ``objective``, ``lm_loss``, ``aux_loss`` (logged values), ``grads`` (each parameter's gradient),
    ``grad_norm``; then ``params`` (every parameter after the last update).
    ``grads`` and ``params`` are judged per tensor: a tensor's largest absolute difference relative to
    ``max(its own largest |entry|, 1e-6 × the largest |entry| of all the step's gradients (or of all the
    parameters))``, so that a gradient of a few 1e-12 entries (a parameter the loss barely reaches) that
    differs by 1e-12 is not a 100% difference, while a tensor within a millionth of the largest keeps its own
    scale. ``grads_abs`` is the largest absolute gradient difference (the scale of ``grads``; not judged).
    A quantity passes when its difference is at most ``max(tol, floor_factor · floor[quantity])``, ``floor``
    being the model's own float32 floor (the same differences between two runs that differ only in a
    summation order; None: ``tol`` alone). ``first`` names the first quantity over its limit in that order
    (with its step, or the parameter), followed by ``hf_scope``'s explanation when given."""
    keys = [k for k in _LOGGED if any(k in line for line in ref["history"])]
    diffs = {k: 0.0 for k in keys if k != "grad_norm"} | {"grads": 0.0, "grad_norm": 0.0, "params": 0.0}
    limit = {k: max(tol, floor_factor * (floor or {}).get(k, 0.0)) for k in diffs}
    grads_abs = 0.0
    first: str | None = None
    if len(run["history"]) != len(ref["history"]) or set(run["params"]) != set(ref["params"]):
        return {"diffs": {k: float("inf") for k in diffs}, "pass": False, "first": "steps or parameter names"}
    tol_of = limit.__getitem__
    for step, (line, ref_line) in enumerate(zip(run["history"], ref["history"]), 1):
        for key in diffs:
            if key in ("grads", "params"):
                if key == "grads":
                    d, name = _worst(run["grads"][step - 1], ref["grads"][step - 1])
                    diffs[key] = max(diffs[key], d)
                    grads_abs = max(grads_abs, _worst_abs(run["grads"][step - 1], ref["grads"][step - 1]))
                    if first is None and d > tol_of(key):
                        first = f"gradient of {name} at step {step}"
                continue
            d = _rel(line.get(key), ref_line.get(key))
            diffs[key] = max(diffs[key], d)
            if first is None and d > tol_of(key):
                first = f"{key} at step {step} ({line.get(key)!r} vs {ref_line.get(key)!r})"
    worst, worst_name = _worst(run["params"], ref["params"])
    diffs["params"] = worst
    if first is None and worst > tol_of("params"):
        first = f"parameter {worst_name} after the last update"
    ok = all(v <= limit[k] for k, v in diffs.items())
    if not ok and hf_scope:
        first = f"{first}; {hf_scope}"
    return {"diffs": diffs | {"grads_abs": grads_abs}, "pass": ok, "first": None if ok else first}


def _worst_abs(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over the named tensors."""
    return max((float((run[n] - t).abs().max()) for n, t in ref.items() if t.numel()), default=0.0)


def _worst(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str | None]:
    """The largest relative difference over the named tensors, and the name of its tensor: each tensor's
    largest absolute difference over ``max(its own largest |entry|, REL_FLOOR × the largest |entry| of all)``."""
    scale = max((float(t.abs().max()) for t in ref.values() if t.numel()), default=0.0)
    worst, name = 0.0, None
    for n, t in ref.items():
        d = _tensor_rel(run[n], t, REL_FLOOR * scale)
        if d > worst:
            worst, name = d, n
    return worst, name


def format_hf_table(report: dict[str, Any], title: str) -> str:
    """The report as a Markdown table (layout × quantity → max relative difference) and its failing rows."""
    present = {c for r in report["rows"] for c in r["diffs"]}
    cols = [
        c for c in ("objective", "lm_loss", "aux_loss", "grads", "grads_abs", "grad_norm", "params") if c in present
    ]
    lines = ([title, ""] if title else []) + ["| layout | mode | vs | " + " | ".join(cols) + " | result |"]
    lines.append("|" + "---|" * (len(cols) + 4))
    for r in report["rows"]:
        cells = " | ".join(f"{r['diffs'][c]:.1e}" if c in r["diffs"] else "—" for c in cols)
        result = "n/a" if r["reference"] == "itself" else "PASS" if r["pass"] else "ERROR" if "error" in r else "FAIL"
        lines.append(f"| {r['layout']} | {r['mode']} | {r['reference']} | {cells} | {result} |")
    compared = [r for r in report["rows"] if r["reference"] != "itself"]
    n_pass = sum(r["pass"] for r in compared)
    n_err = sum("error" in r for r in compared)
    floor = report.get("floor")
    judged = f"tolerance {report['tolerance']:g} relative" + (
        f", or {report.get('floor_factor', 10):g} x the model's float32 floor" if floor else ""
    )
    lines.append(
        f"\n{n_pass}/{len(compared)} PASS"
        + (f", {n_err} ERROR" if n_err else "")
        + f" ({judged}, {report['steps']} steps each, wall {report['wall_s']:.1f} s)"
    )
    if floor:
        lines.append(_floor_line(report))
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"ERROR {r['layout']} {r['mode']}: {r['error']}")
        elif not r["pass"]:
            again = r.get("float64_check_failed")
            lines.append(
                f"FAIL {r['layout']} {r['mode']}: first difference: {r['first']}"
                + (f"; with the model's float32 computation in float64 it still differs: {again}" if again else "")
            )
        elif "float64_check" in r:
            lines.append(
                f"PASS {r['layout']} {r['mode']} by the second opinion: at the model's float32 the first difference "
                f"was {r['float32_first']}; with its float32 computation in float64 the largest difference is "
                f"{r['float64_check']:.1e}: the model's float32 rounding, not the layout"
            )
    ops = report.get("float32_ops") or []
    if ops and not floor and any(not r["pass"] and "error" not in r for r in report["rows"]):
        lines.append(
            f"note: the model computes in float32 inside this float64 run ({', '.join(ops[:4])}"
            + (f" +{len(ops) - 4} more" if len(ops) > 4 else "")
            + "): a difference near 1e-7 may be its float32 rounding, which the floor run did not show"
        )
    if len(compared) < len(report["rows"]):
        lines.append(
            "n/a: the quantity depends on the microbatch size (per_microbatch, aux_scope microbatch) and no other "
            "layout here has this one's; compare D·K = n layouts with K=n"
        )
    walls = report.get("layout_wall_s") or {}
    if walls:
        lines.append("wall per layout (all modes): " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()))
    lines.append(
        "columns: max relative difference to the run named in 'vs' (1x1: one process, one microbatch; K=n: one "
        "process with the same microbatch size) over every step; grads: each parameter's gradient, relative to its "
        "largest entry or to 1e-6 x the largest of all gradients, whichever is larger (grads_abs: the largest "
        "absolute difference); params: every parameter after the last update, alike"
    )
    return "\n".join(lines)


def _floor_line(report: dict[str, Any]) -> str:
    """Why a float64 run is judged against a float32 floor: the floor and where the model computes in float32."""
    params, modules = report.get("float32_params") or [], report.get("float32_modules") or []
    casts = report.get("float32_casts") or []
    where = []
    if params:
        where.append(
            f"float32 parameters: {', '.join(params[:6])}" + (f" (+{len(params) - 6} more)" if len(params) > 6 else "")
        )
    if modules:
        where.append(
            f"modules returning float32: {', '.join(modules[:6])}"
            + (f" (+{len(modules) - 6} more)" if len(modules) > 6 else "")
        )
    if casts:
        where.append(
            f"float64 parameters computed in float32: {', '.join(casts[:6])}"
            + (f" (+{len(casts) - 6} more)" if len(casts) > 6 else "")
        )
    return (
        f"float32 inside the model: its floor is {report['floor']:.1e} (the larger of the difference of a 1x1 run "
        "whose only changes are the rows' summation order and float64-rounding-level parameters, and float32's "
        "unit roundoff 6.0e-08 where it computes in float32); "
        + ("; ".join(where) if where else "no float32 parameter or module output found (float32 casts inside a module)")
    )
