"""Profiles of a run: a ``jax.profiler`` trace of chosen steps, and a device memory profile when a
step runs out of memory.

* :class:`StepProfiler` — ``logging.profile_steps`` (``"3-5"``): the trace starts before the first
  of those steps (after the device work of the steps before it is done) and stops after the last
  one's work is done, so it holds those steps and nothing else of the loop. Each traced step is a
  ``StepTraceAnnotation`` (``train``, its step number), which the profile tools use as the step
  boundary. The trace is written to ``<run_dir>/profile/<run id>/`` in the layout TensorBoard's
  profile plugin and xprof read (``plugins/profile/<timestamp>/<host>.xplane.pb``, and
  ``<host>.trace.json.gz`` for Perfetto): ``tensorboard --logdir <run_dir>/profile`` shows it as
  the run ``<run id>``.
* :func:`save_memory_profile` — ``jax.profiler.save_device_memory_profile``: the live device
  buffers in pprof's format, written when a step runs out of memory (``go tool pprof`` or
  pprof's web UI shows which arrays held the memory).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax

from jaxcolossal.config import Config, parse_step_range
from jaxcolossal.runtime.dist_logger import get_dist_logger


def profile_dir(run_dir: str, run_id: str) -> str:
    """``<run_dir>/profile/<run id>``: the folder of one run's profiles (trace and memory)."""
    return os.path.join(run_dir, "profile", run_id)


class StepProfiler:
    """A trace of the training steps ``first..last`` (counted from 1, as the log numbers them),
    written to ``log_dir`` by the process where ``enabled`` (process 0). A resumed run traces the
    part of the range it runs. Call :meth:`step` around each step and :meth:`close` at the end
    (also after an error or a stop: an open trace is stopped and written). ``overhead_s``: the
    seconds spent starting and writing the trace, which the caller leaves out of the step time
    (:meth:`take_overhead_s`)."""

    def __init__(self, steps: tuple[int, int] | None, log_dir: str, enabled: bool = True):
        self.steps = steps if enabled else None
        self.log_dir = log_dir
        self.active = False
        self.overhead_s = 0.0

    @classmethod
    def for_run(cls, cfg: Config, run_id: str, enabled: bool) -> "StepProfiler":
        """The profiler of ``cfg.logging.profile_steps`` for the run ``run_id``."""
        return cls(parse_step_range(cfg.logging.profile_steps), profile_dir(cfg.logging.run_dir, run_id), enabled)

    def take_overhead_s(self) -> float:
        """The seconds spent starting and stopping the trace since the last call (then 0)."""
        out, self.overhead_s = self.overhead_s, 0.0
        return out

    def wants(self, step: int) -> bool:
        """True when step ``step`` (1-based) is one to trace."""
        return self.steps is not None and self.steps[0] <= step <= self.steps[1]

    @contextlib.contextmanager
    def step(self, step: int, pending: Any):
        """Around training step ``step`` (1-based). ``pending``: the arrays the steps before produced
        (the state), waited for before a trace starts. Yields a list: append the step's outputs to
        it, so that the last traced step's work is waited for before the trace stops."""
        outputs: list = []
        if not self.wants(step):
            yield outputs
            return
        if not self.active:
            jax.block_until_ready(pending)  # the earlier steps' device work stays out of the trace
            t0 = time.time()
            jax.profiler.start_trace(self.log_dir)
            self.overhead_s += time.time() - t0
            self.active = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield outputs
        if step == self.steps[1]:
            jax.block_until_ready(outputs)  # the trace holds the last step's device work
            self.close()

    def close(self) -> None:
        """Stop and write the trace if one is open (idempotent); logs where it went (rank 0)."""
        if not self.active:
            return
        self.active = False
        t0 = time.time()
        jax.profiler.stop_trace()
        self.overhead_s += time.time() - t0
        get_dist_logger().info(f"profiler trace of steps {self.steps[0]}-{self.steps[1]} written to {self.log_dir} "
                               f"(tensorboard --logdir {os.path.dirname(self.log_dir)}, or xprof)", ranks=[0])


def save_memory_profile(run_dir: str, run_id: str, step: int) -> str | None:
    """Write the device memory profile (``jax.profiler.save_device_memory_profile``, pprof's format)
    to ``<run_dir>/profile/<run id>/memory_step<step>.prof`` (``..._process<i>.prof`` in a job of
    several processes), after a step ran out of memory. Returns the path, or None when it could not
    be written: it never raises (a failure must not hide the out-of-memory error itself)."""
    name = f"memory_step{step}" + (f"_process{jax.process_index()}" if jax.process_count() > 1 else "") + ".prof"
    path = os.path.join(profile_dir(run_dir, run_id), name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        jax.profiler.save_device_memory_profile(path)
    except Exception as e:  # noqa: BLE001
        get_dist_logger().warning(f"could not write the device memory profile to {path}: {e!r}")
        return None
    get_dist_logger().error(f"device memory profile at the out-of-memory step written to {path} "
                            "(pprof's format: go tool pprof -http=: " + path + ")")
    return path
