"""The training loop behind ``scripts/train.py``: ``train(cfg)`` and its phases, each a call into
the room named after what it holds.

``train(cfg)``: **preflight** (:mod:`jaxcolossal.train.preflight`: every error that needs the file
system, before anything compiles) → **start** (:mod:`jaxcolossal.train.start`: mesh, plan, data,
state, restore, compile) → the evaluation at the start → **steps** (:mod:`jaxcolossal.train.steps`:
with evaluations and saves at their intervals) → **finish** (:mod:`jaxcolossal.train.finish`: final
evaluation, final save, a sample). The phases share one :class:`jaxcolossal.train.run.Run`. What
happens on a signal, a NaN or a hung peer is decided in :mod:`jaxcolossal.train.guard`; the
evaluations are :mod:`jaxcolossal.train.evaluate`'s, the saves and restores
:mod:`jaxcolossal.train.checkpointing`'s.

It prints, in order (:mod:`jaxcolossal.train.start_lines`, :mod:`jaxcolossal.train.report`): the
mesh, the learning rate and its schedule, seq_len and the global batch in tokens (with a warning
when ``model.init_from`` runs at the pre-training learning rate), a table of every parameter's
shape, dtype and sharding, the per-device bytes of params / gradients / optimizer state (against
the ZeRO formulas), a line as the train step starts compiling and one with its compile time, the
validation loss at start, a progress bar with loss, tokens/s, FLOP/s and (on GPUs) MFU (on a
terminal; elsewhere one plain line per ``logging.log_every`` steps,
:func:`jaxcolossal.train.report.step_line`, which ``train.log`` always gets), the validation loss
at the end and a short generated sample. Metrics go to ``<run_dir>/metrics.jsonl`` (one strict
JSON object a line) and the sinks ``logging`` switches on (TensorBoard, W&B:
:class:`jaxcolossal.metrics.MetricsWriter`), written by process 0 only; each run starts with a
``run_start`` record (:func:`jaxcolossal.train.run.run_start_record`) and a line in ``train.log``
naming the same run id. ``logging.profile_steps`` traces chosen steps
(:mod:`jaxcolossal.train.profile`). A signal during start-up stops it at the next phase boundary,
before any step (:class:`jaxcolossal.train.guard.StoppedBeforeTraining`).

Fault tolerance (docs/fault_tolerance.md): emergency checkpoints every ``checkpoint.local_every``
steps (:mod:`jaxcolossal.train.emergency`), preferred at resume when newer than the persistent
ones; the hang watchdog (:mod:`jaxcolossal.runtime.watchdog`, exit 75) told of each step and phase;
the goodput timeline (:mod:`jaxcolossal.runtime.goodput`, ``<run_dir>/goodput.jsonl``) with its
report at the end; every process's step and data times at each logged step, stragglers named.
"""

from __future__ import annotations

import os
import time

import jax

from jaxcolossal.config import Config
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.faults import job_start, restart_count
from jaxcolossal.runtime.goodput import GoodputRecorder, process_start_time
from jaxcolossal.runtime.heartbeat import Heartbeat
from jaxcolossal.runtime.launch import collective_timeout
from jaxcolossal.runtime.watchdog import HangWatchdog
from jaxcolossal.train.evaluate import first_evaluation
from jaxcolossal.train.finish import finish_run
from jaxcolossal.train.guard import StepWatchdog, StoppedBeforeTraining, StopSignals
from jaxcolossal.train.preflight import preflight
from jaxcolossal.train.report import quiet_console
from jaxcolossal.train.restart import after_restart
from jaxcolossal.train.run import Run
from jaxcolossal.train.start import start_run
from jaxcolossal.train.steps import run_steps


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
    with StopSignals() as stop, quiet_console():
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
    """:func:`train` past preflight: the heartbeat and the hang watchdog, the start phase, then
    :func:`_run`; whatever happens, the watchdog stopped, the emergency checkpoints and the metric
    sinks closed (W&B told the exit code)."""
    ft = cfg.fault_tolerance
    # the heartbeat ($JAXCOLOSSAL_HEARTBEAT_DIR, the launcher's log folder): which process stopped, the steps lost
    beat = Heartbeat.from_env(os.environ, jax.process_index(), jax.process_count(), restart_count(os.environ))
    hang = HangWatchdog(ft.hang_timeout_s, ft.hang_factor, process_index=jax.process_index(), heartbeat=beat)
    run = start_run(cfg, stop, goodput_recorder(cfg, beat))
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
    """The phases after start: the evaluation at the start, the steps, the finish."""
    watchdog.start("compiled the train step")
    run.hang.start()  # armed by the first step; the start-up is the collective-timeout watchdog's
    val_start = first_evaluation(run)
    stop.start_training(after=f"the evaluation at step {int(run.state.step)}")
    state, perf = run_steps(run, watchdog, stop)
    return finish_run(run, state, perf, val_start, watchdog, stop)
