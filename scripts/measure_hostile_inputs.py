"""Time and peak memory of every hostile input of issues 39 and 50 through the command line (a measurement, not a
test).

    nice -n 10 python scripts/measure_hostile_inputs.py [--rows 1-12] [--no-train]
    nice -n 10 python scripts/measure_hostile_inputs.py --round 2 [--no-train]

``--round 2``: the reproductions of issue 50 (``tests/_hostile2.py`` at the issue's sizes: ``gap`` on FIFOs,
devices, bad contents, a sparse 256 MB rank file, a 2 GiB deflate bomb, a 30,000-step dump; ``compare`` on
16,000 restarts with new keys, 20 MB logs with new keys per line, a 99,999-column CSV), and with training
the resumes: a dump file that is a FIFO, ``/dev/zero`` or a 1 GiB sparse file, five bad saved
``decay_steps``, a damaged single-file checkpoint, and a damaged shard of a 2-rank sharded checkpoint.

Rows 1-12 (``tests/_hostile.py``, row 12 at its full size: a 1,000,000-column CSV and a 590,000-step JSONL)
run ``lossparity compare``; rows 13-17, 19 and 20 run ``lossparity train --resume`` on a damaged copy of a
4-step run and ``lossparity convert-checkpoint`` on bad files; row 18 resumes a 2-rank run (``--dp 2``:
sharded checkpoints) whose newest checkpoint's ``.metadata`` points at data files outside its folder. Each
command runs in its own process; the table gives its exit code, its stderr line count, its wall time and
its peak resident memory (``wait4``), and the size of the input.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import _hostile  # noqa: E402
import _hostile2  # noqa: E402

TRAIN = ["--steps", "4", "--ckpt-interval", "2", "--global-batch", "4", "--seq-len", "32", "--warmup", "1"]
TRAIN += ["--no-progress", "--no-tensorboard"]


_TIME = shutil.which("time") or "/usr/bin/time"


def run(argv: list[str], timeout: float = 300.0) -> tuple[int, int, float, float]:
    """``(exit code, stderr lines, seconds, peak MiB)`` of ``python -m lossparity ARGV``. The peak resident
    memory is what GNU ``time -f %M`` reports for the command: a process started directly from this script
    would inherit this script's own high-water mark (Linux keeps it across fork and exec)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss_file:
        start = time.monotonic()
        try:
            proc = subprocess.run(
                [_TIME, "-q", "-f", "%M", "-o", rss_file.name, sys.executable, "-m", "lossparity", *argv],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                timeout=timeout,  # a hang guard
            )
            code, err = proc.returncode, proc.stderr.decode(errors="replace")
        except subprocess.TimeoutExpired:
            return -9, 0, time.monotonic() - start, float("nan")
        seconds = time.monotonic() - start
        text = rss_file.read().strip().splitlines()
    rss = float(text[-1]) / 1024 if text and text[-1].isdigit() else float("nan")
    return code, len(err.splitlines()), seconds, rss


def _size(paths: list[str]) -> int:
    total = 0
    for p in paths:
        if os.path.isdir(p):
            total += sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())
        elif os.path.isfile(p):
            total += os.path.getsize(p)
    return total


def train_cases(d: Path) -> list[tuple[int, str, list[str], list[str]]]:
    """``(row, name, argv, files)`` of the run-folder and checkpoint rows, each on its own damaged copy."""
    import torch

    base = d / "base"
    code, *_ = run(["train", *TRAIN, "--out", str(base)], timeout=900)
    assert code == 0, "the base run failed"
    cases = []

    def copy(name: str) -> Path:
        out = d / name
        shutil.copytree(base, out, symlinks=True)
        return out

    def resume(row: int, name: str, out: Path, files: list[str]) -> None:
        cases.append((row, name, ["train", *TRAIN, "--out", str(out), "--resume"], files))

    out = copy("r13")
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest").symlink_to("/dev/zero")
    resume(13, "latest_dev_zero", out, [])
    out = copy("r14")
    for name in ("step_00000002.pt", "step_00000004.pt"):
        (out / "checkpoints" / name).unlink()
    os.mkfifo(out / "checkpoints" / "step_00000004.pt")
    resume(14, "only_checkpoint_fifo", out, [])
    out = copy("r15")
    (out / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    resume(15, "config_nested", out, [str(out / "config.json")])
    out = copy("r16")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": Infinity}\n')
    resume(16, "metrics_infinity", out, [str(out / "metrics.jsonl")])
    out = copy("r17")
    state = torch.load(out / "checkpoints" / "step_00000004.pt", weights_only=True)
    state["rng"]["torch"] = torch.zeros(10, dtype=torch.uint8)
    torch.save(state, out / "checkpoints" / "step_00000004.pt")
    resume(17, "rng_torch_size", out, [])
    out = copy("r19")
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").write_text("x\n")
    resume(19, "checkpoints_is_a_file", out, [])
    cases.append(_row18_case(d))
    bad = d / "r20"
    bad.mkdir()
    good = (base / "checkpoints" / "step_00000002.pt").read_bytes()
    (bad / "step_00000001.pt").write_bytes(good[: len(good) // 2])
    os.mkfifo(bad / "step_00000002.pt")
    for f in sorted(bad.iterdir()):
        cases.append((20, f"convert_{f.name}", ["convert-checkpoint", "--i-trust-these-files", str(f)], [str(f)]))
    return cases


def _row18_case(d: Path) -> tuple[int, str, list[str], list[str]]:
    """A ``--dp 2`` run (sharded checkpoints) whose newest checkpoint reads its tensors from ``../outside``."""
    import pickle

    out = d / "r18"
    argv = ["train", *TRAIN, "--dp", "2", "--out", str(out)]
    code, *_ = run(argv, timeout=900)
    assert code == 0, "the 2-rank base run failed"
    step = out / "checkpoints" / "step_00000004"
    outside = d / "outside"
    outside.mkdir()
    for data in [p for p in step.iterdir() if p.suffix == ".distcp"]:
        shutil.move(str(data), outside / data.name)  # the bytes the metadata needs now lie outside the folder
    with open(step / ".metadata", "rb") as f:
        meta = pickle.load(f)  # this script's own file, written by torch.distributed.checkpoint just above
    for info in meta.storage_data.values():
        info.relative_path = os.path.relpath(outside / info.relative_path, step)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return (18, "dcp_path_outside", [*argv, "--resume"], [str(step / ".metadata")])


def round2_cases(d: Path, train: bool) -> list[tuple[int, str, list[str], list[str]]]:
    """``(50, name, argv, files)`` of issue 50's reproductions at full size; with ``train`` also the resumes."""
    out = []
    for case in [*_hostile2.gap_files(d), *_hostile2.gap_sizes(d), *_hostile2.compare_files(d)]:
        out.append((50, case.name, case.argv, [a for a in case.argv[1:] if os.path.exists(a)]))
    if not train:
        return out
    base = d / "base50"
    code, *_ = run(["train", *TRAIN, "--dump-samples", "--out", str(base)], timeout=900)
    assert code == 0, "the base run failed"

    def copy(name: str) -> Path:
        return Path(shutil.copytree(base, d / name, symlinks=True))

    for name in ("fifo", "dev_zero", "sparse_1GiB"):
        rank0 = copy(f"dump_{name}") / "samples" / "samples_rank0.bin"
        rank0.unlink()
        if name == "fifo":
            os.mkfifo(rank0)
        elif name == "dev_zero":
            rank0.symlink_to("/dev/zero")
        else:
            with open(rank0, "wb") as f:
                f.truncate(2**30)
        out.append(
            (
                50,
                f"resume_dump_{name}",
                ["train", *TRAIN, "--dump-samples", "--out", str(rank0.parents[1]), "--resume"],
                [],
            )
        )
    for name, text in _hostile2.config_values(base):
        run_dir = copy(f"decay_{name}")
        _hostile2.set_saved(run_dir / "config.json", "decay_steps", text)
        out.append((50, f"saved_decay_steps_{name}", ["train", *TRAIN, "--out", str(run_dir), "--resume"], []))
    run_dir = copy("damaged_pt")
    newest = run_dir / "checkpoints" / "step_00000004.pt"
    newest.write_bytes(b"\x5a" * newest.stat().st_size)
    out.append((50, "damaged_single_file", ["train", *TRAIN, "--out", str(run_dir), "--resume"], []))
    sharded = d / "S"
    argv = ["train", "--steps", "2", "--ckpt-interval", "1", "--global-batch", "4", "--seq-len", "32", "--warmup", "1"]
    argv += ["--no-tensorboard", "--no-progress", "--dp", "2", "--out", str(sharded)]
    code, *_ = run(argv, timeout=900)
    assert code == 0, "the 2-rank base run failed"
    shard = sharded / "checkpoints" / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(b"\x5a" * shard.stat().st_size)
    out.append((50, "damaged_shard_dp2", [*argv, "--resume"], [str(shard)]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1-12", help="log rows to run, e.g. 1-12 or 4,12 (default 1-12)")
    p.add_argument("--no-train", action="store_true", help="skip rows 13-20 (they import torch and train once)")
    p.add_argument("--round", type=int, default=1, choices=(1, 2), help="2: the reproductions of issue 50")
    args = p.parse_args()
    rows: list[int] = []
    for part in args.rows.split(","):
        lo, _, hi = part.partition("-")
        rows += range(int(lo), int(hi or lo) + 1)
    print("| row | case | exit | stderr lines | seconds | peak MiB | input bytes |")
    print("|---|---|---|---|---|---|---|")
    worst_time = worst_mem = (0.0, "")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        measured: list[tuple[int, str, list[str], list[str]]] = []
        if args.round == 2:
            rows, measured = [], round2_cases(d, not args.no_train)
        for row in rows:
            for case in _hostile.ROWS[row](d):
                measured.append((row, case.name, ["compare", *case.argv], case.argv))
        if not args.no_train and args.round == 1:
            measured += train_cases(d)
        for row, name, argv, files in measured:
            code, lines, seconds, rss = run(argv)
            print(f"| {row} | {name} | {code} | {lines} | {seconds:.2f} | {rss:.0f} | {_size(files)} |", flush=True)
            worst_time = max(worst_time, (seconds, f"row {row} {name}"))
            worst_mem = max(worst_mem, (rss, f"row {row} {name}"))
    print(f"\nslowest: {worst_time[1]} {worst_time[0]:.2f} s")
    print(f"largest peak memory: {worst_mem[1]} {worst_mem[0]:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
