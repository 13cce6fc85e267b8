"""``parallel.overlap``: step time and memory with it on and off, side by side.

    python scripts/bench_overlap.py                                   # tiny preset, 8 simulated CPU devices
    python scripts/bench_overlap.py --model llama_1b --seq 2048 --batch-per-dp 4   # a GPU (gpu_check.sh)
    python scripts/bench_overlap.py --feature collective_matmul --seqs 128,512,2048  # TP collective matmul

``--feature prefetch`` (default): ZeRO-3 with ``model.remat=full``, where ``overlap`` prefetches the
next layer's weights. ``--feature collective_matmul``: Megatron-SP (``split_gather``) over all the
``--tp`` devices (the rest data parallel), where ``overlap`` runs the projections as TP collective matmuls
(:mod:`jaxcolossal.parallel.collective_matmul`); one row per ``--seqs`` length, to find the sequence length
from which it pays (``parallel.collective_matmul_min_seq``). Needs ≥ 2 devices: on one GPU there
is nothing to overlap.

Both train steps (``parallel.zero_stage=3``, ``model.remat=full``; ``parallel.overlap`` false and
true, everything else equal) are compiled in one process, then timed alternately, one step of each
per round, so that both see the same machine load; it prints the median step time of each, the
ratio on/off, the compiled peak memory per device of each, and the final losses (equal up to
fp rounding). What it measures is the prefetch in the layer scan
(:func:`jaxcolossal.parallel.layer_scan.prefetched_scan`); the XLA flags that ``overlap`` also sets
(:mod:`jaxcolossal.runtime.xla_flags`) apply to a whole process and GPUs only, so they are the same on
both sides here. On one device ZeRO-3 gathers nothing, and on the CPU the runtime does not run a
collective concurrently with compute in the way a GPU's streams do: expect a ratio near 1 there.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import benchmark as bm  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a configs/bench preset or a config path")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices when there is no accelerator")
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--batch-per-dp", type=int, default=0)
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None)
    ap.add_argument("--feature", choices=["prefetch", "collective_matmul"], default="prefetch")
    ap.add_argument("--tp", type=int, default=2, help="collective_matmul: tensor-parallel size")
    ap.add_argument("--seqs", default="", help="collective_matmul: comma-separated sequence lengths (default: --seq)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)

    from jaxcolossal import simulate_devices  # heavy: jax; main() sets devices first
    simulate_devices(a.devices)
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    prefetch = a.feature == "prefetch"
    seqs = [int(x) for x in a.seqs.split(",") if x] or [a.seq]
    plan = "zero=3" if prefetch else f"zero=1,tp={a.tp}"
    print(f"feature: {a.feature}")
    header = ("| seq | overlap off: median step (s) | on | on / off | peak memory per device off → on | "
              "loss off / on |\n|---|---|---|---|---|---|")
    for seq in seqs:
        args = argparse.Namespace(model=a.model, model_overrides="", plan=plan, precision=a.precision,
                                  remat="full" if prefetch else "none", attention=None, seq=seq,
                                  set=([] if prefetch else ["parallel.sequence_parallelism_mode=split_gather"])
                                  + ([f"model.max_position_embeddings={seq}"] if seq else []),
                                  batch_per_dp=a.batch_per_dp)
        base = bm.load_bench_config(args)
        runs = {}
        for overlap in (False, True):
            cfg = copy.deepcopy(base)
            cfg.parallel.overlap = overlap
            plan_ = make_plan(cfg, make_mesh(cfg.parallel))
            tx = build_optimizer(cfg.training, plan_)
            state = init_state(plan_, tx, key=jax.random.key(0))
            batch = bm.random_batch(cfg, plan_, 0)
            compiled = make_train_step(plan_, tx).lower(state, batch).compile()
            mem, label = bm.peak_memory(compiled)
            runs[overlap] = {"step": compiled, "state": state, "batch": batch, "times": [], "mem": mem,
                             "label": label}
        if seq == seqs[0]:
            print(f"{jax.devices()[0].device_kind} × {jax.device_count()}; {base.model.num_layers} layers, "
                  f"hidden {base.model.hidden_size}; mesh {plan_.mesh_shape}; ZeRO-{base.parallel.zero_stage}; "
                  f"batch {base.training.batch_size}; {base.precision.mode}; "
                  f"{'remat full' if prefetch else 'Megatron-SP, remat none'}")
            print(header)
        for i in range(a.warmup + a.rounds):
            for overlap, r in runs.items():
                t0 = time.perf_counter()
                r["state"], m = r["step"](r["state"], r["batch"])
                jax.block_until_ready((r["state"], m))
                if i >= a.warmup:
                    r["times"].append(time.perf_counter() - t0)
                r["loss"] = float(m["loss"])
        off, on = (statistics.median(runs[k]["times"]) for k in (False, True))
        mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.1f} MiB"  # noqa: E731
        print(f"| {base.training.seq_len} | {off:.4f} | {on:.4f} | {on / off:.3f} | {mib(runs[False]['mem'])} → "
              f"{mib(runs[True]['mem'])} | {runs[False]['loss']:.6f} / {runs[True]['loss']:.6f} |", flush=True)
    print(f"(median of {a.rounds} alternating rounds per row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
