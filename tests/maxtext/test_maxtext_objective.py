"""The per-sample objective inside MaxText 0.2.5's real training loop (CPU, tiny float32 model).

One MaxText run per configuration (module-scoped), shared by the assertions. Expected values come from
MaxText itself (an unpatched run) or from a float64 NumPy recomputation from the logits MaxText produced.
"""

from __future__ import annotations

import numpy as np
import pytest
from _runs import LENGTHS, packed_batch, per_sample64, ragged_batch, run, xent64

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

_RUNS: dict[str, dict] = {}

CONFIGS = {
    "upstream_ga1": ([], None),
    "upstream_ga2": (["gradient_accumulation_steps=2"], None),
    "per_token_ga1": ([], "per_token"),
    "ps_ga1": ([], "per_sample"),
    "ps_ga2": (["gradient_accumulation_steps=2"], "per_sample"),
    "ps_ga4": (["gradient_accumulation_steps=4"], "per_sample"),
    "ps_tunix2": (["gradient_accumulation_steps=2", "use_tunix_gradient_accumulation=true"], "per_sample"),
    "ps_tunix4": (["gradient_accumulation_steps=4", "use_tunix_gradient_accumulation=true"], "per_sample"),
    "mtp_upstream_ga1": (["mtp_num_layers=1"], None),
    "mtp_ps_ga1": (["mtp_num_layers=1"], "per_sample"),
    "mtp_ps_ga2": (["mtp_num_layers=1", "gradient_accumulation_steps=2"], "per_sample"),
    # the MTP gradient control: the same model and batch with the MTP term weighted 0
    "mtp_ps_ga1_lambda0": (["mtp_num_layers=1", "mtp_loss_scaling_factor=0.0"], "per_sample"),
    # an MoE model (MaxText's mixtral block, dense expert matmuls on CPU) with its load-balancing loss on
    "moe_ps_ga1": (
        [
            "decoder_block=mixtral",
            "num_experts=4",
            "num_experts_per_tok=2",
            "base_moe_mlp_dim=128",
            "sparse_matmul=false",
            "megablox=false",
            "load_balance_loss_weight=0.01",
        ],
        "per_sample",
    ),
}


def get(name: str) -> dict:
    """The run of configuration ``name`` (run once per session)."""
    if name not in _RUNS:
        args, mode = CONFIGS[name]
        _RUNS[name] = run(args, mode=mode, capture=name in ("ps_ga1", "mtp_ps_ga1", "moe_ps_ga1"))
    return _RUNS[name]


def step0(name: str) -> dict:
    return get(name)["metrics"][0]


def test_per_token_installs_nothing_bit_identical() -> None:
    up, pt = step0("upstream_ga1"), step0("per_token_ga1")
    keys = [k for k in up if k.startswith("learning/")]
    assert keys and all(up[k] == pt[k] for k in keys), {k: (up[k], pt[k]) for k in keys if up[k] != pt[k]}


def test_lm_loss_and_total_weights_bit_identical_to_upstream() -> None:
    for ours, theirs in (("ps_ga1", "upstream_ga1"), ("ps_ga2", "upstream_ga2")):
        a, b = step0(ours), step0(theirs)
        assert a["learning/lm_loss"] == b["learning/lm_loss"]
        assert a["learning/total_weights"] == b["learning/total_weights"] == sum(LENGTHS)


def test_per_sample_equals_float64_numpy_from_logits() -> None:
    r = get("ps_ga1")
    batch = ragged_batch()
    logits = r["logits"][0]  # step 0, the whole batch (GA 1)
    mask = (batch["targets_segmentation"] != 0).astype(np.float64)
    xent = xent64(logits, batch["targets"])
    expected = per_sample64(xent, mask)
    m = r["metrics"][0]
    assert m["learning/loss"] == pytest.approx(expected, rel=2e-7, abs=0)
    assert m["lossparity/lm_objective"] == pytest.approx(expected, rel=2e-7, abs=0)
    assert m["lossparity/units"] == len(LENGTHS)
    token_mean = float((xent * mask).sum() / mask.sum())
    assert m["learning/lm_loss"] == pytest.approx(token_mean, rel=2e-7, abs=0)
    # the row with no target counts in 1/B: the objective is clearly below the token mean here
    assert expected < token_mean * 0.95


@pytest.mark.parametrize("name", ["ps_ga2", "ps_ga4", "ps_tunix2", "ps_tunix4"])
def test_objective_and_grad_norm_equal_at_every_ga_and_on_tunix(name: str) -> None:
    ref, got = step0("ps_ga1"), step0(name)
    assert got["learning/loss"] == pytest.approx(ref["learning/loss"], rel=3e-7, abs=0)
    assert got["lossparity/lm_objective"] == pytest.approx(ref["lossparity/lm_objective"], rel=3e-7, abs=0)
    assert got["learning/raw_grad_norm"] == pytest.approx(ref["learning/raw_grad_norm"], rel=1e-6, abs=0)


def test_per_sample_differs_from_the_token_mean_here() -> None:
    """Control: the per-sample objective is not MaxText's token mean on this batch (else the GA checks above
    could not tell the two apart)."""
    up = step0("upstream_ga1")
    assert abs(step0("ps_ga1")["learning/loss"] / up["learning/loss"] - 1) > 0.05
    assert abs(step0("ps_ga1")["learning/raw_grad_norm"] / up["learning/raw_grad_norm"] - 1) > 1e-3


def _mtp_expected(r: dict) -> float:
    """λ · (1/B) Σ_i Σ_t x_it m_it / max(n_i, 1), depth-1 mask rolled left by one inside each row."""
    batch = ragged_batch()
    mask = (batch["targets_segmentation"] != 0).astype(np.float64)
    rolled = np.zeros_like(mask)
    rolled[:, :-1] = mask[:, 1:]
    return per_sample64(r["mtp"][0].astype(np.float64), rolled)  # mtp_loss_scaling_factor default 0.1


def test_mtp_per_sample_ga1_and_ga2() -> None:
    r = get("mtp_ps_ga1")
    scale = 0.1
    expected = scale * _mtp_expected(r)
    m1, m2, up = step0("mtp_ps_ga1"), step0("mtp_ps_ga2"), step0("mtp_upstream_ga1")
    assert m1["learning/mtp_loss"] == pytest.approx(expected, rel=5e-7, abs=0)
    assert m2["learning/mtp_loss"] == pytest.approx(m1["learning/mtp_loss"], rel=5e-7, abs=0)
    assert m2["learning/loss"] == pytest.approx(m1["learning/loss"], rel=5e-7, abs=0)
    assert m2["learning/raw_grad_norm"] == pytest.approx(m1["learning/raw_grad_norm"], rel=1e-6, abs=0)
    assert m1["learning/lm_loss"] == up["learning/lm_loss"]
    # upstream's MTP term is the pooled token mean: different on this ragged batch
    assert abs(up["learning/mtp_loss"] / m1["learning/mtp_loss"] - 1) > 1e-3


def test_per_document_on_packed_rows_ga1_ga2() -> None:
    batch = packed_batch()
    r1 = run(["packing=true"], mode="per_document", batch=batch, capture=True)
    r2 = run(["packing=true", "gradient_accumulation_steps=2"], mode="per_document", batch=batch)
    seg = batch["targets_segmentation"]
    xent = xent64(r1["logits"][0], batch["targets"])
    terms = []
    for i in range(seg.shape[0]):
        for j in np.unique(seg[i][seg[i] != 0]):
            sel = seg[i] == j
            terms.append(xent[i][sel].sum() / sel.sum())
    expected = float(np.mean(terms))
    m1, m2 = r1["metrics"][0], r2["metrics"][0]
    assert m1["lossparity/units"] == len(terms)
    assert m1["learning/loss"] == pytest.approx(expected, rel=3e-7, abs=0)
    assert m2["learning/loss"] == pytest.approx(m1["learning/loss"], rel=3e-7, abs=0)
    assert m2["learning/raw_grad_norm"] == pytest.approx(m1["learning/raw_grad_norm"], rel=1e-6, abs=0)


def test_metrics_file_reads_as_maxtext_metrics(tmp_path) -> None:  # noqa: ANN001
    from lossparity.parity.readers import read_log

    path = tmp_path / "metrics.jsonl"
    path.write_text(get("ps_ga1")["jsonl"], encoding="utf8")
    run_ = read_log(path, fmt="maxtext_metrics")
    first = step0("ps_ga1")
    assert run_.metrics["objective"][0] == first["learning/loss"]
    assert run_.metrics["lm_loss"][0] == first["learning/lm_loss"]
    assert run_.metrics["grad_norm"][0] == first["learning/raw_grad_norm"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "loss": 1.0}\n', encoding="utf8")
    with pytest.raises(ValueError, match="MaxText metrics line"):
        read_log(bad, fmt="maxtext_metrics")


def test_mtp_term_carries_its_gradient() -> None:
    """The MTP checks above compare values; a ``stop_gradient`` on the hook's MTP term would keep every value and
    drop its gradient. Control: with the term weighted 0 the step's gradient is the main loss's alone, so with
    λ = 0.1 (same model, same batch, same LM loss) the gradient must differ from it."""
    with_mtp, without = step0("mtp_ps_ga1"), step0("mtp_ps_ga1_lambda0")
    assert with_mtp["learning/lm_loss"] == without["learning/lm_loss"]
    assert with_mtp["learning/mtp_loss"] > 0 and without["learning/mtp_loss"] == 0.0
    assert abs(with_mtp["learning/raw_grad_norm"] / without["learning/raw_grad_norm"] - 1) > 1e-4


def test_moe_load_balancing_term_is_added_once_to_the_per_sample_objective() -> None:
    """An MoE run through the hook: the objective is the per-sample LM term, recomputed in float64 NumPy from the
    logits MaxText produced, plus MaxText's own load-balancing term (GA 1: one microbatch, added once)."""
    r = get("moe_ps_ga1")
    batch = ragged_batch()
    mask = (batch["targets_segmentation"] != 0).astype(np.float64)
    lm = per_sample64(xent64(r["logits"][0], batch["targets"]), mask)
    m = r["metrics"][0]
    assert m["learning/moe_lb_loss"] > 0
    assert m["lossparity/lm_objective"] == pytest.approx(lm, rel=2e-7, abs=0)
    assert m["learning/loss"] == pytest.approx(lm + m["learning/moe_lb_loss"], rel=2e-7, abs=0)
