"""DeepSpeed #7718 check with ``lossparity.integrations.deepspeed.step_gradients``: on the installed DeepSpeed,
2 gloo ranks, ZeRO 0/1/2/3 at GA 2, a plain loop (each microbatch's token mean, ``engine.backward(loss)``).
A correct engine applies the mean of the 4 microbatch means; deepspeed 0.17.6-0.18.2 at ZeRO-2 applies the last
microbatch's alone (#7718, fixed in 0.18.3). Prints, per stage, the relative gradient difference to both.

With ``--audit``: ``lossparity audit``'s class ``zero`` on the tiny Llama of tests/audit/_stacks.py instead (a
DeepSpeed loop handing each microbatch's token mean to ``engine.backward``): on 0.18.2 the ZeRO-2 row is named
"only the last micro-step of each rank"; on 0.19.8 every stage computes per_microbatch.

Usage: .venv/bin/python scripts/deepspeed_7718.py [--audit]
       PYTHONPATH=.cache/ds0182 TORCH_EXTENSIONS_DIR=.cache/torch_extensions_0182 .venv/bin/python
       scripts/deepspeed_7718.py [--audit]   (a `pip install --no-deps --target .cache/ds0182 deepspeed==0.18.2`
       shadowing the installed release; its compiled ops in their own folder)
"""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integrations"), str(ROOT / "src")]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))


def _last_only(world: int, ga: int):
    """(1/(D·K)) Σ_ranks ∇(token mean of the rank's last microbatch), float64: what a step weighing only the last
    microbatch applies."""
    from _deepspeed_workers import TinyLM, microbatches

    model = TinyLM().double()
    total = 0.0
    for r in range(world):
        mb = microbatches(r, world, ga)[-1]
        loss = model(mb["tokens"], mb["labels"])
        total = total + (loss * mb["mask"]).sum() / mb["mask"].sum().clamp(min=1)
    (total / (world * ga)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def main() -> None:
    import deepspeed
    from _deepspeed_workers import N, plain_case, reference_grads, rel

    from lossparity.distributed.launch import spawn

    world, ga = 2, 2
    window, _ = reference_grads("per_microbatch", N // (world * ga))
    last = _last_only(world, ga)
    print(f"deepspeed {deepspeed.__version__}: plain loop, 2 ranks, GA {ga}, token mean per microbatch")
    for stage in (0, 1, 2, 3):
        got = spawn(plain_case, world, stage, ga, timeout_s=300.0)[0]["grads"]
        a, b = rel(got, window), rel(got, last)
        verdict = "OK (the whole window)" if a <= 1e-6 else ("last microbatch only" if b <= 1e-6 else "neither")
        print(f"ZeRO-{stage}: vs mean of the 4 microbatch means {a:.1e}, vs last microbatch only {b:.1e}: {verdict}")


def audit_zero() -> None:
    import deepspeed

    from lossparity.audit import DeepSpeedStep, audit, render

    stacks = str(ROOT / "tests" / "audit" / "_stacks.py")
    print(f"deepspeed {deepspeed.__version__}: lossparity audit --classes zero (2 ranks x GA 2 x 2 rows)")
    report = audit(DeepSpeedStep(model=f"{stacks}:tiny_llama", loss=f"{stacks}:deepspeed_hf_loss"), classes=["zero"])
    print(render(report))


if __name__ == "__main__":
    audit_zero() if "--audit" in sys.argv[1:] else main()
