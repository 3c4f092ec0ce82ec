"""Tensor parallelism (gloo, real DTensor sharding): the same numbers as the single-process float64 run."""

from __future__ import annotations

import pytest
import torch

from lossparity.distributed.launch import spawn
from lossparity.verify.reference import Layout, format_table, run_verify

pytestmark = pytest.mark.slow


def _sharding(rank: int, world: int) -> dict:
    from lossparity.training.trainer import TrainConfig, Trainer

    t = Trainer(
        TrainConfig(tp=2, steps=1, global_batch=4, seq_len=16, progress=False, tensorboard=False, model_overrides={})
    )
    attn = t.raw.layers[0].attention
    experts = t.raw.layers[1].ffn.experts
    return {
        "wq": [str(p) for p in attn.wq.weight.placements],
        "local_heads": attn.n_heads,
        "w1_local": tuple(experts.w1.to_local().shape),
        "w1": tuple(experts.w1.shape),
        "router": [str(p) for p in t.raw.layers[1].ffn.router.weight.placements],
        "head": [str(p) for p in t.raw.output.weight.placements],
        "head_local": t.raw.output.weight.to_local().shape[0],
    }


def test_tp_really_shards_and_replicates_the_router():
    out = spawn(_sharding, 2, timeout_s=60)[0]
    assert out["wq"] == ["S(0)"] and out["local_heads"] == 2  # column-wise: output features sharded
    assert out["w1_local"][2] * 2 == out["w1"][2]  # experts' hidden dimension split over 2 ranks
    assert out["router"] == ["R"]  # NoParallel: replicated over the TP mesh, counts never summed over TP
    assert out["head"] == ["S(0)"] and out["head_local"] == 128  # vocabulary-parallel output head (V=256)


def test_tp_layouts_match_reference():
    layouts = (Layout("1x1", 1, 1, indexer=False), Layout("T2xK2", 1, 2, tp=2, indexer=False))
    report = run_verify(layouts, ("per_sample", "per_microbatch"), steps=2, progress=False)
    assert all(r["pass"] for r in report["rows"]), format_table(report)


def _lagged_counts(rank: int, world: int, tp: int) -> tuple:
    from lossparity.training.trainer import TrainConfig, Trainer

    t = Trainer(
        TrainConfig(
            tp=tp,
            steps=1,
            global_batch=4,
            seq_len=16,
            progress=False,
            tensorboard=False,
            dtype="float64",
            bias_rate=0.0,
        )
    )
    t.fit()
    return float(t.moe.lagged_tokens), t.moe.lagged_counts.clone()


def test_router_counts_are_not_multiplied_by_tp_size():
    # Seed bug class: token histograms all-reduced over TP although TP ranks route the same tokens.
    single = _lagged_counts(0, 1, 1)
    tokens, counts = spawn(_lagged_counts, 2, 2, timeout_s=60)[0]
    assert tokens == single[0]
    assert (counts == single[1]).all()


def _sp_facts(rank: int, world: int) -> dict:
    from lossparity.training.data import global_batch, split_batch
    from lossparity.training.trainer import TrainConfig, Trainer, _valid_tokens

    t = Trainer(
        TrainConfig(tp=2, sp=True, steps=1, global_batch=4, seq_len=16, packed=True, progress=False, tensorboard=False)
    )
    mb = split_batch(global_batch(t.corpus, 0, global_batch_size=4, seq_len=16, packed=True, seed=0), 1, 0, 1, 4)[0]
    seg, _ = _valid_tokens(mb)
    out = t.raw(mb.tokens, segment_ids=seg, positions=mb.positions)
    return {
        "router_tokens": out.routers[0].probs.shape[0],
        "hidden": tuple(out.hidden.shape),
        "token_group": t.acc.groups.token_group is not None
        and __import__("torch").distributed.get_world_size(t.acc.groups.token_group),
        "grad_group": t.acc.groups.grad_group,
        "counts": t.raw.moe_routers()[0].tokens_per_expert.clone(),
    }


def test_sequence_parallel_routes_slices_and_sums_counts_over_tp():
    out = spawn(_sp_facts, 2, timeout_s=60)
    for r in out:
        assert r["router_tokens"] == 4 * 16 // 2  # each TP rank routes its half of the sequence
        assert r["hidden"] == (4, 16, 32)  # the loss sees whole rows
        assert r["token_group"] == 2  # SP: ranks holding distinct tokens include TP
        assert r["grad_group"] is None  # ...but gradients are not summed over TP (dp=1, cp=1)
    assert not torch.equal(out[0]["counts"], out[1]["counts"])  # different tokens, different histograms


def test_sp_layouts_match_reference():
    layouts = (Layout("1x1", 1, 1, indexer=False), Layout("D2xT2+SP", 2, 1, tp=2, sp=True, indexer=False))
    report = run_verify(layouts, ("per_sample", "per_document"), steps=2, progress=False)
    assert all(r["pass"] for r in report["rows"]), format_table(report)
