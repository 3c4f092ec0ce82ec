"""Test-only CPU stand-ins: the ``mindspore.mint`` functions that MindFormers' code paths under test call and that
have no CPU kernel in MindSpore 2.10 ("The kernel X unregistered"), rebound to the older ``ops`` equivalents that
do, and MindFormers' indexer-tracker clearing (an in-place zero without a CPU kernel). :func:`enable` rebinds them
in this process (tests only; the library never imports this module)."""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import mint, ops

_SAVED: dict[str, Any] = {}


def _zeros_like(x: Any, *, dtype: Any = None) -> Any:
    return ops.zeros(tuple(x.shape), dtype or x.dtype)


def _ones_like(x: Any, *, dtype: Any = None) -> Any:
    return ops.ones(tuple(x.shape), dtype or x.dtype)


def _sum(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    out = ops.sum(x.astype(ms.float32) if x.dtype == ms.bool_ else x, dim, keepdim)
    return out.astype(dtype) if dtype is not None else out


def _scatter_add(x: Any, dim: int, index: Any, src: Any) -> Any:
    return ops.tensor_scatter_elements(x, index, src, axis=dim, reduction="add")


STAND_INS = {"zeros_like": _zeros_like, "ones_like": _ones_like, "sum": _sum, "scatter_add": _scatter_add}


def _clear_indexer_losses_tracker() -> None:
    # MindFormers' version zeroes each slot with Tensor.zero_ (InplaceZero: no CPU kernel); same effect
    from mindformers.pynative.transformers.experimental_attention_variant import utils  # noqa: PLC0415

    tracker = utils.get_indexer_loss_tracker()
    if "values" in tracker:
        tracker["values"] = ops.zeros(tuple(tracker["values"].shape), tracker["values"].dtype)


def enable() -> None:
    """Rebind the stand-ins on ``mindspore.mint`` and MindFormers' tracker clearing (idempotent)."""
    from mindformers.pynative.transformers.experimental_attention_variant import utils  # noqa: PLC0415

    for name, fn in STAND_INS.items():
        _SAVED.setdefault(name, getattr(mint, name))
        setattr(mint, name, fn)
    ms.Tensor.clone = lambda self: self.copy()  # process_mtp_loss: labels.clone() (Clone: no CPU kernel)
    utils.clear_indexer_losses_tracker = _clear_indexer_losses_tracker


# -- the whole pynative DeepSeek-V3 model (tests/mindformers/test_mindformers_model.py) --------------------------
# Forward values only: these stand-ins compute the same numbers as the Ascend kernels they replace, on the host
# where that is simplest (index-only ops: sort, histogram, arange); nothing here is used for a parameter gradient.


def _np(x: Any) -> np.ndarray:
    return x.asnumpy() if isinstance(x, ms.Tensor) else np.asarray(x)


def _arange(start: Any = 0, end: Any = None, step: Any = 1, *, dtype: Any = None) -> Any:
    if end is None:
        start, end = 0, start
    values = np.arange(float(start), float(end), float(step))
    if dtype is None:
        dtype = ms.int64 if all(isinstance(v, int) for v in (start, end, step)) else ms.float32
    return ms.Tensor(values).astype(dtype)


def _outer(a: Any, b: Any) -> Any:
    return a.reshape(-1, 1) * b.reshape(1, -1)


def _histc(x: Any, bins: int = 100, min: float = 0, max: float = 0) -> Any:  # noqa: A002 (mint's names)
    # torch.histc's rule: equal-width bins over [min, max], the right edge in the last bin, values outside dropped
    counts, _ = np.histogram(_np(x).astype(np.float64), bins=bins, range=(float(min), float(max)))
    return ms.Tensor(counts.astype(np.float32)).astype(x.dtype)


def _topk(x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:  # noqa: A002
    moved = dim not in (-1, x.ndim - 1)
    y = ops.swapaxes(x, dim, -1) if moved else x
    values, indices = ops.topk(y if largest else -y, k, sorted=True)
    values = values if largest else -values
    if moved:
        values, indices = ops.swapaxes(values, dim, -1), ops.swapaxes(indices, dim, -1)
    return values, indices.astype(ms.int64)


def _argsort(x: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Any:
    # stable on the host: the expert permutation depends on the order of tied expert ids
    a = _np(x)
    return ms.Tensor(np.argsort(-a if descending else a, axis=dim, kind="stable").astype(np.int64))


def _sort(x: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Any:
    order = _argsort(x, dim, descending)
    return ops.gather_elements(x, dim, order.astype(ms.int32)), order


def _cumsum(x: Any, dim: int, *, dtype: Any = None) -> Any:
    return ops.cumsum(x.astype(dtype) if dtype is not None else x, dim)


def _index_select(x: Any, dim: int, index: Any) -> Any:
    return ops.gather(x, index.astype(ms.int32), dim)


def _roll(x: Any, shifts: Any, dims: Any = None) -> Any:
    if dims is None:
        return _roll(x.reshape(-1), shifts, 0).reshape(x.shape)
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    for s, d in zip(shifts, dims, strict=True):
        n = x.shape[d]
        s %= n
        if s:
            x = ops.concat([ops.narrow(x, d, n - s, s), ops.narrow(x, d, 0, n - s)], d)
    return x


def _full(size: Any, fill_value: Any, *, dtype: Any = None) -> Any:
    if dtype is None:
        dtype = ms.bool_ if isinstance(fill_value, bool) else ms.int64 if isinstance(fill_value, int) else ms.float32
    return (ops.ones(tuple(size), ms.float32) * float(fill_value)).astype(dtype)


def _stack(tensors: Any, dim: int = 0) -> Any:
    return ops.stack(list(tensors), dim)


def _floor_divide(x: Any, y: Any) -> Any:
    return ops.floor_div(x, y)


def _mm(a: Any, b: Any) -> Any:
    return ops.matmul(a, b)


def _clone(x: Any, **_: Any) -> Any:
    return x.copy()


def _embedding(ids: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
    return ops.gather(weight, ids.astype(ms.int32), 0)


def _rms_norm(x: Any, gamma: Any, epsilon: float = 1e-6) -> Any:
    # MindSpore's RmsNorm: y = x / sqrt(mean(x², -1) + ε) · γ, and the reciprocal rms it saves
    rstd = ops.rsqrt(ops.mean(ops.square(x.astype(ms.float32)), -1, keep_dims=True) + epsilon)
    return (x * rstd).astype(x.dtype) * gamma, rstd


class _GroupedMatmul:
    """``GroupedMatmul(split_item=3, group_type=0)([x], [w], ..., group_list)``: rows of ``x`` cut at the
    cumulative counts ``group_list`` (one group per expert), group ``e`` multiplied by ``w[e]``."""

    def __init__(self, split_item: int = 3, group_type: int = 0) -> None:
        if (split_item, group_type) != (3, 0):
            raise NotImplementedError(f"GroupedMatmul stand-in: split_item={split_item}, group_type={group_type}")

    def __call__(self, x: Any, w: Any, *args: Any) -> Any:
        (tokens,), (weights,), group_list = x, w, args[-1]
        ends = [int(v) for v in _np(group_list).reshape(-1)]
        starts = [0, *ends[:-1]]
        parts = [ops.matmul(tokens[s:e], weights[i]) for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
        return [ops.concat(parts, 0)]


class _FlashAttentionScore:
    """Softmax attention for FlashAttentionScore's BNSD/BSH/SBH layouts (no dropout, no alibi): the mask
    argument (uint8, 1 = masked) when given, else causal (``pre_tokens`` ∞, ``next_tokens`` 0)."""

    def __init__(self, head_num: int, scale_value: float, input_layout: str, sparse_mode: int, **_: Any) -> None:
        if input_layout not in ("BNSD", "BSH", "SBH") or sparse_mode != 0:
            raise NotImplementedError(f"FlashAttentionScore stand-in: {input_layout}, sparse_mode {sparse_mode}")
        self.heads, self.scale, self.layout = head_num, scale_value, input_layout

    def _bnsd(self, t: Any) -> Any:
        if self.layout == "BNSD":
            return t
        if self.layout == "SBH":
            t = t.transpose(1, 0, 2)
        b, s, h = t.shape
        return t.reshape(b, s, self.heads, h // self.heads).transpose(0, 2, 1, 3)

    def __call__(self, query: Any, key: Any, value: Any, attn_mask: Any = None, **_: Any) -> Any:
        q, k, v = self._bnsd(query), self._bnsd(key), self._bnsd(value)
        sq, sk = q.shape[2], k.shape[2]
        scores = ops.matmul(q.astype(ms.float32), k.astype(ms.float32).swapaxes(-1, -2)) * self.scale
        if attn_mask is None:
            masked = ms.Tensor(np.triu(np.ones((sq, sk), np.bool_), 1))
        else:
            masked = attn_mask.astype(ms.bool_).reshape(attn_mask.shape[0] if attn_mask.ndim == 4 else 1, -1, sq, sk)
        scores = ops.masked_fill(scores, masked, ms.Tensor(-1e30, ms.float32))
        out = ops.matmul(ops.softmax(scores, -1), v.astype(ms.float32)).astype(query.dtype)  # [B, N, S, Dv]
        if self.layout != "BNSD":
            b, n, s, d = out.shape
            out = out.transpose(0, 2, 1, 3).reshape(b, s, n * d)
            if self.layout == "SBH":
                out = out.transpose(1, 0, 2)
        return None, None, None, out


def _scatter_value_(self: Any, dim: int, index: Any, value: Any) -> Any:
    # Tensor.scatter_(dim, index, scalar) (InplaceScatterValue): written back with assign_value, which CPU honours
    src = ops.ones(tuple(index.shape), self.dtype) * ms.Tensor(value, self.dtype)
    self.assign_value(ops.tensor_scatter_elements(self, index.astype(ms.int32), src, axis=dim))
    return self


MODEL_STAND_INS = {
    "arange": _arange,
    "outer": _outer,
    "histc": _histc,
    "topk": _topk,
    "argsort": _argsort,
    "sort": _sort,
    "cumsum": _cumsum,
    "index_select": _index_select,
    "roll": _roll,
    "full": _full,
    "stack": _stack,
    "floor_divide": _floor_divide,
    "mm": _mm,
    "clone": _clone,
}


def enable_model() -> None:
    """:func:`enable` plus the stand-ins the whole pynative DeepSeek-V3 model needs; call before building it (its
    cells keep references to ``mint`` functions taken at construction)."""
    from mindformers.pynative.layers import flash_attention, layer_norm  # noqa: PLC0415
    from mindformers.pynative.transformers.moe import experts  # noqa: PLC0415

    enable()
    for name, fn in MODEL_STAND_INS.items():
        _SAVED.setdefault(name, getattr(mint, name))
        setattr(mint, name, fn)
    mint.nn.functional.embedding = _embedding
    ms.Tensor.scatter_ = _scatter_value_
    layer_norm.rms_norm = _rms_norm
    experts.GroupedMatmul = _GroupedMatmul
    flash_attention.FlashAttentionScore = _FlashAttentionScore
