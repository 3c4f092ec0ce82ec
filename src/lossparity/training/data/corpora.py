"""Corpora of the reference trainer: token lists, text files, JSONL and the synthetic corpus."""

from __future__ import annotations

import json
import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .batch import BOS_ID, NUM_SPECIAL
from .tokenizers import Tokenizer

__all__ = ["Corpus", "TokenListCorpus", "TextFileCorpus", "JsonlCorpus", "SyntheticCorpus"]


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), dtype=np.int64)
    if len(x) > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


def _as_indices(indices: Sequence[int] | np.ndarray, num_documents: int | None) -> np.ndarray:
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    bad = idx < 0 if num_documents is None else (idx < 0) | (idx >= num_documents)
    if bad.any():
        limit = "" if num_documents is None else f", {num_documents})"
        raise IndexError(f"document indices must be in [0{limit or ', inf)'}, got {idx[bad][:3].tolist()}")
    return idx


class Corpus(ABC):
    """A deterministic, random-access collection of tokenized documents.

    Subclasses implement :meth:`lengths` and :meth:`gather`; ``num_documents`` is ``None`` for an
    unbounded corpus. ``shuffle`` tells :func:`stream_documents` whether to visit a finite corpus in a
    per-epoch random order (True) or in index order (False).
    """

    vocab_size: int
    num_documents: int | None
    shuffle: bool

    @abstractmethod
    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts (BOS included) of the documents ``indices``, int64 ``[len(indices)]``."""

    @abstractmethod
    def gather(self, indices: Sequence[int] | np.ndarray, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated tokens of documents ``indices``, each cut to its first ``max_len`` tokens.

        Returns ``(flat, lens)``: ``lens[j] = min(len_j, max_len)`` and ``flat`` (int64) holds the
        documents back to back in the order of ``indices``.
        """

    def document(self, i: int) -> Tensor:
        """Token ids (int64 ``[len_i]``) of document ``i``."""
        flat, _ = self.gather([i])
        return torch.from_numpy(flat)

    def __getitem__(self, i: int) -> Tensor:
        return self.document(i)

    def mean_length(self, cap: int | None = None) -> float:
        """Mean of ``min(len_i, cap)`` over the corpus (over documents ``0..8191`` when unbounded)."""
        cache = self.__dict__.setdefault("_mean_length_cache", {})
        if cap not in cache:
            n = 8192 if self.num_documents is None else self.num_documents
            lens = self.lengths(np.arange(n, dtype=np.int64))
            if cap is not None:
                lens = np.minimum(lens, cap)
            cache[cap] = float(lens.mean()) if lens.size else 0.0
        return cache[cap]


class TokenListCorpus(Corpus):
    """In-memory corpus of already tokenized documents (each a sequence of ids in ``[0, vocab_size)``)."""

    num_documents: int  # always known for an in-memory corpus

    def __init__(self, documents: Sequence[Sequence[int]], vocab_size: int, *, shuffle: bool = True) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in documents]
        if not arrays:
            raise ValueError("documents is empty: a corpus needs at least one document")
        lens = np.array([a.size for a in arrays], dtype=np.int64)
        flat = np.concatenate(arrays) if lens.sum() else np.zeros(0, dtype=np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, vocab_size={vocab_size}), found [{flat.min()}, {flat.max()}]")
        self._flat = flat
        self._offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.vocab_size = int(vocab_size)
        self.num_documents = len(arrays)
        self.shuffle = shuffle

    def __len__(self) -> int:
        return int(self.num_documents)

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts of documents ``indices``."""
        idx = _as_indices(indices, self.num_documents)
        return self._offsets[idx + 1] - self._offsets[idx]

    def gather(self, indices: Sequence[int] | np.ndarray, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Corpus.gather`."""
        idx = _as_indices(indices, self.num_documents)
        lens = self._offsets[idx + 1] - self._offsets[idx]
        if max_len is not None:
            lens = np.minimum(lens, max_len)
        j = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(_excl_cumsum(lens), lens)
        return self._flat[np.repeat(self._offsets[idx], lens) + j], lens


def _encode_documents(texts: Sequence[str], tokenizer: Tokenizer, add_eos: bool) -> list[list[int]]:
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if add_eos and tokenizer.eos_id is not None else []
    return [bos + tokenizer.encode(t) + eos for t in texts]


def _read_text(path: str | os.PathLike[str]) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file not found: {os.fspath(path)!r}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:  # a binary file: name it instead of failing deep in the decoder
        raise ValueError(
            f"corpus file {os.fspath(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
            "--data takes a .txt or .jsonl file"
        ) from None


_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")


class TextFileCorpus(TokenListCorpus):
    """Plain-text corpus: one document per *paragraph* (paragraphs are separated by blank lines).

    A blank line is an empty or whitespace-only line; several in a row count as one break. Each
    paragraph is stripped of leading/trailing whitespace (inner newlines are kept) and encoded as
    ``[BOS] + tokenizer.encode(paragraph) (+ [EOS] if add_eos)``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: Tokenizer,
        *,
        add_eos: bool = False,
        shuffle: bool = True,
    ) -> None:
        text = _read_text(path).replace("\r\n", "\n")
        paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(text)]
        paragraphs = [p for p in paragraphs if p]
        if not paragraphs:
            raise ValueError(f"corpus file {os.fspath(path)!r} has no documents (no non-blank paragraph)")
        self.path = os.fspath(path)
        super().__init__(_encode_documents(paragraphs, tokenizer, add_eos), tokenizer.vocab_size, shuffle=shuffle)


class JsonlCorpus(TokenListCorpus):
    """JSON-lines corpus: each non-blank line is a JSON object whose string ``field`` is one document.

    Blank lines are skipped; a line that is not valid JSON, not an object, or lacks a string ``field``
    raises ``ValueError`` naming ``path:line``. Empty strings are kept (a 1-token ``[BOS]`` document).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: Tokenizer,
        field: str = "text",
        *,
        add_eos: bool = False,
        shuffle: bool = True,
    ) -> None:
        texts: list[str] = []
        where = os.fspath(path)
        for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}:{lineno}: invalid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{where}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            if not isinstance(obj.get(field), str):
                got = "missing" if field not in obj else type(obj[field]).__name__
                raise ValueError(f"{where}:{lineno}: field {field!r} must be a string, got {got}")
            texts.append(obj[field])
        if not texts:
            raise ValueError(f"corpus file {where!r} has no documents")
        self.path = where
        super().__init__(_encode_documents(texts, tokenizer, add_eos), tokenizer.vocab_size, shuffle=shuffle)


# Counter-based random numbers: u(seed, doc, stream, counter) = splitmix64 finalizer of a key mixed from
# its arguments. Unlike a per-document Generator this vectorizes over all documents of a batch, and
# document i stays a pure function of (seed, i) that never touches a global RNG.
_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
_TAG_LEN1, _TAG_LEN2, _TAG_TOPIC, _TAG_MOTIF, _TAG_NOISE, _TAG_NOISE_TOKEN = range(1, 7)


def _mix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(30))
        x = x * _MIX1
        x = x ^ (x >> _U64(27))
        x = x * _MIX2
        return x ^ (x >> _U64(31))


def _uniform(keys: np.ndarray, tag: int, counter: np.ndarray | int) -> np.ndarray:
    """Uniform floats in ``[0, 1)``, a pure function of ``(key, tag, counter)`` (53 random bits)."""
    c = np.asarray(counter, dtype=np.int64).astype(_U64)
    with np.errstate(over="ignore"):
        h = _mix64(keys ^ _mix64(c * _GOLDEN + _U64(tag) * _MIX2))
    return (h >> _U64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


class SyntheticCorpus(Corpus):
    """Embedded, unbounded, deterministic corpus with heavy-tailed lengths and learnable structure.

    Document ``i`` is a pure function of ``(seed, i)`` (counter-based hashing, never a global RNG):

    - length ``n_i = clip(floor(exp(log(median_len) + sigma·z)), min_len, max_len)`` with ``z`` standard
      normal (a discretized log-normal: many short documents, a few long ones); ``n_i`` includes BOS;
    - a topic ``c`` uniform over ``num_topics``; each topic owns ``motifs_per_topic`` fixed motifs (token
      strings of ``motif_len[0]..motif_len[1]`` tokens drawn from a topic-private pool of ``topic_vocab``
      content ids), fixed by ``seed``;
    - content = ``[BOS]`` followed by motifs of topic ``c`` drawn i.i.d. with Zipf weights ``∝ 1/(k+1)``,
      concatenated and cut to ``n_i - 1`` tokens;
    - each content token is independently replaced, with probability
      ``p_i = min(1, noise_short · (min_len / n_i) ** noise_exponent)``, by a uniform content id.

    Content ids are ``NUM_SPECIAL .. vocab_size - 1``. With the default ``noise_exponent > 0`` long
    documents are *easier* per token (less noise, and more context to identify the topic), so
    ``Cov(n, l) < 0``: the per-token mean loss is *below* the per-sample mean loss by
    ``Cov(n, l) / mean(n)``. ``noise_exponent < 0`` makes long documents harder (gap of the other sign).
    ``num_documents`` is ``None`` (unbounded); :func:`stream_documents` visits index order.
    """

    num_documents = None
    shuffle = False

    def __init__(
        self,
        vocab_size: int = 256,
        seed: int = 0,
        *,
        num_topics: int = 16,
        motifs_per_topic: int = 8,
        topic_vocab: int = 24,
        motif_len: tuple[int, int] = (2, 6),
        median_len: float = 32.0,
        sigma: float = 1.0,
        min_len: int = 8,
        max_len: int = 1024,
        noise_short: float = 0.5,
        noise_exponent: float = 0.5,
    ) -> None:
        content = vocab_size - NUM_SPECIAL
        if content < 2:
            raise ValueError(f"vocab_size must be >= {NUM_SPECIAL + 2}, got {vocab_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if num_topics < 1 or motifs_per_topic < 1:
            raise ValueError(f"num_topics and motifs_per_topic must be >= 1, got {num_topics}, {motifs_per_topic}")
        if not 1 <= topic_vocab <= content:
            raise ValueError(f"topic_vocab must be in [1, vocab_size - {NUM_SPECIAL}={content}], got {topic_vocab}")
        if len(motif_len) != 2 or not 1 <= motif_len[0] <= motif_len[1]:
            raise ValueError(f"motif_len must be (lo, hi) with 1 <= lo <= hi, got {motif_len}")
        if not 2 <= min_len <= max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if median_len <= 0 or sigma < 0:
            raise ValueError(f"need median_len > 0 and sigma >= 0, got median_len={median_len}, sigma={sigma}")
        if not 0 <= noise_short <= 1:
            raise ValueError(f"noise_short must be in [0, 1], got {noise_short}")
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.min_len, self.max_len = int(min_len), int(max_len)
        self.median_len, self.sigma = float(median_len), float(sigma)
        self.noise_short, self.noise_exponent = float(noise_short), float(noise_exponent)
        self.num_topics = int(num_topics)
        self._content = content

        rng = np.random.default_rng([self.seed, 0x70_91C5])
        lo, hi = motif_len
        pools = np.stack([rng.choice(content, size=topic_vocab, replace=False) for _ in range(num_topics)])
        pick = rng.integers(0, topic_vocab, size=(num_topics, motifs_per_topic, hi))
        self._motifs = (
            np.take_along_axis(pools[:, None, :], pick.reshape(num_topics, 1, -1), axis=2).reshape(
                num_topics, motifs_per_topic, hi
            )
            + NUM_SPECIAL
        )
        self._motif_len = rng.integers(lo, hi + 1, size=(num_topics, motifs_per_topic)).astype(np.int64)
        self._min_motif = int(lo)
        w = 1.0 / np.arange(1, motifs_per_topic + 1)
        self._motif_cdf = np.cumsum(w / w.sum())
        self._seed_key = _mix64(np.array([self.seed], dtype=_U64) ^ _U64(0x5EED_0F_D0C5))

    def _keys(self, idx: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return _mix64(self._seed_key ^ _mix64(idx.astype(_U64) * _GOLDEN + _U64(0xD0C)))

    def _lengths_of(self, keys: np.ndarray) -> np.ndarray:
        u1 = _uniform(keys, _TAG_LEN1, 0)
        u2 = _uniform(keys, _TAG_LEN2, 0)
        z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
        log_n = np.clip(math.log(self.median_len) + self.sigma * z, 0.0, math.log(self.max_len + 1))
        return np.clip(np.floor(np.exp(log_n)).astype(np.int64), self.min_len, self.max_len)

    def noise_prob(self, lengths: np.ndarray) -> np.ndarray:
        """Per-document noise rate ``min(1, noise_short · (min_len / n) ** noise_exponent)``."""
        n = np.asarray(lengths, dtype=np.float64)
        return np.minimum(1.0, self.noise_short * (self.min_len / n) ** self.noise_exponent)

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts (BOS included) of documents ``indices``, without generating them."""
        return self._lengths_of(self._keys(_as_indices(indices, None)))

    def topics(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Topic of each document of ``indices``."""
        keys = self._keys(_as_indices(indices, None))
        return self._topics_of(keys)

    def _topics_of(self, keys: np.ndarray) -> np.ndarray:
        topic = (_uniform(keys, _TAG_TOPIC, 0) * self.num_topics).astype(np.int64)
        return np.minimum(topic, self.num_topics - 1)

    def gather(self, indices: Sequence[int] | np.ndarray, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Corpus.gather`; a cut document is exactly the prefix of the full one."""
        idx = _as_indices(indices, None)
        keys = self._keys(idx)
        full = self._lengths_of(keys)
        lens = full if max_len is None else np.minimum(full, max_len)
        n_content = np.maximum(lens - 1, 0)
        topic = self._topics_of(keys)

        # Draw enough motifs per document (each has >= min_motif tokens), expand them to tokens, cut.
        n_choice = -(-n_content // self._min_motif)
        ch_doc = np.repeat(np.arange(idx.size, dtype=np.int64), n_choice)
        ch_k = np.arange(ch_doc.size, dtype=np.int64) - np.repeat(_excl_cumsum(n_choice), n_choice)
        u = _uniform(keys[ch_doc], _TAG_MOTIF, ch_k)
        motif = np.minimum(np.searchsorted(self._motif_cdf, u, side="right"), len(self._motif_cdf) - 1)
        ch_topic = topic[ch_doc]
        ch_len = self._motif_len[ch_topic, motif]
        e_ch = np.repeat(np.arange(ch_doc.size, dtype=np.int64), ch_len)
        e_off = np.arange(e_ch.size, dtype=np.int64) - np.repeat(_excl_cumsum(ch_len), ch_len)
        e_doc = ch_doc[e_ch]
        doc_expanded = np.bincount(ch_doc, weights=ch_len, minlength=idx.size).astype(np.int64)
        e_pos = np.arange(e_ch.size, dtype=np.int64) - _excl_cumsum(doc_expanded)[e_doc]
        keep = e_pos < n_content[e_doc]
        e_ch, e_off, e_doc, e_pos = e_ch[keep], e_off[keep], e_doc[keep], e_pos[keep]
        tok = self._motifs[ch_topic[e_ch], motif[e_ch], e_off]

        p = self.noise_prob(full)
        noisy = _uniform(keys[e_doc], _TAG_NOISE, e_pos) < p[e_doc]
        repl = (_uniform(keys[e_doc], _TAG_NOISE_TOKEN, e_pos) * self._content).astype(np.int64) + NUM_SPECIAL
        tok = np.where(noisy, repl, tok)

        flat = np.empty(int(lens.sum()), dtype=np.int64)
        starts = _excl_cumsum(lens)
        flat[starts[lens > 0]] = BOS_ID
        flat[starts[e_doc] + 1 + e_pos] = tok
        return flat, lens
