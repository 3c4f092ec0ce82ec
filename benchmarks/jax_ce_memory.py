"""Compiled temporary memory of the JAX cross-entropies (forward + backward), from XLA's own accounting.

``python -m benchmarks.jax_ce_memory`` prints, for float32 ``T×V×H`` with tiles of 256 tokens × 2048
vocabulary rows, ``jax.jit(grad).lower(...).compile().memory_analysis().temp_size_in_bytes`` of the naive
(full logits), chunked (recompute) and fused (gradients in the forward) programs, next to one ``[T, V]``
float32 buffer. Compiles only (no run), so it is cheap on any machine.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import lossparity.jax as lpj


def temp_bytes(t: int, v: int, h: int, chunk: int, vchunk: int) -> dict[str, int]:
    """``{method: compiled temp bytes}`` of ``grad`` w.r.t. hidden and weight of the summed losses."""
    shapes = (
        jax.ShapeDtypeStruct((t, h), jnp.float32),
        jax.ShapeDtypeStruct((v, h), jnp.float32),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )
    tiles = dict(chunk_size=chunk, vocab_chunk_size=vchunk)
    losses = {
        "naive": lambda a, b, y: lpj.naive_cross_entropy(a, b, y).sum(),
        "chunked": lambda a, b, y: lpj.chunked_cross_entropy(a, b, y, **tiles).sum(),
        "fused": lambda a, b, y: lpj.fused_linear_cross_entropy(a, b, y, jnp.ones(y.shape), **tiles)[0],
    }
    out = {}
    for name, f in losses.items():
        grad = jax.grad(f, argnums=(0, 1))
        out[name] = jax.jit(grad).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    return out


def main() -> None:
    """Print the table of docs/jax.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(2048, 16384, 64), metavar=("T", "V", "H"))
    args = parser.parse_args()
    t, v, h = args.shape
    print(f"T×V×H = {t}×{v}×{h}, tiles 256×2048, one [T, V] float32 buffer = {t * v * 4 / 2**20:.1f} MiB")
    for name, size in temp_bytes(t, v, h, 256, 2048).items():
        print(f"{name:8s} temp {size / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
