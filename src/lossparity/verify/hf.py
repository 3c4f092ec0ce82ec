"""``lossparity verify --hf MODEL`` / ``--model pkg.module:build``: layout invariance of the user's own model.

The model (a Hugging Face causal LM from its configuration, or any module from ``build(seed, dtype)``) is
trained for a few SGD steps on a synthetic corpus (8 rows of unequal length per step, padding, or packed
documents with restarting ``position_ids``) under each layout, and every mode's objective, logged metrics,
gradient norm and updated parameters are compared with the single-process run. Every mode goes through
the :class:`~lossparity.Accountant`, computed in float64 from the model's logits (causal shift,
``-100`` ignored); an MoE model's load-balancing term (transformers' ``load_balancing_loss_func``, float64
from the router logits) in the scope ``aux_scope`` (docs/semantics.md §5): ``hf`` (each microbatch's term
added in full, as ``transformers.Trainer`` does), ``microbatch`` (weighted ``1/(D·K)``) or
``global_lagged`` (the global batch's term with the previous step's expert fractions).

Layouts: ``K`` (accumulation), ``D`` (DDP), ``+fsdp`` (FSDP2 per decoder layer, then the model), ``T`` (the
model's own tensor-parallel plan), ``+recompute`` (gradient checkpointing) and their compositions without
``D×T``; ``C``, ``P``, ``E`` and ``+SP`` are refused (:func:`check_hf_layout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..integrations.hf import IGNORE_INDEX, shifted_labels
from ..losses.hf_aux import hf_lagged_aux, hf_load_balancing_loss, hf_router_sums
from ..losses.modes import MODES
from .hf_compare import compare_runs
from .layouts import Layout, parse_layout

__all__ = [
    "HF_AUX_SCOPES",
    "LayoutUnsupported",
    "ModelSpec",
    "check_hf_layout",
    "parse_hf_layouts",
    "probe_model",
    "run_verify_hf",
    "run_verify_hf_many",
    "synthetic_batch",
]

HF_AUX_SCOPES = ("global_lagged", "microbatch", "hf")
N_ROWS, SEQ, LR = 8, 16, 0.1
_B_DEPENDENT_SCOPES = ("microbatch",)
# The model's own float32 floor: the 1x1 run with the rows of every step in reverse order (the objective,
# the gradients and the update are sums over the rows: only their summation order changes) and its float64
# parameters scaled by 1 + 2^-50 (a change at float64 rounding level, as a different layout's summation
# order makes inside a layer). A float64 model agrees to ~1e-15; one that computes in float32 inside
# (float32 parameters, .float() casts) rounds that change to float32 precision. Each quantity of a layout
# is judged against max(tolerance, FLOOR_FACTOR × its floor).
FLOOR = "1x1 rows reversed"
FLOOR_FACTOR = 10.0
# A floor above this is not float32 rounding (2^-24 ≈ 6e-8 per operation) but a model that does not
# repeat itself (random draws in training mode): it is reported and not used.
FLOOR_MAX = 1e-5


@dataclass
class ModelSpec:
    """What to build on every rank: ``hf_config`` (a transformers config) or ``build`` (``pkg.module:fn``),
    plus ``parallelize`` (``pkg.module:fn(model, tp_mesh)``) for ``T`` with a ``--model``."""

    name: str
    seed: int = 0
    dtype: str = "float64"
    hf_config: Any = None
    build: str | None = None
    parallelize: str | None = None
    packed: bool = False
    aux_scope: str = "global_lagged"
    vocab: int = 256
    moe: tuple[int, int] | None = None  # (E, k) when the model reports router logits
    aux_coef: float = 0.0
    tp_dir: str | None = field(default=None, repr=False)


class LayoutUnsupported(ValueError):
    """A layout that this model does not support (no tensor-parallel plan...): skipped with a note."""


def parse_hf_layouts(names: str, spec: ModelSpec, notes: list[str] | None = None) -> tuple[Layout, ...]:
    """Comma-separated layouts in verify's grammar (``K=n`` may carry ``+recompute``/``+fsdp`` too), each
    checked by :func:`check_hf_layout`; ``ValueError`` naming the first one that cannot run. With ``notes``,
    a layout the model does not support (:class:`LayoutUnsupported`) is left out and its reason appended
    there instead, unless no layout is left."""
    out = []
    for name in dict.fromkeys(x.strip() for x in names.split(",") if x.strip()):
        layout = dataclasses.replace(parse_layout(re.sub(r"^K=(\d+)(?=\+|$)", r"K\1", name)), name=name)
        try:
            check_hf_layout(layout, spec)
        except LayoutUnsupported as e:
            if notes is None:
                raise
            notes.append(f"skipped: {e}")
            continue
        out.append(layout)
    if not out:
        raise ValueError("--layouts: give at least one layout name" + (f" ({notes[-1]})" if notes else ""))
    return tuple(out)


def check_hf_layout(layout: Layout, spec: ModelSpec) -> None:
    """Raise ``ValueError`` (naming the layout) for what verify cannot run on this model, with the reason."""
    why = None
    if layout.cp > 1:
        why = (
            "C: context parallelism needs the flash/efficient SDPA kernels; torch's context_parallel has no "
            "sharding strategy for the CPU attention kernel (and verify --hf does not shard HF attention)"
        )
    elif layout.pp > 1:
        why = "P: transformers' model classes provide no pipeline schedule"
    elif layout.ep > 1:
        why = "E: transformers' model classes provide no expert-parallel plan that verify can run"
    elif layout.sp:
        why = "+SP: transformers' tensor-parallel plans do not wire sequence parallelism"
    elif layout.tp > 1 and layout.dp > 1:
        why = "D×T: transformers builds its own device mesh for its tensor-parallel plan; verify runs T without D"
    elif layout.tp > 1 and spec.hf_config is not None and not _tp_plan(spec.hf_config):
        why = f"T: {type(spec.hf_config).__name__} has no tensor-parallel plan (base_model_tp_plan)"
    elif layout.tp > 1 and spec.build is not None and spec.parallelize is None:
        why = "T: a --model needs --parallelize pkg.module:fn (fn(model, tp_mesh)) to run tensor parallel"
    elif layout.recompute and spec.hf_config is not None and not _supports_recompute(spec.hf_config):
        why = f"+recompute: the {spec.hf_config.model_type} model class does not support activation checkpointing"
    elif layout.engine == "fsdp" and layout.dp < 2:
        why = "+fsdp needs D >= 2"
    elif N_ROWS % (layout.dp * layout.ga):
        why = f"D·K = {layout.dp * layout.ga} does not divide the {N_ROWS} rows of a step"
    if why:
        model_dependent = (layout.tp > 1 and why.startswith("T:")) or why.startswith("+recompute:")
        raise (LayoutUnsupported if model_dependent else ValueError)(f"layout {layout.name!r} cannot run: {why}")


def probe_model(spec: ModelSpec) -> ModelSpec:
    """Build a ``--model`` once and run it on 2 tokens: it must be an ``nn.Module`` returning ``[b, S, V]``
    logits (or ``.logits``); returns ``spec`` with the vocabulary ``V`` and, when the outputs carry
    ``router_logits`` and the model a config with an expert count and top-k, its MoE shape."""
    from .user_models import moe_shape

    model = _build(spec, Layout("1x1", 1, 1))
    ids = torch.tensor([[1, 2]])
    kw = {"position_ids": torch.tensor([[0, 1]])} if spec.packed else {}
    with torch.no_grad():
        try:
            out = model(input_ids=ids, **kw)
        except Exception as e:  # the user's forward: any failure is bad input, named
            raise ValueError(f"--model: {spec.build} failed on input_ids [1, 2]: {type(e).__name__}: {e}") from None
    logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, 2):
        raise ValueError(f"--model: {spec.build} returned no [b, S, V] logits (a tensor or an object with .logits)")
    config = getattr(model, "config", None)
    moe = moe_shape(config) if getattr(out, "router_logits", None) else None
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    return dataclasses.replace(spec, vocab=int(logits.shape[-1]), moe=moe, aux_coef=coef)


def _supports_recompute(config: Any) -> bool:
    """Whether the family's causal-LM class declares gradient checkpointing support (True when unknown)."""
    from ..integrations.hf_moe import model_class

    cls = model_class(config)
    return bool(getattr(cls, "supports_gradient_checkpointing", True)) if cls is not None else True


def _tp_plan(config: Any) -> bool:
    return bool(getattr(config, "base_model_tp_plan", None))


# ------------------------------------------------------------------ data
def synthetic_batch(step: int, vocab: int, packed: bool, seed: int = 0) -> dict[str, Tensor]:
    """The step's global batch, ``[8, 16]``: padded rows of unequal length (``attention_mask``, labels ``-100``
    on a random prompt prefix and on padding; row 2 has no label at all), or packed rows of 1-4 documents
    (``position_ids`` restart at 0, the first label of each document ``-100``, ``segment_ids`` their ids)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    ids = torch.randint(3, vocab, (N_ROWS, SEQ), generator=g)
    if not packed:
        lengths = torch.randint(4, SEQ + 1, (N_ROWS,), generator=g)
        lengths[0] = SEQ
        att = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        prompt = torch.minimum(torch.randint(1, 4, (N_ROWS,), generator=g), lengths - 1)
        prompt[2] = SEQ
        labels = torch.where((torch.arange(SEQ)[None] >= prompt[:, None]) & (att > 0), ids, IGNORE_INDEX)
        return {"input_ids": ids * att, "attention_mask": att, "labels": labels}
    pos = torch.zeros(N_ROWS, SEQ, dtype=torch.long)
    seg = torch.zeros(N_ROWS, SEQ, dtype=torch.long)
    for r in range(N_ROWS):
        cuts = sorted(
            set(torch.randint(2, SEQ - 1, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist())
        )
        for d, (a, b) in enumerate(zip([0] + cuts, cuts + [SEQ])):
            pos[r, a:b] = torch.arange(b - a)
            seg[r, a:b] = d + 1
    labels = torch.where(pos == 0, IGNORE_INDEX, ids)
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "segment_ids": seg}


def _segments(batch: dict[str, Tensor]) -> Tensor:
    if "segment_ids" in batch:
        return batch["segment_ids"]
    return batch["attention_mask"].long()  # padded rows: one document per row, 0 = padding


# ------------------------------------------------------------------ models per layout
def _dtype(spec: ModelSpec) -> torch.dtype:
    return torch.float64 if spec.dtype == "float64" else torch.float32


def _cast_router_scores(model: nn.Module) -> None:
    """Routers that return their top-k weights in float32 (Mixtral) get them cast back to the logits' dtype,
    as Qwen3-MoE does, so that a float64 comparison is not limited by float32 rounding of the gates."""

    def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
        if isinstance(out, tuple) and len(out) == 3 and isinstance(out[1], Tensor) and out[1].is_floating_point():
            if out[1].dtype != out[0].dtype:
                return (out[0], out[1].to(out[0].dtype), out[2])
        return out

    from ..integrations.hf_moe import router_classes

    routers = router_classes(model)
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter") or isinstance(module, routers):
            module.register_forward_hook(hook)


def _quiet_transformers() -> None:
    """No progress bars or info lines of transformers in verify's table (its warnings stay)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _build(spec: ModelSpec, layout: Layout) -> nn.Module:
    from .user_models import build_hf_model, import_target

    _quiet_transformers()
    dtype = _dtype(spec)
    if spec.hf_config is None:
        try:
            model = import_target(spec.build or "", "--model")(spec.seed, dtype)
        except ValueError:
            raise
        except Exception as e:  # the user's build: any failure is bad input, named
            raise ValueError(f"--model: {spec.build}(seed, dtype) failed: {type(e).__name__}: {e}") from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model: {spec.build} returned {type(model).__name__}, not a torch.nn.Module")
        if layout.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            import_target(spec.parallelize or "", "--parallelize")(model, init_device_mesh("cpu", (layout.tp,)))
    elif layout.tp > 1:
        import transformers
        from transformers.distributed import DistributedConfig

        # The model's own plan: load the random initialization saved by the parent with tp_size = T.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(spec.tp_dir),
            dtype=dtype,
            distributed_config=DistributedConfig(tp_size=layout.tp),
            experts_implementation="eager" if spec.moe else None,
        )
    else:
        model = build_hf_model(spec.hf_config, spec.seed, dtype)
    _cast_router_scores(model)
    model.train()
    if layout.recompute:
        # Recent transformers name it activation_checkpointing_enable (the old name warns).
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ValueError("+recompute: the model has no gradient_checkpointing_enable()")
    return model


def _wrap(model: nn.Module, layout: Layout) -> nn.Module:
    if layout.dp == 1:
        return model
    if layout.engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # FSDP2 flattens one dtype per group: a module whose own parameters are of another dtype than the
        # model's (a float32 router in a float64 model) is a group of its own, before its layer's.
        main = next(model.parameters()).dtype
        for name, m in list(model.named_modules())[::-1]:
            own = list(m.parameters(recurse=False))
            if name and own and all(p.dtype != main for p in own) and len({p.dtype for p in own}) == 1:
                fully_shard(m)
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers if layers is not None else []:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # MoE: experts that no token of a microbatch reaches get no gradient there.
    return DistributedDataParallel(model, find_unused_parameters=True)


def _accountant(mode: str, layout: Layout) -> Any:
    from ..distributed.accountant import Accountant

    kw: dict[str, Any] = {"fixed_length": SEQ}
    if layout.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        kw["mesh"] = init_device_mesh("cpu", (1, layout.tp), mesh_dim_names=("dp", "tp"))
    return Accountant(mode, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ one run
@dataclass
class _AuxState:
    """``global_lagged``: this rank's counts ``c_e`` and rows ``R`` of the step, and the previous step's."""

    prev: list[float] | None = None
    local: Tensor | None = None
    frac: Tensor | None = None
    tokens: float = 0.0


def _forward(model: nn.Module, mb: dict[str, Tensor], spec: ModelSpec) -> tuple[Tensor, Any]:
    fwd = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids") if k in mb}
    if spec.hf_config is None:
        fwd.pop("attention_mask", None)
        if not spec.packed:
            fwd.pop("position_ids", None)
    out = model(**fwd)
    logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        what = spec.build or spec.name
        raise ValueError(f"--model: {what} returned no [b, S, V] logits (a tensor or an object with .logits)")
    return logits, out


def _aux_share(spec: ModelSpec, out: Any, mb: dict[str, Tensor], acc: Any, aux: _AuxState) -> Tensor | None:
    router = getattr(out, "router_logits", None)
    if spec.moe is None or not router:
        return None
    e, k = spec.moe
    att = mb.get("attention_mask") if spec.hf_config is not None else None
    mbs = acc.global_count("microbatches")
    if spec.aux_scope == "global_lagged":
        p, c, r = hf_router_sums(router, k, att)
        assert aux.local is not None and aux.frac is not None
        aux.local[:-1] += c
        aux.local[-1] += r
        value = hf_lagged_aux(p, aux.frac, len(router) * aux.tokens)
        acc.record("aux_loss", value.detach(), 1.0 / mbs)
    else:
        value = hf_load_balancing_loss(router, k, att)
        acc.record("aux_loss", value.detach())
        if spec.aux_scope == "microbatch":
            value = value / mbs
    share = spec.aux_coef * value
    acc.record("objective", share.detach())
    return share


def _aux_counts(spec: ModelSpec, rows: dict[str, Tensor], aux: _AuxState) -> dict[str, float]:
    if spec.moe is None or spec.aux_scope != "global_lagged":
        return {}
    e, _ = spec.moe
    tokens = float(rows["attention_mask"].sum()) if "attention_mask" in rows else float(rows["input_ids"].numel())
    prev = aux.prev or [0.0] * (e + 1)
    return {"aux_rows": tokens, "aux_prev_rows": prev[e], **{f"aux_c{i}": prev[i] for i in range(e)}}


def _aux_start(spec: ModelSpec, acc: Any, aux: _AuxState) -> None:
    if spec.moe is None or spec.aux_scope != "global_lagged":
        return
    e, k = spec.moe
    prev_rows = acc.global_count("aux_prev_rows")
    frac = [acc.global_count(f"aux_c{i}") / prev_rows if prev_rows > 0 else k / e for i in range(e)]
    aux.frac = torch.tensor(frac, dtype=torch.float64)
    aux.tokens = acc.global_count("aux_rows")
    aux.local = torch.zeros(e + 1, dtype=torch.float64)


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(spec: ModelSpec, wrapped: nn.Module, acc: Any, mine: dict[str, Tensor], k: int, aux: _AuxState) -> None:
    b = mine["input_ids"].shape[0] // k
    mbs = [{key: v[i * b : (i + 1) * b] for key, v in mine.items()} for i in range(k)]
    labels = [shifted_labels(mb) for mb in mbs]
    masks = [(y != IGNORE_INDEX).double() for y in labels]
    segs = [_segments(mb) for mb in mbs]
    acc.begin_step(masks, segs, extra_counts=_aux_counts(spec, mine, aux))
    _aux_start(spec, acc, aux)
    for mb, y, mask, seg in zip(mbs, labels, masks, segs):
        logits, out = _forward(wrapped, mb, spec)
        per_token = F.cross_entropy(
            logits.double().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(y.shape)
        loss = acc.lm_loss(per_token, mask, seg)
        share = _aux_share(spec, out, mb, acc, aux)
        (loss if share is None else loss + share).backward()
    acc.finish_step(wrapped)


def _run_mode(rank: int, spec: ModelSpec, layout: Layout, mode: str, steps: int) -> dict[str, Any]:
    model = _build(spec, layout)
    if layout.name == FLOOR:
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype == torch.float64:
                    p.mul_(1 + 2.0**-50)
    wrapped = _wrap(model, layout)
    acc = _accountant(mode, layout)
    if spec.moe is not None:
        acc.declare_metric("aux_loss")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp_rank = rank if layout.tp == 1 else 0
    rows_per_rank = N_ROWS // layout.dp
    history, aux = [], _AuxState()
    grads: list[dict[str, Tensor]] = []
    f32: list[str] = []
    f32_ops: list[str] = []
    for step in range(steps):
        rows = synthetic_batch(step, spec.vocab, spec.packed, spec.seed)
        if layout.name == FLOOR:
            rows = {key: v.flip(0) for key, v in rows.items()}
        watch = step == 0 and layout.name == "1x1" and spec.dtype == "float64"
        mine = {key: v[dp_rank * rows_per_rank : (dp_rank + 1) * rows_per_rank] for key, v in rows.items()}
        with _Float32Watch(model, f32, f32_ops) if watch else contextlib.nullcontext():
            _step(spec, wrapped, acc, mine, layout.ga, aux)
        logs = acc.logs()
        if aux.local is not None:
            aux.prev, aux.local = aux.local.tolist(), None
        # Full gradients (DTensor shards gathered; an expert no token reached has none: zeros).
        step_grads = {
            n: _full(p.grad).detach().clone() if p.grad is not None else torch.zeros(_full(p.detach()).shape)
            for n, p in model.named_parameters()
        }
        logs["grad_norm"] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in step_grads.values())))  # type: ignore[arg-type]
        history.append({k: v for k, v in logs.items() if k in ("objective", "lm_loss", "aux_loss", "grad_norm")})
        grads.append(step_grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return {"history": history, "grads": grads, "params": params, "float32_modules": f32, "float32_ops": f32_ops}


class _Float32Watch(TorchDispatchMode):
    """While active (the 1x1 run's first step, float64): appends to ``returns`` the modules whose output is a
    float32 tensor (their own float32 parameters or casts), and to ``computes`` the innermost module of every
    forward operation that produces a float32 tensor anywhere (an RMSNorm's internal float32 upcast too):
    where the model computes in float32 by design, named for the report."""

    def __init__(self, model: nn.Module, returns: list[str], computes: list[str]) -> None:
        super().__init__()
        self.returns, self.found = returns, computes
        self.stack: list[str] = []
        self.handles: list[Any] = []
        for name, m in model.named_modules():
            if name:
                self.handles.append(m.register_forward_pre_hook(self._enter(name)))
                self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, name: str) -> Any:
        def hook(*_args: Any) -> None:  # returns None: the module's input is unchanged
            self.stack.append(name)

        return hook

    def _leave(self, _m: nn.Module, _args: Any, out: Any) -> None:  # returns None: the output is unchanged
        name = self.stack.pop()
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, Tensor) and first.dtype == torch.float32 and name not in self.returns:
            self.returns.append(name)

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)  # type: ignore[no-any-return]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.stack and self.stack[-1] not in self.found:
            leaves = out if isinstance(out, (tuple, list)) else [out]
            if any(isinstance(t, Tensor) and t.dtype == torch.float32 for t in leaves):
                self.found.append(self.stack[-1])
        return out


def _run_jobs(
    rank: int, world: int, specs: list[ModelSpec], jobs: list[tuple[int, Layout]], modes: list[str], steps: int
) -> Any:
    """Every mode of every job ``(model index, layout)`` (all of ``world`` ranks) in one set of processes:
    ``{(index, layout name): ({mode: record}, wall seconds)}`` on rank 0 (records hold full tensors); on one
    rank, a job that raises has its error line instead of the records."""
    torch.set_num_threads(1)
    out: dict[tuple[int, str], tuple[Any, float]] = {}
    for i, layout in jobs:
        t = time.perf_counter()
        try:
            runs: Any = {mode: _run_mode(rank, specs[i], layout, mode, steps) for mode in modes}
        except Exception as e:
            if world > 1:  # peers may wait in a collective: the launcher stops them and names this rank
                raise
            runs = f"{type(e).__name__}: " + " ".join(str(e).split())[:300]  # this layout's row: ERROR
        out[(i, layout.name)] = (runs, time.perf_counter() - t)
    return out if rank == 0 else None


# ------------------------------------------------------------------ the report
def _reference(layout: Layout, mode: str, spec: ModelSpec) -> Layout:
    """The single-process run of the same microbatch size where the quantity depends on it, else 1x1."""
    if mode == "per_microbatch" or (spec.moe is not None and spec.aux_scope in _B_DEPENDENT_SCOPES):
        k = layout.dp * layout.ga
        return Layout("1x1" if k == 1 else f"K={k}", 1, k)
    return Layout("1x1", 1, 1)


def run_verify_hf(
    spec: ModelSpec,
    layouts: tuple[Layout, ...],
    modes: tuple[str, ...] = ("per_token", "per_sample", "per_document"),
    *,
    steps: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every (layout, mode) and compare each with its reference; the report of :func:`format_hf_table`:
    ``{"rows": [{layout, mode, reference, diffs, pass, first}], "tolerance", "steps", "wall_s", ...}``."""
    return run_verify_hf_many([spec], layouts, modes, steps=steps, progress=progress)[0]


def run_verify_hf_many(
    specs: list[ModelSpec],
    layouts: tuple[Layout, ...],
    modes: tuple[str, ...] = ("per_token", "per_sample", "per_document"),
    *,
    steps: int = 2,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """:func:`run_verify_hf` of several models, sharing one set of processes per world size (the start of
    the processes dominates the wall time of small models); one report per model."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--modes: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    for spec in specs:
        for layout in layouts:
            check_hf_layout(layout, spec)
    t0 = time.perf_counter()
    results: dict[tuple[int, str], Any] = {}
    walls: dict[tuple[int, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        specs = [_with_tp_dir(spec, layouts, os.path.join(tmp, str(i))) for i, spec in enumerate(specs)]
        # Every run needed (the layouts and their references), one set of processes per world size.
        needed: dict[tuple[int, str], Layout] = {}
        for i, spec in enumerate(specs):
            needed[(i, FLOOR)] = Layout(FLOOR, 1, 1)
            needed[(i, "1x1")] = Layout("1x1", 1, 1)  # the floor's reference
            for lay in layouts:
                needed[(i, lay.name)] = lay
                for mode in modes:
                    ref = _reference(lay, mode, spec)
                    needed.setdefault((i, ref.name), ref)
        for world in sorted({lay.dp * lay.tp for lay in needed.values()}):
            jobs = [(i, lay) for (i, _), lay in needed.items() if lay.dp * lay.tp == world]
            if progress:
                names = ", ".join(dict.fromkeys(lay.name for _, lay in jobs))
                print(f"  running {names} ({len(modes)} modes, {world} process(es))...", flush=True)
            for key, (record, wall) in _run_world(world, jobs, specs, modes, steps).items():
                results[key], walls[key] = record, wall
    wall = time.perf_counter() - t0
    return [_report(i, spec, layouts, modes, steps, results, walls, wall) for i, spec in enumerate(specs)]


def _run_world(
    world: int, jobs: list[tuple[int, Layout]], specs: list[ModelSpec], modes: tuple[str, ...], steps: int
) -> dict[tuple[int, str], tuple[Any, float]]:
    """:func:`_run_jobs` of one world size; a job that raises gives its error as one line (a ``str`` record)
    and the others still run: in-process for 1 rank, else in one set of processes, then, when a rank failed,
    one set per job (so that the failing layout is named and the others keep their rows)."""
    from ..distributed.launch import RankError, spawn

    args = (specs, jobs, list(modes), steps)
    if world == 1:
        return _run_jobs(0, 1, *args)  # type: ignore[no-any-return]
    try:
        return spawn(_run_jobs, world, *args, timeout_s=900)[0]  # type: ignore[no-any-return]
    except RankError as e:
        if len(jobs) > 1:
            out: dict[tuple[int, str], tuple[Any, float]] = {}
            for job in jobs:
                out.update(_run_world(world, [job], specs, modes, steps))
            return out
        first = e.failures[0] if e.failures else None
        what = f"rank {first.rank}: {first.kind}: {first.message}" if first else str(e)
        return {(jobs[0][0], jobs[0][1].name): (" ".join(what.split())[:300], 0.0)}


def _with_tp_dir(spec: ModelSpec, layouts: tuple[Layout, ...], path: str) -> ModelSpec:
    """An HF model run under ``T``: its random initialization saved for ``from_pretrained`` with a TP plan."""
    if not any(lay.tp > 1 for lay in layouts) or spec.hf_config is None:
        return spec
    from .user_models import build_hf_model

    _quiet_transformers()
    model: Any = build_hf_model(spec.hf_config, spec.seed, _dtype(spec))
    model.save_pretrained(path)
    return dataclasses.replace(spec, tp_dir=path)


def _report(
    i: int,
    spec: ModelSpec,
    layouts: tuple[Layout, ...],
    modes: tuple[str, ...],
    steps: int,
    results: dict[tuple[int, str], Any],
    walls: dict[tuple[int, str], float],
    wall: float,
) -> dict[str, Any]:
    tol = 1e-10 if spec.dtype == "float64" else 1e-5
    floor_runs, base = results.get((i, FLOOR)), results.get((i, "1x1"))
    float32_params: list[str] = []
    float32_modules: list[str] = []
    float32_ops: list[str] = []
    if isinstance(base, dict) and spec.dtype == "float64":
        first = next(iter(base.values()))
        float32_params = [n for n, t in first["params"].items() if t.dtype != torch.float64]
        float32_modules = first.get("float32_modules", [])
        float32_ops = first.get("float32_ops", [])
    # Where the model computes in float32, a float32 rounding flip is as likely as any other: at least
    # float32's unit roundoff, whatever the perturbed run happened to show.
    least = 2.0**-24 if float32_params or float32_modules else 0.0
    floors: dict[str, dict[str, float]] = {}
    if isinstance(floor_runs, dict) and isinstance(base, dict):
        for mode in modes:
            diffs = compare_runs(floor_runs[mode], base[mode], tol)["diffs"]
            floors[mode] = {k: max(v, least) for k, v in diffs.items() if k != "grads_abs"}
    rows = []
    for layout in layouts:
        for mode in modes:
            ref = _reference(layout, mode, spec)
            if ref.name == layout.name:  # a quantity of this microbatch size: no other layout to compare
                rows.append({"layout": layout.name, "mode": mode, "reference": "itself", "pass": True, "diffs": {}})
                continue
            run, ref_run = results.get((i, layout.name)), results.get((i, ref.name))
            if not isinstance(run, dict) or not isinstance(ref_run, dict):
                error = run if isinstance(run, str) else f"its reference {ref.name}: {ref_run}"
                rows.append({"layout": layout.name, "mode": mode, "reference": ref.name, "pass": False, "diffs": {}})
                rows[-1].update(error=error, first=None)
                continue
            floor = floors.get(mode) if spec.dtype == "float64" else None
            if floor and max(floor.values()) > FLOOR_MAX:
                floor = None
            verdict = compare_runs(run[mode], ref_run[mode], tol, hf_scope=_hf_note(spec, layout), floor=floor)
            rows.append({"layout": layout.name, "mode": mode, "reference": ref.name, **verdict})
    worst_floor = max((v for d in floors.values() for v in d.values()), default=0.0)
    if worst_floor > FLOOR_MAX:
        for row in rows:  # no layout can be judged against a run that does not repeat itself: could not run
            if not row["pass"] and "error" not in row:
                row["error"] = (
                    f"the model is not deterministic in training mode: two 1x1 runs that differ only in a "
                    f"summation order differ by {worst_floor:.1e} (random draws: sampling routers, dropout); "
                    f"first difference {row['first']}"
                )
    return {
        "rows": rows,
        "floor": worst_floor if tol < worst_floor <= FLOOR_MAX else None,
        "floor_factor": FLOOR_FACTOR,
        "float32_params": float32_params,
        "float32_modules": float32_modules,
        "float32_ops": float32_ops,
        "tolerance": tol,
        "steps": steps,
        "wall_s": wall,
        "layout_wall_s": {name: w for (j, name), w in walls.items() if j == i and name != FLOOR},
        "moe": spec.moe is not None,
    }


def _hf_note(spec: ModelSpec, layout: Layout) -> str | None:
    """Why an ``hf``-scope row differs: the aux term is added once per microbatch (``D·K`` times)."""
    n = layout.dp * layout.ga
    if spec.moe is None or spec.aux_scope != "hf" or n == 1:
        return None
    return f"aux_scope hf adds the aux term once per microbatch: {n} times in this step (D·K = {n}), once in 1x1"
