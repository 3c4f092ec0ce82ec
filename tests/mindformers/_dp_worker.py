"""One rank of the 2-worker data-parallel run (``msrun --worker_num=2``, MindSpore's ``mccl`` CPU backend).

Rank ``r`` holds rows ``[4r, 4r+4)`` of the 8-row batch of ``_data.py`` and runs, with lossparity installed:
every mode at GA 2 (its gradient w.r.t. the whole logits table after the data-parallel sum, the objective log,
MindFormers' averaged loss), and one step of K=2 microbatches of a real ``TopKRouter`` with ``global_aux_loss``
with the DP fix on and off. Writes ``OUT/rank{r}.npz``.
"""

from __future__ import annotations

import os
import sys

import mindspore as ms
import numpy as np

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
sys.path[:0] = [os.path.join(os.path.dirname(__file__), "stubs"), os.path.dirname(__file__)]

import _cpu_ops  # noqa: E402
from mindspore import Tensor  # noqa: E402
from mindspore.communication import get_rank, init  # noqa: E402

_cpu_ops.enable()
from _data import ASL, B, S, batch  # noqa: E402
from _tiny import TinyLM, TinyMoELM, TinyTrainer, moe_config  # noqa: E402

import lossparity.mindformers as lpmf  # noqa: E402

E, TOPK, COEFF, K, WORLD = 4, 2, 0.01, 2, 2


def main(out_dir: str) -> None:
    init("mccl")
    rank = get_rank()
    rows = np.arange(rank * B // WORLD, (rank + 1) * B // WORLD, dtype=np.int32)
    x = batch()
    inputs = {
        "input_ids": Tensor(np.ones((len(rows), S), np.int32)),
        "labels": Tensor(x["labels"][rows]),
        "loss_mask": Tensor(x["mask"][rows]),
        "row_index": Tensor(rows),
        "actual_seq_len": Tensor(ASL[rows]),
    }
    out: dict[str, np.ndarray] = {}
    for mode in ("per_token", "per_sample", "per_document"):
        trainer = TinyTrainer(TinyLM(x["logits"]), K, len(rows), world=WORLD)
        handle = lpmf.install(trainer, mode)
        loss, _ = trainer.training_step(inputs, 0.0, 0.0, 0)
        out[f"{mode}/grad"] = trainer.grad.asnumpy()
        out[f"{mode}/objective"] = handle.logs["lossparity/lm_objective"].asnumpy()
        out[f"{mode}/loss"] = np.asarray(loss.asnumpy()).reshape(())
    rng = np.random.default_rng(5)
    probs = rng.dirichlet(np.ones(E), (B, S)).astype(np.float32)
    routing = np.zeros_like(probs, dtype=np.int32)
    np.put_along_axis(routing, np.argsort(-probs, -1)[..., :TOPK], 1, -1)
    for fixes in ("lossparity", "mindformers-2.0.0"):
        model = TinyMoELM(x["logits"], probs, routing, moe_config(E, TOPK, COEFF))
        trainer = TinyTrainer(model, K, len(rows), world=WORLD)
        lpmf.install(trainer, "per_sample", fixes=fixes)
        trainer.training_step(inputs, 0.0, 0.0, 0)
        out[f"aux/{fixes}"] = np.array(model.aux)
    out["aux/probs"], out["aux/routing"] = probs, routing
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)


if __name__ == "__main__":
    main(os.environ["LOSSPARITY_DP_OUT"])
