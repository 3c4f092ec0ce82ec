"""Data pipeline of the reference trainer: corpora, tokenizers, global batches and their layout split.

Conventions used everywhere below:

- Special token ids: ``PAD_ID = 0``, ``BOS_ID = 1``, ``EOS_ID = 2`` (``NUM_SPECIAL = 3``). Every document
  starts with ``BOS`` (when the tokenizer has one); ``EOS`` is appended only on request (``add_eos``).
  Padding positions of a :class:`Batch` always hold ``PAD_ID`` whatever the tokenizer, because they are
  masked out of every loss and (in packed mode) carry segment id 0.
- Labels are next-token targets *within a document*: position ``t`` predicts token ``t+1`` of the same
  document; the last token of a document and every padding position have label ``IGNORE_INDEX = -100``
  and mask 0. A document longer than ``seq_len + 1`` tokens is truncated to its first ``seq_len + 1``
  tokens: it fills a whole row and its last input position predicts token ``seq_len`` of the document.
- The global batch of optimizer step ``s`` is a pure function of
  ``(corpus, seed, s, global_batch_size, seq_len, packed, docs_per_step)``: every parallel layout sees the
  same rows, and resuming at step ``s`` costs one batch, not ``s``.
- Layout convention (project-wide): data-parallel rank ``d`` holds rows ``[d·K·b, (d+1)·K·b)`` of the
  global batch and its microbatch ``k`` is rows ``[d·K·b + k·b, d·K·b + (k+1)·b)``.

Modules: :mod:`.batch` (:class:`Batch`, token ids), :mod:`.tokenizers`, :mod:`.corpora` and
:mod:`.batches` (global batches and their split); every name is importable from this package.
"""

from .batch import BOS_ID, EOS_ID, IGNORE_INDEX, NUM_SPECIAL, PAD_ID, Batch
from .batches import default_docs_per_step, global_batch, split_batch, stream_documents
from .corpora import Corpus, JsonlCorpus, SyntheticCorpus, TextFileCorpus, TokenListCorpus
from .tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "PAD_ID",
    "BOS_ID",
    "EOS_ID",
    "NUM_SPECIAL",
    "IGNORE_INDEX",
    "Batch",
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "Corpus",
    "TokenListCorpus",
    "TextFileCorpus",
    "JsonlCorpus",
    "SyntheticCorpus",
    "stream_documents",
    "default_docs_per_step",
    "global_batch",
    "split_batch",
]
