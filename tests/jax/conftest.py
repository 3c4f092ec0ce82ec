"""Shared setup of the JAX tests: 8 forced host devices, float64 enabled, batch factories.

XLA reads ``XLA_FLAGS`` when the JAX backend starts, so the flag is set only around that start and the
previous value is restored at once: nothing leaks into the environment of other tests or of the
subprocesses they spawn. Only the tests under ``tests/jax`` import JAX.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

_FLAG = "--xla_force_host_platform_device_count=8"

if "jax" not in sys.modules:
    _previous = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{_previous} {_FLAG}" if _previous else _FLAG
    try:
        # jax.numpy, not jax: a directory named tests/jax on sys.path would satisfy a bare `import jax`
        pytest.importorskip("jax.numpy")
        import jax

        jax.devices()  # starts the CPU backend while the flag is set
    finally:
        if _previous is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = _previous
else:
    pytest.importorskip("jax.numpy")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

NUM_DEVICES = 8


def make_batch(seed: int, rows: int = 8, seq: int = 16, *, packed: bool = True, long_high: bool = False):
    """A random ``[rows, seq]`` batch as NumPy float64/int arrays: ``(loss, mask, segment_ids)``.

    Rows have different lengths, row 1 has no loss-bearing token (a zero-token sample that must still
    count), and with ``packed`` every row is cut into 1-3 documents (ids 1, 2, ...) followed by padding
    (id 0, mask 0). With ``long_high`` longer rows get higher losses (the covariance of the gap).
    """
    rng = np.random.default_rng(seed)
    loss = rng.uniform(0.1, 5.0, size=(rows, seq))
    mask = np.zeros((rows, seq))
    seg = np.zeros((rows, seq), dtype=np.int64)
    lengths = rng.integers(2, seq + 1, size=rows)
    for i, length in enumerate(lengths):
        mask[i, :length] = rng.uniform(size=length) < 0.85
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(rng.integers(0, 3), length - 1), replace=False))
        bounds = [0, *cuts.tolist(), length]
        for d in range(len(bounds) - 1):
            seg[i, bounds[d] : bounds[d + 1]] = d + 1
        if long_high:
            loss[i] = loss[i] * 0.2 + length
    mask[1] = 0
    if not packed:
        seg = np.where(np.arange(seq)[None, :] < lengths[:, None], 1, 0)
    return loss, mask, seg


@pytest.fixture
def batch():
    return make_batch
