"""Issue 27: loading a checkpoint never runs code; contents are validated; CLI notes are printed lines.

A crafted file whose unpickling would run a command (``__reduce__`` returning ``os.system``) replaces the
newest checkpoint (single process) or one rank's ``extra_rank<r>.pt`` / the DCP ``.metadata`` (multi-rank):
``lossparity train --resume`` must not run it, must fall back to the previous intact checkpoint with a note
on stderr naming the file (whatever the warning filters), and must end with the numbers of the
uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import random
import re
import warnings

import numpy as np
import pytest
import torch

from lossparity.checkpoint.checkpointer import CheckpointFormatError, load_latest
from lossparity.checkpoint.folder import RunDirError
from lossparity.cli import main
from lossparity.training.trainer import TrainConfig, Trainer

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md"
_TIMING = re.compile(r', "tokens_per_s": [^,}]*, "step_time_s": [^,}]*')


class _RunsACommand:
    """Unpickling this object runs ``touch <marker>`` (what a malicious checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _argv(out, *extra: str) -> list[str]:
    return [
        "train",
        "--steps",
        "4",
        "--ckpt-interval",
        "2",
        "--global-batch",
        "4",
        "--seq-len",
        "32",
        "--warmup",
        "1",
        "--no-progress",
        "--no-tensorboard",
        "--out",
        str(out),
        *extra,
    ]


def _lines(path) -> list[str]:
    """The metrics lines without the timings (the only keys allowed to differ between runs)."""
    return [_TIMING.sub("", line) for line in pathlib.Path(path).read_text().splitlines()]


def _resume_quietly(argv: list[str], monkeypatch) -> int:
    """``main(argv)`` with every Python warning filtered out, in this process and in spawned ranks."""
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(argv)


def test_crafted_single_process_checkpoint_is_never_unpickled(tmp_path, monkeypatch, capfd):
    out, marker = tmp_path / "run", tmp_path / "MARKER"
    assert main(_argv(out)) == 0
    reference = _lines(out / "metrics.jsonl")
    crafted = out / "checkpoints" / "step_00000004.pt"
    torch.save({"model": _RunsACommand(str(marker)), "step": 4}, crafted)
    pickle.loads(pickle.dumps(_RunsACommand(str(tmp_path / "CONTROL"))))  # the payload does run when unpickled
    assert (tmp_path / "CONTROL").exists()
    capfd.readouterr()

    assert _resume_quietly(_argv(out, "--resume"), monkeypatch) == 0
    err = capfd.readouterr().err
    assert not marker.exists()
    notes = [line for line in err.splitlines() if line.startswith("lossparity train: note: ")]
    assert len(notes) == 2, err
    assert f"checkpoint {crafted} cannot be read" in notes[0] and "posix.system" in notes[0], notes[0]
    assert "falling back to the previous one" in notes[0]
    assert "dropped 2 line(s) after step 2" in notes[1]
    assert _lines(out / "metrics.jsonl") == reference  # resumed from step 2, bit-exact
    assert torch.load(crafted, weights_only=True)["step"] == 4  # the resume wrote a real step 4 again


@pytest.mark.slow
def test_crafted_multi_rank_checkpoint_is_never_unpickled(tmp_path, monkeypatch, capfd):
    out, marker = tmp_path / "run", tmp_path / "MARKER"
    argv = _argv(out, "--dp", "2", "--dtype", "float64")
    assert main(argv) == 0
    reference = _lines(out / "metrics.jsonl")
    crafted = out / "checkpoints" / "step_00000004" / "extra_rank1.pt"
    torch.save({"step": 4, "rng": _RunsACommand(str(marker))}, crafted)
    capfd.readouterr()

    assert _resume_quietly([*argv, "--resume"], monkeypatch) == 0
    err = capfd.readouterr().err
    assert not marker.exists()
    notes = [line for line in err.splitlines() if line.startswith("lossparity train: note: ")]
    assert len(notes) == 2, err  # rank 0 reports once for all ranks
    assert f"checkpoint {crafted.parent} cannot be read" in notes[0] and f"{crafted}" in notes[0], notes[0]
    assert "posix.system" in notes[0] and "dropped 2 line(s) after step 2" in notes[1]
    assert _lines(out / "metrics.jsonl") == reference


def test_notes_are_warnings_for_api_users(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    torch.save({"x": _RunsACommand(str(tmp_path / "MARKER"))}, d / "step_00000002.pt")
    torch.save({"step": 1}, d / "step_00000001.pt")
    with pytest.warns(UserWarning, match="step_00000002.pt cannot be read .*posix.system"):
        assert load_latest(str(d)) == {"step": 1}
    notes: list[str] = []
    assert load_latest(str(d), notify=notes.append) == {"step": 1}
    assert any("step_00000002.pt cannot be read" in n for n in notes)
    assert not (tmp_path / "MARKER").exists()


def _small(**kw) -> TrainConfig:
    base = dict(steps=4, global_batch=4, seq_len=32, packed=True, progress=False, tensorboard=False, warmup=1)
    return TrainConfig(**{**base, **kw})


def test_well_formed_but_wrong_checkpoint_is_skipped_naming_the_entry(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        Trainer(_small(out=str(out), ckpt_interval=1)).fit(crash_after=2)
    newest = out / "checkpoints" / "step_00000002.pt"
    state = torch.load(newest, weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name] = torch.zeros(3, 5)
    torch.save(state, newest)
    renamed = out / "checkpoints" / "step_00000003.pt"  # step 1's file under another step's name
    renamed.write_bytes((out / "checkpoints" / "step_00000001.pt").read_bytes())
    notes: list[str] = []
    t = Trainer(_small(out=str(out), ckpt_interval=1, resume=True), notify=notes.append)
    assert t.restore(str(out / "checkpoints"))
    assert t.step == 1
    assert any(f"{renamed} cannot be read" in n and "named for step 3" in n for n in notes), notes
    assert any(f"{newest} cannot be read (CheckpointFormatError" in n and name in n and "[3, 5]" in n for n in notes)
    # the same state applied directly is refused with a named error before anything changes
    before = {k: v.clone() for k, v in t.raw.state_dict().items()}
    with pytest.raises(CheckpointFormatError, match=re.escape(name)):
        t.load_state_dict(state)
    assert all(torch.equal(v, t.raw.state_dict()[k]) for k, v in before.items())
    assert t.step == 1


def _format1(state: dict) -> dict:
    """The same checkpoint as the previous release wrote it (pickled NumPy array, tuples, config dict)."""
    rng = state["rng"]
    py, npy = rng["python"], rng["numpy"]
    old_rng = {
        "python": (py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"]),
        "numpy": (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        ),
        "torch": rng["torch"],
    }
    old = {k: v for k, v in state.items() if k not in ("format", "version")}
    return {**old, "rng": old_rng, "config": json.loads(state["config"])}


def test_format1_checkpoint_is_refused_with_the_conversion_command_then_converted(tmp_path, capsys):
    ref = Trainer(_small(out=str(tmp_path / "ref"), ckpt_interval=2))
    ref.fit()
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        Trainer(_small(out=str(out), ckpt_interval=2)).fit(crash_after=2)
    path = out / "checkpoints" / "step_00000002.pt"
    new = torch.load(path, weights_only=True)
    torch.save(_format1(new), path)
    with pytest.raises(RunDirError, match="lossparity convert-checkpoint --i-trust-these-files .*step_00000002.pt"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Trainer(_small(out=str(out), ckpt_interval=2, resume=True)).fit()
    assert main(["convert-checkpoint", str(out)]) == 2  # refuses without the explicit trust flag
    assert "--i-trust-these-files" in capsys.readouterr().err
    assert main(["convert-checkpoint", "--i-trust-these-files", str(out)]) == 0
    assert f"{path}: converted" in capsys.readouterr().out
    converted = torch.load(path, weights_only=True)
    assert converted.keys() == new.keys() and converted["config"] == new["config"]
    assert torch.equal(converted["rng"]["numpy"]["keys"], new["rng"]["numpy"]["keys"])
    assert torch.equal(converted["rng"]["python"]["state"], new["rng"]["python"]["state"])
    resumed = Trainer(_small(out=str(out), ckpt_interval=2, resume=True))
    resumed.fit()
    for n, p in ref.raw.named_parameters():
        assert torch.equal(p, dict(resumed.raw.named_parameters())[n]), n
    assert _lines(out / "metrics.jsonl") == _lines(tmp_path / "ref" / "metrics.jsonl")


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    from lossparity.checkpoint.format import rng_state, set_rng_state

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached gaussian in NumPy's state
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected


def test_crafted_sharded_metadata_is_never_unpickled(tmp_path):
    import torch.distributed.checkpoint as dcp

    from lossparity.checkpoint.folder import load_newest_intact, sharded_checkpoint_intact

    for step in (1, 2):
        path = tmp_path / f"step_0000000{step}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save({"w": torch.full((8,), float(step))}, checkpoint_id=str(path), no_dist=True)
        torch.save({"step": step}, path / "extra_rank0.pt")
    marker = tmp_path / "MARKER"
    with open(tmp_path / "step_00000002" / ".metadata", "wb") as f:
        pickle.dump(_RunsACommand(str(marker)), f)
    notes: list[str] = []
    step, _ = load_newest_intact(str(tmp_path), lambda p: sharded_checkpoint_intact(p), notes.append)
    assert step == 1 and not marker.exists()
    assert any("step_00000002 cannot be read" in n and "posix.system" in n for n in notes), notes


def test_launcher_results_live_in_a_private_folder_and_load_weights_only(monkeypatch):
    from _reliability_workers import rank_and_world

    from lossparity.distributed import launch

    seen = []
    original = torch.load

    def spy(path, *args, **kwargs):
        seen.append((os.stat(os.path.dirname(path)).st_mode & 0o777, kwargs.get("weights_only")))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(launch.torch, "load", spy)
    assert launch.spawn(rank_and_world, 2, timeout_s=60) == [(0, 2), (1, 2)]
    assert seen == [(0o700, True), (0o700, True)]


def test_checkpoint_doc_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 2
    ns: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name}-block{i}", "exec"), ns)


def test_format1_extra_rank_file_converts_to_a_valid_format2_one(tmp_path):
    from lossparity.checkpoint.convert import convert_checkpoint
    from lossparity.checkpoint.format import load_weights_only, rng_state, validate_extra_state

    folder = tmp_path / "checkpoints" / "step_00000002"
    folder.mkdir(parents=True)
    old = {
        "step": 2,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "config": {"seed": 0, "mode": "per_token"},
        "mtp_weight": 0.3,
        "world": 2,
    }
    torch.save(old, folder / "extra_rank1.pt")
    with pytest.raises(CheckpointFormatError, match="convert-checkpoint"):
        load_weights_only(str(folder / "extra_rank1.pt"))
    assert convert_checkpoint(str(tmp_path)) == [(str(folder / "extra_rank1.pt"), "converted")]
    new = torch.load(folder / "extra_rank1.pt", weights_only=True)
    validate_extra_state(new, str(folder / "extra_rank1.pt"))
    assert json.loads(new["config"]) == old["config"] and (new["step"], new["world"]) == (2, 2)
    now = rng_state()
    assert torch.equal(new["rng"]["python"]["state"], now["python"]["state"])  # same generator state
    assert torch.equal(new["rng"]["numpy"]["keys"], now["numpy"]["keys"])
    assert convert_checkpoint(str(folder)) == [(str(folder / "extra_rank1.pt"), "already format 2")]


def test_flat_shapes_match_dcp_keys():
    """The keys and shapes the sharded-checkpoint check expects are those torch.distributed.checkpoint
    stores: compared with torch's own (private) flattening on a model + AdamW state with lists inside."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from lossparity.checkpoint.checkpointer import _flat_shapes

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": [torch.zeros(2), {"t": torch.ones(1, 5)}]}
    flat, _ = flatten_state_dict(state)
    expected = {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert _flat_shapes(state) == expected
    assert "model.0.weight" in expected and expected["model.0.weight"] == (4, 3)
