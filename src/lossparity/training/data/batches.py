"""Global batches: the documents of a step, their packing into rows, and the layout split."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .batch import IGNORE_INDEX, PAD_ID, Batch
from .corpora import Corpus, _excl_cumsum

__all__ = ["stream_documents", "default_docs_per_step", "global_batch", "split_batch"]


@lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch, 0xE90C]).permutation(n)
    perm.setflags(write=False)
    return perm


def stream_documents(corpus: Corpus, seed: int, start: int, count: int) -> np.ndarray:
    """Document indices at positions ``[start, start + count)`` of the corpus's deterministic stream.

    Unbounded or unshuffled corpora: position ``p`` is document ``p mod num_documents`` (``p`` when
    unbounded). Shuffled finite corpora of ``n`` documents: position ``p`` is ``perm_e[p mod n]`` with
    epoch ``e = p // n`` and ``perm_e`` a permutation seeded by ``(seed, e)``. O(count + n), not O(start).
    """
    if start < 0 or count < 0 or seed < 0:
        raise ValueError(f"seed, start and count must be >= 0, got seed={seed}, start={start}, count={count}")
    pos = np.arange(start, start + count, dtype=np.int64)
    n = corpus.num_documents
    if n is None:
        return pos
    if not corpus.shuffle:
        return pos % n
    out = np.empty_like(pos)
    epochs = pos // n
    for e in np.unique(epochs).tolist():
        sel = epochs == e
        out[sel] = _epoch_permutation(int(seed), int(e), int(n))[pos[sel] % n]
    return out


def _first_fit(need: np.ndarray, num_rows: int, seq_len: int) -> tuple[np.ndarray, ...]:
    """Place documents (in order) into the first row with ``need`` free positions; skip the rest."""
    free = np.full(num_rows, seq_len, dtype=np.int64)
    count = np.zeros(num_rows, dtype=np.int64)
    chosen, rows, offsets, segs = [], [], [], []
    for i, k in enumerate(need.tolist()):
        if k == 0:
            continue
        r = int(np.argmax(free >= k))
        if free[r] < k:
            if free.max() == 0:
                break
            continue
        chosen.append(i)
        rows.append(r)
        offsets.append(seq_len - int(free[r]))
        count[r] += 1
        segs.append(int(count[r]))
        free[r] -= k
    as_arr = [np.asarray(x, dtype=np.int64) for x in (chosen, rows, offsets, segs)]
    return tuple(as_arr)


def _assemble(
    flat: np.ndarray,
    lens: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    segs: np.ndarray | None,
    num_rows: int,
    seq_len: int,
) -> Batch:
    """Write documents (each cut to ``seq_len + 1`` tokens) at (row, offset) and derive the targets."""
    occupied = np.minimum(lens, seq_len)
    src = _excl_cumsum(lens)
    doc = np.repeat(np.arange(lens.size, dtype=np.int64), occupied)
    j = np.arange(doc.size, dtype=np.int64) - np.repeat(_excl_cumsum(occupied), occupied)
    dest = rows[doc] * seq_len + offsets[doc] + j
    tokens = np.full(num_rows * seq_len, PAD_ID, dtype=np.int64)
    tokens[dest] = flat[src[doc] + j]
    labels = np.full(num_rows * seq_len, IGNORE_INDEX, dtype=np.int64)
    has_next = j + 1 < lens[doc]
    labels[dest[has_next]] = flat[(src[doc] + j + 1)[has_next]]
    positions = np.zeros(num_rows * seq_len, dtype=np.int64)
    positions[dest] = j
    seg_t = None
    if segs is not None:
        seg = np.zeros(num_rows * seq_len, dtype=np.int64)
        seg[dest] = segs[doc]
        seg_t = torch.from_numpy(seg).view(num_rows, seq_len)
    labels_t = torch.from_numpy(labels).view(num_rows, seq_len)
    return Batch(
        tokens=torch.from_numpy(tokens).view(num_rows, seq_len),
        labels=labels_t,
        mask=(labels_t != IGNORE_INDEX).to(torch.float32),
        segment_ids=seg_t,
        positions=torch.from_numpy(positions).view(num_rows, seq_len),
    )


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def default_docs_per_step(corpus: Corpus, global_batch_size: int, seq_len: int) -> int:
    """Candidate documents per packed step: ``ceil(1.25 · N · S / mean(min(len, S)))``.

    The 25% margin makes unfilled rows rare for heavy-tailed lengths; candidates that do not fit are
    skipped (never generated for the synthetic corpus).
    """
    mean = max(corpus.mean_length(cap=seq_len), 1.0)
    return max(1, math.ceil(1.25 * global_batch_size * seq_len / mean))


def global_batch(
    corpus: Corpus,
    step: int,
    *,
    global_batch_size: int,
    seq_len: int,
    packed: bool,
    seed: int,
    docs_per_step: int | None = None,
) -> Batch:
    """The global batch (``N = global_batch_size`` rows of ``S = seq_len`` tokens) of optimizer step ``step``.

    A pure function of its arguments. Every document is cut to its first ``S + 1`` tokens and occupies
    ``min(len, S)`` positions of a row (see the module docstring for labels).

    - Padded (``packed=False``): row ``r`` is document ``stream[step·N + r]`` alone, right-padded;
      ``segment_ids`` is ``None``.
    - Packed (``packed=True``): the candidates are the ``M = docs_per_step`` documents
      ``stream[step·M .. (step+1)·M)`` (default :func:`default_docs_per_step`). In stream order each goes
      whole into the *first* row with enough free positions (first fit, documents are never split); a
      candidate that fits nowhere is skipped. Segment ids number a row's documents ``1, 2, ...`` from
      left to right; trailing padding has id 0.

    ``stream`` is :func:`stream_documents` with ``seed``; resume at any step costs one batch.
    """
    step = _check_int("step", step, 0)
    n_rows = _check_int("global_batch_size", global_batch_size, 1)
    s_len = _check_int("seq_len", seq_len, 1)
    seed = _check_int("seed", seed, 0)
    if not isinstance(corpus, Corpus):
        raise TypeError(f"corpus must be a Corpus, got {type(corpus).__name__}")
    if not packed:
        idx = stream_documents(corpus, seed, step * n_rows, n_rows)
        flat, lens = corpus.gather(idx, s_len + 1)
        rows = np.arange(n_rows, dtype=np.int64)
        return _assemble(flat, lens, rows, np.zeros(n_rows, dtype=np.int64), None, n_rows, s_len)
    if docs_per_step is None:
        m = default_docs_per_step(corpus, n_rows, s_len)
    else:
        m = _check_int("docs_per_step", docs_per_step, 1)
    idx = stream_documents(corpus, seed, step * m, m)
    need = np.minimum(corpus.lengths(idx), s_len)
    chosen, rows, offsets, segs = _first_fit(need, n_rows, s_len)
    flat, lens = corpus.gather(idx[chosen], s_len + 1)
    return _assemble(flat, lens, rows, offsets, segs, n_rows, s_len)


def split_batch(batch: Batch, dp_size: int, dp_rank: int, grad_accum: int, microbatch_size: int) -> list[Batch]:
    """The ``K = grad_accum`` microbatches of data-parallel rank ``d = dp_rank`` (views, no copy).

    Requires ``N = D·K·b`` (``D = dp_size``, ``b = microbatch_size``). Microbatch ``k`` of rank ``d`` is
    rows ``[d·K·b + k·b, d·K·b + (k+1)·b)`` of the global batch, so concatenating all microbatches in
    (rank, microbatch) order gives back the global batch.
    """
    d_size = _check_int("dp_size", dp_size, 1)
    k_acc = _check_int("grad_accum", grad_accum, 1)
    b = _check_int("microbatch_size", microbatch_size, 1)
    rank = _check_int("dp_rank", dp_rank, 0)
    if rank >= d_size:
        raise ValueError(f"dp_rank must be in [0, dp_size={d_size}), got {rank}")
    if batch.num_rows != d_size * k_acc * b:
        raise ValueError(
            f"global batch has N={batch.num_rows} rows but dp_size*grad_accum*microbatch_size = "
            f"{d_size}*{k_acc}*{b} = {d_size * k_acc * b}"
        )
    base = rank * k_acc * b
    return [batch.rows(base + k * b, base + (k + 1) * b) for k in range(k_acc)]
