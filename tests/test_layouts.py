"""Composed layouts (gloo, up to 8 ranks): the seed bug classes on meshes of several dimensions, refused
layouts, and checkpoints resumed into a different layout.

References are single-process runs of the same configuration (no parallelism at all), and, for the
router histograms, the identity ``Σ_e c_e = k · (valid tokens)``.
"""

from __future__ import annotations

import pytest
import torch

from lossparity.distributed.launch import spawn
from lossparity.training.trainer import TrainConfig, Trainer
from lossparity.verify.reference import parse_layout

pytestmark = pytest.mark.slow

_SKIP = {"tokens_per_s", "step_time_s", "microbatches"}


def _cfg(**kw) -> TrainConfig:
    base = dict(
        steps=2,
        global_batch=8,
        seq_len=16,
        packed=True,
        progress=False,
        tensorboard=False,
        warmup=1,
        dtype="float64",
        bias_rate=1e-2,
        model_overrides={"indexer_layer": 1},
    )
    base.update(kw)
    return TrainConfig(**base)


def _layout_kw(name: str) -> dict:
    lay = parse_layout(name)
    return dict(
        dp=lay.dp,
        cp=lay.cp,
        tp=lay.tp,
        sp=lay.sp,
        pp=lay.pp,
        pp_virtual=lay.pp_virtual,
        ga=lay.ga,
        recompute=lay.recompute,
    )


def _state(t: Trainer) -> dict:
    """Per-layer lagged top-k counts and expert biases of the routers this rank owns, the embedding."""
    moes = [(t.moe, t.routers)] if t.pipeline is None else t.pipeline.moes
    lagged, bias = {}, {}
    for moe, routers in moes:
        for r, row in zip(routers, moe.state_dict()["lagged_counts"]):
            lagged[r.layer_id] = row.clone()
            bias[r.layer_id] = r.expert_bias.detach().clone()
    emb = t.raw.tok_embeddings.weight
    holds = t.pipeline is None or t.pipeline.first or t.pipeline.last
    return {
        "lagged": lagged,
        "bias": bias,
        "embedding": emb.detach().clone() if holds else None,
        "history": [{k: v for k, v in x.items() if k not in _SKIP} for x in t.history],
    }


def _run(rank: int, world: int, name: str, kw: dict) -> dict:
    t = Trainer(_cfg(**_layout_kw(name), **kw))
    t.fit()
    return _state(t)


@pytest.fixture(scope="module")
def reference() -> dict:
    t = Trainer(_cfg())
    t.fit()
    return _state(t)


def test_router_histograms_over_tp_x_cp_equal_single_process_counts(reference):
    # Seed bug: under TP+SP with CP the histogram must be summed over the tp×cp ranks (each holds distinct
    # tokens), never twice over ranks holding the same tokens.
    out = spawn(_run, 8, "D2xC2xT2+SP", {}, timeout_s=300)
    valid_tokens = None
    for r in out:
        assert r["lagged"].keys() == reference["lagged"].keys()
        for lid, row in reference["lagged"].items():
            assert torch.equal(r["lagged"][lid], row), (lid, r["lagged"][lid], row)
            topk = 2  # tiny model: top-2 routing
            total = float(row.sum())
            valid_tokens = total / topk if valid_tokens is None else valid_tokens
            assert total == topk * valid_tokens  # every valid token counted exactly k times, once
        for lid, b in reference["bias"].items():
            assert torch.equal(r["bias"][lid], b)


def test_interleaved_pipeline_with_cp_recompute_biases_and_embedding_copies(reference):
    # Seed bugs: expert biases drifting between stages/ranks, the MTP stage's embedding copy drifting from
    # the first stage's, counts recorded again by recompute — under interleaved PP with CP.
    out = spawn(_run, 4, "C2xP2xV2+recompute", {}, timeout_s=240)
    owners: dict[int, list[torch.Tensor]] = {}
    for r in out:
        for lid, b in r["bias"].items():
            owners.setdefault(lid, []).append(b)
            assert torch.equal(r["lagged"][lid], reference["lagged"][lid])  # no double counting
    assert owners.keys() == reference["bias"].keys()
    for lid, copies in owners.items():
        assert len(copies) == 2  # the owning stage's two CP ranks
        assert all(torch.equal(c, copies[0]) for c in copies)
        assert torch.allclose(copies[0], reference["bias"][lid], rtol=0, atol=1e-12)
    embs = [r["embedding"] for r in out if r["embedding"] is not None]
    assert len(embs) == 4  # first and last chunk on each pipeline rank (V=2), each CP rank
    assert all(torch.equal(e, embs[0]) for e in embs)
    assert torch.allclose(embs[0], reference["embedding"], rtol=1e-10, atol=1e-14)


def _refused(rank: int, world: int, kw: dict) -> str:
    try:
        Trainer(_cfg(**kw))
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"dp": 2, "cp": 2}, "--dp × --cp × --tp × --pp = 2×2×1×1 = 4, but the world size is 2"),
        ({"cp": 2, "aux_scope": "sequence", "mode": "per_document"}, "cp=2 does not combine aux_scope 'sequence'"),
        ({"tp": 2, "sp": True, "seq_len": 17}, "must be divisible by tp=2"),
        ({"tp": 2, "ep": 2}, "--ep=2"),
    ],
)
def test_refused_layouts_fail_at_start_on_every_rank(kw, needle):
    # Every rank raises the same message before any collective (a rank that went on would hang its
    # peers until the bounded spawn timeout).
    messages = spawn(_refused, 2, kw, timeout_s=60)
    assert len(set(messages)) == 1 and needle in messages[0], messages


def _resume(rank: int, world: int, out: str) -> dict:
    ref = Trainer(_cfg(steps=4, **_layout_kw("D2xP2")))
    ref.fit()
    first = Trainer(_cfg(steps=4, out=out, ckpt_interval=2, **_layout_kw("D2xP2")))
    try:
        first.fit(crash_after=2)
    except KeyboardInterrupt:
        pass
    second = Trainer(_cfg(steps=4, out=out, ckpt_interval=2, resume=True, **_layout_kw("T2xC2")))
    second.fit()
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in second.raw.named_parameters()
    }
    owned = ref.pipeline.params
    return {
        "resumed_at": len(ref.history) - len(second.history),
        "history": _state(second)["history"],
        "ref_history": _state(ref)["history"][2:],
        "params": [(n, full[n], p.detach().clone()) for n, p in owned.items()],
    }


def test_resume_into_a_different_layout_continues_identically(tmp_path):
    out = spawn(_resume, 4, str(tmp_path), timeout_s=300)
    for r in out:
        assert r["resumed_at"] == 2
        for a, b in zip(r["history"], r["ref_history"]):
            for k in b:
                x, y = a[k], b[k]
                assert x == y or abs(x - y) <= 1e-10 * max(abs(y), 1e-300), (k, x, y)
        for n, got, want in r["params"]:
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-13), n


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, reference",
    [
        ({"aux_scope": "microbatch", "z_form": "microbatch"}, "K=2"),
        ({"aux_scope": "sequence", "z_form": "global"}, "1x1"),
        ({"aux_scope": "global_running", "z_form": "microbatch"}, "K=2"),
    ],
    ids=["microbatch+z_microbatch", "sequence", "global_running"],
)
def test_per_microbatch_and_per_sequence_aux_forms_under_cp_and_sp_equal_one_process(overrides, reference):
    # Before: context and sequence parallelism refused every aux form but the token-additive ones. The
    # counts of a microbatch (or sequence) are now summed over the ranks holding pieces of its rows;
    # each shard back-propagates its own scores. Reference: one process with the same microbatch size.
    from lossparity.verify.reference import format_table, run_verify

    layouts = (parse_layout("C2xK2"), parse_layout("T2+SPxK2"))
    report = run_verify(layouts, ("per_token", "per_sample"), steps=2, progress=False, overrides=overrides)
    assert all(r["pass"] for r in report["rows"]), format_table(report)
    assert {r["reference"] for r in report["rows"]} == {reference}  # b-dependent forms: the same b
