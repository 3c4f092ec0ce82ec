"""torchtitan MoE (tests/integrations/_titan_moe_workers.py): every aux scope × activation checkpointing
(none, full, selective) × MTP layers (0, 1) × layout (1 process GA 4; 2 gloo ranks × GA 2), two real
``Trainer.train_step`` calls each, against the naive float64 reference of
tests/integrations/test_integration_titan_moe.py.

    nice .venv/bin/python scripts/titan_moe_matrix.py

Prints a Markdown table: the largest relative gradient difference (every parameter, routers included),
the largest expert-bias difference after step 2 and the relative difference of the logged objective.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations"))

from _titan_moe_workers import run_titan_moe, titan_moe_steps  # noqa: E402
from test_integration_titan_moe import _compare, _reference  # noqa: E402

from lossparity.distributed.launch import spawn  # noqa: E402

SCOPES = ("global_lagged", "microbatch", "sequence", "none")
ACS = ("none", "full", "selective")


def main() -> None:
    t0 = time.time()
    cases = [(s, a, m) for s in SCOPES for a in ACS for m in (0, 1)]
    refs = {(s, m): _reference(s, mtp=m) for s in SCOPES for m in (0, 1)}
    two = spawn(run_titan_moe, 2, cases, timeout_s=3000)
    print("| aux scope | AC | MTP | layout | gradients (rel) | expert biases (abs) | objective (rel) |")
    print("|---|---|---|---|---|---|---|")
    for s, a, m in cases:
        rows = [("1 process, GA 4", titan_moe_steps(s, slice(0, 16), 4, ac=a, mtp=m))]
        rows += [(f"2 ranks × GA 2 (rank {r})", two[r][(s, a, m)]) for r in range(2)]
        for label, got in rows:
            g, b, o = _compare(got, refs[(s, m)])
            print(f"| {s} | {a} | {m} | {label} | {g:.1e} | {b:.1e} | {o:.1e} |")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
