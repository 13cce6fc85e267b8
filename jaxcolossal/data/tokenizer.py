"""Tokenizers.

Only a byte-level tokenizer exists for now: every UTF-8 byte of the text is one
token, so the vocabulary has exactly 256 entries and needs no training, no files
and no downloads.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ByteTokenizer", "get_tokenizer", "TOKENIZERS"]


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value, ``vocab_size = 256``."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """Encode ``text`` to its UTF-8 bytes.

        Args:
          text: any ``str``. Characters that UTF-8 cannot encode (lone
            surrogates) are replaced by ``?``.

        Returns:
          1-D writable ``np.ndarray`` of dtype ``uint8`` and shape
          ``[len(text.encode("utf-8"))]``.

        Raises:
          TypeError: if ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects a str, got {type(text).__name__}")
        return np.frombuffer(bytearray(text.encode("utf-8", errors="replace")), dtype=np.uint8)

    def decode(self, ids) -> str:
        """Decode token ids back to text.

        Args:
          ids: array-like of integers in ``[0, 255]`` (any shape; it is
            flattened in C order). numpy arrays, jax arrays and lists work.

        Returns:
          The ``str`` from decoding the bytes as UTF-8 with ``errors="replace"``
          (a window cut in the middle of a multi-byte character decodes to
          U+FFFD instead of failing).

        Raises:
          ValueError: if an id lies outside ``[0, 255]``.
        """
        arr = np.asarray(ids).reshape(-1)
        if arr.size == 0:
            return ""
        if arr.dtype != np.uint8:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"token ids must lie in [0, {self.vocab_size - 1}] for the byte "
                    f"tokenizer, got values in [{lo}, {hi}]"
                )
            arr = arr.astype(np.uint8)
        return arr.tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> ByteTokenizer:
    """Return a tokenizer instance by name.

    Args:
      name: tokenizer name; the allowed values are the keys of ``TOKENIZERS``
        (currently only ``"byte"``).

    Returns:
      A fresh tokenizer object with ``vocab_size``, ``encode`` and ``decode``.

    Raises:
      ValueError: for an unknown name; the message lists the allowed values.
    """
    try:
        cls = TOKENIZERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown tokenizer {name!r}; allowed values: {sorted(TOKENIZERS)}"
        ) from None
    return cls()
