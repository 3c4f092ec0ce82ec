"""Print the size of the three MindFormers 2.0.0 accounting defects on the tiny cases of tests/mindformers
(with each lossparity fix off vs on), and MindFormers' released GA-2 gradient against the global token mean.

Run in the MindSpore venv (./dev.sh builds it): ``.venv-mindspore/bin/python scripts/mindformers_defects.py``.
The data-parallel defect needs 2 workers: its numbers come from ``tests/mindformers/test_mindformers_dp.py``.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "mindformers"
sys.path[:0] = [str(HERE / "stubs"), str(HERE)]
os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="lossparity-mindformers-"))

import numpy as np  # noqa: E402
import test_mindformers_hook as t  # noqa: E402


def main() -> None:
    fixed, released = t._aux_run(2, "lossparity"), t._aux_run(2, "mindformers-2.0.0")
    rel = np.abs(released - fixed) / np.abs(fixed)
    print(f"global_aux_loss, log_interval 2, step 2 (K={t.K}): max relative gap of A_m {rel[t.K :].max():.3e}")
    losses = [2.0e-4, 3.2e-4, 2.48e-4]
    print(
        f"get_index_loss over 3 layers {losses}: fixed {t._index_loss('lossparity', losses):.4e}, "
        f"released {t._index_loss('mindformers-2.0.0', losses):.4e}"
    )
    ref = t.run(t.lm_jobs(t.lpm.segment_ids_from_actual_seq_len(t.Tensor(t.ASL), t.S).asnumpy(), micros=(4,)))
    trainer = t.TinyTrainer(t.TinyLM(t.batch()["logits"]), 2, t.B)
    trainer.training_step(t._inputs(), 0.0, 0.0, 0)
    g, r = trainer.grad.asnumpy(), ref["lm4/per_token/grad"]
    gap, top = np.abs(g - r).max(), np.abs(r).max()
    print(f"released GA 2 gradient vs the global token mean's: max |diff| {gap:.3e} (max |grad| {top:.3e})")


if __name__ == "__main__":
    main()
