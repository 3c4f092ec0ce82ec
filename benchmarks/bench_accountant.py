"""Accountant overhead, collectives per step, and how the bookkeeping grows with K and D.

Run: ``python -m benchmarks.bench_accountant [--quick] [--json PATH]``

1. Overhead: a training step of the reference model (``tiny`` and ``small`` presets, ``D=2`` gloo
   ranks, ``K=4``) with the :class:`Accountant` versus the same math written by hand (same pre-count
   all-reduce, same shares, same gradient all-reduce, one logging all-reduce). Steps alternate between
   the two variants so that machine noise hits both alike; medians over the repeats.
2. ``per_sample`` versus ``per_token`` step time with the accountant (same run).
3. Collectives per step issued by the accountant and their payload bytes, counted by wrapping
   ``torch.distributed.all_reduce`` (gradient reduction excluded: the hand-written step does it too).
4. Bookkeeping cost alone (no model: synthetic per-token losses) as a function of ``K`` and of the
   sequence count, to show it is linear in the obvious quantity.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._util import machine_info, markdown_table, write_json


def _model_and_batches(preset: str, rank: int, K: int, b: int, S: int):
    from lossparity.model import GPT, get_config
    from lossparity.training.trainer import LossForward

    torch.manual_seed(0)
    base = get_config(preset)
    cfg = get_config(preset, mtp_depths=0, n_dense_layers=base.n_layers)  # dense: isolate the LM loss path
    model = LossForward(GPT(cfg))
    g = torch.Generator().manual_seed(100 + rank)
    mbs = []
    for _ in range(K):
        tokens = torch.randint(3, cfg.vocab_size, (b, S), generator=g)
        lengths = torch.randint(S // 4, S + 1, (b,), generator=g)
        mask = (torch.arange(S)[None] < lengths[:, None]).float()
        labels = torch.where(mask > 0, torch.randint(3, cfg.vocab_size, (b, S), generator=g), -100)
        mbs.append((tokens, labels, mask))
    return model, mbs


def _forward(model, tokens, labels):
    seg = torch.ones_like(tokens)
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, labels, [], seg, pos)[0]


def _flat_allreduce(params) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def step_accountant(model, mbs, acc) -> None:
    acc.begin_step([m for _, _, m in mbs])
    for tokens, labels, mask in mbs:
        acc.lm_loss(_forward(model, tokens, labels), mask).backward()
    acc.finish_step(model)
    acc.logs()
    model.zero_grad(set_to_none=True)


def step_by_hand(model, mbs, mode: str) -> None:
    """The same objective and logs without the accountant: one count all-reduce, shares, gradient
    all-reduce, one logging all-reduce."""
    counts = torch.tensor(
        [sum(float(m.sum()) for _, _, m in mbs), float(sum(m.shape[0] for _, _, m in mbs))], dtype=torch.float64
    )
    dist.all_reduce(counts)
    ntok, nsamp = float(counts[0]), float(counts[1])
    logs = torch.zeros(3, dtype=torch.float64)
    for tokens, labels, mask in mbs:
        l = _forward(model, tokens, labels)
        s = (l * mask).sum(1)
        n = mask.sum(1)
        share = s.sum() / max(ntok, 1.0) if mode == "per_token" else (s / n.clamp(min=1)).sum() / nsamp
        share.backward()
        logs += torch.stack([s.sum().detach().double(), n.sum().double(), share.detach().double()])
    _flat_allreduce(model.parameters())
    dist.all_reduce(logs)
    model.zero_grad(set_to_none=True)


def _overhead_worker(rank: int, world: int, presets: list[str], K: int, b: int, S: int, repeats: int) -> dict[str, Any]:
    import lossparity as lp

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for preset in presets:
        model, mbs = _model_and_batches(preset, rank, K, b, S)
        for mode in ("per_token", "per_sample"):
            acc = lp.Accountant(mode, grad_reduction="allreduce")
            for _ in range(2):  # warm-up
                step_accountant(model, mbs, acc)
                step_by_hand(model, mbs, mode)
            t_acc, t_hand = [], []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                step_accountant(model, mbs, acc)
                t_acc.append(time.perf_counter() - t0)
                dist.barrier()
                t0 = time.perf_counter()
                step_by_hand(model, mbs, mode)
                t_hand.append(time.perf_counter() - t0)
            out[f"{preset}/{mode}"] = {
                "accountant_s": statistics.median(t_acc),
                "hand_s": statistics.median(t_hand),
                "accountant_min_s": min(t_acc),
                "hand_min_s": min(t_hand),
            }
        # collectives issued by the accountant (the gradient all-reduce excluded)
        calls: list[int] = []
        orig = dist.all_reduce
        import lossparity.distributed.accountant as A

        def counting(t, *a, _calls=calls, _orig=orig, **k):
            _calls.append(t.numel() * t.element_size())
            return _orig(t, *a, **k)

        acc = lp.Accountant("per_sample", grad_reduction="sum")
        A.dist.all_reduce = counting
        try:
            step_accountant(model, mbs, acc)
        finally:
            A.dist.all_reduce = orig
        out[f"{preset}/collectives"] = {"count": len(calls), "bytes": sum(calls)}
    return out


def bookkeeping_scaling(ks: list[int], b: int, S: int, repeats: int) -> list[dict[str, Any]]:
    """Accountant cost with synthetic losses (no model, one process): begin_step + K lm_loss + finish_step
    + logs."""
    import lossparity as lp

    rows = []
    for K in ks:
        masks = [torch.ones(b, S) for _ in range(K)]
        losses = [torch.rand(b, S, requires_grad=True) for _ in range(K)]
        times = []
        for _ in range(repeats):
            acc = lp.Accountant("per_sample")
            t0 = time.perf_counter()
            acc.begin_step(masks)
            for x, m in zip(losses, masks):
                acc.lm_loss(x, m)
            acc.finish_step()  # the protocol: logs() follows finish_step
            acc.logs()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rows.append({"K": K, "rows_per_mb": b, "median_s": med, "per_microbatch_us": med / K * 1e6})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lossparity.distributed.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    presets = ["tiny"] if args.quick else ["tiny", "small"]
    repeats = 5 if args.quick else 15
    K, b, S = 4, 4, 64
    res = spawn(_overhead_worker, 2, presets, K, b, S, repeats, timeout_s=600)[0]
    rows = []
    for preset in presets:
        for mode in ("per_token", "per_sample"):
            r = res[f"{preset}/{mode}"]
            rows.append(
                [
                    preset,
                    mode,
                    f"{r['hand_s'] * 1e3:.2f}",
                    f"{r['accountant_s'] * 1e3:.2f}",
                    f"{100 * (r['accountant_s'] / r['hand_s'] - 1):+.1f}%",
                ]
            )
    print(f"\n### Accountant overhead (D=2 gloo ranks, K={K}, b={b}, S={S}, medians of {repeats})\n")
    print(markdown_table(["preset", "mode", "by hand ms", "accountant ms", "overhead"], rows))
    ratio_rows = []
    for preset in presets:
        ratio = res[f"{preset}/per_sample"]["accountant_s"] / res[f"{preset}/per_token"]["accountant_s"]
        ratio_rows.append([preset, f"{ratio:.3f}"])
    print("\n### per_sample / per_token step time (accountant)\n")
    print(markdown_table(["preset", "ratio"], ratio_rows))
    print("\n### Collectives per step issued by the accountant (gradient reduction excluded)\n")
    coll = [[p_, res[f"{p_}/collectives"]["count"], res[f"{p_}/collectives"]["bytes"]] for p_ in presets]
    print(markdown_table(["preset", "all-reduces", "bytes"], coll))
    scaling = bookkeeping_scaling([1, 4, 16] if args.quick else [1, 4, 16, 64], b, S, repeats)
    print("\n### Bookkeeping alone (synthetic losses, one process) versus K\n")
    print(
        markdown_table(
            ["K", "median ms", "per microbatch µs"],
            [[r["K"], f"{r['median_s'] * 1e3:.2f}", f"{r['per_microbatch_us']:.0f}"] for r in scaling],
        )
    )
    payload = {
        "machine": machine_info(torch.device("cpu")),
        "overhead": res,
        "scaling": scaling,
        "settings": {"K": K, "b": b, "S": S, "repeats": repeats, "presets": presets},
    }
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
