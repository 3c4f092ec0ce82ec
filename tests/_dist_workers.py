"""Worker functions run on spawned gloo ranks by the multi-process tests (must be importable)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _models import TinyLM, global_batch

import lossparity as lp

MODES_B = {"per_microbatch": 1}  # per_microbatch is compared at fixed b


def run_layout(rank: int, world: int, n_rows: int, ks: list[int], configs: list[tuple[str, str, str]]):
    """For each K in ``ks`` and each (mode, engine, normalization) in ``configs``: one step of TinyLM on
    this rank's rows, return {(mode, engine, norm, K): (grads, logs, returned_sum)}.

    engine: "plain" (accountant all-reduces the grads) or "ddp" (DistributedDataParallel averages).
    """
    tokens, labels, mask, seg = global_batch(n_rows)
    out = {}
    for K in ks:
        per_rank = n_rows // world
        b = per_rank // K
        lo = rank * per_rank
        mbs = [slice(lo + k * b, lo + (k + 1) * b) for k in range(K)]
        for mode, engine, norm in configs:
            model = TinyLM()
            net = nn_ddp(model) if engine == "ddp" else model
            acc = lp.Accountant(mode, normalization=norm, fixed_length=tokens.shape[1])
            acc.begin_step([mask[m] for m in mbs], [seg[m] for m in mbs])
            returned = 0.0
            for i, m in enumerate(mbs):
                sync = engine != "ddp" or i == K - 1
                ctx = net.no_sync() if not sync else _null()
                with ctx:
                    loss = acc.lm_loss(net(tokens[m], labels[m]), mask[m], seg[m])
                    loss.backward()
                returned += float(loss)
            acc.finish_step(net)
            logs = acc.logs()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            out[(mode, engine, norm, K)] = (grads, logs, returned)
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def nn_ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def count_collectives(rank: int, world: int):
    """Count the collectives the accountant issues in one precount step with K=4 (expect 2 + grads)."""
    calls = []
    orig = dist.all_reduce

    def counting(t, *a, **k):
        calls.append(t.numel())
        return orig(t, *a, **k)

    dist.all_reduce = counting
    import lossparity.distributed.accountant as A

    A.dist.all_reduce = counting
    try:
        tokens, labels, mask, seg = global_batch(8 * world)
        lo = rank * 8
        model = TinyLM()
        acc = lp.Accountant("per_sample", grad_reduction="sum")
        mbs = [slice(lo + 2 * k, lo + 2 * k + 2) for k in range(4)]
        acc.begin_step([mask[m] for m in mbs])
        for m in mbs:
            acc.lm_loss(model(tokens[m], labels[m]), mask[m]).backward()
        acc.finish_step(model)
        acc.logs()
    finally:
        dist.all_reduce = orig
        A.dist.all_reduce = orig
    return calls


def bad_mask_on_rank1(rank: int, world: int):
    """Rank 1 passes a mask with a 2 in it: its error must name rank and microbatch; rank 0 must not hang."""
    mask = torch.ones(2, 4)
    if rank == 1:
        mask[1, 2] = 2.0
    acc = lp.Accountant("per_token")
    try:
        acc.begin_step([torch.ones(2, 4), mask])
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def run_cp_layout(rank: int, world: int, dp: int, cp: int, n_rows: int, modes: list[str], zigzag: bool):
    """Context parallelism at the accountant level: mesh (dp, cp); every rank holds whole rows of its DP rank
    (K=2 microbatches) and back-propagates only its columns (zig-zag or contiguous shards), main loss + 1 MTP
    depth rolled on whole rows. Returns {mode: (grads, logs)}."""
    from torch.distributed.device_mesh import init_device_mesh

    from lossparity.losses.mtp import roll_mtp

    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    d, c = mesh.get_coordinate()
    tokens, labels, mask, seg = global_batch(n_rows)
    S = tokens.shape[1]
    if zigzag:
        chunks = torch.arange(S).tensor_split(2 * cp)
        columns = torch.cat([chunks[c], chunks[2 * cp - 1 - c]])
    else:
        columns = torch.arange(S).tensor_split(cp)[c]
    per_rank = n_rows // dp
    K = 2
    b = per_rank // K
    mbs = [slice(d * per_rank + k * b, d * per_rank + (k + 1) * b) for k in range(K)]
    out = {}
    for mode in modes:
        model = TinyLM()
        acc = lp.Accountant(mode, mesh=mesh, fixed_length=S, mtp_depths=1, grad_reduction="allreduce")
        acc.begin_step([mask[m] for m in mbs], [seg[m] for m in mbs], mtp_weight=0.5)
        for m in mbs:
            lab1, w1 = roll_mtp(labels[m], mask[m], seg[m], 1)
            full = model(tokens[m], labels[m])
            full1 = model(tokens[m], lab1)
            loss = acc.lm_loss(full[:, columns], mask[m][:, columns], seg[m][:, columns], columns=columns)
            loss = loss + acc.mtp_loss([full1[:, columns]], [w1[:, columns]], seg[m][:, columns], columns=columns)
            loss.backward()
        acc.finish_step(model)
        out[mode] = ({n: p.grad.clone() for n, p in model.named_parameters()}, acc.logs())
    return out


def run_fsdp(rank: int, world: int, n_rows: int, modes: list[str]):
    """FSDP2 (fully_shard) with K=2 microbatches per rank: the accountant multiplies the averaged, sharded
    gradients by D. Returns {mode: (full grads, logs)}."""
    from torch.distributed.fsdp import fully_shard

    tokens, labels, mask, seg = global_batch(n_rows)
    per_rank = n_rows // world
    b = per_rank // 2
    mbs = [slice(rank * per_rank + k * b, rank * per_rank + (k + 1) * b) for k in range(2)]
    out = {}
    for mode in modes:
        model = TinyLM()
        fully_shard(model)
        acc = lp.Accountant(mode, fixed_length=tokens.shape[1])
        acc.begin_step([mask[m] for m in mbs], [seg[m] for m in mbs])
        for m in mbs:
            acc.lm_loss(model(tokens[m], labels[m]), mask[m], seg[m]).backward()
        factor = acc.finish_step(model)
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        out[mode] = (grads, acc.logs(), factor)
    return out


def vocab_parallel_ce(rank: int, world: int):
    """Each rank holds a vocabulary slice of the head; returns losses and gradients (hidden, local weight)."""
    from lossparity.losses.cross_entropy import chunked_cross_entropy

    g = torch.Generator().manual_seed(5)
    T, V, H = 37, 50, 8
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::5] = -100
    upstream = torch.rand(T, generator=g, dtype=torch.float64)
    rows = V // world
    lo = rank * rows
    h = hidden.clone().requires_grad_()
    w = weight[lo : lo + rows].clone().requires_grad_()
    loss = chunked_cross_entropy(
        h,
        w,
        labels,
        chunk_size=8,
        vocab_chunk_size=7,
        z_loss_coeff=1e-2,
        vocab_parallel_group=dist.group.WORLD,
        vocab_start=lo,
        vocab_size=V,
    )
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad, (hidden, weight, labels, upstream, lo, rows)


def mismatched_ranks(rank: int, world: int):
    """Four bad-input scenarios on one process group; every rank returns its error messages: different
    modes, different MTP depths (count buffers of different lengths without the fixed layout), a NumPy
    mask on rank 1 (an exception other than ValueError before the collective), no mask at all on rank 1."""
    import numpy as np

    out = []
    scenarios = [
        (dict(mode="per_token" if rank == 0 else "per_sample"), [torch.ones(2, 4)]),
        (dict(mode="per_token", mtp_depths=rank), [torch.ones(2, 4)]),
        (dict(mode="per_token"), [torch.ones(2, 4), np.ones((2, 4)) if rank == 1 else torch.ones(2, 4)]),
        (dict(mode="per_token"), [] if rank == 1 else [torch.ones(2, 4)]),
    ]
    for kwargs, masks in scenarios:
        acc = lp.Accountant(**kwargs)
        try:
            acc.begin_step(masks)
            out.append("no error")
        except (ValueError, TypeError, RuntimeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def nan_on_rank1(rank: int, world: int):
    """Rank 1's second microbatch has a NaN loss: logs() raises on both ranks (device flag, no hang)."""
    acc = lp.Accountant("per_token", grad_reduction="sum")
    acc.begin_step([torch.ones(1, 3), torch.ones(1, 3)])
    acc.lm_loss(torch.ones(1, 3), torch.ones(1, 3))
    bad = torch.tensor([[1.0, float("nan") if rank == 1 else 1.0, 1.0]])
    acc.lm_loss(bad, torch.ones(1, 3))
    acc.finish_step()
    try:
        acc.logs()
    except (FloatingPointError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def cp_peers_with_different_settings(rank: int, world: int):
    """Two context-parallel peers (dp=1, cp=2: not compared by the data-parallel pre-count) built with
    different MTP conventions: logs() raises the same message on both."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    acc = lp.Accountant("per_token", mesh=mesh, mtp_depths=1, mtp_convention="own" if rank == 0 else "main")
    mask = torch.ones(1, 4)
    columns = torch.arange(4).tensor_split(world)[rank]
    acc.begin_step([mask])
    acc.lm_loss(torch.ones(1, 4)[:, columns], mask[:, columns], columns=columns)
    acc.mtp_loss([torch.ones(1, 4)[:, columns]], [mask[:, columns]], columns=columns)
    acc.finish_step()
    try:
        acc.logs()
    except ValueError as e:
        return str(e)
    return "no error"
