"""The planner's per-device memory prediction against what XLA compiles, over many layouts.

    python scripts/plan_vs_compiler.py                  # XLA's GPU compiler, 8 compile-only H200s
    python scripts/plan_vs_compiler.py --target cpu     # XLA:CPU, 8 simulated CPU devices
    python scripts/plan_vs_compiler.py --limit 5        # the first 5 only

For each configuration it builds the real train step, compiles it, and compares the planner's
predicted per-device peak (``jaxcolossal.memory.budget.need``: state + fp32 gradients + activation
estimate, with the memory terms of the compiler's backend) with the compiled step's
``memory_analysis()``: arguments + outputs − aliased + temporaries (per device). ``--target``
(default ``h200x8``) compiles for a GPU fleet without its GPUs (``jaxcolossal.aot``; the
``gpu-compile`` extra), as ``scripts/train.py --compile-for`` does; ``--target cpu`` compiles for
XLA:CPU's simulated devices, with the memory model's XLA:CPU terms. It prints one row per configuration, the error of each, and the worst and the
median. The bar is 10%. A measurement script, not a test: the sweep compiles dozens of
programs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import yaml

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # --target: the CUDA plugin without a GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxcolossal.aot import fleet, target  # noqa: E402
from jaxcolossal.config import config_from_dict  # noqa: E402
from jaxcolossal.memory.budget import need  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule  # noqa: E402
from jaxcolossal.train.state import abstract_state, make_plan  # noqa: E402
from jaxcolossal.train.step import make_train_step  # noqa: E402

MODELS = {  # name: model section (LLaMA); the sizes grow from tiny to ~100M parameters
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=768),
    "medium": dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                   intermediate_size=1536),
    "large": dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=12,
                  intermediate_size=2048, vocab_size=8192),
}

SWEEP = [  # (model, parallel, precision, remat, accumulation)
    ("tiny", dict(zero_stage=0), None, "none", 1),
    ("tiny", dict(zero_stage=3), None, "full", 4),
    ("small", dict(zero_stage=0), None, "none", 1),
    ("small", dict(zero_stage=1), None, "none", 1),
    ("small", dict(zero_stage=2), None, "none", 4),
    ("small", dict(zero_stage=3), None, "none", 1),
    ("small", dict(zero_stage=3), "bf16", "full", 1),
    ("small", dict(zero_stage=1, tensor_parallel_size=2), None, "none", 1),
    ("small", dict(zero_stage=2, tensor_parallel_size=4), "bf16", "dots", 1),
    ("small", dict(zero_stage=3, tensor_parallel_size=2), "bf16", "full", 4),
    ("small", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="gpipe"), None, "none", 1),
    ("small", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="1f1b"), None, "none", 1),
    ("small", dict(zero_stage=0, pipeline_parallel_size=4, pipeline_schedule="1f1b"), "bf16", "full", 1),
    ("small", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="interleaved", num_model_chunks=2),
     None, "none", 1),
    ("medium", dict(zero_stage=0), "bf16", "none", 1),
    ("medium", dict(zero_stage=1), "bf16", "full", 1),
    ("medium", dict(zero_stage=2), None, "none", 1),
    ("medium", dict(zero_stage=3), None, "dots", 4),
    ("medium", dict(zero_stage=3), "bf16", "none", 1),
    ("medium", dict(zero_stage=1, tensor_parallel_size=2), "bf16", "none", 4),
    ("medium", dict(zero_stage=2, tensor_parallel_size=4), None, "full", 1),
    ("medium", dict(zero_stage=3, tensor_parallel_size=2), "bf16", "dots", 1),
    ("medium", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="1f1b"), "bf16", "full", 1),
    ("medium", dict(zero_stage=0, pipeline_parallel_size=4, pipeline_schedule="gpipe"), None, "none", 1),
    ("medium", dict(zero_stage=1, pipeline_parallel_size=2, tensor_parallel_size=2), "bf16", "none", 1),
    ("large", dict(zero_stage=1), "bf16", "full", 1),
    ("large", dict(zero_stage=2), "bf16", "none", 4),
    ("large", dict(zero_stage=3), "bf16", "full", 1),
    ("large", dict(zero_stage=3, tensor_parallel_size=2), None, "full", 1),
    ("large", dict(zero_stage=1, tensor_parallel_size=4), "bf16", "dots", 1),
    ("large", dict(zero_stage=1, pipeline_parallel_size=4, pipeline_schedule="1f1b"), "bf16", "full", 1),
    ("large", dict(zero_stage=0, pipeline_parallel_size=2, pipeline_schedule="interleaved", num_model_chunks=2),
     "bf16", "none", 1),
    # added after the model was fitted to the rows above, as a check on layouts it had not seen
    ("small", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="interleaved", num_model_chunks=2),
     "bf16", "none", 1),
    ("medium", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="interleaved", num_model_chunks=2),
     "bf16", "none", 1),
    ("small", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="gpipe", num_model_chunks=2),
     "bf16", "none", 1),
    ("medium", dict(zero_stage=1, pipeline_parallel_size=2, pipeline_schedule="gpipe", num_model_chunks=2),
     "bf16", "none", 1),
]


OVERRIDES: list = []
"""``--set section.key=value`` overrides, applied to every row."""


def config(model: str, parallel: dict, precision: str | None, remat: str, k: int, seq: int = 128, batch: int = 16):
    """One sweep row's config (a pipeline row's ``k``: its microbatches, at least ``2·pp``)."""
    raw = {"model": {**MODELS[model], "max_position_embeddings": seq, "remat": remat},
           "training": {"batch_size": batch, "seq_len": seq, "gradient_accumulation_steps": k},
           "parallel": {"data_parallel_size": -1, **parallel}}
    if precision:
        raw["precision"] = {precision: True}
    for item in OVERRIDES:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    cfg = config_from_dict(raw)
    if cfg.parallel.pipeline_parallel_size > 1:
        cfg.training.gradient_accumulation_steps = 1
        cfg.parallel.num_microbatches = max(k, 2 * cfg.parallel.pipeline_parallel_size)
    return cfg


def measure_gpu(cfg, fleet_name: str) -> tuple[float, float, dict]:
    """(predicted bytes, compiled bytes, predicted parts) per device, compiled by XLA's GPU compiler."""
    tgt, n = target.parse_fleet(fleet_name)
    fc = fleet.compile_for(cfg, tgt, n, keep_hlo=False)
    predicted = need(cfg, n, backend="gpu")
    return float(predicted["total"]), float(fc.peak), predicted


def measure(model: str, parallel: dict, precision: str | None, remat: str, k: int, seq: int = 128,
            batch: int = 16, fleet_name: str = "") -> tuple[float, float, dict]:
    """(predicted bytes, compiled bytes, predicted parts) per device for one configuration, on
    ``fleet_name`` (``h200x8``: XLA:GPU) or, when empty, XLA:CPU's 8 simulated devices."""
    cfg = config(model, parallel, precision, remat, k, seq, batch)
    if fleet_name:
        return measure_gpu(cfg, fleet_name)
    predicted = need(cfg, 8, backend="cpu")
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    tx = build_optimizer(cfg.training, plan)
    state = abstract_state(plan, tx)
    batch_arr = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=plan.batch_sharding)
    step = make_train_step(plan, tx, lr_schedule(cfg.training))
    ma = step.lower(state, {"inputs": batch_arr, "targets": batch_arr}).compile().memory_analysis()
    compiled = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return float(predicted["total"]), float(compiled), predicted


def _rows(text: str) -> list[int]:
    """``--rows``: comma-separated row numbers (argparse reports the ValueError's message)."""
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated row numbers, e.g. 16,17; got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h200x8", help="the GPU fleet to compile for with XLA's GPU compiler "
                    "(default h200x8), or cpu: XLA:CPU on 8 simulated devices")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for every row, e.g. --set parallel.overlap=false")
    ap.add_argument("--limit", type=int, default=0, help="only the first N configurations")
    ap.add_argument("--rows", type=_rows, default=[],
                    help=f"only these rows of the sweep, e.g. 31,32 (0-based, below {len(SWEEP)})")
    a = ap.parse_args(argv)
    OVERRIDES[:] = a.set
    rows = SWEEP[: a.limit] if a.limit else SWEEP
    if a.rows:
        if not all(0 <= i < len(SWEEP) for i in a.rows):
            ap.error(f"--rows: the sweep has rows 0 to {len(SWEEP) - 1}, got {a.rows}")
        rows = [SWEEP[i] for i in a.rows]
    errs = []
    print("| model | parallel | precision | remat | k | predicted MiB (state + grads + activations) | compiled MiB | error |")
    print("|---|---|---|---|---|---|---|---|")
    for model, par, prec, remat, k in rows:
        t0 = time.time()
        try:
            pred, comp, need = measure(model, par, prec, remat, k, batch=16 if k == 1 else 8 * k,
                                       fleet_name="" if a.target == "cpu" else a.target)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, the rest still run
            print(f"| {model} | {par} | {prec or 'fp32'} | {remat} | {k} | failed: {type(e).__name__}: {str(e)[:120]} | | |")
            continue
        err = (pred - comp) / comp
        errs.append(err)
        mib = lambda b: b / 2**20  # noqa: E731
        print(f"| {model} | {' '.join(f'{key}={v}' for key, v in par.items())} | {prec or 'fp32'} | {remat} | {k} | "
              f"{mib(pred):,.2f} ({mib(need['state']):,.2f} + {mib(need['grads']):,.2f} + {mib(need['activations']):,.2f}) | "
              f"{mib(comp):,.2f} | {err:+.1%} |  ({time.time() - t0:.0f} s)", flush=True)
    if errs:
        worst = max(errs, key=abs)
        print(f"\n{len(errs)} configurations: median |error| {statistics.median(abs(e) for e in errs):.1%}, "
              f"worst {worst:+.1%}; within 10%: {sum(abs(e) <= 0.10 for e in errs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
