"""The ``torchrun`` entry point of the audit's multi-rank configurations.

``python -m torch.distributed.run --nproc_per_node=D -m lossparity.audit.worker SPEC.json OUT_DIR``: every
rank rebuilds the crafted batch, runs each configuration of the spec on the user's stack and writes
``OUT_DIR/rank<r>.pt`` (tensors, numbers and strings only: the parent reads it with ``weights_only=True``).
A failure is written as ``{"error": ..., "where": ...}`` with the place in the user's code that raised.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from .batch import Config, craft_batch
from .stack import HandLoop, TrainerFactory, run_config

__all__ = ["stack_from_spec", "user_frame", "main"]

_OWN = ("/lossparity/", "/site-packages/", "/dist-packages/", "/torch/", "/lib/python3")


def user_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback that is the user's code (not lossparity,
    an installed package or the standard library); the innermost frame when none is."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        path = fr.filename.replace(os.sep, "/")
        if not any(part in path for part in _OWN):
            return f"{fr.filename}:{fr.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def stack_from_spec(spec: dict[str, Any]) -> Any:
    """The adapter a JSON spec describes (every callable as a ``MODULE:NAME`` string)."""
    if spec["kind"] == "hand loop":
        return HandLoop(model=spec["model"], step=spec["step"], wrap_ddp=spec["wrap_ddp"], logits=spec.get("logits"))
    if spec["kind"] == "deepspeed":
        from .deepspeed import DeepSpeedStep

        return DeepSpeedStep(
            model=spec["model"],
            loss=spec["loss"],
            zero_stage=spec["zero_stage"],
            offload=spec["offload"],
            config=spec["config"],
        )
    if spec["kind"] == "torchtitan":
        from .torchtitan import TitanStep

        return TitanStep(
            model=spec["model"], loss=spec["loss"], trainer=spec["trainer"], parallelize=spec["parallelize"]
        )
    if spec["kind"] == "megatron-core":
        from .megatron import MegatronStep

        return MegatronStep(model=spec["model"], forward_step=spec["forward_step"], vocab_size=spec["vocab"])
    return TrainerFactory(factory=spec["factory"], logits=spec.get("logits"))


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    stack = stack_from_spec(spec)
    # the Trainer's accelerate initializes its own group; every other stack gets the default group here (also
    # for one process: torchrun's agent store is where a group of this launch can rendezvous)
    if not isinstance(stack, TrainerFactory):
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout_s", 120)))
    batches = {p: craft_batch(spec["vocab"], packed=p) for p in (False, True)}
    results: dict[str, Any] = {}
    for c in spec["configs"]:
        cfg = Config(**c)
        try:
            r = run_config(stack, cfg, batches[cfg.packed], rank, world)
            results[cfg.name] = {
                "grads": r.grads,
                "logged": r.logged,
                "assignment": {str(k): list(v) for k, v in r.assignment.items()},
                "initial": r.initial,
                "note": r.note,
            }
        except Exception as e:  # reported per configuration by the parent, with the user's frame
            results[cfg.name] = {"error": f"{type(e).__name__}: {e}", "where": user_frame(e)}
            break
    torch.save(results, out / f"rank{rank}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
