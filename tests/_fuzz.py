"""Mutation fuzzing of the log readers and the run-folder loader (issue 39), shared by
``tests/test_fuzz_inputs.py`` (a fixed, derandomized budget in CI) and ``scripts/fuzz_inputs.py`` (a longer
run that counts inputs and escapes).

An *escape* is any outcome other than a result or the module's own input error: a reader must return a
:class:`~lossparity.parity.Run` (with integer steps below 2**53) or raise ``LogParseError``; the run-folder
check must return or raise ``RunDirError``/``InputFileError``; a checkpoint load must return or raise
(any exception there falls back to the previous checkpoint). The seeds are the project's own test logs
(``tests/fixtures/logs``) and a run folder built from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"

# the operations of a mutation: (name, where in the file as a fraction, a number that picks the payload)
OPS = (
    "flip",
    "truncate",
    "duplicate_line",
    "swap_lines",
    "delete_line",
    "insert",
    "repeat",
    "invalid_utf8",
    "lone_cr",
)
PAYLOADS = (
    b"9" * 400,
    b"-" + b"9" * 5000,
    b"1e999",
    b"NaN",
    b"Infinity",
    b"-inf",
    str(2**63).encode(),
    str(2**53).encode(),
    b"[" * 3000 + b"]" * 3000,
    b'{"step": ' * 2000,
    b"[1" + b" " * 3000 + b"x",
    b"a " * 2000,
    b"w" * 5000,
    b'"' + b"x" * 140_000 + b'"',
    b"\x00\xff\xfe",
    b",,,,,,,,",
    b"|",
    b":",
    b"step: 99999999999999999999 loss: 1",
    b" iteration 18446744073709551616/ 1 | lm loss: 1 |",
    b"{ Epoch:[99999999999/99999999999], step:[99999999999/99999999999], loss: 1, global_norm: [1 2",
    b"completed step: 1e300, loss: 2",
    b'{"step": 1, "lm_loss": 1}\n',
    b"\r",
)

Mutation = tuple[str, float, int]


def mutate(data: bytes, mutations: Sequence[Mutation]) -> bytes:
    """Apply ``mutations`` in order (deterministic: the same mutations give the same bytes)."""
    for op, where, k in mutations:
        n = len(data)
        at = min(int(where * n), n)
        if op == "flip" and n:
            i = min(at, n - 1)
            data = data[:i] + bytes([data[i] ^ (1 << (k % 8))]) + data[i + 1 :]
        elif op == "truncate":
            data = data[:at]
        elif op in ("duplicate_line", "swap_lines", "delete_line"):
            lines = data.split(b"\n")
            i, j = int(where * (len(lines) - 1)), k % len(lines)
            if op == "duplicate_line":
                lines.insert(j, lines[i])
            elif op == "swap_lines":
                lines[i], lines[j] = lines[j], lines[i]
            elif len(lines) > 1:
                del lines[i]
            data = b"\n".join(lines)
        elif op == "insert":
            data = data[:at] + PAYLOADS[k % len(PAYLOADS)] + data[at:]
        elif op == "repeat":
            data = data[:at] + data[at : at + 64] * (1 + k % 200) + data[at:]
        elif op == "invalid_utf8":
            data = data[:at] + b"\xc3\x28\xa0\xa1\xe2\x28\xa1" + data[at:]
        elif op == "lone_cr":
            data = data[:at] + b"\r" + data[at:]
    return data


def log_seeds() -> list[Path]:
    """The seed logs: every file of ``tests/fixtures/logs`` (folders such as the LFS pointer's included as files)."""
    return sorted(p for p in FIXTURES.rglob("*") if p.is_file())


def seeds_with_formats(work: Path) -> list[tuple[Path, str | None]]:
    """The seed logs with their detected formats (``None`` where detection refuses the seed itself), and a
    TensorBoard event file written under ``work`` when tensorboard is installed."""
    from lossparity.parity import LogParseError, detect_format

    seeds: list[tuple[Path, str | None]] = []
    for seed in log_seeds():
        try:
            seeds.append((seed, detect_format(seed)))
        except LogParseError:
            seeds.append((seed, None))
    try:
        import _hostile

        tb = work / "seed" / "events.out.tfevents.1.host"
        tb.parent.mkdir(parents=True)
        tb.write_bytes(_hostile.tb_events({"lm loss": _hostile.LOSSES, "grad norm": _hostile.LOSSES}))
        seeds.append((tb, "tensorboard"))
    except ImportError:  # tensorboard not installed: no TensorBoard seed
        pass
    return seeds


def check_log(path: Path, fmt: str | None) -> str | None:
    """``None`` when reading ``path`` (format ``fmt``, or detected) ends in a Run or a ``LogParseError``;
    otherwise a one-line description of the escape."""
    from lossparity.parity import LogParseError, read_log

    try:
        run = read_log(path, fmt=fmt)
    except LogParseError as e:
        text = str(e)
        if "\n" in text or str(path) not in text:
            return f"LogParseError not one line naming the file: {text[:200]!r}"
        return None
    except ImportError:  # tensorboard not installed: the reader says which package it needs
        return None
    except BaseException as e:  # noqa: BLE001 - every other outcome is an escape
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    for series in [*run.metrics.values(), run.consumed_samples]:
        for step, value in series.items():
            if not isinstance(step, int) or not -(2**53) < step < 2**53 or not isinstance(value, float):
                return f"bad point {step!r}: {value!r}"
    return None


# ---------------------------------------------------------------------------------------------- run folders
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints/latest")


def make_run_folder(folder: Path) -> object:
    """A run folder as a resume finds it (config.json, metrics.jsonl, checkpoints/latest), without training;
    returns the :class:`TrainConfig` that resumes it."""
    from lossparity.training.config import TrainConfig

    cfg = TrainConfig(steps=4, global_batch=4, seq_len=32, out=str(folder), resume=True, tensorboard=False)
    cfg = cfg.resolved()
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, sort_keys=True) + "\n")
    shutil.copy(FIXTURES / "lossparity.jsonl", folder / "metrics.jsonl")
    (folder / "checkpoints" / "latest").write_text("step_00000002.pt")
    return cfg


def check_run_folder(folder: Path, cfg: object) -> str | None:
    """``None`` when the resume checks of ``folder`` and its metrics truncation end in a result or the run
    folder's own errors; otherwise the escape."""
    from lossparity.checkpoint.folder import _latest_note
    from lossparity.input_files import InputFileError
    from lossparity.training.rundir import RunDirError, check_run_dir
    from lossparity.training.runlog import truncate_metrics

    try:
        check_run_dir(cfg)  # type: ignore[arg-type]
        _latest_note(str(folder / "checkpoints"), "step_00000002.pt")
        truncate_metrics(str(folder / "metrics.jsonl"), 2)
    except (RunDirError, InputFileError):
        return None
    except ValueError as e:  # truncate_metrics names path:line
        return None if str(folder) in str(e) and "\n" not in str(e) else f"ValueError without the file: {e}"
    except BaseException as e:  # noqa: BLE001 - every other outcome is an escape
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def fuzz_run_file(base: Path, work: Path, name: str, mutations: Sequence[Mutation]) -> str | None:
    """Copy the run folder ``base`` to ``work``, mutate its file ``name``, check it (:func:`check_run_folder`)."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(base, work)
    cfg = dataclasses.replace(json_config(base), out=str(work))  # type: ignore[type-var]
    target = work / name
    target.write_bytes(mutate(target.read_bytes(), mutations))
    return check_run_folder(work, cfg)


def json_config(folder: Path) -> object:
    from lossparity.training.config import TrainConfig

    saved = json.loads((folder / "config.json").read_text())
    return TrainConfig(**saved)


def random_mutations(rng: random.Random, most: int = 4) -> list[Mutation]:
    """Mutations for the long run (the CI test draws them with hypothesis instead)."""
    return [(rng.choice(OPS), rng.random(), rng.randrange(2**16)) for _ in range(rng.randint(1, most))]


def write_case(work: Path, seed: Path, data: bytes) -> Path:
    """The mutated bytes under the seed's own name (detection may look at a name, e.g. ``*tfevents*``)."""
    target = work / seed.name
    if target.exists() or target.is_symlink():
        os.unlink(target)
    target.write_bytes(data)
    return target
