"""Longer mutation fuzzing of the log readers, the run-folder loader (issue 39), sample dumps, ``lossparity gap``
and sharded checkpoints (issue 50); the CI share is ``tests/test_fuzz_inputs.py``.

    nice -n 10 python scripts/fuzz_inputs.py --seconds 600 --seed 0 [--engines log,run,dump,gap,sharded]
        [--escapes DIR]

Draws random mutations (``tests/_fuzz.py``: byte flips, truncation, line edits, huge numbers, NaN/inf, deep
nesting, long runs, invalid UTF-8, lone carriage returns) of the seeds and checks each input with its engine:
``log`` (the project's test logs and a TensorBoard file, read by the log readers), ``run`` (a run folder's
files, checked as a resume checks them), ``dump`` (a 2-rank sample dump and an ``.npz``: read, and truncated as
a resume truncates it), ``gap`` (the same dump and the run's ``metrics.jsonl``, through ``lossparity gap``),
``sharded`` (the newest of two ``torch.distributed.checkpoint`` folders, loaded in a one-rank gloo group). An
escape is any outcome but a result or the module's own one-line error (``tests/_fuzz.py``,
``tests/_fuzz_dumps.py``). Prints one line per escape and a summary; ``--escapes DIR`` keeps each escaping
input there (and each input slower than ``--slow`` seconds, printed as ``SLOW``). Exit 1 when any escaped.
``--count N`` stops after N inputs (the CI test of the sharded engine).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

import _fuzz  # noqa: E402
import _fuzz_dumps  # noqa: E402

ENGINES = ("log", "run", "dump", "gap", "sharded")
WEIGHTS = {"log": 0.45, "run": 0.15, "dump": 0.15, "gap": 0.15, "sharded": 0.10}


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=600.0, help="wall-clock budget (default 600)")
    p.add_argument("--count", type=int, default=None, help="stop after this many inputs")
    p.add_argument("--seed", type=int, default=0, help="random seed of the mutations")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    p.add_argument("--escapes", default=None, help="keep each escaping (or slow) input in this folder")
    p.add_argument("--slow", type=float, default=10.0, help="print inputs that take longer (seconds)")
    args = p.parse_args()
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        p.error(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    return args


def _set_up(work: Path, engines: list[str], stack: contextlib.ExitStack) -> dict[str, object]:
    """The seeds of each engine: the logs (with formats), a run folder, a dump folder, two DCP checkpoints."""
    seeds = _fuzz.seeds_with_formats(work) if "log" in engines else []
    if "log" in engines and not any(fmt == "tensorboard" for _, fmt in seeds):
        print("tensorboard not installed: no TensorBoard seed")
    if "run" in engines:
        _fuzz.make_run_folder(work / "run")
    if "dump" in engines or "gap" in engines:
        _fuzz_dumps.make_dump_folder(work / "dumps")
    if "sharded" in engines:
        stack.enter_context(_fuzz_dumps.one_rank_group())
        _fuzz_dumps.make_sharded(work / "sharded")
    (work / "cases").mkdir()
    return {
        "log": seeds,
        "run": work / "run",
        "dump": work / "dumps",
        "gap": work / "dumps",
        "sharded": work / "sharded",
    }


def _one(engine: str, seeds: dict[str, object], work: Path, rng: random.Random, mutations: list) -> tuple:
    """``(what, escape or None, the input's path)`` of one mutated input of ``engine``."""
    if engine == "log":
        seed, fmt = rng.choice(seeds["log"])  # type: ignore[arg-type]
        kept = _fuzz.write_case(work / "cases", seed, _fuzz.mutate(seed.read_bytes(), mutations))
        return seed.name, _fuzz.check_log(kept, None if fmt is None or rng.random() < 0.5 else fmt), kept
    name, check = {
        "run": (rng.choice(_fuzz.RUN_FILES), _fuzz.fuzz_run_file),
        "dump": (rng.choice(_fuzz_dumps.DUMP_FILES), _fuzz_dumps.fuzz_dump),
        "gap": (rng.choice(_fuzz_dumps.GAP_FILES), _fuzz_dumps.fuzz_gap),
        "sharded": (rng.choice(_fuzz_dumps.SHARDED_FILES), _fuzz_dumps.fuzz_sharded),
    }[engine]
    escape = check(seeds[engine], work / "work", name, mutations)
    return f"{engine} {name}", escape, work / "work" / ("step_00000002" if engine == "sharded" else "") / name


def _keep(folder: str | None, kept: Path, name: str) -> None:
    if folder and kept.is_file():
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_bytes(kept.read_bytes())


def main() -> int:
    args = _arguments()
    rng = random.Random(args.seed)
    tried = dict.fromkeys(args.engines, 0)
    escapes: list[str] = []
    slowest = (0.0, "")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        seeds = _set_up(work, args.engines, stack)
        weights = [WEIGHTS[e] for e in args.engines]
        start = time.monotonic()
        while time.monotonic() - start < args.seconds and (args.count is None or sum(tried.values()) < args.count):
            engine = rng.choices(args.engines, weights)[0]
            mutations = _fuzz.random_mutations(rng)
            began = time.monotonic()
            what, escape, kept = _one(engine, seeds, work, rng, mutations)
            tried[engine] += 1
            took = time.monotonic() - began
            slowest = max(slowest, (took, f"{what} {mutations}"))
            if took > args.slow:
                print(f"SLOW {took:.1f} s: {what} {mutations}", flush=True)
                _keep(args.escapes, kept, f"slow_{engine}_{tried[engine]:06d}_{kept.name}")
            if escape is not None:
                escapes.append(f"{what} {mutations}: {escape}")
                print(f"ESCAPE {escapes[-1]}", flush=True)
                _keep(args.escapes, kept, f"{len(escapes):04d}_{kept.name}")
        elapsed = time.monotonic() - start
    counts = ", ".join(f"{n} {e}" for e, n in tried.items())
    print(f"inputs tried: {sum(tried.values())} ({counts}) in {elapsed:.0f} s; escapes: {len(escapes)}")
    print(f"slowest input: {slowest[0]:.1f} s ({slowest[1]})")
    return 1 if escapes else 0


if __name__ == "__main__":
    sys.exit(main())
