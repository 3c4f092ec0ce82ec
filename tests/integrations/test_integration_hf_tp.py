"""Tensor parallelism in ``LossParityTrainer`` (transformers ``tp_plan="auto"``, 2 gloo ranks = TP 2, float64):
every mode's parameters after 2 steps (and per_document with 2 attached MTP layers) and step-1 objective
equal the 1-process run's (the expected values come from transformers' own single-process model and Trainer,
not from a lossparity layout), the loss is not scaled by the TP size; context and sequence parallelism are
refused with their reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_common import RowDataset, padded_rows, tiny_model, training_args  # noqa: E402
from _hf_tp_worker import MODES, run, save_model  # noqa: E402

from lossparity.distributed.launch import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


@pytest.mark.slow
def test_tp2_equals_one_process_for_every_mode(tmp_path):
    torch.set_num_threads(1)
    model_dir = str(tmp_path / "model")
    save_model(model_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]), OMP_NUM_THREADS="1")
    specs = [{"mode": m, "b": 2, "ga": 4} for m in MODES] + [{"mode": "per_document", "b": 2, "ga": 4, "mtp": 2}]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / "_hf_tp_worker.py")]
    cmd += [model_dir, str(tmp_path / "out"), json.dumps(specs)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"out.rank{r}.pt") for r in range(2)]
    for spec in specs:
        mode, name = spec["mode"], spec["mode"] + ("+mtp" if spec.get("mtp") else "")
        # the same microbatches in one process
        ref_params, ref_logs = run(model_dir, str(tmp_path / "ref"), mode, False, 2, 4, spec.get("mtp", 0))
        for rank in ranks:
            assert not isinstance(rank[name], str), rank[name]
            params, logs = rank[name]
            rel = max(float((params[n] - p).abs().max() / p.abs().max()) for n, p in ref_params.items())
            print(f"measured: HF TP 2 {name} vs 1 process (2x4): params after 2 steps {rel:.1e}")
            assert rel <= 1e-10, (name, rel)
            for key in ("objective", "loss"):  # HF's own logged loss too: not scaled by the TP size
                assert logs[0][key] == pytest.approx(ref_logs[0][key], rel=1e-7), (name, key)


@pytest.mark.parametrize("dim", ["cp", "sp"])
def test_context_and_sequence_parallelism_are_refused_with_the_reason(tmp_path, dim):
    from lossparity.integrations.hf import LossParityTrainer

    class Sized(LossParityTrainer):  # the sizes transformers' Trainer reads from accelerate's ParallelismConfig
        def get_cp_size(self):
            return 2 if dim == "cp" else 1

        def get_sp_size(self):
            return 2 if dim == "sp" else 1

    trainer = Sized(
        model=tiny_model(), args=training_args(str(tmp_path), 2, 1, 1), train_dataset=RowDataset(padded_rows())
    )
    reason = "_scaled_dot_product_flash_attention_for_cpu" if dim == "cp" else "deepspeed_sp_compute_loss"
    with pytest.raises(ValueError, match=f"^parallelism_config.{dim}_size=2: .*{reason}"):
        trainer.train()
