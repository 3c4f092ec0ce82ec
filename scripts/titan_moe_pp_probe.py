"""Why torchtitan pipeline parallelism needed ``TitanMoETerms.paused()``: the router forwards of each PP stage
by caller, over two ``train_step`` calls (PP 2 on 2 gloo ranks, 1F1B, GA 2 × 2 pipeline microbatches,
``global_lagged``; tests/integrations/_titan_moe_workers.py), with the mixin as it is and with its pause of the
stages' metadata inference switched off (then ``end_step`` refuses step 1's token count).

    nice .venv/bin/python scripts/titan_moe_pp_probe.py
"""

from __future__ import annotations

import collections
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations"))

from lossparity.distributed.launch import spawn  # noqa: E402


def _probe(rank: int, world: int, pause: bool) -> dict:
    import torch
    from _titan_moe_workers import titan_moe_pp_steps
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    from lossparity.integrations import torchtitan

    calls: collections.Counter = collections.Counter()
    forward = TokenChoiceTopKRouter.forward

    def counted(self, *args, **kwargs):
        callers = {f.name for f in traceback.extract_stack()}
        inside = "backward (AC re-run)" if torch._C._current_graph_task_id() != -1 else "forward"
        caller = "_forward_metadata_inference" if "_forward_metadata_inference" in callers else "step"
        calls[f"{caller}, {inside}"] += 1
        return forward(self, *args, **kwargs)

    TokenChoiceTopKRouter.forward = counted
    if not pause:
        torchtitan._pause_metadata_inference = lambda schedule, terms: None
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    try:
        titan_moe_pp_steps("global_lagged", "none", mesh)
        error = ""
    except RuntimeError as e:
        error = str(e)
    return {"calls": dict(calls), "error": error}


def main() -> None:
    for pause in (True, False):
        print(f"metadata inference paused: {pause}")
        for rank, out in enumerate(spawn(_probe, 2, pause, timeout_s=600)):
            print(f"  stage {rank}: router calls {out['calls']}")
            if out["error"]:
                print(f"  stage {rank}: {out['error']}")


if __name__ == "__main__":
    main()
