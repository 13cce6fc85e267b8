"""Activation memory of long sequences per sequence-parallel mode, read from the compiler.

For each sequence length and each mode, compiles the train step of a tiny LLaMA (batch 1 per
data shard, fp32) on ``sp`` simulated devices (``tp`` for Megatron-SP) and prints the compiled
temporaries per device (``memory_analysis().temp_size_in_bytes``): the activations and the
attention scores, which sequence parallelism exists to split. Nothing runs: only compiles, so
32k tokens are affordable on a laptop.

    python scripts/bench_long_context.py                       # 8k, 16k, 32k; sp 1, 2, 4, 8
    python scripts/bench_long_context.py --seq 8192 --sizes 1 2

A first table compares ``model.attention_impl`` xla and flash on one device: flash attention's
temporaries grow linearly with the sequence, XLA attention's quadratically.

The table in docs/long_context.md comes from this script.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxcolossal.config import config_from_dict  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.train.optimizer import build_optimizer  # noqa: E402
from jaxcolossal.train.state import abstract_state, make_plan  # noqa: E402
from jaxcolossal.train.step import make_train_step  # noqa: E402

MODEL = dict(num_layers=2, hidden_size=128, num_attention_heads=8, num_key_value_heads=8, intermediate_size=256,
             max_position_embeddings=65536, loss_chunk_tokens=1024)


def temp_bytes(seq: int, mode: str, n: int, remat: str, impl: str = "xla") -> int:
    par = {"data_parallel_size": 1}
    if mode == "split_gather":
        par.update(tensor_parallel_size=n, sequence_parallelism_mode=mode)
    elif mode != "none":
        par.update(sequence_parallel_size=n, sequence_parallelism_mode=mode)
    cfg = config_from_dict({"model": {**MODEL, "remat": remat, "attention_impl": impl}, "parallel": par,
                            "training": {"seq_len": seq, "batch_size": 1}})
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:n]))
    tx = build_optimizer(cfg.training, plan)
    state = abstract_state(plan, tx)
    x = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=plan.batch_sharding)
    compiled = make_train_step(plan, tx).lower(state, {"inputs": x, "targets": x}).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="sp (tp for split_gather)")
    ap.add_argument("--modes", nargs="+", default=["split_gather", "all_to_all", "ring_attn"])
    ap.add_argument("--remat", default="full", help="model.remat (default full: what long context uses)")
    ap.add_argument("--no-flash", action="store_true", help="skip the xla-vs-flash table")
    a = ap.parse_args()
    if not a.no_flash:
        print(f"one device, model.attention_impl xla vs flash (Pallas, interpreted on CPU), remat {a.remat}: "
              "compiled temporaries, MiB")
        print(f"{'seq':>6} {'xla':>10} {'flash':>10}   xla / flash")
        for seq in a.seq:
            x, f = temp_bytes(seq, "none", 1, a.remat), temp_bytes(seq, "none", 1, a.remat, "flash")
            print(f"{seq:>6} {x / 2**20:>10.1f} {f / 2**20:>10.1f}   {x / f:.1f}", flush=True)
    print(f"compiled temporaries per device, MiB (tiny LLaMA {MODEL['num_layers']} layers, hidden "
          f"{MODEL['hidden_size']}, {MODEL['num_attention_heads']} heads, batch 1, fp32, remat {a.remat})")
    print(f"{'seq':>6} {'mode':>13} " + " ".join(f"{'n=' + str(n):>10}" for n in a.sizes) + "   ratio n=1 / n=max")
    for seq in a.seq:
        base = temp_bytes(seq, "none", 1, a.remat) if 1 in a.sizes else None
        for mode in a.modes:
            row = []
            for n in a.sizes:
                row.append(base if n == 1 else temp_bytes(seq, mode, n, a.remat))
            ratio = f"{row[0] / row[-1]:.2f}" if row[0] and row[-1] else "-"
            print(f"{seq:>6} {mode:>13} " + " ".join(f"{b / 2**20:>10.1f}" for b in row) + f"   {ratio}", flush=True)


if __name__ == "__main__":
    main()
