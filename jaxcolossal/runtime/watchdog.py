"""The hang watchdog: a thread per process that ends a process whose steps stopped finishing.

The rule (:func:`hang_limit`): a hang is declared when no training step finishes within
``max(hang_timeout_s, hang_factor × the median step time)`` seconds. Counting starts at the end of
the first step: the start-up and step 1's compilation are covered by the collective-timeout
watchdog of the loop (:class:`jaxcolossal.train.guard.StepWatchdog`, ``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT``,
300 s, exit 124), whose allowance is larger. Evaluations and checkpoint saves are phases between
steps: entering and leaving one counts as progress (:meth:`HangWatchdog.progress`), so each may
take the limit itself.

When it fires, the process writes to its stderr (the rank's log under ``python -m
jaxcolossal.run``) one line naming the process, the limit and the phase it was in (``"in step 17's
train_step dispatch"``, ``"in checkpoint save at step 20"``), then every thread's Python stack
(:func:`faulthandler.dump_traceback`), and exits at once with
:data:`jaxcolossal.runtime.faults.HANG_EXIT_CODE` (75) through ``os._exit``: a process blocked in a
collective cannot be unblocked from Python, and the interpreter's teardown would block as well.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from jaxcolossal.runtime.faults import HANG_EXIT_CODE
from jaxcolossal.runtime.heartbeat import Heartbeat, suspect

STEP_WINDOW = 50
"""How many of the latest step times the median is taken over."""


def hang_limit(timeout_s: float, factor: float, step_times: list[float] | tuple[float, ...]) -> float:
    """Seconds without a finished step after which a process is declared hung:
    ``max(timeout_s, factor × median(step_times))``; ``timeout_s`` alone while no step time is known.
    ``step_times`` in seconds."""
    if not step_times:
        return float(timeout_s)
    return max(float(timeout_s), float(factor) * statistics.median(step_times))


class HangWatchdog:
    """Declare a hang when no step finishes within :func:`hang_limit` (a daemon thread).

    Args:
        timeout_s: ``fault_tolerance.hang_timeout_s``, seconds > 0 (0 or None: disabled, every method
            a no-op).
        factor: ``fault_tolerance.hang_factor``, > 0.
        process_index: shown in the message.
        clock: seconds, monotonic (tests pass a fake one).
        on_fire: called with the message instead of dumping stacks and exiting (tests).
        poll_s: how often the thread looks (default ``min(1, timeout_s / 10)``).
        heartbeat: this process's heartbeat; the thread beats it at each poll, and the line names the
            process every process's heartbeat blames (default: none).
    """

    def __init__(self, timeout_s: float | None, factor: float = 10.0, *, process_index: int = 0,
                 clock: Callable[[], float] = time.monotonic, on_fire: Callable[[str], None] | None = None,
                 poll_s: float | None = None, heartbeat: Heartbeat | None = None):
        self.timeout_s = float(timeout_s) if timeout_s else None
        self.heartbeat = heartbeat if heartbeat is not None else Heartbeat(None)
        self.factor, self.process_index, self.clock, self.on_fire = float(factor), process_index, clock, on_fire
        self.poll_s = poll_s if poll_s is not None else min(1.0, (self.timeout_s or 10.0) / 10)
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self.last_step = 0
        self.where = "start-up"
        self._last = None  # clock time of the last progress; None until the first step finished (unarmed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s is not None

    def start(self) -> "HangWatchdog":
        """Start the thread (it stays unarmed until the first :meth:`step_done`)."""
        if self.enabled and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="jaxcolossal-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (before the end-of-run phases, which it does not watch)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.heartbeat.quiet()

    def phase(self, where: str) -> None:
        """Name what the process does now (``"in step 17's train_step dispatch"``); not progress."""
        self.where = where

    def progress(self, where: str) -> None:
        """A phase boundary between steps (an evaluation or a save starts or ends): restart the count."""
        self.where = where
        if self._last is not None:
            self._last = self.clock()

    def step_done(self, step: int, seconds: float | None = None) -> None:
        """Step ``step`` finished (on the host); ``seconds`` its time (default: since the last one)."""
        now = self.clock()
        if seconds is None and self._last is not None:
            seconds = now - self._last
        if seconds is not None and seconds > 0:
            self.step_times.append(seconds)
        self.last_step, self._last = step, now
        self.where = f"after step {step}"

    def limit(self) -> float | None:
        """The current limit in seconds (:func:`hang_limit`), None when disabled."""
        return None if not self.enabled else hang_limit(self.timeout_s, self.factor, tuple(self.step_times))

    def overdue(self) -> float | None:
        """Seconds since the last progress when past the limit, else None (also while unarmed)."""
        if not self.enabled or self._last is None:
            return None
        idle = self.clock() - self._last
        return idle if idle > self.limit() else None

    def message(self, idle: float) -> str:
        """The line written when the watchdog fires."""
        med = statistics.median(self.step_times) if self.step_times else float("nan")
        return (f"jaxcolossal hang watchdog: process {self.process_index}: no step finished for {idle:.1f} s "
                f"(limit {self.limit():.1f} s = max(fault_tolerance.hang_timeout_s={self.timeout_s:g}, "
                f"hang_factor={self.factor:g} x median step time {med:.3f} s)); last step finished: "
                f"{self.last_step}; last known phase: {self.where}. {self.blame()} Python stacks of every thread "
                f"follow; exiting with code {HANG_EXIT_CODE}.")

    def blame(self) -> str:
        """Which process the heartbeats blame, in a sentence (:func:`suspect`); the guess without them."""
        guess = "A collective is probably waiting for a process that is stopped, hung or gone."
        if not self.heartbeat.enabled:
            return guess
        beats = self.heartbeat.peers()
        found = suspect(beats, self.heartbeat.clock())
        if found is None:
            return (f"{guess} The heartbeats of processes {sorted(beats)} in {self.heartbeat.folder} do not "
                    f"say which.")
        r, why = found
        who = "This process" if r == self.process_index else f"Process {r}"
        return f"{who} is the one that stopped: {why}."

    def check(self) -> bool:
        """Fire when overdue (what the thread does each poll); returns whether it fired."""
        idle = self.overdue()
        if idle is None or self.fired:
            return False
        self.fired = msg = self.message(idle)
        if self.on_fire is not None:
            self.on_fire(msg)
            return True
        _dump_and_exit(msg)
        return True  # pragma: no cover - _dump_and_exit does not return

    def _run(self) -> None:
        self.heartbeat.beat(self.poll_s, self.where)
        while not self._stop.wait(self.poll_s):
            self.heartbeat.beat(self.poll_s, self.where)
            if self.check():
                return


def _dump_and_exit(message: str) -> None:
    """``message`` and every thread's stack on stderr, then ``os._exit(HANG_EXIT_CODE)``."""
    try:
        sys.stderr.write("\n" + message + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    finally:
        os._exit(HANG_EXIT_CODE)
