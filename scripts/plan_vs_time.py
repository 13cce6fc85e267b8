"""The planner's step-time model against measured steps: does it rank layouts as the machine does?

    python scripts/plan_vs_time.py                # 9 + 13 layouts of one small LLaMA, 8 simulated CPU devices
    python scripts/plan_vs_time.py --rounds 6     # quicker, noisier

For each layout (ZeRO stage, tp, pp and its schedule, remat, accumulation) of the same model and
global batch it builds and compiles the real train step, then times all of them in alternating
rounds (one step of each per round, so that they share the machine's load), in one process:
about 9 minutes on 2 cores. The model is a LLaMA of 4 layers, hidden 256; the global batch 32
sequences of 128 tokens.

The planner needs a device. The 8 simulated devices are threads sharing this machine's 2 cores,
unlike any GPU of its table: their matmul rate, the fixed cost of one collective inside a step
(8 threads meeting at a rendezvous on 2 cores), the copy rate of the in-process collectives and
the cost per byte of the memory a step touches (its state, gradients and activations, and the
gradients once per microbatch: the optimizer reads and writes the state, each microbatch writes
and adds up its weight gradients, the saved activations leave the caches, XLA:CPU allocates the
temporaries afresh each run) are
properties of this machine. The script measures them: it fits these four constants (and a fixed
per-step cost, which changes no ranking) by non-negative least squares to the measured steps of
the CALIBRATION layouts, builds the ``Device`` they describe (``shared_host=True``: a stage idle
in the pipeline's bubble leaves its cores to the others), and then ranks the other layouts,
LAYOUTS, with :func:`jaxcolossal.plan.predict` (``backend="cpu"``: the collectives XLA:CPU emits)
and compares that ranking with the measured one: Spearman's ρ, the target ρ ≥ 0.8. The two sets
share no layout. It also prints the test-retest ρ of the measurement (the medians of the odd
rounds against the even ones: how well the measurement ranks itself, a gauge of its noise) and
three of the constants from microbenchmarks, for comparison. A measurement script, not a test: it compiles
and runs every layout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from scipy.optimize import nnls

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=768,
             vocab_size=1024, max_position_embeddings=128)


def _pp(p: int, schedule: str, m: int, **kw) -> dict:
    return dict(pipeline_parallel_size=p, pipeline_schedule=schedule, num_microbatches=m, **kw)


LAYOUTS = [  # (parallel, remat, accumulation): the ranked layouts
    (dict(zero_stage=0), "none", 1),
    (dict(zero_stage=3), "full", 1),
    (dict(zero_stage=3), "none", 4),
    (dict(zero_stage=2), "full", 4),
    (dict(zero_stage=1, tensor_parallel_size=2), "none", 1),
    (dict(zero_stage=0, tensor_parallel_size=4), "none", 1),
    (dict(zero_stage=1, tensor_parallel_size=4), "full", 4),
    (dict(zero_stage=3, tensor_parallel_size=4), "none", 16),
    (dict(zero_stage=1, **_pp(2, "1f1b", 4)), "none", 1),
    (dict(zero_stage=0, **_pp(4, "1f1b", 8)), "none", 1),
    (dict(zero_stage=0, **_pp(4, "gpipe", 8)), "none", 1),
    (dict(zero_stage=1, tensor_parallel_size=2, **_pp(2, "interleaved", 8, num_model_chunks=2)), "none", 1),
    (dict(zero_stage=0, tensor_parallel_size=4, **_pp(2, "1f1b", 2)), "none", 1),
]
CALIBRATION = [  # the layouts that measure the device's constants: none of LAYOUTS
    (dict(zero_stage=1), "none", 1),
    (dict(zero_stage=1), "full", 1),
    (dict(zero_stage=2), "none", 4),
    (dict(zero_stage=3), "full", 4),
    (dict(zero_stage=0, tensor_parallel_size=2), "full", 2),
    (dict(zero_stage=3, tensor_parallel_size=2), "none", 8),
    (dict(zero_stage=2, tensor_parallel_size=4), "none", 1),
    (dict(zero_stage=1, **_pp(2, "1f1b", 8)), "none", 1),
    (dict(zero_stage=0, **_pp(2, "gpipe", 4)), "none", 1),
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
    """Microbenchmarks, for comparison with the fitted constants: (fp32 matmul FLOP/s, the bytes/s
    of an elementwise op writing fresh memory: read + write) of this machine, each divided by ``devices``, and the
    time of one small all-reduce over the ``devices`` simulated devices (seconds)."""
    import jax  # heavy: jax; main() sets devices first
    import jax.numpy as jnp  # heavy: jax; main() sets devices first

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
    from jax.sharding import PartitionSpec as P  # heavy: jax; main() sets devices first
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


def terms(cfg, devices: int = 8) -> list[float]:
    """The planner's cost terms of one layout on a ``shared_host`` device, the ones the device's
    constants multiply (:func:`jaxcolossal.plan.cost_terms`): matmul FLOPs, collectives, bytes
    sent (the collectives XLA:CPU emits) and the bytes the step touches (``cost_terms``' ``memory``),
    per device per step."""
    from jaxcolossal.plan import cost_terms  # heavy: jax; main() sets devices first
    c = cost_terms(cfg, devices, shared_host=True, backend="cpu")
    return [c["flops"], c["collectives"], sum(b for _, b in c["bytes"]), c["memory"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="alternating timing rounds (default 8)")
    ap.add_argument("--batch", type=int, default=32, help="global batch, sequences (default 32)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length, tokens (default 128)")
    a = ap.parse_args(argv)

    from jaxcolossal import simulate_devices  # heavy: jax; main() sets devices first
    simulate_devices(8)
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.config import config_from_dict  # heavy: jax; main() sets devices first
    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.plan import Device, predict  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    flops, fresh, latency = machine(8)
    runs = []
    for role, layouts in (("calibration", CALIBRATION), ("ranked", LAYOUTS)):
        for par, remat, k in layouts:
            raw = {"model": {**MODEL, "remat": remat},
                   "training": {"batch_size": a.batch, "seq_len": a.seq, "gradient_accumulation_steps": k},
                   "parallel": {"data_parallel_size": -1, **par}}
            cfg = config_from_dict(raw)
            plan = make_plan(cfg, make_mesh(cfg.parallel))
            tx = build_optimizer(cfg.training, plan)
            state = init_state(plan, tx, key=jax.random.key(0))
            x = np.random.default_rng(0).integers(0, MODEL["vocab_size"], (a.batch, a.seq + 1)).astype(np.int32)
            batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                     "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
            step = make_train_step(plan, tx).lower(state, batch).compile()
            state, m = step(state, batch)  # warm-up
            jax.block_until_ready(m)
            dp = cfg.parallel.resolve(8).data_parallel_size
            name = f"dp={dp} " + " ".join(f"{key}={v}" for key, v in par.items()) + f" remat={remat} k={k}"
            print(f"compiled {role} {len(runs) + 1}/{len(CALIBRATION) + len(LAYOUTS)}: {name}", flush=True)
            runs.append({"role": role, "name": name, "cfg": cfg, "step": step, "state": state, "batch": batch,
                         "terms": terms(cfg), "times": []})
    print(f"timing {a.rounds} rounds ...", flush=True)
    for _ in range(a.rounds):
        for r in runs:
            t0 = time.perf_counter()
            r["state"], m = r["step"](r["state"], r["batch"])
            jax.block_until_ready((r["state"], m))
            r["times"].append(time.perf_counter() - t0)
    for r in runs:
        r["measured"] = statistics.median(r["times"])
    cal = [r for r in runs if r["role"] == "calibration"]
    ranked = [r for r in runs if r["role"] == "ranked"]

    # the device's constants: measured step = fixed + FLOPs/rate + collectives·α + bytes/β + memory·cost
    coef, _ = nnls(np.array([r["terms"] + [1.0] for r in cal]), np.array([r["measured"] for r in cal]))
    inv = lambda c: 1 / c if c > 0 else float("inf")  # noqa: E731
    dev = Device("simulated CPU device", 64e9, 2 * inv(coef[0]), inv(coef[2]), inv(coef[2]), per_node=8,
                 latency=coef[1], shared_host=True, memory_cost=coef[3])
    print(f"one simulated device, fitted to the {len(cal)} calibration layouts (microbenchmark in brackets):")
    print(f"  matmul {inv(coef[0]) / 1e9:.2f} GFLOP/s fp32 [{flops / 1e9:.2f}: a 1024³ matmul, 1/8 of the machine]")
    print(f"  α {coef[1] * 1e6:.0f} µs per collective [{latency * 1e6:.0f}: a small all-reduce over 8, back to back]")
    print(f"  β {inv(coef[2]) / 1e9:.2f} GB/s [{fresh / 1e9:.2f}: an elementwise op into fresh memory, 1/8 of the machine]")
    print(f"  memory {coef[3] * 1e9:.2f} s/GB (of the bytes touched: the need, and the gradients per microbatch); fixed {coef[4]:.3f} s per step (changes no ranking)")
    print("\n| set | layout | predicted step (s, without the fixed cost): compute + comm | measured median (s) |")
    print("|---|---|---|---|")
    for r in runs:
        r["pred"] = p = predict(r["cfg"], 8, dev, efficiency=1.0, backend="cpu")
        print(f"| {r['role']} | {r['name']} | {p.step_s:.3f}: {p.compute_s:.3f} + {p.comm_s:.3f} | {r['measured']:.3f} |")
    rho = spearman([r["pred"].step_s for r in ranked], [r["measured"] for r in ranked])
    fit = spearman([r["pred"].step_s for r in cal], [r["measured"] for r in cal])
    retest = spearman([statistics.median(r["times"][0::2]) for r in ranked],
                      [statistics.median(r["times"][1::2]) for r in ranked])
    print(f"\n{len(ranked)} ranked layouts, {a.rounds} alternating rounds: Spearman ρ(predicted, measured) = {rho:.3f} "
          f"(the target: 0.8 or more: {'met' if rho >= 0.8 else 'not met'} in this run; docs/planner.md has "
          f"the spread over runs)")
    print(f"test-retest ρ of the measurement (odd rounds against even): {retest:.3f}; "
          f"ρ on the {len(cal)} calibration layouts: {fit:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
