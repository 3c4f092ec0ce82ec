"""The API reference (``mkdocs build --strict``: ``./dev.sh docs``) lists every public name with its docstring.

The reference pages are generated from ``scripts/mkdocs_hooks.py``'s list of public modules; this test fails
when a public name, or a public method of a public class, has no docstring of its own, or when a public
integration module is missing from the list.
"""

from __future__ import annotations

import inspect
import pathlib

from _scripts import load_script

import lossparity

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _hooks():
    return load_script("mkdocs_hooks")


def _own_doc(obj) -> str:
    """The docstring written on ``obj`` itself (a class without one would inherit ``object``'s)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return (doc or "").strip()


def test_every_public_module_is_in_the_reference():
    modules = {m for _, m, _ in _hooks().REFERENCE}
    integrations = {
        f"lossparity.integrations.{p.stem}"
        for p in (ROOT / "src/lossparity/integrations").glob("*.py")
        if not p.stem.startswith("_")
    }
    assert integrations | {"lossparity", "lossparity.moe", "lossparity.mtp", "lossparity.jax"} <= modules


def test_every_public_name_has_a_docstring():
    names = _hooks().public_names()
    assert {n for m, n, _ in names if m == "lossparity"} == set(lossparity.__all__)
    missing = []
    for module, name, obj in names:
        if not (inspect.isclass(obj) or callable(obj)):
            continue  # constants (MODES, IGNORE_INDEX) are shown with their value
        if not _own_doc(obj):
            missing.append(f"{module}.{name}")
        if inspect.isclass(obj) and obj.__module__.startswith("lossparity"):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if (inspect.isfunction(member) or isinstance(member, property)) and not _own_doc(member):
                    missing.append(f"{module}.{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"
