"""``aux_scope`` of ``LossParityTrainer`` with the real ``transformers.Trainer`` on tiny float64 MoE models.

Set-up of issue 22: a dataset of exactly one global batch of 8 unequal rows, learning rate 0, two steps. The
second step's lagged expert fractions are then those of its own batch, so ``global_lagged`` must give, under
every layout (8×1, 2×4, 1×8, 2 gloo ranks × 2×2), the gradient that plain ``transformers.Trainer`` computes
at 8×1 in one step (its aux term on the whole batch): the expected values come from transformers itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_aux_common import moe_model, rows8, run  # noqa: E402

from lossparity.distributed.launch import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TOL = 1e-6  # HF computes its cross-entropy and aux term in float32 internally
KINDS = ("mixtral", "qwen3_moe")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rel(a: dict, b: dict) -> float:
    """Relative L2 distance of the whole gradient ``a`` to ``b``."""
    num = sum(float(((a[n] - b[n]) ** 2).sum()) for n in b)
    return (num / sum(float((b[n] ** 2).sum()) for n in b)) ** 0.5


def _torchrun_2x2(tmp_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / "_hf_aux_common.py")]
    cmd += [str(tmp_path / "out"), ",".join(KINDS), "2", "2", "global_lagged"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp_path / "out.rank0.pt")


def _own_aux(kind: str) -> float:
    """The model's own ``aux_loss`` (transformers' load_balancing_loss_func) on the whole batch."""
    rows = rows8()
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return float(moe_model(kind)(**batch, use_cache=False).aux_loss)


def test_global_lagged_aux_matches_plain_trainer_on_the_whole_batch(tmp_path):
    ranks = _torchrun_2x2(tmp_path)
    for kind in KINDS:
        reference, _ = run(str(tmp_path), kind, 8, 1, 1, None)  # plain transformers.Trainer, 8×1, one step
        own = _own_aux(kind)
        shapes = ((8, 1), (2, 4), (1, 8))
        layouts = {f"{b}x{ga}": run(str(tmp_path), kind, b, ga, 2, "global_lagged") for b, ga in shapes}
        layouts["2 ranks x 2x2"] = ([ranks[kind]["grad"]], ranks[kind]["logs"])
        for name, (grads, logs) in layouts.items():
            dist = _rel(grads[-1], reference[0])
            print(f"measured: {kind} global_lagged {name} step-2 gradient vs plain Trainer 8x1: {dist:.1e}")
            assert dist <= TOL, (kind, name, dist)
            steps = [x for x in logs if "aux_loss" in x]
            assert steps[0]["aux_loss"] == pytest.approx(2.0, rel=1e-12)  # uniform fractions: E·Σ(k/E)·P/R = k
            assert steps[1]["aux_loss"] == pytest.approx(own, rel=TOL), (kind, name)
            assert steps[1]["objective"] == pytest.approx(steps[1]["lm_loss"] + 0.5 * own, rel=TOL)


def test_hf_scope_is_plain_trainer_and_micro_batch_is_not_invariant(tmp_path):
    """``hf`` reproduces plain ``transformers.Trainer`` at 2×4 (aux added once per microbatch); ``microbatch``
    (each microbatch's own fractions) differs from the whole-batch gradient far beyond float32 noise.

    Both loss paths agree to 1e-12 (float64) and reproduce HF to its own float32 rounding: HF's loss casts
    the float64 logits to float32 (``logits.float()``); lossparity computes float64 models in float64."""
    plain, _ = run(str(tmp_path), "mixtral", 2, 4, 1, None)
    ours, _ = run(str(tmp_path), "mixtral", 2, 4, 1, "hf", fused_loss=False)
    fused, _ = run(str(tmp_path), "mixtral", 2, 4, 1, "hf")
    print(f"measured: mixtral hf scope vs plain Trainer (its float32 CE): {_rel(fused[0], plain[0]):.1e}")
    assert _rel(fused[0], ours[0]) <= 1e-12
    assert _rel(ours[0], plain[0]) <= 1e-6 and _rel(fused[0], plain[0]) <= 1e-6
    whole, _ = run(str(tmp_path), "mixtral", 8, 1, 1, None)
    micro, _ = run(str(tmp_path), "mixtral", 2, 4, 2, "microbatch")
    dist = _rel(micro[-1], whole[0])
    print(f"measured: mixtral microbatch 2x4 vs whole batch: {dist:.1e}")
    assert dist > 1e-3


def test_bad_aux_scope_is_rejected(tmp_path):
    from _hf_common import RowDataset, training_args

    from lossparity.integrations.hf import LossParityTrainer

    with pytest.raises(ValueError, match="aux_scope"):
        LossParityTrainer(
            model=moe_model("mixtral"),
            args=training_args(str(tmp_path), 2, 1),
            train_dataset=RowDataset(rows8()),
            aux_scope="sequence",
        )
