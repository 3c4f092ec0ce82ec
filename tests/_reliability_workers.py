"""Rank functions of tests/test_reliability_launch.py (importable by spawned ranks)."""

from __future__ import annotations

import time

import torch.distributed as dist


def two_different_errors(rank: int, world: int) -> None:
    """Rank 1 rejects its input; rank 0 fails a moment later with another error."""
    dist.barrier()
    if rank == 1:
        raise ValueError("mask of rank 1, microbatch 0 has values outside {0, 1}")
    time.sleep(1.0)  # well after rank 1, well inside the launcher's 3 s grace period
    raise RuntimeError("rank 0 noticed that a peer left")


def rank_and_world(rank: int, world: int) -> tuple[int, int]:
    """The trivial job: what every rank was told."""
    return rank, world
