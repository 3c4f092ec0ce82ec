"""Forward+backward time and peak extra memory of the output-layer cross-entropy.

Compares, in one process and interleaved repeat by repeat (so machine noise hits all methods alike):
- ``naive``: ``hidden @ W.T`` then ``F.cross_entropy(reduction='none')`` (:func:`naive_cross_entropy`);
- ``chunked``: :func:`chunked_cross_entropy` with its default tiling;
- ``compiled naive``: the naive formula under ``torch.compile`` (skipped with a note if it fails).

Each call is ``loss = f(h, W, y); loss.backward(g)`` with per-token weights ``g = 1/T`` and fresh
gradients (their allocation is counted). Peak memory method: see ``benchmarks/_util.py``. Every method
gets one untimed call on the first shape only (lazy initialisation, compilation with dynamic shapes, so
later shapes do not recompile); the reported figures are the median and minimum of ``--repeats`` calls.

    python -m benchmarks.bench_cross_entropy [--quick] [--json PATH] [--repeats N] [--[no-]compile]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lossparity.losses.cross_entropy import chunked_cross_entropy, default_tiling, naive_cross_entropy

from ._util import MiB, machine_info, markdown_table, measure, memory_method, summarize, write_json

FULL_SHAPES = [(2048, 32768, 512), (8192, 131072, 512)]  # ~5 min on 2 idle cores
QUICK_SHAPES = [(256, 4096, 64), (1024, 8192, 128)]
# naive holds ~3 [T, V] float32 tensors at its backward peak; refuse a shape the machine cannot hold
NAIVE_LOGIT_COPIES = 3.5
TARGET_MEMORY_RATIO = 0.10
TARGET_TIME_RATIO = 1.2

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def _plain_naive(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    # no input validation: its data-dependent checks would break the compiled graph
    return F.cross_entropy(hidden @ weight.t(), labels, reduction="none")


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _inputs(tokens: int, vocab: int, hsize: int, device: torch.device) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens * 31 + vocab)
    hidden = torch.randn(tokens, hsize, generator=gen).to(device).requires_grad_()
    # scaled like a trained head so that the softmax is neither flat nor one-hot
    weight = (torch.randn(vocab, hsize, generator=gen) * hsize**-0.5).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    grad = torch.full((tokens,), 1.0 / tokens, device=device)
    return hidden, weight, labels, grad


def _step(fn: LossFn, hidden: Tensor, weight: Tensor, labels: Tensor, grad: Tensor) -> Tensor:
    loss = fn(hidden, weight, labels)
    loss.backward(grad)
    return loss.detach()


def _measure_step(fn: LossFn, inputs: tuple[Tensor, ...], device: torch.device) -> tuple[float, int | None, Tensor]:
    hidden, weight = inputs[0], inputs[1]
    hidden.grad = weight.grad = None  # freed before the baseline: the new gradients count as extra memory
    out: list[Tensor] = []
    elapsed, peak = measure(lambda: out.append(_step(fn, *inputs)), device)
    return elapsed, peak, out[0]


def bench_shape(
    shape: tuple[int, int, int],
    methods: dict[str, LossFn],
    repeats: int,
    device: torch.device,
    warmup: bool,
) -> dict[str, dict]:
    """Time every method ``repeats`` times on one shape (after one untimed call each if ``warmup``: the
    first shape pays lazy initialisation and compilation); returns per-method figures, or a ``note``
    saying why a method was skipped."""
    tokens, vocab, hsize = shape
    inputs = _inputs(tokens, vocab, hsize, device)
    need = NAIVE_LOGIT_COPIES * tokens * vocab * 4
    avail = _available_bytes() if device.type == "cpu" else None
    results: dict[str, dict] = {}
    active: dict[str, LossFn] = {}
    for name, fn in methods.items():
        if name != "chunked" and avail is not None and need > avail:
            results[name] = {"note": f"skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} available"}
            continue
        results[name] = {"times_s": [], "peak_extra_bytes": []}
        if warmup:
            try:
                results[name]["warmup_s"] = _measure_step(fn, inputs, device)[0]
            except Exception as exc:  # torch.compile can fail in many ways (no compiler, unsupported op)
                results[name] = {"note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"}
                continue
        active[name] = fn
    losses: dict[str, Tensor] = {}
    for _ in range(repeats):
        for name, fn in active.items():
            elapsed, peak, losses[name] = _measure_step(fn, inputs, device)
            results[name]["times_s"].append(elapsed)
            results[name]["peak_extra_bytes"].append(peak)
    for name in active:
        r = results[name]
        r.update(summarize(r["times_s"]))
        peaks = [p for p in r["peak_extra_bytes"] if p is not None]
        r["peak_extra_mib"] = max(peaks) / MiB if peaks else None
        if name != "naive" and "naive" in losses:
            r["max_abs_loss_diff_vs_naive"] = (losses[name] - losses["naive"]).abs().max().item()
    return results


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}"


def report_rows(shape: tuple[int, int, int], results: dict[str, dict]) -> list[list[str]]:
    """Table rows of one shape: figures and ratios to naive."""
    naive = results.get("naive", {})
    rows = []
    for name, r in results.items():
        label = "×".join(str(x) for x in shape)
        if "note" in r:
            rows.append([label, name, "–", "–", "–", "–", "–", r["note"]])
            continue
        mib = r["peak_extra_mib"]
        note = f"first call (compile) {r['warmup_s']:.1f} s" if "warmup_s" in r and name == "compiled naive" else ""
        if name == "chunked":
            note = "tile {}×{}".format(*default_tiling(shape[1]))
        rows.append([
            label,
            name,
            f"{r['median_s']:.3f}",
            f"{r['min_s']:.3f}",
            "–" if mib is None else f"{mib:.0f}",
            _ratio(r["median_s"], naive.get("median_s")),
            _ratio(mib, naive.get("peak_extra_mib")),
            note,
        ])
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the Markdown table and the target check, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, well under a minute")
    parser.add_argument("--json", help="write the figures to this JSON file")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per method and shape")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="include the torch.compile'd naive (default: yes, except with --quick: a cold compile alone "
        "takes ~25 s on 2 cores)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES

    methods: dict[str, LossFn] = {
        "naive": naive_cross_entropy,
        "chunked": chunked_cross_entropy,
    }
    if args.compile if args.compile is not None else not args.quick:
        methods["compiled naive"] = torch.compile(_plain_naive, dynamic=True)

    figures = []
    rows: list[list[str]] = []
    for i, shape in enumerate(shapes):
        results = bench_shape(shape, methods, args.repeats, device, warmup=i == 0)
        figures.append({"T": shape[0], "V": shape[1], "H": shape[2], "dtype": "float32", "methods": results})
        rows += report_rows(shape, results)
    headers = ["T×V×H", "method", "median s", "min s", "peak extra MiB", "time / naive",
               "memory / naive", "note"]
    print(markdown_table(headers, rows))

    last = figures[-1]["methods"]
    check = {}
    if "median_s" in last.get("naive", {}) and "median_s" in last.get("chunked", {}):
        mem = last["chunked"]["peak_extra_mib"] / last["naive"]["peak_extra_mib"]
        tim = last["chunked"]["median_s"] / last["naive"]["median_s"]
        check = {"memory_ratio": mem, "time_ratio": tim,
                 "memory_target_met": mem <= TARGET_MEMORY_RATIO, "time_target_met": tim <= TARGET_TIME_RATIO}
        print(f"\nlargest shape: chunked peak extra memory {mem:.1%} of naive (target <= "
              f"{TARGET_MEMORY_RATIO:.0%}), time {tim:.2f}x naive (target <= {TARGET_TIME_RATIO}x)")
    method_note = memory_method(device)
    print(f"peak memory: {method_note}; {args.repeats} repeats; {torch.get_num_threads()} threads")
    payload = {
        "benchmark": "cross_entropy",
        "machine": machine_info(device),
        "memory_method": method_note,
        "repeats": args.repeats,
        "target": check,
        "figures": figures,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
