"""The torch side of the MindSpore tests: lossparity's PyTorch functions on the same inputs.

``python _torch_ref.py IN.npz OUT.npz`` runs in the main (torch) venv; the MindSpore tests call it through
:func:`run` (``LOSSPARITY_TORCH_PYTHON``, default ``.venv/bin/python`` of the checkout). Inputs and outputs are
plain arrays (``allow_pickle=False``). Every key ``K`` of the input that names a job (``job/<name>/...``) gets
its outputs as ``<name>/...``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(inputs: dict[str, np.ndarray], timeout: float = 180) -> dict[str, np.ndarray]:
    """Run the torch references on ``inputs`` in the torch venv and return its outputs."""
    python = os.environ.get("LOSSPARITY_TORCH_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = pathlib.Path(tmp) / "in.npz", pathlib.Path(tmp) / "out.npz"
        np.savez(src, **inputs)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(
            [python, str(pathlib.Path(__file__)), str(src), str(dst)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=str(ROOT),
        )
        if proc.returncode != 0:
            raise RuntimeError(f"torch reference failed ({python}):\n{proc.stdout}\n{proc.stderr}")
        with np.load(dst, allow_pickle=False) as out:
            return {k: out[k] for k in out.files}


def _lm(x: dict[str, np.ndarray], out: dict[str, np.ndarray], name: str) -> None:
    """Per-token NLL, and for each mode the objective, its gradient w.r.t. the logits and the microbatch shares
    under a split of the rows, from lossparity.losses in float64."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from lossparity.losses import modes  # noqa: PLC0415

    # float64 from the float32 inputs: the reference is the exact value the float32 port approximates
    logits = torch.from_numpy(x[f"job/{name}/logits"]).double()
    labels = torch.from_numpy(x[f"job/{name}/labels"]).long()
    mask = torch.from_numpy(x[f"job/{name}/mask"]).double()
    seg = torch.from_numpy(x[f"job/{name}/segment_ids"]).long()
    micro = int(x[f"job/{name}/microbatch_rows"])
    b, s, v = logits.shape
    nll = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), reduction="none").reshape(b, s)
    out[f"{name}/nll"] = nll.numpy()
    for mode in ("per_token", "per_sample", "per_document", "sample_sum"):
        z = logits.clone().requires_grad_(True)
        l2 = F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), reduction="none").reshape(b, s)
        j = modes.objective(mode, l2, mask, segment_ids=seg if mode == "per_document" else None)
        (g,) = torch.autograd.grad(j, z)
        out[f"{name}/{mode}/objective"] = j.detach().numpy()
        out[f"{name}/{mode}/grad"] = g.numpy()
        norms = modes.count_normalizers(mask, seg)
        den = modes.denominator(mode, norms)
        shares = [
            modes.numerator(
                mode,
                nll[r : r + micro],
                mask[r : r + micro],
                segment_ids=seg[r : r + micro] if mode == "per_document" else None,
            ).item()
            / den
            for r in range(0, b, micro)
        ]
        out[f"{name}/{mode}/shares"] = np.array(shares)


def _moe(x: dict[str, np.ndarray], out: dict[str, np.ndarray], name: str) -> None:
    """Switch load balancing per microbatch and the global_running scope over the microbatches of a step."""
    import torch  # noqa: PLC0415

    from lossparity.moe import GlobalRunningCounts, global_running_load_balancing_loss, switch_load_balancing_loss  # noqa: PLC0415

    probs = torch.from_numpy(x[f"job/{name}/probs"]).double()  # [K, T, E]
    counts = torch.from_numpy(x[f"job/{name}/counts"]).double()  # [K, E] (DP-summed)
    tokens = torch.from_numpy(x[f"job/{name}/tokens"])  # [K] (DP-summed)
    topk, coeff = int(x[f"job/{name}/topk"]), float(x[f"job/{name}/coeff"])
    e = probs.shape[-1]
    out[f"{name}/switch"] = np.array(
        [
            switch_load_balancing_loss(probs[m], counts[m], float(tokens[m]), topk, e, coeff).item()
            for m in range(len(probs))
        ]
    )
    state = GlobalRunningCounts()
    out[f"{name}/global_running"] = np.array(
        [
            global_running_load_balancing_loss(
                probs[m], counts[m], float(tokens[m]), state, topk=topk, num_experts=e, coeff=coeff
            ).item()
            for m in range(len(probs))
        ]
    )


def _mtp(x: dict[str, np.ndarray], out: dict[str, np.ndarray], name: str) -> None:
    """lossparity's ``own`` MTP term ``λ·(1/D)·Σ_d J_d`` (float64) and its gradient w.r.t. every depth's logits:
    depth ``d`` predicts the labels rolled left by ``d`` (zero-filled) under the mask rolled the same way."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from lossparity.losses import modes  # noqa: PLC0415

    zm = torch.from_numpy(x[f"job/{name}/mtp_logits"]).double().requires_grad_(True)  # [D, B, S, V]
    labels = torch.from_numpy(x[f"job/{name}/labels"]).long()
    mask = torch.from_numpy(x[f"job/{name}/mask"]).double()
    seg = torch.from_numpy(x[f"job/{name}/segment_ids"]).long()
    mode, scale = str(x[f"job/{name}/mode"]), float(x[f"job/{name}/scale"])
    depths, b, s, v = zm.shape

    def roll(t: torch.Tensor, d: int) -> torch.Tensor:
        return torch.cat([t[:, d:], torch.zeros_like(t[:, :d])], 1)

    terms = []
    for d in range(1, depths + 1):
        nll = F.cross_entropy(zm[d - 1].reshape(-1, v), roll(labels, d).reshape(-1), reduction="none").reshape(b, s)
        terms.append(modes.objective(mode, nll, roll(mask, d), segment_ids=seg if mode == "per_document" else None))
    j = scale * sum(terms) / depths
    (g,) = torch.autograd.grad(j, zm)
    out[f"{name}/objective"] = j.detach().numpy()
    out[f"{name}/grad"] = g.numpy()


JOBS = {"lm": _lm, "moe": _moe, "mtp": _mtp}


def main(src: str, dst: str) -> None:
    with np.load(src, allow_pickle=False) as f:
        x = {k: f[k] for k in f.files}
    out: dict[str, np.ndarray] = {}
    names = sorted({(k.split("/")[1], str(x[k])) for k in x if k.startswith("job/") and k.endswith("/kind")})
    for name, kind in names:
        JOBS[kind](x, out, name)
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
