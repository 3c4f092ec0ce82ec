"""Tensor parallelism (TP) for the reference model, with PyTorch's ``torch.distributed.tensor.parallel``.

Plan (Megatron's, without sequence parallelism):

- attention: ``wq``/``wk``/``wv`` column-wise (each TP rank holds ``n_heads/T`` query heads and
  ``n_kv_heads/T`` key/value heads), ``wo`` row-wise (its output is all-reduced);
- dense SwiGLU MLPs and the MoE shared expert: ``w1``/``w3`` column-wise, ``w2`` row-wise;
- routed experts' dense parts: the hidden dimension of every expert is sharded (``w1``/``w3`` on their
  last dimension, ``w2`` on its middle one, as ``DTensor``s); the expert input enters a region whose
  backward all-reduces, the output leaves it with a forward all-reduce (Megatron's ``f``/``g``);
- router replicated (:class:`NoParallel`: a DTensor replicated over the TP mesh), norms and embedding
  replicated: every TP rank routes every token identically, so the token
  histograms (aux-loss counts, expert-bias counts) must NOT be summed over TP — they are summed over the
  ranks holding distinct tokens only (DP × CP), which the accountant's token group already is;
- the output head is vocabulary-parallel (rows sharded, a ``DTensor``): the chunked cross-entropy
  combines the ranks' partial logsumexps, so every TP rank gets the same per-token losses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from .attention import Attention, Indexer
from .mlp import SwiGLU
from .moe import GroupedExperts, MoE
from .router import Router
from .sequence_parallel import sp_gather, sp_reduce_scatter, sp_shard

if TYPE_CHECKING:  # gpt.py imports the model modules; this module only needs the type
    from .gpt import GPT

__all__ = ["NoParallel", "apply_tensor_parallel", "sp_gather", "sp_reduce_scatter", "sp_shard"]


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward (the input feeds sharded compute)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: D102
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward (sum of the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: D102
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        return grad, None


class NoParallel(ParallelStyle):
    """torchtitan's ``NoParallel`` for the router: its parameters become DTensors *replicated* over the TP
    mesh (every rank routes with the full weight), so all parameters of the model live on the TP mesh;
    the router computes on the local copy (``Router.forward`` reads ``to_local()``), its gradient comes
    back as a replicated DTensor (TP-partial under sequence parallelism, summed over TP by the trainer)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Replicate, distribute_tensor

        # Parameters only (not ``distribute_module``, which would also turn the routers' count and bias
        # buffers into DTensors: those stay per-rank tensors, summed over the token group by the trainer).
        for mod in module.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Replicate()])))
        return module


def _shard_experts(experts: GroupedExperts, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
        p = getattr(experts, name)
        setattr(experts, name, nn.Parameter(distribute_tensor(p.detach(), tp_mesh, [Shard(dim)])))
    group = tp_mesh.get_group()
    # a plain attribute (not a submodule): ``nn.Module.__setattr__`` stores it in ``__dict__``
    experts.tp_region = (lambda x: _CopyToRegion.apply(x, group), lambda y: _ReduceFromRegion.apply(y, group))


def _shard_head(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Vocabulary-parallel output head: rows sharded over TP (a ``DTensor``)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = tp_mesh.size()
    head = model.output
    if head.weight.shape[0] % tp:
        raise ValueError(f"tp={tp} must divide the vocabulary size {head.weight.shape[0]} (vocab-parallel head)")
    if head.weight is model.tok_embeddings.weight:
        raise ValueError("tied embeddings are not supported with tensor parallelism (vocab-parallel head)")
    head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), tp_mesh, [Shard(0)]))


def _gather_sp_input(module: nn.Module, tp_mesh: DeviceMesh, n_inputs: int) -> None:
    """Under SP the first input arrives sequence-sharded; all-gather it before the TP region."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    rest = (None,) * (n_inputs - 1)
    parallelize_module(
        module,
        tp_mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest), use_local_output=True
        ),
    )


def _parallelize_attention(
    module: Attention, tp_mesh: DeviceMesh, sequence_parallel: bool, row_out: ParallelStyle
) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = tp_mesh.size()
    if module.n_heads % tp or module.n_kv_heads % tp:
        raise ValueError(f"tp={tp} must divide n_heads={module.n_heads} and n_kv_heads={module.n_kv_heads}")
    if sequence_parallel:
        _gather_sp_input(module, tp_mesh, 4)
    parallelize_module(
        module, tp_mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": row_out}
    )
    module.n_heads //= tp
    module.n_kv_heads //= tp


def _parallelize_swiglu(module: SwiGLU, tp_mesh: DeviceMesh, sequence_parallel: bool, row_out: ParallelStyle) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if sequence_parallel:
        _gather_sp_input(module, tp_mesh, 1)
    parallelize_module(module, tp_mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": row_out})


def _parallelize_grouped_experts(module: GroupedExperts, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    tp = tp_mesh.size()
    if module.w1.shape[2] % tp:
        raise ValueError(f"tp={tp} must divide the experts' hidden size {module.w1.shape[2]}")
    _shard_experts(module, tp_mesh)
    if sequence_parallel:
        module.tp_region = None  # the MoE layer gathers tokens and reduce-scatters itself


def _parallelize_submodule(
    module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, shard_experts: bool, row_out: ParallelStyle
) -> None:
    """Apply the plan of the module docstring to one submodule (a no-op for modules it does not name)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if isinstance(module, Attention):
        _parallelize_attention(module, tp_mesh, sequence_parallel, row_out)
    elif isinstance(module, SwiGLU):
        _parallelize_swiglu(module, tp_mesh, sequence_parallel, row_out)
    elif isinstance(module, GroupedExperts) and shard_experts:
        _parallelize_grouped_experts(module, tp_mesh, sequence_parallel)
    elif isinstance(module, MoE) and sequence_parallel:
        module.sp_mesh = tp_mesh
    elif isinstance(module, Router):
        parallelize_module(module, tp_mesh, NoParallel())
    elif isinstance(module, Indexer):  # replicated; its KL target gathers the heads of every TP rank
        module.tp_mesh = tp_mesh
        module.sequence_parallel = sequence_parallel


def apply_tensor_parallel(
    model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False, shard_experts: bool = True
) -> None:
    """Shard ``model`` (a :class:`~lossparity.model.GPT`) over the 1-D ``tp_mesh`` in place (module
    docstring). Raises when head counts or hidden sizes do not divide by the TP size.

    ``sequence_parallel`` (Megatron SP): between the TP regions the residual stream, the norms and the
    routers hold this rank's contiguous slice of the sequence; attention and MLP inputs are all-gathered
    and their outputs reduce-scattered; MoE layers route their own slice, then gather tokens, gates and
    routing map for the TP-sharded experts and reduce-scatter the result (Megatron's all-gather token
    dispatcher). Parameters that stay replicated (norms, routers, embedding, MTP projections) then get
    TP-partial gradients, which the caller must sum over TP (the trainer does).

    ``shard_experts=False`` leaves the routed experts replicated over TP (expert tensor-parallel size 1),
    for expert parallelism to shard them instead (``model/expert_parallel.py``; not with SP).
    """
    if sequence_parallel and not shard_experts:
        raise ValueError("shard_experts=False is not combined with sequence parallelism")
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    row_out = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    _shard_head(model, tp_mesh)
    for module in model.modules():
        _parallelize_submodule(module, tp_mesh, sequence_parallel, shard_experts, row_out)
    if sequence_parallel:
        model.sp_mesh = tp_mesh
