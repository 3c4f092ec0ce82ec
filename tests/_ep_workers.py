"""Worker functions of the expert-parallel tests, run on spawned gloo ranks (module-level, importable).

The reference is the single-process float64 MoE layer on the whole global batch: output rows and the
gradient of every parameter of ``L = Σ y ⊙ w`` (``w`` a fixed random cotangent). Under EP each rank runs
its rows; parameter gradients are reduced as the trainer does: replicated parameters summed over every
rank holding distinct tokens, expert shards summed over the expert-data-parallel group only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lossparity.model.expert_parallel import apply_expert_parallel, expert_parameters, reduce_expert_grads
from lossparity.model.moe import MoE
from lossparity.model.recompute import checkpoint

DIM, HIDDEN, E, TOPK = 8, 12, 4, 2
ROWS, SEQ = 4, 5


def make_layer(bias: list[float], score: str = "softmax") -> MoE:
    """The float64 MoE layer (shared expert on) with a fixed init and the given expert bias."""
    torch.manual_seed(7)
    layer = MoE(DIM, HIDDEN, E, TOPK, score, shared_expert=True, layer_id=0).to(torch.float64)
    layer.router.expert_bias.copy_(torch.tensor(bias))
    return layer


def global_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [ROWS, SEQ, DIM], valid [ROWS, SEQ], cotangent [ROWS, SEQ, DIM])``; row 2 is padding after 1."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, SEQ, DIM, generator=g, dtype=torch.float64)
    valid = torch.ones(ROWS, SEQ, dtype=torch.bool)
    valid[2, 1:] = False
    w = torch.randn(ROWS, SEQ, DIM, generator=g, dtype=torch.float64)
    return x, valid, w


def run_layer(layer: MoE, x: torch.Tensor, valid: torch.Tensor, w: torch.Tensor, recompute: bool) -> torch.Tensor:
    """Forward (optionally under activation recompute) and backward of ``Σ y ⊙ w``; returns ``y``."""
    x = x.clone().requires_grad_(True)
    y = checkpoint(lambda t: layer(t, valid)[0], x) if recompute else layer(x, valid)[0]
    (y * w).sum().backward()
    return y.detach()


def reference(bias: list[float], recompute: bool = False) -> dict:
    """Single process: output, every parameter's gradient, router counts."""
    layer = make_layer(bias)
    x, valid, w = global_inputs()
    y = run_layer(layer, x, valid, w, recompute)
    return {
        "y": y,
        "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
        "counts": layer.router.tokens_per_expert.clone(),
    }


def ep_rank(rank: int, world: int, ep: int, cases: list[tuple[list[float], bool]]) -> list[dict]:
    """For each ``(bias, recompute)``: this rank's rows through the EP layer (ranks ``world/ep`` × ``ep``,
    EP groups contiguous), gradients reduced as in training. Returns per case the output rows, the full
    gradients (expert shards gathered), the summed router counts and the local expert-weight shape."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    edp = mesh.get_group("edp") if world > ep else None
    x, valid, w = global_inputs()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    results = []
    for bias, recompute in cases:
        layer = make_layer(bias)
        apply_expert_parallel(layer, mesh["ep"])
        y = run_layer(layer, x[rows], valid[rows], w[rows], recompute)
        experts = expert_parameters(layer)
        reduce_expert_grads(experts, edp)
        shard = {id(p) for p in experts}
        for p in layer.parameters():  # replicated parameters: summed over every rank (distinct tokens)
            if id(p) not in shard:
                dist.all_reduce(p.grad)
        counts = layer.router.tokens_per_expert.clone()
        dist.all_reduce(counts)
        grads = {n: (p.grad.full_tensor() if id(p) in shard else p.grad).clone() for n, p in layer.named_parameters()}
        results.append(
            {
                "y": y,
                "rows": (rows.start, rows.stop),
                "grads": grads,
                "counts": counts,
                "local_w1": tuple(layer.experts.w1.to_local().shape),
                "placements": [str(pl) for pl in layer.experts.w1.placements],
            }
        )
    return results


def trainer_facts(rank: int, world: int, recompute: bool) -> dict:
    """One step of the reference trainer with ``dp=world, ep=2`` (``world=1``: no EP): how the
    experts are held and reduced, the step's dispatch counts (summed over ranks, read just before the
    reset) and lagged top-k counts, the log line and the updated parameters."""
    from lossparity.training.trainer import TrainConfig, Trainer

    ep = 2 if world > 1 else 1
    t = Trainer(
        TrainConfig(
            dp=world,
            ep=ep,
            ga=2,
            steps=1,
            global_batch=4,
            seq_len=16,
            packed=True,
            dtype="float64",
            recompute=recompute,
            progress=False,
            tensorboard=False,
        )
    )
    dispatch = []
    for r in t.routers:

        def reset(r=r, orig=r.reset_counts):
            dispatch.append(r.tokens_per_expert.clone())
            orig()

        r.reset_counts = reset
    t.fit()
    dispatch = torch.stack(dispatch)
    if world > 1:
        dist.all_reduce(dispatch)
    experts = t.raw.layers[1].ffn.experts
    sharded = hasattr(experts.w1, "placements")
    return {
        "placements": [str(p) for p in experts.w1.placements] if sharded else None,
        "local_experts": experts.w1.to_local().shape[0] if sharded else experts.w1.shape[0],
        "router_sharded": hasattr(t.raw.layers[1].ffn.router.weight, "placements"),
        "engine": type(t.model).__name__,
        "expert_params": len(t.expert_params),
        "dispatch": dispatch,
        "history": t.history,
        "params": {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in t.raw.named_parameters()
        },
        "lagged": t.moe.lagged_counts.clone(),
        "tokens": float(t.moe.lagged_tokens),
    }


def resume_across_ep(rank: int, world: int, out: str) -> dict:
    """Reference: 3 steps under ``D2xE2``. Then 2 steps under ``D2xE2`` with a checkpoint, a crash, and a
    resume under plain ``D2`` (no EP: the expert shards are re-assembled by the checkpoint loader).
    Returns both histories of step 3 and both final parameter sets (full tensors)."""
    from lossparity.training.trainer import TrainConfig, Trainer

    def cfg(**kw) -> TrainConfig:
        return TrainConfig(
            dp=2,
            steps=3,
            global_batch=4,
            seq_len=16,
            packed=True,
            dtype="float64",
            warmup=1,
            bias_rate=1e-2,
            progress=False,
            tensorboard=False,
            **kw,
        )

    def full(t: Trainer) -> dict:
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in t.raw.named_parameters()
        }

    ref = Trainer(cfg(ep=2))
    ref.fit()
    first = Trainer(cfg(ep=2, out=out, ckpt_interval=2))
    try:
        first.fit(crash_after=2)
    except KeyboardInterrupt:
        pass
    second = Trainer(cfg(out=out, ckpt_interval=2, resume=True))
    second.fit()
    bias = [r.expert_bias.clone() for r in second.routers], [r.expert_bias.clone() for r in ref.routers]
    return {
        "history": second.history,
        "ref_history": ref.history[2:],
        "params": full(second),
        "ref_params": full(ref),
        "bias": bias,
    }
