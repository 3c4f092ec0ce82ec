"""The MaxText recipes of docs/jax.md run, print the documented values, match float64 NumPy and MaxText."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lossparity.jax import throw as lpj_throw

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "jax.md"


def test_maxtext_recipe_runs_with_documented_output():
    text = PAGE.read_text()
    section = text[text.index("## Drop-in recipe for a MaxText") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs-jax-maxtext-recipe", "exec"), {})
    lines = out.getvalue().split("\n")
    assert [round(float(x), 6) for x in lines[0].split()] == [2.0, 1.75, 2.375]
    assert round(float(lines[1]), 6) == 2.0


def _run_block(header: str) -> tuple[dict, list[str]]:
    text = PAGE.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index(header) :], re.S).group(1)
    out, ns = io.StringIO(), {}
    previous = os.environ.get("XLA_FLAGS")
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "docs-jax-maxtext-step", "exec"), ns)
    finally:  # the block sets XLA_FLAGS for a fresh process; keep it out of later tests' subprocesses
        if previous is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = previous
    return ns, out.getvalue().split("\n")


def _naive_float64(params, batch):
    """Per-token CE from the full float64 logits (NumPy), 0 at padding; the mask; the segment ids."""
    emb, out = (np.asarray(params[k], np.float64) for k in ("emb", "out"))
    seg = np.asarray(batch["targets_segmentation"])
    z = np.tanh(emb[np.asarray(batch["inputs"])]) @ out.T
    zmax = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(-1)) + zmax[..., 0]
    target = np.take_along_axis(z, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    mask = seg != 0
    return np.where(mask, lse - target, 0.0), mask, seg


def test_maxtext_step_with_ga_and_mesh_matches_float64_and_maxtext_formulas():
    header = "## MaxText-shaped training step"
    ns, lines = _run_block(header)
    section = PAGE.read_text()[PAGE.read_text().index(header) :]
    documented = re.search(r"Output \(any `K`, any mesh\): `([\d. ]+)`.*?and `([\d. ]+)`", section, re.S)
    assert lines[0] == documented.group(1) and lines[1] == documented.group(2)

    loss, mask, seg = _naive_float64(ns["params"], ns["batch"])
    s, n = loss.sum(-1), mask.sum(-1)
    docs = [(i, d) for i in range(seg.shape[0]) for d in np.unique(seg[i]) if d]
    want = {
        "per_token": loss.sum() / mask.sum(),
        "per_sample": np.mean(s / np.maximum(n, 1)),
        "per_document": np.mean([loss[i][seg[i] == d].sum() / max((seg[i] == d).sum(), 1) for i, d in docs]),
    }
    for mode, value in want.items():
        assert ns["results"][mode]["objective"] == pytest.approx(value, rel=2e-6), mode
    assert ns["results"]["per_sample"]["lm_loss"] == pytest.approx(want["per_token"], rel=2e-6)
    assert ns["results"]["per_document"]["documents"] == len(docs)

    # MaxText's formulas (train.py loss_fn and its GA scan), written out on the float64 losses
    eps, k = 1e-8, ns["K"]
    total_loss = [blk.sum() for blk in np.split(loss * mask, k)]
    total_weights = [blk.sum() for blk in np.split(mask, k)]
    maxtext_one_step = loss.sum() / (mask.sum() + eps)
    maxtext_ga = sum(total_loss) / sum(total_weights)
    got = ns["results"]["per_token"]["objective"]
    assert got == pytest.approx(maxtext_ga, rel=2e-6) and got == pytest.approx(maxtext_one_step, rel=2e-6)

    # gradients of the sharded, accumulated, checked step against autodiff of the full-logit formula
    # Σ_t u_t·ce_t, with the per-token weights u of the mode formed here in NumPy
    doc_n = {(i, d): (seg[i] == d).sum() for i, d in docs}
    unit = {
        "per_sample": np.where(mask, 1.0 / (len(n) * np.maximum(n, 1))[:, None], 0.0),
        "per_document": np.array(
            [[1.0 / (len(docs) * doc_n[i, d]) if d else 0.0 for d in row] for i, row in enumerate(seg)]
        ),
    }

    @jax.jit
    def naive_grads(p, u):
        def objective(q):
            hidden = jnp.tanh(q["emb"].astype(jnp.float64)[ns["batch"]["inputs"]])
            logits = hidden @ q["out"].astype(jnp.float64).T
            ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), ns["batch"]["targets"][..., None], -1)[..., 0]
            return jnp.sum(u * ce)

        return jax.grad(objective)(p)

    for mode, u in unit.items():
        err, (_, grads, _) = ns["step"](ns["params"], ns["micro"], mode)  # compiled above: cached
        lpj_throw(err)
        want_g = naive_grads(ns["params"], jnp.asarray(u))
        for name in ("emb", "out"):
            g, w = np.asarray(grads[name], np.float64), np.asarray(want_g[name])
            assert np.abs(g - w).max() <= 2e-5 * np.abs(w).max(), (mode, name)
