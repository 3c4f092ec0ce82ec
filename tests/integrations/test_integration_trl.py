"""``class MySFT(LossParityMixin, trl.SFTTrainer)``: padded and padding-free SFT (CPU, offline).

Global batch of 8 rows as (a) batch 8 × GA 1 and (b) batch 2 × GA 4. Padded batches: ``per_sample``;
padding-free batches (TRL flattens a microbatch into one row, ``position_ids`` restarting per example)
and ``packing=True`` (examples packed into rows of 16 tokens first): ``per_document``, one document per
example. Every objective is then the mean over the step's examples of their token means, computed here
by a naive loop over the rows TRL prepared.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402
from _trl_common import naive_mean_of_example_means, run_sft  # noqa: E402


@pytest.mark.parametrize(
    "mode,padding_free,packing",
    [("per_sample", False, False), ("per_document", True, False), ("per_document", False, True)],
)
def test_sft_trainer_objective_is_layout_invariant(tmp_path, mode, padding_free, packing):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pa, la, first = run_sft(str(tmp_path), mode, 8, 1, padding_free=padding_free, packing=packing)
        pb, lb, _ = run_sft(str(tmp_path), mode, 2, 4, padding_free=padding_free, packing=packing)
    finally:
        torch.set_num_threads(n)
    rel = max(float((pa[k] - pb[k]).abs().max() / pa[k].abs().max()) for k in pa)
    assert rel <= 1e-6, rel
    naive = naive_mean_of_example_means(first)
    worst = max(abs(x[0]["objective"] - naive) / naive for x in (la, lb))
    kind = "packed" if packing else "padding-free" if padding_free else "padded"
    print(
        f"measured: TRL SFTTrainer {mode} ({kind}) 2x4 vs 8x1 after 5 steps: params {rel:.1e}; "
        f"step-1 objective {worst:.1e}"
    )
    for logs in (la, lb):
        assert logs[0]["step"] == 1 and logs[0]["objective"] == pytest.approx(naive, rel=1e-5)
    assert [x["objective"] for x in lb if "objective" in x] == pytest.approx(
        [x["objective"] for x in la if "objective" in x], rel=1e-5
    )
