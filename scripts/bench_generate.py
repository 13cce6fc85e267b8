"""Tokens/s of the KV-cached sampler against the old windowed one and transformers' ``generate``,
in one run on the same CPU, on one tiny LLaMA (the same weights everywhere), greedy, fp32.

    python scripts/bench_generate.py                      # batch 8, prompts of 16-64 tokens, 64 new tokens
    python scripts/bench_generate.py --batch 4 --new-tokens 32 --repeats 2

* new: :func:`jaxcolossal.generate.make_generator`, the whole batch in one jitted program (prefill,
  then the decode steps in a ``lax.while_loop``), compiled before timing.
* windowed: :func:`jaxcolossal.generate.sample_tokens`, one prompt at a time, one dispatch per token
  recomputing a window of ``--window`` tokens (compiled before timing).
* transformers: ``LlamaForCausalLM.generate(do_sample=False)`` on the left-padded batch with its
  KV cache (torch, eager attention, fp32), with torch on as many threads as cores and on one.

Generated tokens per second of wall time; no eos (every row generates ``--new-tokens``). Prints one
line per sampler and the three ratios (docs/performance.md records them).
"""

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np

from jaxcolossal.config import ModelConfig
from jaxcolossal.generate import Sampling, make_generator, pad_prompts, sample_tokens
from jaxcolossal.models import get_family
from jaxcolossal.models.hf_io import save_hf


def model_config(args) -> ModelConfig:
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 32,
                       num_key_value_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                       vocab_size=args.vocab, max_position_embeddings=1024)


def best_of(fn, repeats: int) -> float:
    """The shortest wall time of ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_new(family, cfg, params, prompts, args) -> float:
    tokens, mask = pad_prompts(prompts)
    fn = make_generator(family, cfg, args.new_tokens, Sampling(greedy=True))
    key = jax.random.key(0)
    return best_of(lambda: jax.block_until_ready(fn(params, tokens, mask, key)), args.repeats)


def bench_windowed(family, cfg, params, prompts, args) -> float:
    step = jax.jit(lambda p, x: family.forward(p, x, cfg)[..., : cfg.vocab_size])
    key = jax.random.key(0)

    def run():
        for p in prompts:
            sample_tokens(step, params, np.asarray(p), args.new_tokens, args.window, key, temperature=0.0)
    return best_of(run, args.repeats)


def bench_transformers(cfg, params, prompts, args, threads: int) -> float | None:
    try:
        import torch  # optional: the reference (the test extra)
        import transformers  # optional: as above
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, cfg, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    tokens, mask = pad_prompts(prompts)
    ids, att = torch.from_numpy(tokens).long(), torch.from_numpy(mask).long()
    torch.set_num_threads(threads)

    def run():
        with torch.no_grad():
            model.generate(ids, attention_mask=att, do_sample=False, max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None)
    return best_of(run, args.repeats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=128, help="the windowed sampler's context (default 128)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cfg = model_config(args)
    family = get_family(cfg)
    params = family.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, args.vocab, rng.integers(16, 65)).tolist() for _ in range(args.batch)]
    generated = args.batch * args.new_tokens
    print(f"tiny LLaMA: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch {args.batch}, "
          f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each, "
          f"greedy, fp32, {jax.devices()[0].platform} ({os.cpu_count()} cores)")
    rates = {"new (KV cache, while_loop)": generated / bench_new(family, cfg, params, prompts, args),
             f"windowed (window {args.window}, per prompt)": generated / bench_windowed(family, cfg, params, prompts, args)}
    for threads in (os.cpu_count() or 1, 1):  # torch's threads fight over a busy machine's cores (compare.py)
        hf = bench_transformers(cfg, jax.tree.map(np.asarray, params), prompts, args, threads)
        if hf is not None:
            rates[f"transformers generate ({threads} thread{'s' * (threads > 1)})"] = generated / hf
    for name, r in rates.items():
        print(f"  {name:36s} {r:10.1f} tokens/s")
    new, *others = rates.values()
    for name, r in zip(list(rates)[1:], others):
        print(f"  new / {name}: {new / r:.2f}x")
    for name, r in zip(list(rates)[2:], others[1:]):
        print(f"  windowed / {name}: {others[0] / r:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
