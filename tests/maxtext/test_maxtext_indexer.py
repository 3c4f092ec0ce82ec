"""The DeepSeek-V3.2 indexer term of the objective inside MaxText 0.2.5's real training loop (CPU, tiny float32
MLA model with the sparse-attention indexer in its sparse training stage, λ = indexer_loss_scaling_factor = 1).

MaxText's indexer loss (``layers/attention_mla.py``, ``calculate_indexer_loss``) per layer:
``λ · mean_{b,t} Σ_s p_bts (log(p_bts + ε) − log(q_bts + ε))`` with the target ``p`` = the L1-normalised
``Σ_h softmax_s(q_h·k_h + M)`` of the main attention and ``q = softmax_s(score + M)`` of the indexer, ``M``
the top-k mask (causal mask included), ``ε`` = 1e-8; ``loss_fn`` averages it over the layers and the GA path
over the microbatches. The hook adds it to the per-sample LM term as MaxText adds it (GA 1: once).
Expected values: float64 NumPy from the tensors MaxText passed to ``calculate_indexer_loss`` and from its
logits, and MaxText's own unpatched run (the indexer loss and its gradient).
"""

from __future__ import annotations

import numpy as np
import pytest
from _runs import INDEXER, S, per_sample64, ragged_batch, run, xent64

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EPS = 1e-8  # MaxText's maxtext.utils.globals.EPS, part of the loss's definition
LAYERS = 2  # MODEL's base_num_decoder_layers
TOPK = 16  # INDEXER's indexer_topk

CONFIGS = {
    "ps_ga1": (["indexer_loss_scaling_factor=1.0"], "per_sample"),
    "ps_ga1_lambda0": (["indexer_loss_scaling_factor=0.0"], "per_sample"),
    "up_ga1": (["indexer_loss_scaling_factor=1.0"], None),
    "up_ga1_lambda0": (["indexer_loss_scaling_factor=0.0"], None),
    "ps_ga2": (["indexer_loss_scaling_factor=1.0", "gradient_accumulation_steps=2"], "per_sample"),
}
_RUNS: dict[str, dict] = {}


def get(name: str) -> dict:
    """The run of configuration ``name`` (run once per session)."""
    if name not in _RUNS:
        args, mode = CONFIGS[name]
        _RUNS[name] = run([*INDEXER, *args], mode=mode, capture=name == "ps_ga1")
    return _RUNS[name]


def step0(name: str) -> dict:
    return get(name)["metrics"][0]


def _softmax64(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)  # every row keeps its diagonal: the max is finite
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def indexer_kl64(score: np.ndarray, query: np.ndarray, key: np.ndarray, mask: np.ndarray) -> float:
    """One layer's DeepSeek-V3.2 indexer KL (sparse stage, λ = 1) in float64 from the captured tensors:
    ``score [b,t,s]``, ``query``/``key [b,t|s,h,d]``, the top-k mask ``[b,t,s]`` (0 kept, very negative or -inf
    dropped)."""
    m = mask.astype(np.float64)
    q_idx = _softmax64(score.astype(np.float64) + m)
    att = np.einsum("bthd,bshd->bhts", query.astype(np.float64), key.astype(np.float64)) + m[:, None]
    p = _softmax64(att).sum(axis=1)
    p = p / (p.sum(axis=-1, keepdims=True) + EPS)
    kl = p * (np.log(p + EPS) - np.log(q_idx + EPS))
    return float(kl.sum(axis=-1).mean())


def _layer_inputs(captured: list[tuple[np.ndarray, ...]]) -> list[tuple[np.ndarray, ...]]:
    """The captured calls, one per layer: remat recomputes each layer's forward in the backward pass, which
    reports the same tensors again."""
    unique: list[tuple[np.ndarray, ...]] = []
    for call in captured:
        if not any(all(np.array_equal(a, b) for a, b in zip(call, seen)) for seen in unique):
            unique.append(call)
    return unique


def test_indexer_term_equals_float64_kl_and_maxtexts_own_value() -> None:
    r = get("ps_ga1")
    layers = _layer_inputs(r["indexer"])
    assert len(layers) == LAYERS
    # the top-k mask keeps min(t + 1, 16) keys for query t: sparse beyond the causal mask from t = 16 on
    kept = (layers[0][3] == 0).sum(axis=-1)
    assert np.array_equal(kept, np.broadcast_to(np.minimum(np.arange(1, S + 1), TOPK), kept.shape))
    expected = float(np.mean([indexer_kl64(*call) for call in layers]))
    m = r["metrics"][0]
    # float32 KL sums of 64 keys per query: ~1e-7 absolute here (measured 3e-8 relative)
    assert m["learning/indexer_loss"] == pytest.approx(expected, rel=2e-6, abs=0)
    # MaxText's unpatched run computes the same forward: its indexer loss bit for bit
    assert m["learning/indexer_loss"] == step0("up_ga1")["learning/indexer_loss"]
    batch = ragged_batch()
    mask = (batch["targets_segmentation"] != 0).astype(np.float64)
    lm = per_sample64(xent64(r["logits"][0], batch["targets"]), mask)
    assert m["lossparity/lm_objective"] == pytest.approx(lm, rel=2e-7, abs=0)
    # the objective is the LM term plus the indexer term, once
    assert m["learning/loss"] == pytest.approx(lm + expected, rel=3e-7, abs=0)
    assert expected > 0.1  # large enough that dropping it could not hide in the tolerance


def test_indexer_term_carries_maxtexts_gradient() -> None:
    """A ``stop_gradient`` on the hook's indexer term keeps every value above. The indexer's weights get no
    gradient from the LM loss (top-k is not differentiable, the indexer reads detached inputs) and the main
    weights none from the indexer loss (it reads detached queries and keys), so the squared gradient norms
    add: ``|g(λ=1)|² − |g(λ=0)|²`` is the squared norm of the indexer term's gradient, the same under the hook as
    in MaxText's unpatched run (same model, same batch, same indexer loss)."""
    ours, ours0, theirs, theirs0 = (step0(n) for n in ("ps_ga1", "ps_ga1_lambda0", "up_ga1", "up_ga1_lambda0"))
    assert ours["learning/lm_loss"] == ours0["learning/lm_loss"] == theirs["learning/lm_loss"]
    assert ours0["learning/indexer_loss"] == 0.0 and ours0["learning/loss"] == ours0["lossparity/lm_objective"]
    sq_ours = ours["learning/raw_grad_norm"] ** 2 - ours0["learning/raw_grad_norm"] ** 2
    sq_theirs = theirs["learning/raw_grad_norm"] ** 2 - theirs0["learning/raw_grad_norm"] ** 2
    # control: the indexer gradient is a visible share of MaxText's own squared norm (measured 2.3 %)
    assert sq_theirs > 0.01 * theirs["learning/raw_grad_norm"] ** 2
    # each float32 squared norm (6.5 under the hook) carries ~1e-6 relative error: <= 4e-4 of the 0.038 difference
    assert sq_ours == pytest.approx(sq_theirs, rel=1e-3)


def test_indexer_term_is_the_same_at_ga2() -> None:
    """GA 2 through the hook: the indexer term is the mean of the two microbatches' terms, each a mean over
    the same number of query positions, hence the whole batch's term; objective and gradient as at GA 1."""
    one, two = step0("ps_ga1"), step0("ps_ga2")
    assert two["learning/indexer_loss"] == pytest.approx(one["learning/indexer_loss"], rel=1e-6, abs=0)
    assert two["learning/loss"] == pytest.approx(one["learning/loss"], rel=3e-7, abs=0)
    assert two["learning/raw_grad_norm"] == pytest.approx(one["learning/raw_grad_norm"], rel=1e-6, abs=0)
