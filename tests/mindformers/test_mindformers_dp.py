"""Data parallelism for real: 2 ``msrun`` CPU workers (MindSpore's ``mccl`` backend, ``_dp_worker.py``), each with
half the rows at GA 2. The objective, its log and its gradient equal the 1-worker values (lossparity's torch
reference of the whole batch); ``global_aux_loss`` with the DP fix equals the torch ``global_running`` scope with
counts and tokens summed over the ranks, and without it reproduces MindFormers 2.0.0 (rank-local counts)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import mindspore as ms
import numpy as np
import pytest
from _data import ASL, B, S, lm_jobs
from _torch_ref import run
from mindspore import Tensor
from test_mindformers_hook import _released_loss

import lossparity.mindspore as lpm

HERE = pathlib.Path(__file__).resolve().parent
E, TOPK, COEFF, K, WORLD = 4, 2, 0.01, 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, np.ndarray]]:
    msrun = pathlib.Path(sys.executable).parent / "msrun"
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "PATH": f"{msrun.parent}{os.pathsep}{os.environ.get('PATH', '')}",  # msrun starts `python`
            "LOSSPARITY_DP_OUT": tmp,
            "LOCAL_DEFAULT_PATH": tmp,
            "GLOG_v": "3",
        }
        cmd = [str(msrun), f"--worker_num={WORLD}", f"--local_worker_num={WORLD}", f"--master_port={_free_port()}"]
        cmd += [f"--log_dir={tmp}/logs", "--join=True", str(HERE / "_dp_worker.py")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480, cwd=tmp)
        logs = "".join(p.read_text() for p in sorted(pathlib.Path(tmp, "logs").glob("worker_*.log")))
        assert proc.returncode == 0, f"msrun failed:\n{proc.stdout[-2000:]}\n{logs[-4000:]}"
        out = []
        for r in range(WORLD):
            with np.load(pathlib.Path(tmp, f"rank{r}.npz"), allow_pickle=False) as f:
                out.append({k: f[k] for k in f.files})
        return out


@pytest.fixture(scope="module")
def reference(ranks) -> dict[str, np.ndarray]:
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    jobs = lm_jobs(lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S).asnumpy(), micros=(B,))
    probs, routing = ranks[0]["aux/probs"], ranks[0]["aux/routing"]
    per_rank, micro = B // WORLD, B // WORLD // K
    # microbatch m of rank r: rows r·per_rank + [m·micro, (m+1)·micro); its S·micro tokens
    tok = [[slice(r * per_rank + m * micro, r * per_rank + (m + 1) * micro) for m in range(K)] for r in range(WORLD)]
    summed = np.stack([sum(routing[tok[r][m]].reshape(-1, E).sum(0) for r in range(WORLD)) for m in range(K)])
    for r in range(WORLD):
        p = np.stack([probs[tok[r][m]].reshape(-1, E) for m in range(K)])
        local = np.stack([routing[tok[r][m]].reshape(-1, E).sum(0) for m in range(K)])
        for name, counts, tokens in (("fixed", summed, WORLD * micro * S), ("released", local, micro * S)):
            jobs.update(
                {
                    f"job/{name}{r}/kind": np.array("moe"),
                    f"job/{name}{r}/probs": p,
                    f"job/{name}{r}/counts": counts.astype(np.float32),
                    f"job/{name}{r}/tokens": np.full(K, tokens, np.float32),
                    f"job/{name}{r}/topk": np.array(TOPK),
                    f"job/{name}{r}/coeff": np.array(COEFF),
                }
            )
    return run(jobs)


@pytest.mark.parametrize("mode", ["per_token", "per_sample", "per_document"])
def test_two_workers_equal_the_one_worker_objective(ranks, reference, mode: str) -> None:
    for out in ranks:
        np.testing.assert_allclose(out[f"{mode}/objective"], reference[f"lm8/{mode}/objective"], rtol=1e-6)
        np.testing.assert_allclose(out[f"{mode}/grad"], reference[f"lm8/{mode}/grad"], rtol=1e-5, atol=1e-6)
        # MindFormers' logged loss as released: the mean of the 4 microbatches' token means (2 ranks × GA 2)
        np.testing.assert_allclose(out[f"{mode}/loss"], _released_loss(B // WORLD // K), rtol=1e-6)


def test_global_aux_loss_dp_fix_on_and_off(ranks, reference) -> None:
    for r, out in enumerate(ranks):
        np.testing.assert_allclose(out["aux/lossparity"], reference[f"fixed{r}/global_running"], rtol=1e-6)
        np.testing.assert_allclose(out["aux/mindformers-2.0.0"], reference[f"released{r}/global_running"], rtol=1e-6)
        assert (
            np.abs(out["aux/lossparity"] - out["aux/mindformers-2.0.0"]).max()
            > 1e-6 * np.abs(out["aux/lossparity"]).max()
        )
