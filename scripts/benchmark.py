"""Training throughput of a named LLaMA under a parallel plan: Colossal-AI's benchmark table.

    python scripts/benchmark.py --model tiny --plan "zero=2,dp=8"          # CPU: 8 simulated devices
    python scripts/benchmark.py --model llama_1b --plan dp=1 --seq 4096    # one GPU
    python scripts/benchmark.py --model llama2_7b                          # 8 GPUs, the preset's plan
    python scripts/benchmark.py --model tiny --plan "zero=3,tp=2" --model-overrides num_layers=8,hidden_size=256

Models are the presets in ``configs/bench/<name>.yaml`` (``tiny``, ``llama_1b``, ``llama_3b``,
``llama2_7b``, ``llama3_8b``, ``llama3_70b``) or any config YAML path. Each preset carries its
default plan, batch, sequence length, precision, remat and attention; the flags replace them.

``--plan`` is a comma-separated list of ``key=value``: the short names ``dp``, ``tp``, ``pp``,
``zero``, ``microbatches``, ``schedule``, ``chunks``, ``accum`` or any ``parallel`` config key
(``zero_stage=3``) or dotted config key (``parallel.zero_stage=3``). A plan replaces the preset's
parallel section (unset sizes are 1, ``dp`` defaults to the remaining devices, ZeRO to 0).

The script builds the sharded train state and the jitted train step
(:mod:`jaxcolossal.train.step`), compiles it, runs ``--warmup`` steps, then ``--steps`` timed
steps on random tokens, each ended by ``block_until_ready``. The step time is the median of the
timed steps (the mean is in the JSON). It prints one markdown row with the columns of
Colossal-AI's benchmark tables — hardware and number of devices, model size and parallel
strategy, batch per DP and sequence length, throughput (samples/s over the whole data-parallel
group), TFLOPS per device in both conventions of :mod:`jaxcolossal.metrics` (model FLOPs
6N + attention, and Colossal-AI's 2·N·(3 + recompute)), MFU when the device's peak is known,
and peak memory per device — then one JSON object (last line; also written to ``--out``).

Peak memory: on GPU ``device.memory_stats()['peak_bytes_in_use']`` (the max over local
devices, the whole process); on CPU, where the backend keeps no such statistics, the compiled
step's ``memory_analysis()`` (arguments + outputs − donated aliases + temporaries, per device),
labelled ``compiled``.

With no accelerator the host CPU is split into ``--devices`` simulated devices (default: the
product of the plan's sizes, else 8). Under torchrun/SLURM/Open MPI it calls the matching
launcher (``jc.launch_from_env``) and process 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
BENCH_CONFIGS = os.path.join(ROOT, "configs", "bench")

PLAN_ALIASES = {
    "dp": "parallel.data_parallel_size", "tp": "parallel.tensor_parallel_size",
    "pp": "parallel.pipeline_parallel_size", "zero": "parallel.zero_stage",
    "microbatches": "parallel.num_microbatches", "schedule": "parallel.pipeline_schedule",
    "chunks": "parallel.num_model_chunks", "accum": "training.gradient_accumulation_steps",
}
PARALLEL_RESET = ["parallel.data_parallel_size=-1", "parallel.tensor_parallel_size=1",
                  "parallel.pipeline_parallel_size=1", "parallel.zero_stage=0"]


def model_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(BENCH_CONFIGS) if f.endswith(".yaml"))


def config_path(model: str) -> str:
    """``configs/bench/<model>.yaml`` for a preset name, else ``model`` itself (a YAML path)."""
    path = os.path.join(BENCH_CONFIGS, f"{model}.yaml")
    if os.path.exists(path):
        return path
    if os.path.exists(model):
        return model
    raise SystemExit(f"--model {model!r}: not a preset {model_names()} nor a YAML file")


def plan_overrides(plan: str) -> list[str]:
    """``"zero=3,tp=2"`` -> config overrides (the parallel section reset first)."""
    from jaxcolossal.config import ParallelConfig  # heavy: jax; main() sets devices first

    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    out = list(PARALLEL_RESET)
    for item in filter(None, (s.strip() for s in plan.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise SystemExit(f"--plan item {item!r}: expected key=value")
        if key in PLAN_ALIASES:
            key = PLAN_ALIASES[key]
        elif key in fields:
            key = f"parallel.{key}"
        elif "." not in key:
            raise SystemExit(f"--plan key {key!r}: use one of {sorted(PLAN_ALIASES)}, a parallel key "
                             f"{sorted(fields)} or a dotted config key")
        out.append(f"{key}={value.strip()}")
    return out


def model_overrides(text: str) -> list[str]:
    """``"num_layers=2,hidden_size=64"`` -> ``model.num_layers=2 ...``."""
    out = []
    for item in filter(None, (s.strip() for s in text.replace(" ", ",").split(","))):
        if "=" not in item:
            raise SystemExit(f"--model-overrides item {item!r}: expected key=value")
        out.append(item if item.startswith("model.") else f"model.{item}")
    return out


def load_bench_config(args):
    """The validated :class:`Config` for the command line (before any device is needed)."""
    from jaxcolossal.config import load_config  # heavy: jax; main() sets devices first

    ov = model_overrides(args.model_overrides or "")
    if args.plan:
        ov += plan_overrides(args.plan)
    if args.precision:
        ov += [f"precision.bf16={str(args.precision == 'bf16').lower()}",
               f"precision.fp16={str(args.precision == 'fp16').lower()}"]
    if args.remat:
        ov.append(f"model.remat={args.remat}")
    if args.attention:
        ov.append(f"model.attention_impl={args.attention}")
    if args.seq:
        ov.append(f"training.seq_len={args.seq}")
    ov += list(args.set or [])
    cfg = load_config(config_path(args.model), ov + ["training.max_steps=1000000"])
    t = cfg.training
    # RoPE needs no table of positions: max_position_embeddings only bounds seq_len
    cfg.model.max_position_embeddings = max(cfg.model.max_position_embeddings, t.seq_len)
    accum = t.gradient_accumulation_steps
    if args.batch_per_dp:
        if args.batch_per_dp % accum:
            raise SystemExit(f"--batch-per-dp {args.batch_per_dp} is not divisible by accum={accum}")
        t.micro_batch_size = args.batch_per_dp // accum
    elif t.micro_batch_size == 0:
        raise SystemExit("give --batch-per-dp (the config sets no training.micro_batch_size)")
    return cfg


def default_devices(cfg) -> int:
    p = cfg.parallel
    sizes = (p.data_parallel_size, p.tensor_parallel_size, p.pipeline_parallel_size)
    return math.prod(sizes) if -1 not in sizes else 8


def strategy(cfg, shape: dict) -> str:
    """``zero2 dp8``, ``zero3 dp4 tp2``, ``zero1 dp2 tp2 pp2 (1f1b, 8 mb)``."""
    p = cfg.parallel
    dp = shape["dp"] * shape["fsdp"]
    s = f"zero{p.zero_stage} dp{dp}"
    if shape["tp"] > 1:
        s += f" tp{shape['tp']}"
    if shape["pp"] > 1:
        from jaxcolossal.config import pipeline_microbatches  # heavy: jax; main() sets devices first
        s += f" pp{shape['pp']} ({p.pipeline_schedule}, {pipeline_microbatches(cfg, shape['pp'])} mb)"
    if cfg.training.gradient_accumulation_steps > 1 and shape["pp"] == 1:
        s += f" accum{cfg.training.gradient_accumulation_steps}"
    return s


def random_batch(cfg, plan, seed: int) -> dict:
    """Random tokens as global arrays (each process builds the same data, keeps its shards)."""
    import jax  # heavy: jax; main() sets devices first

    t = cfg.training
    x = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32)
    put = lambda a: jax.make_array_from_callback(a.shape, plan.batch_sharding, lambda idx: a[idx])
    return {"inputs": put(np.ascontiguousarray(x[:, :-1])), "targets": put(np.ascontiguousarray(x[:, 1:]))}


def peak_memory(compiled) -> tuple[float | None, str]:
    """(bytes, label): GPU allocator peak, else the compiled step's memory analysis."""
    import jax  # heavy: jax; main() sets devices first

    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        return float(max(s["peak_bytes_in_use"] for s in stats)), "peak_bytes_in_use"
    ma = compiled.memory_analysis()
    if ma is None:
        return None, "unavailable"
    total = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
             + ma.temp_size_in_bytes)
    return float(total), "compiled"


def run(cfg, warmup: int, steps: int, seed: int = 0, log=print) -> dict:
    """Build, compile, warm up and time the train step for ``cfg`` on all devices; the result dict."""
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal import metrics as mx  # heavy: jax; main() sets devices first
    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    plan = make_plan(cfg, make_mesh(cfg.parallel))  # validates; fills batch_size from micro_batch_size
    shape, t, m = plan.mesh_shape, cfg.training, cfg.model
    n, dp = plan.mesh.size, shape["dp"] * shape["fsdp"]
    tx = build_optimizer(t, plan)
    state = init_state(plan, tx, key=jax.random.key(seed))
    batches = [random_batch(cfg, plan, seed + i) for i in range(2)]
    step = make_train_step(plan, tx)
    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    log(f"compiled in {compile_s:.1f} s; {warmup} warmup + {steps} timed steps")

    losses = []
    for i in range(warmup):
        state, metrics = compiled(state, batches[i % 2])
        losses.append(float(metrics["loss"]))
    jax.block_until_ready(state)
    times = []
    for i in range(steps):
        t1 = time.perf_counter()
        state, metrics = compiled(state, batches[i % 2])
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t1)
        losses.append(float(metrics["loss"]))
    step_s = statistics.median(times)

    dev = jax.devices()[0]
    kind = dev.device_kind
    recompute = m.remat != "none"
    tp = mx.throughput(m, batch_size=t.batch_size, seq_len=t.seq_len, step_seconds=step_s, num_devices=n,
                       peak=mx.mfu_peak(jax.devices()), recompute=recompute)
    mem, mem_label = peak_memory(compiled)
    nparams = mx.param_count(m)["total"]
    simulated = dev.platform == "cpu" and n > 1
    return {
        "hardware": kind + (" (simulated devices on the host CPU)" if simulated else ""),
        "platform": dev.platform, "num_devices": n, "processes": jax.process_count(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "model": cfg.model.type, "params": nparams, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "strategy": strategy(cfg, shape), "mesh": shape, "zero_stage": cfg.parallel.zero_stage,
        "precision": cfg.precision.mode, "remat": m.remat, "attention": m.attention_impl,
        "optimizer": t.optimizer, "batch_per_dp": t.batch_size // dp, "global_batch": t.batch_size,
        "seq_len": t.seq_len, "warmup": warmup, "steps": steps,
        "step_s_median": step_s, "step_s_mean": statistics.fmean(times), "step_s_all": times,
        "compile_s": compile_s, **tp,
        "flops_per_token": mx.flops_per_token(m, t.seq_len, recompute),
        "peak_memory_bytes": mem, "peak_memory_source": mem_label,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


HEADER = ("| hardware | devices | model | strategy | precision, remat, attention | batch/DP | seq | "
          "samples/s | tokens/s | TFLOPS/dev 6N+attn | TFLOPS/dev Colossal 2N(3+r) | MFU | peak mem/dev |")


def planner_device(kind: str):
    """The planner's :class:`jaxcolossal.plan.Device` for a JAX ``device_kind`` ("NVIDIA H200",
    "NVIDIA A100-SXM4-80GB", ...), or ``None`` when its table has no such device (CPUs)."""
    from jaxcolossal.plan import DEVICES  # heavy: jax; main() sets devices first

    k = kind.lower()
    for name in ("h200", "h100", "b200"):
        if name in k:
            return DEVICES[name]
    if "a100" in k:
        return DEVICES["a100-80" if "80" in k else "a100-40"]
    return None


def planner_prediction(cfg, r: dict) -> dict:
    """The planner's predicted step time for the measured run ``r`` (same layout, devices and
    kind), and its ratio to the measured median: ``{}`` where the planner has no such device."""
    from jaxcolossal.plan import predict  # heavy: jax; main() sets devices first

    dev = planner_device(r["hardware"])
    if dev is None:
        return {}
    p = predict(cfg, r["num_devices"], dev)
    return {"predicted_step_s": p.step_s, "predicted_over_measured": p.step_s / r["step_s_median"]}


def human(n: float) -> str:
    """1.24e9 -> '1.24 B', 8.5e5 -> '0.85 M'."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def markdown_row(r: dict, model_name: str) -> str:
    mem = r["peak_memory_bytes"]
    if mem is None:
        mem_s = "n/a"
    else:
        mem_s = f"{mem / 2**30:.2f} GiB" if mem >= 2**30 else f"{mem / 2**20:.1f} MiB"
        mem_s += " (compiled)" if r["peak_memory_source"] == "compiled" else ""
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"| {r['hardware']} | {r['num_devices']} | {model_name} ({human(r['params'])}) | {r['strategy']} | "
            f"{r['precision']}, {r['remat']}, {r['attention']} | {r['batch_per_dp']} | {r['seq_len']} | "
            f"{r['samples_per_s']:.3g} | {r['tokens_per_s']:.4g} | {r['tflops_6n']:.3g} | "
            f"{r['tflops_colossal']:.3g} | {mfu} | {mem_s} |")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset in configs/bench (" + ", ".join(model_names())
                    + ") or a config YAML")
    ap.add_argument("--model-overrides", default="", help="model keys, e.g. num_layers=2,hidden_size=64")
    ap.add_argument("--plan", default=None, help='parallel plan, e.g. "dp=8" or "zero=3,tp=2"')
    ap.add_argument("--batch-per-dp", type=int, default=None, help="sequences per data-parallel rank per step")
    ap.add_argument("--seq", type=int, default=None, help="sequence length")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None)
    ap.add_argument("--remat", choices=["none", "selective", "dots", "save_qkv_proj", "full"], default=None)
    ap.add_argument("--attention", choices=["xla", "cudnn"], default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--devices", type=int, default=None, help="simulated CPU devices when there is no accelerator")
    ap.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE", help="any other config override")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--no-header", action="store_true", help="print the markdown row without the header")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import jaxcolossal as jc  # heavy: jax; main() sets devices first
    from jaxcolossal.config import ConfigError  # heavy: jax; main() sets devices first

    try:
        cfg = load_bench_config(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    jc.simulate_devices(args.devices or default_devices(cfg))
    jc.launch_from_env(verbose=False)
    import jax  # heavy: jax; main() sets devices first

    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    if cfg.model.attention_impl == "cudnn" and jax.default_backend() != "gpu":
        say("note: model.attention_impl=cudnn needs a GPU; using xla attention on "
            f"{jax.default_backend()}", file=sys.stderr)
        cfg.model.attention_impl = "xla"
    try:
        r = run(cfg, args.warmup, args.steps, log=say)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    name = args.model if os.path.exists(os.path.join(BENCH_CONFIGS, f"{args.model}.yaml")) else cfg.model.type
    if args.model_overrides:
        name += "*"
    r["model_name"] = name
    r["model_overrides"] = args.model_overrides
    r.update(planner_prediction(cfg, r))
    if "predicted_step_s" in r:  # docs/planner.md: the time model beside the measurement
        say(f"planner: {r['predicted_step_s']:.3f} s per step predicted, {r['step_s_median']:.3f} s measured "
            f"(predicted / measured {r['predicted_over_measured']:.2f})")
    else:
        say(f"planner: no prediction ({r['hardware']} is not in its device table)")
    if not args.no_header:
        say(HEADER)
        say("|" + "---|" * (HEADER.count("|") - 1))
    say(markdown_row(r, name))
    line = json.dumps(r)
    if args.out and jax.process_index() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(line + "\n")
    say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
