"""Prepared GPU benchmark (not run in CI): ``python -m benchmarks.gpu --out DIR`` on a CUDA machine.

1. The weighted output-layer loss ``Σ w·CE`` (ragged per-token weights) by naive (``hidden @ W.T`` +
   ``F.cross_entropy``), lossparity's chunked and fused cross-entropy and, each when its package
   imports, Liger Kernel's fused linear cross-entropy (``reduction='none'``) and cut-cross-entropy's
   ``cce`` kernel, on realistic shapes (default ``T=32768, V=151936, H=4096``, bf16):
   forward+backward time (CUDA events) and peak memory (``torch.cuda.max_memory_allocated``) of
   each, side by side.
2. One ``verify`` on the GPU: the tiny MoE+MTP model in float64 under the single-process layouts
   (``1x1``, ``K=4``, ``K=4`` with recompute), every mode.
3. The MoE auxiliary-loss path against the MoE layers (``benchmarks.bench_moe_aux``, one joint
   backward, scopes ``microbatch`` and ``global_lagged``) at the ``small``, ``medium`` and ``100m``
   presets: on a GPU both sides pay kernel launches, so the CPU ratios need not carry over.

Writes ``DIR/gpu_bench.json`` and prints Markdown tables. Sized to finish well under 8 minutes on an
H200-class GPU (the naive path at the default shape materializes 32768×151936 bf16 logits, ~10 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F


def _bench(fn, repeats: int) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
    }


def _peers(hidden, weight, labels, weights) -> dict:
    """Liger Kernel's fused linear cross-entropy and cut-cross-entropy's ``cce`` kernel, each only when its
    package imports; every method returns ``Σ w·l`` (the same objective)."""
    peers = {}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="none")  # per-token: fixed in Liger >= 0.8.2
        peers["liger_flce"] = lambda: (liger(weight, hidden, labels).float() * weights).sum()
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        peers["cce"] = lambda: (
            linear_cross_entropy(hidden, weight, labels, reduction="none", impl="cce").float() * weights
        ).sum()
    except ImportError:
        pass
    return peers


def cross_entropy_bench(T: int, V: int, H: int, repeats: int) -> list[dict]:
    from lossparity.losses.cross_entropy import chunked_cross_entropy
    from lossparity.losses.fused_cross_entropy import fused_linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(T, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    labels[::7] = -100
    weights = torch.rand(T, device="cuda", generator=g) / T  # ragged per-token objective weights

    def run(f):
        def step():
            hidden.grad = weight.grad = None
            f().backward()

        return step

    methods = {
        "naive": lambda: (F.cross_entropy((hidden @ weight.T).float(), labels, reduction="none") * weights).sum(),
        "chunked": lambda: (chunked_cross_entropy(hidden, weight, labels) * weights).sum(),
        "fused": lambda: fused_linear_cross_entropy(hidden, weight, labels, weights)[0],
        **_peers(hidden, weight, labels, weights),
    }
    rows = []
    for name, f in methods.items():
        run(f)()  # warm-up (kernel selection, Triton compile)
        r = _bench(run(f), repeats)
        rows.append({"method": name, "T": T, "V": V, "H": H, **r})
    ref = next(r for r in rows if r["method"] == "naive")
    for r in rows:
        r["time_vs_naive"] = r["median_s"] / ref["median_s"]
        r["memory_vs_naive"] = r["peak_extra_gib"] / ref["peak_extra_gib"]
    return rows


def gpu_verify(steps: int) -> dict:
    from lossparity.verify.reference import Layout, format_table, run_verify

    layouts = (Layout("1x1", 1, 1), Layout("K=4", 1, 4), Layout("K=4+recompute", 1, 4, True))
    report = run_verify(layouts, steps=steps, overrides={"device": "cuda"}, progress=False)
    print(format_table(report))
    return report


def moe_aux_bench(presets: list[str], repeats: int) -> list[dict]:
    from benchmarks.bench_moe_aux import FULL, bench_case

    device = torch.device("cuda")
    cases = [
        bench_case(p, *FULL[p], scope, repeats, 3, device) for p in presets for scope in ("microbatch", "global_lagged")
    ]
    print("| preset | scope | MoE fwd+bwd ms/step | aux path ms/step | aux / MoE | ops/step |")
    print("|---|---|---|---|---|---|")
    for c in cases:
        print(
            f"| {c['preset']} | {c['scope']} | {c['moe']['median_s'] * 1e3:.2f} | {c['aux']['median_s'] * 1e3:.3f} | "
            f"{100 * c['ratio']:.2f}% | {c['ops_per_step']} |"
        )
    return cases


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_bench.json")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--H", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--verify-steps", type=int, default=3)
    p.add_argument("--moe-presets", default="small,medium,100m", help="presets of the MoE aux-path step ('' skips)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA device")
    t0 = time.perf_counter()
    rows = cross_entropy_bench(args.T, args.V, args.H, args.repeats)
    print("| method | T×V×H | median s | min s | peak extra GiB | time / naive | memory / naive |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['T']}×{r['V']}×{r['H']} | {r['median_s']:.3f} | {r['min_s']:.3f} | "
            f"{r['peak_extra_gib']:.2f} | {r['time_vs_naive']:.2f} | {r['memory_vs_naive']:.2f} |"
        )
    report = gpu_verify(args.verify_steps)
    moe = moe_aux_bench([x for x in args.moe_presets.split(",") if x], repeats=10)
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cross_entropy": rows,
        "verify": report,
        "moe_aux": moe,
        "wall_s": time.perf_counter() - t0,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return payload


if __name__ == "__main__":
    main()
