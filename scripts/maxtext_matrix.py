"""Upstream MaxText vs lossparity.maxtext on the ragged 8-row batch of tests/maxtext (target lengths
64, 48, 0, 8, 64, 1, 32, 16), step 0 of a tiny float32 model on CPU: GA × tunix × MTP × packed.

Run in the MaxText venv (``./dev.sh test-maxtext`` creates it)::

    DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu nice .venv-maxtext/bin/python scripts/maxtext_matrix.py [--quick]

``--quick``: the first table of docs/maxtext.md (no packed rows, MTP at GA 1 and 2 only); ``--rest``: only
the runs that ``--quick`` leaves out (the second table). Prints a Markdown
table: learning/loss, learning/lm_loss, learning/raw_grad_norm and learning/mtp_loss per run.
``--indexer``: the third table instead: the DeepSeek-V3.2-style MLA model of tests/maxtext (``INDEXER``,
sparse indexer stage) at λ = indexer_loss_scaling_factor 0 and 1, GA 1, GA 2, GA 2 tunix; its last column is
learning/indexer_loss.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "maxtext"))
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _runs import INDEXER, packed_batch, run  # noqa: E402


def configs(quick: bool, rest: bool = False) -> list[tuple[str, list[str], bool]]:
    """(label, MaxText arguments, packed) of every run of the matrix (``rest``: those ``quick`` leaves out)."""
    if rest:
        everything, first = configs(False), configs(True)
        return [c for c in everything if c not in first]
    out = []
    for mtp in (0, 1):
        for ga, tunix in ((1, False), (2, False), (4, False), (2, True), (4, True)):
            if quick and mtp and (tunix or ga == 4):
                continue
            args = [f"gradient_accumulation_steps={ga}", f"mtp_num_layers={mtp}"]
            if tunix:
                args.append("use_tunix_gradient_accumulation=true")
            label = f"GA {ga}{' tunix' if tunix else ''}{' MTP 1' if mtp else ''}"
            out.append((label, args, False))
    if not quick:
        for ga in (1, 2):
            out.append((f"GA {ga} packed", [f"gradient_accumulation_steps={ga}", "packing=true"], True))
    return out


def indexer_configs() -> list[tuple[str, list[str], bool]]:
    """(label, MaxText arguments, packed) of the indexer table."""
    out = []
    for lam in (0, 1):
        for ga, tunix in ((1, False), (2, False), (2, True)):
            if lam == 0 and ga > 1:
                continue  # λ = 0: the gradient without the indexer term, at GA 1 only
            args = [*INDEXER, f"indexer_loss_scaling_factor={lam}.0", f"gradient_accumulation_steps={ga}"]
            if tunix:
                args.append("use_tunix_gradient_accumulation=true")
            out.append((f"GA {ga}{' tunix' if tunix else ''} λ={lam}", args, False))
    return out


def main() -> None:
    quick, rest, indexer = (f"--{o}" in sys.argv[1:] for o in ("quick", "rest", "indexer"))
    last = "indexer_loss" if indexer else "mtp_loss"
    print(f"| run | objective | learning/loss | learning/lm_loss | raw_grad_norm | learning/{last} |")
    print("|---|---|---|---|---|---|")
    for label, args, packed in indexer_configs() if indexer else configs(quick, rest):
        batch = packed_batch() if packed else None
        for mode in (None, "per_document" if packed else "per_sample"):
            m = run(args, mode=mode, batch=batch)["metrics"][0]
            name = "upstream" if mode is None else f"lossparity {mode}"
            print(
                f"| {label} | {name} | {m['learning/loss']:.7f} | {m['learning/lm_loss']:.9f} | "
                f"{m['learning/raw_grad_norm']:.7f} | {m[f'learning/{last}']:.7f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
