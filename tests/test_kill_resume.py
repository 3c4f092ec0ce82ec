"""A multi-rank ``--resume`` that finds no checkpoint yet must start exactly like a new run.

``benchmarks/kill_resume.py --dp 2`` found trials that differed from the uninterrupted run from step 2
on: the first run was killed after logging step 1 but before its first checkpoint was renamed into place,
so the resume found no checkpoint and started from step 0. Building the layout-independent state to load
into (``get_optimizer_state_dict``) had run torch's ``_init_optim_state``, a zero-lr AdamW step that
leaves ``step = 1`` in the optimizer state: the first real step then used the bias correction of step 2.
The tests craft that on-disk state instead of relying on the timing of a kill.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import warnings

import pytest
import torch
from torch import nn

from lossparity.checkpoint.checkpointer import Checkpointer
from lossparity.cli import main
from lossparity.training.config import TrainConfig


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)


def test_multi_rank_restore_without_checkpoint_leaves_the_optimizer_fresh(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    twin = nn.Linear(4, 3).double()
    twin.load_state_dict(model.state_dict())
    opt, twin_opt = _adamw(model), _adamw(twin)
    # world=2: the multi-rank (DCP) path; an empty folder is decided without any collective.
    ckpt = Checkpointer(model, opt, [], TrainConfig(), world=2)
    assert ckpt.restore(str(tmp_path / "checkpoints")) is None
    assert not opt.state  # before the fix: AdamW state with step = 1

    # The first real step equals the one of an optimizer nobody touched (independent reference).
    x = torch.randn(5, 4, dtype=torch.float64)
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).square().sum().backward()
        o.step()
    assert float(opt.state[model.weight]["step"]) == 1.0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def _argv(out: pathlib.Path, *extra: str) -> list[str]:
    return [
        "train",
        "--steps",
        "2",
        "--dp",
        "2",
        "--global-batch",
        "4",
        "--seq-len",
        "32",
        "--packed",
        "--ckpt-interval",
        "1",
        "--no-progress",
        "--no-tensorboard",
        "--out",
        str(out),
        *extra,
    ]


def _numbers(path: pathlib.Path) -> list[dict]:
    timings = {"tokens_per_s", "step_time_s"}
    return [{k: v for k, v in json.loads(x).items() if k not in timings} for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_dp2_resume_after_a_kill_before_the_first_checkpoint_is_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    ref, run = tmp_path / "ref", tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(_argv(ref)) == 0
        # What a SIGKILL during the first checkpoint write leaves: the configuration, the metrics line of
        # step 1 plus a torn one, the unfinished DCP folder and no checkpoint under a final name.
        run.mkdir()
        shutil.copy(ref / "config.json", run / "config.json")
        first = (ref / "metrics.jsonl").read_text().splitlines()[0]
        (run / "metrics.jsonl").write_text(first + "\n" + '{"step": 2, "lm_lo')
        shutil.copytree(ref / "checkpoints" / "step_00000001", run / "checkpoints" / ".tmp-step_00000001")
        (run / "checkpoints" / ".tmp-step_00000001" / "extra_rank1.pt").unlink()
        assert main(_argv(run, "--resume")) == 0
    assert _numbers(run / "metrics.jsonl") == _numbers(ref / "metrics.jsonl")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001", "step_00000002"]
