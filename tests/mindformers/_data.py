"""The batch every MindSpore/MindFormers test uses: ragged rows (a full row, a row without targets, a one-token
row), packed rows given as MindFormers' ``actual_seq_len``, random float32 logits."""

from __future__ import annotations

import numpy as np

B, S, V = 8, 12, 17
# loss-bearing tokens per row: a full row, a row without targets, a one-token row, ragged rows
LENGTHS = (12, 0, 7, 1, 12, 5, 9, 3)
# MindFormers' actual_seq_len per row: document ends, padded with S (3 slots); rows 2, 4 and 6 hold 2–3 documents
ASL = np.array(
    [[12, 12, 12], [12, 12, 12], [4, 12, 12], [12, 12, 12], [3, 8, 12], [12, 12, 12], [6, 12, 12], [12, 12, 12]],
    np.int32,
)
DOCUMENTS = 12  # 1+1+2+1+3+1+2+1, counted by hand from ASL


def batch(seed: int = 0) -> dict[str, np.ndarray]:
    """``logits [B, S, V]``, ``labels [B, S]`` and ``mask [B, S]`` (float32 0/1, the first LENGTHS[i] positions)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, S), np.float32)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    return {
        "logits": rng.normal(0.0, 2.0, (B, S, V)).astype(np.float32),
        "labels": rng.integers(0, V, (B, S)).astype(np.int32),
        "mask": mask,
    }


def lm_jobs(segment_ids: np.ndarray, micros: tuple[int, ...] = (8, 4, 2)) -> dict[str, np.ndarray]:
    """The torch-reference jobs (``_torch_ref.py``) of :func:`batch` for microbatches of ``micros`` rows."""
    x = batch()
    jobs: dict[str, np.ndarray] = {}
    for micro in micros:
        name = f"lm{micro}"
        jobs.update({f"job/{name}/{k}": v for k, v in x.items()})
        jobs[f"job/{name}/segment_ids"] = segment_ids
        jobs[f"job/{name}/microbatch_rows"] = np.array(micro)
        jobs[f"job/{name}/kind"] = np.array("lm")
    return jobs
