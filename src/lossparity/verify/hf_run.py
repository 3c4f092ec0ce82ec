"""One rank of ``lossparity verify --hf``: the synthetic batches, the model built and wrapped for one layout,
the accountant, the MoE aux term in its scope, the SGD steps and what they record (objective, logs,
gradients, parameters), and the float32 watch that names the parameters and modules computing in float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..integrations.hf import IGNORE_INDEX, shifted_labels
from ..losses.hf_aux import hf_lagged_aux, hf_load_balancing_loss, hf_router_sums
from .hf_spec import FLOOR, LR, N_ROWS, REPEAT, SEQ, ModelSpec
from .layouts import Layout

__all__ = ["synthetic_batch", "probe_model"]


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
        if spec.tp_error:
            raise ValueError(spec.tp_error)
        import transformers
        from transformers.distributed import DistributedConfig

        # The model's own plan: load the random initialization saved by the parent with tp_size = T.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(spec.tp_dir),
            dtype=dtype,
            distributed_config=DistributedConfig(tp_size=layout.tp),
            experts_implementation="eager",  # as the reference build (float64 grouped kernels do not exist)
        )
        _reference_buffers(model, str(spec.tp_dir))
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


BUFFERS = "lossparity_buffers.pt"


def _reference_buffers(model: nn.Module, tp_dir: str) -> None:
    """The buffers of the reference build (saved by the parent next to its weights) copied into the model
    ``from_pretrained`` built for ``T``: buffers that are not saved with the weights are computed again
    there, not always alike (CodeGen's and GPT-J's sinusoidal positions: computed in float32 there, in float64
    by the reference build, 5.7e-7 apart), so that ``T`` would compare another model. A buffer of another
    shape (sharded by the plan) keeps its own values."""
    import os

    path = os.path.join(tp_dir, BUFFERS)
    if not os.path.exists(path):
        return
    saved = torch.load(path, weights_only=True)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            ref = saved.get(name)
            if ref is not None and type(buf) is Tensor and buf.shape == ref.shape:
                buf.copy_(ref)


def _wrap(model: nn.Module, layout: Layout, dtype: torch.dtype) -> nn.Module:
    if layout.dp == 1:
        return model
    if layout.engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # FSDP2 flattens one dtype per group, and one module may hold parameters of both (Bailing-hybrid's
        # linear attention: a float32 conv1d and forget gate next to float64 projections): the parameters of
        # another dtype than the model's stay out of every group, replicated, their gradients averaged by
        # _reduce_replicated.
        other = {p for p in model.parameters() if p.dtype != dtype}
        ignored, ids = other or None, {id(p) for p in other}
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers if layers is not None else []:
            fully_shard(layer, ignored_params=ignored)
        fully_shard(model, ignored_params=ignored)
        _REPLICATED[model] = [p for p in model.parameters() if id(p) in ids]
        return model
    from torch.nn.parallel import DistributedDataParallel

    # MoE: experts that no token of a microbatch reaches get no gradient there.
    return DistributedDataParallel(model, find_unused_parameters=True)


# FSDP-wrapped models: their parameters left out of FSDP (another dtype), in the model's order.
_REPLICATED: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()


def _reduce_replicated(model: nn.Module) -> None:
    """The gradients of the parameters FSDP leaves out: summed over the data-parallel ranks and divided by
    their number, as FSDP averages its own (the accountant then scales every gradient alike). A parameter
    without a gradient on this rank (an expert no token reached) takes part with zeros."""
    params = _REPLICATED.get(model) or []
    if not params:
        return
    import torch.distributed as dist

    world = dist.get_world_size()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


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
    _reduce_replicated(wrapped)
    acc.finish_step(wrapped)


def _run_mode(rank: int, spec: ModelSpec, layout: Layout, mode: str, steps: int) -> dict[str, Any]:
    model = _build(spec, layout)
    if layout.name == REPEAT:  # the 1x1 run drawing other random numbers: a model that draws any differs
        torch.manual_seed(1_000_003 + spec.seed)
    if layout.name == FLOOR:
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype == torch.float64:
                    p.mul_(1 + 2.0**-50)
    wrapped = _wrap(model, layout, _dtype(spec))
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
    f32_params: list[str] = []
    for step in range(steps):
        rows = synthetic_batch(step, spec.vocab, spec.packed, spec.seed)
        if layout.name == FLOOR:
            rows = {key: v.flip(0) for key, v in rows.items()}
        watch = step == 0 and layout.name == "1x1" and spec.dtype == "float64"
        mine = {key: v[dp_rank * rows_per_rank : (dp_rank + 1) * rows_per_rank] for key, v in rows.items()}
        keep = KeepFloat64() if spec.keep_float64 else contextlib.nullcontext()
        with keep, _Float32Watch(model, f32, f32_ops, f32_params) if watch else contextlib.nullcontext():
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
    return {
        "history": history,
        "grads": grads,
        "params": params,
        "float32_modules": f32,
        "float32_ops": f32_ops,
        "float32_casts": f32_params,
    }


class KeepFloat64(TorchFunctionMode):
    """The model's float32 computation done in float64 (the second opinion on a FAIL, :func:`run_verify_hf`):
    a torch function or tensor method that has a float64 tensor among its inputs gets its float32 tensor
    inputs as float64 and a float32 target as float64 (``x.float()``, ``w.to(torch.float32)``, ``sum(...,
    dtype=float32)``, ``F.linear(x, w32)``). Above autograd, so gradients flow back to float32 parameters
    through the cast; in-place methods (``add_``) are left as they are."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))] + list(kwargs.values())
        name = getattr(func, "__name__", "")
        if name.endswith("_") or not any(isinstance(a, Tensor) and a.dtype == torch.float64 for a in flat):
            return func(*args, **kwargs)
        if func is Tensor.float:
            return args[0]  # already float64: .float() of the model's own float32 copy, kept float64

        def up(x: Any) -> Any:
            if x is torch.float32:
                return torch.float64
            if isinstance(x, Tensor) and x.dtype == torch.float32:
                return x.double()
            return type(x)(up(y) for y in x) if isinstance(x, (list, tuple)) else x

        return func(*up(args), **{k: up(v) for k, v in kwargs.items()})


class _Float32Watch(TorchDispatchMode):
    """While active (the 1x1 run's first step, float64): appends to ``returns`` the modules whose output is a
    float32 tensor (their own float32 parameters or casts), to ``computes`` the innermost module of every
    forward operation that produces a float32 tensor anywhere (an RMSNorm's internal float32 upcast too),
    and to ``casts`` the float64 parameters that reach a float32 operation: the parameter itself, or a
    tensor computed from parameters alone (Jamba's ``A_log.float()``, DiffLlama's
    ``sum(lambda_q1 * lambda_k1, dtype=float32)``), where the model computes in float32 by design, named
    for the report. Activations cast to float32 (a norm's upcast) are not casts of a parameter: a layout
    changes no value there, so they set no floor."""

    def __init__(self, model: nn.Module, returns: list[str], computes: list[str], casts: list[str]) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        super().__init__()
        self.returns, self.found, self.casts = returns, computes, casts
        self.stack: list[str] = []
        self.handles: list[Any] = []
        # tensor -> the float64 parameters it is computed from, for tensors computed from parameters alone
        self.derived: Any = WeakIdKeyDictionary()
        for name, p in model.named_parameters():
            if p.dtype == torch.float64:
                self.derived[p] = {name}
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
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        leaves = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if self.stack and self.stack[-1] not in self.found:
            if any(t.dtype == torch.float32 for t in leaves):
                self.found.append(self.stack[-1])
        inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, Tensor)]
        if inputs and all(t in self.derived for t in inputs):
            names = set().union(*(self.derived[t] for t in inputs))
            if any(t.dtype == torch.float32 for t in leaves):
                self.casts.extend(sorted(n for n in names if n not in self.casts))
            for t in leaves:
                if t.dtype == torch.float64:
                    self.derived[t] = names
        return out


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
