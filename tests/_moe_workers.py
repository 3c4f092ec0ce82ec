"""Synthetic router records and one-rank training-step flows for the MoEAccounting tests.

Importable by the spawned gloo ranks (module-level functions only). The router logits of every MoE layer
are one float64 leaf ``[L, N, S, E]`` per step: each microbatch's records are views of its rows, so the
gradient of the auxiliary objective w.r.t. the leaf can be compared with a naive float64 computation.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lossparity.distributed.accountant import Accountant
from lossparity.distributed.moe.accounting import MoEAccounting
from lossparity.losses.moe import router_probs, topk_routing_map

E, TOPK, S_LEN, L = 4, 2, 5, 3
BIAS_RATE = 0.1


def make_batch(
    n_rows: int, steps: int = 2, seed: int = 0, hollow: bool = False, zero_mb: int | None = None, b: int | None = None
):
    """``(logits per step [L, N, S, E] float64, valid [N, S] bool, lm_mask [N, S] float64, bias [L, E])``.

    Rows have uneven lengths and row 1 is all padding; the LM mask drops the last valid position of each
    row (as a label shift does), so the LM token count differs from the router token count. ``hollow``
    makes the second half of the rows all padding; ``zero_mb`` (with ``b``) empties that microbatch."""
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(L, n_rows, S_LEN, E, generator=g, dtype=torch.float64) * 1.5 for _ in range(steps)]
    lengths = torch.randint(1, S_LEN + 1, (n_rows,), generator=g)
    lengths[1] = 0
    if hollow:
        lengths[n_rows // 2 :] = 0
    if zero_mb is not None:
        lengths[zero_mb * b : (zero_mb + 1) * b] = 0
    pos = torch.arange(S_LEN)[None, :]
    valid = pos < lengths[:, None]
    lm_mask = (pos < (lengths[:, None] - 1)).to(torch.float64)
    bias = torch.randn(L, E, generator=g, dtype=torch.float64) * 0.3
    return logits, valid, lm_mask, bias


class FakeRouter:
    """What ``MoEAccounting.end_step`` reads of a router: dispatch counts, expert bias, reset."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id
        self.tokens_per_expert = torch.zeros(E, dtype=torch.float64)
        self.expert_bias = torch.zeros(E, dtype=torch.float32)

    def reset_counts(self) -> None:
        self.tokens_per_expert.zero_()


def records_for(leaf: torch.Tensor, rows: slice, bias: torch.Tensor, score: str = "softmax") -> list:
    """Router records of the microbatch ``rows``: views of the leaf, plain top-k and biased dispatch."""
    recs = []
    for layer in range(leaf.shape[0]):
        lg = leaf[layer, rows].reshape(-1, E)
        p = router_probs(lg, score)
        recs.append(
            SimpleNamespace(
                logits=lg,
                probs=p,
                topk_map=topk_routing_map(p, TOPK),
                dispatch_map=topk_routing_map(p.detach() + bias[layer], TOPK),
            )
        )
    return recs


def microbatches(n_rows: int, world: int, rank: int, k: int) -> list[slice]:
    """Rank ``rank``'s ``k`` microbatches: contiguous rows, rank-major (row order = global order)."""
    per_rank = n_rows // world
    b = per_rank // k
    lo = rank * per_rank
    return [slice(lo + m * b, lo + (m + 1) * b) for m in range(k)]


def run_rank(batch, mbs: list[slice], cfg: dict, steps: int = 1) -> list[dict]:
    """One rank's steps with the accountant flow: ``begin_step`` (router tokens as extra counts), per
    microbatch ``lm_loss`` (zero per-token loss) + ``microbatch_loss``, backward, ``finish_step``,
    ``end_step`` (expert bias), ``logs``. Returns per step the leaf's gradient, logs, sum of the returned
    shares, expert biases, max_vio."""
    logits, valid, lm_mask, bias = batch
    cfg = dict(cfg)
    normalization = cfg.pop("normalization", "precount")
    score = cfg.pop("score", "softmax")
    acc = Accountant("per_token", normalization=normalization, grad_reduction="sum")
    moe = MoEAccounting(acc, L, E, TOPK, **cfg)
    routers = [FakeRouter(i) for i in range(moe.num_slots)]
    out = []
    for step in range(steps):
        leaf = logits[step].clone().requires_grad_(True)
        valids = [valid[m] for m in mbs]
        acc.begin_step([lm_mask[m] for m in mbs], extra_counts=MoEAccounting.router_tokens(valids))
        returned = 0.0
        for m in mbs:
            recs = records_for(leaf, m, bias, score)
            zeros = torch.zeros(lm_mask[m].shape, dtype=torch.float64)
            loss = acc.lm_loss(zeros, lm_mask[m]) + moe.microbatch_loss(recs, valid[m])
            if loss.requires_grad:
                loss.backward()
            returned += float(loss.detach())
            v = valid[m].reshape(-1, 1)
            for i, r in enumerate(recs):
                routers[min(i, moe.num_slots - 1)].tokens_per_expert += (r.dispatch_map & v).sum(0).double()
        acc.finish_step([leaf])
        vio = moe.end_step(routers, bias_rate=BIAS_RATE)
        logs = acc.logs()
        grad = leaf.grad.clone() if leaf.grad is not None else torch.zeros_like(leaf)
        out.append(
            {
                "grad": grad,
                "logs": logs,
                "returned": returned,
                "vio": vio,
                "bias": torch.stack([r.expert_bias.clone() for r in routers]),
            }
        )
    return out


def layout_worker(
    rank: int, world: int, n_rows: int, jobs: list[tuple[str, bool, list[int], dict[str, dict]]], steps: int = 2
) -> dict:
    """For each job ``(tag, hollow, ks, configs)``, each K in ``ks`` and each named config: this rank's
    ``run_rank`` results under the key ``(tag, name, K)`` (one spawn serves several batches)."""
    res = {}
    for tag, hollow, ks, configs in jobs:
        batch = make_batch(n_rows, steps=steps, hollow=hollow)
        for k in ks:
            for name, cfg in configs.items():
                res[(tag, name, k)] = run_rank(batch, microbatches(n_rows, world, rank, k), cfg, steps=steps)
    return res
