"""Mutation fuzzing of sample dumps, ``lossparity gap`` and sharded checkpoints (issue 50), shared by
``tests/test_fuzz_inputs.py`` (a fixed budget in CI) and ``scripts/fuzz_inputs.py`` (a longer run).

Escapes, by engine:

- *dump* (a mutated rank file, ``samples_meta.json`` or ``.npz``): reading it (``read_sample_meta``,
  ``read_sample_dump``) and truncating it as a resume does (``truncate_records``) must return or raise
  ``SampleDumpError`` (one line naming a file of the dump);
- *gap* (the same mutations, and a mutated ``metrics.jsonl`` beside the dump): ``lossparity gap`` must exit 0,
  1 or 2, and with 2 print one stderr line naming a file of the run folder, never a traceback;
- *sharded* (a mutated ``.metadata``, ``__0_0.distcp`` or ``extra_rank0.pt`` of the newest of two DCP
  checkpoints, loaded in a one-rank gloo group): the load must end with one of the two checkpoints (the older
  when the newer is refused, with one note naming it and never torch's ``weights_only`` advice).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from _fuzz import Mutation, mutate

DUMP_FILES = (
    "samples/samples_rank0.bin",
    "samples/samples_rank1.bin",
    "samples/samples_meta.json",
    "dump.npz",
)
GAP_FILES = (*DUMP_FILES, "metrics.jsonl")
SHARDED_FILES = (".metadata", "__0_0.distcp", "extra_rank0.pt")


def make_dump_folder(folder: Path) -> None:
    """A run folder with a 2-rank dump of 3 steps (global batch 4, two rows per rank), its description, the
    run's ``metrics.jsonl`` and the same records as ``dump.npz``."""
    import numpy as np

    from lossparity.parity.sample_dump import write_sample_meta

    samples = folder / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    rows = {0: [], 1: []}  # type: dict[int, list[tuple[float, float, float, float]]]
    for step in (1, 2, 3):
        for row in range(4):
            rows[row // 2].append((step, row, 1 + (row * step) % 5, 0.5 * row + step))
    for rank, recs in rows.items():
        (samples / f"samples_rank{rank}.bin").write_bytes(b"".join(struct.pack("<4d", *r) for r in recs))
    write_sample_meta(samples, global_batch=4, microbatch_size=2, seq_len=8, mode="per_token", world_size=2)
    lines = "".join(json.dumps({"step": s, "objective": 2.0 / s, "lm_loss": 2.0 / s}) + "\n" for s in (1, 2, 3))
    (folder / "metrics.jsonl").write_text(lines)
    allrec = np.array(rows[0] + rows[1], dtype=np.float64)
    np.savez(folder / "dump.npz", step=allrec[:, 0], row=allrec[:, 1], n=allrec[:, 2], s=allrec[:, 3])


def _copy_mutated(base: Path, work: Path, name: str, mutations: Sequence[Mutation]) -> Path:
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(base, work)
    target = work / name
    target.write_bytes(mutate(target.read_bytes(), mutations))
    return target


def _one_line_naming(text: str, folder: Path) -> bool:
    return "\n" not in text.strip() and str(folder) in text and "Traceback" not in text


def fuzz_dump(base: Path, work: Path, name: str, mutations: Sequence[Mutation]) -> str | None:
    """Mutate the dump file ``name`` of a copy of ``base``; ``None`` when every reader ends as it must."""
    from lossparity.parity.sample_dump import SampleDumpError, read_sample_dump, read_sample_meta, truncate_records

    target = _copy_mutated(base, work, name, mutations)
    source = target if name.endswith(".npz") else work / "samples"
    try:
        read_sample_meta(source)
        read_sample_dump(source, [])
        if name.endswith(".bin"):
            truncate_records(str(target), 2)
    except SampleDumpError as e:
        return None if _one_line_naming(str(e), work) else f"SampleDumpError not one line naming a file: {e}"
    except BaseException as e:  # noqa: BLE001 - every other outcome is an escape
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def fuzz_gap(base: Path, work: Path, name: str, mutations: Sequence[Mutation]) -> str | None:
    """``lossparity gap`` (in this process) on a copy of ``base`` whose file ``name`` is mutated."""
    from lossparity.cli import main

    target = _copy_mutated(base, work, name, mutations)
    source = target if name.endswith(".npz") else work
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["gap", str(source), "--bootstrap", "16"])
    except BaseException as e:  # noqa: BLE001 - every other outcome is an escape
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    text = err.getvalue()
    if code not in (0, 1, 2):
        return f"exit {code}: {text[-200:]!r}"
    if code == 2 and not _one_line_naming(text, work):
        return f"exit 2 without one line naming a file: {text[-300:]!r}"
    if "Traceback" in text:
        return f"a traceback: {text[-300:]!r}"
    return None


# ---------------------------------------------------------------------------------------------- sharded
@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group on 127.0.0.1 (a free port, a bounded timeout), destroyed on exit."""
    import datetime

    import torch.distributed as dist

    from lossparity.distributed.launch import free_port

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state(step: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(6, 5, generator=g, dtype=torch.float64), "b": torch.randn(5, generator=g)},
        "optim": {"state": {"w": {"exp_avg": torch.randn(6, 5, generator=g, dtype=torch.float64)}}},
    }


def _extra(step: int) -> dict:
    from lossparity.checkpoint.format import FORMAT, VERSION, rng_state

    config = json.dumps({"steps": 2})
    return {"format": FORMAT, "version": VERSION, "step": step, "rng": rng_state(), "config": config} | {
        "mtp_weight": 0.0,
        "world": 1,
    }


def make_sharded(ckpt_dir: Path) -> None:
    """Two DCP checkpoints (steps 1 and 2) of a small state in ``ckpt_dir`` (inside :func:`one_rank_group`)."""
    from lossparity.checkpoint.checkpointer import save_sharded_checkpoint

    for step in (1, 2):
        save_sharded_checkpoint(str(ckpt_dir), step, None, None, _extra(step), state=_state(step))


def fuzz_sharded(base: Path, work: Path, name: str, mutations: Sequence[Mutation]) -> str | None:
    """Load the newest intact checkpoint of a copy of ``base`` whose ``step_00000002/<name>`` is mutated
    (inside :func:`one_rank_group`): step 2 as saved, or step 1 with one note naming step 2."""
    import torch

    from lossparity.checkpoint.checkpointer import load_sharded_latest

    _copy_mutated(base, work, f"step_00000002/{name}", mutations)
    target = _state(0)  # the state to load into, zeroed: what a load leaves there is what it read
    for group in (target["model"], target["optim"]["state"]["w"]):
        for t in group.values():
            t.zero_()
    notes: list[str] = []
    try:
        extra = load_sharded_latest(str(work), None, None, state=target, notify=notes.append)
    except BaseException as e:  # noqa: BLE001 - every other outcome is an escape (an intact step 1 is there)
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if extra is None or extra.get("step") not in (1, 2):
        return f"loaded {extra!r}"
    bad = [n for n in notes if "\n" in n or "weights_only" in n or "Traceback" in n]
    if bad:
        return f"a note that is not one clean line: {bad[0][:300]!r}"
    if extra["step"] == 1:
        if not any("step_00000002" in n for n in notes):
            return f"fell back without a note naming step_00000002: {notes!r}"
        if not torch.equal(target["model"]["w"], _state(1)["model"]["w"]):
            return "fell back to step 1 but its tensors were not loaded"
    return None
