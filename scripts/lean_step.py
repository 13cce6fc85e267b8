"""The lean train step, measured: what the fused LM-head loss, the masked-gather embedding and each
remat policy cost, read from compiled programs (no timing), plus the timed checks, in one run.

    python scripts/lean_step.py                    # parts memory, audit, chunk, mainjob
    python scripts/lean_step.py --part audit       # one part
    python scripts/lean_step.py --part memory --bf16

Parts:

memory. A LLaMA with vocabulary 128256, hidden 2048, 2 layers (the Llama-3.2-1B shape cut to 2
   layers), batch 4 × seq 2048, compiled (not run) on 1 device and on 8 simulated devices as
   dp 4 × tp 2. For each layout, four programs: the old paths (all logits materialized,
   ``model.loss_chunk_tokens=0``; one-hot embedding, ``model.embedding_impl=one_hot``), each new
   path alone, and both. Printed: XLA's temporary bytes per device (``memory_analysis()``), the
   matmul FLOPs per device from the HLO (:func:`jaxcolossal.aot.hlo.dot_flops`, loops × trip counts),
   and the ratios old / new.
audit. The FLOP audit: the step's matmul FLOPs from the compiled HLO (loop bodies × trip
   counts; XLA's ``cost_analysis`` counts a ``while`` body once) divided by the model FLOPs
   ``6N + attention`` of :func:`jaxcolossal.metrics.flops_per_token` (causal attention counted
   half), and by ``6N + dense attention`` (the full ``t × t`` scores that the XLA attention
   computes), for the ``tiny`` preset and the ``llama_1b`` shape at seq 4096 (batch 1, one
   device, compiled only), for each remat policy; with the compiled temporaries.
chunk. The default of ``model.loss_chunk_tokens``: step time (run, interleaved) and compiled
   temporaries of a vocabulary-heavy small model (hidden 256, vocab 32000, 2 layers, batch 8 ×
   seq 512) for several chunk sizes, as ratios to the unchunked step.
mainjob. The main job (``scripts/train.py``, 300 steps) with the old paths and with the new ones,
   one after the other: final validation loss and wall time, as a ratio; then the main job's
   compiled train step on both paths, run interleaved: the step-time ratio (less noisy).

The final line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

OLD = {"loss_chunk_tokens": 0, "embedding_impl": "one_hot"}
NEW = {}  # the defaults
LLAMA_1B = dict(type="llama", num_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, max_position_embeddings=8192, vocab_size=128256,
                tie_word_embeddings=True, rope_theta=500000.0, vocab_pad_multiple=64)
TINY = dict(type="llama", num_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=384, max_position_embeddings=512, vocab_size=256)
POLICIES = ("none", "selective", "dots", "save_qkv_proj", "full")


def build(model: dict, batch: int, seq: int, parallel: dict, bf16: bool = False):
    """``(cfg, plan, tx)`` for a compile-only step."""
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.config import config_from_dict  # heavy: jax; main() sets devices first
    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import make_plan  # heavy: jax; main() sets devices first

    raw = {"model": model, "training": {"batch_size": batch, "seq_len": seq}, "parallel": parallel}
    if bf16:
        raw["precision"] = {"bf16": True}
    cfg = config_from_dict(raw)
    n = 1
    for k in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
        n *= max(1, parallel.get(k, 1))
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:n]))
    return cfg, plan, build_optimizer(cfg.training, plan)


def compile_only(model: dict, batch: int, seq: int, parallel: dict, bf16: bool = False) -> dict:
    """Compile the train step on abstract arrays (nothing allocated); its per-device figures."""
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.aot import hlo  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    cfg, plan, tx = build(model, batch, seq, parallel, bf16)
    abstract = jax.eval_shape(lambda k: init_state(plan, tx, key=k), jax.random.key(0))
    b = jax.ShapeDtypeStruct((batch, seq), "int32", sharding=plan.batch_sharding)
    t0 = time.perf_counter()
    compiled = make_train_step(plan, tx).lower(abstract, {"inputs": b, "targets": b}).compile()
    mem = compiled.memory_analysis()
    flops = hlo.dot_flops(compiled.as_text())
    return {"temp_bytes": int(mem.temp_size_in_bytes), "dot_flops": flops["flops"], "dots": flops["dots"],
            "compile_s": time.perf_counter() - t0, "cfg": cfg}


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------- parts


def head_only(tokens: int, d: int, v: int, chunk: int, bf16: bool) -> int:
    """Temporary bytes of the LM head + loss alone (value and gradient w.r.t. ``h`` and ``w``) on
    one device, for ``tokens`` tokens, hidden ``d``, (per-device) vocabulary ``v``."""
    import jax  # heavy: jax; main() sets devices first
    import jax.numpy as jnp  # heavy: jax; main() sets devices first

    from jaxcolossal.models.layers.vocab import lm_head_loss  # heavy: jax; main() sets devices first

    dt = jnp.bfloat16 if bf16 else jnp.float32
    h, w = jax.ShapeDtypeStruct((1, tokens, d), dt), jax.ShapeDtypeStruct((d, v), dt)
    y = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    f = jax.jit(jax.value_and_grad(lambda h, w, y: lm_head_loss(h, w, y, v, chunk_tokens=chunk, force_fused=True), argnums=(0, 1)))
    return int(f.lower(h, w, y).compile().memory_analysis().temp_size_in_bytes)


def part_memory(args, log) -> dict:
    from jaxcolossal.config import ModelConfig  # heavy: jax; main() sets devices first
    from jaxcolossal.models.layers.vocab import fused_pays  # heavy: jax; main() sets devices first

    model = {**LLAMA_1B, "num_layers": 2}
    chunk = ModelConfig().loss_chunk_tokens
    layouts = {"1 device": ({"data_parallel_size": 1}, 1, 8192, 4, 2048),
               "8 devices dp4 tp2": ({"data_parallel_size": 4, "tensor_parallel_size": 2}, 2, 2048, 4, 2048),
               "1 device, batch 16 × seq 512": ({"data_parallel_size": 1}, 1, 8192, 16, 512)}
    variants = {"old (all logits, one-hot)": OLD, "chunked loss only": {"embedding_impl": "one_hot"},
                "gather embedding only": {"loss_chunk_tokens": 0}, "new (both)": NEW}
    out = {"loss_chunk_tokens": chunk}
    for lname, (par, tp, tokens, batch, seq) in layouts.items():
        log(f"  {lname}: LLaMA vocab 128256, hidden 2048, 2 layers; batch {batch} × seq {seq} ({tokens} tokens/device); "
            f"{'bf16' if args.bf16 else 'fp32'}; loss_chunk_tokens {chunk}")
        rows = {}
        for remat in ("none", "full"):
            for vname, ov in (variants.items() if remat == "none" else [(k, variants[k]) for k in
                                                                         ("old (all logits, one-hot)", "new (both)")]):
                r = compile_only({**model, "remat": remat, **ov}, batch, seq, par, args.bf16)
                r.pop("cfg")
                rows[f"{vname}, remat {remat}"] = r
                log(f"    remat {remat:4s} {vname:26s} temporaries {gib(r['temp_bytes']):>10s}   "
                    f"matmul FLOPs/device {r['dot_flops']:.4e}   (compiled in {r['compile_s']:.0f} s)")
        v = 128256 // tp
        head = {c: head_only(tokens, 2048, v, c, args.bf16) for c in (0, chunk)}
        fused = fused_pays(tokens, 2048, chunk)
        ratios = {f"temp_old_over_new_remat_{rm}": rows[f"old (all logits, one-hot), remat {rm}"]["temp_bytes"] /
                  rows[f"new (both), remat {rm}"]["temp_bytes"] for rm in ("none", "full")}
        ratios["head_only_temp_old_over_new"] = head[0] / head[chunk]
        emb_old, emb_new = rows["chunked loss only, remat none"], rows["new (both), remat none"]
        ratios["flops_one_hot_over_gather"] = emb_old["dot_flops"] / emb_new["dot_flops"]
        ratios["flops_saved_by_gather"] = emb_old["dot_flops"] - emb_new["dot_flops"]
        log(f"    the fused head {'is' if fused else 'is NOT'} taken at {tokens} tokens/device (fused_pays)")
        log(f"    LM head + loss alone ({tokens} tokens × vocab {v} per device, forced chunking): temporaries "
            f"{gib(head[0])} unchunked, {gib(head[chunk])} chunked: {ratios['head_only_temp_old_over_new']:.2f}×")
        log(f"    whole step, temporaries old / new: remat none {ratios['temp_old_over_new_remat_none']:.2f}×, "
            f"remat full {ratios['temp_old_over_new_remat_full']:.2f}×")
        log(f"    matmul FLOPs one-hot / gather embedding = {ratios['flops_one_hot_over_gather']:.4f} "
            f"({ratios['flops_saved_by_gather']:.3e} FLOPs/device saved per step)")
        out[lname] = {"rows": rows, "head_only_temp_bytes": head, "fused": fused, **ratios}
    return out


def part_audit(args, log) -> dict:
    from jaxcolossal.metrics import flops_per_token  # heavy: jax; main() sets devices first

    shapes = {"tiny": (TINY, 2, 128), "llama_1b": (LLAMA_1B, 1, args.audit_seq)}
    out = {}
    for name, (model, batch, seq) in shapes.items():
        log(f"  {name}: batch {batch} × seq {seq}, one device, {'bf16' if args.bf16 else 'fp32'}")
        log(f"    {'remat':14s} {'temporaries':>12s} {'matmul FLOPs':>14s} {'/ 6N+attn':>10s} {'/ 6N+dense attn':>16s}")
        rows = {}
        for policy in POLICIES:
            r = compile_only({**model, "remat": policy}, batch, seq, {"data_parallel_size": 1}, args.bf16)
            m = r.pop("cfg").model
            tokens = batch * seq
            model_flops = flops_per_token(m, seq)["6N+attn"] * tokens
            dense = model_flops + 6 * m.num_layers * seq * m.hidden_size * tokens  # the masked half too
            r.update(model_flops=model_flops, ratio=r["dot_flops"] / model_flops, ratio_dense=r["dot_flops"] / dense)
            rows[policy] = r
            log(f"    {policy:14s} {gib(r['temp_bytes']):>12s} {r['dot_flops']:14.4e} {r['ratio']:10.4f} {r['ratio_dense']:16.4f}")
        out[name] = rows
    return out


def part_chunk(args, log) -> dict:
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.train.state import init_state  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    model = dict(type="llama", num_layers=2, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=768, max_position_embeddings=512, vocab_size=32000)
    batch, seq = 8, 512
    sizes = [0] + [int(s) for s in args.chunks.split(",")]
    steps, runs = {}, {}
    for c in sizes:
        cfg, plan, tx = build({**model, "loss_chunk_tokens": c}, batch, seq, {"data_parallel_size": 1})
        state = init_state(plan, tx, key=jax.random.key(0))
        step = make_train_step(plan, tx)
        x = np.random.default_rng(0).integers(0, 32000, (batch, seq + 1)).astype(np.int32)
        b = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding), "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        compiled = step.lower(state, b).compile()
        state, m = compiled(state, b)
        jax.block_until_ready(m)
        steps[c] = (compiled, b)
        runs[c] = {"state": state, "times": [], "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}
    for r in range(args.repeats):  # interleaved: every size once per repeat, order flipped each repeat
        for c in (sizes if r % 2 == 0 else sizes[::-1]):
            compiled, b = steps[c]
            t0 = time.perf_counter()
            runs[c]["state"], m = compiled(runs[c]["state"], b)
            jax.block_until_ready(m)
            runs[c]["times"].append(time.perf_counter() - t0)
    base = statistics.median(runs[0]["times"])
    out = {}
    log(f"  hidden 256, vocab 32000, 2 layers, batch {batch} × seq {seq} ({batch * seq} tokens), one device, fp32")
    for c in sizes:
        med = statistics.median(runs[c]["times"])
        out[c] = {"step_s": med, "time_ratio": med / base, "temp_bytes": runs[c]["temp_bytes"],
                  "temp_ratio": runs[c]["temp_bytes"] / runs[0]["temp_bytes"]}
        log(f"    loss_chunk_tokens={c:<6d} step {med * 1e3:7.1f} ms  time / unchunked {med / base:6.3f}   "
            f"temporaries {gib(runs[c]['temp_bytes'])} ({out[c]['temp_ratio']:.3f} of unchunked)")
    return out


def main_step_times(repeats: int) -> dict:
    """The main job's compiled train step (configs/llama_tiny.yaml, 8 devices) on the old and the
    new paths, run interleaved on the same batch: median step seconds of each."""
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.config import load_config  # heavy: jax; main() sets devices first
    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer, lr_schedule  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    runs = {}
    for name, ov in (("old", OLD), ("new", NEW)):
        cfg = load_config(os.path.join(HERE, "..", "configs", "llama_tiny.yaml"),
                          overrides=[f"model.{k}={v}" for k, v in ov.items()])
        plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()))
        tx = build_optimizer(cfg.training, plan)
        state = init_state(plan, tx, key=jax.random.key(0))
        t = cfg.training
        x = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1)).astype(np.int32)
        b = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding), "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        compiled = make_train_step(plan, tx, lr_schedule(t)).lower(state, b).compile()
        state, m = compiled(state, b)
        jax.block_until_ready(m)
        runs[name] = {"fn": compiled, "state": state, "batch": b, "times": []}
    for r in range(repeats):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            run = runs[name]
            t0 = time.perf_counter()
            run["state"], m = run["fn"](run["state"], run["batch"])
            jax.block_until_ready(m)
            run["times"].append(time.perf_counter() - t0)
    return {name: statistics.median(run["times"]) for name, run in runs.items()}


def part_mainjob(args, log) -> dict:
    out = {}
    for name, ov in (("old", OLD), ("new", NEW), ("old again", OLD), ("new again", NEW))[: 2 * args.mainjob_repeats]:
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, os.path.join(HERE, "train.py"), f"logging.run_dir={d}"] + \
                  [f"model.{k}={v}" for k, v in ov.items()]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
            val = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if '"val_loss"' in line]
        out[name] = {"wall_s": wall, "val_loss": val[-1]["val_loss"]}
        log(f"  {name:10s} final val_loss {val[-1]['val_loss']:.4f}   wall {wall:.1f} s")
    new = [v["wall_s"] for k, v in out.items() if k.startswith("new")]
    old = [v["wall_s"] for k, v in out.items() if k.startswith("old")]
    out["time_ratio_new_over_old"] = statistics.median(new) / statistics.median(old)
    out["val_loss_new_minus_old"] = out["new"]["val_loss"] - out["old"]["val_loss"]
    log(f"  wall time (compile, 300 steps, evaluations, sample; runs one after the other) new / old = "
        f"{out['time_ratio_new_over_old']:.3f}; val_loss new - old = {out['val_loss_new_minus_old']:+.4f}")
    steps = main_step_times(args.step_repeats)
    out["step_s"] = steps
    out["step_ratio_new_over_old"] = steps["new"] / steps["old"]
    log(f"  the main job's train step, interleaved ({args.step_repeats} steps each): old {steps['old'] * 1e3:.1f} ms, "
        f"new {steps['new'] * 1e3:.1f} ms; new / old = {out['step_ratio_new_over_old']:.3f}")
    return out


PARTS = {"memory": ("temporaries and FLOPs: old vs new loss and embedding paths", part_memory),
         "audit": ("FLOP audit per remat policy", part_audit),
         "chunk": ("loss_chunk_tokens: step time and temporaries", part_chunk),
         "mainjob": ("the main job with the old and the new paths", part_mainjob)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="memory,audit,chunk,mainjob", help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--bf16", action="store_true", help="compile the memory and audit parts in bf16 (default fp32)")
    ap.add_argument("--audit-seq", type=int, default=4096)
    ap.add_argument("--chunks", default="512,1024,2048,4096", help="chunk sizes for part chunk")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed steps per chunk size")
    ap.add_argument("--mainjob-repeats", type=int, default=1, choices=[1, 2])
    ap.add_argument("--step-repeats", type=int, default=30, help="interleaved timed steps of the main job's step")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--part {bad}: choose from {sorted(PARTS)}")

    import jaxcolossal as jc  # heavy: jax; main() sets devices first
    jc.simulate_devices(8)
    import jax  # heavy: jax; main() sets devices first

    log = lambda *a: print(*a, flush=True)
    log(f"lean_step.py: jax {jax.__version__}, {jax.devices()[0].device_kind} ×{jax.device_count()}, "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    result = {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    for p in parts:
        title, fn = PARTS[p]
        log(f"\n[{p}] {title}")
        t0 = time.perf_counter()
        result[p] = fn(args, log)
        result[p]["wall_s"] = time.perf_counter() - t0
    line = json.dumps(result, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
