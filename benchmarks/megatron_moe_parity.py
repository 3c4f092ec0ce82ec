"""Megatron-core's own MoE aux / z-loss / MTP terms vs lossparity's MoETerms, layout against one rank.

Real megatron-core ``GPTModel`` (local spec, 2 MoE layers + MTP depth 1, 4 experts top-2, hidden 32,
sequence 32, float64), 8 rows per global batch, two steps of ``forward_backward_no_pipelining`` +
``finalize_model_grads`` on CPU gloo (the test harness's CUDA bridges), mode ``per_token``. For each
layout the second step's logged values and gradients are compared with the same system on one rank
(micro-batch size 2); the table prints the largest relative difference over ranks.

    PYTHONPATH=src python -m benchmarks.megatron_moe_parity [--layouts DP2,TP2+SP,CP2,TP2+SP×CP2,PP2]
    PYTHONPATH=src python -m benchmarks.megatron_moe_parity --help
    PYTHONPATH=src python -m benchmarks.megatron_moe_parity --objective CP2,TP2+SP×CP2

``--objective``: every mode (per_token, per_sample, per_document), scope and ``calculate_per_token_loss``
under context parallelism against the harness's hand-written float64 objective instead.

Context parallelism uses the harness's test attention (keys and values all-gathered over CP), since
Megatron's own CP attention needs Transformer Engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))

# Megatron's scopes next to lossparity's: Megatron's aux_loss is the microbatch scope; its
# global_aux_loss (running over microbatches) is compared with lossparity's global_lagged.
PAIRS = [
    ("megatron", "microbatch"),
    ("megatron", "global"),
    ("lossparity", "microbatch"),
    ("lossparity", "global_lagged"),
]
LOG_KEYS = {
    "megatron": {"aux": ("load_balancing_loss", "global_load_balancing_loss"), "z": "z_loss", "mtp": "mtp_1 loss"},
    "lossparity": {"aux": ("load_balancing_loss", "global_load_balancing_loss"), "z": "z_loss", "mtp": "mtp_1_loss"},
}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _cases(per_token_flags, mbs):
    return [(system, scope, pt, mbs) for system, scope in PAIRS for pt in per_token_flags]


def _figures(results, ref, case):
    """Largest relative differences over ranks: (aux log, z log, mtp log, router grad, all grads),
    and the largest disagreement of the z log between ranks."""
    system = case[0]
    keys = LOG_KEYS[system]
    want_logs, want_grads = ref
    out = {"aux": 0.0, "z": 0.0, "mtp": 0.0, "router": 0.0, "all": 0.0}
    zs = []
    for res in results:
        logs, grads = res[case]
        aux = keys["aux"][0 if case[1] == "microbatch" else 1]  # Megatron's tracker keeps stale keys
        for name, key in (("aux", aux), ("z", keys["z"]), ("mtp", keys["mtp"])):
            if key in logs:  # (Megatron logs MTP on the last pipeline stage only)
                out[name] = max(out[name], abs(logs[key] - want_logs[key]) / abs(want_logs[key]))
        zs.append(logs[keys["z"]])
        routers = [n for n in grads if "router" in n]  # (a pipeline stage holds some parameters)
        out["router"] = max(out["router"], max(_rel(grads[n], want_grads[n]) for n in routers))
        out["all"] = max(out["all"], max(_rel(grads[n], want_grads[n]) for n in grads))
    out["z_ranks"] = (max(zs) - min(zs)) / abs(zs[0])
    return out


MODES = ("per_token", "per_sample", "per_document")
OBJECTIVE_LAYOUTS = {"CP2": (2, 1, 2), "TP2+SP×CP2": (4, 2, 2)}


def objective_check(chosen: list[str]) -> None:
    """``--objective``: MoETerms against the harness's hand-written float64 objective (one process, the
    whole global batch in one forward) for every mode, scope and ``calculate_per_token_loss`` on the chosen
    context-parallel layouts; prints the largest relative gradient (every parameter, router weights
    included) and log differences over both steps and all ranks, and whether the logs are identical on
    every rank."""
    from _megatron_gpt_workers import run_layout

    from lossparity.distributed.launch import spawn

    cases = [(m, sc, pt, None) for m in MODES for sc in ("microbatch", "global_lagged") for pt in (True, False)]
    pairs = sorted({c[:2] for c in cases})
    naive = spawn(run_layout, 1, 1, [], 8, 2, 2, pairs, timeout_s=900)[0]["naive"]
    print("| layout | mode | scope | per-token loss | gradients (rel) | logs (rel) | logs identical on every rank |")
    print("|---|---|---|---|---|---|---|")
    for name in chosen:
        world, tp, cp = OBJECTIVE_LAYOUTS[name]
        results = spawn(run_layout, world, tp, cases, 8, 2, 2, (), False, cp, timeout_s=900)
        for case in cases:
            g_worst = l_worst = 0.0
            same = True
            for step, (want_logs, want_grads) in enumerate(naive[case[:2]]):
                for res in results:
                    logs, grads, _ = res[case][step]
                    g_worst = max(g_worst, max(_rel(grads[n], want_grads[n]) for n in want_grads))
                    l_worst = max(l_worst, max(abs(logs[k] - v) / abs(v) for k, v in want_logs.items()))
                    same = same and logs == results[0][case][step][0]
            print(f"| {name} | {case[0]} | {case[1]} | {case[2]} | {g_worst:.1e} | {l_worst:.1e} | {same} |")


ALL_LAYOUTS = {  # (world, tp, cp, pp) of each layout
    "DP2": (2, 1, 1, 1),
    "TP2+SP": (2, 2, 1, 1),
    "CP2": (2, 1, 2, 1),
    "TP2+SP×CP2": (4, 2, 2, 1),
    "PP2": (2, 1, 1, 2),
}


def _layouts(text: str, known: Any) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown layout(s) {bad or text!r}; choose from {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` prints it and runs nothing)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.megatron_moe_parity",
        description="Megatron-core's own MoE aux / z-loss / MTP terms vs lossparity's MoETerms: each layout's "
        "second step against the same system on one rank (a markdown table).",
    )
    parser.add_argument(
        "--layouts",
        type=lambda t: _layouts(t, ALL_LAYOUTS),
        default=list(ALL_LAYOUTS),
        help=f"comma-separated layouts to compare with one rank (default: all of {','.join(ALL_LAYOUTS)})",
    )
    parser.add_argument(
        "--objective",
        type=lambda t: _layouts(t, OBJECTIVE_LAYOUTS),
        default=None,
        help="instead: MoETerms against the hand-written objective, every mode, scope and flag, on these "
        f"context-parallel layouts ({','.join(OBJECTIVE_LAYOUTS)})",
    )
    return parser.parse_args(argv)


def megatron_version() -> str:
    """The installed megatron-core release (its distribution's metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"megatron-core {megatron_version()}, torch {__import__('torch').__version__}, Python {sys.version.split()[0]}"
    )
    from _megatron_gpt_workers import run_megatron_own

    from lossparity.distributed.launch import spawn

    if args.objective:
        objective_check(args.objective)
        return

    flags = (True, False)
    chosen = args.layouts
    all_layouts = ALL_LAYOUTS
    one = spawn(run_megatron_own, 1, 1, _cases(flags, 2) + _cases((True,), 1), timeout_s=900)
    layouts = {
        name: spawn(run_megatron_own, world, tp, _cases(flags, 2), 8, 2, cp, pp, timeout_s=900)
        for name, (world, tp, cp, pp) in all_layouts.items()
        if name in chosen
    }
    print(
        "| layout vs 1 rank | system | scope | per-token loss | aux log | z_loss log | z_loss ranks disagree "
        "| mtp_1 log | router grad | all grads |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(name, res, 2, flags) for name, res in layouts.items()] + [("micro-batch size 2 -> 1", one, 1, (True,))]
    for name, res, mbs, row_flags in rows:
        for system, scope in PAIRS:
            for pt in row_flags:
                ref = one[0][(system, scope, pt, 2)]
                f = _figures(res, ref, (system, scope, pt, mbs))
                print(
                    f"| {name} | {system} | {scope} | {pt} | {f['aux']:.1e} | {f['z']:.1e} | {f['z_ranks']:.1e} "
                    f"| {f['mtp']:.1e} | {f['router']:.1e} | {f['all']:.1e} |"
                )


if __name__ == "__main__":
    main()
