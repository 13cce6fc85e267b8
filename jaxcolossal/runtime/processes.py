"""The local launcher's processes (:mod:`jaxcolossal.runtime.run`): one start of the group, each
process in its own session with its output to ``<log-dir>/rank<r>.log`` (rank 0's streamed to this
terminal too, without Gloo's connection lines), supervised until all have ended; the first to fail
named (or, after a hang, the one the heartbeats blame), the others stopped with SIGTERM then SIGKILL
(:func:`run_processes`, :func:`attempt`). The restarts around it and the command line are
:mod:`jaxcolossal.runtime.run`'s."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Mapping, Sequence

from jaxcolossal.runtime.faults import CONFIG_ERROR_EXIT_CODE, HANG_EXIT_CODE, NO_PROGRESS_EXIT_CODE, describe_exit
from jaxcolossal.runtime.heartbeat import heartbeat_path, read_heartbeat, suspect

DEFAULT_TIMEOUT = 300
"""Seconds the other processes have to follow one that ended with 0 (``--timeout``'s default)."""
PREFIX = "jaxcolossal.run"
"""The launcher's name at the start of its own lines on stderr."""


@dataclass
class _Proc:
    rank: int
    popen: subprocess.Popen
    log_path: str
    started: float
    threads: list = field(default_factory=list)
    log_file: IO | None = None
    slot: int | None = None
    ended: float | None = None
    """When it ended (``time.monotonic()``, set by its waiter thread right after ``waitpid``): which
    process failed first, also when the others fail a few milliseconds later (a peer gone)."""


def _watch(p: _Proc) -> None:
    """Start ``p``'s waiter thread: it reaps the process as soon as it ends and records when."""
    def wait() -> None:
        p.popen.wait()
        p.ended = time.monotonic()
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    p.threads.append(t)


@dataclass
class Outcome:
    """How one start of the group ended: the launcher's status and, for a failed process, which."""

    status: int
    failed: _Proc | None = None
    restartable: bool = False
    blamed: _Proc | None = None
    """The process the heartbeats blame when the first to fail was a watchdog waiting for it (a hang)."""
    why: str = ""
    """Why the heartbeats blame it, in words."""
    rank0: dict | None = None
    """Rank 0's last heartbeat of this start (the step it restored, its last step), when it wrote one."""

    @property
    def culprit(self) -> _Proc | None:
        """The process the start is blamed on: the one the heartbeats name, else the first to fail."""
        return self.blamed or self.failed

    def what(self) -> str:
        """What the culprit did: ``killed by SIGKILL after 41.3 s``, or for a blamed process ``stopped: no
        heartbeat for 4.5 s ...; rank 1 hung (exit 75) after 20.1 s waiting for it``."""
        first = self.failed
        ended = f"{describe_exit(first.popen.returncode)} after {uptime(first):.1f} s"
        if self.blamed is None:
            return ended
        if self.blamed is first:
            return f"{ended} ({self.why})"
        return f"stopped: {self.why}; rank {first.rank} {ended} waiting for it"

    def cause(self) -> str:
        """``rank 2 (slot 2) `` and :meth:`what`."""
        return f"rank {self.culprit.rank} (slot {self.culprit.slot}) {self.what()}"


_QUIET = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks "
                    rb"is : \d+\n")
"""Messages kept out of the terminal (they stay in the rank's log): Gloo prints one per process and
communicator from C++, several per run, unsynchronised with the program's own output (so one can
land in the middle of a line of it)."""


def _pump(src: IO[bytes], dests: Sequence[IO[bytes]], terminal: IO[bytes] | None = None) -> None:
    """Copy ``src`` to every stream in ``dests`` as data arrives (keeps ``\\r`` progress bars), and to
    ``terminal`` by whole lines, without Gloo's connection messages (:data:`_QUIET`), also where one
    landed in the middle of a line; ``\\r`` updates still pass as they come."""
    pending = b""

    def write(d: IO[bytes], data: bytes) -> None:
        try:
            d.write(data)
            d.flush()
        except (OSError, ValueError):
            pass

    def to_terminal(data: bytes) -> bytes:
        *lines, rest = _QUIET.sub(b"", data).split(b"\n")
        if lines:
            write(terminal, b"".join(line + b"\n" for line in lines))
        if b"\r" in rest:  # a progress bar's update: show it, keep its last segment for the line's end
            head, _, rest = rest.rpartition(b"\r")
            write(terminal, head + b"\r")
        return rest

    try:
        while True:
            chunk = src.read1(65536) if hasattr(src, "read1") else src.read(65536)
            if not chunk:
                break
            for d in dests:
                write(d, chunk)
            if terminal is not None:
                pending = to_terminal(pending + chunk)
    finally:
        if terminal is not None and pending:
            write(terminal, pending)
        src.close()


def _signal_group(p: _Proc, sig: int) -> None:
    if p.popen.poll() is not None:
        return
    try:
        os.killpg(p.popen.pid, sig)  # its own session: the whole process group
    except (ProcessLookupError, PermissionError):
        try:
            p.popen.send_signal(sig)
        except ProcessLookupError:
            pass


def _stop_all(procs: Sequence[_Proc], grace: float) -> None:
    """SIGTERM every running process, SIGKILL what is left after ``grace`` seconds, reap all."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.popen.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.popen.wait()


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            data = collections.deque(f, maxlen=lines)
    except OSError:
        return ""
    return b"".join(data).decode("utf-8", "replace").rstrip()


def _exit_status(code: int) -> int:
    """Shell-style status: a process killed by signal N gives 128 + N."""
    return 128 - code if code < 0 else code


def say(msg: str) -> None:
    sys.stderr.write(f"[{PREFIX}] {msg}\n")
    sys.stderr.flush()


def run_processes(
    cmd: Sequence[str],
    envs: Sequence[Mapping[str, str]],
    ranks: Sequence[int],
    log_dir: str,
    *,
    stream_rank: int | None = 0,
    exit_timeout: float = DEFAULT_TIMEOUT,
    kill_grace: float = 5.0,
    poll: float = 0.1,
) -> int:
    """Start ``cmd`` once per environment and supervise the processes until all have ended.

    Args:
      cmd: the command (argv) every process runs.
      envs: one environment per process.
      ranks: the global rank of each process (names the log files ``rank<r>.log`` and the pid files
        ``rank<r>.pid``).
      log_dir: folder of the log files (created).
      stream_rank: the rank whose output is also streamed to this process's stdout/stderr.
      exit_timeout: after a process ends with 0, seconds the others have to end too.
      kill_grace: seconds between SIGTERM and SIGKILL when stopping processes.

    Returns:
      0 when every process ended with 0; else the status of the first process that failed
      (128 + N for signal N), or 1 when the others did not follow a clean exit in time.
    """
    return attempt(cmd, envs, ranks, log_dir, stream_rank=stream_rank, exit_timeout=exit_timeout,
                    kill_grace=kill_grace, poll=poll).status


def attempt(cmd: Sequence[str], envs: Sequence[Mapping[str, str]], ranks: Sequence[int], log_dir: str, *,
             stream_rank: int | None, exit_timeout: float, kill_grace: float, poll: float = 0.1,
             slots: Sequence[int] | None = None, header: str | None = None, append: bool = False) -> Outcome:
    """One start of the group (:func:`run_processes`), with, for restarts, each process's ``slot``, a
    ``header`` line (``{rank}`` and ``{slot}`` filled in) at the top of its part of the log, and the
    logs appended to instead of truncated."""
    os.makedirs(log_dir, exist_ok=True)
    _clear_heartbeats(log_dir)
    procs: list[_Proc] = []
    slots = list(slots) if slots is not None else [None] * len(ranks)
    with _caught_signals() as stop_signal:
        try:
            for rank, env, slot in zip(ranks, envs, slots):
                head = header.format(rank=rank, slot=slot) if header else None
                procs.append(_start(cmd, env, rank, os.path.join(log_dir, f"rank{rank}.log"), rank == stream_rank,
                                    slot=slot, header=head, append=append))
            first_clean_exit: list[float] = []
            while True:
                outcome = _check(procs, stop_signal, stream_rank, exit_timeout, kill_grace, first_clean_exit)
                if outcome is not None:
                    outcome.rank0 = read_heartbeat(heartbeat_path(log_dir, 0)) if 0 in ranks else None
                    return outcome
                time.sleep(poll)
        finally:
            _clean_up(procs)


def _clear_heartbeats(log_dir: str) -> None:
    """Remove the heartbeat files of an earlier start (``rank<r>.heartbeat``, :mod:`jaxcolossal.runtime.heartbeat`):
    what the folder holds afterwards is this start's."""
    for name in os.listdir(log_dir):
        if re.fullmatch(r"rank\d+\.heartbeat(\.\d+\.tmp)?", name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(log_dir, name))


def _blame(procs: Sequence[_Proc], first: _Proc) -> tuple[_Proc | None, str]:
    """When the first process to fail is a watchdog's (the hang watchdog's 75, the no-progress one's 124: it
    waited for a peer), the process every rank's heartbeat blames (:func:`suspect`: a running process
    whose heartbeat went stale, else the one whose last step is behind) and why; else ``(None, "")``."""
    if first.popen.returncode not in (HANG_EXIT_CODE, NO_PROGRESS_EXIT_CODE):
        return None, ""
    by_rank = {p.rank: p for p in procs}
    beats = {p.rank: rec for p in procs
             if (rec := read_heartbeat(heartbeat_path(os.path.dirname(p.log_path), p.rank))) is not None}
    found = suspect(beats, time.time(), alive=lambda r: by_rank[r].ended is None)
    return (None, "") if found is None else (by_rank[found[0]], found[1])


@contextlib.contextmanager
def _caught_signals():
    """SIGINT and SIGTERM recorded (in the list yielded) instead of acted on, in the main thread."""
    caught: list[int] = []
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda signum, _frame: caught.append(signum))
    try:
        yield caught
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _write_pid(log_path: str, pid: int) -> None:
    """``rank<r>.pid`` beside ``rank<r>.log``: the process's pid, written whole (renamed into place)."""
    path = log_path[: -len(".log")] + ".pid"
    with open(path + ".tmp", "w") as f:
        f.write(f"{pid}\n")
    os.replace(path + ".tmp", path)


def _start(cmd: Sequence[str], env: Mapping[str, str], rank: int, path: str, stream: bool, *,
           slot: int | None = None, header: str | None = None, append: bool = False) -> _Proc:
    """One process, its output to ``path`` (and, when ``stream``, to this process's stdout/stderr too),
    its pid to ``rank<r>.pid``; ``header`` first in the log, which ``append`` keeps instead of truncating."""
    log_file = open(path, "ab" if append else "wb")
    if header:
        log_file.write(header.encode() + b"\n")
        log_file.flush()
    if not stream:
        popen = subprocess.Popen(list(cmd), env=dict(env), stdout=log_file, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        _write_pid(path, popen.pid)
        p = _Proc(rank, popen, path, time.monotonic(), log_file=log_file, slot=slot)
        _watch(p)
        return p
    popen = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    _write_pid(path, popen.pid)
    p = _Proc(rank, popen, path, time.monotonic(), log_file=log_file, slot=slot)
    _watch(p)
    out, err = getattr(sys.stdout, "buffer", None), getattr(sys.stderr, "buffer", None)
    for src, dst in ((popen.stdout, out), (popen.stderr, err)):
        t = threading.Thread(target=_pump, args=(src, [log_file], dst), daemon=True)
        t.start()
        p.threads.append(t)
    return p


def _check(procs: list[_Proc], stop_signal: list[int], stream_rank: int | None, exit_timeout: float,
           kill_grace: float, first_clean_exit: list[float]) -> Outcome | None:
    """One look at the processes: how the group ended once it is over (a signal, a failure, all
    done, or the rest not following a clean exit in time), else ``None``."""
    running = [p for p in procs if p.ended is None]
    failed = [p for p in procs if p.ended is not None and p.popen.returncode != 0]
    if stop_signal:
        say(f"received signal {stop_signal[0]}; stopping {len(running)} process(es)")
        _stop_all(procs, kill_grace)
        return Outcome(128 + stop_signal[0])
    if failed:
        first = min(failed, key=lambda p: (p.ended, p.rank))  # the others may only be reacting to it
        blamed, why = _blame(procs, first)  # before the others are stopped: their heartbeats still beat
        code = first.popen.returncode
        what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        culprit = "" if blamed is None else \
            f"; the heartbeats blame rank {blamed.rank}{'' if blamed.slot is None else f' (slot {blamed.slot})'}: {why}"
        say(f"rank {first.rank} {what} after {uptime(first):.1f} s{culprit}; "
             f"stopping the other {len(running)} process(es)")
        _stop_all(procs, kill_grace)
        if first.rank != stream_rank:
            tail = _tail(first.log_path)
            say(f"last lines of {first.log_path}:\n{tail}" if tail else f"log: {first.log_path}")
        return Outcome(_exit_status(code), first, restartable=code != CONFIG_ERROR_EXIT_CODE, blamed=blamed,
                        why=why)
    if not running:
        return Outcome(0)
    if len(running) < len(procs):  # some ended with 0, the rest still runs
        first_clean_exit[:] = first_clean_exit or [time.monotonic()]
        if time.monotonic() - first_clean_exit[0] > exit_timeout + kill_grace:
            say(f"rank(s) {', '.join(str(p.rank) for p in running)} still running {exit_timeout + kill_grace:.0f} s "
                 "after another rank finished; stopping them (a collective mismatch or a hang?)")
            _stop_all(procs, kill_grace)
            return Outcome(1)
    return None


def uptime(p: _Proc) -> float:
    """Seconds ``p`` ran: until it was seen ended, else until now."""
    return (p.ended if p.ended is not None else time.monotonic()) - p.started


def _clean_up(procs: list[_Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            _stop_all([p], 0)
        for t in p.threads:
            t.join(timeout=5)
        if p.log_file:
            p.log_file.close()
