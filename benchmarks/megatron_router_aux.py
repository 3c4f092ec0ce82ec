"""Megatron's own MoE aux path at the shapes of ``bench_moe_aux``: megatron-core's ``TopKRouter`` with
``moe_aux_loss_coeff`` and ``moe_z_loss_coeff`` versus the same router without them.

Run by ``bench_moe_aux`` in a subprocess (its CPU stand-ins stay out of the benchmark's own process):
``python -m benchmarks.megatron_router_aux '{"preset": ..., "b": .., "s": .., "k": .., "layers": .., ...}'``
prints one ``RESULT {json}`` line. Per step: ``K`` microbatches × ``layers`` routers (``hidden = dim``, the
preset's experts, top-k and score function; ``[S, b, dim]`` tokens, one gloo process), forward and the backward
of a fixed random gradient of the routing probabilities, with (``aux_loss`` load balancing at 1e-2, z-loss at
1e-3, as ``bench_moe_aux``) and without the aux terms, interleaved step by step; the aux cost is the
difference. Two CPU stand-ins, as in the Megatron tests: ``torch.cuda.current_device`` returns ``"cpu"`` (the
router moves its weight there) and ``moe_utils.te_general_gemm`` is ``None`` (no Transformer Engine).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import torch


def _router(cfg: Any, coeffs: bool, seed: int) -> Any:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2,
        hidden_size=cfg["dim"],
        num_attention_heads=4,
        num_moe_experts=cfg["experts"],
        moe_router_topk=cfg["topk"],
        moe_router_score_function=cfg["score"],
        use_cpu_initialization=True,
        add_bias_linear=False,
        params_dtype=torch.float32,
    )
    if coeffs:
        kw.update(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_load_balancing_type="aux_loss")
    else:
        kw.update(moe_router_load_balancing_type="none")
    torch.manual_seed(seed)
    router = TopKRouter(config=TransformerConfig(**kw), pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    return router.train()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-step seconds (median, minimum) of the routers with and without the aux terms."""
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(spec["port"]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # CPU stand-in (module docstring)
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    ps.initialize_model_parallel()
    b, s, k, layers = spec["b"], spec["s"], spec["k"], spec["layers"]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(s, b, spec["dim"], generator=gen).requires_grad_() for _ in range(layers)]
    grads = [torch.randn(s * b, spec["experts"], generator=gen) for _ in range(layers)]
    variants = {name: [_router(spec, name == "aux", i) for i in range(layers)] for name in ("aux", "plain")}
    times: dict[str, list[float]] = {"aux": [], "plain": []}
    for step in range(spec["warmup"] + spec["repeats"]):
        for name, routers in variants.items():
            t0 = time.perf_counter()
            for _ in range(k):
                probs = [r(x)[0] for r, x in zip(routers, xs)]
                torch.autograd.backward(probs, grads)
            if step >= spec["warmup"]:
                times[name].append(time.perf_counter() - t0)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    diff = [a - p for a, p in zip(times["aux"], times["plain"])]
    return {
        "router_plain_ms": 1e3 * statistics.median(times["plain"]),
        "router_aux_ms": 1e3 * statistics.median(times["aux"]),
        "aux_ms": 1e3 * statistics.median(diff),
        "aux_ms_from_minima": 1e3 * (min(times["aux"]) - min(times["plain"])),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
