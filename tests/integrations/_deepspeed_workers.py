"""Workers run on spawned gloo ranks by test_integration_deepspeed.py (importable by the children), and the
tiny model, global batch and naive float64 reference they are compared with.

The model is a float32 embedding -> tanh(linear) -> head language model that returns the ``[b, S]``
per-token cross-entropy (float32 also in bf16 runs: the logits are upcast). The global batch has ragged
rows, a row without any target, a document without targets and packed documents; rank ``r`` takes rows
``r·N/D .. (r+1)·N/D`` and splits them into ``K`` microbatches in order. The reference
(:func:`reference_grads`) is a one-process float64 computation on the whole global batch with the naive
per-mode loops written out here, never lossparity's formulas.
"""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a CPU test: never pick up a GPU accelerator
# DeepSpeed's compiled ops cached in the work folder, as ./dev.sh sets it, also when pytest runs alone
_ROOT = pathlib.Path(__file__).resolve().parents[2]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".cache" / "torch_extensions"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

V, S, H, N = 13, 8, 8, 16
MODES = ("per_token", "per_sample", "per_document", "per_microbatch", "sample_sum", "sample_sum_norm")
FIXED_LENGTH = S  # the L of sample_sum_norm


class TinyLM(nn.Module):
    """Embedding -> tanh(linear) -> head; ``forward(tokens, labels)`` is the [b, S] per-token loss (float32)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(V, H)
        self.mix = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.emb(tokens))))
        if labels is None:  # the documented recipe computes the loss from the logits itself
            return logits
        logits = logits if logits.dtype == torch.float64 else logits.float()
        flat = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1).clamp(min=0), reduction="none")
        return flat.view(labels.shape)


def global_batch() -> dict[str, torch.Tensor]:
    """16 rows of 8 tokens: ragged lengths (padding: mask 0, segment 0), 1-3 packed documents per row with
    increasing ids, a prompt part masked, row 5 without any target, row 9's first document without targets."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (N, S), generator=g)
    labels = torch.randint(0, V, (N, S), generator=g)
    mask = torch.zeros(N, S)
    seg = torch.zeros(N, S, dtype=torch.long)
    for i in range(N):
        length = int(torch.randint(2, S + 1, (1,), generator=g))
        cuts = sorted(
            set(torch.randint(1, length, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g).tolist())
        )
        starts = [0] + [c for c in cuts if 0 < c < length]
        for d, (a, b) in enumerate(zip(starts, starts[1:] + [length]), start=1):
            seg[i, a:b] = d
        prompt = int(torch.randint(0, 2, (1,), generator=g))
        mask[i, prompt:length] = 1.0
        if i == 5:
            mask[i] = 0.0
        if i == 9:
            mask[i] = mask[i] * (seg[i] != 1)
    labels = torch.where(mask > 0, labels, torch.full_like(labels, -100))
    return {"tokens": tokens, "labels": labels, "mask": mask, "seg": seg}


def microbatches(rank: int, world: int, ga: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s ``ga`` microbatches of ``N/(world·ga)`` rows, in order."""
    batch = global_batch()
    per_rank = N // world
    b = per_rank // ga
    lo = rank * per_rank
    return [{k: v[lo + j * b : lo + (j + 1) * b] for k, v in batch.items()} for j in range(ga)]


# ---------------------------------------------------------------------- the naive float64 reference


def naive_objective(
    mode: str,
    loss: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor | None,
    b: int,
    fixed_length: int = FIXED_LENGTH,
) -> torch.Tensor:
    """J of ``mode`` over the whole batch, written out with loops (semantics §1); ``b`` rows per microbatch,
    ``seg`` the documents' ids (increasing along each row, 0 = padding), ``fixed_length`` the ``L`` of
    ``sample_sum_norm``."""
    n_rows = loss.shape[0]
    if mode == "per_token":
        return (loss * mask).sum() / mask.sum()
    if mode in ("sample_sum", "sample_sum_norm"):
        total = sum((loss[i] * mask[i]).sum() for i in range(n_rows))
        return total / (n_rows * (fixed_length if mode == "sample_sum_norm" else 1))
    terms = []
    if mode == "per_sample":
        for i in range(n_rows):
            terms.append((loss[i] * mask[i]).sum() / max(float(mask[i].sum()), 1.0))
    elif mode == "per_document":
        assert seg is not None
        for i in range(n_rows):
            for d in seg[i].unique().tolist():
                if d != 0:  # ids increase along a row here: one id = one document
                    w = mask[i] * (seg[i] == d)
                    terms.append((loss[i] * w).sum() / max(float(w.sum()), 1.0))
    elif mode == "per_microbatch":
        for r in range(0, n_rows, b):
            w = mask[r : r + b]
            terms.append((loss[r : r + b] * w).sum() / max(float(w.sum()), 1.0))
    else:
        raise ValueError(mode)
    return torch.stack(terms).sum() / len(terms)


def reference_grads(mode: str, b: int) -> tuple[dict[str, torch.Tensor], float]:
    """∇J (float64, by parameter name) and J, one process, the whole global batch, ``b`` rows per microbatch."""
    model = TinyLM().double()
    batch = global_batch()
    loss = model(batch["tokens"], batch["labels"])
    J = naive_objective(mode, loss, batch["mask"].double(), batch["seg"], b)
    J.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(J)


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over parameters of |a - b|∞ / |b|∞."""
    return max(float((a[n].double() - b[n]).abs().max() / b[n].abs().max()) for n in b)


# ---------------------------------------------------------------------- rank workers


def drop_in_case(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case ``{stage, offload, ga, dtype}``: one engine (SGD, lr 0, so every step sees the initial
    weights), then one optimizer step per mode through ``DeepSpeedAccountant``; returns, per case and mode,
    the full gradients at the boundary (rank 0) and the accountant's logs."""
    import deepspeed

    from lossparity.integrations.deepspeed import DeepSpeedAccountant, deepspeed_config, full_gradients

    out = []
    for case in cases:
        model = TinyLM()
        if case["dtype"] == "bfloat16":
            model = model.to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        cfg = deepspeed_config(
            case["stage"],
            offload=case["offload"],
            gradient_accumulation_steps=case["ga"],
            micro_batch_size=N // (world * case["ga"]),
            dtype=case["dtype"],
        )
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        mbs = microbatches(rank, world, case["ga"])
        for mode in case.get("modes", MODES):
            acc = DeepSpeedAccountant(engine, mode, fixed_length=FIXED_LENGTH)
            seg = [mb["seg"] for mb in mbs] if mode == "per_document" else None
            acc.begin_step([mb["mask"] for mb in mbs], seg)
            grads: dict = {}
            for j, mb in enumerate(mbs):
                per_token = engine(mb["tokens"], mb["labels"])
                share = acc.lm_loss(per_token, mb["mask"].to(per_token.dtype), seg[j] if seg else None)
                acc.backward(share, scale_wrt_gas=case.get("scale_wrt_gas", False))
                if j == len(mbs) - 1:
                    grads = full_gradients(engine)
                acc.step()
            logs = acc.logs()
            out.append({**case, "mode": mode, "grads": grads if rank == 0 else None, "logs": logs})
        if case.get("check_bad_masks"):  # rank 1 gives one mask fewer than K: both ranks must raise, none hang
            try:
                DeepSpeedAccountant(engine, "per_sample").begin_step([mb["mask"] for mb in mbs][: len(mbs) - rank])
                out[-1]["bad_masks_error"] = None
            except ValueError as e:
                out[-1]["bad_masks_error"] = str(e)
        engine.destroy()
    return out


def plain_case(rank: int, world: int, stage: int, ga: int) -> dict:
    """``step_gradients`` with the loss a plain DeepSpeed loop back-propagates: each microbatch's token mean."""
    from lossparity.integrations.deepspeed import step_gradients

    def loss_fn(engine, mb):
        per_token = engine(mb["tokens"], mb["labels"])
        return (per_token * mb["mask"]).sum() / mb["mask"].sum().clamp(min=1)

    mbs = microbatches(rank, world, ga)
    model = TinyLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = step_gradients(model, mbs, loss_fn, zero_stage=stage, micro_batch_size=N // (world * ga))
    untouched = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return {"grads": grads if rank == 0 else None, "untouched": untouched}


def doc_recipe_case(rank: int, world: int, code: str, lr: float) -> dict:
    """docs/integrations.md's DeepSpeed recipe as written (``model``, ``ds_config``, ``lr`` given), one step of
    ZeRO-2 with GA 2; returns its logs and the parameters after the optimizer step (ZeRO-2 keeps them whole)."""
    from lossparity.integrations.deepspeed import deepspeed_config

    ns = {
        "model": TinyLM(),
        "ds_config": deepspeed_config(2, gradient_accumulation_steps=2, micro_batch_size=4),
        "lr": lr,
    }
    exec(compile(code, "docs/integrations.md DeepSpeed", "exec"), ns)
    logs = ns["train_step"](microbatches(rank, world, 2))
    params = {n: p.detach().double().clone() for n, p in ns["engine"].module.named_parameters()}
    return {"logs": logs, "params": params}
