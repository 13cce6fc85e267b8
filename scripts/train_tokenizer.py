"""Train a byte-level BPE tokenizer on local files and save it as a Hugging Face tokenizer folder.

    python scripts/train_tokenizer.py --corpus 'data/*.txt' --vocab-size 8000 --out my_tokenizer
    python scripts/train_tokenizer.py --corpus chat.jsonl --text-key text --vocab-size 4000 --out tok --chat-template

Writes ``OUT/tokenizer.json`` (the ``tokenizers`` library's format: GPT-2-style byte-level BPE,
so every string is encodable) and ``OUT/tokenizer_config.json`` naming the end-of-text token
(``--eos``, default ``</s>``, the tokenizer's id 0). With ``--chat-template`` it also stores a
minimal chat template (``<|role|>content`` per turn, ``eos`` after each assistant turn) for
``data.format=chat``. Use the folder as ``data.tokenizer=OUT``, with ``model.vocab_size`` at least
the vocabulary size printed at the end.

The corpus is read as ``data.corpus`` is (globs of ``.txt``/``.jsonl``; ``stdlib``; JSON lines
use ``--text-key``, or the ``content`` of every message and the ``prompt``/``response`` of chat
lines). Exit status 2 for bad arguments or an unreadable corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def texts(corpus: str, text_key: str):
    """Every text of the corpus: documents, or the contents of chat lines."""
    from jaxcolossal.data.corpus import iter_json_lines, read_text, resolve_files  # heavy: jax; keeps this module light

    for path in resolve_files(corpus):
        if not path.lower().endswith((".jsonl", ".json")):
            yield read_text(path)
            continue
        for where, rec in iter_json_lines(path):
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object")
            found = [rec[k] for k in (text_key, "prompt", "response") if isinstance(rec.get(k), str)]
            found += [m["content"] for m in rec.get("messages", []) if isinstance(m, dict) and isinstance(m.get("content"), str)]
            if not found:
                raise ValueError(f"{where}: no {text_key!r}, prompt/response or messages field")
            yield from found


def train(corpus: str, vocab_size: int, out: str, eos: str = "</s>", text_key: str = "text",
          chat_template: bool = False) -> int:
    """Train, save to ``out``, and return the vocabulary size (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # heavy: only train() needs it

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(corpus, text_key), trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tok.get_vocab_size(with_added_tokens=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="globs of .txt/.jsonl files (comma-separated), or 'stdlib'")
    ap.add_argument("--vocab-size", type=int, required=True, help="target vocabulary size (>= 257)")
    ap.add_argument("--out", required=True, help="folder to write tokenizer.json and tokenizer_config.json to")
    ap.add_argument("--eos", default="</s>", help="the end-of-text token (id 0)")
    ap.add_argument("--text-key", default="text", help="the text field of JSON lines")
    ap.add_argument("--chat-template", action="store_true", help="store a minimal chat template")
    args = ap.parse_args(argv)
    if args.vocab_size < 257:
        ap.error(f"--vocab-size={args.vocab_size}: a byte-level BPE needs at least 257 entries (256 bytes + eos)")
    try:
        n = train(args.corpus, args.vocab_size, args.out, args.eos, args.text_key, args.chat_template)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/tokenizer.json: vocabulary {n} (set model.vocab_size >= {n}); eos {args.eos!r} = id 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
