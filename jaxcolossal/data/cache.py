"""The pre-tokenization cache: a corpus is tokenized once, then memory-mapped.

``load_corpus`` keys the token stream by a SHA-256 of what determines it: every file's path,
size and modification time, the tokenizer (its ``tokenizer.json`` bytes, or ``byte``), the text
field and the byte limit. The stream is stored as ``<data.cache_dir>/<key>.npy`` (numpy's format:
dtype and length in the header) and later runs, and every process of a multi-host run, open it
with ``np.load(mmap_mode="r")``: nothing is re-tokenized, and nothing is read until a window
needs it.

Writes are atomic (a temporary file, then ``os.replace``), so a crash mid-write never leaves a
partial cache; processes that build the same key at once write identical bytes. A cache file
that does not load is deleted and rebuilt, with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable

import numpy as np

__all__ = ["corpus_key", "cached"]

VERSION = 1
"""Bumped when the stream a key describes changes (e.g. how documents are joined)."""


def tokenizer_id(tokenizer) -> str:
    """``byte``, or a hash of a Hugging Face tokenizer's file and end-of-text id."""
    name = getattr(tokenizer, "name", "byte")
    if name == "byte":
        return "byte"
    file = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
    with open(file, "rb") as f:
        return f"hf:{hashlib.sha256(f.read()).hexdigest()}:eos={getattr(tokenizer, 'eos_id', None)}"


def corpus_key(files: list[str], tokenizer, text_key: str, limit: int) -> str:
    """The cache key (hex SHA-256) of the token stream of ``files`` under ``tokenizer``."""
    stats = []
    for path in files:
        st = os.stat(path)
        stats.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"v": VERSION, "files": stats, "tokenizer": tokenizer_id(tokenizer), "text_key": text_key,
                       "limit": limit}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cached(cache_dir: str, key: str, build: Callable[[], np.ndarray]) -> np.ndarray:
    """The stream stored under ``key`` in ``cache_dir`` (memory-mapped, read-only), or
    ``build()``'s, stored first. An empty ``cache_dir`` disables the cache."""
    if not cache_dir:
        return build()
    path = os.path.join(cache_dir, f"{key}.npy")
    if os.path.exists(path):
        try:
            return np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            logging.getLogger("jaxcolossal").warning(f"pre-tokenization cache {path} is unreadable ({e}); rebuilding")
            os.remove(path)
    stream = build()
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(stream))
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")
