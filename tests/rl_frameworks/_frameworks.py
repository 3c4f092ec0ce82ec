"""Loads the frameworks' loss functions from the side packages without their heavy package imports: the
``verl``/``openrlhf`` package ``__init__`` files (ray, DeepSpeed, vLLM) are replaced by empty packages whose
``__path__`` is the real folder, so that only the loss modules and what they import are executed; OpenRLHF's
``models/utils.py`` imports DeepSpeed at the top without using it for the losses: an empty module stands in."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
import types

# the same folder as conftest.py's (not imported from it: several conftest modules share that name)
SITE = pathlib.Path(os.environ.get("LOSSPARITY_RL_SITE", pathlib.Path(__file__).resolve().parents[2] / ".venv-rl"))


def _package(name: str, root) -> None:
    m = types.ModuleType(name)
    m.__path__ = [str(root.joinpath(*name.split(".")))]
    sys.modules[name] = m


def load():
    """(verl 0.9.1 core_algos, verl 0.7.1 core_algos, OpenRLHF 0.11.2 models.loss, OpenRLHF utils.loss_utils)."""
    site = SITE / "site"
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        _package(name, site)
    core = importlib.import_module("verl.trainer.ppo.core_algos")
    spec = importlib.util.spec_from_file_location(
        "verl071_core_algos", SITE / "verl071" / "verl" / "trainer" / "ppo" / "core_algos.py"
    )
    legacy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(legacy)  # its imports resolve to verl 0.9.1's utilities; agg_loss needs masked_sum only
    for name in ("openrlhf", "openrlhf.models", "openrlhf.utils"):
        _package(name, site)
    sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
    return (
        core,
        legacy,
        importlib.import_module("openrlhf.models.loss"),
        importlib.import_module("openrlhf.utils.loss_utils"),
    )
