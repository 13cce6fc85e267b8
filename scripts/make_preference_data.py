"""Write a small synthetic preference set for configs/dpo_tiny.yaml (DPO on a CPU in minutes).

Each pair is cut from the main job's corpus (the Python standard library's sources, byte tokens): the
prompt is a stretch of source text, ``chosen`` is its real continuation and ``rejected`` the same
characters shuffled. A model that prefers real code to scrambled code gets the held-out pairs right, so
``rewards/accuracies`` on them measures whether DPO learnt the preference.

    python scripts/make_preference_data.py [--out configs/data/dpo_tiny.jsonl] [--pairs 1200] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random

from jaxcolossal.data import stdlib_files

PROMPT_CHARS, RESPONSE_CHARS = 40, 20


def pairs(n: int, seed: int) -> list[dict]:
    """``n`` pairs ``{"prompt", "chosen", "rejected"}`` of printable ASCII, drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    files = sorted(stdlib_files())
    out = []
    while len(out) < n:
        with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
            text = f.read()
        if len(text) < 4 * (PROMPT_CHARS + RESPONSE_CHARS):
            continue
        at = rng.randrange(0, len(text) - PROMPT_CHARS - RESPONSE_CHARS)
        piece = text[at: at + PROMPT_CHARS + RESPONSE_CHARS]
        if not piece.isascii() or "\t" in piece:
            continue
        prompt, chosen = piece[:PROMPT_CHARS], piece[PROMPT_CHARS:]
        letters = list(chosen)
        rng.shuffle(letters)
        rejected = "".join(letters)
        if rejected != chosen and chosen.strip():
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="configs/data/dpo_tiny.jsonl")
    ap.add_argument("--pairs", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with open(a.out, "w") as f:
        for p in pairs(a.pairs, a.seed):
            f.write(json.dumps(p) + "\n")
    print(f"wrote {a.pairs} pairs to {a.out}")


if __name__ == "__main__":
    main()
