"""Longer mutation fuzzing of the log readers and the run-folder loader (issue 39); the CI share is
``tests/test_fuzz_inputs.py``.

    nice -n 10 python scripts/fuzz_inputs.py --seconds 600 --seed 0 [--escapes DIR]

Draws random mutations (``tests/_fuzz.py``: byte flips, truncation, line edits, huge numbers, NaN/inf, deep
nesting, long runs, invalid UTF-8, lone carriage returns) of the seed logs (``tests/fixtures/logs`` and a
TensorBoard file) and of a run folder's files, reads each input, and counts the inputs tried and the
escapes (any outcome but a result or the module's own one-line error; see ``tests/_fuzz.py``). Prints one
line per escape and a summary; ``--escapes DIR`` keeps each escaping input there. Exit 1 when any escaped.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

import _fuzz  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600.0, help="wall-clock budget (default 600)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the mutations")
    p.add_argument("--run-folder-share", type=float, default=0.25, help="fraction of inputs that are run folders")
    p.add_argument("--escapes", default=None, help="keep each escaping input in this folder")
    args = p.parse_args()
    rng = random.Random(args.seed)
    tried = {"log": 0, "run folder": 0}
    escapes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        seeds = _fuzz.seeds_with_formats(work)
        if not any(fmt == "tensorboard" for _, fmt in seeds):
            print("tensorboard not installed: no TensorBoard seed")
        base = work / "run"
        _fuzz.make_run_folder(base)
        cases = work / "cases"
        cases.mkdir()
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            mutations = _fuzz.random_mutations(rng)
            if rng.random() < args.run_folder_share:
                name = rng.choice(_fuzz.RUN_FILES)
                escape = _fuzz.fuzz_run_file(base, work / "work", name, mutations)
                tried["run folder"] += 1
                what, kept = f"run folder {name}", work / "work" / name
            else:
                seed, fmt = rng.choice(seeds)
                kept = _fuzz.write_case(cases, seed, _fuzz.mutate(seed.read_bytes(), mutations))
                escape = _fuzz.check_log(kept, None if fmt is None or rng.random() < 0.5 else fmt)
                tried["log"] += 1
                what = seed.name
            if escape is not None:
                escapes.append(f"{what} {mutations}: {escape}")
                print(f"ESCAPE {escapes[-1]}", flush=True)
                if args.escapes:
                    keep = Path(args.escapes)
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"{len(escapes):04d}_{kept.name}").write_bytes(kept.read_bytes())
        elapsed = time.monotonic() - start
    total = sum(tried.values())
    print(
        f"inputs tried: {total} ({tried['log']} logs, {tried['run folder']} run folders) in {elapsed:.0f} s; "
        f"escapes: {len(escapes)}"
    )
    return 1 if escapes else 0


if __name__ == "__main__":
    sys.exit(main())
