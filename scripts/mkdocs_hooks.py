"""mkdocs hooks of the API reference site (``mkdocs.yml``): pages generated at build time.

- ``index.md``: the README, its ``docs/`` links pointed at the site's pages;
- ``changelog.md``: ``CHANGELOG.md``;
- ``reference/*.md``: one page per public module of :data:`REFERENCE`, one mkdocstrings entry per name of
  the module's ``__all__``, at the place the name is defined (``lossparity.Accountant`` is rendered from
  ``lossparity.distributed.accountant.Accountant``: the package root exports its names lazily, which a static
  reader cannot follow). A name built at run time (``LossParityTrainer``) is rendered from its docstring.

``public_names()`` is also what ``tests/test_api_reference.py`` checks for docstrings.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (page, module, title): every public module a user imports, in the order of the reference's menu
REFERENCE: tuple[tuple[str, str, str], ...] = (
    ("lossparity", "lossparity", "lossparity"),
    ("moe", "lossparity.moe", "lossparity.moe"),
    ("mtp", "lossparity.mtp", "lossparity.mtp"),
    ("integrations-hf", "lossparity.integrations.hf", "lossparity.integrations.hf"),
    ("integrations-hf-parity", "lossparity.integrations.hf_parity", "lossparity.integrations.hf_parity"),
    ("integrations-hf-head", "lossparity.integrations.hf_head", "lossparity.integrations.hf_head"),
    ("integrations-hf-moe", "lossparity.integrations.hf_moe", "lossparity.integrations.hf_moe"),
    ("integrations-hf-aux-terms", "lossparity.integrations.hf_aux_terms", "lossparity.integrations.hf_aux_terms"),
    ("integrations-hf-mtp", "lossparity.integrations.hf_mtp", "lossparity.integrations.hf_mtp"),
    ("integrations-hf-mtp-terms", "lossparity.integrations.hf_mtp_terms", "lossparity.integrations.hf_mtp_terms"),
    ("integrations-deepspeed", "lossparity.integrations.deepspeed", "lossparity.integrations.deepspeed"),
    ("integrations-megatron", "lossparity.integrations.megatron", "lossparity.integrations.megatron"),
    ("integrations-megatron-moe", "lossparity.integrations.megatron_moe", "lossparity.integrations.megatron_moe"),
    (
        "integrations-megatron-parity",
        "lossparity.integrations.megatron_parity",
        "lossparity.integrations.megatron_parity",
    ),
    (
        "integrations-megatron-pipeline",
        "lossparity.integrations.megatron_pipeline",
        "lossparity.integrations.megatron_pipeline",
    ),
    ("integrations-torchtitan", "lossparity.integrations.torchtitan", "lossparity.integrations.torchtitan"),
    ("integrations-titan-parity", "lossparity.integrations.titan_parity", "lossparity.integrations.titan_parity"),
    ("integrations-titan-moe", "lossparity.integrations.titan_moe", "lossparity.integrations.titan_moe"),
    ("jax", "lossparity.jax", "lossparity.jax"),
    ("audit", "lossparity.audit", "lossparity.audit"),
)


def public_names() -> list[tuple[str, str, Any]]:
    """``(module, name, object)`` of every public name of the :data:`REFERENCE` modules (their ``__all__``,
    each name once)."""
    found = []
    for _, module_name, _ in REFERENCE:
        module = importlib.import_module(module_name)
        for name in dict.fromkeys(module.__all__):
            found.append((module_name, name, getattr(module, name)))
    return found


def _defined_at(module_name: str, name: str, obj: Any) -> str:
    """The dotted path where ``obj`` is defined (a function or class), else where the module binds it."""
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith("lossparity"):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"{module_name}.{name}"


def _static_paths() -> Any:
    import griffe

    return griffe.load("lossparity", search_paths=[str(ROOT / "src")], resolve_aliases=False)


def _exists(package: Any, path: str) -> bool:
    try:
        package[path.removeprefix("lossparity.")]
    except (KeyError, ValueError, AttributeError):
        return False
    return True


def reference_page(module_name: str, title: str, package: Any) -> str:
    """The markdown of one reference page: the module's docstring, then every public name."""
    module = importlib.import_module(module_name)
    lines = [
        f"# `{title}`",
        "",
        f"::: {module_name}",
        "    options:",
        "      members: false",
        "      show_root_heading: false",
        "",
    ]
    for mod, name, obj in public_names():
        if mod != module_name:
            continue
        path = _defined_at(module_name, name, obj)
        if _exists(package, path):
            lines += [f"::: {path}", "    options:", f'      heading: "{name}"', ""]
        else:  # built at run time: its docstring as written
            doc = inspect.getdoc(obj) or ""
            lines += [f"## `{name}`", "", f"`{module.__name__}.{name}`", "", doc, ""]
    return "\n".join(lines)


def _readme_as_home() -> str:
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", text)
    # links to files of the checkout that are not site pages become plain text
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#|[\w-]+\.md)([^)]+)\)", r"\1 (`\2`)", text).replace(
        "(CHANGELOG.md)", "(changelog.md)"
    )


def on_config(config: Any) -> Any:
    """Fill the menu's "API reference" entry with the generated pages."""
    for entry in config["nav"]:
        if isinstance(entry, dict) and "API reference" in entry:
            entry["API reference"] = [{title: f"reference/{page}.md"} for page, _, title in REFERENCE]
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages (index, changelog, reference) to the site's files."""
    from mkdocs.structure.files import File

    package = _static_paths()
    pages = {"index.md": _readme_as_home(), "changelog.md": (ROOT / "CHANGELOG.md").read_text()}
    for page, module_name, title in REFERENCE:
        pages[f"reference/{page}.md"] = reference_page(module_name, title, package)
    for path, content in pages.items():
        files.append(File.generated(config, path, content=content))
    return files
