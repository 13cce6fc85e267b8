"""Rollout decoding with refill (continuous batching over the static KV cache) against the static batch, in
one run on the same CPU, on a long-tail length mix (issue 53, item 2).

    python scripts/bench_rollout.py          # 1024 prompts, 16 slots, 90% end by 16 tokens, 10% run to 256
    python scripts/bench_rollout.py --prompts 256 --slots 16 --max-new 128
    python scripts/bench_rollout.py --layouts none   # without the compile-only GPU part

First, for each config of ``--layouts`` (comma-separated; default the Llama-3-8B, GPT-OSS-20B (ZeRO-1, ep 8) and Mixtral-8x7B (ZeRO-3, ep 8)
GRPO configs) on ``--fleet`` (default 8 H200s), 64 rows of a 513-token prompt and 1,024 new tokens, the collective bytes per device
that XLA's GPU compiler puts in the rollout, without a GPU (``jaxcolossal.aot.fleet.layout_collectives``):
the reshard into the decode layout (once per rollout) and one decode step on the decode layout and on the
training layout. Then the refill part:

Prints, side by side, for three schedules of the same prompts and weights (greedy, fp32):

* static: today's sampler, the whole generation batch as one batch (every row decodes until the last ends);
* static/S: the same sampler on chunks of ``--slots`` prompts, one after the other (the refill's cache size);
* refill: ``make_generator(slots=S)``, a slot taking the next prompt as soon as its row ends;

the decode steps, the decode-slot utilisation (the share of slot-steps that decoded a live row:
``Σ (length − 1) / (slots · steps)``), the wall time (best of ``--repeats`` after a compiled warm-up) and
generated tokens per second, then the ratios refill ÷ static and refill ÷ static/S, and whether every
schedule's completions are token-equal to the static batch's.

How the lengths are controlled (no sampler hook): a tiny LLaMA whose greedy next token is the last one plus
one (mod the vocabulary). Its embeddings are random and large (``--embed-scale``), its LM head the embedding
table shifted by one row, its layers random at the init's scale: they run at full cost, but the residual
stream of the token's embedding dominates the argmax (the script checks every completion against the
schedule). With one eos id ``E``, a prompt whose last token is ``E − L`` ends after ``L`` tokens; a prompt
ending in ``E + 1`` runs to ``--max-new``. The lengths are drawn 90% (``1 − --long-share``) uniform in
``1..--short-max`` and the rest ``--max-new``, in a seeded random queue order; the prompts' other tokens
are random, their lengths uniform in ``4..--prompt-len``.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcolossal.aot import fleet, target
from jaxcolossal.config import ModelConfig, load_config
from jaxcolossal.generate import make_generator, pad_prompts
from jaxcolossal.models import get_family


def successor_model(args):
    """``(family, cfg, params)``: a tiny LLaMA whose greedy next token is the last one plus one (module doc)."""
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 32,
                      num_key_value_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                      vocab_size=args.vocab, max_position_embeddings=args.prompt_len + args.max_new + 8)
    fam = get_family(cfg)
    params = fam.init_params(cfg, jax.random.key(args.seed))
    embed = jax.random.normal(jax.random.key(args.seed + 1), (cfg.vocab_size, cfg.hidden_size)) * args.embed_scale
    head = jnp.roll(embed / jnp.linalg.norm(embed, axis=1, keepdims=True), 1, axis=0).T  # column v: row v − 1
    return fam, cfg, dict(params, embed_tokens=embed, lm_head=jnp.zeros_like(params["lm_head"]).at[:, :cfg.vocab_size].set(head))


def length_mix(args) -> tuple[list[list[int]], np.ndarray]:
    """``(prompts, intended lengths [Q])``: the long-tail mix (module doc)."""
    rng = np.random.default_rng(args.seed)
    n_long = int(round(args.long_share * args.prompts))
    lengths = np.concatenate([np.full(n_long, args.max_new), rng.integers(1, args.short_max + 1, args.prompts - n_long)])
    rng.shuffle(lengths)
    prompts = []
    for n in lengths:
        last = args.eos + 1 if n == args.max_new else args.eos - int(n)
        body = rng.integers(0, args.vocab, rng.integers(3, args.prompt_len)).tolist()
        prompts.append(body + [last])
    return prompts, lengths


def timed(fn, inputs, repeats: int):
    """``(outputs, best wall time)`` of ``fn(*inputs)`` over ``repeats`` calls after a warm-up."""
    out = jax.block_until_ready(fn(*inputs))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*inputs))
        best = min(best, time.perf_counter() - t)
    return out, best


def run(args) -> dict:
    fam, cfg, params = successor_model(args)
    prompts, want = length_mix(args)
    tokens, mask = pad_prompts(prompts)
    key = jax.random.key(0)
    gen = lambda slots: make_generator(fam, cfg, args.max_new, eos_id=args.eos, slots=slots, stats=True)  # noqa: E731
    rows = {}
    static, t = timed(gen(None), (params, tokens, mask, key), args.repeats)
    rows["static"] = (np.asarray(static[0]), np.asarray(static[1]), int(static[2]), len(prompts), t)
    chunk = gen(None)
    outs, lens, steps, total = [], [], 0, 0.0
    for i in range(0, len(prompts), args.slots):
        (o, n, s), t = timed(chunk, (params, tokens[i:i + args.slots], mask[i:i + args.slots], key), args.repeats)
        outs.append(np.asarray(o))
        lens.append(np.asarray(n))
        steps += int(s)
        total += t
    rows["static/S"] = (np.concatenate(outs), np.concatenate(lens), steps, args.slots, total)
    refill, t = timed(gen(args.slots), (params, tokens, mask, key), args.repeats)
    rows["refill"] = (np.asarray(refill[0]), np.asarray(refill[1]), int(refill[2]), args.slots, t)
    return dict(rows=rows, want=want, static_tokens=rows["static"][0])


def report(args, res: dict) -> None:
    rows, want = res["rows"], res["want"]
    print(f"{args.prompts} prompts (<= {args.prompt_len} tokens), max_new {args.max_new}, "
          f"{1 - args.long_share:.0%} of lengths uniform in 1..{args.short_max}, the rest {args.max_new}; "
          f"mean length {want.mean():.1f}; {args.slots} slots; backend {jax.default_backend()}, "
          f"{jax.device_count()} device(s)")
    print(f"{'schedule':10} {'slots':>6} {'decode steps':>13} {'utilisation':>12} {'wall s':>8} {'tokens/s':>10} "
          f"{'lengths ok':>11} {'= static':>9}")
    speed = {}
    for name, (out, lengths, steps, slots, t) in rows.items():
        util = float(np.sum(lengths - 1)) / (slots * steps)
        speed[name] = float(np.sum(lengths)) / t
        same = bool(np.array_equal(out, res["static_tokens"]))
        print(f"{name:10} {slots:>6} {steps:>13} {util:>12.1%} {t:>8.3f} {speed[name]:>10.0f} "
              f"{str(bool(np.array_equal(lengths, want))):>11} {str(same):>9}")
    print(f"tokens/s ratio refill / static: {speed['refill'] / speed['static']:.2f}; "
          f"refill / static/S: {speed['refill'] / speed['static/S']:.2f}")


LAYOUTS = "configs/bench/llama3_8b.yaml,configs/bench/gpt_oss_20b.yaml,configs/bench/mixtral_8x7b.yaml"
GRPO = ["training.objective=grpo", "data.format=prompts", "data.corpus=configs/data/arith_prompts.jsonl",
        "training.batch_size=64", "training.micro_batch_size=0", "training.seq_len=1536",
        "posttrain.max_completion_length=1024", "posttrain.num_generations=8", "posttrain.beta=0.04"]
"""The rollout of the compile-only part: 8 prompts × 8 completions, 513-token prompts, 1,024 new tokens."""


def layouts(spec: str, name: str) -> None:
    """The collective bytes of the rollout's layouts for each config of ``spec`` on fleet ``name`` (module doc)."""
    if spec == "none":
        return
    print("collectives per device, XLA's GPU compiler without a GPU (GiB): reshard once per rollout; one decode step")
    print(f"{'config':28} {'fleet':8} {'decode tp':>9} {'reshard':>9} {'decode layout':>14} {'training layout':>16} "
          f"{'training / decode':>18}")
    gpu, n = target.parse_fleet(name)
    for path in spec.split(","):
        impl = "flash" if load_config(path).model.attention_impl == "flash" else "xla"
        r = fleet.layout_collectives(load_config(path, GRPO + [f"model.attention_impl={impl}"]), gpu, n)
        g = 2 ** 30
        print(f"{os.path.basename(path):28} {name:8} {r['rollout_tp']:>9} {r['reshard'] / g:>9.3f} {r['decode'] / g:>14.4f} "
              f"{r['training'] / g:>16.4f} {r['training'] / max(r['decode'], 1):>17.2f}x")
        print(f"{'':28} the decode layout's step by kind: "
              + ", ".join(f"{kind} {b / g:.4f}" for kind, b in sorted(r["decode_kinds"].items())))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--short-max", type=int, default=16)
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--eos", type=int, default=300)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embed-scale", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default=LAYOUTS, help="configs (comma-separated) of the compile-only part; none: skip it")
    p.add_argument("--fleet", default="h200x8", help="the compile-only part's fleet, GPUxN")
    args = p.parse_args(argv)
    layouts(args.layouts, args.fleet)
    report(args, run(args))


if __name__ == "__main__":
    target.prepare_environment()  # the compile-only GPU devices, before jax's backends start
    main()
