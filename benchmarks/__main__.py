"""Run every benchmark side by side: ``python -m benchmarks [--quick] [--json DIR]``.

Each benchmark prints its Markdown table; with ``--json DIR`` each writes ``DIR/<name>.json`` (machine,
torch version, threads, and medians/minima of repeated runs). ``--quick`` uses small shapes and few
repeats (the form CI runs: numbers are printed, nothing is asserted about time).
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks import bench_accountant, bench_cross_entropy, bench_moe_aux, bench_moe_dispatch

BENCHMARKS = {
    "cross_entropy": bench_cross_entropy.main,
    "accountant": bench_accountant.main,
    "moe_aux": bench_moe_aux.main,
    "moe_dispatch": bench_moe_dispatch.main,
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, metavar="DIR")
    p.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    args = p.parse_args(argv)
    names = [n for n in BENCHMARKS if not args.only or n in args.only.split(",")]
    results = {}
    for name in names:
        print(f"\n## {name}\n", flush=True)
        t0 = time.perf_counter()
        sub = ["--quick"] if args.quick else []
        if args.json:
            os.makedirs(args.json, exist_ok=True)
            sub += ["--json", os.path.join(args.json, f"{name}.json")]
        results[name] = BENCHMARKS[name](sub)
        print(f"\n({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    return results


if __name__ == "__main__":
    main()
