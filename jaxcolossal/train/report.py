"""What the loop reports, and where: the parameter table (:func:`param_table`) and the per-device
memory report (:func:`memory_report`) at start-up; each logged step's metrics record, progress-bar
fields (:func:`bar_fields`) and plain line (:func:`step_line`), with every process's step and data
times (:func:`rank_times`, stragglers named); the goodput report at the end
(:func:`report_goodput`); and the console that keeps log lines above the progress bar
(:func:`quiet_console`)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.contrib.logging import logging_redirect_tqdm

from jaxcolossal import metrics as mx
from jaxcolossal.memory.budget import formula_bytes
from jaxcolossal.memory.placement import DEVICE, HOST, bytes_by_kind
from jaxcolossal.parallel.compression import state_bytes as compression_bytes
from jaxcolossal.parallel.sharding import describe, is_shape, shard_bytes
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.goodput import StragglerTracker, read_records, summarize, summary_lines
from jaxcolossal.train.nvme import NVME, NvmeTier
from jaxcolossal.train.objective import objective_class
from jaxcolossal.train.run import Run
from jaxcolossal.train.state import BYTES_PER_PARAM, TrainPlan


# ----------------------------------------------------------------------------- start-up


def param_table(plan: TrainPlan) -> str:
    """One line per parameter: name, shape, dtype, logical axes and mesh sharding."""
    rows = []
    flat_shapes = jax.tree_util.tree_flatten_with_path(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    flat_axes = jax.tree.leaves(plan.param_axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_specs = jax.tree.leaves(plan.specs.params)
    flat_opt = jax.tree.leaves(plan.specs.opt)
    dtype = jnp.dtype(plan.compute_dtype).name
    w = max(len(jax.tree_util.keystr(p)) for p, _ in flat_shapes)
    names = [str(tuple(a or "-" for a in axes)) for axes in flat_axes]
    wa = max(len("logical axes"), *map(len, names))
    rows.append(f"{'parameter':<{w}}  {'shape':<22} {'dtype':<8} {'logical axes':<{wa}} {'params':<22} optimizer state")
    for (path, shape), axes, spec, ospec in zip(flat_shapes, names, flat_specs, flat_opt):
        rows.append(f"{jax.tree_util.keystr(path):<{w}}  {str(tuple(shape)):<22} {dtype:<8} "
                    f"{axes:<{wa}} {describe(spec):<22} {describe(ospec)}")
    return "\n".join(rows)


def memory_report(plan: TrainPlan, state: Any, tier: NvmeTier | None = None) -> tuple[str, dict]:
    """Per-device model-state bytes, measured from the arrays, next to the ZeRO paper's (docs/zero.md) formula.

    ``state`` is the whole state; with the NVMe ``tier``, the leaves bound for it are reported as
    ``nvme`` (they are in pinned host memory until :meth:`NvmeTier.spill` writes them out).

    The formula's Ψ is the parameters of one model-parallel rank: what tensor and pipeline
    parallelism leave on a device before ZeRO (``plan.specs.base``).
    """
    got = mx.model_state_bytes(state, plan.specs.grads, plan.param_shapes, plan.mesh_shape)
    psi = sum(math.prod(s) for s in jax.tree.leaves(plan.param_shapes, is_leaf=is_shape))
    psi_local = sum(jax.tree.leaves(jax.tree.map(lambda s, sp: shard_bytes(s, jnp.uint8, sp, plan.mesh_shape),
                                                 plan.param_shapes, plan.specs.base, is_leaf=is_shape)))
    b = BYTES_PER_PARAM[plan.precision]
    n = plan.mesh_shape["fsdp"]
    want = mx.zero_formula_bytes(psi_local, n, plan.cfg.parallel.zero_stage, **b)
    lines = [f"per-device model state (ZeRO-{plan.cfg.parallel.zero_stage}, {plan.precision}: "
             f"p={b['p']} g={b['g']} K={b['K']} bytes/param, Ψ={psi:,}, per model-parallel rank {psi_local:,}, "
             f"N={n}, tp={plan.mesh_shape['tp']}, pp={plan.mesh_shape['pp']})"]
    for k in ("params", "grads", "optimizer"):
        lines.append(f"  {k:<10} {got[k] / 2**20:10.3f} MiB   formula {want[k] / 2**20:10.3f} MiB")
    out = {"measured": got, "formula": want}
    if plan.lora:
        lines.append(_lora_line(plan, got, n, b))
        out["full_finetune_optimizer"] = _full_optimizer_bytes(plan, n, b)
    lines.append(f"  {'total':<10} {got['total'] / 2**20:10.3f} MiB")
    if getattr(state, "reference", None) is not None:  # DPO's or GRPO's frozen reference copy, device 0's shards
        ref = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.reference))
        whose = objective_class(plan.cfg).reference_label
        lines.append(f"  {'reference':<10} {ref / 2**20:10.3f} MiB   ({whose} frozen reference copy, sharded like params)")
        out["reference"] = ref
    if state.residual is not None:  # gradient compression's state, read from the arrays on device 0
        dev0 = jax.devices()[0]
        held = sum(s.data.nbytes for a in jax.tree.leaves(state.residual) for s in a.addressable_shards
                   if s.device == dev0)
        predicted = compression_bytes(plan.cfg.parallel, plan.param_shapes, plan.param_axes)
        lines.append(f"  {'compression':<10} {held / 2**20:10.3f} MiB   formula {predicted / 2**20:10.3f} MiB "
                     f"({plan.cfg.parallel.gradient_compression} state: error feedback"
                     + (", Q" if plan.cfg.parallel.gradient_compression == "powersgd" else "")
                     + (" + momentum correction's velocity" if plan.cfg.parallel.momentum_correction else "") + ")")
        out["compression"] = {"measured": held, "formula": predicted}
    pl = plan.placement
    if pl is not None and pl.active:  # by memory kind, read from each shard's sharding.memory_kind
        kinds = bytes_by_kind([state.params, state.master, state.opt_state])
        f = formula_bytes(psi_local, n, plan.cfg.parallel.zero_stage, plan.precision, pl.optim_frac, pl.param_frac)
        lines.append(f"  by memory kind (params + optimizer state; offload_optim_frac {pl.asked_optim_frac:g} reached "
                     f"{pl.optim_frac:.4f}, offload_param_frac {pl.asked_param_frac:g} reached {pl.param_frac:.4f}, "
                     f"optimizer_device {pl.optimizer_device}):")
        lines.append(f"  {'device':<10} {kinds[DEVICE] / 2**20:10.3f} MiB   formula {f['device'] / 2**20:10.3f} MiB "
                     "(+ the fp32 grads inside the step)")
        if tier is not None:  # the offloaded optimizer state is bound for the NVMe files
            kinds[NVME] = tier.bytes_per_device()
            kinds[HOST] -= kinds[NVME]
            f = {**f, NVME: f["optim_host"], "host": f["host"] - f["optim_host"]}
        lines.append(f"  {'host':<10} {kinds[HOST] / 2**20:10.3f} MiB   formula {f['host'] / 2**20:10.3f} MiB (pinned)")
        if tier is not None:
            lines.append(f"  {'nvme':<10} {kinds[NVME] / 2**20:10.3f} MiB   formula {f[NVME] / 2**20:10.3f} MiB "
                         f"(files in {tier.path})")
        out.update(kinds=kinds, kinds_formula=f)
    return "\n".join(lines), out


def _full_optimizer_bytes(plan: TrainPlan, n: int, b: dict) -> float:
    """The optimizer-state bytes per device (fp32 master + Adam's moments) of full fine-tuning of the
    same model in the same layout: the ZeRO formula over the base's Ψ per model-parallel rank."""
    base = sum(jax.tree.leaves(jax.tree.map(lambda s, sp: shard_bytes(s, jnp.uint8, sp, plan.mesh_shape),
                                            plan.frozen_shapes, plan.frozen_specs, is_leaf=is_shape)))
    if plan.cfg.parallel.zero_stage >= 3:  # frozen_specs carry fsdp then: Ψ per model-parallel rank is N× that
        base *= n
    return mx.zero_formula_bytes(base, n, plan.cfg.parallel.zero_stage, **b)["optimizer"]


def _lora_line(plan: TrainPlan, got: dict, n: int, b: dict) -> str:
    """LoRA's frozen base and its optimizer state against full fine-tuning's, per device."""
    full = _full_optimizer_bytes(plan, n, b)
    return (f"  {'frozen':<10} {got['frozen'] / 2**20:10.3f} MiB   (LoRA's base weights, {jnp.dtype(plan.compute_dtype).name}; "
            f"optimizer state {got['optimizer'] / 2**20:.3f} MiB against {full / 2**20:.3f} MiB for full fine-tuning: "
            f"{full / max(got['optimizer'], 1):.0f}x less)")


# ----------------------------------------------------------------------------- steps


class StepClock:
    """Seconds per training step between log lines, with evaluation and checkpoint time left out."""

    def __init__(self, step: int):
        self.t, self.step, self.paused_s = time.time(), step, 0.0

    @contextlib.contextmanager
    def paused(self, pending: Any):
        jax.block_until_ready(pending)  # the steps dispatched so far belong to the training time
        t0 = time.time()
        try:
            yield
        finally:
            self.paused_s += time.time() - t0

    def lap(self, step: int) -> float:
        now = time.time()
        per_step = (now - self.t - self.paused_s) / max(step - self.step, 1)
        self.t, self.step, self.paused_s = now, step, 0.0
        return per_step


def log_step(run: Run, done: int, m: dict, clock: StepClock, bar) -> dict:
    cfg, t = run.cfg, run.cfg.training
    m = {k: float(v) if np.ndim(v) == 0 else [round(float(x), 6) for x in np.asarray(v)] for k, v in m.items()}
    step_s = clock.lap(done)
    perf = mx.throughput(cfg.model, batch_size=t.batch_size, seq_len=t.seq_len, step_seconds=step_s,
                         num_devices=jax.device_count(), peak=mx.mfu_peak(run.plan.mesh),
                         recompute=cfg.model.remat != "none")
    peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")  # addressable here
    ranks = rank_times(run, done, step_s)
    run.write({"step": done, **m, **perf, "step_time_s": step_s, "peak_memory_bytes": peak or run.compiled_peak,
               "peak_memory_source": "runtime" if peak else "compiled estimate", **ranks})
    moe = {} if "expert_load" not in m else {  # a mixture of experts: its busiest expert's share, the dropped slots
        "top_expert": f"{max(m['expert_load']):.0%}", "dropped": f"{m['moe_dropped_share']:.1%}"}
    extra = {**mx.posttrain_columns(m), **moe}  # DPO's and GRPO's TRL columns (reward, kl, rewards/margins, ...)
    bar.set_postfix(**bar_fields(m, perf), **extra)
    # the bar on a terminal, this line in train.log; elsewhere (a file, a pipe) the line is the log's only record
    get_dist_logger().info(step_line(done, t.max_steps, m, perf, extra), ranks=[0], file_only=not bar.disable)
    if cfg.posttrain.log_completions and getattr(run.loader, "shown", None):
        _log_completions(run, done)
    return perf


def _log_completions(run: Run, done: int) -> None:
    """``posttrain.log_completions``: the newest rollout's first completions with their rewards, on the
    console (process 0) and as W&B's ``completions`` table, once per rollout."""
    rows = run.loader.take_shown()
    get_dist_logger().info(mx.completions_text(rows), ranks=[0])
    if run.metrics is not None:
        run.metrics.table(done, "completions", rows)


def rank_times(run: Run, done: int, step_s: float) -> dict:
    """Every process's step time and data-waiting time per step since the last logged step (a gather
    over the processes; ``{}`` with one), as ``rank_step_time_s`` / ``rank_data_s`` lists in seconds;
    a rank that :class:`StragglerTracker` flags (``fault_tolerance.straggler_*``: above the factor × the
    others' median and the floor, at that many logged steps in a row) is named in a warning."""
    data_total = run.goodput.totals["data_waiting"]
    data_s = (data_total - run.data_mark) / max(run.cfg.logging.log_every, 1)
    run.data_mark = data_total
    if jax.process_count() == 1:
        return {}
    rows = np.asarray(multihost_utils.process_allgather(np.array([step_s, data_s], np.float64)))
    out = {"rank_step_time_s": [round(float(x), 6) for x in rows[:, 0]],
           "rank_data_s": [round(float(x), 6) for x in rows[:, 1]]}
    ft = run.cfg.fault_tolerance
    if run.stragglers is None:
        run.stragglers = StragglerTracker(ft.straggler_factor, ft.straggler_min_share, ft.straggler_min_s,
                                          ft.straggler_checks)
    job_step_s = float(np.median(rows[:, 0]))
    for what, key in (("step time", "rank_step_time_s"), ("data-loading time", "rank_data_s")):
        for r in run.stragglers.update(what, out[key], job_step_s):
            others = float(np.median(out[key][:r] + out[key][r + 1:]))
            get_dist_logger().warning(
                f"straggler at step {done}: process {r}'s {what} {out[key][r]:.4f} s per step is above "
                f"fault_tolerance.straggler_factor={ft.straggler_factor:g} x the other processes' median "
                f"{others:.4f} s, by more than {run.stragglers.floor(job_step_s):.4f} s (straggler_min_share="
                f"{ft.straggler_min_share:g} of the {job_step_s:.3f} s step, at least straggler_min_s="
                f"{ft.straggler_min_s:g} s), at {ft.straggler_checks} logged steps in a row", ranks=[0])
    return out


def bar_fields(m: dict, perf: dict) -> dict[str, str]:
    """The progress bar's fields of a logged step: ``loss`` (nats/token), ``tok_s``, the model FLOP/s
    per device (6N + attention) to three significant digits under its unit's name (``tflops=41.2``,
    ``gflops=512``: :func:`jaxcolossal.metrics.flops_rate`) and, when ``perf["mfu"]`` is set (GPUs of
    a known peak: :func:`jaxcolossal.metrics.mfu_peak`), ``mfu=41.2%``."""
    value, unit = mx.flops_rate(perf["tflops_6n"])
    out = {"loss": f"{m['loss']:.3f}", "tok_s": f"{perf['tokens_per_s']:.0f}", unit.lower(): value}
    if perf.get("mfu") is not None:
        out["mfu"] = f"{perf['mfu']:.1%}"
    return out


def step_line(step: int, max_steps: int, m: dict, perf: dict, extra: dict | None = None) -> str:
    """One plain log line for a logged step, with what the progress bar shows: the loss (nats/token),
    the learning rate, the gradient norm, tokens/s and the model FLOP/s per device (6N + attention,
    three significant digits: ``41.2 TFLOPS``, ``512 GFLOPS``), the MFU when ``perf["mfu"]`` is set
    (GPUs of a known peak), and ``extra`` (``name value`` pairs)."""
    parts = [f"step {step}/{max_steps}", f"loss {m['loss']:.4f}"]
    if "lr" in m:
        parts.append(f"lr {m['lr']:.3e}")
    if "grad_norm" in m:
        parts.append(f"grad_norm {m['grad_norm']:.4f}")
    parts += [f"{perf['tokens_per_s']:,.0f} tok/s", mx.flops_text(perf["tflops_6n"])]
    if perf.get("mfu") is not None:
        parts.append(f"MFU {perf['mfu']:.1%}")
    parts += [f"{k} {v}" for k, v in (extra or {}).items()]
    return ", ".join(parts)


# ----------------------------------------------------------------------------- end


def report_goodput(run: Run, step: int) -> dict:
    """End the attempt's goodput timeline; on process 0 (with ``fault_tolerance.goodput``) log the job's
    summary over all its attempts (:func:`summary_lines`) and write it to the metrics as one record
    (``event`` ``"goodput"``: ``goodput``, ``goodput_wall_s``, ``goodput_accounted``, ``steps_lost`` and
    ``goodput_<category>_s``). Returns :func:`summarize`'s dict (``{}`` elsewhere)."""
    run.goodput.finish()
    if not run.goodput.path:
        return {}
    s = summarize(read_records(run.goodput.path))
    for line in summary_lines(s):
        get_dist_logger().info(line, ranks=[0])
    run.write({"step": step, "event": "goodput", "goodput": s["goodput"], "goodput_wall_s": s["wall_s"],
               "goodput_accounted": s["accounted"], "steps_lost": s["steps_lost"],
               **{f"goodput_{k}_s": v for k, v in s["seconds"].items()}})
    return s


# ----------------------------------------------------------------------------- the console


ORBAX_NOISE = ("did not provide metrics", "Metadata file does not exist")
"""orbax log lines that say less than ours: saves between evaluations carry no val_loss on purpose,
and a step folder without metadata is reported (and moved aside) by the checkpoint manager."""


def _drop_orbax_noise(record: logging.LogRecord) -> bool:
    return not any(n in record.getMessage() for n in ORBAX_NOISE)


@contextlib.contextmanager
def quiet_console():
    """Log lines (ours, absl's, orbax's) go above the progress bar instead of through it."""
    get_dist_logger()  # its own console handler first, so that the redirect replaces it instead of adding one
    absl = logging.getLogger("absl")
    absl.addFilter(_drop_orbax_noise)
    try:
        with logging_redirect_tqdm([logging.getLogger(), logging.getLogger("jaxcolossal")]):
            yield
    finally:
        absl.removeFilter(_drop_orbax_noise)
