"""How much MindFormers' routing and aux-count conventions change the numbers (a measurement, not a test;
docs/moe.md shows its output).

    python scripts/moe_mindformers_conventions.py [--tokens 100000] [--seed 0]

On random router logits (standard normal ×1.5, E=8 experts, k=2, G=4 groups, g=2 kept groups, an expert bias
of standard deviation 0.1 where said), with the public calls of ``lossparity.moe``:

1. group-limited routing: the share of tokens whose selected experts differ between the default
   (a group scored by its ``k//g`` best, Megatron and MindFormers graph mode) and ``group_score_topk=2``
   (MindFormers pynative, DeepSeek-V3 with a bias), and between the ``-inf`` fill and graph mode's ``0.0``;
2. graph mode's aux counts: the relative difference of the Switch loss (α = 1) of one microbatch counted on
   the dispatch map (bias included) rather than on the plain top-k.
"""

from __future__ import annotations

import argparse

import torch

from lossparity import moe

E, K, G, GTOP = 8, 2, 4, 2


def _differ(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).any(dim=-1).double().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    logits = torch.randn(args.tokens, E, generator=g) * 1.5
    bias = torch.randn(E, generator=g) * 0.1
    groups = {"num_groups": G, "group_topk": GTOP}
    print(f"tokens={args.tokens} seed={args.seed} E={E} k={K} G={G} g={GTOP}")
    print("score    bias  default vs group_score_topk=2  -inf vs 0.0 fill  aux dispatch/top-k - 1")
    for fn in ("softmax", "sigmoid"):
        scores, probs = moe.router_scores(logits, fn)
        for b in (None, bias):
            _, base = moe.topk_routing(scores, K, expert_bias=b, **groups)
            _, top2 = moe.topk_routing(scores, K, expert_bias=b, group_score_topk=2, **groups)
            _, zero = moe.topk_routing(scores, K, expert_bias=b, group_fill=0.0, **groups)
            plain = moe.aux_routing_map(scores, K)
            disp = moe.aux_routing_map(scores, K, counts="dispatch", expert_bias=b)
            a_plain = moe.switch_load_balancing_loss(probs, moe.tokens_per_expert(plain), args.tokens, K, E, 1.0)
            a_disp = moe.switch_load_balancing_loss(probs, moe.tokens_per_expert(disp), args.tokens, K, E, 1.0)
            print(
                f"{fn:8s} {'yes' if b is not None else 'no':4s}  {_differ(base, top2):28.2%}  "
                f"{_differ(base, zero):16.2%}  {(a_disp / a_plain - 1).item():+.2e}"
            )


if __name__ == "__main__":
    main()
