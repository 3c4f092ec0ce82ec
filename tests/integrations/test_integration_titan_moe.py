"""lossparity's router terms and expert biases in torchtitan's DeepSeek-V3 MoE model and real
``Trainer.train_step`` (see _titan_moe_workers).

Expected values: a naive float64 computation on the whole global batch of 16 rows in one forward of the
same model, with the objective's terms written out here (per-row LM loop, per-layer Switch terms of each
scope, z-loss) and torchtitan's expert-bias formula, over two steps (the second step routes with the
updated biases and, for ``global_lagged``, weighs the scores with the first step's fractions).
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("torchtitan.trainer", exc_type=ImportError)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _titan_moe_workers import (  # noqa: E402
    EAGER,
    LAMBDA,
    RATE,
    E,
    K,
    V,
    build_model,
    global_batch,
    run_titan_moe,
    run_titan_moe_pp,
    titan_moe_steps,
)

from lossparity.distributed.launch import spawn  # noqa: E402

ALPHA, BETA = 0.1, 1e-2


def _per_sample(logits, labels) -> torch.Tensor:
    """Mean over rows of each row's token mean (per_sample), with a loop over rows."""
    w = (labels != -100).double()
    tok = F.cross_entropy(logits.reshape(-1, V), labels.clamp(min=0).reshape(-1), reduction="none")
    tok = tok.view(labels.shape) * w
    return sum(tok[i].sum() / max(float(w[i].sum()), 1.0) for i in range(labels.shape[0])) / labels.shape[0]


def _depth_labels(labels, positions, k):
    """Depth-k labels by hand: the label k positions ahead inside the same document, else ignored."""
    out = torch.full_like(labels, -100)
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1] - k):
            if positions[i, t + k] == positions[i, t] + k:
                out[i, t] = labels[i, t + k]
    return out


def _reference(scope: str, steps: int = 2, mtp: int = 0, mb_rows: int = 4) -> dict:
    """Gradients of the last step, biases after it and its objective, computed naively (``microbatch``: the
    16 rows in consecutive microbatches of ``mb_rows``)."""
    from torchtitan.models.common.moe import MoE

    model, _ = build_model("none", mtp)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    seen: dict[int, dict] = {}
    for i, m in enumerate(moes):
        m.router.gate.register_forward_hook(lambda mod, a, out, i=i: seen.setdefault(i, {}).update(logits=out))
        m.router.register_forward_hook(lambda mod, a, out, i=i: seen.setdefault(i, {}).update(ids=out[1]))
    tokens, labels, positions = global_batch(16)
    n_rows, length = labels.shape
    tt = float(labels.numel())
    frac_prev = torch.full((len(moes), E), K / E, dtype=torch.float64)
    for _ in range(steps):
        model.zero_grad()
        with EAGER:
            masks = model.get_attention_masks(positions=positions)
        out = model(tokens, positions=positions, attention_masks=masks)
        outs = out if isinstance(out, list) else [out]
        j = _per_sample(outs[0], labels)
        for k in range(1, mtp + 1):  # own convention, per_sample: every (depth, row) pair weighs the same
            j = j + LAMBDA / mtp * _per_sample(outs[k], _depth_labels(labels, positions, k))
        new_frac, disp = [], []
        for layer in range(len(moes)):
            z_logits = seen[layer]["logits"].reshape(n_rows, length, E)
            s = torch.sigmoid(z_logits)
            p = s / s.sum(-1, keepdim=True)
            top = torch.zeros_like(p).scatter(-1, p.topk(K, dim=-1).indices, 1.0)

            def switch(pp, tp):  # α·E/k · Σ_e (c_e/T)·(P_e/T) over one token set
                n = pp.shape[0]
                return ALPHA * E / K * ((tp.sum(0) / n) * (pp.sum(0) / n)).sum()

            if scope == "global_lagged":
                aux = ALPHA * E / K * (frac_prev[layer] * p.reshape(-1, E).sum(0) / tt).sum()
            elif scope == "microbatch":  # every layout here cuts the rows in order
                blocks = range(0, n_rows, mb_rows)
                aux = sum(
                    switch(p[a : a + mb_rows].reshape(-1, E), top[a : a + mb_rows].reshape(-1, E)) for a in blocks
                ) / len(blocks)
            elif scope == "sequence":
                aux = sum(switch(p[i], top[i]) for i in range(n_rows)) / n_rows
            else:
                aux = 0.0
            z = (torch.logsumexp(z_logits, -1) ** 2).sum() / tt
            j = j + aux + BETA * z
            new_frac.append(top.reshape(-1, E).sum(0) / tt)
            disp.append(torch.bincount(seen[layer]["ids"].reshape(-1), minlength=E).double())
        j.backward()
        frac_prev = torch.stack(new_frac).detach()
        with torch.no_grad():
            for m, c in zip(moes, disp):  # torchtitan's formula, once per step from the global counts
                delta = RATE * torch.sign(c.mean() - c)
                m.expert_bias_E += delta - delta.mean()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias_E")}
    return {"grads": grads, "biases": biases, "objective": float(j.detach())}


def _key(name: str) -> str:  # activation checkpointing wraps the blocks
    return name.replace("._checkpoint_wrapped_module", "")


def _compare(got: dict, ref: dict, stage: bool = False) -> tuple[float, float, float | None]:
    """Largest relative gradient difference, largest bias difference, relative objective difference (None
    where nothing logs one: a pipeline stage other than the last). ``stage``: ``got`` holds one pipeline
    stage's parameters (compared by name; the caller checks that the stages cover the model)."""
    g = {_key(n): v for n, v in got["grads"].items()}
    b = {_key(n): v for n, v in got["biases"].items()}
    names, buffers = (g, b) if stage else (ref["grads"], ref["biases"])
    rel = max(
        float((g[n] - ref["grads"][n]).abs().max() / ref["grads"][n].abs().max().clamp(min=1e-300)) for n in names
    )
    bias = max(float((b[n] - ref["biases"][n]).abs().max()) for n in buffers)
    logged = got["logs"].get("objective")
    obj = None if logged is None else abs(logged - ref["objective"]) / abs(ref["objective"])
    return rel, bias, obj


# one case in the default suite (the CI budget); every scope × AC × layout: scripts/titan_moe_matrix.py
@pytest.mark.parametrize(("scope", "ac", "mtp"), [("global_lagged", "full", 1)])
def test_ga4_matches_naive_reference(scope, ac, mtp):
    ref = _reference(scope, mtp=mtp)
    got = titan_moe_steps(scope, slice(0, 16), 4, ac=ac, mtp=mtp)
    rel, bias, obj = _compare(got, ref)
    print(
        f"measured: torchtitan MoE {scope} AC {ac} MTP {mtp} GA 4: grads {rel:.1e}, biases {bias:.1e}, "
        f"objective {obj:.1e}"
    )
    assert rel <= 1e-10 and bias <= 1e-12 and obj <= 1e-10
    routers = [n for n in ref["grads"] if "router.gate" in n]
    assert routers and all(float(ref["grads"][n].abs().max()) > 0 for n in routers)
    assert any(float(b.abs().max()) > 0 for b in ref["biases"].values())  # the biases did move


@pytest.mark.slow
def test_two_ranks_ga2_match_naive_reference():
    cases = [("sequence", "none", 1), ("microbatch", "full", 0)]
    results = spawn(run_titan_moe, 2, cases, timeout_s=300)
    for case in cases:
        ref = _reference(case[0], mtp=case[2])
        for rank in range(2):
            rel, bias, obj = _compare(results[rank][case], ref)
            print(
                f"measured: torchtitan MoE {case[0]} AC {case[1]} MTP {case[2]} 2 ranks x GA 2 (rank {rank}): "
                f"grads {rel:.1e}, biases {bias:.1e}, objective {obj:.1e}"
            )
            assert rel <= 1e-10 and bias <= 1e-12 and obj <= 1e-10, (case, rank)


# PP 2 on 2 gloo ranks (torchtitan's pipeline_llm split; 1F1B: one stage per rank, one MoE layer each;
# Interleaved1F1B: two stages per rank, layers 0 + 2 and layer 1 + head) × GA 2 × 2 pipeline microbatches;
# every scope × AC of both schedules: scripts/titan_moe_matrix.py
@pytest.mark.parametrize(
    ("schedule", "scope", "ac"), [("1F1B", "global_lagged", "full"), ("Interleaved1F1B", "microbatch", "none")]
)
def test_pipeline_parallel_matches_naive_reference(schedule, scope, ac):
    case = (scope, ac)
    results = spawn(run_titan_moe_pp, 2, [case], schedule, timeout_s=300)
    ref = _reference(scope)
    for rank in range(2):
        rel, bias, obj = _compare(results[rank][case], ref, stage=True)
        print(
            f"measured: torchtitan MoE {scope} AC {ac} PP 2 ({schedule}) x GA 2 x 2 PP microbatches (rank {rank}): "
            f"grads {rel:.1e}, biases {bias:.1e}, objective {'-' if obj is None else f'{obj:.1e}'}"
        )
        assert rel <= 1e-10 and bias <= 1e-12, rank
    assert obj is not None and obj <= 1e-10  # the last stage (rank 1) logs the objective (torchtitan's loss + terms)
    ranks = [{_key(n) for n in results[r][case]["grads"]} for r in range(2)]
    assert not ranks[0] & ranks[1] and ranks[0] | ranks[1] == set(ref["grads"])  # each parameter once
    biases = [{_key(n) for n in results[r][case]["biases"]} for r in range(2)]
    assert all(biases) and biases[0] | biases[1] == set(ref["biases"])  # a MoE layer on each rank
    logs = [results[r][case]["logs"] for r in range(2)]
    assert logs[0]["moe_terms"] == logs[1]["moe_terms"]  # summed over the stages on both
    wrapped = [any("_checkpoint_wrapped_module" in n for n in results[r][case]["grads"]) for r in range(2)]
    assert wrapped == [ac == "full"] * 2  # full AC wraps the blocks of every stage
    routers = [n for n in ref["grads"] if "router.gate" in n]
    assert routers and all(float(ref["grads"][n].abs().max()) > 0 for n in routers)


def test_router_forward_outside_the_step_is_refused_or_paused():
    """A router forward beyond the step's microbatches would count its tokens twice; ``paused()`` leaves one
    out (what the mixin does with a pipeline stage's metadata inference), ``end_step`` refuses the count."""
    from lossparity.integrations.titan_moe import TitanMoETerms

    model, _ = build_model()
    terms = TitanMoETerms(model, "global_lagged", aux_coeff=0.1)
    tokens, labels, positions = global_batch(16)
    with EAGER:
        masks = model.get_attention_masks(positions=positions[:4])
    for pause in (True, False):
        terms.begin_step([labels[:4]])
        model(tokens[:4], positions=positions[:4], attention_masks=masks)
        with terms.paused() if pause else contextlib.nullcontext():
            model(tokens[:4], positions=positions[:4], attention_masks=masks)
        if pause:
            assert terms.end_step()["global_load_balancing_loss"] > 0
        else:
            routed = r"MoE layer 0 \(layers\.1\.moe\): its router routed 80 tokens in this step.*T = 40"
            with pytest.raises(RuntimeError, match=routed):
                terms.end_step()


def test_bad_input_names_the_argument():
    from _titan_workers import TinyLM

    from lossparity.integrations.titan_moe import TitanMoETerms
    from lossparity.integrations.torchtitan import LossParityLoss

    model, _ = build_model()
    with pytest.raises(ValueError, match="aux_scope"):
        TitanMoETerms(model, "global_running")
    with pytest.raises(ValueError, match="aux_coeff"):
        TitanMoETerms(model, aux_coeff=-1.0)
    with pytest.raises(ValueError, match="model_parts: no torchtitan MoE"):
        TitanMoETerms(TinyLM())
    terms = TitanMoETerms(model)
    with pytest.raises(RuntimeError, match="end_step: begin_step was not called"):
        terms.end_step()
    with pytest.raises(ValueError, match=r"labels\[0\]"):
        terms.begin_step([torch.zeros(3, dtype=torch.long)])
    terms.remove()
    with pytest.raises(ValueError, match="mtp_depths"):
        LossParityLoss(mtp_depths=-1)
    loss = LossParityLoss(mtp_depths=1)
    with pytest.raises(ValueError, match="pred: 1 logits tensors for mtp_depths=1"):
        loss(torch.rand(2, 3, V), torch.zeros(2, 3, dtype=torch.long), positions=torch.zeros(2, 3, dtype=torch.long))
