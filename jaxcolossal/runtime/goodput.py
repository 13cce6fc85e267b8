"""Goodput: a job's wall time split by cause, across the attempts of a restarted job (issue 44).

The categories follow MaxText's goodput library (``ml-goodput-measurement``: productive time, and
badput from TPU/program start-up, compilation, data loading, checkpoint save/restore, job restart
and wasted progress), on one timeline per attempt:

``initialization``  process start → the checkpoint folder and state (imports, mesh, data, init)
``compilation``     compiling the train step
``checkpoint_load`` restoring the state (persistent or emergency checkpoint)
``productive``      training steps kept by the job
``data_waiting``    the host building the next batch
``checkpoint_save`` persistent and emergency saves (the blocking part)
``evaluation``      validation passes
``other``           the rest of the attempt (logging, the end-of-run phases)
``restart``         between attempts: from the last record of a failed attempt to the start of
                    the next process (failure detection, teardown, relaunch), and the starts that
                    ended before their record began (see below)
``wasted``          the steps lost (:func:`jaxcolossal.runtime.faults.steps_lost`: steps done since
                    the checkpoint the next start restored, computed again), at the mean step time
                    of the attempt that did them

Every second of an attempt is in exactly one category (:class:`GoodputRecorder` switches between
them), so the categories add up to the job's wall time (first process start → last record); the
summary reports the difference as ``unaccounted_s``. Process 0 appends records to
``<run_dir>/goodput.jsonl``; a restarted attempt (:func:`jaxcolossal.runtime.faults.restart_count`
> 0) appends to the same file; an attempt numbered 0, or not above the one before, or of another
``$JAXCOLOSSAL_JOB_START``, starts a new job in it.

**Every start counts.** A start can end before its recorder begins (a process that fails while
importing, a slot that cannot start): it writes nothing. Attempts are numbered by the restart count,
so the summary counts ``starts`` as the last attempt's number + 1, and, where ``python -m
jaxcolossal.run`` gave the job's start (:data:`jaxcolossal.runtime.faults.JOB_START_ENV`), the wall
time runs from it: the time of the starts before the first record is ``restart``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator

from jaxcolossal.runtime.faults import steps_lost
from jaxcolossal.runtime.heartbeat import Heartbeat

CATEGORIES = ("initialization", "compilation", "checkpoint_load", "productive", "data_waiting", "checkpoint_save",
              "evaluation", "other")
"""The categories of one attempt's timeline."""
JOB_CATEGORIES = CATEGORIES + ("restart", "wasted")
"""The categories of a job's summary: an attempt's, plus the time between attempts and the steps recomputed."""


def process_start_time() -> float:
    """This process's start, in seconds since the epoch: the time now less the seconds since the
    start (Linux: ``/proc/uptime`` less ``/proc/self/stat``'s start time, both 10 ms ticks since boot;
    ``/proc/stat``'s whole-second ``btime`` would put a restarted attempt's start up to 1 s before the
    failed one's end); the time now where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class GoodputRecorder:
    """One attempt's timeline: the current category, and seconds per category so far.

    Args:
        path: the job's ``goodput.jsonl`` (appended to), or None: record in memory only (the
            processes other than 0).
        attempt: the restart number (0: the first attempt; another job starts at each 0).
        start: the attempt's start (seconds since the epoch), default :func:`process_start_time`.
        clock: seconds since the epoch (tests pass a fake one).
        heartbeat: this process's heartbeat, told the step restored and each step finished along with
            the records (so the launcher's steps lost and goodput's come from the same two numbers).
        job_start: the job's start (``$JAXCOLOSSAL_JOB_START``, seconds since the epoch), when known.
    """

    def __init__(self, path: str | None, attempt: int = 0, *, start: float | None = None,
                 clock: Callable[[], float] = time.time, heartbeat: Heartbeat | None = None,
                 job_start: float | None = None):
        self.path, self.attempt, self.clock = path, attempt, clock
        self.heartbeat = heartbeat if heartbeat is not None else Heartbeat(None)
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.current, self.t = "initialization", process_start_time() if start is None else start
        self.start, self.step, self.steps_run = self.t, 0, 0
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a")
        self._write({"event": "attempt_start", "attempt": attempt, "time": self.start, "pid": os.getpid(),
                     "job_start": job_start})

    def _write(self, rec: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def enter(self, category: str) -> str:
        """Switch to ``category`` (one of :data:`CATEGORIES`); returns the one left.

        Raises:
            ValueError: an unknown category.
        """
        if category not in self.totals:
            raise ValueError(f"goodput category {category!r} is not one of {', '.join(CATEGORIES)}")
        now = self.clock()
        self.totals[self.current] += now - self.t
        left, self.current, self.t = self.current, category, now
        return left

    @contextlib.contextmanager
    def phase(self, category: str) -> Iterator[None]:
        """``category`` for the block, then back to the one before."""
        left = self.enter(category)
        try:
            yield
        finally:
            self.enter(left)

    def snapshot(self, event: str = "progress", **extra) -> dict:
        """The totals up to now, as written to the file: ``event``, ``attempt``, ``time``, ``step``,
        ``steps_run``, ``totals`` (seconds per category) and ``extra``."""
        self.enter(self.current)
        rec = {"event": event, "attempt": self.attempt, "time": self.t, "step": self.step,
               "steps_run": self.steps_run, "totals": dict(self.totals), **extra}
        self._write(rec)
        return rec

    def resumed(self, step: int, source: str) -> None:
        """The attempt starts from ``step`` (0: fresh), restored from ``source`` (``"persistent"``,
        ``"local"``, ``"none"``)."""
        self.step = step
        self.snapshot("resumed", resumed_from=step, source=source)
        self.heartbeat.resumed(step)

    def step_done(self, step: int) -> None:
        """Training step ``step`` finished (its time is ``productive``); one record per step."""
        self.step, self.steps_run = step, self.steps_run + 1
        self.snapshot()
        self.heartbeat.step_done(step)

    def finish(self) -> dict:
        """The attempt's last record (``attempt_end``); closes the file."""
        rec = self.snapshot("attempt_end")
        if self._file is not None:
            self._file.close()
            self._file = None
        return rec


def read_records(path: str) -> list[dict]:
    """The records of ``path`` (a ``goodput.jsonl``); a last line cut by a killed process is ignored."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _new_job(rec: dict, prev: dict | None) -> bool:
    """Whether the ``attempt_start`` record ``rec`` begins a new job after ``prev`` (the one before)."""
    if prev is None or rec.get("attempt") == 0 or rec.get("attempt", 0) <= prev.get("attempt", 0):
        return True
    a, b = rec.get("job_start"), prev.get("job_start")
    return a is not None and b is not None and a != b


def _attempts(records: list[dict]) -> list[dict]:
    """The attempts of the file's last job (:func:`_new_job`): number, start, end (its last record's
    time), totals, the step it resumed from and how (``None`` until it restored), its last step (the
    restored one before its first), steps run, and the job's start when known."""
    begins = [i for i, r in enumerate(records) if r.get("event") == "attempt_start"]
    first = next((i for j, i in reversed(list(enumerate(begins)))
                  if _new_job(records[i], records[begins[j - 1]] if j else None)), 0)
    out: list[dict] = []
    for r in records[first:]:
        if r.get("event") == "attempt_start":
            out.append({"attempt": r["attempt"], "start": r["time"], "end": r["time"], "step": None, "steps_run": 0,
                        "totals": dict.fromkeys(CATEGORIES, 0.0), "resumed_from": None, "source": "none",
                        "finished": False, "job_start": r.get("job_start")})
        elif out:
            a = out[-1]
            a.update(end=r["time"], step=r.get("step", a["step"]), steps_run=r.get("steps_run", a["steps_run"]),
                     totals=r.get("totals", a["totals"]), finished=r.get("event") == "attempt_end")
            if r.get("event") == "resumed":
                a.update(resumed_from=r["resumed_from"], source=r["source"])
    return out


def _lost(attempts: list[dict]) -> dict[int, int | None]:
    """Attempt number -> its steps lost (:func:`steps_lost` over every start of the job, a start without
    a record counted as one that did not restore)."""
    by_number = {a["attempt"]: a for a in attempts}
    starts = [(by_number[n]["resumed_from"], by_number[n]["step"] if by_number[n]["resumed_from"] is not None
               else None) if n in by_number else (None, None) for n in range(attempts[-1]["attempt"] + 1)]
    return dict(enumerate(steps_lost(starts)))


def summarize(records: list[dict]) -> dict:
    """The job's goodput from its records (:func:`read_records`).

    Returns a dict: ``wall_s``; ``seconds`` (per :data:`JOB_CATEGORIES`); ``goodput`` (productive /
    wall, in [0, 1]); ``accounted`` (sum of the categories / wall); ``unaccounted_s``; ``restarts``: one
    ``{"attempt", "resumed_from", "source", "steps_lost", "lost_s", "gap_s"}`` per recorded attempt after
    the first (``steps_lost`` :func:`steps_lost`'s, None where it did not restore); ``steps_lost`` (their
    sum); ``attempts`` (recorded) and ``starts`` (every start: the last attempt's number + 1).
    ``{}`` when there is no attempt.
    """
    attempts = _attempts(records)
    if not attempts:
        return {}
    seconds = dict.fromkeys(JOB_CATEGORIES, 0.0)
    for a in attempts:
        for k, v in a["totals"].items():
            seconds[k] += v
    lost, restarts, did = _lost(attempts), [], None
    for prev, a in zip(attempts, attempts[1:]):
        did = prev if prev["resumed_from"] is not None else did  # the newest attempt whose steps can be lost
        n = lost[a["attempt"]]
        lost_s = 0.0 if not n or did is None else \
            min(n, did["steps_run"]) * did["totals"]["productive"] / max(did["steps_run"], 1)
        gap = a["start"] - prev["end"]
        seconds["restart"] += gap
        seconds["wasted"] += lost_s
        seconds["productive"] -= lost_s
        restarts.append({"attempt": a["attempt"], "resumed_from": a["resumed_from"], "source": a["source"],
                         "steps_lost": n, "lost_s": lost_s, "gap_s": gap})
    begin, js = attempts[0]["start"], attempts[0]["job_start"]
    if attempts[0]["attempt"] > 0 and js is not None and js < begin:  # starts before the first record
        seconds["restart"] += begin - js
        begin = js
    wall = attempts[-1]["end"] - begin
    total = sum(seconds.values())
    return {"wall_s": wall, "seconds": seconds, "goodput": seconds["productive"] / wall if wall > 0 else 0.0,
            "accounted": total / wall if wall > 0 else 1.0, "unaccounted_s": wall - total, "restarts": restarts,
            "steps_lost": sum(n or 0 for n in lost.values()), "attempts": len(attempts),
            "starts": attempts[-1]["attempt"] + 1}


def summary_lines(s: dict) -> list[str]:
    """The end-of-run report of :func:`summarize`'s dict: the goodput line, then one line per restart
    (``restart 1: resumed from step 10 (local), 2 steps lost (0.8 s), 6.1 s between attempts``)."""
    if not s:
        return []
    wall, sec = s["wall_s"], s["seconds"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s ({v / wall:.1%})" for k, v in sec.items() if wall > 0)
    silent = s["starts"] - s["attempts"]
    unrecorded = (f" ({silent} of them ended before their goodput record began; their time is in restart)"
                  if silent else "")
    lines = [f"goodput {s['goodput']:.1%} of {wall:.1f} s wall over {s['starts']} start(s){unrecorded}: {parts}; "
             f"the categories add up to {s['accounted']:.2%} of the wall time"]
    for r in s["restarts"]:
        if r["steps_lost"] is None:
            lines.append(f"restart {r['attempt']}: ended before it restored a step, {r['gap_s']:.1f} s between attempts")
            continue
        lines.append(f"restart {r['attempt']}: resumed from step {r['resumed_from']} ({r['source']}), "
                     f"{r['steps_lost']} step{'' if r['steps_lost'] == 1 else 's'} lost ({r['lost_s']:.1f} s), "
                     f"{r['gap_s']:.1f} s between attempts")
    return lines


def stragglers(times: list[float], factor: float, floor_s: float = 0.0) -> list[int]:
    """The ranks whose time (``times[rank]``, seconds, e.g. a step's) exceeds ``factor`` × the
    median of the other ranks' times, and that median by more than ``floor_s`` seconds (none with
    fewer than 2 ranks)."""
    out = []
    for r, t in enumerate(times):
        others = times[:r] + times[r + 1:]
        if others and t > 0:
            med = statistics.median(others)
            if t > factor * med and t - med > floor_s:
                out.append(r)
    return out


class StragglerTracker:
    """Which ranks to warn about, from the per-rank times gathered at each logged step (a "check").

    A rank is flagged at a check when its time is above ``factor`` × the other ranks' median **and**
    above that median by more than the floor, ``max(min_share × the step time, min_s)`` (so a 1 ms
    difference in data loading on a 600 ms step is not a straggler); it is warned about when it was
    flagged at ``checks`` consecutive checks, once per such run of checks (flagged again after a check
    where it was not: warned again after ``checks`` more).

    Args:
        factor: ``fault_tolerance.straggler_factor``, >= 1.
        min_share: ``fault_tolerance.straggler_min_share``, the floor's share of the step time, in [0, 1].
        min_s: ``fault_tolerance.straggler_min_s``, the floor in seconds, >= 0.
        checks: ``fault_tolerance.straggler_checks``, consecutive checks before a warning, >= 1.
    """

    def __init__(self, factor: float = 1.5, min_share: float = 0.05, min_s: float = 0.01, checks: int = 3):
        self.factor, self.min_share, self.min_s, self.checks = float(factor), float(min_share), float(min_s), int(checks)
        self.streak: dict[tuple[str, int], int] = {}

    def floor(self, step_s: float) -> float:
        """Seconds a rank must be above the others' median by: ``max(min_share × step_s, min_s)``."""
        return max(self.min_share * max(step_s, 0.0), self.min_s)

    def update(self, what: str, times: list[float], step_s: float) -> list[int]:
        """One check of ``what`` (``"step time"``, ``"data-loading time"``): ``times[rank]`` in seconds,
        ``step_s`` the job's step time in seconds. Returns the ranks to warn about now."""
        flagged = set(stragglers(times, self.factor, self.floor(step_s)))
        warn = []
        for r in range(len(times)):
            n = self.streak.get((what, r), 0) + 1 if r in flagged else 0
            self.streak[(what, r)] = n
            if n == self.checks:
                warn.append(r)
        return warn
