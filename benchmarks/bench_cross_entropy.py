"""Forward+backward time, first-call peak extra memory and float64 correctness of the output-layer loss.

Every method computes the same objective ``J = Σ_t w_t·CE_t`` (ragged positive per-token weights ``w``)
of ``z = hidden @ W.T`` and back-propagates it:

- ``naive``: ``F.cross_entropy(hidden @ W.T, reduction='none')`` then ``Σ w·l`` (the baseline);
- ``compiled naive``: the same under ``torch.compile`` (skipped with a note if it fails);
- ``chunked``: :func:`lossparity.chunked_cross_entropy` (logits recomputed in the backward);
- ``fused``: :func:`lossparity.fused_linear_cross_entropy` (gradients formed in the forward);
- ``cce torch_compile``: cut-cross-entropy's ``linear_cross_entropy(impl="torch_compile")`` when the
  package imports (it needs ``triton`` to import).

Time: all methods in this one process, interleaved repeat by repeat (machine noise hits them alike),
after one untimed call each per shape; median and minimum of ``--repeats`` calls. Peak memory: the
*first* forward+backward of a fresh subprocess per (method, shape), because after a first call freed
buffers stay resident in the allocator and a high-water mark taken on a repeat undercounts (compiled
methods are compiled on a tiny shape first, with dynamic shapes, so that the probe measures the call
and not the compiler). Method: see ``benchmarks/_util.py``. Correctness: each method on the first
``CHECK_TOKENS`` tokens of the shape (full ``V`` and ``H``) against a float64 autograd formula:
largest relative error of ``J``, ``∂J/∂h`` and ``∂J/∂W`` (max abs difference / max abs reference).

    python -m benchmarks.bench_cross_entropy [--quick] [--json PATH] [--repeats N] [--[no-]compile]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lossparity.losses.cross_entropy import chunked_cross_entropy, naive_cross_entropy
from lossparity.losses.fused_cross_entropy import fused_linear_cross_entropy, fused_tiling

from ._util import MiB, machine_info, markdown_table, measure, memory_method, summarize, write_json

FULL_SHAPES = [(2048, 32768, 512), (8192, 32768, 256), (8192, 32768, 512), (8192, 131072, 512)]
QUICK_SHAPES = [(256, 4096, 64), (1024, 8192, 128)]
CHECK_TOKENS = 512
TINY = (64, 256, 32)  # compile warm-up shape of the memory probes
# [T, V] float32 tensors a method holds at its peak: refuse a shape the machine cannot hold (with room
# left for the other processes of a shared machine)
LOGIT_COPIES = {"naive": 3.5, "compiled naive": 1.5, "cce torch_compile": 1.5}
MEMORY_SHARE = 0.6
TARGET_TIME_VS_NAIVE = 0.9
TARGET_MEMORY_VS_NAIVE = 0.05  # at 8192×32768 tokens×vocabulary and larger
TARGET_MEMORY_VS_FLOOR = 1.5  # below that: vs grad_h + grad_W + one tile

Method = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _plain_naive(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    # no input validation: its data-dependent checks would break the compiled graph
    return F.cross_entropy(hidden @ weight.t(), labels, reduction="none")


def _weighted(per_token: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Method:
    def run(hidden: Tensor, weight: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        loss = per_token(hidden, weight, labels)
        return (weights * loss).sum(), loss.detach()

    return run


def _cce() -> Method | str:
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:  # ImportError, or triton failing at import
        return f"skipped: cut_cross_entropy does not import ({type(exc).__name__})"
    return _weighted(lambda h, w, y: linear_cross_entropy(h, w, y, reduction="none", impl="torch_compile"))


def methods(compile_naive: bool) -> dict[str, Method | str]:
    """Every method by name; a string instead of a function says why the method is skipped."""
    out: dict[str, Method | str] = {
        "naive": _weighted(naive_cross_entropy),
        "compiled naive": _weighted(torch.compile(_plain_naive, dynamic=True))
        if compile_naive
        else "skipped: --no-compile",
        "chunked": _weighted(chunked_cross_entropy),
        "fused": fused_linear_cross_entropy,
    }
    out["cce torch_compile"] = _cce() if compile_naive else "skipped: --no-compile"
    return out


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _too_big(name: str, shape: tuple[int, int, int], device: torch.device, share: float = MEMORY_SHARE) -> str | None:
    tokens, vocab, _ = shape
    need = LOGIT_COPIES.get(name, 0.0) * tokens * vocab * 4
    avail = _available_bytes() if device.type == "cpu" else None
    if avail is not None and need > share * avail:
        return f"skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} available"
    return None


def _inputs(tokens: int, vocab: int, hsize: int, device: torch.device) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens * 31 + vocab + hsize)
    hidden = torch.randn(tokens, hsize, generator=gen).to(device).requires_grad_()
    # scaled like a trained head so that the softmax is neither flat nor one-hot
    weight = (torch.randn(vocab, hsize, generator=gen) * hsize**-0.5).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    weights = (torch.rand(tokens, generator=gen) + 0.5).to(device) / tokens  # ragged, like per-sample weights
    return hidden, weight, labels, weights


def _step(fn: Method, inputs: tuple[Tensor, ...]) -> None:
    hidden, weight = inputs[0], inputs[1]
    hidden.grad = weight.grad = None  # freed before the call: the new gradients count as extra memory
    total, _ = fn(*inputs)
    total.backward()


def probe_memory(name: str, shape: tuple[int, int, int], device: torch.device) -> int | None:
    """Peak extra bytes of the first forward+backward of ``name`` at ``shape`` in this (fresh) process."""
    fn = methods(compile_naive=True)[name]
    assert not isinstance(fn, str), fn
    if name in ("compiled naive", "cce torch_compile"):
        _step(fn, _inputs(*TINY, device))
    inputs = _inputs(*shape, device)
    return measure(lambda: _step(fn, inputs), device)[1]


def _probe_subprocess(name: str, shape: tuple[int, int, int], device: torch.device) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_cross_entropy",
        "--probe",
        name,
        *map(str, shape),
        "--device",
        str(device),
        "--threads",
        str(torch.get_num_threads()),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        return {"probe_error": proc.stderr.strip().splitlines()[-1][:120] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_float64(fn: Method, shape: tuple[int, int, int], device: torch.device) -> dict[str, float]:
    """Largest relative error of ``J``, ``∂J/∂h``, ``∂J/∂W`` on the first ``CHECK_TOKENS`` tokens."""
    tokens = min(shape[0], CHECK_TOKENS)
    hidden, weight, labels, weights = (x.detach() for x in _inputs(*shape, device))
    hidden, labels, weights = hidden[:tokens], labels[:tokens], weights[:tokens]
    got = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    total, _ = fn(got[0], got[1], labels, weights)
    total.backward()
    ref = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
    z = ref[0] @ ref[1].t()
    loss = torch.logsumexp(z, 1) - z.gather(1, labels.unsqueeze(1)).squeeze(1)
    ref_total = (weights.double() * loss).sum()
    ref_total.backward()
    pairs = [(total.detach(), ref_total.detach()), (got[0].grad, ref[0].grad), (got[1].grad, ref[1].grad)]
    errs = [float((a.double() - b).abs().max() / b.abs().max()) for a, b in pairs]
    return {"rel_err_J": errs[0], "rel_err_grad_h": errs[1], "rel_err_grad_W": errs[2]}


def bench_shape(
    shape: tuple[int, int, int],
    fns: dict[str, Method | str],
    repeats: int,
    device: torch.device,
    memory_share: float = MEMORY_SHARE,
) -> dict[str, dict]:
    """Time every method ``repeats`` times (interleaved, after one untimed call), probe its first-call
    memory in a subprocess and check it against float64; a ``note`` says why a method was skipped."""
    results: dict[str, dict] = {}
    active: dict[str, Method] = {}
    inputs = _inputs(*shape, device)
    for name, fn in fns.items():
        note = fn if isinstance(fn, str) else _too_big(name, shape, device, memory_share)
        if note:
            results[name] = {"note": note}
            continue
        try:
            results[name] = {"times_s": [], "warmup_s": measure(functools.partial(_step, fn, inputs), device)[0]}
        except Exception as exc:  # torch.compile can fail in many ways (no compiler, unsupported op)
            results[name] = {"note": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"}
            continue
        active[name] = fn
    for _ in range(repeats):
        for name, fn in active.items():
            results[name]["times_s"].append(measure(functools.partial(_step, fn, inputs), device)[0])
    del inputs
    for name, fn in active.items():
        r = results[name]
        r.update(summarize(r["times_s"]))
        r.update(check_float64(fn, shape, device))
        r.update(_probe_subprocess(name, shape, device))
    return results


def floor_bytes(shape: tuple[int, int, int]) -> int:
    """grad_h + grad_W + one fused tile (float32): the least any exact method holds at the end of backward."""
    tokens, vocab, hsize = shape
    chunk, _ = fused_tiling(tokens, vocab, hsize)
    return 4 * (tokens * hsize + vocab * hsize + chunk * vocab)


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if value is None or not base else f"{value / base:.2f}"


def report_rows(shape: tuple[int, int, int], results: dict[str, dict]) -> list[list[str]]:
    """Table rows of one shape: figures, ratios to naive, float64 errors."""
    naive = results.get("naive", {})
    naive_mib = None if naive.get("peak_extra_bytes") is None else naive["peak_extra_bytes"] / MiB
    label = "×".join(str(x) for x in shape)
    rows = []
    for name, r in results.items():
        if "note" in r:
            rows.append([label, name, "–", "–", "–", "–", "–", "–", r["note"]])
            continue
        mib = None if r.get("peak_extra_bytes") is None else r["peak_extra_bytes"] / MiB
        err = max(r["rel_err_J"], r["rel_err_grad_h"], r["rel_err_grad_W"])
        note = "tile {}×{}".format(*fused_tiling(*shape)) if name == "fused" else r.get("probe_error", "")
        rows.append(
            [
                label,
                name,
                f"{r['median_s']:.3f}",
                f"{r['min_s']:.3f}",
                "–" if mib is None else f"{mib:.0f}",
                _ratio(r["median_s"], naive.get("median_s")),
                _ratio(mib, naive_mib),
                f"{err:.1e}",
                note,
            ]
        )
    return rows


def check_targets(shape: tuple[int, int, int], results: dict[str, dict]) -> dict:
    """The issue's targets for the fused method at one shape (None where a figure is missing)."""
    fused, naive = results.get("fused", {}), results.get("naive", {})
    peers = [r["median_s"] for n, r in results.items() if n not in ("fused", "naive") and "median_s" in r]
    out: dict = {"shape": list(shape)}
    if "median_s" not in fused:
        return out
    out["time_vs_naive"] = fused["median_s"] / naive["median_s"] if "median_s" in naive else None
    out["time_vs_best_peer"] = fused["median_s"] / min(peers) if peers else None
    mem = fused.get("peak_extra_bytes")
    if shape[0] * shape[1] >= 8192 * 32768:
        base = naive.get("peak_extra_bytes")
        out["memory_vs_naive"] = mem / base if mem is not None and base else None
        out["memory_target"] = TARGET_MEMORY_VS_NAIVE
        out["memory_met"] = None if out["memory_vs_naive"] is None else out["memory_vs_naive"] <= TARGET_MEMORY_VS_NAIVE
    else:
        out["memory_vs_floor"] = None if mem is None else mem / floor_bytes(shape)
        out["memory_target"] = TARGET_MEMORY_VS_FLOOR
        out["memory_met"] = None if mem is None else out["memory_vs_floor"] <= TARGET_MEMORY_VS_FLOOR
    tn, tp = out["time_vs_naive"], out["time_vs_best_peer"]
    out["time_met"] = None if tn is None else tn <= TARGET_TIME_VS_NAIVE and (tp is None or tp <= 1.0)
    return out


def _target_line(t: dict) -> str:
    def fmt(key: str, spec: str) -> str:
        return "–" if t.get(key) is None else format(t[key], spec)

    mem = (
        f"memory {fmt('memory_vs_naive', '.1%')} of naive (<= 5%)"
        if "memory_vs_naive" in t
        else f"memory {fmt('memory_vs_floor', '.2f')}x the floor (<= 1.5x)"
    )
    return (
        f"{'×'.join(map(str, t['shape']))}: fused time {fmt('time_vs_naive', '.2f')}x naive (<= 0.9x), "
        f"{fmt('time_vs_best_peer', '.2f')}x the best peer (<= 1x), {mem}"
    )


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
        help="include the torch.compile'd methods (default: yes, except with --quick: a cold "
        "compile alone takes ~25 s on 2 cores)",
    )
    parser.add_argument("--shapes", default="", help="T×V×H list, e.g. 2048x32768x512,8192x32768x256")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", default="", help="comma-separated subset of the methods (default: all)")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads, also in the memory probes (0: torch's default); on a "
        "busy shared machine 1 gives steadier figures",
    )
    parser.add_argument(
        "--memory-share",
        type=float,
        default=MEMORY_SHARE,
        help=f"skip a method whose estimated peak exceeds this share of the available memory (default "
        f"{MEMORY_SHARE}: room for other processes of a shared machine; raise it on an idle one)",
    )
    parser.add_argument("--probe", nargs=4, metavar=("METHOD", "T", "V", "H"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:  # subprocess mode: one first-call memory figure, as JSON on the last line
        shape = tuple(int(x) for x in args.probe[1:])
        print(json.dumps({"peak_extra_bytes": probe_memory(args.probe[0], shape, device)}))
        return {}
    shapes = (
        [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        if args.shapes
        else QUICK_SHAPES
        if args.quick
        else FULL_SHAPES
    )
    fns = methods(args.compile if args.compile is not None else not args.quick)
    if args.methods:
        keep = args.methods.split(",")
        fns = {name: fn if name in keep else "not run (--methods)" for name, fn in fns.items()}
    figures, rows, targets = [], [], []
    for shape in shapes:
        results = bench_shape(shape, fns, args.repeats, device, args.memory_share)
        figures.append({"T": shape[0], "V": shape[1], "H": shape[2], "dtype": "float32", "methods": results})
        rows += report_rows(shape, results)
        targets.append(check_targets(shape, results))
        print(f"done {'×'.join(map(str, shape))}: " + json.dumps(figures[-1]["methods"]), flush=True)
    print(
        markdown_table(
            [
                "T×V×H",
                "method",
                "median s",
                "min s",
                "first-call peak extra MiB",
                "time / naive",
                "memory / naive",
                "max rel err vs float64",
                "note",
            ],
            rows,
        )
    )
    print()
    for t in targets:
        if "time_vs_naive" in t:
            print(_target_line(t))
    method_note = memory_method(device)
    print(
        f"peak memory: {method_note}, first call of a fresh process; {args.repeats} repeats; "
        f"{torch.get_num_threads()} threads"
    )
    payload = {
        "benchmark": "cross_entropy",
        "machine": machine_info(device),
        "memory_method": method_note,
        "repeats": args.repeats,
        "targets": targets,
        "figures": figures,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
