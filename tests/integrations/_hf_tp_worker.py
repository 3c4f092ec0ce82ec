"""Tensor parallelism (transformers ``tp_plan="auto"``) under ``LossParityTrainer``: ``torchrun`` entry point
``python _hf_tp_worker.py MODEL_DIR OUT_PREFIX RUNS_JSON`` (2 ranks = TP 2) and the 1-process reference
``run(model_dir, spec, tp=False)``. float64, the tiny Llama of ``_hf_common`` with 2 KV heads (one per TP rank).

Bridge: accelerate 1.x refuses any ``ParallelismConfig`` on a CPU run ("ParallelismConfig is only compatible
DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got
DistributedType.MULTI_CPU"), although the TP model and its DTensor collectives run on gloo; the worker skips
that one validation, the rest of the Trainer is unchanged.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _hf_common import TINY, RowDataset, packed_rows, padded_rows, training_args  # noqa: E402

MODES = ["per_token", "per_sample", "per_microbatch", "per_document", "sample_sum", "sample_sum_norm", "token_sum"]


def save_model(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 2})
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def run(model_dir: str, out_dir: str, mode: str, tp: bool, b: int, ga: int, mtp: int = 0) -> tuple[dict, list]:
    """Two steps of ``mode`` (packed rows for per_document, else padded): (full parameters, log_history).
    ``mtp``: that many transformers ``MtpModel`` layers attached after loading (replicated on the TP ranks),
    convention ``pooled``, λ = 0.3."""
    import transformers

    from lossparity.integrations.hf import LossParityTrainer

    kw = {"tp_plan": "auto"} if tp else {}
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64, **kw)
    if mtp:
        from lossparity.integrations.hf_mtp import attach_mtp

        torch.manual_seed(1)  # the same MTP weights on every rank and in the reference
        attach_mtp(model, mtp)
        model.lossparity_mtp.double()
    rows = (packed_rows() if mode == "per_document" else padded_rows())[:16]
    trainer = LossParityTrainer(
        model=model,
        args=training_args(out_dir, b, ga, 2),
        train_dataset=RowDataset(rows),
        loss_mode=mode,
        fixed_length=12 if mode == "sample_sum_norm" else None,
        mtp_convention="pooled",
        mtp_weight=0.3,
    )
    trainer.train()
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }
    return params, trainer.state.log_history


if __name__ == "__main__":
    import json
    import tempfile

    import accelerate.parallelism_config as apc

    apc.ParallelismConfig._validate_accelerator = lambda self, accelerator: None  # the bridge (module docstring)
    torch.set_num_threads(1)
    results = {}
    for spec in json.loads(sys.argv[3]):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                name = spec["mode"] + ("+mtp" if spec.get("mtp") else "")
                results[name] = run(sys.argv[1], tmp, spec["mode"], True, spec["b"], spec["ga"], spec.get("mtp", 0))
            except ValueError as e:
                results[name] = str(e)
    torch.save(results, f"{sys.argv[2]}.rank{os.environ.get('RANK', '0')}.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
