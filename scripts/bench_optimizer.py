#!/usr/bin/env python
"""Benchmark fused AdamW vs optax.adamw on LLaMA-1B-like leaf shapes.

Shapes follow TinyLlama-1.1B (hidden 2048, intermediate 5632, 22 layers,
32 heads / 4 KV heads of 64, vocab 32000, untied embeddings): ~1.1e9 params.
``--scale`` shrinks the leading dim of every 2-D leaf (param count ~ scale x
full); the default is 1/64 on CPU (a < 1 minute run) and 1.0 on GPU.

Both optimizers run in the SAME process on the same params/grads, each as a
jitted step with params and optimizer state donated (in place):

* ``optax.adamw``: ``update`` + ``optax.apply_updates`` in one jit.
* ``fused_adamw.apply``: new params written directly by the per-leaf update
  (Pallas kernel on GPU, jnp reference elsewhere -- printed in the output).
* ``fused_adamw.update+apply``: the optax-compatible path (returns deltas).

Reported: params, median time/step over ``--steps`` timed steps after
``--warmup`` steps (``block_until_ready`` each step), effective GB/s at
28 bytes/param (f32: read p, g, m, v; write p, m, v), ratio vs optax, and on
GPU the fraction of the device's HBM peak (H200 4.8 TB/s, H100 3.35 TB/s,
A100 2.0 TB/s, by ``device_kind``) and of a measured device-to-device copy
(jitted ``x + 1`` on a large array: read + write). Ends with one JSON line.

Usage: python scripts/bench_optimizer.py [--scale 0.015625] [--steps 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxcolossal.optim import BYTES_PER_PARAM_F32, fused_adamw  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS = 2048, 5632, 22, 32000, 32, 4
HEAD_DIM = HIDDEN // HEADS
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def llama_shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """TinyLlama-1.1B leaf shapes, leading dim of 2-D leaves times ``scale``."""
    def s(rows, cols):
        return (max(1, round(rows * scale)), cols)

    shapes = {"embed": s(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        pre = f"layer{i:02d}."
        shapes.update({
            pre + "wq": s(HIDDEN, HEADS * HEAD_DIM),
            pre + "wk": s(HIDDEN, KV_HEADS * HEAD_DIM),
            pre + "wv": s(HIDDEN, KV_HEADS * HEAD_DIM),
            pre + "wo": s(HEADS * HEAD_DIM, HIDDEN),
            pre + "w_gate": s(HIDDEN, INTER),
            pre + "w_up": s(HIDDEN, INTER),
            pre + "w_down": s(INTER, HIDDEN),
            pre + "attn_norm": (HIDDEN,),
            pre + "mlp_norm": (HIDDEN,),
        })
    shapes["final_norm"] = (HIDDEN,)
    shapes["lm_head"] = s(HIDDEN, VOCAB)
    return shapes


def make_tree(shapes, seed, scale=1.0):
    @jax.jit
    def build(key):
        keys = jax.random.split(key, len(shapes))
        return {n: scale * jax.random.normal(k, sh, jnp.float32)
                for k, (n, sh) in zip(keys, shapes.items())}
    return build(jax.random.key(seed))


def time_steps(step, params, state, grads, warmup, steps):
    for _ in range(warmup):
        params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, state = step(params, state, grads)
        jax.block_until_ready((params, state))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), params, state


def copy_bandwidth(n_elems, warmup, steps):
    x = jnp.ones((n_elems,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    for _ in range(warmup):
        f(x).block_until_ready()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(ts)  # read + write


def main():
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0 if on_gpu else 1 / 64)
    ap.add_argument("--steps", type=int, default=20 if on_gpu else 7)
    ap.add_argument("--warmup", type=int, default=3 if on_gpu else 2)
    ap.add_argument("--impl", default="auto",
                    choices=["auto", "kernel", "reference"])
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--no-check", action="store_true",
                    help="skip the 1-step fused-vs-optax agreement check")
    args = ap.parse_args()

    impl = args.impl
    if impl == "auto":
        impl = "kernel" if on_gpu else "reference"
    hp = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=args.weight_decay)
    shapes = llama_shapes(args.scale)
    params = make_tree(shapes, 0)
    grads = make_tree(shapes, 1, scale=1e-2)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    dev = jax.devices()[0]
    kind = dev.device_kind
    print(f"backend={backend} device={kind} impl(fused)={impl} "
          f"({'Pallas kernel' if impl == 'kernel' else 'jnp reference'}) "
          f"scale={args.scale:g} leaves={len(shapes)} params={n_params:,}")

    tx_opt = optax.adamw(args.lr, **hp)
    tx_fused = fused_adamw(args.lr, **hp, impl=impl)

    def optax_step(p, s, g):
        u, s = tx_opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def fused_step(p, s, g):
        return tx_fused.apply(g, s, p)

    def fused_update_step(p, s, g):
        u, s = tx_fused.update(g, s, p)
        return optax.apply_updates(p, u), s

    if not args.no_check:  # one step on the first layer's leaves, undonated
        sub = [k for k in shapes if k.startswith("layer00.")]
        p1 = {k: params[k] for k in sub}
        g1 = {k: grads[k] for k in sub}
        a, _ = jax.jit(optax_step)(p1, tx_opt.init(p1), g1)
        b, _ = jax.jit(fused_step)(p1, tx_fused.init(p1), g1)
        check = max(float(jnp.max(jnp.abs(a[k] - b[k]))) for k in sub)
        print(f"check: max|fused - optax| after 1 step (layer00) = {check:.3e}")
    else:
        check = None

    results = {}
    for name, fn, tx in (("optax.adamw", optax_step, tx_opt),
                         ("fused_adamw.apply", fused_step, tx_fused),
                         ("fused_adamw.update+apply", fused_update_step, tx_fused)):
        p = jax.tree.map(jnp.copy, params)
        s = tx.init(p)
        step = jax.jit(fn, donate_argnums=(0, 1))
        t, p, s = time_steps(step, p, s, grads, args.warmup, args.steps)
        results[name] = t
        del p, s

    copy_bw = None
    if on_gpu:
        copy_bw = copy_bandwidth(min(256 * 2**20, max(n_params, 2**20)),
                                 args.warmup, args.steps)
    peak = next((v for k, v in HBM_PEAK.items() if k in kind), None) if on_gpu else None

    bytes_step = BYTES_PER_PARAM_F32 * n_params
    t_opt = results["optax.adamw"]
    hdr = f"{'optimizer':<26}{'params':>15}{'ms/step':>10}{'GB/s':>9}{'vs optax':>10}"
    if on_gpu:
        hdr += f"{'%HBM':>8}{'%copy':>8}"
    print(hdr)
    rows = []
    for name, t in results.items():
        gbs = bytes_step / t / 1e9
        line = (f"{name:<26}{n_params:>15,}{t * 1e3:>10.2f}{gbs:>9.1f}"
                f"{t / t_opt:>10.3f}")
        row = dict(name=name, ms=t * 1e3, gb_s=gbs, ratio_vs_optax=t / t_opt)
        if on_gpu:
            f_hbm = bytes_step / t / peak if peak else None
            f_copy = bytes_step / t / copy_bw
            line += (f"{100 * f_hbm:>7.1f}%" if f_hbm else f"{'n/a':>8}")
            line += f"{100 * f_copy:>7.1f}%"
            row.update(frac_hbm_peak=f_hbm, frac_copy_bw=f_copy)
        print(line)
        rows.append(row)
    if on_gpu:
        print(f"copy bandwidth (x+1, read+write): {copy_bw / 1e9:.1f} GB/s; "
              f"HBM peak for {kind!r}: "
              f"{peak / 1e12 if peak else float('nan'):.2f} TB/s")
    print(f"(GB/s counts {BYTES_PER_PARAM_F32} B/param: read p,g,m,v + write "
          f"p,m,v in f32; 'vs optax' = time / optax time, <1 is faster)")
    print(json.dumps(dict(
        bench="optimizer", backend=backend, device_kind=kind, fused_impl=impl,
        scale=args.scale, params=n_params, bytes_per_param=BYTES_PER_PARAM_F32,
        steps=args.steps, warmup=args.warmup, check_max_abs_diff=check,
        copy_gb_s=copy_bw / 1e9 if copy_bw else None,
        hbm_peak_tb_s=peak / 1e12 if peak else None, results=rows)))


if __name__ == "__main__":
    main()
