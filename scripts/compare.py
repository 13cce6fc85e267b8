"""Side-by-side comparisons on the CPU, in one process, printed as ratios.

    python scripts/compare.py                  # all parts
    python scripts/compare.py --part a,c       # some of them
    python scripts/compare.py --repeats 7 --hidden 384

Parts (a, b, c on one device; d on 8 simulated devices):

a. **Framework overhead.** Our jitted train step (``jaxcolossal.train.step``: accumulation
   ``scan``/``vmap``, sharding constraints, fp32 gradient buffer, global-norm metric) against a
   hand-written plain JAX + optax step of the same LLaMA (``jaxcolossal.models.llama.loss_sum``,
   ``jax.value_and_grad``, the same optax chain from ``build_optimizer``), both jitted with the
   state donated, fp32, same initial weights and batches. Their losses and updated parameters are
   checked to agree first. Ratio = our step time / plain step time (goal ≤ 1.03).
b. **Against Hugging Face + PyTorch.** ``transformers.LlamaForCausalLM`` (SDPA attention) with
   the same config and the same initial weights (exported with ``save_hf``; the first losses are
   checked to agree), trained with ``torch.optim.AdamW`` + ``clip_grad_norm_``, eager mode, fp32,
   ``torch.set_num_threads`` = the CPU cores this process may use (the headline ratio) and, as a
   third contender, 1 thread. Ratio = our tokens/s / torch's. XLA:CPU uses its default pool.
c. **Compile time vs depth.** Trace + lower + compile of our train step for 4 and for 32 layers
   (same width; the layers run under ``lax.scan``). Ratio = 32-layer / 4-layer (goal ≤ 1.3).
   Each compile gets a fresh jitted function and a slightly different learning rate (a constant
   in the program), so no cache can serve it.
d. **ZeRO 0–3 on 8 simulated devices** (``scripts/zero_report.py``'s ``measure``): per-device
   bytes of params / gradients / optimizer state measured from the arrays against the ZeRO formulas (docs/zero.md),
   and the collective volume per step read from the compiled HLO against 2Ψ (stages 0–2) and 3Ψ
   (stage 3). Volume counts elements per device in the ring convention of the ZeRO paper: an
   all-reduce of S elements moves 2S, a reduce-scatter or all-gather S. XLA's CPU backend writes a
   reduce-scatter as an all-reduce whose result each rank slices by its partition id; such an
   all-reduce (every user indexes it with ``partition-id``) counts S, as the GPU backend's
   reduce-scatter would.

Timing (a, b): the contenders alternate step by step (A B A B ..., the order flipped in every
other repeat) on the same batches, each step ended by ``block_until_ready`` / ``.item()``; each
repeat takes the median step time of each contender over ``--steps`` steps; the reported ratio
is the median of the per-repeat ratios, with its range, and the ratio of the two fastest steps (``ratio_of_best``, the least disturbed by other
load on a shared machine). The final line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from zero_report import measure  # noqa: E402

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# ----------------------------------------------------------------------------- shared helpers


def model_cfg(args, layers: int | None = None, lr_scale: float = 1.0):
    """The compared LLaMA on one device, fp32, no accumulation."""
    from jaxcolossal.config import config_from_dict  # heavy: jax; main() sets devices first

    h = args.hidden
    return config_from_dict({
        "model": dict(num_layers=layers or args.layers, hidden_size=h, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), intermediate_size=3 * h,
                      max_position_embeddings=max(args.seq, 64), vocab_size=args.vocab),
        "training": dict(batch_size=args.batch, seq_len=args.seq, learning_rate=1e-3 * lr_scale,
                         warmup_steps=2, max_steps=1000),
        "parallel": dict(data_parallel_size=1, zero_stage=0),
    })


_OURS: dict = {}


def ours_compiled(args):
    """``(cfg, plan, tx, state, compiled step, batches, raw)`` of our train step on device 0.

    Built and compiled once per process (parts a and b share it); each call returns a fresh copy
    of the initial state, since the step donates it. ``batches`` are the two step batches on the
    device, ``raw`` the same tokens as numpy ``[B, t+1]``.
    """
    import jax  # heavy: jax; main() sets devices first
    import jax.numpy as jnp  # heavy: jax; main() sets devices first

    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    if not _OURS:
        cfg = model_cfg(args)
        plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
        tx = build_optimizer(cfg.training, plan)
        state = init_state(plan, tx, key=jax.random.key(0))
        raw = token_batches(cfg)
        batches = [{"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                    "targets": jax.device_put(x[:, 1:], plan.batch_sharding)} for x in raw]
        compiled = make_train_step(plan, tx).lower(state, batches[0]).compile()
        _OURS.update(cfg=cfg, plan=plan, tx=tx, state=state, compiled=compiled, batches=batches, raw=raw)
    o = _OURS
    return o["cfg"], o["plan"], o["tx"], jax.tree.map(jnp.copy, o["state"]), o["compiled"], o["batches"], o["raw"]


def token_batches(cfg, n: int = 2):
    rng = np.random.default_rng(0)
    t = cfg.training
    return [rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32) for _ in range(n)]


def interleaved(contenders: dict, repeats: int, steps: int) -> dict[str, list[list[float]]]:
    """Step seconds ``[repeat][step]`` of each contender; ``contenders[name](i)`` runs step ``i``
    and waits for it. The contenders alternate step by step (A B A B ..., then B A B A ... in the
    next repeat), so that the load of a shared machine hits both alike."""
    names = list(contenders)
    out = {n: [] for n in names}
    for r in range(repeats):
        for n in names:
            out[n].append([])
        for i in range(steps):
            for name in (names if r % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                contenders[name](i)
                out[name][-1].append(time.perf_counter() - t0)
    return out


def ratio_summary(num: list, den: list) -> dict:
    """Median over repeats of each repeat's median paired ratio ``num[r][i] / den[r][i]`` (a list
    of floats is one value per repeat), with the range of the per-repeat ratios."""
    rs = [statistics.median([a / b for a, b in zip(x, y)]) if isinstance(x, list) else x / y
          for x, y in zip(num, den)]
    flat = lambda v: [t for x in v for t in (x if isinstance(x, list) else [x])]
    return {"ratio": statistics.median(rs), "ratio_min": min(rs), "ratio_max": max(rs), "ratios": rs,
            "ratio_of_best": min(flat(num)) / min(flat(den))}


def med(ts: list) -> float:
    """Median of all step times (``[repeat][step]``) or of a flat list."""
    return statistics.median([t for x in ts for t in (x if isinstance(x, list) else [x])])


# ----------------------------------------------------------------------------- a: overhead


def part_a(args, log) -> dict:
    import jax  # heavy: jax; main() sets devices first
    import jax.numpy as jnp  # heavy: jax; main() sets devices first
    import optax  # heavy: jax; main() sets devices first

    dev = jax.devices()[0]
    cfg, plan, tx, state, ours, ob, raw = ours_compiled(args)
    family = plan.family
    m = cfg.model

    def plain_loss(p, x, y):
        return family.loss_sum(p, x, y, m) / (x.shape[0] * x.shape[1])

    def plain_step(p, s, x, y):
        loss, g = jax.value_and_grad(plain_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    params = jax.device_put(plan.init_model(jax.random.key(0)), dev)  # the same init as init_state
    opt = tx.init(params)
    pb = [(jax.device_put(x[:, :-1], dev), jax.device_put(x[:, 1:], dev)) for x in raw]
    plain = jax.jit(plain_step, donate_argnums=(0, 1)).lower(params, opt, *pb[0]).compile()

    # the compiled programs, side by side: XLA's own count of FLOPs and bytes (no timing noise)
    cost = {}
    for name, c in (("ours", ours), ("plain", plain)):
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        cost[name] = {"flops": ca.get("flops"), "bytes_accessed": ca.get("bytes accessed"),
                      "temp_bytes": c.memory_analysis().temp_size_in_bytes}
    static = {k: cost["ours"][k] / cost["plain"][k] for k in cost["ours"] if cost["plain"][k]}
    log("  compiled cost (ours / plain): " + ", ".join(f"{k} {v:.4f}" for k, v in static.items()))
    # what ours adds: the non-finite guard (isfinite over the gradients, and a select that keeps the old
    # state when a step is not finite), a few FLOPs per parameter
    num_params = sum(int(x.size) for x in jax.tree.leaves(params))
    guard_flops = (cost["ours"]["flops"] - cost["plain"]["flops"]) / num_params
    log(f"  extra FLOPs of ours per parameter (the non-finite guard): {guard_flops:.2f}")

    # same math: three steps from the same weights give the same losses and parameters
    ours_loss, plain_loss_v = [], []
    for i in range(3):
        state, met = ours(state, ob[i % 2])
        params, opt, loss = plain(params, opt, *pb[i % 2])
        ours_loss.append(float(met["loss"]))
        plain_loss_v.append(float(loss))
    dparam = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)))
    dloss = max(abs(a - b) for a, b in zip(ours_loss, plain_loss_v))
    log(f"  agreement after 3 steps: max |Δloss| = {dloss:.2e}, max |Δparam| = {dparam:.2e}")

    box = {"s": state, "p": params, "o": opt}

    def run_ours(i):
        box["s"], met = ours(box["s"], ob[i % 2])
        jax.block_until_ready((box["s"], met))

    def run_plain(i):
        box["p"], box["o"], loss = plain(box["p"], box["o"], *pb[i % 2])
        jax.block_until_ready((box["p"], box["o"], loss))

    for i in range(args.warmup):
        run_ours(i)
        run_plain(i)
    t = interleaved({"jaxcolossal": run_ours, "plain": run_plain}, args.repeats, args.steps)
    r = ratio_summary(t["jaxcolossal"], t["plain"])
    tokens = args.batch * args.seq
    log(f"  step: jaxcolossal {med(t['jaxcolossal']) * 1e3:.1f} ms, plain JAX+optax "
        f"{med(t['plain']) * 1e3:.1f} ms ({tokens} tokens/step; medians over all timed steps)")
    log(f"  overhead ratio (ours / plain) = {r['ratio']:.3f}  [range {r['ratio_min']:.3f}–{r['ratio_max']:.3f}, "
        f"{args.repeats} repeats; best step vs best step {r['ratio_of_best']:.3f}]  "
        f"goal ≤ 1.03: {'met' if r['ratio'] <= 1.03 else 'NOT met'}")
    return {**r, "ours_s": t["jaxcolossal"], "plain_s": t["plain"], "max_abs_dloss": dloss,
            "max_abs_dparam": dparam, "goal": 1.03, "compiled_cost": cost, "compiled_cost_ratio": static,
            "num_params": num_params, "extra_flops_per_param": guard_flops}


# ----------------------------------------------------------------------------- b: HF + torch


def part_b(args, log) -> dict:
    import jax  # heavy: jax; main() sets devices first
    import torch  # optional: torch, part b only
    import torch.nn.functional as F  # optional: torch, part b only
    import transformers  # optional: transformers, part b only

    from jaxcolossal.models.hf_io import save_hf  # heavy: jax; main() sets devices first

    torch.set_num_threads(CORES)
    torch.manual_seed(0)
    cfg, plan, tx, state, ours, ob, raw = ours_compiled(args)
    t = cfg.training
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(tmp, cfg.model, plan.init_model(jax.random.key(0)))
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float32)
    hf.train()
    decay = [p for n, p in hf.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in hf.named_parameters() if n.endswith("norm.weight")]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    try:
        opt, opt_name = torch.optim.AdamW(groups, fused=True, **kw), "AdamW(fused=True)"
    except (RuntimeError, TypeError):
        opt, opt_name = torch.optim.AdamW(groups, **kw), "AdamW"

    tb = [(torch.from_numpy(x[:, :-1].astype(np.int64)), torch.from_numpy(x[:, 1:].astype(np.int64))) for x in raw]
    V = cfg.model.vocab_size

    def torch_step(i):
        x, y = tb[i % 2]
        logits = hf(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    box = {"s": state}

    def ours_step(i):
        box["s"], met = ours(box["s"], ob[i % 2])
        return float(met["loss"])

    first_t, first_o = torch_step(0), ours_step(0)  # the same weights and batch: the same loss
    log(f"  first-step loss: transformers {first_t:.6f}, jaxcolossal {first_o:.6f} (|Δ| {abs(first_t - first_o):.1e})")
    for i in range(1, args.warmup):
        torch_step(i)
        ours_step(i)

    def torch_with(threads):
        def run(i):
            torch.set_num_threads(threads)
            return torch_step(i)
        return run

    # torch with as many threads as cores (the headline); also with one thread, because on a
    # machine shared with other jobs OpenMP's spinning threads can collapse (docs/performance.md)
    contenders = {"jaxcolossal": ours_step, f"torch_{CORES}t": torch_with(CORES)}
    if CORES > 1:
        contenders["torch_1t"] = torch_with(1)
    tm = interleaved(contenders, args.repeats, args.steps)
    torch.set_num_threads(CORES)
    tokens = t.batch_size * t.seq_len
    out = {"tokens_per_s": {k: tokens / med(v) for k, v in tm.items()}, "step_s": tm, "torch_threads": CORES,
           "torch": torch.__version__, "transformers": transformers.__version__, "torch_optimizer": opt_name,
           "first_loss_torch": first_t, "first_loss_ours": first_o}
    log(f"  transformers {transformers.__version__} + torch {torch.__version__}: {opt_name}, eager, SDPA attention; "
        f"XLA:CPU with its default thread pool")
    log("  tokens/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in out["tokens_per_s"].items()))
    for name in contenders:
        if name == "jaxcolossal":
            continue
        r = ratio_summary(tm[name], tm["jaxcolossal"])  # time ratio torch / ours = tokens/s ratio ours / torch
        out[name] = r
        log(f"  throughput ratio (ours / {name}) = {r['ratio']:.2f}  [range {r['ratio_min']:.2f}–{r['ratio_max']:.2f}, "
            f"{args.repeats} repeats; best step vs best step {r['ratio_of_best']:.2f}]")
    out.update(out[f"torch_{CORES}t"])  # the headline ratio: torch with threads = cores
    return out


# ----------------------------------------------------------------------------- c: compile time


def part_c(args, log) -> dict:
    import jax  # heavy: jax; main() sets devices first

    from jaxcolossal.parallel.mesh import make_mesh  # heavy: jax; main() sets devices first
    from jaxcolossal.train.optimizer import build_optimizer  # heavy: jax; main() sets devices first
    from jaxcolossal.train.state import init_state, make_plan  # heavy: jax; main() sets devices first
    from jaxcolossal.train.step import make_train_step  # heavy: jax; main() sets devices first

    dev = jax.devices()[0]
    depths = (4, 32)
    out = {d: [] for d in depths}
    for r in range(args.compile_repeats):
        for d in (depths if r % 2 == 0 else depths[::-1]):
            cfg = model_cfg(args, layers=d, lr_scale=1.0 + 1e-3 * (r + 1))
            plan = make_plan(cfg, make_mesh(cfg.parallel, [dev]))
            tx = build_optimizer(cfg.training, plan)
            abstract = jax.eval_shape(lambda k: init_state(plan, tx, key=k), jax.random.key(0))
            b = jax.ShapeDtypeStruct((cfg.training.batch_size, cfg.training.seq_len), "int32",
                                     sharding=plan.batch_sharding)
            step = make_train_step(plan, tx)
            t0 = time.perf_counter()
            step.lower(abstract, {"inputs": b, "targets": b}).compile()
            out[d].append(time.perf_counter() - t0)
    r = ratio_summary(out[32], out[4])
    log(f"  compile (trace+lower+compile): 4 layers {med(out[4]):.2f} s, 32 layers {med(out[32]):.2f} s")
    log(f"  compile ratio (32 / 4 layers) = {r['ratio']:.3f}  [range {r['ratio_min']:.3f}–{r['ratio_max']:.3f}, "
        f"{args.compile_repeats} repeats]  goal ≤ 1.3: {'met' if r['ratio'] <= 1.3 else 'NOT met'}")
    return {**r, "compile_s_4": out[4], "compile_s_32": out[32], "goal": 1.3}


# ----------------------------------------------------------------------------- d: ZeRO


def _name_re(name: str):
    return re.compile(re.escape(name) + r"(?![\w.\-])")


def _users(lines: list[str], name: str) -> list[tuple[str, str]]:
    """``(result name, right-hand side)`` of each instruction in ``lines`` that reads ``name``."""
    pat = _name_re(name)
    out = []
    for line in lines:
        lhs, _, rhs = line.partition("=")
        if rhs and pat.search(rhs):
            out.append((lhs.strip().split()[0] if lhs.strip() else "", rhs))
    return out


def _sliced_by_rank(lines: list[str], name: str) -> bool:
    """True when every user of ``name`` (through bitcasts and copies) also takes ``partition-id``:
    each rank keeps only its slice of the reduced value, i.e. a reduce-scatter in CPU form."""
    frontier, users = [name], []
    while frontier:
        for res, rhs in _users(lines, frontier.pop()):
            if re.search(r"\s(bitcast|copy)\(", rhs):
                frontier.append(res)
            else:
                users.append(rhs)
    return bool(users) and all("partition-id" in u for u in users)


def _all_reduce_parts(lines: list[str], line: str, min_elements: int) -> list[tuple[int, bool]]:
    """``(elements, sliced)`` for each array an all-reduce produces (one per tuple element)."""
    name = line.split("=", 1)[0].strip().split()[0]
    shapes = hlo_result_shapes(line)
    if len(shapes) == 1:
        n = math.prod(shapes[0][1])
        return [(n, _sliced_by_rank(lines, name))] if n >= min_elements else []
    gte = {}
    for res, rhs in _users(lines, name):
        m = re.search(r"get-tuple-element\([^)]*\), index=(\d+)", rhs)
        if m:
            gte.setdefault(int(m.group(1)), []).append(res)
    parts = []
    for i, (_, dims) in enumerate(shapes):
        n = math.prod(dims)
        if n >= min_elements:
            names = gte.get(i, [])
            parts.append((n, bool(names) and all(_sliced_by_rank(lines, g) for g in names)))
    return parts


def hlo_result_shapes(line: str):
    from jaxcolossal.aot import hlo  # heavy: jax; main() sets devices first

    return hlo.result_shapes(line)


def collective_volume(hlo_text: str, min_elements: int = 64) -> dict:
    """Per-device elements moved per step (ring convention), loops multiplied by trip counts.

    Returns ``{"all-reduce": 2S summed, "all-reduce (sliced)": S summed, "all-gather": S,
    "reduce-scatter": S·N, "all-to-all" / "collective-permute": S, "total"}``, where S is each
    result array's elements and N a reduce-scatter's group size.
    """
    from jaxcolossal.aot import hlo  # heavy: jax; main() sets devices first

    comps, entry = hlo.computations(hlo_text)
    vol: dict[str, float] = {}
    trip = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')

    def add(key, v):
        vol[key] = vol.get(key, 0) + v

    def walk(name, times, stack):
        if name in stack or name not in comps:
            return
        lines = comps[name]
        for line in lines:
            for kind in hlo.COLLECTIVES:
                if f" {kind}(" in line or f" {kind}-start(" in line:
                    if kind == "all-reduce":
                        for n, sliced in _all_reduce_parts(lines, line, min_elements):
                            add("all-reduce (sliced)" if sliced else "all-reduce", times * n * (1 if sliced else 2))
                        continue
                    sizes = [math.prod(s) for _, s in hlo_result_shapes(line)]
                    if max(sizes, default=0) < min_elements:
                        continue
                    factor = 1
                    if kind == "reduce-scatter":
                        g = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
                        factor = len(g.group(1).split(",")) if g else 1
                    add(kind, times * factor * sum(sizes))
            m = trip.search(line)
            mult = int(m.group(1)) if (" while(" in line and m) else 1
            for callee in hlo.callees(line):
                walk(callee, times * mult, stack + (name,))

    walk(entry, 1, ())
    vol["total"] = sum(vol.values())
    return vol


def part_d(args, log) -> dict:
    import jax  # heavy: jax; main() sets devices first

    rows = []
    log(f"  {jax.device_count()} simulated devices, ZeRO group 8, fp32 (p, g, K = 4, 4, 8), hidden "
        f"{args.zero_hidden}, {args.zero_layers} layers")
    log("  | ZeRO | params meas/formula | grads meas/formula | optimizer meas/formula | "
        "volume/Ψ by kind | volume/Ψ | formula | ratio |")
    log("  |---|---|---|---|---|---|---|---|")
    for zero in args.zero_stages:
        r = measure("fp32", zero, hidden=args.zero_hidden, layers=args.zero_layers)
        psi = r["psi"]
        mem = {k: r["measured"][k] / r["formula"][k] for k in ("params", "grads", "optimizer")}
        vol = collective_volume(r["hlo"])
        want = 3.0 if zero == 3 else 2.0
        got = vol["total"] / psi
        kinds = ", ".join(f"{k} {v / psi:.2f}" for k, v in sorted(vol.items()) if k != "total")
        log(f"  | {zero} | {mem['params']:.3f} | {mem['grads']:.3f} | {mem['optimizer']:.3f} | {kinds} | "
            f"{got:.2f} | {want:.0f}Ψ | {got / want:.3f} |")
        rows.append({"zero": zero, "psi": psi, "bytes_measured": r["measured"], "bytes_formula": r["formula"],
                     "bytes_ratio": mem, "volume_by_kind_over_psi": {k: v / psi for k, v in vol.items()},
                     "volume_over_psi": got, "volume_formula_over_psi": want, "volume_ratio": got / want,
                     "collectives": r["collectives"]})
    return {"rows": rows}


PARTS = {"a": ("our train step vs plain JAX + optax, 1 device", part_a),
         "b": ("our train step vs Hugging Face transformers + PyTorch, 1 device (CPU)", part_b),
         "c": ("compile time, 4 vs 32 layers", part_c),
         "d": ("ZeRO 0-3 on 8 simulated devices vs the ZeRO formulas (docs/zero.md)", part_d)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats (a, b)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per contender per repeat (a, b)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile-repeats", type=int, default=3, help="compiles per depth (c)")
    ap.add_argument("--zero-hidden", type=int, default=256, help="model width for part d")
    ap.add_argument("--zero-layers", type=int, default=4, help="layers for part d")
    ap.add_argument("--zero-stages", default="0,1,2,3", help="ZeRO stages for part d")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    args.zero_stages = [int(z) for z in args.zero_stages.split(",") if z.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--part {bad}: choose from {sorted(PARTS)}")

    import jaxcolossal as jc  # heavy: jax; main() sets devices first
    jc.simulate_devices(8)  # part d; a, b and c use the first device only
    import jax  # heavy: jax; main() sets devices first

    log = lambda *a: print(*a, flush=True)
    log(f"compare.py: jax {jax.__version__}, {jax.devices()[0].device_kind} ×{jax.device_count()} (simulated), "
        f"{CORES} CPU cores, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    log(f"model (a-c): LLaMA {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {max(1, args.heads // 2)} kv, "
        f"intermediate {3 * args.hidden}, vocab {args.vocab}; batch {args.batch} × seq {args.seq}, fp32")
    result = {"jax": jax.__version__, "cpu_cores": CORES, "date": time.strftime("%Y-%m-%d"),
              "config": {k: v for k, v in vars(args).items() if k not in ("part", "out")}}
    for p in parts:
        title, fn = PARTS[p]
        log(f"\n[{p}] {title}")
        t0 = time.perf_counter()
        try:
            result[p] = fn(args, log)
        except ImportError as e:  # part b needs the test extras: pip install -e ".[test]"
            log(f"  skipped: {e} (pip install -e \".[test]\" installs torch and transformers)")
            result[p] = {"skipped": str(e)}
        result[p]["wall_s"] = time.perf_counter() - t0
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
