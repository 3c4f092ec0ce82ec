"""Tiny Llama with transformers' ``MtpModel`` layers attached (``attach_mtp``), float64, trained by
``LossParityTrainer``; the naive float64 references of its MTP term. Also the ``torchrun`` entry point:
``python _hf_mtp_common.py OUT_PREFIX RUNS_JSON`` runs every spec on every rank and saves the final
parameters, the first step's gradients and ``log_history``.

The naive reference runs every *document* alone (a sequence of its own: no rolling, no packing), depth ``k``
teacher-forced by hand (its input tokens ``doc[k:]``, positions ``k, k+1, ...``), the per-token losses by
``log_softmax`` in float64 and the mode's means written out: nothing of lossparity's rolling, masks or
accounting is used.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from _hf_common import SEQ, TINY, RowDataset, grad_recorder, packed_rows, padded_rows, training_args  # noqa: E402

STEPS = 2
LAMBDA = 0.3


def mtp_model(depths: int, dtype: str = "float64"):
    """The tiny Llama (1 layer) with ``depths`` MTP layers attached, float64 (or ``dtype``), seeded."""
    import transformers

    from lossparity.integrations.hf_mtp import attach_mtp

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    attach_mtp(model, depths)
    return model.to(getattr(torch, dtype))


def rows_for(data: str) -> list[dict[str, torch.Tensor]]:
    """The first 8 rows of ``_hf_common``'s padded (prompt and padding masked) or packed rows."""
    return (packed_rows() if data == "packed" else padded_rows())[:8]


def run(out_dir: str, spec: dict, record_grads: bool = True):
    """One training run of ``spec`` (depths, convention, mode, data, b, ga, fused): (params, logs, grads,
    the MTP token counts of the first step)."""

    from lossparity.integrations.hf import LossParityTrainer

    model = mtp_model(spec["depths"], spec.get("dtype", "float64"))
    rec = grad_recorder() if record_grads else None
    counts: list[list[float]] = []

    class Recorded(LossParityTrainer):  # keeps every step's accountant logs (the MTP token counts)
        lp_step_logs_all: list = []

        def training_step(self, *a, **kw):
            n = len(self._lp_step_logs)
            out = super().training_step(*a, **kw)
            self.lp_step_logs_all += self._lp_step_logs[n:]
            return out

    trainer = Recorded(
        model=model,
        args=training_args(out_dir, spec["b"], spec["ga"], spec.get("steps", STEPS)),
        train_dataset=RowDataset(rows_for(spec["data"])),
        callbacks=[rec] if rec else None,
        loss_mode=spec["mode"],
        mtp_convention=spec["convention"],
        mtp_weight=LAMBDA,
        fused_loss=spec.get("fused", True),
    )
    trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    counts = [[e[f"mtp_{k}_tokens"] for k in range(1, spec["depths"] + 1)] for e in trainer.lp_step_logs_all]
    return params, trainer.state.log_history, (rec.grads if rec else None), counts


def _documents(row: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) of each document of a row: packed rows split where ``position_ids`` restart,
    padded rows cut at the attention mask."""
    if "position_ids" in row:
        starts = [int(t) for t in torch.nonzero(row["position_ids"] == 0).flatten()] + [SEQ]
        return [(row["input_ids"][a:b], row["labels"][a:b]) for a, b in zip(starts, starts[1:])]
    n = int(row["attention_mask"].sum())
    return [(row["input_ids"][:n], row["labels"][:n])]


def hand_mtp_tokens(rows: list[dict], depth: int) -> int:
    """Tokens of MTP depth ``k`` counted by hand: position ``t`` predicts the token ``t + k + 1`` of its own
    document, which must carry a label (not -100: no prompt, no padding)."""
    n = 0
    for row in rows:
        for _, labels in _documents(row):
            n += sum(1 for t in range(len(labels)) if t + depth + 1 < len(labels) and labels[t + depth + 1] != -100)
    return n


def naive_objective(rows: list[dict], depths: int, mode: str, convention: str) -> float:
    """``J = J_main + λ·(1/Dm)·Σ_k J_k`` (``own``) or ``J_main + λ·J_pooled`` (``pooled``) of ``rows`` at the
    initial weights, every document run alone, float64. ``per_sample``: units = rows, ``per_document``:
    units = documents; each unit's loss is its sum over its tokens divided by its own token count."""
    model = mtp_model(depths)
    mtp = model.lossparity_mtp
    units: list[dict[int, list[float]]] = []  # per unit: depth (0 = main) -> [loss sum, tokens]
    with torch.no_grad():
        for row in rows:
            row_unit: dict[int, list[float]] = {k: [0.0, 0] for k in range(depths + 1)}
            for ids, labels in _documents(row):
                doc_unit = row_unit if mode == "per_sample" else {k: [0.0, 0] for k in range(depths + 1)}
                s = len(ids)
                out = model.model(input_ids=ids[None], position_ids=torch.arange(s)[None], use_cache=False)
                hidden = out.last_hidden_state
                for k in range(min(depths, s - 1) + 1):  # a depth past the document's end has no token
                    if k > 0:  # depth k: tokens k.., positions k.., the previous depth's states at 0..s-k-1
                        hidden = mtp.forward_layer(
                            k - 1, hidden[:, : s - k], torch.arange(k, s)[None], None, input_ids=ids[None, k:]
                        )
                    logp = torch.log_softmax(model.lm_head(hidden)[0], -1)
                    for t in range(s - k - 1):
                        y = int(labels[t + k + 1])
                        if y != -100:
                            doc_unit[k][0] -= float(logp[t, y])
                            doc_unit[k][1] += 1
                if mode == "per_document":
                    units.append(doc_unit)
            if mode == "per_sample":
                units.append(row_unit)
    n = len(units)
    main = sum(u[0][0] / max(u[0][1], 1) for u in units) / n
    depth_range = range(1, depths + 1)
    if convention == "pooled":  # per unit: its loss over all depths over its tokens over all depths
        term = sum(sum(u[k][0] for k in depth_range) / max(sum(u[k][1] for k in depth_range), 1) for u in units) / n
    else:  # per depth: J_k, the mean over units of their depth-k means; then the mean over depths
        term = sum(sum(u[k][0] / max(u[k][1], 1) for u in units) / n for k in depth_range) / depths
    return main + LAMBDA * term


if __name__ == "__main__":  # torchrun entry point: OUT_PREFIX RUNS_JSON
    import json
    import tempfile

    torch.set_num_threads(1)
    results = {}
    for spec in json.loads(sys.argv[2]):
        with tempfile.TemporaryDirectory() as tmp:
            params, logs, grads, counts = run(tmp, spec)
            results[spec["name"]] = {"params": params, "logs": logs, "grads": grads, "counts": counts}
    torch.save(results, f"{sys.argv[1]}.rank{os.environ.get('RANK', '0')}.pt")
    import torch.distributed as dist

    if dist.is_initialized():  # an orderly end (see _hf_parity_worker.py)
        dist.barrier()
        dist.destroy_process_group()
