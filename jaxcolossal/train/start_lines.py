"""What a run says as it starts, before its first step: the run's line (mesh, devices, precision and
every path the config switches on: :func:`run_line`), the optimization line, where the output goes,
what ``model.init_from`` brings, and the warnings about the settings (:func:`start_notes`)."""

from __future__ import annotations

import os

import jax

from jaxcolossal.config import Config, TrainingConfig, precision_label
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.train.emergency import local_dir
from jaxcolossal.train.optimizer import lr_schedule
from jaxcolossal.train.state import TrainPlan
from jaxcolossal.train.step import gathers_lowp, prefetches_weights


def run_line(cfg: Config, plan: TrainPlan, mesh) -> str:
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


def optimization_line(cfg: Config) -> str:
    """The run's second log line: the peak learning rate, its schedule (warmup steps, cosine decay to
    ``learning_rate × min_learning_rate_ratio`` at ``max_steps``), weight decay, ``seq_len`` in
    tokens, the global batch in sequences and in tokens (``batch_size × seq_len``) and the steps."""
    t = cfg.training
    return (f"learning rate {t.learning_rate:g}: warmup {t.warmup_steps} steps, cosine decay to "
            f"{t.learning_rate * t.min_learning_rate_ratio:g} at step {t.max_steps}; weight decay {t.weight_decay:g}; "
            f"seq_len {t.seq_len} tokens; global batch {t.batch_size} sequences = {t.batch_size * t.seq_len} tokens; "
            f"{t.max_steps} steps")


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


def init_from_inherits(cfg: Config) -> str:
    """What a run with ``model.init_from`` takes from the Hugging Face folder and what starts fresh,
    for its start-up line."""
    fresh = "the optimizer state, the schedule and the step start fresh"
    lora = cfg.model.lora
    if lora.enabled and not lora.init_from:
        fresh = "the LoRA adapters, " + fresh
    return f"its {cfg.model.num_layers} layers' weights, embeddings and head; {fresh}"


def start_notes(cfg: Config, plan: TrainPlan) -> None:
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
