"""The training loop behind ``scripts/train.py``, as a short sequence of named phases.

``train(cfg)``: **preflight** (every error that needs the file system, before anything
compiles) → **start** (mesh, plan, data, state, **restore**, compile) → **steps** (with
**evaluate** and **save** at their intervals) → **finish** (final evaluation, final save, a
sample). What happens on a signal, a NaN or a hung peer is decided in
:mod:`jaxcolossal.train.guard`.

It prints, in order: the mesh, the learning rate and its schedule, seq_len and the global batch
in tokens (with a warning when ``model.init_from`` runs at the pre-training learning rate), a table of every parameter's shape, dtype and sharding, the
per-device bytes of params / gradients / optimizer state (against the ZeRO formulas), a line as the
train step starts compiling and one with its compile time, the validation loss at start, a progress
bar with loss, tokens/s, FLOP/s and (on GPUs) MFU (on a terminal; elsewhere one plain line per
``logging.log_every`` steps, :func:`step_line`, which ``train.log`` always gets), the validation loss
at the end and a short generated sample. Metrics go to ``<run_dir>/metrics.jsonl`` (one strict JSON
object a line) and the sinks ``logging`` switches on (TensorBoard, W&B:
:class:`jaxcolossal.metrics.MetricsWriter`), written by process 0 only; each run starts with a
``run_start`` record (:func:`run_start_record`) and a line in ``train.log`` naming the same run id.
``logging.profile_steps`` traces chosen steps (:mod:`jaxcolossal.train.profile`). A signal during
start-up stops it at the next phase boundary, before any step (:class:`StoppedBeforeTraining`).

Fault tolerance (docs/fault_tolerance.md): emergency checkpoints every ``checkpoint.local_every``
steps (:mod:`jaxcolossal.train.emergency`), preferred at resume when newer than the persistent
ones; the hang watchdog (:mod:`jaxcolossal.runtime.watchdog`, exit 75) told of each step and phase;
the goodput timeline (:mod:`jaxcolossal.runtime.goodput`, ``<run_dir>/goodput.jsonl``) with its
report at the end; every process's step and data times at each logged step, stragglers named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from jaxcolossal import metrics as mx
from jaxcolossal.checkpoint import CheckpointManager, NonFiniteStateError, config_diff, step_dirs
from jaxcolossal.config import Config, ConfigError, TrainingConfig, double_buffers_loops, precision_label
from jaxcolossal.data import DataLoader, get_tokenizer
from jaxcolossal.data.corpus import TEXT_SAMPLE_PROMPT
from jaxcolossal.data.formats import data_format
from jaxcolossal.generate import Sampling, generate, printable, run_eos_ids, sample_tokens
from jaxcolossal.memory.budget import formula_bytes
from jaxcolossal.memory.placement import DEVICE, HOST, bytes_by_kind
from jaxcolossal.models.hf_io import check_init_from, init_params_from
from jaxcolossal.models.peft import load_adapters, read_adapter_config, save_adapters
from jaxcolossal.parallel.compression import state_bytes as compression_bytes
from jaxcolossal.parallel.layer_scan import fetch_layer
from jaxcolossal.parallel.mesh import make_mesh, platform
from jaxcolossal.parallel.sharding import DATA_AXES, Sharder, describe, is_shape, shard_bytes
from jaxcolossal.runtime import xla_flags
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.faults import job_start, restart_count
from jaxcolossal.runtime.goodput import (
    GoodputRecorder,
    process_start_time,
    StragglerTracker,
    read_records,
    summarize,
    summary_lines,
)
from jaxcolossal.runtime.heartbeat import Heartbeat
from jaxcolossal.runtime.launch import collective_timeout
from jaxcolossal.runtime.watchdog import HangWatchdog
from jaxcolossal.train.emergency import LocalCheckpoints, agree_step, any_local_steps, default_local_dir, local_dir
from jaxcolossal.train.guard import (
    NonFiniteError,
    NonFiniteGuard,
    StepWatchdog,
    StoppedBeforeTraining,
    StopSignals,
    explain_oom,
)
from jaxcolossal.train.nvme import NVME, NvmeTier, nvme_tier
from jaxcolossal.train.objective import objective_class
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.profile import StepProfiler, save_memory_profile
from jaxcolossal.train.restart import after_restart
from jaxcolossal.train.state import BYTES_PER_PARAM, TrainPlan, init_state, make_plan
from jaxcolossal.train.step import (
    gathers_lowp,
    make_eval_step,
    make_objective_eval_step,
    make_train_step,
    prefetches_weights,
)


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


# ----------------------------------------------------------------------------- preflight


OUTPUT_DIR_EXAMPLES = {"checkpoint.dir": "checkpoints/run1", "logging.run_dir": "runs/default",
                       "checkpoint.local_dir": "checkpoints/local"}
"""A value that works for each output folder key, for its refusal (relative: under the working directory)."""


def check_output_dir(key: str, path: str, example: str | None = None) -> None:
    """Refuse a folder the run would write (``key``, e.g. ``checkpoint.dir``) when it cannot be
    created: a file in its way, or a nearest existing folder where nothing can be created
    (permissions, a read-only or virtual file system such as ``/proc``). Checked by creating and
    at once removing an empty probe folder in the nearest existing one: nothing is left behind.
    ``example``: the value the refusal suggests (default: :data:`OUTPUT_DIR_EXAMPLES`'s for ``key``).

    Raises:
        ConfigError: ``checkpoint.dir='a.jsonl/ck': cannot create it: a.jsonl is a file; ...``.
    """
    head = os.path.abspath(path)
    while not os.path.exists(head) and os.path.dirname(head) != head:  # the nearest part that exists
        head = os.path.dirname(head)
    shown = head if os.path.isabs(path) else os.path.relpath(head)
    fix = f"set {key} to a folder that can be created, e.g. {key}={example or OUTPUT_DIR_EXAMPLES.get(key, 'out')}"
    if not os.path.isdir(head):
        raise ConfigError(f"{key}={path!r}: cannot create it: {shown} is a file; {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxcolossal-probe-", dir=head))
    except OSError as e:
        raise ConfigError(f"{key}={path!r}: cannot create it: nothing can be created in {shown} "
                          f"({e.strerror}); {fix}") from None


def preflight(cfg: Config, eval_only: bool = False) -> None:
    """Every check that needs the file system, before anything is compiled. ``eval_only``
    (:func:`evaluate_only`): the ``training.resume`` checks are left out (it never trains or saves).

    Raises:
        ConfigError: one line naming the key: ``checkpoint.dir``, ``checkpoint.local_dir`` (with
            ``checkpoint.local_every``; every process writes there) or (on process 0, which writes
            it) ``logging.run_dir`` that cannot be created (:func:`check_output_dir`);
            ``model.init_from`` missing or not matching;
            ``model.vocab_size`` below the tokenizer's ids; ``training.resume=true`` with a
            ``checkpoint.dir`` that holds no step; a fresh run into a ``checkpoint.dir`` that
            holds steps, without ``checkpoint.overwrite``.
        DependencyError: ``logging.wandb=true`` without the ``wandb`` package (every process
            refuses, not only process 0, which logs).
    """
    m, t, c = cfg.model, cfg.training, cfg.checkpoint
    if cfg.logging.wandb:
        mx.import_wandb()
    if c.dir:
        check_output_dir("checkpoint.dir", c.dir)
    if c.dir and c.local_every and not eval_only:  # every process writes its own folder and a peer's replica
        check_output_dir("checkpoint.local_dir", local_dir(cfg),
                          example=default_local_dir(c.dir) if c.local_dir else None)
    if jax.process_index() == 0:  # the only process that writes the run folder (_start)
        check_output_dir("logging.run_dir", cfg.logging.run_dir)
    if m.init_from:
        check_init_from(m)
    if m.lora.init_from:  # a PEFT adapter to continue: its rank, alpha and targets are the run's
        m.lora = read_adapter_config(m.lora.init_from)
    tok = get_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > m.vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than the {tok.vocab_size} ids of data.tokenizer="
            f"{cfg.data.tokenizer}: ids >= {m.vocab_size} would have no embedding row; set model.vocab_size "
            f">= {tok.vocab_size}")
    if not c.dir or eval_only:
        return
    steps = step_dirs(c.dir)
    if t.resume is True and not steps and not (c.local_every and any_local_steps(local_dir(cfg))):
        unfinished = sorted(n for n in os.listdir(c.dir) if "tmp" in n) if os.path.isdir(c.dir) else []
        raise ConfigError(
            f"training.resume=true, but checkpoint.dir={c.dir!r} holds no checkpoint"
            + (f" (only unfinished saves: {', '.join(unfinished)})" if unfinished else " (a typo?)")
            + "; training.resume=auto starts fresh when there is none")
    if t.resume is False and steps and not c.overwrite:
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        raise ConfigError(
            f"checkpoint.dir={c.dir!r} already holds the checkpoints of steps {shown}; a fresh run would mix "
            "with them and its retention would delete them. Continue them with training.resume=true, pick "
            "another checkpoint.dir, or set checkpoint.overwrite=true to delete them")


# ----------------------------------------------------------------------------- start


SAMPLE_WINDOW = 2048
"""The end-of-run sample's context in tokens, at most: it runs unsharded on one device, with the
whole window through every layer per token (a 16k window of a long-context run did not fit a
23 GiB host)."""


@dataclass
class Run:
    """Everything the phases share; built by :func:`_start`."""

    cfg: Config
    plan: TrainPlan
    state: Any
    ckpt: CheckpointManager | None
    loader: DataLoader
    evals: list
    compiled: Any
    eval_step: Any
    compile_s: float
    compiled_peak: int
    metrics: mx.MetricsWriter
    nvme: NvmeTier | None = None
    sample_prompt: str = TEXT_SAMPLE_PROMPT
    run_id: str = ""
    profiler: StepProfiler | None = None
    local: LocalCheckpoints | None = None
    goodput: GoodputRecorder = dataclasses.field(default_factory=lambda: GoodputRecorder(None))
    """The job's goodput timeline (:func:`goodput_recorder`); in memory only by default."""
    hang: HangWatchdog = dataclasses.field(default_factory=lambda: HangWatchdog(None))
    """The hang watchdog (:func:`train` sets it); off by default."""
    data_mark: float = 0.0
    """The data-waiting seconds at the last logged step (per-rank times, :func:`_rank_times`)."""
    stragglers: StragglerTracker | None = None
    """The straggler rule's state across logged steps (:func:`_rank_times` makes it from the config)."""

    def full(self, state: Any) -> Any:
        """``state`` whole: with the NVMe tier, its leaves read back from their files (for a save)."""
        return self.nvme.fill(state) if self.nvme is not None else state

    @property
    def is_main(self) -> bool:
        """True on process 0, which prints tables and writes ``metrics.jsonl``."""
        return jax.process_index() == 0

    def write(self, rec: dict) -> None:
        """Append one record to ``metrics.jsonl`` and the sinks ``logging`` switches on (TensorBoard,
        W&B; process 0)."""
        self.metrics.write(rec)


def _open_checkpoints(cfg: Config) -> CheckpointManager | None:
    c = cfg.checkpoint
    if not c.dir:
        return None
    ckpt = CheckpointManager(c.dir, c.max_to_keep, config=cfg.to_dict())
    if c.overwrite and cfg.training.resume is False and step_dirs(c.dir):
        get_dist_logger().warning(f"checkpoint.overwrite=true: deleted steps {ckpt.clear()} in {ckpt.directory}",
                                  ranks=[0])
    return ckpt


SCHEDULE_KEYS = tuple(f"training.{k}" for k in ("learning_rate", "min_learning_rate_ratio", "warmup_steps",
                                                  "max_steps"))
"""Keys that shape the learning-rate schedule; a resume that changes them says so."""


def _restore(cfg: Config, ckpt: CheckpointManager | None, state: Any,
             local: LocalCheckpoints | None = None) -> tuple[Any, str]:
    """``training.resume``: true restores the newest step that restores (or fails), auto as
    well when there is one; damaged steps are moved aside by the checkpoint manager. With
    emergency checkpoints (``local``), the newest step every process holds locally
    (:func:`agree_step`, a collective) is restored instead when it is newer than the newest
    persistent step. Returns ``(state, source)``: ``source`` ``"local"``, ``"persistent"``, or
    ``"none"`` with ``state`` itself when it restores nothing (a fresh run also clears ``local``)."""
    if ckpt is None or cfg.training.resume is False:
        if local is not None:
            local.clear()
        return state, "none"
    log = get_dist_logger()
    state, source = _restore_newest(cfg, ckpt, state, local)
    if source == "none":
        return state, source
    step = int(state.step)
    if local is not None:  # newer local steps belong to the history this run replaces
        local.drop_after(step)
    if step >= cfg.training.max_steps:
        raise ConfigError(f"training.max_steps={cfg.training.max_steps}: the checkpoint is already at step {step}, "
                          "so there is nothing to train; max_steps counts all steps, not the steps to add "
                          f"(e.g. training.max_steps={step + cfg.training.max_steps})")
    if source == "persistent":
        changed = config_diff(ckpt.saved_config(step), cfg.to_dict(), SCHEDULE_KEYS)
        if changed:
            log.warning("the learning-rate schedule differs from the saved run's, so the resumed steps "
                        "follow the new one: " + "; ".join(changed), ranks=[0])
    return state, source


def _restore_newest(cfg: Config, ckpt: CheckpointManager, state: Any,
                    local: LocalCheckpoints | None) -> tuple[Any, str]:
    """:func:`_restore`'s choice between the emergency and the persistent checkpoints, logged."""
    log = get_dist_logger()
    newest_local = agree_step(local.available(state)) if local is not None else None
    persistent = ckpt.latest_step()
    tried = newest_local is not None and (persistent is None or newest_local > persistent)
    if tried:
        restored = local.restore_newest(state, newer_than=persistent)  # each process logs the copy it read
        if restored is not None:
            state, copy = restored
            log.info(f"resumed from step {copy.step} of the emergency (local) checkpoints in {local.directory} "
                     f"({'no persistent step' if persistent is None else f'newest persistent step {persistent}'} "
                     f"in {ckpt.directory}; process 0 read {copy.path})", ranks=[0])
            return state, "local"
    try:
        state = ckpt.restore(state)
    except FileNotFoundError:
        if cfg.training.resume is True:
            raise
        log.info(f"training.resume=auto: no checkpoint in {ckpt.directory}, starting fresh", ranks=[0])
        return state, "none"
    log.info(f"resumed from step {int(state.step)} in {ckpt.directory} (persistent"
             + ("; no newer emergency step is whole on every process)" if tried else
                f"; newest emergency step every process holds: {newest_local})" if local is not None else ")"),
             ranks=[0])
    return state, "persistent"


def _data(cfg: Config, mesh, plan: TrainPlan | None = None) -> tuple[Any, list, str]:
    """The training loader, the fixed evaluation batches and the end-of-run sample's prompt:
    ``data.format``'s (:func:`jaxcolossal.data.formats.data_format`), its loader through the
    objective's hook (GRPO: the rollout phase on ``plan``)."""
    t = cfg.training
    data, evals, prompt = data_format(cfg).batches(cfg, mesh, jax.sharding.PartitionSpec(DATA_AXES),
                                                   t.batch_size // t.gradient_accumulation_steps)
    return objective_class(cfg).loader(data, cfg, plan), evals, prompt


def _eval_step(plan: TrainPlan) -> Any:
    """The jitted evaluation step the objective's ``evaluation`` runs: its own loss and metrics with the
    reference (``objective``), else the language-model loss."""
    return make_objective_eval_step(plan) if objective_class(plan.cfg).evaluation == "objective" \
        else make_eval_step(plan)


def _warn_about_freeze(cfg: Config) -> None:
    """Top-k's error feedback and Adam's variance (``training.adam_freeze_step``): the settings that
    trained badly in docs/communication.md's measurements, named in the log before the run."""
    log = get_dist_logger()
    p, t = cfg.parallel, cfg.training
    if p.gradient_compression == "topk" and p.error_feedback and not t.adam_freeze_step:
        log.warning("top-k with error feedback under Adam's live variance: the error a shard sends late inflates "
                    "Adam's second moment. In docs/communication.md's 300-step runs, a dense warm-up then a frozen "
                    "variance with momentum correction trained best: parallel.compression_warmup_steps=100 "
                    "training.adam_freeze_step=100 parallel.momentum_correction=true (about a third of the run, "
                    "well after the learning-rate warm-up)", ranks=[0])
    if 0 < t.adam_freeze_step <= t.warmup_steps:
        log.warning(f"training.adam_freeze_step={t.adam_freeze_step} freezes Adam's variance within the "
                    f"learning-rate warm-up (training.warmup_steps={t.warmup_steps}): the early gradients' large "
                    "variance then slows all later steps (+29% val loss on the main job frozen at 30, "
                    "docs/communication.md); freeze well after it", ranks=[0])


def optimization_line(cfg: Config) -> str:
    """The run's second log line: the peak learning rate, its schedule (warmup steps, cosine decay to
    ``learning_rate × min_learning_rate_ratio`` at ``max_steps``), weight decay, ``seq_len`` in
    tokens, the global batch in sequences and in tokens (``batch_size × seq_len``) and the steps."""
    t = cfg.training
    return (f"learning rate {t.learning_rate:g}: warmup {t.warmup_steps} steps, cosine decay to "
            f"{t.learning_rate * t.min_learning_rate_ratio:g} at step {t.max_steps}; weight decay {t.weight_decay:g}; "
            f"seq_len {t.seq_len} tokens; global batch {t.batch_size} sequences = {t.batch_size * t.seq_len} tokens; "
            f"{t.max_steps} steps")


def warmup_warning(cfg: Config) -> str | None:
    """The warning for ``training.warmup_steps`` >= ``max_steps``: the learning rate never reaches its
    peak (the warmup is not capped, so that a run stopped early and resumed with a larger ``max_steps``
    keeps its schedule); None otherwise."""
    t = cfg.training
    if t.warmup_steps < t.max_steps or t.max_steps < 1:
        return None
    last = float(lr_schedule(t)(t.max_steps - 1))
    return (f"training.warmup_steps={t.warmup_steps} >= training.max_steps={t.max_steps}: the learning rate never "
            f"reaches training.learning_rate={t.learning_rate:g} (the last step runs at {last:.3e}); set "
            f"training.warmup_steps={max(t.max_steps // 10, 0)} (or anything below {t.max_steps})")


def fine_tuning_warning(cfg: Config) -> str | None:
    """The warning for a fine-tuning run (``model.init_from`` set) left at the schema's pre-training
    learning rate (``TrainingConfig.learning_rate``, 3e-3), which wrecks a pretrained model; None
    otherwise."""
    t = cfg.training
    if not cfg.model.init_from or t.learning_rate != TrainingConfig.learning_rate:
        return None
    rate = "1e-4 to 2e-4 for LoRA" if cfg.model.lora.enabled else "1e-5 to 2e-5 for full fine-tuning"
    return (f"model.init_from is set but training.learning_rate is the pre-training default {t.learning_rate:g}, "
            f"which wrecks a pretrained model: fine-tuning usually runs at {rate} (full SFT 1e-5 to 2e-5, LoRA 1e-4 "
            "to 2e-4); set training.learning_rate, or start from the model.yaml of scripts/convert_hf.py --to-jax")


def _run_line(cfg: Config, plan: TrainPlan, mesh) -> str:
    """The run's first log line: the mesh and devices, precision, ZeRO stage, and every path the
    config switches on (sequence parallelism, attention, prefetch, collective matmul, compression)."""
    t = cfg.training
    return (f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].device_kind} device(s), "
             f"{jax.process_count()} process(es); precision {precision_label(cfg)}; "
             f"zero_stage {cfg.parallel.zero_stage}"
             + (f"; sequence parallelism {cfg.parallel.sequence_parallelism_mode}"
                if cfg.parallel.sequence_parallelism_mode != "none" else "")
             + (f"; attention {cfg.model.attention_impl}" if cfg.model.attention_impl != "xla" else "")
             + ("; ZeRO-3 weight prefetch (parallel.overlap)" if prefetches_weights(cfg) else "")
             + (f"; no ZeRO-3 weight prefetch (parallel.communication_dtype={cfg.parallel.communication_dtype} "
                "reduces the gradients per data shard; the prefetch needs fp32)"
                if cfg.parallel.zero_stage == 3 and cfg.parallel.overlap and cfg.model.remat == "full"
                and cfg.parallel.communication_dtype != "fp32" else "")
             + ("; TP collective matmul (parallel.overlap)" if plan.sharder.collective_matmul(t.seq_len) else "")
             + (f"; Adam's variance frozen after step {t.adam_freeze_step}" if t.adam_freeze_step else "")
             + (f"; gradient communication {cfg.parallel.communication_dtype}"
                if cfg.parallel.communication_dtype != "fp32" else "")
             + (f"; ZeRO-3 layer weights gathered in {cfg.parallel.communication_dtype}" if gathers_lowp(plan) else "")
             + (f"; gradient compression {cfg.parallel.gradient_compression}"
                + (f" rank {cfg.parallel.powersgd_rank}" if cfg.parallel.gradient_compression == "powersgd"
                   else f" ratio {cfg.parallel.compression_ratio:g}")
                + ("" if cfg.parallel.error_feedback else " without error feedback")
                + (" with momentum correction" if cfg.parallel.momentum_correction else "")
                + (f" after {cfg.parallel.compression_warmup_steps} dense steps"
                   if cfg.parallel.compression_warmup_steps else "")
                if cfg.parallel.gradient_compression != "none" else ""))


def new_run_id() -> str:
    """A unique id for one run: its UTC start time and 6 random hex digits (``20250105-143000-1a2b3c``)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def run_start_record(cfg: Config, run_id: str, resumed_from_step: int | None) -> dict:
    """The first record of a run in ``metrics.jsonl``, its boundary from the runs before it in the
    same ``run_dir``: ``event`` ``"run_start"``, ``time`` (ISO 8601, UTC), ``run`` (the id, also in
    ``train.log`` and the TensorBoard folder), ``resumed_from_step`` (None: a fresh start) and
    ``config`` (the YAML file, None when there was none). It has no ``step``."""
    return {"event": "run_start", "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "run": run_id, "resumed_from_step": resumed_from_step, "config": cfg.source}


def _mesh_and_plan(cfg: Config, run_id: str | None = None) -> tuple[Any, TrainPlan]:
    """The run folder and its ``train.log`` (process 0; with ``run_id``, the run's separator line in
    it), the mesh and the plan, with the run's line."""
    if jax.process_index() == 0:
        os.makedirs(cfg.logging.run_dir, exist_ok=True)
        get_dist_logger().log_to_file(os.path.join(cfg.logging.run_dir, "train.log"))
    if run_id is not None:
        get_dist_logger().info(f"========== run {run_id} (config {cfg.source or '-'}) ==========", ranks=[0],
                               file_only=True)
    mesh = make_mesh(cfg.parallel)
    plan = make_plan(cfg, mesh)
    get_dist_logger().info(_run_line(cfg, plan, mesh), ranks=[0])
    return mesh, plan


def _initial_state(cfg: Config, plan: TrainPlan, tx: Any) -> Any:
    """The state before any restore: ``model.init_from``'s Hugging Face weights (fine-tuning), else
    a fresh init from ``training.seed``; with ``model.lora.init_from``, its adapters."""
    log, lora = get_dist_logger(), cfg.model.lora
    state = init_state(plan, tx, key=jax.random.key(cfg.training.seed),
                       params=init_params_from(cfg.model, plan.mesh_shape["tp"]),
                       adapters=load_adapters(lora.init_from, cfg.model) if lora.init_from else None)
    if cfg.model.init_from:
        log.info(f"initialised from the Hugging Face weights in {cfg.model.init_from} ({init_from_inherits(cfg)})",
                 ranks=[0])
    if lora.enabled:
        on = ", ".join(cfg.model.lora_targets)
        log.info(f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {on}: the base weights are "
                 "frozen" + (f"; adapters from {lora.init_from}" if lora.init_from else ""), ranks=[0])
    return state


def init_from_inherits(cfg: Config) -> str:
    """What a run with ``model.init_from`` takes from the Hugging Face folder and what starts fresh,
    for its start-up line."""
    fresh = "the optimizer state, the schedule and the step start fresh"
    lora = cfg.model.lora
    if lora.enabled and not lora.init_from:
        fresh = "the LoRA adapters, " + fresh
    return f"its {cfg.model.num_layers} layers' weights, embeddings and head; {fresh}"


def _start_notes(cfg: Config, plan: TrainPlan) -> None:
    """The start-up lines after the run's first: the optimization line and the warnings about the
    settings (fine-tuning at the pre-training rate, compression, Adam's freeze), the placement."""
    log, t = get_dist_logger(), cfg.training
    log.info(optimization_line(cfg), ranks=[0])
    for line in output_lines(cfg):
        log.info(line, ranks=[0])
    for warning in (fine_tuning_warning(cfg), warmup_warning(cfg)):
        if warning:
            log.warning(warning, ranks=[0])
    if 0 < t.max_steps <= cfg.parallel.compression_warmup_steps and cfg.parallel.gradient_compression != "none":
        log.warning(f"parallel.compression_warmup_steps={cfg.parallel.compression_warmup_steps} >= "
                    f"training.max_steps={t.max_steps}: no step of this run is compressed", ranks=[0])
    _warn_about_freeze(cfg)
    if plan.placement_report:
        log.info(plan.placement_report, ranks=[0])


def output_lines(cfg: Config) -> list[str]:
    """Where a run's output goes, as the start-up says it: the run folder with its ``metrics.jsonl``
    and ``train.log`` (absolute paths), the checkpoints (``checkpoint.dir`` and when, or that nothing
    is saved), the emergency checkpoints (``checkpoint.local_every``) and the hang watchdog
    (``fault_tolerance.hang_timeout_s``) when they are on."""
    lg, c, ft = cfg.logging, cfg.checkpoint, cfg.fault_tolerance
    run_dir = os.path.abspath(lg.run_dir)
    out = [f"run folder {run_dir}: metrics in {os.path.join(run_dir, 'metrics.jsonl')}, log in "
           f"{os.path.join(run_dir, 'train.log')}" + (", TensorBoard in tensorboard/" if lg.tensorboard else "")]
    if c.dir:
        when = (f"every {c.save_every} steps, " if c.save_every else "") + \
               ("at each evaluation and " if cfg.training.eval_every else "") + "at the end"
        out.append(f"checkpoints to {os.path.abspath(c.dir)} ({when})")
    else:
        out.append("no checkpoint is saved (checkpoint.dir is empty): set checkpoint.dir=checkpoints/NAME to keep "
                   "the trained model")
    if c.local_every:
        out.append(f"emergency checkpoints on: every {c.local_every} steps in {local_dir(cfg)} (checkpoint.local_every)")
    if ft.hang_timeout_s > 0:
        out.append(f"hang watchdog on: a process with no finished step for max({ft.hang_timeout_s:g} s, "
                   f"{ft.hang_factor:g} x the median step time) exits with code 75 "
                   "(fault_tolerance.hang_timeout_s=0 turns it off)")
    return out


def _compile(cfg: Config, plan: TrainPlan, tx: Any, state: Any, loader: DataLoader) -> tuple[Any, float, int]:
    """Compile the train step for ``state`` and the loader's batch. Returns ``(compiled, seconds,
    peak)``: ``peak`` is the per-device bytes the step needs by XLA's memory analysis (arguments +
    outputs + temporaries - donated aliases), for backends without runtime memory statistics (the CPU).

    Raises:
        XlaRuntimeError: the compiler's, after an out-of-memory one is explained (:func:`explain_oom`).
    """
    log, t = get_dist_logger(), cfg.training
    step_fn = make_train_step(plan, tx, lr_schedule(t))
    # parallel.overlap / bucket_size_mb: XLA's GPU flags, for a mesh of GPUs (none on other platforms)
    options = xla_flags.compiler_options(cfg.parallel.overlap, cfg.parallel.bucket_size_mb, platform(plan.mesh),
                                         double_buffers_loops(cfg), cfg.parallel.nccl_abort_on_error)
    if options:
        log.info("XLA GPU options (parallel.overlap / bucket_size_mb / nccl_abort_on_error): "
                 + " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()),
                 ranks=[0])
    log.info("compiling the train step", ranks=[0])
    t0 = time.time()
    try:
        compiled = step_fn.lower(state, loader.batch(int(state.step))).compile(compiler_options=options)
    except Exception as e:
        explain_oom(e, plan)  # an out-of-memory error: the predicted breakdown and what would fit
        raise
    compile_s = time.time() - t0
    mem = compiled.memory_analysis()
    peak = sum(getattr(mem, f, 0) or 0 for f in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "temp_size_in_bytes")) - (getattr(mem, "alias_size_in_bytes", 0) or 0)
    log.info(f"train step compiled in {compile_s:.1f}s; per-device temporary memory "
             f"{(getattr(mem, 'temp_size_in_bytes', 0) or 0) / 2**20:.1f} MiB", ranks=[0])
    return compiled, compile_s, peak


def _start(cfg: Config, stop: StopSignals, rec: GoodputRecorder) -> Run:
    """Everything before the first step: the mesh and plan, the data, the model's state, the
    checkpoint folder (restored from with ``training.resume``), the metric sinks and the compiled
    train step.

    Raises:
        StoppedBeforeTraining: a signal arrived; raised at the next phase boundary
            (:meth:`StopSignals.check`), with the checkpoint folder and the sinks closed.
    """
    is_main, run_id = jax.process_index() == 0, new_run_id()
    mesh, plan = _mesh_and_plan(cfg, run_id)
    _start_notes(cfg, plan)
    stop.check("making the mesh and the plan")
    loader, evals, sample_prompt = _data(cfg, mesh, plan)
    stop.check("loading the data")
    tx = build_optimizer(cfg.training, plan)
    state = _initial_state(cfg, plan, tx)
    tier = nvme_tier(plan, tx)
    stop.check("initialising the model")
    if is_main:
        print(param_table(plan))
        print(memory_report(plan, state, tier)[0])
    ckpt, metrics = _open_checkpoints(cfg), None
    local = LocalCheckpoints(local_dir(cfg), cfg.checkpoint.local_every, plan.mesh_shape, cfg.to_dict()) \
        if cfg.checkpoint.local_every else None
    try:
        with rec.phase("checkpoint_load"):
            state, resumed_from, source = _restored(cfg, ckpt, state, tier, stop, local)
        rec.resumed(resumed_from or 0, source)
        # the metric sinks before compiling: a W&B run that cannot start is refused without the compile's wait
        metrics = mx.MetricsWriter.for_run(cfg, run_id, enabled=is_main)
        with rec.phase("compilation"):
            compiled, compile_s, peak = _compile(cfg, plan, tx, state, loader)
        stop.check("compiling the train step")
        rec.enter("other")
    except BaseException as e:
        if metrics is not None:
            metrics.close(exit_code=getattr(e, "exit_code", 1))
        if isinstance(e, StoppedBeforeTraining) and ckpt is not None:
            ckpt.close()
        raise
    metrics.write(run_start_record(cfg, run_id, resumed_from))
    return Run(cfg=cfg, plan=plan, state=state, ckpt=ckpt, loader=loader, evals=evals, compiled=compiled,
               eval_step=_eval_step(plan),
               compile_s=compile_s, compiled_peak=peak, metrics=metrics, nvme=tier,
               sample_prompt=sample_prompt, run_id=run_id, profiler=StepProfiler.for_run(cfg, run_id, is_main),
               local=local, goodput=rec)


def _restored(cfg: Config, ckpt: Any, state: Any, tier: NvmeTier | None, stop: StopSignals,
              local: LocalCheckpoints | None = None) -> tuple[Any, int | None, str]:
    """``(state, resumed_from, source)``: ``state`` restored with ``training.resume`` from the
    checkpoint folder or the emergency checkpoints (:func:`_restore`; ``resumed_from`` its step, else
    ``None``; ``source`` ``"persistent"``, ``"local"`` or ``"none"``), its NVMe-bound leaves spilled
    to their files.

    Raises:
        StoppedBeforeTraining: a signal arrived while the folder was opened or restored from.
    """
    state, source = _restore(cfg, ckpt, state, local)
    resumed_from = None if source == "none" else int(state.step)
    stop.check("opening the checkpoint folder" if resumed_from is None else f"restoring step {resumed_from}")
    if tier is not None:  # the offloaded optimizer state goes to its files; tokens take its places
        state = tier.spill(state)
        get_dist_logger().info(f"NVMe tier: {len(tier.slots)} optimizer-state leaves, "
                               f"{tier.bytes_per_device() / 2**20:.3f} MiB per device, in {tier.path}", ranks=[0])
    return state, resumed_from, source


# ----------------------------------------------------------------------------- evaluate, save


def _evaluate(run: Run, state: Any) -> float:
    """Mean validation loss (nats/token) over the fixed evaluation batches; with DPO the mean DPO loss
    over the held-out pairs, and their TRL metrics written as ``val_rewards/accuracies`` etc.; with
    GRPO minus the mean reward of greedy completions of the held-out prompts (``val_reward``)."""
    evaluation = objective_class(run.cfg).evaluation
    if evaluation == "rollouts":
        metrics = run.loader.evaluate(state)
        run.write({"step": int(state.step), **metrics})
        get_dist_logger().info(f"step {int(state.step)}: held-out reward (greedy) {metrics['val_reward']:.4f}",
                               ranks=[0])
        return -metrics["val_reward"]
    if evaluation != "objective":
        return float(np.mean([float(run.eval_step(state.model_params, *batch)) for batch in run.evals]))
    reference = state.frozen if run.cfg.posttrain.reference == "lora_base" else state.reference
    outs = [run.eval_step(state.model_params, reference, *batch) for batch in run.evals]
    metrics = {f"val_{k}": float(np.mean([float(m[k]) for _, m in outs])) for k in outs[0][1]}
    run.write({"step": int(state.step), **metrics})
    get_dist_logger().info(f"step {int(state.step)}: held-out rewards/accuracies "
                           f"{metrics['val_rewards/accuracies']:.3f}, rewards/margins "
                           f"{metrics['val_rewards/margins']:.4f}", ranks=[0])
    return float(np.mean([float(v) for v, _ in outs]))


def _save(run: Run, state: Any, val_loss: float | None = None, final: bool = False) -> None:
    """Save ``state`` at its step (a no-op without ``checkpoint.dir``). ``final``: wait for the
    periodic saves and skip a step that is already on disk."""
    if run.ckpt is None:
        return
    step = int(state.step)
    if final:
        run.ckpt.wait()
        if step in run.ckpt.all_steps():
            return
    run.ckpt.save(step, run.full(state), val_loss=val_loss, force=final)
    get_dist_logger().info(f"checkpoint of step {step}: saving to {os.path.join(run.ckpt.directory, str(step))}"
                           + ("" if final else " (in the background)"), ranks=[0])


class _StepClock:
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


# ----------------------------------------------------------------------------- steps


def _log_step(run: Run, done: int, m: dict, clock: _StepClock, bar) -> dict:
    cfg, t = run.cfg, run.cfg.training
    m = {k: float(v) if np.ndim(v) == 0 else [round(float(x), 6) for x in np.asarray(v)] for k, v in m.items()}
    step_s = clock.lap(done)
    perf = mx.throughput(cfg.model, batch_size=t.batch_size, seq_len=t.seq_len, step_seconds=step_s,
                         num_devices=jax.device_count(), peak=mx.mfu_peak(run.plan.mesh),
                         recompute=cfg.model.remat != "none")
    peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")  # addressable here
    ranks = _rank_times(run, done, step_s)
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


def _rank_times(run: Run, done: int, step_s: float) -> dict:
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


def _evaluate_phase(run: Run, state: Any, done: int) -> float:
    """The evaluation at step ``done`` inside the loop: its loss logged and written, its time
    ``evaluation`` in the goodput, a phase boundary for the hang watchdog."""
    run.hang.progress(f"in the evaluation at step {done}")
    with run.goodput.phase("evaluation"):
        v = _evaluate(run, state)
    run.hang.progress(f"after the evaluation at step {done}")
    run.write({"step": done, "val_loss": v})
    get_dist_logger().info(f"step {done}: {eval_line(run.cfg, v)}", ranks=[0])
    return v


def _save_local(run: Run, state: Any, done: int, m: dict, clock: "_StepClock") -> None:
    """The emergency checkpoint of step ``done`` (``checkpoint.local_every``): the host copy here, the
    files in the background (:class:`LocalCheckpoints`); time ``checkpoint_save`` in the goodput."""
    with clock.paused(m):
        run.hang.progress(f"in the emergency checkpoint save at step {done}")
        with run.goodput.phase("checkpoint_save"):
            run.local.save(done, run.full(state))
        run.hang.progress(f"after the emergency checkpoint save at step {done}")


def _steps(run: Run, watchdog: StepWatchdog, stop: StopSignals) -> tuple[Any, dict]:
    """Train from the state's step to ``max_steps`` (or a signal). Returns ``(state, perf)``.

    Each step's non-finite flag is read one step late (:meth:`NonFiniteGuard.watch`), so the host
    never waits for the device in between, and at once before a log line, an evaluation, a save or
    a stop (:meth:`NonFiniteGuard.flush`). The steps of ``logging.profile_steps`` run inside the
    profiler's trace (:class:`StepProfiler`); a step out of device memory writes the device memory
    profile (:func:`save_memory_profile`) after the planner's explanation.
    """
    cfg, t, c = run.cfg, run.cfg.training, run.cfg.checkpoint
    guard = NonFiniteGuard(t.nonfinite_policy, cfg.precision)
    state, start = run.state, int(run.state.step)
    clock, perf, done = _StepClock(start), {}, start
    profiler = run.profiler or StepProfiler(None, "")
    bar = tqdm(range(start, t.max_steps), initial=start, total=t.max_steps, dynamic_ncols=True, desc="train",
               disable=not (run.is_main and cfg.logging.progress_bar and sys.stderr.isatty()))
    rec, hang = run.goodput, run.hang
    rec.enter("productive")
    try:
        for step in bar:
            done = step + 1
            hang.phase(f"in step {done}'s data loading")
            on_policy = getattr(run.loader, "on_policy", False)  # GRPO: the rollout phase on this state,
            with contextlib.nullcontext() if on_policy else rec.phase("data_waiting"):  # productive time
                batch = run.loader.batch(step, state) if on_policy else run.loader.batch(step)
            hang.phase(f"in step {done}'s train_step dispatch")
            with profiler.step(done, state) as traced:
                state, m = run.compiled(state, batch)
                if on_policy:
                    m = {**m, **run.loader.metrics}
                traced.append((state, m))
            clock.paused_s += profiler.take_overhead_s()  # starting and writing a trace is not step time
            watchdog.kick(f"step {done}")
            hang.phase(f"waiting for step {done - 1}'s results (the collectives of steps {done - 1}-{done})")
            guard.watch(done, m)
            hang.step_done(done)
            rec.step_done(done)
            evaluate = bool(t.eval_every) and done % t.eval_every == 0 and done != t.max_steps
            save = run.ckpt is not None and (evaluate or (c.save_every and done % c.save_every == 0))
            log_now = done % cfg.logging.log_every == 0 or done == t.max_steps
            if log_now:  # a non-finite step is logged too (null values, spelt out in "nonfinite_values")
                hang.phase(f"waiting for step {done}'s results (the collectives of step {done}) to log them")
                perf = _log_step(run, done, m, clock, bar)
            if log_now or evaluate or save or stop:
                guard.flush()
            if evaluate or save:
                with clock.paused(m):
                    v = _evaluate_phase(run, state, done) if evaluate else None
                    if save:
                        hang.progress(f"in checkpoint save at step {done}")
                        with rec.phase("checkpoint_save"):
                            _save(run, state, val_loss=v)  # eval steps are candidates for the best checkpoint
                        hang.progress(f"after the checkpoint save at step {done}")
            if run.local is not None and run.local.due(done) and done != t.max_steps:
                _save_local(run, state, done, m, clock)
            if stop:
                break
        guard.flush()
        rec.enter("other")
    except Exception as e:
        if not isinstance(e, NonFiniteError):
            if explain_oom(e, run.plan, run.compiled):  # out of memory in a step: why, what would fit, what held it
                save_memory_profile(cfg.logging.run_dir, run.run_id, done)
            raise
        if e.step % cfg.logging.log_every and e.step != t.max_steps:  # not logged yet: its values matter
            run.write({"step": e.step, **{k: float(v) for k, v in e.metrics.items() if np.ndim(v) == 0}})
        get_dist_logger().error(str(e), ranks=[0])
        _save_last_finite(run, state)
        raise
    finally:
        profiler.close()
        bar.close()
    return state, perf


def _save_last_finite(run: Run, state: Any) -> None:
    """On a non-finite stop: the state still holds the last finite update (the bad one was not
    applied); save it so that nothing since the last checkpoint is lost."""
    if run.ckpt is None:
        return
    try:
        _save(run, state, final=True)
        run.ckpt.close()
        get_dist_logger().warning(f"saved step {int(state.step)} in {run.ckpt.directory}: the last finite state "
                                  "(the step counts the skipped steps; their updates were not applied)", ranks=[0])
    except NonFiniteStateError as e:
        get_dist_logger().warning(str(e), ranks=[0])


# ----------------------------------------------------------------------------- finish


def _sample(run: Run, state: Any) -> str:
    """A short generated text from the run's sample prompt (:func:`_data`), the tokenizer's ids only
    (temperature 0.8, the prompt cut to its last ``seq_len`` tokens), encoded as the run's data is: a
    GRPO run's prompt as its prompts are (``encode_prompt``: the tokenizer's BOS), a chat run's rendered
    text and a text corpus's without special tokens. After chat fine-tuning or GRPO it ends at the first
    end-of-text id (the tokenizer's, or any of ``model.init_from``'s ``generation_config.json`` list:
    :func:`jaxcolossal.generate.run_eos_ids`). The KV-cached sampler
    (:func:`jaxcolossal.generate.generate`) on the params as training lays them out; a family without
    a decode path (``Family.forward_cached`` None) uses the windowed one."""
    cfg, t = run.cfg.model, run.cfg.training
    if t.sample_tokens <= 0:
        return ""
    tok = get_tokenizer(run.cfg.data.tokenizer)
    fmt = data_format(run.cfg)
    eos = run_eos_ids(tok, cfg.init_from or None) if fmt.sample_ends_at_eos else ()
    encode = tok.encode_prompt if fmt.sample_as_prompt else tok.encode
    prompt = encode(run.sample_prompt)[-min(t.seq_len, SAMPLE_WINDOW):]
    family = run.plan.family
    if family.forward_cached is None:
        shard = Sharder(None).with_fp8(run.cfg.precision.fp8)
        fn = jax.jit(lambda p, x: family.forward(fetch_layer(p), x, cfg, shard)[..., : tok.vocab_size])
        out = sample_tokens(fn, state.model_params, prompt, t.sample_tokens, min(t.seq_len, SAMPLE_WINDOW),
                            jax.random.key(t.seed + 1)).tolist()
    else:  # the tokenizer's ids only: the logits past its vocabulary are masked like the padded ones
        small = dataclasses.replace(cfg, vocab_size=min(cfg.vocab_size, tok.vocab_size))
        out = generate(family, small, state.model_params, [list(prompt)], t.sample_tokens, Sampling(temperature=0.8),
                       eos_id=eos, seed=t.seed + 1, fp8=run.cfg.precision.fp8).rows()[0]
    out = out[: next((i for i, t in enumerate(out) if t in eos), len(out))]
    return run.sample_prompt + tok.decode(np.asarray(out, np.int32))


ORBAX_NOISE = ("did not provide metrics", "Metadata file does not exist")
"""orbax log lines that say less than ours: saves between evaluations carry no val_loss on purpose,
and a step folder without metadata is reported (and moved aside) by the checkpoint manager."""


def _drop_orbax_noise(record: logging.LogRecord) -> bool:
    return not any(n in record.getMessage() for n in ORBAX_NOISE)


@contextlib.contextmanager
def _quiet_console():
    """Log lines (ours, absl's, orbax's) go above the progress bar instead of through it."""
    get_dist_logger()  # its own console handler first, so that the redirect replaces it instead of adding one
    absl = logging.getLogger("absl")
    absl.addFilter(_drop_orbax_noise)
    try:
        with logging_redirect_tqdm([logging.getLogger(), logging.getLogger("jaxcolossal")]):
            yield
    finally:
        absl.removeFilter(_drop_orbax_noise)


def train(cfg: Config) -> dict:
    """Run the main job described by ``cfg``; returns a summary dict (losses, throughput, sample).

    With ``checkpoint.dir`` set it saves every ``checkpoint.save_every`` steps, at each
    evaluation (a candidate for the best checkpoint) and at the end. On SIGTERM or Ctrl-C it
    saves the current step and returns early with ``stopped_by`` set (``"SIGTERM"``/``"SIGINT"``)
    and ``exit_code`` 143/130. Before the first step (during start-up) a signal stops it at the next
    phase boundary instead (after the mesh and plan, the data, the model's init, the checkpoint
    folder, the compile or the evaluation at the start), without a step or a save; the summary then
    says so in ``stopped_before_training`` (the phase just finished) and holds no state. A second
    Ctrl-C raises ``KeyboardInterrupt`` at once. In a multi-process job a watchdog aborts a process
    that makes no progress for ``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT`` seconds (exit 124). See
    :mod:`jaxcolossal.train.guard`.

    Raises:
        ConfigError: before anything is compiled, for any impossible setting.
        NonFiniteError: a NaN/inf step under ``training.nonfinite_policy`` (after saving the last
            finite state).
        CheckpointError: a save that could not be written, or a checkpoint that does not fit.
        KeyboardInterrupt: a second Ctrl-C.
    """
    with StopSignals() as stop, _quiet_console():
        cfg = after_restart(cfg, os.environ, jax.device_count())  # a restarted job resumes (issue 44)
        preflight(cfg)
        watchdog = StepWatchdog(collective_timeout() if jax.process_count() > 1 else None)
        try:
            return _train(cfg, watchdog, stop)
        except StoppedBeforeTraining as e:
            get_dist_logger().warning(str(e), ranks=[0])
            return {"val_loss_start": None, "val_loss_end": None, "perf": {}, "compile_s": None, "sample": "",
                    "state": None, "plan": None, "stopped_by": e.signal_name, "exit_code": e.exit_code,
                    "stopped_before_training": e.after}
        finally:
            watchdog.stop()


_TRAINED_IN_THIS_PROCESS = [False]
"""Whether :func:`train` ran before in this process: the goodput of the first run counts from the
process's start (imports included), a later one's from its call."""


def goodput_recorder(cfg: Config, heartbeat: Heartbeat | None = None) -> GoodputRecorder:
    """The run's goodput timeline (:mod:`jaxcolossal.runtime.goodput`): process 0 appends it to
    ``<logging.run_dir>/goodput.jsonl`` with ``fault_tolerance.goodput``; the other processes keep it in
    memory (their data-waiting time is gathered for the straggler check). The attempt number is
    :func:`restart_count` (0: a new job in the file), the job's start ``$JAXCOLOSSAL_JOB_START``; the
    ``heartbeat`` is told the step restored and each step finished (the launcher's steps lost)."""
    path = os.path.join(cfg.logging.run_dir, "goodput.jsonl") \
        if cfg.fault_tolerance.goodput and jax.process_index() == 0 else None
    start = time.time() if _TRAINED_IN_THIS_PROCESS[0] else process_start_time()
    _TRAINED_IN_THIS_PROCESS[0] = True
    return GoodputRecorder(path, restart_count(os.environ), start=start, heartbeat=heartbeat,
                           job_start=job_start(os.environ))


def _train(cfg: Config, watchdog: StepWatchdog, stop: StopSignals) -> dict:
    ft = cfg.fault_tolerance
    # the heartbeat ($JAXCOLOSSAL_HEARTBEAT_DIR, the launcher's log folder): which process stopped, the steps lost
    beat = Heartbeat.from_env(os.environ, jax.process_index(), jax.process_count(), restart_count(os.environ))
    hang = HangWatchdog(ft.hang_timeout_s, ft.hang_factor, process_index=jax.process_index(), heartbeat=beat)
    run = _start(cfg, stop, goodput_recorder(cfg, beat))
    run.hang = hang
    out = None
    try:
        out = _run(run, watchdog, stop)
        return out
    except StoppedBeforeTraining:
        if run.ckpt is not None:
            run.ckpt.close()
        raise
    finally:  # W&B marks a run that raised as failed, one stopped by a signal with its exit code
        hang.stop()
        if run.local is not None:
            run.local.close()
        run.metrics.close(exit_code=1 if out is None else out["exit_code"])


def _run(run: Run, watchdog: StepWatchdog, stop: StopSignals) -> dict:
    log, rec = get_dist_logger(), run.goodput
    watchdog.start("compiled the train step")
    run.hang.start()  # armed by the first step; the start-up is the collective-timeout watchdog's
    with rec.phase("evaluation"):
        val_start = _evaluate(run, run.state)
    name, value = eval_parts(run.cfg, val_start)
    log.info(f"{name} at step {int(run.state.step)}: {value}", ranks=[0])
    run.write({"step": int(run.state.step), "val_loss": val_start})
    stop.start_training(after=f"the evaluation at step {int(run.state.step)}")
    state, perf = _steps(run, watchdog, stop)
    out = {"val_loss_start": val_start, "val_loss_end": None, "perf": perf, "compile_s": run.compile_s,
           "sample": "", "state": state, "plan": run.plan, "stopped_by": stop.received,
           "exit_code": stop.exit_code}
    run.hang.stop()  # the end-of-run phases are watched by the collective-timeout watchdog
    if stop:  # a signal: save where we are and stop, without the final evaluation
        watchdog.stop()
        log.warning(f"{stop.received} received: saving step {int(state.step)} and stopping", ranks=[0])
    else:
        with rec.phase("evaluation"):
            out["val_loss_end"] = val_end = _evaluate(run, state)
        watchdog.stop()  # past the last collective of the loop; orbax's own barriers time out the final save
        run.write({"step": int(state.step), "val_loss": val_end})
        (name, start), (_, end) = eval_parts(run.cfg, val_start), eval_parts(run.cfg, val_end)
        log.info(f"{name}: {start} at start -> {end} at step {int(state.step)}", ranks=[0])
    with rec.phase("checkpoint_save"):
        try:
            if run.local is not None:
                run.local.close()
        finally:  # whatever the emergency copies did, the final persistent checkpoint is written
            _save(run, state, val_loss=out["val_loss_end"], final=True)
        if run.ckpt:
            run.ckpt.close()
        if run.local is not None:  # the final persistent step is the newest: the emergency copies are stale
            run.local.clear()
    if run.nvme is not None:  # the returned state is whole
        out["state"] = state = run.full(state)
    if run.plan.lora and run.is_main:  # the trained adapters in PEFT's format, beside the logs
        out["adapter_dir"] = adapter_dir = os.path.join(run.cfg.logging.run_dir, "adapter")
        save_adapters(adapter_dir, run.cfg.model, jax.device_get(state.master if run.plan.mixed else state.params),
                      base_model=run.cfg.model.init_from)
        log.info(f"LoRA adapters saved in PEFT's format in {adapter_dir}", ranks=[0])
    if not stop:
        out["sample"] = _sample(run, state)
        if run.is_main and out["sample"]:
            print("----- sample -----\n" + printable(out["sample"]) + "\n------------------")
    out["goodput"] = _report_goodput(run, int(state.step))
    return out


def _report_goodput(run: Run, step: int) -> dict:
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


# ----------------------------------------------------------------------------- evaluate only


def _nothing_to_evaluate(cfg: Config, what: str = "--eval-only: nothing to evaluate") -> None:
    """Raises ConfigError (one line, starting with ``what``) when ``checkpoint.dir`` holds no step and
    ``model.init_from`` is empty."""
    c = cfg.checkpoint
    if (c.dir and step_dirs(c.dir)) or cfg.model.init_from:
        return
    where = f"checkpoint.dir={c.dir!r} holds no checkpoint" if c.dir else "checkpoint.dir is not set"
    raise ConfigError(f"{what}: {where} and model.init_from is empty; set checkpoint.dir "
                      "to a run's checkpoints or model.init_from=HF_DIR (a Hugging Face folder)")


POLICY_FIELDS = ("step", "params", "frozen")
"""The state's fields that sampling and evaluation read (:func:`_restored_state`): a post-training
run's saved ``reference.*`` and every optimizer state stay unread, whatever ``training.objective``."""


def _restored_state(cfg: Config, plan: TrainPlan, reference: bool = False) -> tuple[Any, str]:
    """``(state, source)``: the newest step in ``checkpoint.dir`` that restores, else ``model.init_from``'s
    Hugging Face weights, and a phrase naming which. Only the policy is read (:data:`POLICY_FIELDS`;
    ``reference``: DPO's frozen reference too), so a DPO or GRPO checkpoint restores under an SFT
    config and the other way round. Raises as :func:`evaluate_only`."""
    state = _initial_state(cfg, plan, build_optimizer(cfg.training, plan))
    if not reference:
        state = state.replace(reference=None)
    source = f"the Hugging Face weights in {cfg.model.init_from}"
    if cfg.checkpoint.dir and step_dirs(cfg.checkpoint.dir):
        ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.max_to_keep, config=cfg.to_dict())
        try:
            state = ckpt.restore(state, only=POLICY_FIELDS + (("reference",) if reference else ()))
        finally:
            ckpt.close()
        source = f"checkpoint step {int(state.step)} in {ckpt.directory}"
    return state, source


def state_for_sampling(cfg: Config) -> tuple[TrainPlan, Any, str]:
    """``scripts/generate.py``: ``(plan, state, source)``, the state that :func:`evaluate_only` would
    evaluate (the newest checkpoint in ``checkpoint.dir``, else ``model.init_from``), on the run's
    mesh and in its layout (``state.model_params``, sharded as ``plan.specs.params``). Never trains.

    Raises:
        ConfigError: nothing to sample from, or a :func:`preflight` refusal.
        CheckpointMismatchError, CheckpointNotFoundError: as :func:`evaluate_only`.
    """
    preflight(cfg, eval_only=True)
    _nothing_to_evaluate(cfg, "nothing to sample from")
    with _quiet_console():
        _, plan = _mesh_and_plan(cfg, new_run_id())
        state, source = _restored_state(cfg, plan)
    return plan, state, source


def evaluate_only(cfg: Config) -> dict:
    """``scripts/train.py --eval-only``: the held-out evaluation of the state a run of ``cfg`` would
    start from, by the loop's own evaluation (:func:`_evaluate`, the one ``training.eval_every``
    runs) over the same fixed batches (``training.eval_batches`` of the validation split, with the
    same data keys, mesh and sharding). The state: the policy of the newest step in ``checkpoint.dir``
    that restores (as ``training.resume=true`` restores it, whatever ``training.resume`` says; a DPO
    or GRPO run's frozen reference is read only where DPO's evaluation needs it), else
    ``model.init_from``'s Hugging Face weights. Never trains, never saves a checkpoint.

    Prints one line (process 0), :func:`eval_line`'s ``<what> at step N (<source>)``: SFT's
    ``validation loss X.XXXX nats/token, perplexity Y``, DPO's held-out pairs' loss and
    ``rewards/accuracies``, GRPO's held-out ``reward`` of greedy completions. Appends ``{"step": N,
    "val_loss": ..., "eval_only": true}`` (with DPO's ``val_rewards/*``, GRPO's ``val_reward``) to
    ``<run_dir>/metrics.jsonl``; returns ``{"step", "val_loss", "perplexity" (SFT), "source"}``.

    Raises:
        ConfigError: before anything compiles: nothing to evaluate (no checkpoint in
            ``checkpoint.dir`` and no ``model.init_from``), or any :func:`preflight` refusal.
        CheckpointMismatchError: the checkpoint is of another model size.
        CheckpointNotFoundError: ``checkpoint.dir`` holds steps, none of which restores.
    """
    preflight(cfg, eval_only=True)
    _nothing_to_evaluate(cfg)
    run_id, evaluation = new_run_id(), objective_class(cfg).evaluation  # its own train.log separator and TB folder
    with _quiet_console():
        mesh, plan = _mesh_and_plan(cfg, run_id)
        loader, evals, _ = _data(cfg, mesh, plan)
        state, source = _restored_state(cfg, plan,
                                        reference=evaluation == "objective" and cfg.posttrain.reference == "frozen")
        metrics = mx.MetricsWriter.for_run(cfg, run_id, enabled=jax.process_index() == 0)
        run = Run(cfg=cfg, plan=plan, state=state, ckpt=None, loader=loader, evals=evals, compiled=None,
                  eval_step=_eval_step(plan), compile_s=0.0,
                  compiled_peak=0, metrics=metrics)
        ok = False
        try:
            step, val = int(state.step), _evaluate(run, state)
            run.write({"step": step, "val_loss": val, "eval_only": True})
            ok = True
        finally:
            metrics.close(exit_code=0 if ok else 1)
    out = {"step": step, "val_loss": val, "source": source}
    if evaluation == "loss":
        out["perplexity"] = math.exp(val) if val < 700 else math.inf  # exp overflows a float past ~709
    if run.is_main:
        print(f"{eval_line(cfg, val, out.get('perplexity'))} at step {step} ({source})")
    return out


def eval_parts(cfg: Config, val: float) -> tuple[str, str]:
    """``(name, value with its unit)`` of a held-out evaluation's value ``val`` (:func:`_evaluate`'s):
    SFT's ``("validation loss", "X nats/token")``, DPO's ``("held-out DPO loss", "X per pair")``, GRPO's
    ``("held-out reward (greedy)", "X")`` (``val`` is minus the reward)."""
    return objective_class(cfg).held_out_parts(val)


def eval_line(cfg: Config, val: float, perplexity: float | None = None) -> str:
    """:func:`eval_parts` as one phrase, ``validation loss X nats/token`` (with ``perplexity``),
    ``held-out DPO loss X per pair``, ``held-out reward (greedy) X``."""
    name, value = eval_parts(cfg, val)
    return f"{name} {value}" + ("" if perplexity is None else f", perplexity {perplexity:.2f}")
