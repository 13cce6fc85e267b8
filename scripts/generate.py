"""Sample from a trained checkpoint or a Hugging Face folder with the KV-cached batched sampler
(jaxcolossal.generate; docs/generate.md).

    python scripts/generate.py --config configs/llama_tiny.yaml checkpoint.dir=checkpoints/tiny --prompt "def "
    python scripts/generate.py --hf HF_DIR --prompt "Once upon" --prompt "The" --greedy --max-new-tokens 50
    python scripts/generate.py --hf HF_DIR --prompts-file prompts.jsonl --temperature 0.7 --top-p 0.9 --jsonl

A checkpoint is restored as ``scripts/train.py --eval-only`` restores it (the newest step in
``checkpoint.dir``, else ``model.init_from``), on the run's mesh and in its layout; the config's
``data.tokenizer`` encodes the prompts, and a row ends at the tokenizer's eos or at any id of the
``model.init_from`` folder's ``generation_config.json`` ``eos_token_id`` list. An HF folder is read
with ``load_hf`` on one device; its tokenizer files (``tokenizer.json``), else ``--tokenizer``, encode
the prompts, and its ``generation_config.json``/``config.json`` name the eos: one id or a list (LLaMA
3's ``[128001, 128008, 128009]``), a row ending at any of them, as transformers' ``generate``. Prompts
are encoded as the tokenizer encodes a prompt by default (``AutoTokenizer(folder)(text)``: LLaMA 3's
``<|begin_of_text|>`` first); the printed completion leaves every eos id out. All prompts are one
batch.

Exit status: 0 done; 2 bad input (one line on stderr: a missing or malformed prompts file, no
prompt, an option out of range, a config error, nothing to sample from); 3 a tokenizer or
checkpoint error.
"""

import argparse
import dataclasses
import json
import os
import sys

import jaxcolossal as jc
from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.errors import exit_status

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "llama_tiny.yaml")


def read_prompts(args) -> list[str]:
    """The ``--prompt`` texts, then the ``prompt`` field of each line of ``--prompts-file`` (jsonl).

    Raises:
        ConfigError: no prompt at all, an empty one, a missing file, or a line that is not a JSON
            object with a string ``prompt`` (named by file and line)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            raise ConfigError(f"--prompts-file {args.prompts_file!r} does not exist")
        with open(args.prompts_file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{args.prompts_file}:{n}: not JSON ({e.msg})") from None
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ConfigError(f"{args.prompts_file}:{n}: needs a string field \"prompt\"")
                prompts.append(row["prompt"])
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE.jsonl")
    if any(p == "" for p in prompts):
        raise ConfigError("an empty prompt: each prompt needs at least one token")
    return prompts


def sampling_of(args):
    """The :class:`jaxcolossal.generate.Sampling` the options ask for. Raises ConfigError on a value out
    of range (before anything compiles)."""
    from jaxcolossal.generate import Sampling  # heavy: jax, after the devices are set up
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        return Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p).check()
    except ValueError as e:
        raise ConfigError(f"--{str(e).split(' ')[0].replace('_', '-')}: {e}") from None


def _eos_of(value, where: str) -> tuple[int, ...]:
    """The eos ids of ``value`` (an id, a list of ids or None). Raises ConfigError naming ``where``."""
    from jaxcolossal.generate import eos_ids  # heavy: jax, after the devices are set up
    try:
        return eos_ids(value)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def check_length(cfg, prompts: list[str], tok, max_new_tokens: int) -> None:
    """Refuse, before the weights are read or anything compiles, a generation that runs past the
    positions the model knows: the longest prompt's tokens + ``max_new_tokens`` above
    ``model.max_position_embeddings`` (a ``dynamic`` RoPE scales past it and passes).

    Raises:
        ConfigError: one line naming both values and the ``--max-new-tokens`` that fits."""
    longest = max(len(tok.encode_prompt(p)) for p in prompts)
    limit = cfg.max_position_embeddings
    if longest + max_new_tokens > limit and cfg.rope.type != "dynamic":
        fix = (f"use --max-new-tokens {limit - longest} or fewer" if longest < limit
               else "shorten the prompt")
        raise ConfigError(f"--max-new-tokens {max_new_tokens} after a prompt of {longest} tokens runs to "
                          f"{longest + max_new_tokens} positions, past the model's max_position_embeddings={limit}: "
                          + fix)


def from_hf(args, prompts: list[str]):
    """``(family, model cfg, params, tokenizer, eos ids)`` of ``--hf``'s folder: the eos ids that its
    ``generation_config.json`` (else ``config.json``) names, as transformers' ``generate`` reads them.
    The length is checked (:func:`check_length`) before the weights are read."""
    from jaxcolossal.data import get_tokenizer  # heavy: jax, after the devices are set up
    from jaxcolossal.models import get_family  # heavy: as above
    from jaxcolossal.models.hf_io import config_from_hf, load_hf, read_hf_config, read_special_tokens  # heavy: as above
    if not os.path.isfile(os.path.join(args.hf, "config.json")):
        raise ConfigError(f"--hf {args.hf!r}: no config.json there (a Hugging Face model folder is needed)")
    has_tok = any(os.path.isfile(os.path.join(args.hf, f)) for f in ("tokenizer.json", "tokenizer.model"))
    tok = get_tokenizer(args.tokenizer or (args.hf if has_tok else "byte"))
    check_length(config_from_hf(read_hf_config(args.hf)), prompts, tok, args.max_new_tokens)
    cfg, params = load_hf(args.hf)
    eos = _eos_of(read_special_tokens(args.hf).get("eos_token_id"), f"--hf {args.hf}: eos_token_id")
    return get_family(cfg), cfg, params, tok, eos


def from_checkpoint(args, prompts: list[str]):
    """``(family, model cfg, params, tokenizer, eos ids)`` of the config's newest checkpoint (or
    ``model.init_from``), on the run's mesh: the tokenizer's eos, and the ids of the ``model.init_from``
    folder's ``generation_config.json`` list when the run has one. The length is checked
    (:func:`check_length`) before anything is restored."""
    from jaxcolossal.data import get_tokenizer  # heavy: jax, after the devices are set up
    from jaxcolossal.generate import run_eos_ids  # heavy: as above
    from jaxcolossal.train.evaluate import state_for_sampling  # heavy: orbax and tensorstore
    cfg = load_config(args.config, args.overrides)
    tok = get_tokenizer(args.tokenizer or cfg.data.tokenizer)
    check_length(cfg.model, prompts, tok, args.max_new_tokens)
    try:
        eos = run_eos_ids(tok, cfg.model.init_from or None)
    except ValueError as e:
        raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {e}") from None
    plan, state, source = state_for_sampling(cfg)
    print(f"sampling from {source}", file=sys.stderr)
    return plan.family, cfg.model, state.model_params, tok, eos


def run(args) -> int:
    """Check the input, load the model, generate one batch and print it."""
    prompts = read_prompts(args)
    if args.hf and args.overrides:
        raise ConfigError(f"--hf takes no config overrides, got {' '.join(args.overrides)}")
    jc.simulate_devices(args.devices or 8)
    sampling = sampling_of(args)
    from jaxcolossal.generate import generate, printable  # heavy: jax, after the devices are set up
    family, cfg, params, tok, eos = from_hf(args, prompts) if args.hf else from_checkpoint(args, prompts)
    cfg = dataclasses.replace(cfg, vocab_size=min(cfg.vocab_size, tok.vocab_size))  # the tokenizer's ids only
    ids = [[int(i) for i in tok.encode_prompt(p)] for p in prompts]  # as AutoTokenizer(folder)(p): its BOS
    out = generate(family, cfg, params, ids, args.max_new_tokens, sampling, eos_id=None if args.ignore_eos else eos,
                   seed=args.seed)
    for prompt, row in zip(prompts, out.rows()):
        text = tok.decode([t for t in row if t not in eos])
        if args.jsonl:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": row}))
        else:
            print(printable(prompt + text) + "\n" + "-" * 40)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="the run's YAML config (default: configs/llama_tiny.yaml)")
    ap.add_argument("--hf", metavar="DIR", default=None, help="a Hugging Face model folder instead of a checkpoint")
    ap.add_argument("--tokenizer", default=None, help="tokenizer name or folder (default: the config's, or the HF "
                                                      "folder's, else byte)")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    ap.add_argument("--prompts-file", default=None, help="a jsonl file with a \"prompt\" field per line")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    ap.add_argument("--temperature", type=float, default=1.0, help="softmax temperature, 0 = greedy (default 1)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1: all)")
    ap.add_argument("--greedy", action="store_true", help="the most likely token (HF's do_sample=False)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling key's seed (default 0)")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--jsonl", action="store_true", help="print one JSON object per prompt (prompt, completion, "
                                                         "tokens)")
    ap.add_argument("--devices", type=int, default=None, help="simulated CPU devices when no accelerator (default 8)")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides (checkpoint.dir=..., ...)")
    return ap


def main(argv=None) -> int:
    try:
        args = _parser().parse_intermixed_args(argv)
    except SystemExit as e:  # argparse's own usage errors: already one line on stderr after the usage
        return 2 if e.code else 0
    try:
        return run(args)
    except Exception as e:  # a user's error: one line and its exit code (jaxcolossal.errors); a bug raises
        status = exit_status(e)
        if status is None:
            raise
        print(status[0], file=sys.stderr)
        return status[1]


if __name__ == "__main__":
    sys.exit(main())
