"""Megatron-core's own MoE aux / z-loss / MTP terms vs lossparity's MoETerms, layout against one rank.

Real megatron-core ``GPTModel`` (local spec, 2 MoE layers + MTP depth 1, 4 experts top-2, hidden 32,
sequence 32, float64), 8 rows per global batch, two steps of ``forward_backward_no_pipelining`` +
``finalize_model_grads`` on CPU gloo (the test harness's CUDA bridges), mode ``per_token``. For each
layout the second step's logged values and gradients are compared with the same system on one rank
(micro-batch size 2); the table prints the largest relative difference over ranks.

    PYTHONPATH=src python -m benchmarks.megatron_moe_parity [--layouts DP2,TP2+SP,CP2,TP2+SP×CP2,PP2]

Context parallelism uses the harness's test attention (keys and values all-gathered over CP), since
Megatron's own CP attention needs Transformer Engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))

# Megatron's scopes next to lossparity's: Megatron's aux_loss is the micro_batch scope; its
# global_aux_loss (running over microbatches) is compared with lossparity's global_lagged.
PAIRS = [
    ("megatron", "micro_batch"),
    ("megatron", "global"),
    ("lossparity", "micro_batch"),
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
        aux = keys["aux"][0 if case[1] == "micro_batch" else 1]  # Megatron's tracker keeps stale keys
        for name, key in (("aux", aux), ("z", keys["z"]), ("mtp", keys["mtp"])):
            if key in logs:  # (Megatron logs MTP on the last pipeline stage only)
                out[name] = max(out[name], abs(logs[key] - want_logs[key]) / abs(want_logs[key]))
        zs.append(logs[keys["z"]])
        routers = [n for n in grads if "router" in n]  # (a pipeline stage holds some parameters)
        out["router"] = max(out["router"], max(_rel(grads[n], want_grads[n]) for n in routers))
        out["all"] = max(out["all"], max(_rel(grads[n], want_grads[n]) for n in grads))
    out["z_ranks"] = (max(zs) - min(zs)) / abs(zs[0])
    return out


def main() -> None:
    from _megatron_gpt_workers import run_megatron_own

    from lossparity.distributed.launch import spawn

    flags = (True, False)
    # (world, tp, cp) of each layout; ``--layouts CP2,...`` runs a subset (the one-rank reference always)
    all_layouts = {
        "DP2": (2, 1, 1, 1),
        "TP2+SP": (2, 2, 1, 1),
        "CP2": (2, 1, 2, 1),
        "TP2+SP×CP2": (4, 2, 2, 1),
        "PP2": (2, 1, 1, 2),
    }
    chosen = sys.argv[sys.argv.index("--layouts") + 1].split(",") if "--layouts" in sys.argv else list(all_layouts)
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
