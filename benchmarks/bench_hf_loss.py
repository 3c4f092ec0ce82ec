"""One HF training step of a Llama-like model: plain ``transformers.Trainer`` loss vs ``LossParityTrainer`` (fused)
vs cut-cross-entropy vs Liger Kernel, peak memory (first step of a fresh process) and step time.

``python -m benchmarks.bench_hf_loss [--vocabs 32000,128256] [--seqs 1024,4096] [--batch 2] [--steps 3]
[--threads 1] [--quick] [--json OUT]``

Model: ``LlamaForCausalLM`` from a config (2 layers, hidden 256, intermediate 1024, 4 heads, untied head),
float32, CPU, seeded; random tokens, the first quarter of every row's labels ``-100`` (a prompt). Methods,
each a ``transformers.Trainer`` (SGD, ``per_device_train_batch_size = batch``, no accumulation) training
``1 + steps`` steps in its own fresh subprocess per (method, shape), threads pinned (``--threads``, also
``OMP_NUM_THREADS``):

- ``hf``: plain ``transformers.Trainer`` (the model's own loss: full ``[b, S, V]`` logits, then
  ``ForCausalLMLoss``);
- ``lossparity``: ``LossParityTrainer`` (``loss_mode="per_token"``, the default ``fused_loss=True``: the
  fused cross-entropy from the head's input, no logits tensor);
- ``cce``: a Trainer whose ``compute_loss`` does what cut-cross-entropy's ``cce_patch`` patches into the
  model's forward: the decoder's last hidden state and ``lm_head.weight`` into its ``linear_cross_entropy``
  (``impl="torch_compile"``, the implementation that runs on a CPU; ``shift=1``, mean over the labels). The
  released ``cut-cross-entropy`` wheel has no ``cut_cross_entropy.transformers`` (``cce_patch``), so the
  peer is called directly;
- ``liger``: Liger Kernel's ``AutoLigerKernelForCausalLM``-style patch (``apply_liger_kernel_to_llama(
  fused_linear_cross_entropy=True)``), where ``liger_kernel`` imports (its kernels are Triton: GPU only).

Peak memory: the resident-set high-water mark over the **first** training step, above the resident set just
before ``trainer.train()`` (``benchmarks/_util.py``); step time: median and minimum of the ``steps`` steps
after the first (a callback times each optimizer step). Ratios are against ``hf`` of the same shape, in the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks._util import MiB, markdown_table, write_json

METHODS = ("hf", "lossparity", "cce", "liger")
QUICK = dict(vocabs=[512], seqs=[64], batch=2, steps=1, hidden=64)


def _model(vocab: int, seq: int, hidden: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _rows(n: int, vocab: int, seq: int) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        labels = ids.clone()
        labels[: seq // 4] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels})
    return rows


def _trainer_class(method: str) -> Any:
    import transformers

    if method == "hf":
        return transformers.Trainer
    if method == "lossparity":
        from lossparity.integrations.hf import LossParityTrainer

        return LossParityTrainer
    if method == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)
        return transformers.Trainer
    from cut_cross_entropy import linear_cross_entropy

    class CCETrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"]
            fwd = {k: v for k, v in inputs.items() if k != "labels"}
            hidden = model.model(**fwd, use_cache=False).last_hidden_state
            loss = linear_cross_entropy(hidden, model.lm_head.weight, labels, shift=1, impl="torch_compile")
            return (loss, None) if return_outputs else loss

    return CCETrainer


def run_one(method: str, vocab: int, seq: int, batch: int, steps: int, hidden: int, threads: int) -> dict[str, Any]:
    """One (method, shape) in this process: ``1 + steps`` training steps; the first one's peak memory."""
    import torch
    import transformers

    from benchmarks._util import _proc_status_kib, _reset_rss_peak

    torch.set_num_threads(threads)
    try:
        cls = _trainer_class(method)
    except Exception as exc:  # an absent or GPU-only peer
        return {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    model = _model(vocab, seq, hidden)
    marks: list[float] = []
    peak: list[int | None] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())
            if len(peak) == 0:  # the first step: its high-water mark above the resident set before train()
                hwm = _proc_status_kib("VmHWM")
                peak.append(None if hwm is None or base is None else max(hwm - base, 0) * 1024)

    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            max_steps=1 + steps,
            learning_rate=1e-3,
            optim="sgd",
            lr_scheduler_type="constant",
            logging_steps=1000,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            max_grad_norm=0.0,
        )
        kw = {"loss_mode": "per_token"} if method == "lossparity" else {}
        trainer = cls(model=model, args=args, train_dataset=_rows(batch * (1 + steps), vocab, seq), **kw)
        trainer.add_callback(Clock())
        base = _proc_status_kib("VmRSS")
        if not _reset_rss_peak():
            base = None
        trainer.train()
    times = [marks[i + 1] - marks[i] for i in range(2, len(marks) - 1, 2)]
    return {
        "peak_bytes": peak[0] if peak else None,
        "first_step_s": marks[1] - marks[0],
        "median_s": statistics.median(times) if times else None,
        "min_s": min(times) if times else None,
    }


def _subprocess(method: str, vocab: int, seq: int, args: argparse.Namespace, hidden: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    spec = json.dumps([method, vocab, seq, args.batch, args.steps, hidden, args.threads])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_hf_loss", "--one", spec],
        capture_output=True,
        text=True,
        env=env,
        timeout=args.timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return {"skipped": f"failed: {tail}"}
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocabs", default="32000,128256")
    p.add_argument("--seqs", default="1024,4096")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=int, default=3600, help="seconds per (method, shape) subprocess")
    p.add_argument("--quick", action="store_true", help="vocabulary 512, sequence 64, hidden 64, 1 timed step")
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:  # the subprocess of one (method, shape)
        print("RESULT " + json.dumps(run_one(*json.loads(args.one))), flush=True)
        return {}
    vocabs = [int(v) for v in args.vocabs.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    hidden = args.hidden
    if args.quick:
        vocabs, seqs, args.batch, args.steps, hidden = (
            QUICK["vocabs"],
            QUICK["seqs"],
            QUICK["batch"],
            QUICK["steps"],
            QUICK["hidden"],
        )
    methods = args.methods.split(",")
    results: list[dict[str, Any]] = []
    rows = []
    for vocab in vocabs:
        for seq in seqs:
            shape = {m: _subprocess(m, vocab, seq, args, hidden) for m in methods}
            ref = shape.get("hf", {})
            for m, r in shape.items():
                results.append({"method": m, "vocab": vocab, "seq": seq, "batch": args.batch, **r})
                if "skipped" in r:
                    rows.append([f"{args.batch}×{seq}×{vocab}", m, "", "", "", "", "", r["skipped"]])
                    continue
                mem = r["peak_bytes"]
                ref_mem, ref_t = ref.get("peak_bytes"), ref.get("median_s")
                rows.append(
                    [
                        f"{args.batch}×{seq}×{vocab}",
                        m,
                        f"{r['median_s']:.3f}" if r["median_s"] is not None else "",
                        f"{r['min_s']:.3f}" if r["min_s"] is not None else "",
                        f"{mem / MiB:.0f}" if mem is not None else "n/a",
                        f"{r['median_s'] / ref_t:.2f}" if ref_t and r["median_s"] else "",
                        f"{mem / ref_mem:.2f}" if mem is not None and ref_mem else "",
                        "",
                    ]
                )
    headers = [
        "b×S×V",
        "method",
        "step median s",
        "step min s",
        "first-step peak extra MiB",
        "time / hf",
        "memory / hf",
    ]
    print(markdown_table(headers + ["note"], rows), flush=True)
    payload = {"threads": args.threads, "hidden": hidden, "results": results}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
