"""Corpus loading: local text files -> one 1-D token stream.

Nothing is cached on disk; the stream is rebuilt from the source files on each
call (the whole Python standard library takes well under a second or two).
"""
from __future__ import annotations

import glob
import itertools
import json
import math
import os
import sysconfig
from typing import Iterator

import numpy as np
from tqdm import tqdm

from jaxcolossal.errors import DataError, DependencyError

from .cache import cached, corpus_key
from .tokenizer import get_tokenizer

__all__ = [
    "DOC_SEPARATOR",
    "MIN_STREAM_TOKENS",
    "stdlib_files",
    "resolve_files",
    "iter_documents",
    "iter_json_lines",
    "load_corpus",
    "split_corpus",
    "load_splits",
]

#: Text placed between two documents in the token stream.
DOC_SEPARATOR = "\n\n"
#: The shortest usable stream: one window of ``seq_len = 1`` needs 2 tokens.
TEXT_SAMPLE_PROMPT = "def "
"""The end-of-run sample's prompt for text corpora (and the formats without a prompt of their own)
when ``training.sample_prompt`` is empty."""

MIN_STREAM_TOKENS = 2

_SKIP_DIRS = ("site-packages", "__pycache__")
_JSON_SUFFIXES = (".jsonl", ".json")


def stdlib_files() -> list[str]:
    """The ``.py`` files of the running Python's standard library.

    Walks ``sysconfig.get_paths()["stdlib"]`` recursively, skipping any
    ``site-packages`` and ``__pycache__`` directory, and returns the paths
    sorted (plain string order) so that the stream is deterministic.

    Raises:
      FileNotFoundError: if the directory holds no ``.py`` file.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"corpus 'stdlib': no .py files found under {root!r}")
    return sorted(files)


def resolve_files(corpus: str) -> list[str]:
    """Resolve a corpus spec to a sorted list of file paths.

    Args:
      corpus: ``"stdlib"``, or one glob pattern, or several comma-separated
        glob patterns (each expanded with ``recursive=True``, so ``**`` matches
        nested directories; ``~`` and ``$VAR`` are expanded earlier, by
        :func:`jaxcolossal.config.expand_paths`).

    Returns:
      Sorted, de-duplicated regular-file paths (directories matched by a
      pattern are ignored).

    Raises:
      FileNotFoundError: if no file matches; the message names the pattern.
      ValueError: if ``corpus`` is empty.
    """
    if corpus == "stdlib":
        return stdlib_files()
    patterns = [p.strip() for p in str(corpus).split(",") if p.strip()]
    if not patterns:
        raise DataError(f"data corpus must be 'stdlib' or a glob pattern, got {corpus!r}")
    files = set()
    for pattern in patterns:
        for path in glob.glob(pattern, recursive=True):
            if os.path.isfile(path):
                files.add(path)
    if not files:
        raise FileNotFoundError(
            f"corpus pattern {corpus!r} matched no files "
            f"(globs tried, recursive=True: {patterns}; cwd={os.getcwd()!r})"
        )
    return sorted(files)


def read_text(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.read().decode("utf-8", errors="replace")


def iter_json_lines(path: str) -> Iterator[tuple[str, object]]:
    """``("<path>:<line>", parsed value)`` for every non-blank line of a JSON-lines file.

    Raises:
      ValueError: a line that does not parse, naming the file and line.
    """
    for lineno, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON line ({e.msg})") from None


def _parquet_documents(path: str, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional (the data extra): parquet corpora only
    except ImportError as e:
        raise DependencyError("data.format=parquet needs pyarrow: pip install pyarrow") from e
    f = pq.ParquetFile(path)
    names = f.schema_arrow.names
    if text_key not in names:
        raise DataError(f"{path}: parquet file has no column {text_key!r} (data.text_key); its columns: {names}")
    for batch in f.iter_batches(columns=[text_key], batch_size=1024):
        for i, text in enumerate(batch.column(0).to_pylist()):
            if not isinstance(text, str):
                raise DataError(f"{path}: column {text_key!r} holds {type(text).__name__}, expected strings")
            yield text


def _dataset_documents(folder: str, text_key: str) -> Iterator[str]:
    try:
        import datasets  # optional (the data extra), heavy: saved datasets folders only
    except ImportError as e:
        raise DependencyError("data.format=datasets needs the datasets package: pip install datasets") from e
    ds = datasets.load_from_disk(folder)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{folder}: a DatasetDict without a 'train' split (splits: {list(ds)})")
        ds = ds["train"]
    if text_key not in ds.column_names:
        raise DataError(f"{folder}: dataset has no column {text_key!r} (data.text_key); its columns: "
                         f"{ds.column_names}")
    for batch in ds.select_columns([text_key]).iter(batch_size=1024):
        yield from batch[text_key]


def iter_documents(files: list[str], text_key: str = "text", fmt: str = "text") -> Iterator[str]:
    """Yield the documents of ``files`` in order.

    A plain text file is one document (read as UTF-8, invalid bytes replaced
    by U+FFFD). A ``.jsonl``/``.json`` file is JSON-lines: every non-blank
    line is a JSON object whose ``text_key`` field is one document.

    ``fmt``: ``text`` (by suffix, as above), ``jsonl`` (every file is JSON
    lines), ``parquet`` (column ``text_key`` of each file, with ``pyarrow``) or
    ``datasets`` (``files`` is one ``datasets.load_from_disk`` folder; its
    ``train`` split when it is a ``DatasetDict``).

    Raises:
      ValueError: for a JSON line that does not parse, is not an object, or
        lacks a string ``text_key`` field (file and line number are named); a
        parquet file or dataset without the column (its columns are listed).
    """
    if fmt == "datasets":
        yield from _dataset_documents(files[0], text_key)
        return
    for path in files:
        if fmt == "parquet":
            yield from _parquet_documents(path, text_key)
            continue
        if fmt != "jsonl" and not path.lower().endswith(_JSON_SUFFIXES):
            yield read_text(path)
            continue
        for where, record in iter_json_lines(path):
            if not isinstance(record, dict) or text_key not in record:
                raise DataError(f"{where}: JSON line has no field {text_key!r} (text_key)")
            text = record[text_key]
            if not isinstance(text, str):
                raise DataError(f"{where}: field {text_key!r} is {type(text).__name__}, expected str")
            yield text


def tokenize_texts(files: list[str], text_key: str, tokenizer, limit: int, fmt: str = "text") -> dict[str, np.ndarray]:
    """``{"tokens": stream, "docs": starts}``: the documents of ``files`` joined by the end-of-text
    id or the separator (which ends the document before it), and int64 ``starts`` of each
    document in the stream (``starts[0] == 0``)."""
    eos = getattr(tokenizer, "eos_id", None)
    sep = np.asarray([eos], tokenizer.dtype) if eos is not None else tokenizer.encode(DOC_SEPARATOR)
    parts: list[np.ndarray] = []
    starts: list[int] = []
    total = 0
    docs = iter_documents(files, text_key, fmt)
    batched = hasattr(tokenizer, "encode_batch")  # Hugging Face: documents in groups, on its threads
    bar = tqdm(desc="tokenizing", unit=" doc", disable=None, leave=False, mininterval=1.0)  # only on a terminal
    while True:
        group = list(itertools.islice(docs, 256 if batched else 1))
        if not group:
            break
        for ids in (tokenizer.encode_batch(group) if batched else [tokenizer.encode(group[0])]):
            if parts:
                parts.append(sep)
                total += len(sep)
            starts.append(total)
            parts.append(ids)
            total += len(ids)
        bar.update(len(group))
        if limit and total >= limit:
            break
    bar.close()
    stream = np.concatenate(parts) if parts else np.zeros((0,), getattr(tokenizer, "dtype", np.uint8))
    starts = np.asarray(starts or [0], np.int64)
    if limit:
        stream = stream[:limit]
        starts = starts[starts < max(limit, 1)]
    return {"tokens": stream, "docs": starts}


def load_corpus(data_cfg, with_docs: bool = False):
    """Build the full token stream described by ``data_cfg``.

    Reads ``data_cfg.corpus`` (see :func:`resolve_files`), tokenizes every
    document with ``get_tokenizer(data_cfg.tokenizer)`` and joins the documents
    in file order with the tokenizer's end-of-text id (a Hugging Face tokenizer
    that has one) or :data:`DOC_SEPARATOR` (``"\\n\\n"``). When
    ``data_cfg.max_corpus_bytes > 0`` the stream is cut to that many tokens
    (reading stops as soon as enough is read). With ``data_cfg.cache_dir`` the
    stream is tokenized once and memory-mapped afterwards (:mod:`.cache`).
    Missing attributes fall back to
    the dataclass defaults (``corpus="stdlib"``, ``text_key="text"``,
    ``tokenizer="byte"``, ``max_corpus_bytes=0``).

    Returns:
      1-D ``np.ndarray`` of shape ``[N]``: ``uint8`` (byte tokenizer), ``uint16``
      or ``uint32`` (a Hugging Face tokenizer, by its vocabulary size); with
      ``with_docs`` also the int64 start of every document in it.

    Raises:
      FileNotFoundError: no file matches the pattern (the pattern is named).
      ValueError: unknown tokenizer, negative ``max_corpus_bytes``, a bad JSON
        line, or a stream shorter than :data:`MIN_STREAM_TOKENS` tokens.
    """
    corpus = getattr(data_cfg, "corpus", "stdlib")
    text_key = getattr(data_cfg, "text_key", "text")
    tokenizer = get_tokenizer(getattr(data_cfg, "tokenizer", "byte"))
    limit = int(getattr(data_cfg, "max_corpus_bytes", 0) or 0)
    if limit < 0:
        raise ValueError(f"max_corpus_bytes must be >= 0 (0 = no limit), got {limit}")

    fmt = getattr(data_cfg, "format", "text")
    if fmt == "datasets":  # one saved dataset folder: its files key the cache
        if not os.path.isdir(corpus):
            raise FileNotFoundError(f"data.format=datasets: data.corpus={corpus!r} is not a folder saved by "
                                    "datasets' save_to_disk")
        files = [corpus]
        stat_files = sorted(os.path.join(d, f) for d, _, names in os.walk(corpus) for f in names)
    else:
        files = stat_files = resolve_files(corpus)

    def build() -> dict[str, np.ndarray]:
        return tokenize_texts(files, text_key, tokenizer, limit, fmt)

    cache_dir = getattr(data_cfg, "cache_dir", "") or ""
    key = corpus_key(stat_files, tokenizer, f"{fmt}:{text_key}", limit)
    out = cached(cache_dir, key, build) if cache_dir else build()
    stream = out["tokens"]
    if len(stream) < MIN_STREAM_TOKENS:
        raise DataError(
            f"corpus {corpus!r} gives only {len(stream)} tokens; "
            f"at least {MIN_STREAM_TOKENS} are needed"
        )
    return (stream, out["docs"]) if with_docs else stream


def split_corpus(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split the stream into train and validation parts.

    The validation split is the LAST ``int(len(tokens) * val_fraction)``
    tokens; training gets everything before it. Both are views of ``tokens``
    (no copy). ``val_fraction == 0`` gives an empty validation split.

    Args:
      tokens: 1-D token array of length ``N``.
      val_fraction: fraction in ``[0, 1)``.

    Returns:
      ``(train, val)`` with ``len(train) + len(val) == N``, same dtype as
      ``tokens``.

    Raises:
      ValueError: ``tokens`` not 1-D, ``val_fraction`` outside ``[0, 1)``, or
        a split shorter than :data:`MIN_STREAM_TOKENS` (the validation split
        is only checked when ``val_fraction > 0``).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    val_fraction = float(val_fraction)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(tokens)
    n_val = int(n * val_fraction)
    train, val = tokens[: n - n_val], tokens[n - n_val:]
    if len(train) < MIN_STREAM_TOKENS or (val_fraction > 0 and len(val) < MIN_STREAM_TOKENS):
        raise DataError(
            f"stream of {n} tokens is too short for val_fraction={val_fraction}: "
            f"train has {len(train)} and val {len(val)} tokens, each needs >= "
            f"{MIN_STREAM_TOKENS} (raise max_corpus_bytes or use more files)"
        )
    return train, val


def load_splits(data_cfg, with_docs: bool = False):
    """``split_corpus(load_corpus(data_cfg), data_cfg.val_fraction)``.

    ``val_fraction`` defaults to 0.05 when the attribute is missing. With ``with_docs`` returns
    ``((train, train_starts), (val, val_starts))``: each split's document starts, relative to
    it (the validation split starts a document at 0, wherever it cuts). Raises what
    :func:`load_corpus` and :func:`split_corpus` raise.
    """
    frac = getattr(data_cfg, "val_fraction", 0.05)
    if not with_docs:
        return split_corpus(load_corpus(data_cfg), frac)
    stream, starts = load_corpus(data_cfg, with_docs=True)
    train, val = split_corpus(stream, frac)
    cut = len(train)
    starts = np.asarray(starts)
    val_starts = np.unique(np.concatenate([[0], starts[starts >= cut] - cut])).astype(np.int64)
    return (train, starts[starts < cut]), (val, val_starts)


def held_out_cut(n: int, val_fraction: float) -> int:
    """Where ``n`` rows split into training and held-out parts: the last ``ceil(n · val_fraction)`` rows
    (at least one when ``val_fraction > 0`` and ``n > 1``; none otherwise) are held out; returns the
    index of the first held-out row."""
    k = 0 if val_fraction <= 0 or n < 2 else max(1, int(math.ceil(n * val_fraction)))
    return n - k
