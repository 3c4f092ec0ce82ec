"""TRL ``SFTTrainer`` runs for the integration tests: a word-level tokenizer built in memory (nothing is
downloaded), pre-tokenized examples with ragged completion masks (labels -100 on the prompt; some
examples are prompt-only), and the tiny Llama of ``_hf_common``."""

from __future__ import annotations

import torch
from _hf_common import STEPS, VOCAB, common_args, tiny_model


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB - 1)}, "<eos>": VOCAB - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def examples(n: int = 40, seed: int = 5) -> list[dict[str, list[int]]]:
    """Pre-tokenized examples of 3..12 tokens; labels -100 on a prompt prefix; every fifth is prompt-only."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 13, (1,), generator=g))
        ids = torch.randint(1, VOCAB - 1, (length,), generator=g).tolist()
        prompt = length if i % 5 == 2 else int(torch.randint(1, length, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def sft_args(out_dir: str, b: int, ga: int, *, padding_free: bool = False, packing: bool = False, steps: int = STEPS):
    """SFTConfig of the tests: SGD, constant LR, no clipping, sequential sampling; ``packing`` packs the
    examples into rows of 16 tokens (TRL's best-fit decreasing, padding-free batches)."""
    import trl

    return trl.SFTConfig(
        packing=packing,
        **({"max_length": 16} if packing else {"max_length": None}),
        **common_args(out_dir, b, ga, steps),
        padding_free=padding_free or packing,
        bf16=False,
    )


def run_sft(
    out_dir: str, mode: str, b: int, ga: int, *, padding_free: bool = False, packing: bool = False, steps: int = STEPS
):
    """``class MySFT(LossParityMixin, trl.SFTTrainer)`` for ``steps`` steps; returns (params, log_history,
    the first 8 rows as TRL prepared them)."""
    import datasets
    import trl

    from lossparity.integrations.hf import LossParityMixin

    class MySFT(LossParityMixin, trl.SFTTrainer):
        pass

    args = sft_args(out_dir, b, ga, padding_free=padding_free, packing=packing, steps=steps)
    model = tiny_model("llama")
    trainer = MySFT(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(examples()),
        processing_class=tokenizer(),
        loss_mode=mode,
    )
    trainer.train()
    first = [trainer.train_dataset[i] for i in range(8)]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, trainer.state.log_history, first


def naive_mean_of_example_means(rows: list[dict]) -> float:
    """Mean over the examples of ``rows`` (a packed row is split by its ``seq_lengths``) of each example's
    next-token loss mean (float64 log-softmax of the initial model run on that example alone)."""
    model = tiny_model("llama")
    means = []
    with torch.no_grad():
        for row in rows:
            lengths = row.get("seq_lengths") or [len(row["input_ids"])]
            start = 0
            for n in lengths:
                ids = torch.tensor(row["input_ids"][start : start + n])
                labels = torch.tensor(row["labels"][start : start + n])
                start += n
                logp = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0].double(), -1)
                terms = [-float(logp[t, labels[t + 1]]) for t in range(n - 1) if labels[t + 1] != -100]
                means.append(sum(terms) / max(len(terms), 1))
    return sum(means) / len(means)
