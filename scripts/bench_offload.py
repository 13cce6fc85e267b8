"""Offload's cost: step time with each offload setting against none, as ratios measured in one run.

    python scripts/bench_offload.py                       # 8 simulated CPU devices, ZeRO-3, bf16
    python scripts/bench_offload.py --devices 1 --hidden 2048 --layers 8 --seq 1024   # one GPU

For each setting (none; 50% and 100% of the optimizer state offloaded, updated on the device or on
the host; the compute params offloaded; the layer projections offloaded as activations) it
compiles the train step, then times the steps round-robin (``--rounds`` rounds of ``--steps``
steps each, so that machine noise hits every setting alike) and prints

* ``ratio``: median step time / the no-offload median;
* ``host in/out``: per-device bytes of the step's arguments and results in host memory, read from
  the compiled HLO's entry layout (:func:`jaxcolossal.aot.hlo.host_io_bytes`): what the step moves over
  the host link with ``optimizer_device=device``;
* ``predicted``: :func:`jaxcolossal.memory.budget.traffic`, the model's host↔device bytes per step;
* ``GB/s``: predicted bytes / (step time − the no-offload step time), the achieved host↔device
  bandwidth when the transfers do not overlap compute (on a GPU: compare with PCIe Gen5 x16,
  ~55 GB/s, or NVLink-C2C, ~450 GB/s per direction on GH200; on the CPU it means nothing: every
  memory kind is the same DRAM).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SETTINGS = {
    "none": {},
    "optim 0.5 device": dict(offload_optim_frac=0.5),
    "optim 1.0 device": dict(offload_optim_frac=1.0),
    "optim 0.5 host": dict(offload_optim_frac=0.5, optimizer_device="host"),
    "optim 1.0 host": dict(offload_optim_frac=1.0, optimizer_device="host"),
    "params 1.0": dict(offload_param_frac=1.0),
    "optim 1.0 nvme": dict(offload_optim_frac=1.0, nvme_path="{tmp}"),  # ZeRO-Infinity: files in a temp folder
    "activations host": dict(activations="host"),
}


def _setup(name, args, n, h, tmp):
    """Build, compile and warm up the train step for one setting."""
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.aot.hlo import host_io_bytes  # heavy: jax; main() sets devices first
    from jaxcolossal.config import config_from_dict  # heavy: jax; main() sets devices first
    from jaxcolossal.memory.budget import traffic  # heavy: jax; main() sets devices first
    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.nvme import nvme_tier  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer, lr_schedule  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    cfg = config_from_dict({
        "model": dict(num_layers=args.layers, hidden_size=h, num_attention_heads=max(4, h // 64),
                      num_key_value_heads=max(2, h // 128), intermediate_size=int(8 * h / 3) // 8 * 8,
                      max_position_embeddings=args.seq, vocab_size=256),
        "training": dict(batch_size=args.batch, seq_len=args.seq, warmup_steps=1, max_steps=1000),
        "parallel": dict(data_parallel_size=n, zero_stage=3),
        "precision": {"bf16": True},
        "offload": {k: v.format(tmp=tmp) if isinstance(v, str) else v for k, v in SETTINGS[name].items()},
    })
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    tx = build_optimizer(cfg.training, plan)
    state = init_state(plan, tx, key=jax.random.key(0))
    tier = nvme_tier(plan, tx)
    if tier is not None:  # the NVMe leaves go to their files
        state = tier.spill(state)
    x = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
             "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
    t0 = time.time()
    compiled = make_train_step(plan, tx, lr_schedule(cfg.training)).lower(state, batch).compile()
    state, m = compiled(state, batch)  # warm-up
    jax.block_until_ready(m)
    return dict(compiled=compiled, state=state, batch=batch, times=[], compile_s=time.time() - t0,
                io=host_io_bytes(compiled.as_text()),
                predicted=traffic(plan.placement, plan.param_shapes, plan.specs, plan.mesh_shape, "bf16"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on a GPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    args = ap.parse_args(argv)
    if "XLA_FLAGS" not in os.environ and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax  # heavy: jax; main() sets devices first

    n = jax.device_count()
    names = [s for s in SETTINGS if not args.only or s in args.only.split(",")]
    if "none" not in names:
        names.insert(0, "none")
    h = args.hidden
    runs = {}
    tmp = tempfile.mkdtemp(prefix="bench_offload_nvme_")
    failed = {}
    for name in list(names):
        try:
            runs[name] = _setup(name, args, n, h, tmp)
        except Exception as e:  # one setting that fails (say, host callbacks on a backend) must not hide the rest
            if name == "none":
                raise
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            names.remove(name)
    for _ in range(args.rounds):
        for name in names:
            r = runs[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                r["state"], m = r["compiled"](r["state"], r["batch"])
            jax.block_until_ready(m)
            r["times"].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(runs["none"]["times"])
    print(f"{jax.devices()[0].device_kind} × {n}; LLaMA {args.layers} layers, hidden {h}, seq {args.seq}, "
          f"batch {args.batch}; ZeRO-3 bf16; median of {args.rounds} rounds × {args.steps} steps")
    print(f"{'setting':<18} {'step ms':>9} {'ratio':>7} {'host in MiB':>12} {'host out MiB':>13} "
          f"{'predicted MiB':>14} {'GB/s':>8}")
    for name in names:
        r = runs[name]
        t = statistics.median(r["times"])
        extra = t - base
        bw = f"{r['predicted'] / extra / 1e9:8.2f}" if r["predicted"] and extra > 0 else f"{'-':>8}"
        print(f"{name:<18} {t * 1e3:9.2f} {t / base:7.3f} {r['io']['host_arguments'] / 2**20:12.3f} "
              f"{r['io']['host_results'] / 2**20:13.3f} {r['predicted'] / 2**20:14.3f} {bw}")
    for name, why in failed.items():
        print(f"{name:<18} FAILED {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
