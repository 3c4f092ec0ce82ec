"""Kill-and-resume trials: SIGKILL ``lossparity train`` at random moments, resume, compare bit for bit.

``python -m benchmarks.kill_resume [--trials 8] [--steps 8] [--dp 1] [--seed 0] [--json PATH]``

A reference run trains ``--steps`` steps uninterrupted (checkpoint every step, ``--dump-samples``). Each
trial starts the same run in a fresh folder and kills it with ``SIGKILL`` once a random number of steps
is logged, after a random extra delay (so kills land inside steps and inside checkpoint writes); then it
resumes with ``--resume``, and with probability 1/2 kills that resume too, shortly after it starts
(during the checkpoint load, the truncation of the logs or the first steps), up to three kills in all;
the last resume runs to the end. A trial is *bit-exact* when the final ``metrics.jsonl`` (every key but
the timings), the per-sample dump and the final checkpoint's parameters equal the reference's exactly.
Evidence of a kill inside a write (a ``.tmp-*`` file left behind, removed by the next start) is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_TIMINGS = {"tokens_per_s", "step_time_s"}
_CODE = "import sys; from lossparity.cli import main; sys.exit(main())"


def _argv(out: Path, steps: int, dp: int, resume: bool) -> list[str]:
    return [
        sys.executable,
        "-c",
        _CODE,
        "train",
        "--steps",
        str(steps),
        "--dp",
        str(dp),
        "--global-batch",
        "4",
        "--seq-len",
        "32",
        "--packed",
        "--ckpt-interval",
        "1",
        "--dump-samples",
        "--no-progress",
        "--no-tensorboard",
        "--out",
        str(out),
    ] + (["--resume"] if resume else [])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher (its ranks die with it: PR_SET_PDEATHSIG) and reap it."""
    proc.kill()
    proc.wait()


def _run_and_kill(out: Path, steps: int, dp: int, resume: bool, rng: random.Random, during_start: bool) -> bool:
    """Start a run and SIGKILL it at a random moment; returns False when it finished before the kill."""
    config = out / "config.json"
    before = config.stat().st_mtime_ns if config.exists() else 0
    err_path = out.parent / f"{out.name}.stderr"
    with open(err_path, "wb") as err:  # a file, not a pipe: a child never blocks on a full pipe
        proc = subprocess.Popen(_argv(out, steps, dp, resume), env=_env(), stdout=subprocess.DEVNULL, stderr=err)
    target = rng.randrange(0, steps) if not during_start else None
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        started = config.exists() and config.stat().st_mtime_ns != before
        if during_start and started or target is not None and started and _lines(out / "metrics.jsonl") > target:
            time.sleep(rng.uniform(0.0, 0.15 if during_start else 0.3))
            break
        time.sleep(0.01)
    if proc.poll() is not None:
        if proc.returncode != 0:
            raise RuntimeError(f"run failed (exit {proc.returncode}): {err_path.read_text()[-2000:]}")
        return False
    _kill_group(proc)
    return True


def _finish(out: Path, steps: int, dp: int) -> None:
    proc = subprocess.run(_argv(out, steps, dp, True), env=_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"final resume failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def _snapshot(out: Path, steps: int) -> dict[str, Any]:

    from lossparity.parity.sample_dump import read_sample_dump

    lines = [
        {k: v for k, v in json.loads(x).items() if k not in _TIMINGS}
        for x in (out / "metrics.jsonl").read_text().splitlines()
    ]
    dump = {s: [a.tolist() for a in v] for s, v in read_sample_dump(str(out)).items()}
    return {"lines": lines, "dump": dump, "model": _final_params(out, steps)}


def _final_params(out: Path, steps: int) -> dict[str, Any]:
    """The parameters of the last checkpoint: the ``model`` of ``step_<n>.pt`` (one process), or the
    ``model.*`` entries of the ``step_<n>/`` folder (several ranks), both read without unpickling code."""
    import torch
    import torch.distributed.checkpoint as dcp

    from lossparity.checkpoint.safe_dcp import SafeFileSystemReader, read_metadata_safely

    single = out / "checkpoints" / f"step_{steps:08d}.pt"
    if single.exists():
        return torch.load(single, map_location="cpu", weights_only=True)["model"]
    folder = str(out / "checkpoints" / f"step_{steps:08d}")
    entries = read_metadata_safely(folder).state_dict_metadata
    state = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)  # type: ignore[union-attr]
        for k, md in entries.items()
        if k.startswith("model.")
    }
    dcp.load(state, storage_reader=SafeFileSystemReader(folder), no_dist=True)
    return state


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    bad = [k for k in ("lines", "dump") if a[k] != b[k]]
    if a["model"].keys() != b["model"].keys() or not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        bad.append("parameters")
    return bad


def _left_temporaries(out: Path) -> bool:
    """Whether a killed write left a ``.tmp-*`` file (the next start removes it)."""
    dirs = [d for d in (out, out / "checkpoints", out / "samples") if d.is_dir()]
    return any(p.name.startswith(".tmp-") for d in dirs for p in d.iterdir())


def _left_state(out: Path) -> str:
    """What a kill left: the logged steps and the newest checkpoint under a final name (what the next
    resume loads when it is intact), e.g. ``"3 logged, ckpt 2"``."""
    from lossparity.training.rundir import list_checkpoints

    found = list_checkpoints(str(out / "checkpoints"))
    return f"{_lines(out / 'metrics.jsonl')} logged, ckpt {found[0][0] if found else 'none'}"


def _trial(out: Path, steps: int, dp: int, rng: random.Random, resume_kill_p: float, reference: dict) -> dict:
    """One trial: a killed run, up to two killed resumes, a resume to the end, the comparison."""
    kills = in_write = in_resume = 0
    left = []
    for attempt in range(3):
        if attempt > 0 and rng.random() >= resume_kill_p:
            break
        if not _run_and_kill(out, steps, dp, attempt > 0, rng, during_start=attempt > 0):
            break
        kills += 1
        in_resume += attempt > 0
        in_write += _left_temporaries(out)
        left.append(_left_state(out))
    _finish(out, steps, dp)
    diffs = _equal(reference, _snapshot(out, steps))
    return {
        "kills": kills,
        "kills_during_resume": in_resume,
        "kills_inside_a_write": in_write,
        "bit_exact": not diffs,
        "differs": diffs,
        "left": left,
    }


def run_trials(
    trials: int,
    *,
    steps: int = 8,
    dp: int = 1,
    seed: int = 0,
    workdir: str | None = None,
    resume_kill_p: float = 0.5,
    log=print,
) -> dict[str, Any]:
    """Run ``trials`` kill-and-resume trials against one reference run; ``resume_kill_p`` is the chance
    that each resume (up to two) is killed too. Returns the counts and the per-trial details."""
    rng = random.Random(seed)
    base = Path(workdir or tempfile.mkdtemp(prefix="lossparity-kill-"))
    ref = base / "ref"
    subprocess.run(_argv(ref, steps, dp, False), env=_env(), check=True, capture_output=True, timeout=900)
    reference = _snapshot(ref, steps)
    results = []
    for t in range(trials):
        r = {"trial": t, **_trial(base / f"trial{t}", steps, dp, rng, resume_kill_p, reference)}
        results.append(r)
        log(
            f"trial {t}: {r['kills']} kill(s) ({r['kills_during_resume']} during a resume, "
            f"{r['kills_inside_a_write']} inside a write; left {'; '.join(r['left']) or '-'}): "
            + ("bit-exact" if r["bit_exact"] else f"DIFFERS in {', '.join(r['differs'])}")
        )
    keys = ("kills", "kills_during_resume", "kills_inside_a_write", "bit_exact")
    summary = {
        "trials": trials,
        **{k: sum(r[k] for r in results) for k in keys},
        "steps": steps,
        "dp": dp,
        "seed": seed,
        "results": results,
    }
    log(
        f"{summary['bit_exact']}/{trials} bit-exact resumes; {summary['kills']} kills, "
        f"{summary['kills_during_resume']} during a resume, {summary['kills_inside_a_write']} inside a write"
    )
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    summary = run_trials(args.trials, steps=args.steps, dp=args.dp, seed=args.seed)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"wall {summary['wall_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
