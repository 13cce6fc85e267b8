"""The pre-tokenization cache: a corpus is tokenized once, then memory-mapped.

``load_corpus`` keys the token stream by a SHA-256 of what determines it: every file's path,
size and modification time, the tokenizer (its ``tokenizer.json`` bytes, or ``byte``), the text
field and the byte limit. The stream and its document starts are stored as
``<data.cache_dir>/<key>.tokens.npy`` and ``<key>.docs.npy`` (numpy's format: dtype and length
in the header) with an index ``<key>.json`` written last. Later runs, and every process of a
multi-host run, open them with ``np.load(mmap_mode="r")``: nothing is re-tokenized, and nothing
is read until a window needs it.

Writes are atomic (a temporary file, then ``os.replace``), so a crash mid-write never leaves a
partial entry; processes that build the same key at once write identical bytes. An entry that
does not load is rebuilt, with a warning.
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
    file = name
    if os.path.isdir(name):
        file = os.path.join(name, "tokenizer.json")
        file = file if os.path.isfile(file) else os.path.join(name, "tokenizer.model")
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


def cached(cache_dir: str, key: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays stored under ``key`` in ``cache_dir`` (memory-mapped, read-only), or ``build()``'s
    (a dict of named 1-D arrays), stored first. ``<key>.<name>.npy`` per array; the first name's
    file is written last, so its presence means the entry is complete. An empty ``cache_dir``
    disables the cache."""
    if not cache_dir:
        return build()
    log = logging.getLogger("jaxcolossal")
    index = os.path.join(cache_dir, f"{key}.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = json.load(f)
            return {n: np.load(os.path.join(cache_dir, f"{key}.{n}.npy"), mmap_mode="r") for n in names}
        except (ValueError, OSError, EOFError) as e:
            log.warning(f"pre-tokenization cache {index} is unreadable ({e}); rebuilding")
            os.remove(index)
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)

    def atomic(path: str, write) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb" if path.endswith(".npy") else "w") as f:
            write(f)
        os.replace(tmp, path)

    for n, a in arrays.items():
        atomic(os.path.join(cache_dir, f"{key}.{n}.npy"), lambda f, a=a: np.save(f, np.ascontiguousarray(a)))
    atomic(index, lambda f: json.dump(list(arrays), f))  # last: the entry is complete
    return {n: np.load(os.path.join(cache_dir, f"{key}.{n}.npy"), mmap_mode="r") for n in arrays}
