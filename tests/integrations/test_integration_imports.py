"""Each integration imports its framework lazily and names the extra to install when it is missing."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_importing_the_package_imports_no_framework(monkeypatch):
    for name in ("transformers", "trl", "megatron", "torchtitan", "deepspeed"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of them would now fail
    for mod in (
        "lossparity.integrations",
        "lossparity.integrations.hf",
        "lossparity.integrations.megatron",
        "lossparity.integrations.torchtitan",
        "lossparity.integrations.deepspeed",
    ):
        monkeypatch.delitem(sys.modules, mod, raising=False)
        importlib.import_module(mod)


@pytest.mark.parametrize(
    "module,attr,extra,args",
    [
        ("lossparity.integrations.hf", "LossParityTrainer", "hf", None),
        ("lossparity.integrations.megatron", "LossFunc", "megatron", ("per_sample",)),
        ("lossparity.integrations.torchtitan", "LossParityLoss", "torchtitan", ("per_sample",)),
        ("lossparity.integrations.deepspeed", "full_gradients", "deepspeed", (object(),)),
    ],
)
def test_missing_framework_gives_one_line_naming_the_extra(monkeypatch, module, attr, extra, args):
    for name in ("transformers", "megatron.core", "torchtitan", "deepspeed", "deepspeed.utils"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, module, raising=False)  # a fresh module: nothing cached from other tests
    mod = importlib.import_module(module)
    with pytest.raises(ImportError) as err:
        obj = getattr(mod, attr)
        if args is not None:
            obj(*args)
    msg = str(err.value)
    assert f'pip install "lossparity[{extra}]"' in msg and "\n" not in msg
