"""Tokenizers of the reference trainer: the byte-level one and a Hugging Face wrapper."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np

from .batch import BOS_ID, EOS_ID, NUM_SPECIAL, PAD_ID

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer"]


class Tokenizer(Protocol):
    """What a corpus needs from a tokenizer: ``encode`` (no special tokens), special ids, vocab size."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 byte tokenizer: byte ``v`` (0..255) has id ``v + NUM_SPECIAL``; ids 0..2 are PAD/BOS/EOS.

    ``vocab_size = 256 + NUM_SPECIAL = 259``. ``encode`` returns the ids of the text's UTF-8 bytes without
    special tokens; ``decode`` drops special ids and decodes the bytes (invalid UTF-8 is replaced).
    """

    pad_id = PAD_ID

    @property
    def vocab_size(self) -> int:
        """``256 + NUM_SPECIAL``."""
        return 256 + NUM_SPECIAL

    @property
    def bos_id(self) -> int:
        """``BOS_ID``."""
        return BOS_ID

    @property
    def eos_id(self) -> int:
        """``EOS_ID``."""
        return EOS_ID

    def encode(self, text: str) -> list[int]:
        """Ids ``byte + NUM_SPECIAL`` of the UTF-8 encoding of ``text`` (no BOS/EOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return (raw.astype(np.int64) + NUM_SPECIAL).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of :meth:`encode`: special ids (``< NUM_SPECIAL``) are dropped; ids must be ``< 259``."""
        arr = np.asarray(list(ids), dtype=np.int64)
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), found {bad[:3].tolist()}")
        return (arr[arr >= NUM_SPECIAL] - NUM_SPECIAL).astype(np.uint8).tobytes().decode("utf-8", "replace")


class HFTokenizer:
    """Thin wrapper of a Hugging Face tokenizer (``AutoTokenizer.from_pretrained(name_or_path)``).

    Needs the optional ``transformers`` package, imported only here. ``encode`` never adds special
    tokens (the corpus adds BOS/EOS from ``bos_id``/``eos_id``, which may be ``None``); ``vocab_size`` is
    ``len(tokenizer)`` (base vocabulary plus added tokens).
    """

    def __init__(self, name_or_path: str | os.PathLike[str], **kwargs: Any) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(
                "HFTokenizer needs the optional 'transformers' package, which is not installed; "
                "install it or use ByteTokenizer"
            ) from e
        self._tok = AutoTokenizer.from_pretrained(str(name_or_path), **kwargs)

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``."""
        return len(self._tok)

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's BOS id, or ``None``."""
        return self._tok.bos_token_id

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's EOS id, or ``None``."""
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        # one sequence of ids decodes to one string (the stub's ``list[str]`` is for batched input)
        return cast(str, self._tok.decode(list(ids), skip_special_tokens=True))
