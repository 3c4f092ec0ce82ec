"""Cost of the MoE auxiliary-loss and tracker path relative to the MoE layers themselves, per step.

For each model preset (default ``tiny`` and ``small``) and each aux scope, optimizer steps of ``K``
microbatches run every MoE layer of the model (main and MTP) on random hidden states of ``b × S`` tokens,
in two variants interleaved step by step in one process (machine noise hits them alike):

- *MoE layers*: the layers' forward (router, experts, shared expert) and the backward of their outputs;
- *MoE layers + aux path*: the same, plus per microbatch :meth:`MoEAccounting.microbatch_loss`
  (load-balancing share, router z-loss, log accumulation) back-propagated in **the same** backward as
  the layers' outputs (as in a training step: the share's gradient joins the router's own graph), and
  per step :meth:`MoEAccounting.router_tokens` (the step's count) and :meth:`MoEAccounting.end_step`
  (log hand-off, dispatch and top-k counts, expert-bias update).

The aux path's cost is the difference of the two variants' step times (the accountant's own calls,
``begin_step``/``lm_loss``/``finish_step``/``logs``, are not timed). Reported: medians over the repeated
steps after warm-up, the median of the per-pair ratios ``(t_aux − t_moe)/t_moe``, the same from the
minima (least disturbed by other processes on a shared machine), the directly timed ``microbatch_loss``
+ ``end_step`` (the forward side alone), and ``ops/step``: the aten operators the aux path adds to a step
(operators of the aux step minus those of the plain step, forward, backward and ``end_step``: a
machine-independent measure). Targets (issue 16): aux path <= 10% of the MoE layers at ``tiny``, <= 3% at
``small``. ``--threads`` fixes torch's intra-op threads (CPU figures of a shared machine are steadier
with 1).

    python -m benchmarks.bench_moe_aux [--quick] [--json PATH] [--repeats N] [--threads N] [--device D]
                                       [--presets tiny,small,medium,100m] [--compiled]

``--compiled`` prints another table instead: the per-microbatch aux math eager vs ``torch.compile``d, per
call, with the compile time (benchmarks/moe_aux_compiled.py).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lossparity.distributed.accountant import Accountant
from lossparity.distributed.moe.accounting import MoEAccounting
from lossparity.model import GPT, get_config
from lossparity.model.moe import MoE

from ._util import machine_info, markdown_table, summarize, write_json

SCOPES = ("microbatch", "sequence", "global_lagged", "global_running")
# rows per microbatch b, sequence length S, microbatches K, per preset
FULL = {"tiny": (8, 64, 2), "small": (8, 128, 2), "medium": (8, 128, 2), "100m": (4, 256, 2)}
QUICK = {"tiny": (4, 32, 2), "small": (4, 64, 2), "medium": (2, 64, 2), "100m": (1, 64, 2)}
TARGETS = {"tiny": 0.10, "small": 0.03}
TARGET_RATIO = 0.03  # the default target of presets without their own


class _CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside the context."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _moe_layers(model: GPT) -> list[MoE]:
    blocks = list(model.layers) + [m.block for m in model.mtp]
    return [blk.ffn for blk in blocks if isinstance(blk.ffn, MoE)]


def _valid(b: int, s: int, device: torch.device) -> Tensor:
    """Rows of uneven length (the tail of every other row is padding), one full row."""
    lengths = torch.tensor([s - (i % 3) * (s // 4) for i in range(b)], device=device)
    return torch.arange(s, device=device)[None, :] < lengths[:, None]


class _Case:
    """One preset's MoE layers, accountant and aux path, with the two step variants being compared."""

    def __init__(self, preset: str, b: int, s: int, k: int, scope: str, device: torch.device) -> None:
        cfg = get_config(preset)
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        self.cfg, self.k, self.device = cfg, k, device
        self.layers: list[nn.Module] = _moe_layers(model)
        self.routers = [m.router for m in self.layers]
        self.acc = Accountant("per_token", device=device)
        self.aux = MoEAccounting(
            self.acc, len(self.layers), cfg.num_experts, cfg.topk, scope=scope, aux_coeff=1e-2, z_coeff=1e-3
        )
        gen = torch.Generator().manual_seed(1)
        self.xs = [torch.randn(b, s, cfg.dim, generator=gen).to(device).requires_grad_() for _ in self.layers]
        self.grads = [torch.randn(b, s, cfg.dim, generator=gen).to(device) for _ in self.layers]
        self.one = torch.ones((), device=device)
        self.valid = _valid(b, s, device)
        self.mask = self.valid.float()
        self.zeros = torch.zeros(b, s, device=device)

    def _forward(self) -> tuple[list[Tensor], list]:
        outs, records = zip(*(layer(x, self.valid) for layer, x in zip(self.layers, self.xs)))
        return list(outs), list(records)

    def plain_step(self, ops: TorchDispatchMode | None = None) -> float:
        """The MoE layers' forward and backward of every microbatch (seconds)."""
        t = 0.0
        for _ in range(self.k):
            _sync(self.device)
            t0 = time.perf_counter()
            with ops if ops is not None else contextlib.nullcontext():
                outs, _ = self._forward()
                torch.autograd.backward(outs, self.grads)
            _sync(self.device)
            t += time.perf_counter() - t0
        for r in self.routers:  # what end_step does to the counters; not part of the MoE layers' time
            r.reset_counts()
        return t

    def aux_step(self, ops: TorchDispatchMode | None = None) -> tuple[float, float]:
        """The same with the aux path in the one backward: ``(step seconds, seconds of the aux calls)``."""
        ctx = ops if ops is not None else contextlib.nullcontext()
        acc, aux, k = self.acc, self.aux, self.k
        t0 = time.perf_counter()
        with ctx:
            extra = MoEAccounting.router_tokens([self.valid] * k)
        t = direct = time.perf_counter() - t0
        acc.begin_step([self.mask] * k, extra_counts=extra)
        for _ in range(k):
            _sync(self.device)
            t0 = time.perf_counter()
            with ctx:
                outs, records = self._forward()
            t1 = time.perf_counter()
            with ctx:
                share = aux.microbatch_loss(records, self.valid)
            _sync(self.device)
            t2 = time.perf_counter()
            with ctx:
                torch.autograd.backward([*outs, share], [*self.grads, self.one])
            _sync(self.device)
            t += time.perf_counter() - t0
            direct += t2 - t1
            acc.lm_loss(self.zeros, self.mask)
        acc.finish_step(None)
        _sync(self.device)
        t0 = time.perf_counter()
        with ctx:
            aux.end_step(self.routers, bias_rate=1e-3)
        _sync(self.device)
        t_end = time.perf_counter() - t0
        acc.logs()
        return t + t_end, direct + t_end


def bench_case(
    preset: str, b: int, s: int, k: int, scope: str, repeats: int, warmup: int, device: torch.device
) -> dict:
    """Per-step times (seconds) of the MoE layers with and without the aux path, for one preset and scope
    (see the module docstring)."""
    case = _Case(preset, b, s, k, scope, device)
    moe_t, aux_t, direct_t = [], [], []
    for step in range(warmup + repeats):
        t_moe = case.plain_step()
        t_aux, t_direct = case.aux_step()
        if step >= warmup:
            moe_t.append(t_moe)
            aux_t.append(t_aux - t_moe)
            direct_t.append(t_direct)
    plain_ops, aux_ops = _CountOps(), _CountOps()
    case.plain_step(plain_ops)
    case.aux_step(aux_ops)
    cfg = case.cfg
    return {
        "preset": preset,
        "scope": scope,
        "b": b,
        "seq_len": s,
        "microbatches": k,
        "moe_layers": len(case.layers),
        "num_experts": cfg.num_experts,
        "topk": cfg.topk,
        "score_function": cfg.score_function,
        "moe": summarize(moe_t),
        "aux": summarize(aux_t),
        "aux_forward_and_end_step": summarize(direct_t),
        "ratio": statistics.median(a / m for a, m in zip(aux_t, moe_t)),
        "ratio_of_minima": (min(m + a for m, a in zip(moe_t, aux_t)) - min(moe_t)) / min(moe_t),
        "ops_per_step": aux_ops.count - plain_ops.count,
        "target_ratio": TARGETS.get(preset, TARGET_RATIO),
    }


def _megatron_cell(m: dict) -> str:
    return f"skipped: {m['skipped']}" if "skipped" in m else f"{m['aux_ms']:.3f}"


def _megatron_ratio(c: dict, m: dict) -> str:
    return "" if "skipped" in m or m["aux_ms"] <= 0 else f"{c['aux']['median_s'] * 1e3 / m['aux_ms']:.2f}"


def megatron_case(preset: str, b: int, s: int, k: int, layers: int, repeats: int, warmup: int) -> dict:
    """Megatron's own aux path (``TopKRouter`` with aux + z loss minus without) at this preset's shapes, in a
    subprocess (benchmarks/megatron_router_aux.py); ``{"skipped": why}`` when megatron-core does not run."""
    import json
    import subprocess
    import sys

    from lossparity.distributed.launch import free_port

    cfg = get_config(preset)
    spec = dict(preset=preset, b=b, s=s, k=k, layers=layers, dim=cfg.dim, experts=cfg.num_experts, topk=cfg.topk)
    spec.update(score=cfg.score_function, threads=torch.get_num_threads(), port=free_port())
    spec.update(warmup=warmup, repeats=repeats)
    cmd = [sys.executable, "-m", "benchmarks.megatron_router_aux", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return {"skipped": "timed out"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"skipped": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    return json.loads(lines[-1][len("RESULT ") :])


def _compiled(
    args: argparse.Namespace, presets: list[str], shapes: dict, repeats: int, warmup: int, device: torch.device
) -> dict:
    """``--compiled``: the table of benchmarks/moe_aux_compiled.py (CPU; ``--repeats`` calls of each variant)."""
    from .moe_aux_compiled import compiled_table

    if device.type != "cpu":
        raise SystemExit("--compiled: CPU only (--device cpu)")
    table, results = compiled_table(presets, shapes, torch.get_num_threads(), repeats * 20, warmup * 10)
    print(table)
    payload = {"benchmark": "moe_aux_compiled", "machine": machine_info(device), "cases": results}
    if args.json:
        write_json(args.json, payload)
    return payload


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the Markdown table and return (and optionally write) the JSON payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per case (default 15, quick 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--presets", default="tiny,small", help="comma-separated model presets (default tiny,small)")
    parser.add_argument("--no-megatron", action="store_true", help="skip the megatron-core TopKRouter column")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="instead: the per-microbatch aux math eager vs torch.compile (benchmarks/moe_aux_compiled.py)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = args.repeats or (3 if args.quick else 15)
    warmup = 1 if args.quick else 3
    shapes = QUICK if args.quick else FULL
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in shapes]
    if unknown:
        parser.error(f"--presets: unknown preset(s) {unknown}; valid: {', '.join(shapes)}")
    if args.compiled:
        return _compiled(args, presets, shapes, repeats, warmup, device)
    cases = [bench_case(p, *shapes[p], scope, repeats, warmup, device) for p in presets for scope in SCOPES]
    megatron = {}
    for p in presets:
        layers = next(c["moe_layers"] for c in cases if c["preset"] == p)
        skip = {"skipped": "--no-megatron"} if args.no_megatron or device.type != "cpu" else None
        megatron[p] = skip or megatron_case(p, *shapes[p], layers, repeats, warmup)
    rows = [
        [
            c["preset"],
            c["scope"],
            f"{c['b']}x{c['seq_len']}",
            c["microbatches"],
            c["moe_layers"],
            f"{c['moe']['median_s'] * 1e3:.2f}",
            f"{c['aux']['median_s'] * 1e3:.3f}",
            f"{c['aux_forward_and_end_step']['median_s'] * 1e3:.3f}",
            f"{100 * c['ratio']:.2f}%",
            f"{100 * c['ratio_of_minima']:.2f}%",
            f"{100 * c['target_ratio']:.0f}%",
            c["ops_per_step"],
            _megatron_cell(megatron[c["preset"]]),
            _megatron_ratio(c, megatron[c["preset"]]),
        ]
        for c in cases
    ]
    print(
        markdown_table(
            [
                "preset",
                "scope",
                "b×S",
                "K",
                "MoE layers",
                "MoE fwd+bwd ms/step",
                "aux path ms/step",
                "microbatch_loss+end_step ms",
                "aux / MoE",
                "from minima",
                "target",
                "ops/step",
                "Megatron TopKRouter aux ms/step",
                "ours / Megatron",
            ],
            rows,
        )
    )
    worst = max(c["ratio"] for c in cases)
    print(f"\nworst median ratio {100 * worst:.2f}% (targets: {TARGETS}, others {100 * TARGET_RATIO:.0f}%)")
    payload = {
        "benchmark": "moe_aux",
        "targets": TARGETS,
        "target_ratio": TARGET_RATIO,
        "worst_ratio": worst,
        "repeats": repeats,
        "warmup": warmup,
        "machine": machine_info(device),
        "cases": cases,
        "megatron": megatron,
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
