"""Tiny HF models, datasets and Trainer runs shared by the HF/TRL integration tests.

Also the ``torchrun`` entry point of the multi-rank run: ``python _hf_common.py OUT.pt KIND MODE B GA``
runs the same training on every rank and rank 0 saves the final parameters and ``log_history``.
Nothing is downloaded: models are built from configs (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

VOCAB, SEQ, N_ROWS, STEPS = 64, 12, 40, 5
# The dimensions of every tiny model (1 layer): shared by the config-built models of the HF tests.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def tiny_model(kind: str = "llama"):
    """A 1-layer model from a config, float32, identical weights on every call (seeded)."""
    import transformers

    torch.manual_seed(0)
    common = dict(TINY)
    if kind == "nologits":  # a model whose outputs carry no logits (bad input of the integration)

        class NoLogits(transformers.LlamaForCausalLM):
            def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kw):
                out = super().forward(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw
                )
                return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=out.logits)

        return NoLogits(transformers.LlamaConfig(**common))
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05
        )
        return transformers.MixtralForCausalLM(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def padded_rows(n: int = N_ROWS, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Right-padded rows of ragged lengths; a random prompt part is masked (-100), and every fifth row
    has no loss token at all (prompt only): zero-loss-token samples, which still count in N."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        att = (torch.arange(SEQ) < length).long()
        prompt = length if i % 5 == 2 else int(torch.randint(1, length, (1,), generator=g))
        labels = torch.where(torch.arange(SEQ) < prompt, -100, ids)
        labels = torch.where(att > 0, labels, -100)
        rows.append({"input_ids": ids * att, "attention_mask": att, "labels": labels})
    return rows


def packed_rows(n: int = N_ROWS, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """Packed rows of 1-4 documents each (``position_ids`` restart at 0 for each document, the first
    label of every document is -100 as in TRL's padding-free collator); some documents carry no label."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        cuts = sorted(
            set(torch.randint(2, SEQ - 1, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist())
        )
        starts = [0] + cuts
        pos = torch.zeros(SEQ, dtype=torch.long)
        for a, b in zip(starts, starts[1:] + [SEQ]):
            pos[a:b] = torch.arange(b - a)
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        labels = torch.where(pos == 0, -100, ids)
        if i % 4 == 1:  # a document whose tokens are all prompt
            labels[: starts[1] if len(starts) > 1 else SEQ] = -100
        rows.append({"input_ids": ids, "position_ids": pos, "labels": labels})
    return rows


class RowDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return dict(self.rows[i])


def common_args(out_dir: str, b: int, ga: int, steps: int = STEPS) -> dict:
    """Arguments shared by the Trainer and SFTTrainer runs: SGD, constant LR, no clipping, sequential
    sampling, CPU, no logging integrations."""
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=b,
        gradient_accumulation_steps=ga,
        max_steps=steps,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_grad_norm=0.0,
    )


def training_args(out_dir: str, b: int, ga: int, steps: int = STEPS, **over):
    import transformers

    return transformers.TrainingArguments(**{**common_args(out_dir, b, ga, steps), **over})


def grad_recorder():
    """A Trainer callback keeping a copy of every parameter gradient just before each optimizer step."""
    import transformers

    class GradRecorder(transformers.TrainerCallback):
        def __init__(self):
            self.grads = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    return GradRecorder()


def run(
    out_dir: str,
    kind: str,
    mode: str | None,
    b: int,
    ga: int,
    *,
    data: str = "padded",
    steps: int = STEPS,
    trainer_cls=None,
    record_grads: bool = False,
):
    """Train ``steps`` steps; ``mode=None`` runs the plain ``transformers.Trainer``. Returns (final
    parameters, log_history, recorded gradients)."""
    import transformers

    from lossparity.integrations.hf import LossParityTrainer

    rows = rows_for(data)
    model = tiny_model(kind)
    rec = grad_recorder() if record_grads else None
    kw = dict(
        model=model,
        args=training_args(out_dir, b, ga, steps),
        train_dataset=RowDataset(rows),
        callbacks=[rec] if rec else None,
    )
    if mode is None:
        trainer = (trainer_cls or transformers.Trainer)(**kw)
    else:
        trainer = (trainer_cls or LossParityTrainer)(**kw, loss_mode=mode)
    trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, trainer.state.log_history, (rec.grads if rec else None)


def naive_step1_objective(mode: str, rows: list[dict]) -> float:
    """J of the first 8 rows under the initial weights: per row, the model's logits, log-softmax in
    float64, the next-token loss at each labelled position, then the per-sample or per-document mean."""
    model = tiny_model("llama")
    units = []
    with torch.no_grad():
        for r in rows[:8]:
            kw = {k: r[k][None] for k in ("input_ids", "attention_mask", "position_ids") if k in r}
            logp = torch.log_softmax(model(**kw, use_cache=False).logits[0].double(), -1)
            doc = (r["position_ids"] == 0).cumsum(0) if mode == "per_document" else torch.ones(len(r["labels"]))
            sums: dict[int, list[float]] = {int(d): [0.0, 0] for d in doc.unique()}
            for t in range(len(r["labels"]) - 1):
                y = int(r["labels"][t + 1])
                if y != -100:
                    sums[int(doc[t])][0] -= float(logp[t, y])
                    sums[int(doc[t])][1] += 1
            units += [s / max(n, 1) for s, n in sums.values()]
    return sum(units) / len(units)


def rows_for(data: str) -> list[dict[str, torch.Tensor]]:
    """``padded``, ``packed``, ``ignored`` (every label -100) or ``segbad`` (per-row ``segment_ids`` with a
    labelled token at segment 0 in rows 2-3 only: with b=2 and 2 ranks, only rank 1 receives them)."""
    if data == "packed":
        return packed_rows()
    rows = padded_rows()
    if data == "ignored":
        for r in rows:
            r["labels"] = torch.full_like(r["labels"], -100)
    if data == "segbad":
        for i, r in enumerate(rows):
            r["segment_ids"] = r["attention_mask"].clone()
            if i in (2, 3):
                r["segment_ids"].zero_()
    return rows


if __name__ == "__main__":  # torchrun entry point: OUT_PREFIX RUNS_JSON
    import json
    import tempfile

    torch.set_num_threads(1)
    results = {}
    for spec in json.loads(sys.argv[2]):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                params, logs, _ = run(
                    tmp,
                    spec["kind"],
                    spec["mode"],
                    spec["b"],
                    spec["ga"],
                    data=spec["data"],
                    steps=spec.get("steps", STEPS),
                )
                results[spec["name"]] = {"params": params, "logs": logs}
            except ValueError as e:
                results[spec["name"]] = {"error": str(e)}
    torch.save(results, f"{sys.argv[1]}.rank{os.environ.get('RANK', '0')}.pt")
