"""torchtitan MoE (tests/integrations/_titan_moe_workers.py): every aux scope × activation checkpointing
(none, full, selective) × MTP layers (0, 1) × layout (1 process GA 4; 2 gloo ranks × GA 2; PP 2 on 2 gloo
ranks × GA 2 × 2 pipeline microbatches with the 1F1B and the Interleaved1F1B schedules; 2 data-parallel
ranks × PP 2 (1F1B) on 4 gloo ranks × GA 2 × 2 pipeline microbatches; without MTP under PP: torchtitan refuses
it), two real
``Trainer.train_step`` calls each, against the naive float64 reference of
tests/integrations/test_integration_titan_moe.py.

    nice .venv/bin/python scripts/titan_moe_matrix.py [--layouts ga4 dp2 pp2 pp2i dp2pp2]

Prints a Markdown table: the largest relative gradient difference (every parameter, routers included; a
pipeline rank: its stages' parameters), the largest expert-bias difference after step 2 and the relative
difference of the logged objective ("-" on a pipeline rank that logs none: torchtitan's loss is the last
stage's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations"))

from _titan_moe_workers import run_titan_moe, run_titan_moe_dp_pp, run_titan_moe_pp, titan_moe_steps  # noqa: E402
from test_integration_titan_moe import _compare, _reference  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402

SCOPES = ("global_lagged", "microbatch", "sequence", "none")
ACS = ("none", "full", "selective")
LAYOUTS = ("ga4", "dp2", "pp2", "pp2i", "dp2pp2")
SCHEDULES = {"pp2": "1F1B", "pp2i": "Interleaved1F1B"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    layouts = parser.parse_args().layouts
    t0 = time.time()
    cases = [(s, a, m) for s in SCOPES for a in ACS for m in (0, 1)]
    mtp = {"ga4", "dp2"} & set(layouts)
    refs = {(s, m): _reference(s, mtp=m) for s in SCOPES for m in (0, 1) if m == 0 or mtp}
    two = spawn(run_titan_moe, 2, cases, timeout_s=3000) if "dp2" in layouts else None
    pp_cases = [(s, a) for s in SCOPES for a in ACS]
    pp = {k: spawn(run_titan_moe_pp, 2, pp_cases, v, timeout_s=3000) for k, v in SCHEDULES.items() if k in layouts}
    four = spawn(run_titan_moe_dp_pp, 4, pp_cases, timeout_s=3000) if "dp2pp2" in layouts else None
    mb2 = _reference("microbatch", mb_rows=2) if four is not None else None  # microbatches of 2 rows there
    print("| aux scope | AC | MTP | layout | gradients (rel) | expert biases (abs) | objective (rel) |")
    print("|---|---|---|---|---|---|---|")
    for s, a, m in cases:
        rows = []
        if "ga4" in layouts:
            rows.append(("1 process, GA 4", titan_moe_steps(s, slice(0, 16), 4, ac=a, mtp=m), False))
        if two is not None:
            rows += [(f"2 ranks × GA 2 (rank {r})", two[r][(s, a, m)], False) for r in range(2)]
        for k, ranks in pp.items() if m == 0 else ():
            rows += [(f"PP 2 {SCHEDULES[k]} × GA 2 × 2 mb (rank {r})", ranks[r][(s, a)], True) for r in range(2)]
        if four is not None and m == 0:
            rows += [(f"DP 2 × PP 2 × GA 2 × 2 mb (rank {r})", four[r][(s, a)], True) for r in range(4)]
        for label, got, stage in rows:
            ref = mb2 if s == "microbatch" and label.startswith("DP 2 × PP 2") else refs[(s, m)]
            g, b, o = _compare(got, ref, stage=stage)
            print(f"| {s} | {a} | {m} | {label} | {g:.1e} | {b:.1e} | {'-' if o is None else f'{o:.1e}'} |")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
