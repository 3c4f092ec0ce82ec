"""The reference MoE layer's token dispatch: fixed-shape (sorted by expert, grouped matmul) vs the per-expert loop.

``python -m benchmarks.bench_moe_dispatch [--presets tiny,small] [--repeats N] [--threads T] [--quick]``

For each preset, one MoE layer of the preset's dimensions (``dim``, ``moe_ffn_hidden``, experts, top-k, score
function, shared expert) runs forward + backward on ``b×S`` tokens in two ways, interleaved repeat by repeat in
one process: ``GroupedExperts.forward(..., topk)`` (model/moe.py: sort by expert, ``torch._grouped_mm`` or a
padded batched matmul, no host read) and the same module without ``topk`` (the per-expert ``nonzero`` loop the
layer used before, kept for expert parallelism). Reported: median and minimum ms per forward+backward, their
ratio, and the host reads per layer forward (``Tensor.nonzero``/``item``/``tolist``/``bool`` calls counted).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks._util import machine_info, markdown_table, write_json
from lossparity.model.config import get_config
from lossparity.model.moe import MoE

TOKENS = {"tiny": (8, 64), "small": (8, 128), "medium": (8, 256)}
_HOST_READS = ("nonzero", "item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def count_host_reads() -> Iterator[list[int]]:
    """Count the Tensor -> host conversions made inside the block (the first element of the yielded list)."""
    counter = [0]
    saved = {n: getattr(torch.Tensor, n) for n in _HOST_READS}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return fn(*args, **kwargs)

        return counted

    try:
        for n, f in saved.items():
            setattr(torch.Tensor, n, wrap(f))
        yield counter
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _layer(preset: str) -> MoE:
    c = get_config(preset)
    torch.manual_seed(0)
    return MoE(c.dim, c.moe_ffn_hidden, c.num_experts, c.topk, c.score_function, c.shared_expert, layer_id=1)


def _step(layer: MoE, x: torch.Tensor, sorted_dispatch: bool) -> None:
    """Forward + backward of the layer's routed experts (router and shared expert included)."""
    flat = x.reshape(-1, x.shape[-1])
    gates, record = layer.router(flat)
    k = layer.router.topk if sorted_dispatch else None
    y = layer.experts(flat, gates, record.dispatch_map, k)
    if layer.shared is not None:
        y = y + layer.shared(flat)
    y.square().sum().backward()


def run_preset(preset: str, repeats: int) -> dict[str, Any]:
    layer = _layer(preset)
    b, s = TOKENS[preset]
    x = torch.randn(b, s, layer.router.weight.shape[1], generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"sorted": [], "loop": []}
    reads = {}
    for name in times:  # warm-up, and the host reads of one call
        with count_host_reads() as counter:
            _step(layer, x, name == "sorted")
        reads[name] = counter[0]
    for _ in range(repeats):
        for name in times:
            layer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _step(layer, x, name == "sorted")
            times[name].append(time.perf_counter() - t0)
    c = get_config(preset)
    out: dict[str, Any] = {"preset": preset, "tokens": f"{b}x{s}", "experts": c.num_experts, "topk": c.topk}
    for name, t in times.items():
        out[name] = {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "host_reads": reads[name]}
    out["ratio_median"] = out["sorted"]["median_ms"] / out["loop"]["median_ms"]
    out["ratio_min"] = out["sorted"]["min_ms"] / out["loop"]["min_ms"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny preset, 3 repeats")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    presets = ["tiny"] if args.quick else args.presets.split(",")
    repeats = 3 if args.quick else args.repeats
    results = [run_preset(name, repeats) for name in presets]
    rows = [
        [
            r["preset"],
            r["tokens"],
            f"{r['experts']}/{r['topk']}",
            f"{r['loop']['median_ms']:.2f} ({r['loop']['min_ms']:.2f})",
            f"{r['sorted']['median_ms']:.2f} ({r['sorted']['min_ms']:.2f})",
            f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f})",
            f"{r['loop']['host_reads']} / {r['sorted']['host_reads']}",
        ]
        for r in results
    ]
    headers = [
        "preset",
        "b×S",
        "E/k",
        "loop ms median (min)",
        "sorted ms median (min)",
        "sorted / loop",
        "host reads per layer forward: loop / sorted",
    ]
    print(markdown_table(headers, rows), flush=True)
    payload = {"machine": machine_info(torch.device("cpu")), "repeats": repeats, "results": results}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
