"""Pipeline schedules: compiled per-device temporary memory and bubble fraction against m.

    python scripts/bench_pipeline.py                 # pp=4 × dp=2 on 8 simulated CPU devices
    python scripts/bench_pipeline.py --pp 2 --mbs 4  # other sizes

For each schedule (gpipe, 1f1b, interleaved with 2 chunks) and m ∈ {p, 2p, 4p, 8p} pipeline
microbatches of a fixed size (``--mbs`` sequences per data shard, so the global batch grows with
m), it compiles the whole train step (nothing runs) and prints

* ``temp MiB``: ``compiled.memory_analysis().temp_size_in_bytes``, the per-device scratch of the
  step (activations, stash, gradient buffers), and its ratio to the value at m = 2p;
* the schedule table's tick count and bubble fraction, next to the closed form
  (gpipe ``(p−1)/(m·v+p−1)``; 1f1b ``(2p−2)/(m+2p−2)``; interleaved
  ``((v+1)p−2)/(m·v+(v+1)p−2)``; see :mod:`jaxcolossal.parallel.pipeline_schedule`).

Then it checks the claims: 1f1b's memory at m = 8p is within 1.2× of m = 2p, gpipe's grows with
m, the table bubbles equal the formulas, and interleaved's bubble is below 1f1b's at every m
(true for p > 2; at p = 2 the lock-step forms tie). Exit status 1 if a claim fails.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def pipeline_config(schedule: str, pp: int, m: int, dp: int = 1, mbs: int = 2, layers: int = 8,
                    chunks: int = 2, hidden: int = 64, seq: int = 32, zero_stage: int = 0, tp: int = 1):
    """A tiny LLaMA config pipelined with ``schedule`` over ``pp`` stages and ``m`` microbatches
    of ``mbs`` sequences per data shard (global batch ``dp·m·mbs``)."""
    from jaxcolossal.config import config_from_dict  # heavy: jax; main() sets devices first
    return config_from_dict({
        "model": dict(num_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=2 * hidden, max_position_embeddings=max(64, seq)),
        "training": dict(batch_size=dp * m * mbs, seq_len=seq, warmup_steps=1, max_steps=10),
        "parallel": dict(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                         zero_stage=zero_stage, pipeline_schedule=schedule, num_microbatches=m,
                         num_model_chunks=chunks if schedule == "interleaved" else 1),
    })


def compile_step(cfg, devices=None):
    """Lower and compile the train step of ``cfg`` (state initialised, nothing executed)."""
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    mesh = make_mesh(cfg.parallel, devices)
    plan = make_plan(cfg, mesh)
    tx = build_optimizer(cfg.training)
    state = init_state(plan, tx, key=jax.random.key(0))
    t = cfg.training
    tok = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jax.numpy.int32, sharding=plan.batch_sharding)
    return make_train_step(plan, tx).lower(state, {"inputs": tok, "targets": tok}).compile()


def measure(schedule: str, pp: int, m: int, **kw) -> dict:
    """``{temp_bytes, ticks, bubble, formula}`` of one pipelined configuration."""
    from jaxcolossal.parallel.pipeline_schedule import pipeline_schedule_for  # heavy: jax; main() sets devices first
    cfg = pipeline_config(schedule, pp, m, **kw)
    compiled = compile_step(cfg)
    s = pipeline_schedule_for(cfg, pp)
    return {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), "ticks": s.num_ticks,
            "bubble": s.bubble_fraction, "formula": s.bubble_formula}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (dp = devices / pp)")
    ap.add_argument("--mbs", type=int, default=2, help="sequences per microbatch per data shard")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=2, help="model chunks per device for interleaved")
    args = ap.parse_args(argv)

    import jaxcolossal as jc  # heavy: jax; main() sets devices first
    jc.simulate_devices(args.devices)
    import jax  # heavy: jax; main() sets devices first

    p = args.pp
    dp = jax.device_count() // p
    ms = [p, 2 * p, 4 * p, 8 * p]
    print(f"tiny LLaMA: {args.layers} layers, hidden {args.hidden}, seq {args.seq}; mesh pp={p} × dp={dp}; "
          f"microbatch {args.mbs} sequences per data shard; interleaved v={args.chunks}; fp32")
    print(f"{'schedule':<12} {'m':>4} {'ticks':>6} {'bubble':>8} {'formula':>8} {'temp MiB':>10} {'vs m=2p':>8}")
    res = {}
    for sched in ("gpipe", "1f1b", "interleaved"):
        for m in ms:
            r = measure(sched, p, m, dp=dp, mbs=args.mbs, layers=args.layers, chunks=args.chunks,
                        hidden=args.hidden, seq=args.seq)
            res[sched, m] = r
        base = res[sched, 2 * p]["temp_bytes"]
        for m in ms:
            r = res[sched, m]
            print(f"{sched:<12} {m:>4} {r['ticks']:>6} {r['bubble']:>8.4f} {r['formula']:>8.4f} "
                  f"{r['temp_bytes'] / 2**20:>10.3f} {r['temp_bytes'] / base:>8.2f}")

    claims = {
        "1f1b temp memory at m=8p <= 1.2 x m=2p":
            res["1f1b", 8 * p]["temp_bytes"] <= 1.2 * res["1f1b", 2 * p]["temp_bytes"],
        "gpipe temp memory grows with m (strictly, each doubling)":
            all(res["gpipe", 2 * a]["temp_bytes"] > res["gpipe", a]["temp_bytes"] for a in ms[:-1]),
        "table bubbles equal the formulas":
            all(abs(r["bubble"] - r["formula"]) < 1e-12 for r in res.values()),
        "interleaved bubble < 1f1b bubble at every m":
            all(res["interleaved", m]["bubble"] < res["1f1b", m]["bubble"] for m in ms),
    }
    ok = True
    for claim, holds in claims.items():
        print(f"{'PASS' if holds else 'FAIL'}  {claim}")
        ok &= holds
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
