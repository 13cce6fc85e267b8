"""The planner's step-time model against measured steps: does it rank layouts as the machine does?

    python scripts/plan_vs_time.py                # 10 layouts of one small LLaMA, 8 simulated CPU devices
    python scripts/plan_vs_time.py --rounds 5

For each layout (ZeRO stage, tp, pp, remat, accumulation) of the same model and global batch it
builds and compiles the real train step, then times all of them in alternating rounds (one step
of each per round, so that they share the machine's load), and prints the median step time next
to the planner's prediction (:func:`jaxcolossal.plan.predict` with ``backend="cpu"``: the
collectives XLA:CPU emits) and the Spearman rank correlation between the two. The target is
ρ ≥ 0.8.

The planner needs a device: here the 8 simulated devices share this machine's cores, so the
script measures the machine once first and describes one simulated device as 1/8 of it: its
fp32 matmul rate (a 1024³ matmul, times 2 for the planner's bf16 peak, which it halves for fp32)
and its memory-copy rate (the in-process collectives are copies), both with ``efficiency=1``,
and the time of one small all-reduce over the 8 devices (the α of each collective).
These two constants set the scale, not the order; what is tested is the order. A measurement
script, not a test: it compiles and runs every layout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=768,
             vocab_size=1024, max_position_embeddings=128)
LAYOUTS = [  # (parallel, remat, accumulation)
    (dict(zero_stage=0), "none", 1),
    (dict(zero_stage=1), "none", 1),
    (dict(zero_stage=2), "none", 1),
    (dict(zero_stage=3), "none", 1),
    (dict(zero_stage=3), "full", 1),
    (dict(zero_stage=1), "full", 1),
    (dict(zero_stage=2), "none", 4),
    (dict(zero_stage=3), "full", 4),
    (dict(zero_stage=1, tensor_parallel_size=2), "none", 1),
    (dict(zero_stage=1, tensor_parallel_size=4), "none", 1),
    (dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="1f1b", num_microbatches=4), "none", 1),
]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's ρ of two equal-length lists (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(x):
            j = i
            while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / ((sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5)


def machine(devices: int) -> tuple[float, float, float]:
    """(fp32 matmul FLOP/s, copy bytes/s) of this machine, each divided by ``devices``, and the
    time of one small all-reduce over the ``devices`` simulated devices (seconds)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = jax.devices()[0]
    a = jax.device_put(np.ones((1024, 1024), np.float32), cpu)
    mm = jax.jit(lambda x: x @ x)
    cp = jax.jit(lambda x: x + 1.0)
    big = jax.device_put(np.ones((64 * 2**20 // 4,), np.float32), cpu)
    mm(a).block_until_ready(), cp(big).block_until_ready()
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        mm(a).block_until_ready()
        t.append(time.perf_counter() - t0)
    flops = 2 * 1024**3 / min(t)
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        cp(big).block_until_ready()
        t.append(time.perf_counter() - t0)
    copy = 2 * big.nbytes / min(t)  # read + write
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    hops = 200
    ar = jax.jit(jax.shard_map(lambda v: jax.lax.fori_loop(0, hops, lambda i, v: jax.lax.pcast(jax.lax.psum(v, "x") / devices, "x", to="varying"), v),
                               mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    v = jnp.ones((devices, 8), jnp.float32)
    ar(v).block_until_ready()
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        ar(v).block_until_ready()
        t.append(time.perf_counter() - t0)
    return flops / devices, copy / devices, min(t) / hops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    a = ap.parse_args(argv)

    from jaxcolossal import simulate_devices
    simulate_devices(8)
    import jax
    import numpy as np

    from jaxcolossal.config import config_from_dict
    from jaxcolossal.mesh import make_mesh
    from jaxcolossal.plan import Device, predict
    from jaxcolossal.train.optimizer import build_optimizer
    from jaxcolossal.train.state import init_state, make_plan
    from jaxcolossal.train.step import make_train_step

    flops, copy, latency = machine(8)
    dev = Device("simulated CPU device", 64e9, 2 * flops, copy, copy, latency=latency)
    print(f"one simulated device: {flops / 1e9:.2f} GFLOP/s fp32 matmul, {copy / 1e9:.2f} GB/s copy (1/8 of the "
          f"machine); one small all-reduce over 8: {latency * 1e6:.0f} µs")
    runs = []
    for par, remat, k in LAYOUTS:
        raw = {"model": {**MODEL, "remat": remat},
               "training": {"batch_size": a.batch, "seq_len": a.seq, "gradient_accumulation_steps": k},
               "parallel": {"data_parallel_size": -1, **par}}
        cfg = config_from_dict(raw)
        pred = predict(cfg, 8, dev, efficiency=1.0, backend="cpu")  # the collectives XLA:CPU emits
        plan = make_plan(cfg, make_mesh(cfg.parallel))
        tx = build_optimizer(cfg.training, plan)
        state = init_state(plan, tx, key=jax.random.key(0))
        x = np.random.default_rng(0).integers(0, MODEL["vocab_size"], (a.batch, a.seq + 1)).astype(np.int32)
        batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                 "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        step = make_train_step(plan, tx).lower(state, batch).compile()
        state, m = step(state, batch)  # warm-up
        jax.block_until_ready(m)
        name = " ".join(f"{key}={v}" for key, v in par.items()) + f" remat={remat} k={k}"
        runs.append({"name": name, "step": step, "state": state, "batch": batch, "pred": pred, "times": []})
    for _ in range(a.rounds):
        for r in runs:
            t0 = time.perf_counter()
            r["state"], m = r["step"](r["state"], r["batch"])
            jax.block_until_ready((r["state"], m))
            r["times"].append(time.perf_counter() - t0)
    print("| layout | predicted step (s): compute + comm | measured median (s) |")
    print("|---|---|---|")
    for r in runs:
        p = r["pred"]
        r["measured"] = statistics.median(r["times"])
        print(f"| {r['name']} | {p.step_s:.3f}: {p.compute_s:.3f} + {p.comm_s:.3f} | {r['measured']:.3f} |")
    rho = spearman([r["pred"].step_s for r in runs], [r["measured"] for r in runs])
    print(f"\n{len(runs)} layouts, {a.rounds} alternating rounds: Spearman ρ(predicted, measured) = {rho:.3f} "
          f"(the target: 0.8 or more)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
