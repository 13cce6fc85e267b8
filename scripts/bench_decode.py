"""The KV-cached sampler's decode step on one device: time per step and MBU (memory-bandwidth utilisation).

    python scripts/bench_decode.py                              # the Llama-3-8B shape (one H100/H200)
    python scripts/bench_decode.py --model tiny --batch 4 --prompt 32 --new 16    # a CPU rehearsal

Random weights of ``configs/bench/<model>.yaml``'s model in bf16 (the compute dtype), ``--batch`` prompts of
``--prompt`` tokens, greedy, no end-of-text id (every row decodes ``--new`` tokens). The decode step's time
is the difference of two runs of the same compiled shapes' programs, ``--new`` tokens and 1 token (the
prefill and the first token), divided by ``--new - 1`` (best of ``--repeats``). MBU = the bytes a decode
step must read (the weights once, and the KV cache's filled slots, on average half the new tokens past the
prompt) ÷ the step's time ÷ the device's HBM bandwidth (``jaxcolossal.aot.target``'s table for the
device's name; ``--hbm-gbs`` otherwise). The decode attention is the flash-decoding kernel on a GPU
(``make_generator``'s default), XLA's elsewhere.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcolossal.aot import target
from jaxcolossal.config import load_config
from jaxcolossal.generate import Sampling, make_generator
from jaxcolossal.metrics import param_count
from jaxcolossal.models import get_family


def hbm_bandwidth(device, override: float) -> float:
    """Bytes/s of ``device``'s HBM: ``override`` GB/s when given, else the target table's for its name."""
    if override:
        return override * 1e9
    name = getattr(device, "device_kind", "").lower()
    for key in ("h200", "h100", "a100"):
        if key in name:
            return target.get_target(key).hbm_bw
    raise SystemExit(f"no HBM bandwidth known for {device.device_kind!r}: pass --hbm-gbs")


def run(args) -> dict:
    cfg = load_config(f"configs/bench/{args.model}.yaml").model
    fam = get_family(cfg)
    params = jax.jit(lambda k: jax.tree.map(lambda x: x.astype(jnp.bfloat16), fam.init_params(cfg, k)))(
        jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (args.batch, args.prompt)), jnp.int32)
    mask = jnp.ones(tokens.shape, bool)

    def best(new: int) -> float:
        fn = make_generator(fam, cfg, new, Sampling(greedy=True), eos_id=None)
        jax.block_until_ready(fn(params, tokens, mask, jax.random.key(0)))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(params, tokens, mask, jax.random.key(0)))
            times.append(time.perf_counter() - t)
        return min(times)

    step = (best(args.new) - best(1)) / (args.new - 1)
    weights = 2 * param_count(cfg)["total"]
    slots = args.prompt + args.new / 2  # the cache's filled slots, on average over the decode steps
    kv = args.batch * slots * cfg.num_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    return {"step_s": step, "weights": weights, "kv": kv, "bw": hbm_bandwidth(jax.devices()[0], args.hbm_gbs),
            "device": jax.devices()[0].device_kind}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3_8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hbm-gbs", type=float, default=0.0, help="the device's HBM bandwidth in GB/s (default: known GPUs)")
    args = p.parse_args(argv)
    r = run(args)
    read = r["weights"] + r["kv"]
    print(f"{args.model} on {r['device']}: {args.batch} rows, prompt {args.prompt}, {args.new} new tokens; "
          f"decode step {r['step_s'] * 1e3:.3f} ms, {args.batch / r['step_s']:,.0f} tokens/s; reads "
          f"{r['weights'] / 2**30:.2f} GiB weights + {r['kv'] / 2**30:.2f} GiB KV a step: "
          f"{read / r['step_s'] / 1e9:,.0f} GB/s = MBU {read / r['step_s'] / r['bw']:.1%} of {r['bw'] / 1e9:,.0f} GB/s")


if __name__ == "__main__":
    main()
