"""torchtitan's real ``Trainer.train_step`` driven on CPU around a tiny float64 model.

The Trainer object is made without its ``__init__`` (which builds a model from a registry, tokenizer,
dataloader and checkpointer): the attributes ``train_step`` reads are set by hand. The stand-ins are the
optimizer (``step`` sums the gradients over the data-parallel group, as torchtitan's FSDP does with its
gradient divide factor set to 1, then keeps them), the LR scheduler, checkpointer and metrics processor
(no logging step). Everything between fetching the batches and the optimizer step is torchtitan's code:
``global_valid_tokens``, ``forward_backward_step``, ``post_dataloading_process``, the loss call with
``positions``, backward and gradient clipping.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

V, S, H = 11, 10, 6


class TinyLM(nn.Module):
    """Token-local (no attention): a context-parallel shard needs nothing from the other shards."""

    def __init__(self, seq: int = S):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.emb = nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64))
        self.out = nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5)
        self.pos = nn.Parameter(torch.randn(seq, H, generator=g, dtype=torch.float64) / 4)

    def forward(self, tokens, positions=None):
        h = self.emb[tokens] + (self.pos[positions] if positions is not None else 0)
        return torch.tanh(h) @ self.out.T


class TinyHeadLM(TinyLM):
    """TinyLM with its output layer as an ``nn.Linear`` (the same weights), which tensor parallelism can shard
    on the vocabulary (loss parallel: the logits a DTensor with placements ``(Shard(-1),)``)."""

    def __init__(self, seq: int = S):
        super().__init__(seq)
        self.head = nn.Linear(H, V, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.head.weight.copy_(self.out)
        del self.out

    def forward(self, tokens, positions=None):
        # under TP the other parameters are replicated DTensors (torchtitan's clip_grad_norm_ needs one kind)
        emb, pos = (p.to_local() if hasattr(p, "to_local") else p for p in (self.emb, self.pos))
        h = emb[tokens] + (pos[positions] if positions is not None else 0)
        return self.head(torch.tanh(h))


def global_batch(n_rows: int, seq: int = S):
    """Tokens, labels (-100 = ignored; ragged, row 1 has none) and per-document positions (1-3 docs)."""
    S = seq  # noqa: N806 (the module's row length unless told)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (n_rows, S), generator=g)
    labels = torch.randint(0, V, (n_rows, S), generator=g)
    keep = torch.rand(n_rows, S, generator=g) < 0.7
    keep[1] = False
    labels = torch.where(keep, labels, -100)
    positions = torch.zeros(n_rows, S, dtype=torch.long)
    for i in range(n_rows):
        cuts = sorted(set(torch.randint(1, S, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist()))
        for a, b in zip([0] + cuts, cuts + [S]):
            positions[i, a:b] = torch.arange(b - a)
    return tokens, labels, positions


class _Optim:
    def __init__(self, model, group):
        self.model, self.group, self.grads = model, group, None

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=True)

    def step(self):
        for p in self.model.parameters():
            if self.group is not None:
                dist.all_reduce(p.grad, group=self.group)
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}


def titan_step(
    mode: str, rows: slice, ga: int, mesh=None, cls=None, install=None, cp_mesh=None, seq: int = S, tp_mesh=None
):
    """One torchtitan ``train_step`` over ``rows`` of the global batch cut into ``ga`` microbatches.
    ``cls``: the trainer class (default: LossParityTitanMixin + Trainer); ``install(trainer, mode)`` sets
    its loss (default: ``trainer.loss_fn = LossParityLoss(mode)``). ``cp_mesh``: a 1-D ``cp`` mesh, torchtitan's
    context parallelism (its ``prepare_context_parallel_input``, head-tail load balancing) over rows of ``seq``.
    ``tp_mesh``: a 1-D ``tp`` mesh; the output layer is sharded on the vocabulary (torch's ``ColwiseParallel``
    with DTensor output: loss parallel) and its gradient returned whole, under TinyLM's name."""
    from torchtitan.trainer import Trainer

    from lossparity.integrations.torchtitan import LossParityLoss, LossParityTitanMixin

    class T(LossParityTitanMixin, Trainer):
        pass

    T = cls or T

    tokens, labels, positions = global_batch(16, seq)
    tokens, labels, positions = tokens[rows], labels[rows], positions[rows]
    model = TinyLM(seq)
    if tp_mesh is not None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        model = TinyHeadLM(seq)
        parallelize_module(model, tp_mesh, {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        model.emb = nn.Parameter(distribute_tensor(model.emb.detach(), tp_mesh, [Replicate()]))
        model.pos = nn.Parameter(distribute_tensor(model.pos.detach(), tp_mesh, [Replicate()]))
    t = object.__new__(T)
    # gradients summed over the data-parallel ranks, and over the context-parallel ones (FSDP's dp_shard_cp)
    group = mesh.get_group() if mesh is not None else cp_mesh.get_group() if cp_mesh is not None else None
    t.config = SimpleNamespace(
        training=SimpleNamespace(disable_cuda_graphs=False, max_norm=1e6),
        parallelism=SimpleNamespace(
            spmd_backend="none", context_parallel_load_balancer="headtail", context_parallel_ptrr_mask_key=None
        ),
    )
    t.parallel_dims = SimpleNamespace(
        dp_enabled=mesh is not None,
        pp_enabled=False,
        cp_enabled=cp_mesh is not None,
        ep_enabled=False,
        dp_cp_enabled=mesh is not None or cp_mesh is not None,
        get_mesh=lambda name: cp_mesh if name == "cp" else mesh,
        get_optional_mesh=lambda name: None,
    )
    t.model_parts, t.model_config, t.device, t.step, t.ntokens_seen = [model], SimpleNamespace(), "cpu", 1, 0
    t.gradient_accumulation_steps, t.num_pipeline_parallel_microbatches = ga, 1
    t.optimizers = _Optim(model, group)
    t.lr_schedulers = SimpleNamespace(get_metrics=lambda: {}, step=lambda: None)
    t.metrics_processor = SimpleNamespace(should_log=lambda step: False)
    t.checkpointer = SimpleNamespace(maybe_wait_for_staging=lambda: None)
    t.train_context = contextlib.nullcontext
    t.fwd_bwd_fn = t._forward_backward_body
    if install is None:
        t.loss_fn = LossParityLoss(mode)
    else:
        install(t, mode)
    b = tokens.shape[0] // ga
    data = iter(
        [
            (
                {"input": tokens[k * b : (k + 1) * b], "positions": positions[k * b : (k + 1) * b]},
                labels[k * b : (k + 1) * b],
            )
            for k in range(ga)
        ]
    )
    t.train_step(data)
    grads = t.optimizers.grads
    if tp_mesh is not None:
        grads = {
            ("out" if n == "head.weight" else n): getattr(g, "full_tensor", lambda g=g: g)() for n, g in grads.items()
        }
    return grads


def run_titan(rank: int, world: int, modes: list[str]):
    """Every mode on 2 ranks × GA 2 × b 4 (rank r holds rows [8r, 8r+8)) over a 1-D ``batch`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("batch",))
    per = 16 // world
    return {m: titan_step(m, slice(rank * per, (rank + 1) * per), 2, mesh) for m in modes}


def run_titan_cp(rank: int, world: int, modes: list[str], seq: int):
    """Every mode with context parallelism 2 × GA 4 × b 4 (each CP rank holds every row, its half of each
    row as torchtitan's head-tail sharding places it) over a 1-D ``cp`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return {m: titan_step(m, slice(0, 16), 4, cp_mesh=cp_mesh, seq=seq) for m in modes}


def run_titan_tp(rank: int, world: int, modes: list[str]):
    """Every mode with the logits sharded on the vocabulary over a 1-D ``tp`` mesh (loss parallel), GA 4."""
    from torch.distributed.device_mesh import init_device_mesh

    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return {m: titan_step(m, slice(0, 16), 4, tp_mesh=tp_mesh) for m in modes}
