"""Training stacks the audit tests run: hand-written loops with known normalizations and Trainer factories.

Module-level functions, so that the audit's 2-rank worker processes import them by ``FILE.py:NAME``.
Each loop's docstring states what it computes; the tests assert the audit names exactly that.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.nn.functional as F

TINY = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def tiny_llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def tiny_llama64():
    return tiny_llama().double()


def _token_losses(model, mb):
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    v = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, v), mb["labels"][:, 1:].reshape(-1), reduction="none", ignore_index=-100
    ).view(mb["labels"].shape[0], -1)


def _world_sum(x: float) -> float:
    if dist.is_initialized():
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)
    return x


def mean_over_ga(model, microbatches, ctx):
    """The loop of transformers #37766: each microbatch's token mean divided by GA, DDP averaging: the mean
    of the microbatch means (per_microbatch)."""
    total = 0.0
    for mb in microbatches:
        ell = _token_losses(model, mb)
        n = (mb["labels"][:, 1:] != -100).sum()
        loss = ell.sum() / n / ctx.ga
        loss.backward()
        total += float(loss)
    return total


def global_token_mean(model, microbatches, ctx):
    """Summed token losses divided by the global target count (counted over every rank and microbatch
    first), times the world size to undo DDP's averaging: the token mean (per_token). Logs the loss."""
    n_global = _world_sum(sum(float((mb["labels"][:, 1:] != -100).sum()) for mb in microbatches))
    total = 0.0
    for mb in microbatches:
        loss = _token_losses(model, mb).sum() / n_global * ctx.world_size
        loss.backward()
        total += float(loss) / ctx.world_size
    return _world_sum(total)


def per_sample_nonempty(model, microbatches, ctx):
    """Per-sample means divided by the number of rows that have a target (OpenRLHF's convention): the
    per-sample mean scaled by N / N_nonempty (8/7 on the audit's batch, which has one prompt-only row)."""
    counts = [(mb["labels"][:, 1:] != -100).sum(1) for mb in microbatches]
    nonempty = _world_sum(sum(float((c > 0).sum()) for c in counts))
    for mb, c in zip(microbatches, counts):
        loss = (_token_losses(model, mb).sum(1) / c.clamp(min=1)).sum() / nonempty * ctx.world_size
        loss.backward()
    return None


def no_reduction(model, microbatches, ctx):
    """A global token mean without DDP and without a gradient all-reduce (``wrap_ddp=False``): rank 0 keeps
    its own rows' gradient only (rank 1's rows weigh 0)."""
    n_global = _world_sum(sum(float((mb["labels"][:, 1:] != -100).sum()) for mb in microbatches))
    for mb in microbatches:
        (_token_losses(model, mb).sum() / n_global).backward()
    return None


def trainer_factory(ctx):
    """The plain transformers.Trainer on a tiny Llama: per_token since 4.46."""
    import transformers

    args = ctx.args(output_dir="unused", learning_rate=0.1, optim="sgd")
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=ctx.train_dataset)


class _NoKwargsLlama:
    pass


def trainer_no_loss_kwargs(ctx):
    """A Trainer whose model's forward does not accept the loss kwargs (transformers #37766/#47688): the
    Trainer cannot pass num_items_in_batch and trains the mean of microbatch means."""
    import transformers

    class Plain(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    torch.manual_seed(0)
    model = Plain(transformers.LlamaConfig(**TINY))
    args = ctx.args(output_dir="unused", learning_rate=0.1, optim="sgd")
    return transformers.Trainer(model=model, args=args, train_dataset=ctx.train_dataset)


def trainer_local_tokens(ctx):
    """``average_tokens_across_devices=False`` (transformers #39392): each rank divides by its own tokens."""
    import transformers

    args = ctx.args(output_dir="unused", learning_rate=0.1, optim="sgd", average_tokens_across_devices=False)
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=ctx.train_dataset)


def good_kernel(logits, labels, reduction="mean", ignore_index=-100):
    """torch's own cross-entropy: the kernel that passes."""
    return F.cross_entropy(logits, labels, reduction=reduction, ignore_index=ignore_index)


class _FirstTokenUpstream(torch.autograd.Function):
    """Per-token losses whose backward scales every token's gradient by token 0's upstream gradient (the
    bug class of Liger-Kernel #968), correct forward."""

    @staticmethod
    def forward(ctx, logits, labels):
        logp = torch.log_softmax(logits.float(), -1)
        valid = labels != -100
        safe = labels.clamp(min=0)
        ctx.save_for_backward(logp, safe, valid)
        return torch.where(valid, -logp.gather(1, safe[:, None])[:, 0], 0.0).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        logp, safe, valid = ctx.saved_tensors
        g = logp.exp()
        g[torch.arange(len(safe)), safe] -= 1
        g = g * valid[:, None]
        return (g * grad[0]).to(grad.dtype), None  # the bug: grad[0] instead of grad[:, None]


def first_token_kernel(logits, labels, reduction="mean", ignore_index=-100):
    ell = _FirstTokenUpstream.apply(logits, labels)
    if reduction == "none":
        return ell
    total = ell.sum()
    return total if reduction == "sum" else total / (labels != ignore_index).sum()


def raising_step(model, microbatches, ctx):
    """A step that fails in the user's code (the audit names this file and line)."""
    raise RuntimeError("the user's step failed")


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, 63)}, "<eos>": 63}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def sft_factory(ctx):
    """TRL's SFTTrainer on pre-tokenized rows with a completion mask (loss on completion tokens only)."""
    import trl

    args = ctx.args(
        trl.SFTConfig,
        output_dir="unused",
        learning_rate=0.1,
        optim="sgd",
        max_length=None,
        bf16=False,
        completion_only_loss=True,
    )
    data = ctx.dataset(("input_ids", "completion_mask"), unpadded=True)
    return trl.SFTTrainer(model=tiny_llama(), args=args, train_dataset=data, processing_class=_tokenizer())


def tiny_mixtral():
    import transformers

    config = transformers.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05
    )
    return transformers.MixtralForCausalLM(config)


def trainer_mixtral(ctx):
    """The plain Trainer on a tiny Mixtral whose forward adds router_aux_loss_coef × aux to its loss."""
    import transformers

    args = ctx.args(output_dir="unused", learning_rate=0.1, optim="sgd")
    return transformers.Trainer(model=tiny_mixtral(), args=args, train_dataset=ctx.train_dataset)


def deepspeed_hf_loss(engine, mb):
    """A DeepSpeed loop's loss: the model's own (token mean of the microbatch), handed to engine.backward
    with DeepSpeed's defaults: the mean of the microbatch means (DeepSpeed divides by GA, DDP averages)."""
    return engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], labels=mb["labels"]).loss


def deepspeed_recording_loss(engine, mb):
    """``deepspeed_hf_loss``, also appending the engine's own ZeRO stage and offload to the file named by
    ``LOSSPARITY_TEST_RECORD`` (the test reads what each configuration's engine really ran)."""
    import os

    import torch.distributed as dist

    with open(os.environ["LOSSPARITY_TEST_RECORD"], "a") as f:
        f.write(f"{dist.get_rank()} {engine.zero_optimization_stage()} {bool(engine.zero_cpu_offload())}\n")
    return deepspeed_hf_loss(engine, mb)
