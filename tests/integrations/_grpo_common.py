"""TRL ``GRPOTrainer`` runs for the RL tests (CPU, offline): the word-level tokenizer and tiny Llama of the
TRL tests, prompts of one length (left padding then moves no position), and a deterministic ``rollout_func``
(TRL's own hook) so that every layout trains on the same completions; a reward that prefers short completions."""

from __future__ import annotations

import torch
from _hf_common import VOCAB, common_args, tiny_model
from _trl_common import tokenizer

NUM_GENERATIONS = 4
MAX_COMPLETION = 8


def prompts(n: int = 8) -> list[dict[str, str]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"prompt": " ".join(f"w{int(x)}" for x in torch.randint(1, VOCAB - 1, (4,), generator=g))} for _ in range(n)
    ]


def rollout(prompt_list: list[str], trainer) -> dict:
    """Completions that depend only on the prompt and the row's place in its group: 1..8 tokens, the last one
    <eos> except for every fourth (truncated: masked whole under mask_truncated_completions)."""
    prompt_ids = [[int(w[1:]) for w in p.split()] for p in prompt_list]  # the word-level ids of "w5 w17 ..."
    out = []
    for j, ids in enumerate(prompt_ids):
        k = j % NUM_GENERATIONS
        seed = sum(ids) * 7 + k
        length = 1 + (sum(ids) % 5 + 2 * k) % MAX_COMPLETION  # groups of different token totals
        body = [1 + (seed * (t + 3)) % (VOCAB - 2) for t in range(length)]
        if k != 3:
            body[-1] = VOCAB - 1
        out.append(body)
    return {"prompt_ids": prompt_ids, "completion_ids": out, "logprobs": None}


def reward(completions, completion_ids, **_) -> list[float]:
    return [1.0 / (1 + len(c)) + 0.1 * (c[0] % 3) for c in completion_ids]


def grpo_args(out_dir: str, b: int, ga: int, *, steps: int = 1, spg: int | None = None, **over):
    import trl

    args = {
        **common_args(out_dir, b, ga, steps),
        "learning_rate": 1.0,
        "num_generations": NUM_GENERATIONS,
        "max_completion_length": MAX_COMPLETION,
        "steps_per_generation": spg or ga,
        "shuffle_dataset": False,
        "bf16": False,
        **over,
    }
    args.pop("train_sampling_strategy", None)
    return trl.GRPOConfig(**args)


def run_grpo(
    out_dir: str, b: int, ga: int, *, mixin: bool = True, steps: int = 1, spg: int | None = None, lp=None, **over
):
    """One run; returns (initial params, final params, log_history, the trainer). The trainer keeps the
    parameters after each step (``_test_params``) and the first generation batch (``_test_rows``)."""
    import datasets
    import trl

    from lossparity.rl import LossParityGRPOMixin

    base = (LossParityGRPOMixin, trl.GRPOTrainer) if mixin else (trl.GRPOTrainer,)
    cls = type("GRPO", base, {})
    import os

    path = os.path.join(out_dir, "tiny-llama")  # a path: TRL builds the reference model (beta != 0) from it
    if not os.path.isdir(path):
        tiny_model("llama").save_pretrained(path)
    kw = dict(lp or {}) if mixin else {}
    trainer = cls(
        model=path,
        args=grpo_args(out_dir, b, ga, steps=steps, spg=spg, **over),
        train_dataset=datasets.Dataset.from_list(prompts()),
        processing_class=tokenizer(),
        reward_funcs=reward,
        rollout_func=rollout,
        callbacks=[cb := StepParams()],
        **kw,
    )
    trainer._test_params = cb.params
    trainer._test_rows = []
    generate = trainer._generate_and_score_completions

    def keep_first(inputs):
        out = generate(inputs)
        if not trainer._test_rows:
            trainer._test_rows.append(out)
        return out

    trainer._generate_and_score_completions = keep_first
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return before, after, trainer.state.log_history, trainer


def rel_update_diff(a: tuple, b: tuple) -> float:
    """Relative max difference of two runs' updates (final − initial parameters)."""
    ua = torch.cat([(a[1][k] - a[0][k]).flatten() for k in a[0]])
    ub = torch.cat([(b[1][k] - b[0][k]).flatten() for k in b[0]])
    return float((ua - ub).abs().max() / ua.abs().max())


class StepParams:
    """A ``TrainerCallback`` that keeps the parameters after every optimizer step."""

    def __new__(cls):
        import transformers

        class _CB(transformers.TrainerCallback):
            def __init__(self) -> None:
                self.params: list[dict[str, torch.Tensor]] = []

            def on_step_end(self, args, state, control, model=None, **kw):
                self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})

        return _CB()


def naive_objective(out_dir: str, rows: list[dict], terms: dict[str, tuple[str, float]], L: int = MAX_COMPLETION):
    """``J = Σ_k coef_k · J_{mode_k}`` of the rows of one step at the initial parameters, in float64, written out
    row by row from semantics §1/§9 (groups: rows with the same prompt; microbatches: the entries of ``rows``);
    returns (J, its gradient by name, each term's value)."""
    import os

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "tiny-llama"), dtype=torch.float64)
    per_row = []  # (group key, n_i, {term: s_i}, microbatch)
    for m, mb in enumerate(rows):
        for i in range(mb["completion_ids"].shape[0]):
            p_ids, p_m = mb["prompt_ids"][i], mb["prompt_mask"][i]
            c_ids, c_m = mb["completion_ids"][i], mb["completion_mask"][i].double()
            ids = torch.cat([p_ids[p_m > 0], c_ids])[None]
            logits = model(input_ids=ids, use_cache=False).logits[0, -c_ids.shape[0] - 1 : -1].double()
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, c_ids[:, None])[:, 0]
            ratio = torch.exp(logp - logp.detach())
            a = float(mb["advantages"][i])
            pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            d = logp.detach() - logp  # the reference model is the initial model: ref logps = logp's value
            kl = torch.exp(d) - d - 1
            ent = -(logp_all.exp() * logp_all).sum(-1)
            sums = {"policy": (pg * c_m).sum(), "kl": (kl * c_m).sum(), "entropy": (ent * c_m).sum()}
            per_row.append((tuple(p_ids[p_m > 0].tolist()), float(c_m.sum()), sums, m))
    ntok = sum(r[1] for r in per_row)
    J = torch.zeros((), dtype=torch.float64)
    values: dict[str, float] = {}
    for name, (mode, coef) in terms.items():
        if mode == "per_token":
            j = sum(r[2][name] for r in per_row) / max(ntok, 1)
        elif mode == "per_sample":
            j = sum(r[2][name] / max(r[1], 1) for r in per_row) / len(per_row)
        elif mode == "sample_sum_norm":
            j = sum(r[2][name] for r in per_row) / (len(per_row) * L)
        elif mode == "per_group":
            keys = sorted({r[0] for r in per_row})
            j = sum(
                sum(r[2][name] for r in per_row if r[0] == k) / max(sum(r[1] for r in per_row if r[0] == k), 1)
                for k in keys
            ) / len(keys)
        elif mode == "per_microbatch":
            j = sum(
                sum(r[2][name] for r in per_row if r[3] == m) / max(sum(r[1] for r in per_row if r[3] == m), 1)
                for m in range(len(rows))
            ) / len(rows)
        else:
            raise ValueError(mode)
        values[name] = float(j)
        J = J + coef * j
    J.backward()
    return float(J.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, values


if __name__ == "__main__":  # torchrun entry point: OUT MODE B GA (rank 0 saves the run's parameters and logs)
    import os
    import sys

    torch.set_num_threads(1)
    out, mode, b, ga = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rank_dir = f"{out}.rank{os.environ.get('RANK', '0')}"  # each rank builds the (seeded, identical) model itself
    os.makedirs(rank_dir, exist_ok=True)
    before, after, logs, _ = run_grpo(
        rank_dir,
        b,
        ga,
        steps=2,
        lp={"lossparity_mode": mode},
        beta=0.04,
        entropy_coef=0.1,
        mask_truncated_completions=True,
    )
    if os.environ.get("RANK", "0") == "0":
        torch.save({"before": before, "after": after, "logs": logs}, f"{out}.pt")
