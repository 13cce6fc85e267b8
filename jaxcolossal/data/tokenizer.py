"""Tokenizers.

* ``byte`` (the default): every UTF-8 byte of the text is one token, so the vocabulary has
  exactly 256 entries and needs no training, no files and no downloads.
* A local Hugging Face tokenizer (a folder holding ``tokenizer.json``, or that file), loaded with
  the ``tokenizers`` library (:class:`HFTokenizer`): what a LLaMA or GPT-2 checkpoint ships with.
* A SentencePiece ``tokenizer.model`` (or a folder holding one and no ``tokenizer.json``), loaded
  with the ``sentencepiece`` library (:class:`SentencePieceTokenizer`).

Two encodings: ``encode`` adds no special token (corpus documents, joined by the end-of-text id;
chat text rendered by a template that writes its own ``bos_token``); ``encode_prompt`` encodes a
prompt as the model's own tokenizer does by default, as ``transformers.AutoTokenizer(folder)(text)``
does: the ``tokenizer.json`` post-processor applied (LLaMA 3's ``<|begin_of_text|>``, Mistral's
``<s>``, Gemma's ``<bos>``; nothing for Qwen or GPT-2).
"""
from __future__ import annotations

import json
import os

import numpy as np
from tokenizers import Tokenizer

from jaxcolossal.errors import DependencyError, TokenizerError

__all__ = ["ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "get_tokenizer", "TOKENIZERS"]


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value, ``vocab_size = 256``."""

    name = "byte"
    vocab_size = 256
    dtype = np.uint8

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

    def encode_prompt(self, text: str) -> np.ndarray:
        """:meth:`encode`: bytes have no special tokens to add."""
        return self.encode(text)

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


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (Rust, multi-threaded).

    ``vocab_size`` counts the added special tokens; ``eos_id`` is the id of the end-of-text token
    named by ``tokenizer_config.json``'s ``eos_token`` beside the file, else of the first of
    ``</s>``, ``<|end_of_text|>``, ``<|endoftext|>``, ``<eos>`` the vocabulary holds, else None.
    ``encode`` adds no special tokens (documents are joined with ``eos_id`` by the corpus);
    ``encode_prompt`` adds what the file's post-processor adds (as transformers does by default).

    Raises:
        FileNotFoundError: ``path`` is neither a ``tokenizer.json`` nor a folder holding one.
        ValueError: the file is not a tokenizer the library can read.
    """

    EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")

    def __init__(self, path: str):

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"data.tokenizer={path!r}: no tokenizer.json there (a Hugging Face "
                                    "tokenizer folder or its tokenizer.json file, or 'byte')")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise TokenizerError(f"data.tokenizer={path!r}: {file} is not a readable tokenizers file: {e}") from None
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(os.path.dirname(os.path.abspath(file)))
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32

    def _find_eos(self, folder: str) -> int | None:
        names = list(self.EOS_CANDIDATES)
        cfg = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                eos = json.load(f).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> np.ndarray:
        """Ids of ``text`` (no special tokens added): 1-D ``uint16`` (vocabulary ≤ 65536) or ``uint32``."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode expects a str, got {type(text).__name__}")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def encode_prompt(self, text: str) -> np.ndarray:
        """Ids of ``text`` as a prompt: with the special tokens the ``tokenizer.json`` post-processor
        adds (LLaMA 3's ``<|begin_of_text|>`` first), equal to ``AutoTokenizer(folder)(text).input_ids``
        (transformers 5 takes the post-processor from ``tokenizer.json`` and ignores
        ``tokenizer_config.json``'s ``add_bos_token`` when that file exists). 1-D, :attr:`dtype`."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode_prompt expects a str, got {type(text).__name__}")
        return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, dtype=self.dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode` of many texts at once, on the library's thread pool."""
        return [np.asarray(e.ids, dtype=self.dtype)
                for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Text of the ids (any shape, flattened). Raises ValueError for ids outside the vocabulary."""
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size - 1}], got [{arr.min()}, {arr.max()}]")
        return self._tok.decode([int(i) for i in arr], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` (LLaMA-1/2's format) through the ``sentencepiece`` library.

    ``vocab_size`` is the model's piece count; ``eos_id`` its end-of-sentence id (None when it has
    none). ``encode`` adds no BOS/EOS; ``encode_prompt`` adds BOS (EOS) when the
    ``tokenizer_config.json`` beside the model sets ``add_bos_token`` (``add_eos_token``) true, as
    transformers builds the post-processor of a tokenizer converted from ``tokenizer.model``.

    Raises:
        ImportError: without the ``sentencepiece`` package.
        ValueError: a file the library cannot load.
    """

    def __init__(self, path: str):
        try:
            import sentencepiece  # optional (the data extra): SentencePiece tokenizers only
        except ImportError as e:
            raise DependencyError(f"data.tokenizer={path!r} is a SentencePiece model: pip install sentencepiece") from e
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except Exception as e:  # the library raises OSError/RuntimeError for a bad file
            raise TokenizerError(f"data.tokenizer={path!r}: not a readable SentencePiece model: {e}") from None
        self.name = path
        self.vocab_size = int(self._sp.get_piece_size())
        eos = int(self._sp.eos_id())
        self.eos_id = eos if eos >= 0 else None
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        self._bos_eos = self._prompt_specials(os.path.dirname(os.path.abspath(path)))

    def _prompt_specials(self, folder: str) -> tuple[list[int], list[int]]:
        """``([bos] or [], [eos] or [])``: what :meth:`encode_prompt` puts around the ids."""
        cfg = os.path.join(folder, "tokenizer_config.json")
        flags = {}
        if os.path.isfile(cfg):
            with open(cfg) as f:
                flags = json.load(f)
        bos, eos = int(self._sp.bos_id()), int(self._sp.eos_id())
        return ([bos] if flags.get("add_bos_token") is True and bos >= 0 else [],
                [eos] if flags.get("add_eos_token") is True and eos >= 0 else [])

    def encode(self, text: str) -> np.ndarray:
        """Ids of ``text`` (no BOS/EOS): 1-D ``uint16`` or ``uint32``."""
        if not isinstance(text, str):
            raise TypeError(f"SentencePieceTokenizer.encode expects a str, got {type(text).__name__}")
        return np.asarray(self._sp.encode(text), dtype=self.dtype)

    def encode_prompt(self, text: str) -> np.ndarray:
        """Ids of ``text`` as a prompt: :meth:`encode`'s with BOS/EOS as the class docstring says."""
        bos, eos = self._bos_eos
        return np.asarray(bos + [int(i) for i in self.encode(text)] + eos, dtype=self.dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode` of many texts (the library's C++ loop)."""
        return [np.asarray(ids, dtype=self.dtype) for ids in self._sp.encode(list(texts))]

    def decode(self, ids) -> str:
        """Text of the ids (any shape, flattened). Raises ValueError for ids outside the vocabulary."""
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size - 1}], got [{arr.min()}, {arr.max()}]")
        return self._sp.decode([int(i) for i in arr])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> "ByteTokenizer | HFTokenizer":
    """Return a tokenizer by name or path.

    Args:
      name: ``"byte"``, or the path of a Hugging Face tokenizer folder / ``tokenizer.json``.

    Returns:
      A fresh tokenizer object with ``vocab_size``, ``encode`` and ``decode``.

    Raises:
      ValueError: an unknown name that is not a path; the message lists the allowed values.
      FileNotFoundError: a path without a ``tokenizer.json``.
    """
    if name == "auto":  # data.tokenizer's default, resolved by the config; without a model folder: bytes
        name = "byte"
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    if isinstance(name, str) and (os.sep in name or name.endswith((".json", ".model")) or os.path.exists(name)):
        if name.endswith(".model") or (os.path.isdir(name) and not os.path.isfile(os.path.join(name, "tokenizer.json"))
                                        and os.path.isfile(os.path.join(name, "tokenizer.model"))):
            return SentencePieceTokenizer(os.path.join(name, "tokenizer.model") if os.path.isdir(name) else name)
        return HFTokenizer(name)
    raise ValueError(f"unknown tokenizer {name!r}; allowed values: {sorted(TOKENIZERS)} or the path of a "
                     "Hugging Face tokenizer folder (tokenizer.json)")
