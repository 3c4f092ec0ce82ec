"""Expert parallelism (EP): the routed experts of an MoE layer sharded over the ``ep`` ranks.

``ExpertParallel`` is a ``ParallelStyle`` for :class:`~lossparity.model.moe.GroupedExperts`. Applied with a
1-D ``DeviceMesh`` of ``ep`` ranks (ranks that hold *distinct tokens*: carved out of DP × CP), it

- shards the stacked expert weights on their expert dimension (``DTensor``, ``Shard(0)``): EP rank ``r``
  holds experts ``r·E/ep .. (r+1)·E/ep − 1``;
- dispatches tokens (forward pre-hook): every (token, expert) pair of the routing map is sent to the
  rank owning the expert with one all-to-all (``all_to_all_single_autograd``: its backward is the
  reverse all-to-all), after exchanging the per-expert counts (the split sizes);
- computes the local experts on the received rows (the module's own forward, with a one-hot routing map
  and unit gates: each received row is one pair);
- combines (forward hook): the expert outputs go back with the reverse all-to-all, and the origin rank
  forms ``out[t] = Σ_e gates[t, e] · y[t, e]``, adding the experts in increasing ``e`` with one
  ``index_add_`` per expert (distinct indices), exactly as the single-process layer does.

The router, its gates and its dispatch counts are untouched: EP only moves the expert computation, so
router counts, the aux losses and the expert bias stay those of the token group (semantics §5). The
gates multiply the expert outputs on the origin rank, so their gradient never crosses ranks.

Gradients. The gradient of an expert shard on EP rank ``r`` is the sum over the tokens of the whole EP
group that were dispatched to it, i.e. already summed over EP. Ranks with the same EP coordinate
(the expert-data-parallel group, ``edp``) hold copies of the same experts and see different tokens:
:func:`reduce_expert_grads` sums them over ``edp``. Expert gradients must never be reduced over the EP
dimension (that would add other experts' gradients, or count the same tokens twice).

Host synchronization: the all-to-all split sizes must be known on the host, so each MoE forward reads
the ``2E`` sent/received per-expert counts once (one ``Tensor.tolist``), as torchtitan and Megatron's
all-to-all dispatcher do; the (token, expert) index lists come from ``nonzero`` like in the
single-process expert loop. Nothing else leaves the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from ..distributed.collectives import all_reduce_coalesced
from .moe import GroupedExperts

__all__ = ["ExpertParallel", "apply_expert_parallel", "ep_mesh", "expert_parameters", "reduce_expert_grads"]

_WEIGHTS = ("w1", "w3", "w2")


class _Route:
    """The bookkeeping of one dispatch, needed by the matching combine."""

    def __init__(
        self, tokens: Tensor, gates: Tensor, counts: list[int], send: list[int], recv: list[int], num_tokens: int
    ) -> None:
        self.tokens, self.gates, self.counts = tokens, gates, counts
        self.send, self.recv, self.num_tokens = send, recv, num_tokens


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """All-to-all of the rows of ``x`` (``in_splits[j]`` rows go to rank ``j``) with autograd; returns the
    ``sum(out_splits)`` received rows, rank-major."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    out = all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return wait_tensor(out)


def _exchange_counts(counts: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``recv[j, l]`` = number of rows EP rank ``j`` sends to this rank's local expert ``l``
    (``counts [E]`` = this rank's per-expert counts, expert-major over the ranks)."""
    from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

    return wait_tensor(all_to_all_single(counts.contiguous(), None, None, group))


class ExpertParallel(ParallelStyle):
    """``ParallelStyle`` sharding a :class:`~lossparity.model.moe.GroupedExperts` over a 1-D EP mesh (module
    docstring). The module keeps its signature ``(x [T, dim], gates [T, E], dispatch_map [T, E]) -> [T, dim]``
    with the *global* ``E``; inside, it computes only its ``E/ep`` local experts."""

    def __init__(self) -> None:
        self._route: _Route | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        _check_shardable(module, device_mesh)
        # torch's stub types input_fn/output_fn as returning None, but distribute_module uses what they
        # return as the module's new inputs/outputs (as its docstring says): the stub is wrong.
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_partition,
            input_fn=self._dispatch,  # type: ignore[arg-type]
            output_fn=self._combine,  # type: ignore[arg-type]
        )

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[Tensor, Tensor, Tensor]:
        """Forward pre-hook: send every (token, expert) pair to the expert's rank; return the received
        rows with a one-hot local routing map and unit gates."""
        x, gates, dispatch_map = inputs[:3]  # a 4th input, topk, does not apply to the one-hot local map
        T, E = dispatch_map.shape
        ep = mesh.size()
        group = mesh.get_group()
        pairs = dispatch_map.t().nonzero()  # (e, t), expert-major: destination-rank-major too
        counts = dispatch_map.sum(dim=0)
        recv_counts = _exchange_counts(counts, group)
        host = torch.cat([counts, recv_counts]).tolist()  # the host read of the layer: the split sizes
        per_expert, recv_host = host[:E], host[E:]
        local = E // ep
        send = [sum(per_expert[j * local : (j + 1) * local]) for j in range(ep)]
        recv = [sum(recv_host[j * local : (j + 1) * local]) for j in range(ep)]
        self._route = _Route(pairs[:, 1], gates, per_expert, send, recv, T)
        rows = _all_to_all(x.index_select(0, pairs[:, 1]), recv, send, group)
        # Received rows are source-rank-major, then local-expert-major: their local expert index.
        expert_of_row = (
            torch.arange(local, device=x.device)
            .repeat(ep)
            .repeat_interleave(recv_counts.to(device=x.device, dtype=torch.long), output_size=sum(recv))
        )
        onehot = nn.functional.one_hot(expert_of_row, local).to(torch.bool)
        return rows, onehot.to(rows.dtype), onehot

    def _combine(self, module: nn.Module, outputs: Tensor, mesh: DeviceMesh) -> Tensor:
        """Forward hook: bring the expert outputs back and form ``Σ_e gates[t, e] · y[t, e]`` in
        increasing ``e`` (the single-process order)."""
        route = self._route
        if route is None:
            raise RuntimeError("ExpertParallel: combine without a matching dispatch (forward hooks out of order)")
        self._route = None
        back = _all_to_all(outputs, route.send, route.recv, mesh.get_group())
        out = outputs.new_zeros(route.num_tokens, outputs.shape[1])
        start = 0
        for e, n in enumerate(route.counts):
            idx = route.tokens[start : start + n]
            ge = route.gates[:, e].index_select(0, idx).unsqueeze(1).to(out.dtype)
            out.index_add_(0, idx, back[start : start + n].to(out.dtype) * ge)
            start += n
        return out


def _check_shardable(module: nn.Module, mesh: DeviceMesh) -> None:
    """Raise ``ValueError`` when ``module`` is not a stack of experts divisible over ``mesh``."""
    if getattr(mesh, "ndim", 1) != 1:
        raise ValueError(f"ExpertParallel needs a 1-D expert-parallel mesh, got {mesh.ndim} dimensions")
    missing = [n for n in _WEIGHTS if not isinstance(getattr(module, n, None), nn.Parameter)]
    if missing:
        raise ValueError(
            f"ExpertParallel applies to GroupedExperts (parameters {_WEIGHTS}); {type(module).__name__} lacks {missing}"
        )
    if any(hasattr(getattr(module, n), "to_local") for n in _WEIGHTS):
        raise ValueError(
            "ExpertParallel: the experts are already sharded (tensor parallelism is not combined "
            "with expert parallelism)"
        )
    num = cast(nn.Parameter, module.w1).shape[0]  # checked above: a Parameter
    if num % mesh.size():
        raise ValueError(f"ep={mesh.size()} must divide the number of routed experts num_experts={num}")


def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Shard the expert weights of ``module`` (not of its children) on their expert dimension."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for pname, p in list(module.named_parameters(recurse=False)):
        if pname in _WEIGHTS:
            sharded = distribute_tensor(p.detach(), mesh, [Shard(0)])
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=p.requires_grad))


def ep_mesh(ep_group: dist.ProcessGroup, device_type: str = "cpu") -> DeviceMesh:
    """The 1-D ``DeviceMesh`` (dimension ``ep``) of the expert-parallel process group ``ep_group``."""
    return DeviceMesh.from_group(ep_group, device_type, mesh_dim_names=("ep",))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[GroupedExperts]:
    """Apply :class:`ExpertParallel` to every ``GroupedExperts`` of ``model`` over the 1-D ``ep_mesh`` (a
    ``DeviceMesh`` of ranks holding distinct tokens). Every rank must hold identical expert weights
    before the call (same seed); afterwards rank ``r`` of ``ep_mesh`` keeps experts ``r·E/ep ..``.
    Returns the sharded modules. ``ep_mesh.size() == 1``: nothing changes."""
    from torch.distributed.tensor.parallel import parallelize_module

    if ep_mesh.size() == 1:
        return []
    mods = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in mods:
        parallelize_module(m, ep_mesh, ExpertParallel())
    return mods


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters sharded by :class:`ExpertParallel` (``DTensor`` with a ``Shard(0)`` placement on an
    expert mesh), in ``model.parameters()`` order."""
    out: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            out.extend(p for n, p in m.named_parameters(recurse=False) if n in _WEIGHTS and _ep_sharded(p))
    return out


def _ep_sharded(p: Tensor) -> bool:
    placements = getattr(p, "placements", None)
    return placements is not None and len(placements) == 1 and placements[0].is_shard(0)


def reduce_expert_grads(params: Iterable[nn.Parameter], edp_group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the expert shards ``params`` over the expert-data-parallel group ``edp_group``
    (ranks with the same EP coordinate: copies of the same experts, different tokens), in place, with one
    all-reduce: ``g ← Σ_{r ∈ edp} g_r``. A shard without a gradient (no token reached its experts on
    this rank) contributes zeros. ``None`` or a group of one rank: nothing to do."""
    params = list(params)
    if edp_group is None or dist.get_world_size(edp_group) == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    from torch.distributed.tensor import DTensor

    grads = [cast(Tensor, p.grad) for p in params]  # every one set just above
    all_reduce_coalesced([g.to_local() if isinstance(g, DTensor) else g for g in grads], edp_group)
