"""Print per-device model-state memory and per-step collectives for ZeRO 0-3, measured.

    python scripts/zero_report.py                 # 8 simulated CPU devices, fp32 and bf16
    python scripts/zero_report.py --precision bf16 --accum 4

For each ZeRO stage: the bytes of params / gradients / optimizer state one device holds
(measured from the arrays' shards; gradients from their buffer spec) next to the ZeRO paper's (docs/zero.md)
formula, and the collectives in the compiled train step (kind, count, and the elements they
produce per step, relative to Ψ). On the CPU backend gradient reduce-scatters appear as
all-reduce + dynamic-slice and bf16 collectives are widened to f32 (see tests/integration/
test_hlo_collectives.py); the GPU backend emits reduce-scatter and bf16.
"""

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def measure(precision: str, zero: int, *, accum: int = 1, hidden: int = 256, layers: int = 4,
            seq: int = 64) -> dict:
    """Build the train step of a LLaMA over all devices (ZeRO ``zero`` over a data group of all of
    them) and measure it.

    Returns ``{"psi", "n", "measured", "formula", "collectives", "hlo"}``: Ψ (every parameter),
    the ZeRO group size, per-device bytes of params / grads / optimizer measured from the arrays
    (:func:`jaxcolossal.metrics.model_state_bytes`) and from the ZeRO paper's (docs/zero.md) formula, the compiled
    step's per-step collective totals (:func:`jaxcolossal.aot.hlo.collective_totals`) and its HLO text.
    Call after the device count is set (``jc.simulate_devices``).
    """
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal import metrics as mx  # heavy: jax; main() sets devices first
    from jaxcolossal.aot import hlo  # heavy: jax; main() sets devices first
    from jaxcolossal.config import config_from_dict  # heavy: jax; main() sets devices first
    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import BYTES_PER_PARAM, init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    n = jax.device_count()
    raw = {"model": dict(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=4 * hidden),
           "training": dict(batch_size=n * accum, seq_len=seq, gradient_accumulation_steps=accum),
           "parallel": dict(data_parallel_size=n, zero_stage=zero)}
    if precision != "fp32":
        raw["precision"] = {precision: True}
    cfg = config_from_dict(raw)
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    tx = build_optimizer(cfg.training)
    state = init_state(plan, tx, key=jax.random.key(0))
    got = mx.model_state_bytes(state, plan.specs.grads, plan.param_shapes, plan.mesh_shape)
    psi = sum(math.prod(s) for s in jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple)))
    want = mx.zero_formula_bytes(psi, plan.mesh_shape["fsdp"], zero, **BYTES_PER_PARAM[precision])
    step = make_train_step(plan, tx)
    tokens = np.zeros((cfg.training.batch_size, seq), np.int32)
    batch = {"inputs": jax.device_put(tokens, plan.batch_sharding),
             "targets": jax.device_put(tokens, plan.batch_sharding)}
    text = step.lower(state, batch).compile().as_text()
    return {"psi": psi, "n": plan.mesh_shape["fsdp"], "measured": got, "formula": want,
            "collectives": hlo.collective_totals(text), "hlo": text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation microbatches")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()

    import jaxcolossal as jc  # heavy: jax; main() sets devices first
    jc.simulate_devices(args.devices)
    import jax  # heavy: jax; main() sets devices first

    n = jax.device_count()
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    print(f"{n} devices ({jax.devices()[0].device_kind}); model hidden {args.hidden}, {args.layers} layers; "
          f"{args.accum} microbatch(es) per step")
    print("| precision | ZeRO | params MiB (formula) | grads MiB (formula) | optimizer MiB (formula) | "
          "collectives per step: kind ×count (elements/Ψ) |")
    print("|---|---|---|---|---|---|")
    for prec in precisions:
        for zero in range(4):
            r = measure(prec, zero, accum=args.accum, hidden=args.hidden, layers=args.layers)
            got, want, psi, totals = r["measured"], r["formula"], r["psi"], r["collectives"]
            coll = ", ".join(f"{k} ×{v['count']} ({v['elements'] / psi:.2f})" for k, v in sorted(totals.items()))
            cells = [f"{got[k] / 2**20:.3f} ({want[k] / 2**20:.3f})" for k in ("params", "grads", "optimizer")]
            print(f"| {prec} | {zero} | " + " | ".join(cells) + f" | {coll} |")
    print("\nΨ counts every parameter; formula = the ZeRO formulas (docs/zero.md) with p, g, K of jaxcolossal/train/state.py "
          "(fp32: 4, 4, 8; bf16: 2, 4, 12).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
