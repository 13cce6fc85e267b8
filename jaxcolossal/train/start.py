"""The loop's start phase (:func:`start_run`): everything before the first step. The run folder,
the mesh and the plan (:func:`mesh_and_plan`), the data through its format's plug-in and the
objective's loader (:func:`load_data`), the model's initial state (:func:`initial_state`), the
restore (:mod:`jaxcolossal.train.checkpointing`), the metric sinks and the compiled train step
(:func:`compile_step`), with the start-up lines (:mod:`jaxcolossal.train.start_lines`) and the
parameter table and memory report (:mod:`jaxcolossal.train.report`)."""

from __future__ import annotations

import os
import time
from typing import Any

import jax

from jaxcolossal import metrics as mx
from jaxcolossal.config import Config, double_buffers_loops
from jaxcolossal.config.derived import holds_reference
from jaxcolossal.data import DataLoader
from jaxcolossal.data.formats import data_format
from jaxcolossal.models.hf_io import init_params_from
from jaxcolossal.models.peft import load_adapters
from jaxcolossal.parallel.mesh import make_mesh, platform
from jaxcolossal.parallel.sharding import DATA_AXES
from jaxcolossal.posttrain.ref_model import load_ref_model
from jaxcolossal.runtime import xla_flags
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.goodput import GoodputRecorder
from jaxcolossal.train.checkpointing import open_checkpoints, restored
from jaxcolossal.train.emergency import LocalCheckpoints, local_dir
from jaxcolossal.train.guard import StoppedBeforeTraining, StopSignals, explain_oom
from jaxcolossal.train.nvme import nvme_tier
from jaxcolossal.train.objective import objective_class
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.profile import StepProfiler
from jaxcolossal.train.ref_logps import ref_logps_phase
from jaxcolossal.train.report import memory_report, param_table
from jaxcolossal.train.run import Run, new_run_id, run_start_record
from jaxcolossal.train.start_lines import init_from_inherits, run_line, start_notes
from jaxcolossal.train.state import TrainPlan, init_state, make_plan
from jaxcolossal.train.step import make_eval_step, make_objective_eval_step, make_train_step


def mesh_and_plan(cfg: Config, run_id: str | None = None) -> tuple[Any, TrainPlan]:
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
    get_dist_logger().info(run_line(cfg, plan, mesh), ranks=[0])
    return mesh, plan


def initial_state(cfg: Config, plan: TrainPlan, tx: Any) -> Any:
    """The state before any restore: ``model.init_from``'s Hugging Face weights (fine-tuning), else
    a fresh init from ``training.seed``; with ``model.lora.init_from``, its adapters; with
    ``posttrain.ref_model`` (and a reference copy held), that model's weights as the reference."""
    log, lora = get_dist_logger(), cfg.model.lora
    ref_model = cfg.posttrain.ref_model and holds_reference(cfg)
    state = init_state(plan, tx, key=jax.random.key(cfg.training.seed),
                       params=init_params_from(cfg.model, plan.mesh_shape["tp"], cfg.training.seed),
                       adapters=load_adapters(lora.init_from, cfg.model) if lora.init_from else None,
                       reference=load_ref_model(cfg, plan.mesh_shape["tp"]) if ref_model else None)
    if ref_model:
        log.info(f"the reference model is posttrain.ref_model={cfg.posttrain.ref_model} (a frozen copy)", ranks=[0])
    if cfg.model.init_from:
        log.info(f"initialised from the Hugging Face weights in {cfg.model.init_from} ({init_from_inherits(cfg)})",
                 ranks=[0])
    if lora.enabled:
        on = ", ".join(cfg.model.lora_targets)
        log.info(f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {on}: the base weights are "
                 "frozen" + (f"; adapters from {lora.init_from}" if lora.init_from else ""), ranks=[0])
    return state


def load_data(cfg: Config, mesh, plan: TrainPlan | None = None) -> tuple[Any, list, str]:
    """The training loader, the fixed evaluation batches and the end-of-run sample's prompt:
    ``data.format``'s (:func:`jaxcolossal.data.formats.data_format`; batches placed on ``mesh`` over
    the data group, evaluation batches of one microbatch's rows), or the objective's own reading of
    that format (its optional ``batches``: a reward model's pairs with their margins), its loader
    through the objective's hook (GRPO: the rollout phase on ``plan``).

    Raises:
        DataError, DependencyError: the format's files cannot be read as it reads them.
        ConfigError: an on-policy loader refusing what would train nothing (GRPO's rollouts).
    """
    t, objective = cfg.training, objective_class(cfg)
    batches = getattr(objective, "batches", None) or data_format(cfg).batches
    data, evals, prompt = batches(cfg, mesh, jax.sharding.PartitionSpec(DATA_AXES),
                                  t.batch_size // t.gradient_accumulation_steps)
    return objective.loader(data, cfg, plan), evals, prompt


def eval_step_for(plan: TrainPlan) -> Any:
    """The jitted evaluation step the objective's ``evaluation`` runs: its own loss and metrics with the
    reference (``objective``), else the language-model loss."""
    return make_objective_eval_step(plan) if objective_class(plan.cfg).evaluation == "objective" \
        else make_eval_step(plan)


def compile_step(cfg: Config, plan: TrainPlan, tx: Any, state: Any, loader: DataLoader) -> tuple[Any, float, int]:
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


def start_run(cfg: Config, stop: StopSignals, rec: GoodputRecorder) -> Run:
    """Everything before the first step: the mesh and plan, the data, the model's state, the
    checkpoint folder (restored from with ``training.resume``), DPO's precomputed reference log-probs
    (:func:`ref_logps_phase`), the metric sinks and the compiled train step.

    Raises:
        StoppedBeforeTraining: a signal arrived; raised at the next phase boundary
            (:meth:`StopSignals.check`), with the checkpoint folder and the sinks closed.
    """
    is_main, run_id = jax.process_index() == 0, new_run_id()
    mesh, plan = mesh_and_plan(cfg, run_id)
    start_notes(cfg, plan)
    stop.check("making the mesh and the plan")
    loader, evals, sample_prompt = load_data(cfg, mesh, plan)
    stop.check("loading the data")
    tx = build_optimizer(cfg.training, plan)
    state = initial_state(cfg, plan, tx)
    tier = nvme_tier(plan, tx)
    stop.check("initialising the model")
    if is_main:
        print(param_table(plan))
        print(memory_report(plan, state, tier)[0])
    ckpt, metrics = open_checkpoints(cfg), None
    local = LocalCheckpoints(local_dir(cfg), cfg.checkpoint.local_every, plan.mesh_shape, cfg.to_dict()) \
        if cfg.checkpoint.local_every else None
    try:
        with rec.phase("checkpoint_load"):
            state, resumed_from, source = restored(cfg, ckpt, state, tier, stop, local)
        rec.resumed(resumed_from or 0, source)
        # posttrain.precompute_ref_log_probs: the reference's log-probs computed (or read back) before the steps
        evals = ref_logps_phase(cfg, plan, state, loader, evals, resumed=resumed_from is not None)
        # the metric sinks before compiling: a W&B run that cannot start is refused without the compile's wait
        metrics = mx.MetricsWriter.for_run(cfg, run_id, enabled=is_main)
        with rec.phase("compilation"):
            compiled, compile_s, peak = compile_step(cfg, plan, tx, state, loader)
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
               eval_step=eval_step_for(plan),
               compile_s=compile_s, compiled_peak=peak, metrics=metrics, nvme=tier,
               sample_prompt=sample_prompt, run_id=run_id, profiler=StepProfiler.for_run(cfg, run_id, is_main),
               local=local, goodput=rec)
