"""Write the toy arithmetic task of docs/posttraining.md's GRPO example: a text corpus of sums for a
short supervised warm-up, and GRPO prompts with their answers.

    python scripts/make_arithmetic.py [OUT_DIR]      # default configs/data

Writes ``arith_sft.txt`` (lines ``a+b=c``, ``a, b`` in ``[0, 20)``) and ``arith_prompts.jsonl``
(``{"prompt": "a+b=", "answer": "c"}``, every pair once, shuffled with seed 0).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

MAX_TERM = 20
"""Terms are drawn from ``[0, MAX_TERM)``."""


def main(out_dir: str = "configs/data") -> None:
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    pairs = [(a, b) for a in range(MAX_TERM) for b in range(MAX_TERM)]
    order = rng.permutation(len(pairs))
    with open(os.path.join(out_dir, "arith_sft.txt"), "w") as f:
        for i in rng.integers(0, len(pairs), 20000):
            a, b = pairs[i]
            f.write(f"{a}+{b}={a + b}\n")
    with open(os.path.join(out_dir, "arith_prompts.jsonl"), "w") as f:
        for i in order:
            a, b = pairs[i]
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    print(f"wrote {out_dir}/arith_sft.txt and {out_dir}/arith_prompts.jsonl ({len(pairs)} prompts)")


if __name__ == "__main__":
    main(*sys.argv[1:2])
