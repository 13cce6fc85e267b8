"""The training loop's fault policies, in one place: signals, non-finite steps, the watchdog.

* :class:`StopSignals` — SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) set a
  flag; the loop saves a checkpoint at the end of the current step and exits 143 / 130
  (``128 + signal``). During start-up (before the first step) the run stops at the next phase
  boundary instead (:meth:`StopSignals.check` raises :class:`StoppedBeforeTraining`): no step, no
  save. A second Ctrl-C aborts at once (``KeyboardInterrupt``); a command line then ends with
  :func:`exit_at_once`, never through the interpreter's teardown.
* :class:`NonFiniteGuard` — every precision: a step whose loss or gradients hold NaN/inf is
  never applied (the train step keeps the old state, see ``jaxcolossal.train.step``); the guard
  then stops the run with :class:`NonFiniteError` (``training.nonfinite_policy=stop``) or lets
  it skip up to ``precision.max_consecutive_skips`` steps in a row (``skip``). In fp16, overflow
  is the loss scaler's business (DynamicGradScaler: skip and back off); the run stops only when
  ``max_consecutive_skips`` steps in a row overflow with the scale at ``min_scale``.
* :class:`StepWatchdog` — in a multi-process job, aborts a process that makes no progress for
  the collective timeout (a peer died or left the loop; NCCL has no timeout of its own).
* :func:`explain_oom` — XLA out of device memory, at compile time or in a step: log the
  planner's explanation (the predicted breakdown next to what XLA reported, and the cheapest
  changes: :func:`jaxcolossal.memory.oom.explain_oom`), then the caller re-raises.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import jax

from jaxcolossal.errors import StoppedError
from jaxcolossal.memory.budget import device_limit
from jaxcolossal.memory.oom import explain_oom as explain
from jaxcolossal.memory.oom import is_oom
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.launch import COLLECTIVE_TIMEOUT_ENV, WATCHDOG_EXIT_CODE, backend_started

EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}
"""Exit status after a signal-triggered save, ``128 + signal number``, as schedulers expect."""


class StoppedBeforeTraining(Exception):
    """A SIGTERM or SIGINT arrived during start-up; raised at the next phase boundary
    (:meth:`StopSignals.check`), before any step ran or anything was saved. ``signal_name`` is
    ``"SIGTERM"``/``"SIGINT"``, ``after`` the phase just finished (``"compiling the train step"``)
    and ``exit_code`` 143 / 130; the message is the one line the run ends with."""

    def __init__(self, signal_name: str, after: str):
        super().__init__(f"{signal_name} received: stopped before training started (after {after}); no step ran "
                         "and nothing was saved")
        self.signal_name, self.after = signal_name, after
        self.exit_code = EXIT_CODES[signal_name]


class StopSignals:
    """Turn SIGTERM and SIGINT into a request to stop (a context manager).

    ``received`` is ``None`` until a signal arrives, then its name (``"SIGTERM"``/``"SIGINT"``);
    ``bool(stop)`` is True once one has. A signal before :meth:`start_training` means "stop at the
    next start-up phase, saving nothing" (the loop calls :meth:`check` at each boundary); one after
    it, "save the current step and stop". A second SIGINT restores Python's default handler
    and raises ``KeyboardInterrupt("second Ctrl-C")`` at once, wherever the main thread is (also
    out of a wait for an XLA compile, which then keeps running in the background: see
    :func:`exit_at_once`). Handlers can only be installed from the main thread; elsewhere this is a
    flag that never sets.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self.training = False
        self._in_start_up = False  # whether the first signal came before start_training
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received == "SIGINT" and name == "SIGINT":
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt("second Ctrl-C")
        if self.received is None:
            self.received, self._in_start_up = name, not self.training
        if name == "SIGINT":
            sys.stderr.write("\nCtrl-C: " + ("stopping before training starts, at the end of this start-up phase; "
                                             "nothing will be saved" if self._in_start_up
                                             else "finishing this step, saving a checkpoint and stopping")
                             + " (press Ctrl-C again to abort at once)\n")

    def check(self, after: str) -> None:
        """A start-up phase boundary; ``after`` names the phase just finished (in the message).

        Raises:
            StoppedBeforeTraining: a signal arrived before :meth:`start_training`.
        """
        if self.received is not None and self._in_start_up:
            raise StoppedBeforeTraining(self.received, after)

    def start_training(self, after: str) -> None:
        """The last start-up boundary (``after``: the phase just finished), then the first step: a
        signal from here on means "save the current step and stop".

        Raises:
            StoppedBeforeTraining: a signal arrived before this call.
        """
        self.training = True
        self.check(after)

    @property
    def exit_code(self) -> int:
        """143 after SIGTERM, 130 after SIGINT, 0 when no signal arrived."""
        return EXIT_CODES.get(self.received, 0)

    def __bool__(self) -> bool:
        return self.received is not None


def exit_at_once(message: str, status: int = 130) -> NoReturn:
    """End the process now with ``status``: ``message`` on stderr, then stdout, stderr and every
    logging handler (``train.log``) flushed, then ``os._exit``. Further Ctrl-Cs are ignored
    meanwhile. Never returns, never raises.

    For a command line after a Ctrl-C that aborts (:class:`StopSignals`' second): the interpreter's
    own teardown would destroy XLA's client while a compile the ``KeyboardInterrupt`` abandoned
    still runs on the client's thread pool. That teardown waits for the compile to end (minutes for a
    large model) and then crashes with a segmentation fault (exit 139) when the finished compile
    builds its executable against the half-destroyed client. ``os._exit`` skips the teardown: no
    destructor runs, and no ``atexit`` handler (nothing is left to save). Not for library code: in a
    notebook it would end the kernel.
    """
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stderr.write(message + "\n")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


class NonFiniteError(StoppedError, FloatingPointError):
    """Training produced NaN or inf and the policy says stop. ``step`` is the offending step,
    ``metrics`` its metrics (device or host scalars)."""

    def __init__(self, message: str, step: int, metrics: dict | None = None):
        super().__init__(message)
        self.step, self.metrics = step, metrics or {}


class NonFiniteGuard:
    """Read each step's ``nonfinite`` flag and apply ``training.nonfinite_policy``.

    Args:
        policy: ``"stop"`` or ``"skip"`` (``training.nonfinite_policy``).
        precision: the ``precision`` config section (``mode``, ``max_consecutive_skips``,
            ``min_scale``).
    """

    def __init__(self, policy: str, precision):
        self.policy, self.pc = policy, precision
        self.fp16 = precision.mode == "fp16"
        self.streak = 0
        self._pending: tuple[int, dict] | None = None

    def watch(self, step: int, m: dict) -> None:
        """Check the previous step's metrics, then hold these until the next call or :meth:`flush`:
        reading a step's flag one step late lets the host dispatch the next step before the device
        finishes this one."""
        self.flush()
        self._pending = (step, m)

    def flush(self) -> None:
        """Check the held step now (before a log line, an evaluation, a save or a stop)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.check(*pending)

    def check(self, step: int, m: dict) -> None:
        """Check the metrics of optimizer step ``step`` (1-based; a host sync on two scalars).

        Raises:
            NonFiniteError: the policy says stop; the message names the step, the values and
                what to try.
        """
        if not int(m["nonfinite"]):
            self.streak = 0
            return
        self.streak += 1
        k = self.pc.max_consecutive_skips
        loss, norm = float(m["loss"]), float(m["grad_norm"])
        if self.fp16:
            if self.streak >= k and float(m["loss_scale"]) <= self.pc.min_scale:
                raise NonFiniteError(
                    f"fp16: {self.streak} consecutive steps overflowed with the loss scale at its minimum "
                    f"{self.pc.min_scale:g} (up to step {step}); training stopped instead of skipping forever "
                    "(try bf16, a lower learning rate, or precision.min_scale)", step, m)
            return
        what = f"step {step}: loss {loss}, grad_norm {norm}"
        if self.policy == "stop":
            raise NonFiniteError(
                f"{what} is not finite; the update was not applied and training stopped "
                "(training.nonfinite_policy=stop). Lower training.learning_rate, check the data, or set "
                "training.nonfinite_policy=skip to skip such steps", step, m)
        if self.streak >= k:
            raise NonFiniteError(
                f"{what}: {self.streak} consecutive non-finite steps (precision.max_consecutive_skips={k}); "
                "training stopped", step, m)


class StepWatchdog:
    """Abort the process when it makes no progress for ``timeout`` seconds.

    A process blocked in a collective whose peer left the loop early, hung or died cannot be
    interrupted from Python (the wait is inside XLA/NCCL/gloo), and NCCL has no timeout of its
    own. The loop calls :meth:`kick` after each unit of progress; a daemon thread checks the time
    since the last kick and, past ``timeout``, prints a clear message and the Python stacks of
    every thread to stderr and ends the process with ``os._exit(WATCHDOG_EXIT_CODE)`` (124).

    Use it as a context manager or call :meth:`start`/:meth:`stop`. With ``timeout=None`` it is
    disabled and every method is a no-op.

    Args:
      timeout: seconds without a kick before aborting, or None (disabled).
      process_index: shown in the message (default: 0 before the backend starts, else
        ``jax.process_index()``, read once here and never from the watchdog thread).
      on_timeout: called with the message instead of aborting (for tests).
    """

    def __init__(self, timeout: float | None, *, process_index: int | None = None,
                 on_timeout: Callable[[str], None] | None = None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.timeout = timeout
        if process_index is None:
            process_index = jax.process_index() if backend_started() else 0
        self.process_index = process_index
        self._on_timeout = on_timeout
        self._last = time.monotonic()
        self._what = "start"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    @property
    def enabled(self) -> bool:
        return self.timeout is not None

    def start(self, what: str = "start") -> "StepWatchdog":
        if self.enabled and self._thread is None:
            self.kick(what)
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="jaxcolossal-watchdog", daemon=True)
            self._thread.start()
        return self

    def kick(self, what: str = "") -> None:
        """Record progress (``what`` names it in the message, e.g. ``"step 12"``)."""
        self._last = time.monotonic()
        if what:
            self._what = what

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "StepWatchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        poll = min(1.0, self.timeout / 10)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                self.fired = True
                msg = (f"jaxcolossal watchdog: process {self.process_index} made no progress for "
                       f"{idle:.0f} s (timeout {self.timeout:g} s; last progress: {self._what}). A "
                       f"collective is probably waiting for a process that left the training loop "
                       f"early, hung or died. Aborting with exit code {WATCHDOG_EXIT_CODE}; set "
                       f"{COLLECTIVE_TIMEOUT_ENV} (or python -m jaxcolossal.run --timeout) to change "
                       f"the timeout.")
                if self._on_timeout is not None:
                    self._on_timeout(msg)
                    return
                sys.stderr.write("\n" + msg + "\nPython stacks of this process:\n")
                sys.stderr.flush()
                try:
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                except Exception:  # noqa: BLE001 - best effort
                    pass
                sys.stderr.flush()
                os._exit(WATCHDOG_EXIT_CODE)




def explain_oom(error: BaseException, plan, compiled=None) -> bool:
    """If ``error`` is XLA reporting device memory exhausted, log (rank 0) why and what would fit
    (:func:`jaxcolossal.memory.oom.explain_oom`) and return True; otherwise return False. Never raises
    (a failure to explain must not hide the out-of-memory error itself)."""
    if not is_oom(error):
        return False
    try:
        text = explain(plan, error, compiled, device_limit(plan.cfg, list(plan.mesh.devices.flat)))
    except Exception as e:  # noqa: BLE001
        text = f"out of device memory ({error}); the planner could not explain it: {e!r}"
    get_dist_logger().error(text, ranks=[0])
    return True
