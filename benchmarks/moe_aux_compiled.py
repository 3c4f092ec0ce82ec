"""``python -m benchmarks.bench_moe_aux --compiled``: the per-microbatch MoE aux math, eager vs ``torch.compile``.

The math timed (:func:`aux_math`) is the arithmetic :meth:`MoEAccounting.microbatch_loss` runs per microbatch
at the ``microbatch`` scope with the load-balancing and z terms on, built from the library's own formulas,
without the accountant's state (log vector, NaN flags, the autograd hand-off) and with the microbatch's own
token count as the normaliser: the scores, top-k maps and
logits of the ``L`` MoE layers stacked in float32, one batched token sum for the score sums ``P`` and the
top-k counts ``c``, the Switch weights ``K`` (:func:`~lossparity.losses.moe.switch_load_balancing_weights`),
the share ``Σ_l w_l·(Σ_e K_le·P_le + β·z_l/T)`` and the z-loss sums with their gradient
(:func:`~lossparity.losses.moe.router_z_loss_sums_and_grad`). Inputs: the router records of one forward of
the preset's MoE layers on the benchmark's microbatch (``b × S`` tokens, rows of uneven length).

Each preset runs in a fresh process (``python -m benchmarks.moe_aux_compiled SPEC``), so that its first
compiled call is the process's first compilation: that call's time is the compile time. Then eager and
compiled calls alternate (machine noise hits them alike); reported: the median per call of each, the saving
per step (``K`` calls), the steps after which the compile time is repaid, and the largest relative
difference of the compiled share and gradients from the eager ones (inductor reduces in another order).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch
from torch import Tensor

from lossparity.distributed.moe.grad import token_sum
from lossparity.losses.moe import router_z_loss_sums_and_grad, switch_load_balancing_weights

AUX_COEFF, Z_COEFF = 1e-2, 1e-3  # bench_moe_aux's coefficients


def aux_math(
    stacked: Tensor, valid: Tensor, w: Tensor, *, topk: int, num_experts: int, aux_coeff: float, z_coeff: float
) -> tuple[Tensor, Tensor, Tensor]:
    """One microbatch's aux share at the ``microbatch`` scope, with its gradients (no autograd graph).

    ``stacked [3L, T, E]``: the ``L`` layers' scores ``p``, top-k maps ``m`` (0/1) and logits ``x``, stacked
    in that order; ``valid [T]`` (0/1 floats), ``w [L]`` the layer weights. With ``T = Σ valid``,
    ``P_le = Σ_t valid_t·p[l,t,e]``, ``c_le = Σ_t valid_t·m[l,t,e]``, ``K_le = aux_coeff·E·c_le/(k·T²)`` and
    ``z_l = Σ_t valid_t·lse(x[l,t])²``, returns ``(share, K, G)``::

        share = Σ_l w_l·(Σ_e K_le·P_le + z_coeff·z_l/T)

    ``K`` is ``∂share/∂p`` divided by ``w_l`` per valid token; ``G = ∂share/∂x`` ``[L, T, E]``.
    """
    n = stacked.shape[0] // 3
    tt = valid.sum()
    sums = token_sum(stacked[: 2 * n], valid)  # [2L, E]: score sums, then top-k counts
    k = switch_load_balancing_weights(sums[n:], tt, topk=topk, num_experts=num_experts, coeff=aux_coeff)
    z_scale = w * (z_coeff / tt.clamp(min=1.0))
    z, g = router_z_loss_sums_and_grad(stacked[2 * n :], valid, z_scale)
    return (sums[:n] * k).sum(dim=-1) @ w + z @ z_scale, k, g


def _inputs(preset: str, b: int, s: int, k: int) -> tuple[Tensor, Tensor, Tensor, dict]:
    """The stacked router records of one forward of the preset's MoE layers, the valid mask, the weights."""
    from .bench_moe_aux import _Case

    case = _Case(preset, b, s, k, "microbatch", torch.device("cpu"))
    with torch.no_grad():
        _, records = case._forward()
    stacked = torch.stack(
        [r.probs for r in records] + [r.topk_map.float() for r in records] + [r.logits for r in records]
    ).float()
    n = len(records)
    w = torch.full((n,), 1.0 / n)
    kw = dict(topk=case.cfg.topk, num_experts=case.cfg.num_experts, aux_coeff=AUX_COEFF, z_coeff=Z_COEFF)
    return stacked.contiguous(), case.valid.reshape(-1).float(), w, kw


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def run_one(spec: dict) -> dict:
    """In this (fresh) process: compile time, then eager vs compiled per call (seconds) for one preset."""
    torch.set_num_threads(spec["threads"])
    stacked, valid, w, kw = _inputs(spec["preset"], spec["b"], spec["s"], spec["k"])
    compiled = torch.compile(aux_math)
    t0 = time.perf_counter()
    out_c = compiled(stacked, valid, w, **kw)
    first = time.perf_counter() - t0
    out_e = aux_math(stacked, valid, w, **kw)
    eager_t, comp_t = [], []
    for i in range(spec["warmup"] + spec["repeats"]):
        for fn, times in ((aux_math, eager_t), (compiled, comp_t)):
            t0 = time.perf_counter()
            fn(stacked, valid, w, **kw)
            if i >= spec["warmup"]:
                times.append(time.perf_counter() - t0)
    return {
        "preset": spec["preset"],
        "tokens": stacked.shape[1],
        "layers": stacked.shape[0] // 3,
        "experts": stacked.shape[2],
        "first_compiled_call_s": first,
        "eager_s": statistics.median(eager_t),
        "compiled_s": statistics.median(comp_t),
        "rel_diff": max(_rel(c, e) for c, e in zip(out_c, out_e)),
    }


def compiled_table(presets: list[str], shapes: dict, threads: int, repeats: int, warmup: int) -> tuple[str, list]:
    """One fresh process per preset (:func:`run_one`); returns the Markdown table and the results."""
    from ._util import markdown_table

    results, rows = [], []
    for p in presets:
        b, s, k = shapes[p]
        spec = dict(preset=p, b=b, s=s, k=k, threads=threads, repeats=repeats, warmup=warmup)
        cmd = [sys.executable, "-m", "benchmarks.moe_aux_compiled", json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"--compiled {p}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        r = json.loads(lines[-1][len("RESULT ") :])
        saved = (r["eager_s"] - r["compiled_s"]) * k
        repay = f"{r['first_compiled_call_s'] / saved:,.0f}" if saved > 0 else "never"
        r.update(microbatches=k, saved_per_step_s=saved)
        results.append(r)
        rows.append(
            [
                p,
                f"{b}x{s}",
                r["layers"],
                f"{r['eager_s'] * 1e6:.0f}",
                f"{r['compiled_s'] * 1e6:.0f}",
                f"{r['first_compiled_call_s']:.1f}",
                k,
                f"{saved * 1e3:.3f}",
                repay,
                f"{r['rel_diff']:.1e}",
            ]
        )
    headers = [
        "preset",
        "b×S",
        "MoE layers",
        "eager µs/call",
        "compiled µs/call",
        "first compiled call s",
        "K",
        "saved ms/step",
        "steps to repay",
        "compiled vs eager",
    ]
    return markdown_table(headers, rows), results


if __name__ == "__main__":
    print("RESULT " + json.dumps(run_one(json.loads(sys.argv[1]))), flush=True)
