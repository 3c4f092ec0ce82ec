"""``lossparity audit`` on real stacks: hand-written loops whose normalization is known by construction,
the installed ``transformers.Trainer`` (plain, a model without loss kwargs, per-rank token counts), TRL's
``SFTTrainer``, and cross-entropy kernels. Each test asserts the named mode and the verdict; the expected
names come from how each stack is written (tests/audit/_stacks.py), not from the audit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from lossparity.audit import HandLoop, TrainerFactory, audit, audit_kernel, render  # noqa: E402

HERE = Path(__file__).resolve().parent
STACKS = str(HERE / "_stacks.py")
SRC = HERE.parents[1] / "src"

pytestmark = pytest.mark.frameworks


def _names(report) -> dict[str, str]:
    return {r.config: (r.found.name if r.found else r.skipped) for r in report.rows}


def _hand(step: str, **kw) -> HandLoop:
    return HandLoop(model=f"{STACKS}:tiny_llama", step=f"{STACKS}:{step}", **kw)


@pytest.mark.multiprocess
def test_global_token_mean_loop_is_per_token_at_every_layout():
    report = audit(_hand("global_token_mean"), classes=["ga", "dp"], expect="per_token")
    assert set(_names(report).values()) == {"per_token"}, render(report)
    assert report.invariant and report.as_expected and report.exit_code == 0
    assert all(r.vs_reference <= 1e-5 for r in report.rows)
    assert all(r.log_matches for r in report.rows), render(report)  # it logs the token mean it optimizes


def test_mean_over_ga_loop_is_per_microbatch_and_breaks_at_ga():
    report = audit(_hand("mean_over_ga"), classes=["ga", "recompute"], expect="per_token")
    names = _names(report)
    assert names["D1 K1 b8"] == "per_token"  # one microbatch: the two modes coincide
    assert names["K2 b4"] == names["K4 b2"] == names["K2 b4 +recompute"] == "per_microbatch", render(report)
    assert report.first_broken == "ga" and report.exit_code == 1
    k2 = next(r for r in report.rows if r.config == "K2 b4")
    assert k2.vs_reference > 0.05  # the mean of 2 microbatch means on ragged rows, far from the token mean
    assert "NOT INVARIANT: first broken class 'ga'" in render(report)


def test_per_sample_over_nonempty_rows_is_named_with_its_factor():
    report = audit(_hand("per_sample_nonempty"), classes=["ga"])
    assert set(_names(report).values()) == {"per_sample × 8/7"}, render(report)
    assert all(abs(r.found.factor - 8 / 7) < 1e-4 for r in report.rows)
    assert report.invariant and report.exit_code == 0  # invariant, but not the mode: --expect catches it
    assert audit(_hand("per_sample_nonempty"), classes=[], expect="per_sample").exit_code == 1


@pytest.mark.multiprocess
def test_a_loop_without_gradient_reduction_loses_rank_1():
    report = audit(_hand("no_reduction", wrap_ddp=False), classes=["dp"])
    names = _names(report)
    assert names["D2 K1 b4"] == "per_token; rank 0's rows × 1, rank 1's rows × 0", render(report)
    assert report.first_broken == "dp"


@pytest.mark.multiprocess
def test_plain_trainer_is_per_token_and_invariant():
    report = audit(TrainerFactory(f"{STACKS}:trainer_factory"), classes=["ga", "microbatch", "dp"])
    assert set(_names(report).values()) == {"per_token"}, render(report)
    assert report.invariant and all(r.log_matches for r in report.rows)


def test_trainer_with_a_model_without_loss_kwargs_is_per_microbatch():
    report = audit(TrainerFactory(f"{STACKS}:trainer_no_loss_kwargs"), classes=["ga"])
    names = _names(report)
    assert names["K2 b4"] == names["K4 b2"] == "per_microbatch", render(report)
    assert report.first_broken == "ga"


@pytest.mark.multiprocess
def test_trainer_without_token_averaging_across_devices_is_per_rank():
    report = audit(TrainerFactory(f"{STACKS}:trainer_local_tokens"), classes=["dp"])
    names = _names(report)
    # one microbatch per rank: each rank's token mean is its microbatch's mean
    assert names["D2 K1 b4"] == "per_microbatch", render(report)
    assert names["D2 K2 b2"] == "per_rank", render(report)
    assert report.first_broken == "dp"


def test_trl_sft_trainer_with_completion_loss_is_per_token():
    report = audit(TrainerFactory(f"{STACKS}:sft_factory"), classes=["ga"], expect="per_token")
    assert set(_names(report).values()) == {"per_token"}, render(report)
    assert report.exit_code == 0


def test_kernel_audit_passes_torch_and_finds_the_first_token_upstream_bug():
    sys.path.insert(0, str(HERE))
    try:
        import _stacks
    finally:
        sys.path.remove(str(HERE))
    good = audit_kernel(_stacks.good_kernel)
    assert good.exit_code == 0 and all(c.passed for c in good.checks)
    bad = audit_kernel(_stacks.first_token_kernel)
    failed = [c.name for c in bad.checks if not c.passed]
    assert failed == ["reduction=none: losses, per-token upstream weights"]
    assert bad.checks[0].value_err < 1e-5 and bad.checks[0].grad_err > 0.1  # right losses, wrong gradient
    linear = audit_kernel(
        lambda h, w, y, reduction, ignore_index: _stacks.good_kernel(h @ w.T, y, reduction), kind="linear"
    )
    assert linear.exit_code == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "lossparity", "audit", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_cli_exit_codes_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    p = _cli(
        "--step", f"{STACKS}:mean_over_ga", "--model", f"{STACKS}:tiny_llama", "--classes", "ga", "--json", str(out)
    )
    assert p.returncode == 1, p.stderr
    assert "| K2 b4 | ga | per_microbatch |" in p.stdout
    data = json.loads(out.read_text())
    assert data["first_broken"] == "ga" and data["exit_code"] == 1

    def cli(*args: str) -> tuple[int, str, str]:  # the same CLI in this process (no interpreter start)
        from lossparity.cli import main

        code = main(["audit", *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, _, err = cli("--step", f"{STACKS}:raising_step", "--model", f"{STACKS}:tiny_llama", "--classes", "ga")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the user's step failed" in err and "_stacks.py:" in err  # the user's file and line
    code, _, err = cli("--step", f"{STACKS}:nope", "--model", f"{STACKS}:tiny_llama")
    assert code == 2 and "has no attribute 'nope'" in err and len(err.strip().splitlines()) == 1
    code, out, _ = cli("--kernel", f"{STACKS}:first_token_kernel")
    assert code == 1 and "FAIL" in out
    code, _, err = cli("--trainer", f"{STACKS}:trainer_factory", "--classes", "gaa")
    assert code == 2 and "unknown class 'gaa'" in err


def _local_step(model, microbatches, ctx):
    for mb in microbatches:
        model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], labels=mb["labels"]).loss.backward()


def test_a_callable_a_worker_cannot_import_makes_the_2_rank_classes_incomplete():
    def step(model, microbatches, ctx):  # defined inside a function: no worker process can import it
        _local_step(model, microbatches, ctx)

    report = audit(HandLoop(model=f"{STACKS}:tiny_llama", step=step), classes=["dp"])
    assert report.exit_code == 2
    assert [r.config for r in report.incomplete] == ["D2 K1 b4", "D2 K2 b2"]
    assert "not importable by a worker process" in report.incomplete[0].skipped
    assert "INCOMPLETE: 2 configuration(s) could not run" in render(report)


def test_docs_audit_page_block_runs(capsys):
    import re

    page = (HERE.parents[1] / "docs" / "audit.md").read_text()
    block = re.findall(r"```python\n(.*?)```", page, re.S)[0]
    exec(compile(block, "docs/audit.md", "exec"), {"__name__": "docs_audit"})
    out = capsys.readouterr().out
    assert "| K2 b4 | ga | per_microbatch |" in out and "first broken class 'ga'" in out


@pytest.mark.multiprocess
def test_trainer_moe_aux_term_grows_with_ga_and_ranks():
    """transformers #48690: the Trainer multiplies the loss by the world size to undo DDP's averaging of a
    token-normalized loss, and the model adds its router aux term to that loss: the aux weight is the
    reference's × D; under GA every microbatch's aux is added whole (× K) instead of averaged."""
    report = audit(TrainerFactory(f"{STACKS}:trainer_mixtral"), classes=["ga", "dp"])
    got = {r.config: (r.found.name, r.aux) for r in report.rows}
    assert got == {
        "D1 K1 b8": ("per_token", "aux × 1"),
        "K2 b4": ("per_token", "aux × 2"),
        "K4 b2": ("per_token", "aux × 4"),
        "D2 K1 b4": ("per_token", "aux × 2"),
        "D2 K2 b2": ("per_token", "aux × 4"),
    }, render(report)
    assert all(r.found.residual < 1e-5 for r in report.rows)  # with the aux columns the fit is exact again
    assert report.first_broken == "ga"
