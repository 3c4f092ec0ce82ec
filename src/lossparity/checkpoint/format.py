"""What a checkpoint file holds, in types that ``torch.load(weights_only=True)`` reads, and its validation.

Loading a checkpoint never runs code: every file is read with ``weights_only=True`` (tensors, numbers,
strings, ``None``, lists, tuples and dicts only; PyTorch's restricted unpickler refuses anything else) and
its contents are checked against the model before any of it is used (:func:`validate_single_state`,
:func:`validate_extra_state`): a file that is well formed but wrong (missing key, wrong type, a tensor of
another shape) raises :class:`CheckpointFormatError` naming the file and the entry.

Format 2 (``"format": "lossparity-checkpoint", "version": 2``):

- single process, ``step_<n>.pt``: ``step`` (int), ``model`` (the module's state dict), ``optimizer``
  (AdamW's state dict), ``moe`` (``lagged_counts`` ``[L, E]`` float64, ``lagged_tokens`` float), ``rng``
  (:func:`rng_state`), ``config`` (the run's ``TrainConfig`` as a JSON string), ``mtp_weight`` (float);
- multi-rank, ``step_<n>/extra_rank<r>.pt`` next to the ``torch.distributed.checkpoint`` shards: ``step``,
  ``rng``, ``config``, ``mtp_weight``, ``world`` (the number of ranks that wrote it).

The RNG states are tensors and plain values: Python's Mersenne Twister state as an int64 tensor of 625
words, NumPy's as an int64 tensor of 624 keys plus ints/floats, torch's CPU (and CUDA) states as the
uint8 tensors torch returns. Checkpoints of format 1 (pickled objects: NumPy arrays, a config dict) are
refused by the weights-only load with a note naming ``lossparity convert-checkpoint``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

from ..input_files import open_regular
from .folder import load_failure

__all__ = [
    "FORMAT",
    "VERSION",
    "CONVERT_HINT",
    "CheckpointFormatError",
    "load_weights_only",
    "rng_state",
    "encode_rng_state",
    "set_rng_state",
    "validate_rng_state",
    "validate_single_state",
    "validate_extra_state",
]

FORMAT = "lossparity-checkpoint"
VERSION = 2
CONVERT_HINT = (
    "if you trust the file (a run of your own), convert it once: "
    "lossparity convert-checkpoint --i-trust-these-files {path}"
)
_PY_WORDS = 625  # random.getstate()[1]: 624 state words + the position
_NP_KEYS = 624


class CheckpointFormatError(ValueError):
    """A checkpoint file that cannot be used: it holds pickled objects beyond tensors and plain values
    (format 1, or a crafted file), or its contents do not match the model (names the file and the entry)."""


@contextlib.contextmanager
def _no_extra_safe_globals() -> Iterator[None]:
    """torch's own weights-only allowlist only, for the duration of a load: libraries extend it process-wide
    (importing ``megatron.core`` admits NumPy arrays, for one), which would let a format-1 file through
    here in one process and not in another. A lossparity checkpoint never needs more."""
    extra = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        if extra:
            torch.serialization.add_safe_globals(extra)


def load_weights_only(path: str) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``; a file that needs more than tensors and
    plain values (an unpickled object would run code) raises :class:`CheckpointFormatError` with the way
    to convert a trusted file of format 1; a file that is no checkpoint at all (damaged bytes) raises
    :class:`CheckpointFormatError` saying what torch found, without torch's advice to disable
    ``weights_only``."""
    try:
        # a regular file only: a FIFO named step_<n>.pt would block the load, a device never end it
        with open_regular(path, "a checkpoint file (a regular file)") as f, _no_extra_safe_globals():
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message names a refused global (e.g. "Unsupported global: GLOBAL posix.system"): pickled
        # objects; without one, the bytes are no pickle torch can read (a damaged file)
        what = next((ln.strip() for ln in str(e).splitlines() if "global" in ln.lower()), None)
        if what is not None:
            what = what.split("WeightsUnpickler error:")[-1].strip()
        if what is None:
            raise CheckpointFormatError(f"{path}: damaged, not a checkpoint ({load_failure(e)}); not loaded") from None
        raise CheckpointFormatError(
            f"{path}: holds pickled Python objects, not only tensors and plain values ({what}); not loaded "
            f"(a checkpoint of an earlier lossparity, or a crafted file): {CONVERT_HINT.format(path=path)}"
        ) from None
    except (RuntimeError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        if isinstance(e, CheckpointFormatError):
            raise
        # zip framing, storage sizes, record names: torch's words, one line, never its weights_only advice
        raise CheckpointFormatError(f"{path}: damaged, not a checkpoint ({load_failure(e)}); not loaded") from None


# ---------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """Every RNG state a training step may touch (Python, NumPy, torch CPU and CUDA), as tensors and plain
    values (``python``: ``version``, ``state`` int64 ``[625]``, ``gauss_next``; ``numpy``: ``kind``,
    ``keys`` int64 ``[624]``, ``pos``, ``has_gauss``, ``cached_gaussian``; ``torch``: uint8; ``cuda``: list
    of uint8)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    numpy_state = cast(tuple, np.random.get_state(legacy=True))  # the legacy form is a tuple
    return encode_rng_state(random.getstate(), numpy_state, torch.get_rng_state(), cuda)


def encode_rng_state(
    python: tuple, numpy: tuple, torch_state: torch.Tensor, cuda: list | None = None
) -> dict[str, Any]:
    """The :func:`rng_state` form of ``random.getstate()``, ``np.random.get_state()`` (legacy tuple), the
    torch CPU state and the CUDA states (used by the conversion of format-1 checkpoints too)."""
    version, words, gauss = python
    kind, keys, pos, has_gauss, cached = numpy
    state: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(list(words), dtype=torch.int64), "gauss_next": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch_state,
    }
    if cuda is not None:
        state["cuda"] = list(cuda)
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`rng_state` (validated first: :func:`validate_rng_state`)."""
    validate_rng_state(state, "rng")
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------- checks
def _fail(where: str, what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where}: {what}")


def _need(d: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(d, dict):
        raise _fail(where, f"expected a dict, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        raise _fail(where, f"missing key(s) {', '.join(map(repr, missing))}")


def _int(v: Any, where: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _fail(where, f"expected an int >= {lo}, got {v!r}")
    return v


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(where, f"expected a number, got {type(v).__name__}")
    return float(v)


def _tensor(v: Any, where: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> None:
    if not isinstance(v, torch.Tensor):
        raise _fail(where, f"expected a tensor, got {type(v).__name__}")
    if shape is not None and tuple(v.shape) != shape:
        raise _fail(where, f"expected shape {list(shape)}, got {list(v.shape)}")
    if dtype is not None and v.dtype != dtype:
        raise _fail(where, f"expected dtype {dtype}, got {v.dtype}")


def validate_rng_state(state: Any, where: str) -> None:
    """Raise :class:`CheckpointFormatError` unless ``state`` has the layout of :func:`rng_state`."""
    _need(state, ("python", "numpy", "torch"), where)
    py, npy = state["python"], state["numpy"]
    _need(py, ("version", "state", "gauss_next"), f"{where}.python")
    _int(py["version"], f"{where}.python.version")
    _tensor(py["state"], f"{where}.python.state", (_PY_WORDS,), torch.int64)
    if py["gauss_next"] is not None:
        _number(py["gauss_next"], f"{where}.python.gauss_next")
    _need(npy, ("kind", "keys", "pos", "has_gauss", "cached_gaussian"), f"{where}.numpy")
    if npy["kind"] != "MT19937":
        raise _fail(f"{where}.numpy.kind", f"expected 'MT19937', got {npy['kind']!r}")
    _tensor(npy["keys"], f"{where}.numpy.keys", (_NP_KEYS,), torch.int64)
    if _int(npy["pos"], f"{where}.numpy.pos") > _NP_KEYS:
        raise _fail(f"{where}.numpy.pos", f"expected <= {_NP_KEYS}, got {npy['pos']}")
    _int(npy["has_gauss"], f"{where}.numpy.has_gauss")
    _number(npy["cached_gaussian"], f"{where}.numpy.cached_gaussian")
    _tensor(state["torch"], f"{where}.torch", dtype=torch.uint8)
    if "cuda" in state:
        if not isinstance(state["cuda"], list):
            raise _fail(f"{where}.cuda", f"expected a list, got {type(state['cuda']).__name__}")
        for i, t in enumerate(state["cuda"]):
            _tensor(t, f"{where}.cuda[{i}]", dtype=torch.uint8)
            if t.dim() != 1:
                raise _fail(f"{where}.cuda[{i}]", f"expected a 1-D tensor, got shape {list(t.shape)}")
    _check_rng_values(state, where)


def _check_rng_values(state: Mapping[str, Any], where: str) -> None:
    """Each state is applied to a scratch generator (never the process's own): a value Python, NumPy or
    torch refuses (a Mersenne word beyond 32 bits, a position past 624, a torch state of the wrong size)
    fails here, while the checkpoint is still being chosen, instead of in :func:`set_rng_state` after."""
    py, npy = state["python"], state["numpy"]
    words = py["state"]
    if bool((words[:-1] < 0).any()) or bool((words[:-1] >= 2**32).any()) or not 0 <= int(words[-1]) <= _PY_WORDS - 1:
        raise _fail(f"{where}.python.state", "expected 624 32-bit unsigned words and a position in [0, 624]")
    try:
        random.Random().setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"]))
    except (ValueError, TypeError, OverflowError) as e:
        raise _fail(f"{where}.python", f"not a state of Python's random ({e})") from None
    keys = npy["keys"]
    if bool((keys < 0).any()) or bool((keys >= 2**32).any()):
        raise _fail(f"{where}.numpy.keys", "expected 32-bit unsigned words")
    try:
        np.random.RandomState().set_state(
            (npy["kind"], keys.numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
        )
    except (ValueError, TypeError, OverflowError) as e:
        raise _fail(f"{where}.numpy", f"not a state of NumPy's RandomState ({e})") from None
    try:
        torch.Generator().set_state(state["torch"])
    except (RuntimeError, TypeError, ValueError) as e:
        raise _fail(f"{where}.torch", f"not a state of torch's CPU generator ({' '.join(str(e).split())})") from None


def _header(state: Any, keys: tuple[str, ...], path: str, name: str) -> None:
    """The entries both files share; ``name``: the checkpoint's ``step_<n>[.pt]`` (its step must be ``n``)."""
    if isinstance(state, Mapping) and "format" not in state and "version" not in state:
        raise _fail(
            path,
            f"no 'format'/'version' entries: a checkpoint of an earlier lossparity; {CONVERT_HINT.format(path=path)}",
        )
    _need(state, ("format", "version", *keys), path)
    if state["format"] != FORMAT or state["version"] != VERSION:
        raise _fail(path, f"format {state['format']!r} version {state['version']!r}, expected {FORMAT!r} {VERSION}")
    step = _int(state["step"], f"{path}: step")
    named = re.fullmatch(r"step_(\d+)(\.pt)?", name)
    if named and int(named.group(1)) != step:  # a file copied under another step's name
        raise _fail(f"{path}: step", f"{step}, but the checkpoint is named for step {int(named.group(1))}")
    validate_rng_state(state["rng"], f"{path}: rng")
    _number(state["mtp_weight"], f"{path}: mtp_weight")
    config = state["config"]
    try:
        ok = isinstance(config, str) and isinstance(json.loads(config), dict)
    except ValueError:
        ok = False
    if not ok:
        raise _fail(f"{path}: config", "expected the run configuration as a JSON object string")


def _validate_model(sd: Any, template: Mapping[str, torch.Tensor], where: str) -> None:
    _need(sd, (), where)
    missing, extra = sorted(set(template) - set(sd)), sorted(set(sd) - set(template))
    if missing or extra:
        raise _fail(where, f"parameter names differ from the model's (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, ref in template.items():
        _tensor(sd[name], f"{where}[{name!r}]", tuple(ref.shape), ref.dtype)


def _validate_optimizer(sd: Any, optimizer: torch.optim.Optimizer, where: str) -> None:
    _need(sd, ("state", "param_groups"), where)
    groups, state = sd["param_groups"], sd["state"]
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise _fail(f"{where}.param_groups", f"expected a list of {len(optimizer.param_groups)} groups")
    params: dict[int, torch.Tensor] = {}
    template = optimizer.state_dict()["param_groups"]
    for g, (saved, ref, live) in enumerate(zip(groups, template, optimizer.param_groups)):
        _need(saved, tuple(ref), f"{where}.param_groups[{g}]")
        if saved["params"] != ref["params"]:
            raise _fail(f"{where}.param_groups[{g}].params", "the parameter indices differ from the optimizer's")
        params.update(zip(ref["params"], live["params"]))
    _need(state, (), f"{where}.state")
    for idx, entry in state.items():
        if idx not in params:
            raise _fail(f"{where}.state", f"entry {idx!r} names no parameter of the optimizer")
        _need(entry, (), f"{where}.state[{idx}]")
        shape = tuple(params[idx].shape)
        for key, v in entry.items():  # AdamW: a scalar ``step`` and moments of the parameter's shape
            _tensor(v, f"{where}.state[{idx}][{key!r}]")
            if v.dim() != 0 and tuple(v.shape) != shape:
                raise _fail(f"{where}.state[{idx}][{key!r}]", f"expected shape {list(shape)}, got {list(v.shape)}")


def validate_single_state(
    state: Any,
    path: str,
    model: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    moe_shape: tuple[int, int],
) -> None:
    """Raise :class:`CheckpointFormatError` (naming ``path`` and the entry) unless ``state`` is a format-2
    single-process checkpoint of this model (names, shapes and dtypes of ``model``, the parameter groups
    and moment shapes of ``optimizer``, MoE counts of shape ``moe_shape``; a file named ``step_<n>.pt``
    holds step ``n``)."""
    _header(state, ("step", "model", "optimizer", "moe", "rng", "config", "mtp_weight"), path, os.path.basename(path))
    _validate_model(state["model"], model, f"{path}: model")
    _validate_optimizer(state["optimizer"], optimizer, f"{path}: optimizer")
    moe = state["moe"]
    _need(moe, ("lagged_counts", "lagged_tokens"), f"{path}: moe")
    _tensor(moe["lagged_counts"], f"{path}: moe.lagged_counts", moe_shape, torch.float64)
    if not _number(moe["lagged_tokens"], f"{path}: moe.lagged_tokens") > 0:
        raise _fail(f"{path}: moe.lagged_tokens", f"expected > 0, got {moe['lagged_tokens']}")


def validate_extra_state(state: Any, path: str) -> None:
    """Raise :class:`CheckpointFormatError` unless ``state`` is a format-2 ``extra_rank<r>.pt`` (of the step
    its folder ``step_<n>/`` is named for)."""
    _header(state, ("step", "rng", "config", "mtp_weight", "world"), path, os.path.basename(os.path.dirname(path)))
    _int(state["world"], f"{path}: world", lo=1)
