"""Data pipeline: byte tokenizer, local corpora, stateless resumable loader."""
from .corpus import (
    DOC_SEPARATOR,
    load_corpus,
    load_splits,
    resolve_files,
    split_corpus,
    stdlib_files,
)
from .loader import (
    DataLoader,
    ExampleLoader,
    eval_batches,
    local_rows,
    process_rows,
    sample_windows,
    window_starts,
)
from .tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "get_tokenizer",
    "DOC_SEPARATOR",
    "stdlib_files",
    "resolve_files",
    "load_corpus",
    "split_corpus",
    "load_splits",
    "window_starts",
    "sample_windows",
    "process_rows",
    "local_rows",
    "eval_batches",
    "DataLoader",
    "ExampleLoader",
]
