"""The extras users install (``pip install "lossparity[hf]"``...) exist, pull the framework they are named for,
and the module documented for each imports it. ``./dev.sh wheel`` checks the built wheel's metadata lists
them and runs the commands from a fresh environment; here each extra's documented import runs."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# extra -> (the distribution it must pull, the lossparity module documented for it, the framework module)
EXTRAS = {
    "hf": ("transformers", "lossparity.integrations.hf", "transformers"),
    "trl": ("trl", "lossparity.integrations.hf", "trl"),
    "megatron": ("megatron-core", "lossparity.integrations.megatron", "megatron.core"),
    "torchtitan": ("torchtitan", "lossparity.integrations.torchtitan", "torchtitan"),
    "deepspeed": ("deepspeed", "lossparity.integrations.deepspeed", "deepspeed"),
    "jax": ("jax", "lossparity.jax", "jax"),
    "maxtext": ("jax", "lossparity.jax", "jax"),
    "report": ("matplotlib", "lossparity.parity.report", "matplotlib.figure"),
}


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_extra_pulls_its_framework_and_its_module_imports(extra):
    distribution, module, framework = EXTRAS[extra]
    assert distribution in {_name(r) for r in _extras()[extra]}
    importlib.import_module(module)
    importlib.import_module(framework)  # installed by ./dev.sh test: the extras' frameworks are test oracles


def test_every_extra_the_docs_name_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for p in pages for m in re.findall(r"lossparity\[([a-z-]+)\]", p.read_text())}
    assert named, "no extra is named in the docs"
    assert named <= set(_extras()), f"extras named in the docs but not in pyproject.toml: {named - set(_extras())}"
    assert set(EXTRAS) <= set(_extras())
