"""Run MaxText 0.2.5's own ``train.main`` in this process on a tiny float32 model, with a fixed batch
fed through MaxText's data-iterator hook, and return the rows of its ``metrics_file``.

Test bridges (never used by the library): ``create_data_iterator`` is replaced for the run so that the
batch can hold a row with no target and a one-token row (MaxText's synthetic data has neither), and the
main / MTP cross-entropy functions and the MLA indexer loss can report their inputs or outputs through
``jax.debug.callback`` for an independent NumPy recomputation (``xent64``, ``per_sample64`` here).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from maxtext.configs import pyconfig  # noqa: F401 (imported first, as MaxText's own entry point does)
from maxtext.input_pipeline import input_pipeline_interface
from maxtext.layers import attention_mla, multi_token_prediction
from maxtext.trainers.pre_train import train
from maxtext.utils import max_utils

import lossparity.maxtext as lpm

BASE_YML = os.path.join(os.path.dirname(train.__file__), "..", "..", "configs", "base.yml")
V, S = 256, 64
LENGTHS = (64, 48, 0, 8, 64, 1, 32, 16)  # target tokens per row: a row with none and a one-token row

MODEL = [
    "dataset_type=synthetic",
    f"max_target_length={S}",
    "base_emb_dim=64",
    "base_num_query_heads=2",
    "base_num_kv_heads=2",
    "base_mlp_dim=128",
    "base_num_decoder_layers=2",
    "head_dim=32",
    f"vocab_size={V}",
    "dtype=float32",
    "enable_checkpointing=false",
    "attention=dot_product",
    "per_device_batch_size=8",
    "packing=false",
    "enable_dropout=false",
]

# A DeepSeek-V3.2-style model on top of MODEL: MLA attention with the sparse-attention indexer (top 16 of the
# 64 keys) in its sparse training stage, both layers dense; add indexer_loss_scaling_factor=λ to train it.
INDEXER = [
    "decoder_block=deepseek",
    "attention_type=mla",
    "first_num_dense_layers=2",
    "q_lora_rank=16",
    "kv_lora_rank=16",
    "qk_nope_head_dim=16",
    "qk_rope_head_dim=16",
    "v_head_dim=16",
    "use_indexer=true",
    "indexer_n_heads=2",
    "indexer_head_dim=32",
    "indexer_topk=16",
    "indexer_sparse_training=true",
]


def xent64(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per-token cross-entropy ``logsumexp(x) - x[target]`` in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(x - m).sum(axis=-1))
    return lse - np.take_along_axis(x, targets[..., None].astype(np.int64), axis=-1)[..., 0]


def per_sample64(xent: np.ndarray, mask: np.ndarray) -> float:
    """``(1/B) Σ_i Σ_t x_it m_it / max(n_i, 1)`` in float64."""
    s = (xent * mask).sum(axis=1)
    n = mask.sum(axis=1)
    return float(np.mean(s / np.maximum(n, 1)))


def ragged_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """8 rows × 64: row i has LENGTHS[i] loss-bearing targets (targets_segmentation 1, then 0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(len(LENGTHS), S + 1)).astype(np.int32)
    tseg = np.zeros((len(LENGTHS), S), np.int32)
    for i, n in enumerate(LENGTHS):
        tseg[i, :n] = 1
    pos = np.broadcast_to(np.arange(S, dtype=np.int32), (len(LENGTHS), S)).copy()
    return {
        "inputs": tokens[:, :-1].copy(),
        "inputs_position": pos,
        "inputs_segmentation": np.ones((len(LENGTHS), S), np.int32),
        "targets": tokens[:, 1:].copy(),
        "targets_position": pos.copy(),
        "targets_segmentation": tseg,
    }


def packed_batch(seed: int = 1) -> dict[str, np.ndarray]:
    """8 packed rows: documents numbered 1, 2, 3 per row with ragged lengths; some targets masked."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(8, S + 1)).astype(np.int32)
    seg = np.ones((8, S), np.int32)
    pos = np.zeros((8, S), np.int32)
    for i in range(8):
        cuts = sorted(rng.choice(np.arange(1, S), size=2, replace=False))
        for j, (a, b) in enumerate(zip([0, *cuts], [*cuts, S]), start=1):
            seg[i, a:b] = j
            pos[i, a:b] = np.arange(b - a)
    tseg = seg.copy()
    tseg[2, :] = 0  # a row with no target at all
    tseg[5, 1:] = 0  # a one-token row
    tseg[0, S - 20 :] = 0  # a masked tail
    return {
        "inputs": tokens[:, :-1].copy(),
        "inputs_position": pos,
        "inputs_segmentation": seg,
        "targets": tokens[:, 1:].copy(),
        "targets_position": pos.copy(),
        "targets_segmentation": tseg,
    }


class _Fixed:
    """The same batch at every step (MaxText's loader device_puts it with the data sharding)."""

    def __init__(self, batch: dict[str, np.ndarray]) -> None:
        self.batch = batch

    def __iter__(self) -> _Fixed:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.batch.items()}

    def reset(self) -> None:
        pass


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def run(
    args: list[str],
    *,
    mode: str | None = None,
    batch: dict[str, np.ndarray] | None = None,
    steps: int = 1,
    capture: bool = False,
) -> dict[str, Any]:
    """One MaxText run; ``mode=None`` is MaxText untouched. Returns ``{"metrics": rows, "logits": [...],
    "mtp": [...], "indexer": [...]}`` (captured arrays only with ``capture``; ``indexer``: one
    ``(indexer_score, query, key, indexer_mask)`` per call of MaxText's ``calculate_indexer_loss``, a layer's
    forward recomputed in the backward pass (remat) reporting again)."""
    batch = ragged_batch() if batch is None else batch
    captured: dict[str, list[Any]] = {"logits": [], "mtp": [], "indexer": []}
    real_xent = max_utils.cross_entropy_with_logits
    real_mtp = multi_token_prediction._cross_entropy_with_integer_labels
    real_indexer_loss = attention_mla.MLA.calculate_indexer_loss

    def xent_bridge(logits, targets, z_loss=0.0):  # noqa: ANN001, ANN202
        jax.debug.callback(lambda x: captured["logits"].append(np.asarray(x)), logits)
        return real_xent(logits, targets, z_loss=z_loss)

    def mtp_bridge(logits, labels):  # noqa: ANN001, ANN202
        out = real_mtp(logits, labels)
        jax.debug.callback(lambda x: captured["mtp"].append(np.asarray(x)), out)
        return out

    def indexer_bridge(self, indexer_score, query, key, attention_mask, indexer_mask, sparse_loss, scaling_factor):  # noqa: ANN001, ANN202
        jax.debug.callback(
            lambda *xs: captured["indexer"].append(tuple(np.asarray(x) for x in xs)),
            indexer_score,
            query,
            key,
            indexer_mask,
        )
        return real_indexer_loss(
            self, indexer_score, query, key, attention_mask, indexer_mask, sparse_loss, scaling_factor
        )

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        metrics_file = os.path.join(tmp, "metrics.jsonl")
        stack.enter_context(
            _patched(input_pipeline_interface, "create_data_iterator", lambda config, mesh: (_Fixed(batch), None))
        )
        if capture:
            stack.enter_context(_patched(max_utils, "cross_entropy_with_logits", xent_bridge))
            stack.enter_context(_patched(multi_token_prediction, "_cross_entropy_with_integer_labels", mtp_bridge))
            stack.enter_context(_patched(attention_mla.MLA, "calculate_indexer_loss", indexer_bridge))
        handle = lpm.install(mode) if mode is not None else None
        try:
            argv = [
                "train",
                BASE_YML,
                "run_name=t",
                f"base_output_directory={tmp}",
                f"metrics_file={metrics_file}",
                f"steps={steps}",
                *MODEL,
                *args,
            ]
            train.main(argv)
        finally:
            if handle is not None:
                handle.uninstall()
        with open(metrics_file, encoding="utf8") as f:
            rows = [json.loads(line) for line in f]
        text = open(metrics_file, encoding="utf8").read()
    return {**captured, "metrics": rows, "jsonl": text}
