"""The pre-tokenization cache: built once, memory-mapped after, keyed by files and tokenizer,
rebuilt when a file changes or the cached file is damaged; writes are atomic."""

import logging
import os
import time

import numpy as np

from jaxcolossal.data import get_tokenizer, load_corpus
from jaxcolossal.data.cache import cached, corpus_key


class _Data:
    def __init__(self, corpus, cache_dir):
        self.corpus, self.cache_dir = str(corpus), str(cache_dir)


def test_built_once_then_memory_mapped(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return {"tokens": np.arange(100, dtype=np.uint16), "docs": np.array([0, 40])}

    a = cached(str(tmp_path), "k", build)
    b = cached(str(tmp_path), "k", build)
    assert len(calls) == 1 and isinstance(b["tokens"], np.memmap) and b["tokens"].dtype == np.uint16
    np.testing.assert_array_equal(a["tokens"], np.arange(100))
    np.testing.assert_array_equal(b["tokens"], np.arange(100))
    np.testing.assert_array_equal(b["docs"], [0, 40])
    assert sorted(os.listdir(tmp_path)) == ["k.docs.npy", "k.json", "k.tokens.npy"]  # no temporary file left


def test_damaged_cache_is_rebuilt(tmp_path, caplog):
    cached(str(tmp_path), "k", lambda: {"tokens": np.arange(1000, dtype=np.uint8)})
    with open(tmp_path / "k.tokens.npy", "r+b") as f:
        f.truncate(20)  # a header cut short, as by a disk error
    log = logging.getLogger("jaxcolossal")  # it does not propagate once the run's logger is set up
    log.addHandler(caplog.handler)
    try:
        out = cached(str(tmp_path), "k", lambda: {"tokens": np.arange(10, dtype=np.uint8)})
    finally:
        log.removeHandler(caplog.handler)
    np.testing.assert_array_equal(out["tokens"], np.arange(10))
    assert "unreadable" in caplog.text


def test_corpus_stream_is_cached_and_follows_its_files(tmp_path):
    doc = tmp_path / "a.txt"
    doc.write_text("hello world " * 2000)
    data = _Data(doc, tmp_path / "cache")
    first = load_corpus(data)
    assert len(os.listdir(tmp_path / "cache")) == 3
    second = load_corpus(data)
    assert isinstance(second, np.memmap)
    np.testing.assert_array_equal(first, second)
    time.sleep(0.01)
    doc.write_text("goodbye world " * 2000)  # a changed file is a new key
    third = load_corpus(data)
    assert len(os.listdir(tmp_path / "cache")) == 6
    assert get_tokenizer("byte").decode(third[:7]) == "goodbye"


def test_key_depends_on_tokenizer_and_limit(tmp_path):
    doc = tmp_path / "a.txt"
    doc.write_text("x")
    tok = get_tokenizer("byte")
    k = corpus_key([str(doc)], tok, "text", 0)
    assert k == corpus_key([str(doc)], tok, "text", 0)
    assert k != corpus_key([str(doc)], tok, "text", 10)
    assert k != corpus_key([str(doc)], tok, "body", 0)
