"""Test-only import stand-in for ``hyper_parallel`` (MindFormers 2.x imports it; no registry here serves it).

Enough for ``import mindformers`` and for a single-process or data-parallel pynative run in which nothing is
sharded: ``DTensor`` is a real class (MindFormers only asks ``isinstance(x, DTensor)``, which is then always
false), ``SkipDTensorDispatch`` is a no-op context manager, and every other name of any ``hyper_parallel.*``
module is a placeholder class without methods, so a code path that really shards something fails with an
AttributeError instead of silently doing nothing. Never imported by lossparity itself.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+lossparity-test-stub"


class DTensor:
    """Never instantiated: with nothing sharded no tensor is a DTensor."""


class DeviceMesh:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("hyper_parallel stub: DeviceMesh is not available (nothing may be sharded)")


@contextlib.contextmanager
def _skip() -> Any:
    yield


def SkipDTensorDispatch() -> Any:  # noqa: N802 (the library's name)
    return _skip()


def _placeholder(qualname: str) -> Any:
    # instantiable (MindFormers builds its sharding plans from Replicate()/Shard(0) at import time) but with
    # no behaviour: any method of it is missing, so a path that shards something fails with AttributeError
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        self.args, self.kwargs = args, kwargs

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": qualname.rsplit(".", 1)[0]})


class _AutoModule(types.ModuleType):
    """A ``hyper_parallel.*`` submodule whose unknown attributes are placeholders."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        known = {"DTensor": DTensor, "DeviceMesh": DeviceMesh, "SkipDTensorDispatch": SkipDTensorDispatch}
        if name in known:
            return known[name]
        if name == "get_platform":
            return lambda *a, **k: _AutoModule("hyper_parallel.platform.instance")
        if name == "enable_mindspore_backward_compat":
            return lambda *a, **k: None
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("hyper_parallel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        module = _AutoModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        return None


sys.meta_path.append(_Finder())
_me = sys.modules[__name__]
_me.__class__ = _AutoModule  # the package itself also answers unknown names with placeholders
