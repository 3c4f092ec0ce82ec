"""torchrun entry point of the two-process ParityCallback test: ``python _hf_parity_worker.py OUT_DIR``.

Every process trains the same 2-process run twice: first without a callback (its ``log_history`` is the
reference, identical on both processes: the loss is gathered before logging), then with ``ParityCallback``
against that reference with the loss raised 3% from step 4. Each rank saves its final step, the step the
callback stopped at and its verdict steps to ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _hf_common import RowDataset, rows_for, tiny_model, training_args  # noqa: E402

from lossparity.integrations.hf import ParityCallback  # noqa: E402


def main(out: str) -> None:
    import transformers

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))

    def train(sub: str, callbacks: list) -> transformers.Trainer:
        args = training_args(os.path.join(out, f"{sub}{rank}"), 2, 1, 6)
        trainer = transformers.Trainer(
            model=tiny_model("llama"), args=args, train_dataset=RowDataset(rows_for("padded")), callbacks=callbacks
        )
        trainer.train()
        return trainer

    golden = train("golden", [])
    history = [dict(e) for e in golden.state.log_history]
    for e in history:
        if "loss" in e and e["step"] >= 4:
            e["loss"] *= 1.03
    ref = os.path.join(out, f"raised{rank}.json")
    with open(ref, "w") as f:
        json.dump({"log_history": history, "global_step": 6}, f)
    cb = ParityCallback(ref, report_dir=os.path.join(out, "report"))
    run = train("run", [cb])
    result = {
        "global_step": run.state.global_step,
        "stopped_at": cb.stopped_at,
        "verdict_steps": [v.step for v in cb.verdicts],
        "golden_losses": [e["loss"] for e in golden.state.log_history if "loss" in e],
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():  # an orderly end: a group torn down at interpreter exit can abort a rank (SIGABRT)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
