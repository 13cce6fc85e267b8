"""Tokenization throughput and the pre-tokenization cache, measured side by side in one run.

    python scripts/bench_data.py                   # stdlib corpus, capped at --mb MB of text
    python scripts/bench_data.py --mb 32 --vocab 16000

1. Trains a byte-level BPE (``scripts/train_tokenizer.py``) on the first 2 MB of the corpus.
2. Tokenizes the first ``--mb`` MB of the corpus's documents in two ways: a plain single-process
   loop (``tokenizer.encode`` per document) and our path (``encode_batch`` in groups of 256 on the
   ``tokenizers`` library's threads, :func:`jaxcolossal.data.corpus.tokenize_texts`). It reports MB/s
   of UTF-8 text for each, and their ratio.
3. ``load_corpus`` with an empty cache (tokenize + write) and again (a cache hit: memory-mapped),
   for that tokenizer and for the default byte-level stdlib corpus (the main job's start-up).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import train_tokenizer  # noqa: E402

from jaxcolossal.config import DataConfig  # noqa: E402
from jaxcolossal.data import get_tokenizer, load_corpus  # noqa: E402
from jaxcolossal.data.corpus import iter_documents, resolve_files, tokenize_texts  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--mb", type=float, default=16.0, help="MB of text to tokenize")
    ap.add_argument("--vocab", type=int, default=8000)
    args = ap.parse_args(argv)

    files = resolve_files(args.corpus)
    budget = int(args.mb * 2**20)
    docs, size = [], 0
    for d in iter_documents(files):
        docs.append(d)
        size += len(d.encode())
        if size >= budget:
            break
    out = {"corpus": args.corpus, "text_mb": size / 2**20, "documents": len(docs), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        sample = os.path.join(tmp, "sample.txt")
        with open(sample, "w") as f:
            f.write("".join(itertools.islice(docs, 0, None))[: 2 * 2**20])
        t0 = time.perf_counter()
        vocab = train_tokenizer.train(sample, args.vocab, os.path.join(tmp, "tok"))
        out["tokenizer_train_s"] = time.perf_counter() - t0
        tok = get_tokenizer(os.path.join(tmp, "tok"))

        t0 = time.perf_counter()
        n_loop = sum(len(tok.encode(d)) for d in docs)
        loop_s = time.perf_counter() - t0
        # our path over the same documents (written as files so that tokenize_texts reads them)
        paths = []
        for i, d in enumerate(docs):
            p = os.path.join(tmp, f"d{i:06d}.txt")
            with open(p, "w") as f:
                f.write(d)
            paths.append(p)
        t0 = time.perf_counter()
        stream = tokenize_texts(paths, "text", tok, 0)["tokens"]
        ours_s = time.perf_counter() - t0
        out.update(vocab=vocab, tokens=n_loop, loop_mb_s=out["text_mb"] / loop_s, ours_mb_s=out["text_mb"] / ours_s,
                   speedup=loop_s / ours_s, stream_tokens=int(len(stream)))
        print(f"{out['text_mb']:.1f} MB of text, {len(docs)} documents, BPE vocabulary {vocab}, {os.cpu_count()} CPUs")
        print(f"  plain loop (encode per document):  {out['loop_mb_s']:6.2f} MB/s")
        print(f"  ours (encode_batch on threads):    {out['ours_mb_s']:6.2f} MB/s   ({out['speedup']:.2f}×)")

        for name, tokenizer, corpus in (("BPE", os.path.join(tmp, "tok"), ",".join(paths)),
                                        ("byte, stdlib (the main job)", "byte", "stdlib")):
            cfg = DataConfig(corpus=corpus, tokenizer=tokenizer, cache_dir=os.path.join(tmp, "cache"))
            t0 = time.perf_counter()
            load_corpus(cfg)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            s = load_corpus(cfg)
            warm = time.perf_counter() - t0
            out[f"load_cold_s[{name}]"], out[f"load_warm_s[{name}]"] = cold, warm
            print(f"  load_corpus {name}: first run {cold:.2f} s (tokenize + write cache), "
                  f"second {warm:.3f} s (cache hit, memory-mapped; {len(s)} tokens)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
