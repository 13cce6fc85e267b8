"""The loop's steps phase (:func:`run_steps`): train from the state's step to ``training.max_steps``
(or a signal), with the logged steps (:func:`jaxcolossal.train.report.log_step`), the evaluations
(:func:`jaxcolossal.train.evaluate.evaluate_phase`) and the saves (:mod:`jaxcolossal.train.checkpointing`)
at their intervals, the non-finite guard, the profiler's steps and the watchdogs told of each step."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.train.checkpointing import save, save_last_finite, save_local
from jaxcolossal.train.evaluate import evaluate_phase
from jaxcolossal.train.guard import NonFiniteError, NonFiniteGuard, StepWatchdog, StopSignals, explain_oom
from jaxcolossal.train.profile import StepProfiler, save_memory_profile
from jaxcolossal.train.report import StepClock, log_step
from jaxcolossal.train.run import Run


def run_steps(run: Run, watchdog: StepWatchdog, stop: StopSignals) -> tuple[Any, dict]:
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
    clock, perf, done = StepClock(start), {}, start
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
                if hasattr(run.loader, "step_metrics"):  # host-side counts (DPO's, the reward model's num_tokens)
                    m = {**m, **run.loader.step_metrics(step)}
                traced.append((state, m))
            clock.paused_s += profiler.take_overhead_s()  # starting and writing a trace is not step time
            watchdog.kick(f"step {done}")
            hang.phase(f"waiting for step {done - 1}'s results (the collectives of steps {done - 1}-{done})")
            guard.watch(done, m)
            hang.step_done(done)
            rec.step_done(done)
            evaluate_now = bool(t.eval_every) and done % t.eval_every == 0 and done != t.max_steps
            save_now = run.ckpt is not None and (evaluate_now or (c.save_every and done % c.save_every == 0))
            log_now = done % cfg.logging.log_every == 0 or done == t.max_steps
            if log_now:  # a non-finite step is logged too (null values, spelt out in "nonfinite_values")
                hang.phase(f"waiting for step {done}'s results (the collectives of step {done}) to log them")
                perf = log_step(run, done, m, clock, bar)
            if log_now or evaluate_now or save_now or stop:
                guard.flush()
            if evaluate_now or save_now:
                with clock.paused(m):
                    v = evaluate_phase(run, state, done) if evaluate_now else None
                    if save_now:
                        hang.progress(f"in checkpoint save at step {done}")
                        with rec.phase("checkpoint_save"):
                            save(run, state, val_loss=v)  # eval steps are candidates for the best checkpoint
                        hang.progress(f"after the checkpoint save at step {done}")
            if run.local is not None and run.local.due(done) and done != t.max_steps:
                save_local(run, state, done, m, clock)
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
        save_last_finite(run, state)
        raise
    finally:
        profiler.close()
        bar.close()
    return state, perf
