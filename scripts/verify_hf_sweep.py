"""``lossparity verify --hf`` over every decoder-only causal-LM ``model_type`` of the installed transformers.

One family at a time (a fresh ``lossparity verify --hf MODEL_TYPE`` process each, default layouts), writing a
Markdown table row per family as soon as it finishes: the result (PASS / FAIL / exit 2 and its line), the
worst difference over the compared rows, and the wall time. Run by hand, not in CI (minutes per family)::

    nice -n 10 python scripts/verify_hf_sweep.py --out sweep.md [--modes per_token] [--only a,b] [--list]

Decoder-only causal LMs: the ``model_type``s of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` less encoder-decoder
configurations, encoders with a causal-LM head (also in the masked-LM mapping or the sequence-to-sequence
mapping) and composite multimodal configurations (sub-configurations other than DBRX/MPT's ``attn_config`` /
``ffn_config``); ``--list`` prints every family with the reason it is left out, if it is.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

_OWN_SUBCONFIGS = {"attn_config", "ffn_config"}  # DBRX, MPT: parts of one decoder, not other models


def families() -> list[tuple[str, str | None]]:
    """``(model_type, reason it is left out or None)`` for every causal-LM family of transformers."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as ma

    out: list[tuple[str, str | None]] = []
    for mt in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        why = None
        if mt in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            why = "sequence-to-sequence"
        elif mt in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            why = "encoder with a causal-LM head"
        else:
            cls = CONFIG_MAPPING[mt]
            subs = set(getattr(cls, "sub_configs", {}) or {})
            if getattr(cls, "is_encoder_decoder", False) is True:
                why = "encoder-decoder"
            elif subs - _OWN_SUBCONFIGS:
                why = "composite configuration: " + ", ".join(sorted(subs - _OWN_SUBCONFIGS))
        out.append((mt, why))
    return out


def _worst(text: str) -> str:
    """The largest relative difference of the table (every column but ``grads_abs``), as printed."""
    worst, cols = 0.0, []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| layout"):
            cols = cells
        elif line.startswith("| ") and cols:
            for name, c in zip(cols[3:-1], cells[3:-1]):
                if name != "grads_abs" and re.fullmatch(r"[0-9.]+e[+-][0-9]+", c):
                    worst = max(worst, float(c))
    return f"{worst:.1e}"


def _build_only(todo: list[str]) -> int:
    """``OK`` or ``ERR`` and the error's line for each family: the tiny configuration, the model, one forward
    of 2 padded rows and one backward, float64 (what every layout of verify needs first)."""
    import torch

    from lossparity.verify.hf import synthetic_batch
    from lossparity.verify.user_models import build_hf_model, hf_config

    torch.set_num_threads(1)
    ok = 0
    for mt in todo:
        try:
            config = hf_config(mt)
            model = build_hf_model(config, 0, torch.float64).train()
            batch = synthetic_batch(0, config.vocab_size, False)
            out = model(input_ids=batch["input_ids"][:2], attention_mask=batch["attention_mask"][:2])
            out.logits.double().sum().backward()
            ok += 1
            print("OK", mt, flush=True)
        except Exception as e:  # one line per family, whatever transformers raised
            print("ERR", mt, f"{type(e).__name__}:", " ".join(str(e).split())[:200], flush=True)
    print(f"{ok} of {len(todo)} build and run one forward and backward")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="verify_hf_sweep.md", help="Markdown table, appended row by row")
    ap.add_argument("--modes", default=None, help="--modes of each run (default: verify's)")
    ap.add_argument("--only", default=None, help="comma-separated model_types (default: every decoder-only one)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per family (default 900)")
    ap.add_argument("--list", action="store_true", help="print the families and why some are left out")
    ap.add_argument(
        "--build-only",
        action="store_true",
        help="in this process, per family: build the tiny model and run one float64 forward and backward",
    )
    args = ap.parse_args()
    fams = families()
    if args.list:
        for mt, why in fams:
            print(mt, f"(left out: {why})" if why else "")
        print(f"{sum(w is None for _, w in fams)} decoder-only of {len(fams)}")
        return 0
    todo = [mt for mt, why in fams if why is None]
    if args.only:
        todo = [mt for mt in args.only.split(",") if mt]
    if args.build_only:
        return _build_only(todo)
    with open(args.out, "a") as f:
        f.write("| model_type | result | worst difference | wall s | note |\n|---|---|---|---|---|\n")
    counts: dict[str, int] = {}
    start, tracebacks = time.perf_counter(), 0
    for mt in todo:
        cmd = [sys.executable, "-m", "lossparity", "verify", "--hf", mt]
        if args.modes:
            cmd += ["--modes", args.modes]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ.copy())
            code, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired:
            code, out, err = -1, "", f"timed out after {args.timeout:.0f} s"
        wall = time.perf_counter() - t
        result = {0: "PASS", 1: "FAIL", 2: "exit 2"}.get(code, f"exit {code}")
        counts[result] = counts.get(result, 0) + 1
        errs = [x for x in err.splitlines() if x.strip() and "note:" not in x]
        note = next((x for x in out.splitlines() if x.startswith(("FAIL ", "ERROR "))), "")
        if not note and code != 0:
            note = errs[-1] if errs else ""
        floor = next((x for x in out.splitlines() if x.startswith("float32 inside the model")), "")
        if code == 0 and floor:
            note = "float32 floor " + floor.split("its floor is ")[1].split(" ")[0]
        if "Traceback" in err:
            note = "TRACEBACK: " + note
            tracebacks += 1
        note = note.replace("|", "/")[:240]
        with open(args.out, "a") as f:
            f.write(f"| {mt} | {result} | {_worst(out)} | {wall:.0f} | {note} |\n")
        print(mt, result, f"{wall:.0f} s", note, flush=True)
    # the totals line, also under the table: what the docs quote
    order = ["PASS", "FAIL", "exit 2", *sorted(set(counts) - {"PASS", "FAIL", "exit 2"})]
    total = ", ".join(f"{counts.get(k, 0)} {k}" for k in order) + f" of {len(todo)}; {tracebacks} with a traceback"
    total += f" in {(time.perf_counter() - start) / 60:.0f} min"
    with open(args.out, "a") as f:
        f.write(f"\n{total}\n")
    print(total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
