"""The training loop behind ``scripts/train.py``: data, steps, metrics, checkpoints, a sample.

``train(cfg)`` prints, in order: the mesh, a table of every parameter's shape, dtype and
sharding, the per-device bytes of params / gradients / optimizer state (against the ZeRO
formulas), the validation loss at start, a progress bar with loss, tokens/s and TFLOPS, the
validation loss at the end and a short generated sample. Metrics go to
``<run_dir>/metrics.jsonl`` (one JSON object a line), written by process 0 only.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxcolossal import metrics as mx
from jaxcolossal.checkpoint import CheckpointManager
from jaxcolossal.config import Config
from jaxcolossal.data import DataLoader, eval_batches, get_tokenizer, load_splits
from jaxcolossal.dist_logger import get_dist_logger
from jaxcolossal.generate import sample_tokens
from jaxcolossal.launch import StepWatchdog, collective_timeout
from jaxcolossal.mesh import make_mesh
from jaxcolossal.models.hf import init_params_from
from jaxcolossal.sharding import DATA_AXES, describe
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.state import BYTES_PER_PARAM, TrainPlan, init_state, make_plan
from jaxcolossal.train.step import make_eval_step, make_train_step


def param_table(plan: TrainPlan) -> str:
    """One line per parameter: name, shape, dtype, logical axes and mesh sharding."""
    rows = []
    flat_shapes = jax.tree_util.tree_flatten_with_path(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    flat_axes = jax.tree.leaves(plan.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_specs = jax.tree.leaves(plan.specs.params)
    flat_opt = jax.tree.leaves(plan.specs.opt)
    dtype = jnp.dtype(plan.compute_dtype).name
    w = max(len(jax.tree_util.keystr(p)) for p, _ in flat_shapes)
    rows.append(f"{'parameter':<{w}}  {'shape':<22} {'dtype':<8} {'logical axes':<40} {'params':<22} optimizer state")
    for (path, shape), axes, spec, ospec in zip(flat_shapes, flat_axes, flat_specs, flat_opt):
        rows.append(f"{jax.tree_util.keystr(path):<{w}}  {str(tuple(shape)):<22} {dtype:<8} "
                    f"{str(tuple(a or '-' for a in axes)):<40} {describe(spec):<22} {describe(ospec)}")
    return "\n".join(rows)


def memory_report(plan: TrainPlan, state: Any) -> tuple[str, dict]:
    """Per-device model-state bytes, measured from the arrays, next to the ZeRO paper's (docs/zero.md) formula."""
    got = mx.model_state_bytes(state, plan.specs.grads, plan.param_shapes, plan.mesh_shape)
    psi = sum(math.prod(s) for s in jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple)))
    psi_local = psi / plan.mesh_shape["tp"]  # the formula's Ψ is per tensor-parallel rank
    b = BYTES_PER_PARAM[plan.precision]
    n = plan.mesh_shape["fsdp"]
    want = mx.zero_formula_bytes(psi_local, n, plan.cfg.parallel.zero_stage, **b)
    lines = [f"per-device model state (ZeRO-{plan.cfg.parallel.zero_stage}, {plan.precision}: "
             f"p={b['p']} g={b['g']} K={b['K']} bytes/param, Ψ={psi:,}, N={n}, tp={plan.mesh_shape['tp']})"]
    for k in ("params", "grads", "optimizer"):
        lines.append(f"  {k:<10} {got[k] / 2**20:10.3f} MiB   formula {want[k] / 2**20:10.3f} MiB")
    lines.append(f"  {'total':<10} {got['total'] / 2**20:10.3f} MiB")
    return "\n".join(lines), {"measured": got, "formula": want}


class _PreemptionFlag:
    """Set by SIGTERM (a scheduler's preemption notice) while the loop runs; the loop then
    saves a checkpoint and stops. Only the main thread can install signal handlers; elsewhere
    this is a flag that never sets."""

    def __init__(self):
        self.hit = False
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.hit = True

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None

    def __bool__(self) -> bool:
        return self.hit


def _final_save(ckpt: CheckpointManager, state: Any, val_loss: float | None = None) -> None:
    """Save the last step unless the periodic save already wrote it."""
    ckpt.wait()
    if int(state.step) not in ckpt.all_steps():
        ckpt.save(int(state.step), state, val_loss=val_loss, force=True)


def _check_overflow_streak(m: dict, pc) -> None:
    """Stop fp16 training that can only skip: ``max_consecutive_skips`` overflowed steps in a row
    while the loss scale is already at ``min_scale`` (one host sync per step, fp16 only).

    Raises:
        FloatingPointError: naming the streak and the scale.
    """
    skips = int(m["consecutive_skips"])
    if skips >= pc.max_consecutive_skips and float(m["loss_scale"]) <= pc.min_scale:
        raise FloatingPointError(
            f"fp16: {skips} consecutive steps overflowed with the loss scale at its minimum "
            f"{pc.min_scale}; training stopped instead of skipping forever (try bf16, a lower learning "
            "rate, or precision.min_scale)")


def _evaluate(eval_step, params, batches) -> float:
    return float(np.mean([float(eval_step(params, x, y)) for x, y in batches]))


def train(cfg: Config) -> dict:
    """Run the main job described by ``cfg``; returns a summary dict (losses, throughput, sample).

    With ``checkpoint.dir`` set it saves every ``checkpoint.save_every`` steps, at each
    evaluation (a candidate for the best checkpoint) and at the end; on SIGTERM it saves the
    current step and returns early with ``preempted=True``.

    In a multi-process job a :class:`~jaxcolossal.launch.StepWatchdog` guards the steps and
    evaluations: a process that makes no progress for ``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT`` seconds
    (default 300; e.g. stuck in a collective because another process left the loop or died)
    aborts with a clear message and exit status 124.

    Raises:
        ConfigError: before anything is compiled, for any impossible setting.
    """
    watchdog = StepWatchdog(collective_timeout() if jax.process_count() > 1 else None)
    try:
        return _train(cfg, watchdog)
    finally:
        watchdog.stop()


def _train(cfg: Config, watchdog: StepWatchdog) -> dict:
    log = get_dist_logger()
    run_dir = cfg.logging.run_dir
    is_main = jax.process_index() == 0
    if is_main:
        os.makedirs(run_dir, exist_ok=True)
        log.log_to_file(os.path.join(run_dir, "train.log"))
    mesh = make_mesh(cfg.parallel)
    plan = make_plan(cfg, mesh)
    t = cfg.training
    log.info(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].device_kind} device(s), "
             f"{jax.process_count()} process(es); precision {plan.precision}; "
             f"zero_stage {cfg.parallel.zero_stage}", ranks=[0])

    tx = build_optimizer(t, plan)
    schedule = lr_schedule(t)
    # model.init_from: start from Hugging Face weights (fine-tuning); None: a fresh init from the seed
    state = init_state(plan, tx, key=jax.random.key(t.seed),
                       params=init_params_from(cfg.model, plan.mesh_shape["tp"]))
    if cfg.model.init_from:
        log.info(f"initialised from the Hugging Face weights in {cfg.model.init_from}", ranks=[0])
    if is_main:
        print(param_table(plan))
        report, _ = memory_report(plan, state)
        print(report)

    ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.max_to_keep) if cfg.checkpoint.dir else None
    if t.resume:
        if ckpt is None:
            raise ValueError("training.resume=true needs checkpoint.dir")
        if ckpt.latest_step() is not None:
            state = ckpt.restore(state)
            log.info(f"resumed from step {int(state.step)} in {ckpt.directory}", ranks=[0])

    train_tokens, val_tokens = load_splits(cfg.data)
    tok = get_tokenizer(cfg.data.tokenizer)
    loader = DataLoader(train_tokens, t.batch_size, t.seq_len, t.seed, mesh=mesh,
                        batch_spec=jax.sharding.PartitionSpec(DATA_AXES))
    eval_bs = t.batch_size // t.gradient_accumulation_steps
    evals = [(loader.to_global(x), loader.to_global(y))
             for x, y in eval_batches(val_tokens if len(val_tokens) > t.seq_len + 1 else train_tokens,
                                      eval_bs, t.seq_len, t.eval_batches)]

    step_fn = make_train_step(plan, tx, schedule)
    eval_step = make_eval_step(plan)
    t0 = time.time()
    compiled = step_fn.lower(state, loader.batch(int(state.step))).compile()
    compile_s = time.time() - t0
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None)
    # per-device bytes the step needs (arguments + outputs + temporaries - donated aliases), for
    # backends without runtime memory statistics (the CPU)
    compiled_peak = sum(getattr(mem, f, 0) or 0 for f in ("argument_size_in_bytes", "output_size_in_bytes",
                                                          "temp_size_in_bytes")) - (getattr(mem, "alias_size_in_bytes", 0) or 0)
    log.info(f"train step compiled in {compile_s:.1f}s; per-device temporary memory "
             f"{(temp or 0) / 2**20:.1f} MiB", ranks=[0])

    watchdog.start("compiled the train step")
    val_start = _evaluate(eval_step, state.params, evals)
    log.info(f"validation loss at step {int(state.step)}: {val_start:.4f} nats/token", ranks=[0])
    mfile = open(os.path.join(run_dir, "metrics.jsonl"), "a") if is_main else None

    def write(rec):
        if mfile:
            mfile.write(json.dumps(rec) + "\n")
            mfile.flush()

    write({"step": int(state.step), "val_loss": val_start})
    kind = jax.devices()[0].device_kind
    recompute = cfg.model.remat != "none"
    start = int(state.step)
    bar = tqdm(range(start, t.max_steps), initial=start, total=t.max_steps, disable=not (is_main and cfg.logging.progress_bar),
               dynamic_ncols=True, desc="train")
    last_t, last_step, perf, m = time.time(), start, {}, None
    preempted = _PreemptionFlag()
    for step in bar:
        state, m = compiled(state, loader.batch(step))
        done = step + 1
        watchdog.kick(f"step {done}")
        if plan.precision == "fp16":
            _check_overflow_streak(m, cfg.precision)
        if done % cfg.logging.log_every == 0 or done == t.max_steps:
            m = {k: float(v) for k, v in m.items()}
            now = time.time()
            step_s = (now - last_t) / (done - last_step)
            last_t, last_step = now, done
            perf = mx.throughput(cfg.model, batch_size=t.batch_size, seq_len=t.seq_len, step_seconds=step_s,
                                 num_devices=jax.device_count(),
                                 device_kind=kind, recompute=recompute)
            peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")  # addressable here
            rec = {"step": done, **m, **perf, "step_time_s": step_s, "peak_memory_bytes": peak or compiled_peak,
                   "peak_memory_source": "runtime" if peak else "compiled estimate"}
            write(rec)
            bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{perf['tokens_per_s']:.0f}",
                            tflops=f"{perf['tflops_6n']:.3f}")
        v = None
        if t.eval_every and done % t.eval_every == 0 and done != t.max_steps:
            v = _evaluate(eval_step, state.params, evals)
            write({"step": done, "val_loss": v})
            if is_main:
                bar.write(f"step {done}: validation loss {v:.4f}")
        if ckpt and (v is not None or (cfg.checkpoint.save_every and done % cfg.checkpoint.save_every == 0)):
            ckpt.save(done, state, val_loss=v)  # eval steps are candidates for the best checkpoint
        if preempted:
            break
    bar.close()
    preempted.restore()
    if preempted:  # SIGTERM: save where we are and stop, without the final evaluation
        watchdog.stop()
        log.warning(f"SIGTERM received: saving step {int(state.step)} and stopping", ranks=[0])
        if ckpt:
            _final_save(ckpt, state)
            ckpt.close()
        if mfile:
            mfile.close()
        return {"preempted": True, "state": state, "plan": plan, "final_metrics": m, "perf": perf,
                "val_loss_start": val_start, "val_loss_end": None, "compile_s": compile_s, "sample": ""}
    val_end = _evaluate(eval_step, state.params, evals)
    watchdog.stop()  # past the last collective of the loop; orbax's own barriers time out the final save
    write({"step": int(state.step), "val_loss": val_end})
    log.info(f"validation loss: {val_start:.4f} at start -> {val_end:.4f} at step {int(state.step)} (nats/token)",
             ranks=[0])
    if ckpt:
        _final_save(ckpt, state, val_end)
        ckpt.close()

    sample = ""
    if t.sample_tokens > 0:
        from jaxcolossal.sharding import Sharder  # the unconstrained forward for a batch of one
        fn = jax.jit(lambda p, x: plan.family.forward(p, x, cfg.model, Sharder(None)))
        out = sample_tokens(fn, state.params, tok.encode(t.sample_prompt), t.sample_tokens, t.seq_len,
                            jax.random.key(t.seed + 1))
        sample = t.sample_prompt + tok.decode(out)
        if is_main:
            print("----- sample -----\n" + sample + "\n------------------")
    if mfile:
        mfile.close()
    return {"val_loss_start": val_start, "val_loss_end": val_end, "final_metrics": m, "perf": perf,
            "compile_s": compile_s, "sample": sample, "state": state, "plan": plan}
