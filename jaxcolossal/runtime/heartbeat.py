"""Each process's heartbeat: the step it restored, its last finished step and a sign of life, in a file
that the launcher and the other processes read (issue 54).

Two uses:

* **Blame the rank that stopped.** When a process is stopped (``SIGSTOP``), hung inside a collective
  while holding the interpreter, or stuck before its next step, every other process waits in a
  collective for it, and the first hang watchdog to fire is a healthy one. The heartbeats say which
  process it was (:func:`suspect`): the one whose watchdog thread stopped writing (a stale heartbeat),
  else the one whose last step is behind the others'. The hang watchdog names it in its line
  (:mod:`jaxcolossal.runtime.watchdog`), and ``python -m jaxcolossal.run`` blames it in its restart
  line and, with ``--nproc MIN:MAX``, drops its slot.
* **One "steps lost".** Process 0's heartbeat holds, per start, the step it restored and the last step
  it finished: the launcher's figure comes from them, through
  :func:`jaxcolossal.runtime.faults.steps_lost`, the same function goodput uses on the same two
  numbers (both written by :class:`jaxcolossal.runtime.goodput.GoodputRecorder`).

The file is ``<folder>/rank<r>.heartbeat``, one JSON object replaced whole (written aside, then
renamed): ``rank``, ``world``, ``attempt`` (the restart count), ``pid``, ``resumed_from`` (the step
restored, 0 for a fresh start; ``None`` until then), ``step`` (the last step finished, the restored one
before the first), ``time`` (its last write, seconds since the epoch), ``progress_time`` (when ``step``
last changed), ``poll_s`` (the watchdog thread's interval while it beats; ``None`` while no thread
beats: the start-up, the end-of-run phases, a disabled watchdog) and ``where`` (the phase).

The folder is ``$JAXCOLOSSAL_HEARTBEAT_DIR`` (:data:`HEARTBEAT_DIR_ENV`); ``python -m jaxcolossal.run``
sets it to its log folder. Unset: no file is written (every method is a no-op). Under another
launcher, set it to a folder every process of a node can write; the processes of other nodes are
then not seen (their clocks would not compare anyway).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping

HEARTBEAT_DIR_ENV = "JAXCOLOSSAL_HEARTBEAT_DIR"
"""The folder of the heartbeat files; set by ``python -m jaxcolossal.run`` to its ``--log-dir``."""

STALE_POLLS = 4
"""A running process whose watchdog thread has not written its heartbeat for this many of its poll
intervals is taken as stopped. The hang limit is at least 10 poll intervals (the watchdog polls at
``min(1 s, hang_timeout_s / 10)``), so a process stopped when its peers' watchdogs fire is stale by
then, with room for a busy machine's scheduling delays."""


def heartbeat_path(folder: str, rank: int) -> str:
    """``<folder>/rank<rank>.heartbeat``."""
    return os.path.join(folder, f"rank{rank}.heartbeat")


def read_heartbeat(path: str) -> dict | None:
    """The record in ``path``, or ``None`` when it is missing or unreadable."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


class Heartbeat:
    """This process's heartbeat file (the module's doc); a no-op without a folder.

    Args:
        folder: where ``rank<rank>.heartbeat`` goes, or ``None`` (off).
        rank: this process's index.
        world: the process count.
        attempt: the restart count (:func:`jaxcolossal.runtime.faults.restart_count`).
        clock: seconds since the epoch (tests pass a fake one).
    """

    def __init__(self, folder: str | None, rank: int = 0, world: int = 1, attempt: int = 0, *,
                 clock: Callable[[], float] = time.time):
        self.folder, self.clock = folder or None, clock
        self.rec = {"rank": rank, "world": world, "attempt": attempt, "pid": os.getpid(), "resumed_from": None,
                    "step": None, "time": None, "progress_time": None, "poll_s": None, "where": "start-up"}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int, world: int, attempt: int) -> "Heartbeat":
        """The heartbeat in ``$JAXCOLOSSAL_HEARTBEAT_DIR`` of ``env`` (off when unset or empty)."""
        return cls(env.get(HEARTBEAT_DIR_ENV, "").strip() or None, rank, world, attempt)

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def _write(self, **fields) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.rec.update(fields, time=self.clock())
            path = heartbeat_path(self.folder, self.rec["rank"])
            tmp = f"{path}.{threading.get_ident()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(self.rec, f)
                os.replace(tmp, path)
            except OSError:  # a full or vanished folder must not end the run: blame is best effort
                pass

    def resumed(self, step: int) -> None:
        """The start restored ``step`` (0: fresh)."""
        self._write(resumed_from=int(step), step=int(step), progress_time=self.clock(), where=f"restored step {step}")

    def step_done(self, step: int) -> None:
        """Training step ``step`` finished."""
        self._write(step=int(step), progress_time=self.clock(), where=f"after step {step}")

    def beat(self, poll_s: float, where: str) -> None:
        """A sign of life from the watchdog thread, which looks every ``poll_s`` seconds."""
        self._write(poll_s=float(poll_s), where=where)

    def quiet(self) -> None:
        """No thread beats any more (the end-of-run phases): the heartbeat's age means nothing now."""
        self._write(poll_s=None, where="past the training loop")

    def peers(self) -> dict[int, dict]:
        """Every process's record of this start (the same ``world`` and ``attempt``), by rank."""
        if not self.enabled:
            return {}
        out = {}
        for r in range(self.rec["world"]):
            rec = read_heartbeat(heartbeat_path(self.folder, r))
            if rec and rec.get("world") == self.rec["world"] and rec.get("attempt") == self.rec["attempt"]:
                out[r] = rec
        return out


def _age(rec: dict, now: float) -> float:
    return now - (rec.get("time") or now)


def suspect(beats: Mapping[int, dict], now: float, alive: Callable[[int], bool] = lambda r: True
            ) -> tuple[int, str] | None:
    """The rank that stopped, from every rank's heartbeat, with why in words; ``None`` when they do not say.

    1. A stale heartbeat: a rank ``alive(rank)`` whose watchdog thread beats (``poll_s`` set) and has not
       written for more than :data:`STALE_POLLS` poll intervals (the stalest, when several).
    2. Else a rank whose last finished step is behind the others' (the one behind the longest, when
       several).

    Args:
        beats: rank -> its record (:meth:`Heartbeat.peers`).
        now: seconds since the epoch.
        alive: whether a rank's process still runs (the launcher knows; one that exited stops beating).
    """
    stale = [r for r, b in beats.items() if b.get("poll_s") and alive(r)
             and _age(b, now) > STALE_POLLS * b["poll_s"]]
    if stale and len(stale) < len(beats):
        r = max(stale, key=lambda r: (_age(beats[r], now), -r))
        b = beats[r]
        return r, (f"no heartbeat for {_age(b, now):.1f} s (its watchdog thread beats every {b['poll_s']:g} s: "
                   f"stopped, or stuck holding the interpreter); last step {b.get('step')} (last known phase: "
                   f"{b.get('where')})")
    steps = {r: b["step"] for r, b in beats.items() if b.get("step") is not None}
    if len(set(steps.values())) > 1:
        low = min(steps.values())
        r = min((r for r, s in steps.items() if s == low), key=lambda r: (beats[r].get("progress_time") or now, r))
        return r, (f"its last step {low} is behind the others' {max(steps.values())} "
                   f"(last known phase: {beats[r].get('where')})")
    return None
