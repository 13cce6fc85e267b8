"""Local launcher, in the style of ``torchrun`` and ``colossalai run``.

    python -m jaxcolossal.run --nproc 4 scripts/train.py parallel.zero_stage=3
    python -m jaxcolossal.run --nproc 2 --devices-per-proc 4 --timeout 60 scripts/train.py ...
    python -m jaxcolossal.run --nproc 8 --platform gpu scripts/train.py ...        # one process per GPU

It starts ``--nproc`` copies of the program on this machine. Each gets the environment that
:func:`jaxcolossal.launch_from_env` reads -- ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` (default ``127.0.0.1``) and ``MASTER_PORT`` (default: a free port) -- plus
``LOCAL_WORLD_SIZE``, ``NODE_RANK`` and ``PYTHONUNBUFFERED=1``. ``--nnodes``/``--node-rank``
run the same command on several machines, as torchrun does (``RANK = node_rank * nproc +
local_rank``; give every node the same ``--master-addr``/``--master-port``).

Platform (``--platform``, default ``auto``: ``gpu`` when ``/dev/nvidia0`` exists, else ``cpu``):

* ``cpu``: each process gets its own ``--devices-per-proc`` simulated host devices (default
  ``8 / nproc``) through ``XLA_FLAGS=--xla_force_host_platform_device_count=K`` (other flags
  are kept) and ``JAX_PLATFORMS=cpu``; ``launch_from_env`` selects gloo for the collectives.
* ``gpu``: nothing is added; ``launch_from_env`` gives process ``LOCAL_RANK`` the GPU of the
  same index (one process per GPU).

Output: rank 0's stdout and stderr are streamed to this terminal line by line and copied to
``<log-dir>/rank0.log``; every other rank writes to ``<log-dir>/rank<r>.log``. Gloo's
"connected to N peer ranks" lines go to the logs only. ``--log-dir``
defaults to a new temporary folder, printed at start.

Failure handling: when a process exits with a non-zero status, the others get SIGTERM and,
``--kill-grace`` seconds later, SIGKILL; the launcher prints which rank failed (with the end of
its log) and exits with that status. When a process exits with 0, the others must follow
within ``--timeout`` + ``--kill-grace`` seconds (a correct JAX job ends together: its shutdown
barrier waits for every process) or they are stopped the same way and the launcher exits with
status 1. ``--timeout`` (default ``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT`` or 300 s) is also passed to
the processes as ``JAXCOLOSSAL_COLLECTIVE_TIMEOUT``, the collective timeout of
:mod:`jaxcolossal.runtime.launch`. SIGINT/SIGTERM to the launcher stop every process the same way.

Restarts (``--max-restarts K``, as torchrun's; docs/fault_tolerance.md): when a process fails (a
non-zero status, a signal, or the hang watchdog's status 75), every process is stopped as above and
the whole group is started again, at most K times; each restart is printed with its cause, the rank
and slot that failed, the attempt and rank 0's last finished step, and at the end with where the next
start resumed and the steps lost (:func:`jaxcolossal.runtime.faults.steps_lost`, the figure goodput
reports too). Every process gets
``JAXCOLOSSAL_RESTART_COUNT`` (0 on the first start; added to the count of an engine that restarts the
launcher itself, e.g. a JobSet or ``sbatch --requeue``), ``JAXCOLOSSAL_SLOT`` (its slot, stable across
restarts), ``JAXCOLOSSAL_HEARTBEAT_DIR`` (the log folder: :mod:`jaxcolossal.runtime.heartbeat`),
``JAXCOLOSSAL_JOB_START`` (when the job started) and, from the first restart on,
``JAXCOLOSSAL_PLANNED_DEVICES`` (the devices of all ``MAX``
slots: a shrunk run keeps its global batch, :func:`jaxcolossal.config.keep_global_batch`); the training loop
then resumes from the newest checkpoint (``training.resume=false`` is taken as ``auto``). Status 2
(a config error, the same at every start), a clean exit that the others do not follow and a signal
to the launcher are never restarted. When the K restarts are used up, one line says why and the
launcher exits with 1. ``<log-dir>/rank<r>.pid`` holds each process's pid (rewritten at every start);
``<log-dir>/rank<r>.log`` is appended to at each restart, after a line
``===== jaxcolossal.run attempt A (restart R): rank r of n, slot s =====``.

Blame: the process a start is blamed on is the first to end, except when that one is a watchdog's
(the hang watchdog's 75, the no-progress one's 124: it waited for a peer); then it is the process the
heartbeats in ``<log-dir>/rank<r>.heartbeat`` name (:func:`jaxcolossal.runtime.heartbeat.suspect`: a
running process whose heartbeat went stale, e.g. one stopped with SIGSTOP, else the one whose last
step is behind), and the restart line says both.

Shrink (``--nproc MIN:MAX``, with ``--max-restarts``): MAX processes start. A slot whose process a start
is blamed on in :data:`DROP_AFTER` (2) attempts in a row is dropped, and the group restarts on
the largest count n with MIN <= n <= the slots left that divides MAX
(:func:`jaxcolossal.runtime.faults.shrink_size`: 4 -> 2, 8 -> 4), each process keeping its
``--devices-per-proc``; ``RANK`` is renumbered 0..n-1 over the slots kept (``LOCAL_RANK`` is the
slot, so that a process keeps its slot's GPU). When no such n remains, one line and exit 1. A
shrink uses one of the K restarts. Restarts and shrink are for one machine (``--nnodes 1``); across
machines use SLURM ``--requeue``, a Kubernetes JobSet or torchrun's elastic agent.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from jaxcolossal.runtime.faults import (
    JOB_START_ENV,
    PLANNED_DEVICES_ENV,
    RESTART_COUNT_ENV,
    SLOT_ENV,
    parse_nproc,
    restart_count,
    shrink_size,
    steps_lost,
)
from jaxcolossal.runtime.heartbeat import HEARTBEAT_DIR_ENV
from jaxcolossal.runtime.processes import DEFAULT_TIMEOUT, PREFIX, Outcome, attempt, run_processes, say

__all__ = ["main", "build_env", "free_port", "run_processes", "run_with_restarts", "DEFAULT_TOTAL_DEVICES",
           "DROP_AFTER"]

DEFAULT_TOTAL_DEVICES = 8
_TIMEOUT_ENV = "JAXCOLOSSAL_COLLECTIVE_TIMEOUT"  # = jaxcolossal.runtime.launch.COLLECTIVE_TIMEOUT_ENV
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DROP_AFTER = 2
"""With ``--nproc MIN:MAX``: a slot whose process a start is blamed on (the first to fail, or the one
the heartbeats name after a hang) in this many attempts in a row is dropped and the group shrinks."""


# ------------------------------------------------------------------------ environment
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _with_device_count(xla_flags: str, n: int) -> str:
    kept = [t for t in xla_flags.split() if not re.fullmatch(re.escape(_DEVICE_COUNT_FLAG) + r"(=.*)?", t)]
    return " ".join(kept + [f"{_DEVICE_COUNT_FLAG}={n}"])


def build_env(
    base: Mapping[str, str],
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int,
    platform: str = "cpu",
    devices_per_proc: int | None = None,
    timeout: int | None = None,
) -> dict[str, str]:
    """The environment of one process (pure: returns a new dict, ``base`` is not changed).

    Sets the torchrun variables read by ``launch_from_env``, ``PYTHONUNBUFFERED=1`` and, when
    given, ``JAXCOLOSSAL_COLLECTIVE_TIMEOUT=timeout``. With ``platform="cpu"`` it also sets
    ``JAX_PLATFORMS=cpu`` and replaces the host device count in ``XLA_FLAGS`` by
    ``devices_per_proc`` (keeping the other flags).
    """
    env = dict(base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size), NODE_RANK=str(node_rank),
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1",
    )
    if timeout is not None:
        env[_TIMEOUT_ENV] = str(timeout)
    if platform == "cpu":
        if devices_per_proc is None or devices_per_proc < 1:
            raise ValueError(f"devices_per_proc must be >= 1 on cpu, got {devices_per_proc!r}")
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = _with_device_count(base.get("XLA_FLAGS", ""), devices_per_proc)
    elif platform != "gpu":
        raise ValueError(f"platform must be 'cpu' or 'gpu', got {platform!r}")
    return env


def _detect_platform() -> str:
    return "gpu" if os.path.exists("/dev/nvidia0") else "cpu"


# ------------------------------------------------------------------------ restarts
@dataclass
class _Restarts:
    """The restart loop's state: the slots still healthy, the failure streak and what each start did."""

    low: int
    high: int
    max_restarts: int
    healthy: list[int]
    active: list[int]
    count: int = 0
    streak: tuple[int | None, int] = (None, 0)
    history: list[str] = field(default_factory=list)
    """One line per restart: its cause and rank 0's last finished step (the steps lost added at the end)."""
    starts: list[tuple[int | None, int | None]] = field(default_factory=list)
    """Per start, from rank 0's heartbeat: the step it restored and its last finished step
    (:func:`jaxcolossal.runtime.faults.steps_lost`'s input; ``None`` where it did not get there)."""
    reason: str = ""
    """Why the job gave up (one line), when it did."""

    def record_failure(self, slot: int) -> int:
        """Count ``slot``'s failure; returns its failures in a row (as the process the start is blamed on)."""
        self.streak = (slot, self.streak[1] + 1 if self.streak[0] == slot else 1)
        return self.streak[1]

    def summary(self) -> list[str]:
        """The history lines, each with where the next start resumed and the steps lost
        (:func:`steps_lost`: the same figure as goodput's)."""
        lost = steps_lost(self.starts)
        out = []
        for i, line in enumerate(self.history):
            nxt = i + 1  # the start after restart i + 1
            if nxt >= len(self.starts):
                out.append(line)
            elif lost[nxt] is None:
                out.append(f"{line}; start {nxt + 1} ended before it restored a step")
            else:
                out.append(f"{line}; start {nxt + 1} resumed from step {self.starts[nxt][0]} "
                           f"({lost[nxt]} step(s) lost)")
        return out


def run_with_restarts(
    cmd: Sequence[str],
    make_envs: Callable[[Sequence[int], int], list[dict[str, str]]],
    log_dir: str,
    *,
    nproc: tuple[int, int],
    max_restarts: int,
    exit_timeout: float = DEFAULT_TIMEOUT,
    kill_grace: float = 5.0,
) -> int:
    """Supervise the group with up to ``max_restarts`` restarts (the module's doc: restarts, shrink).

    Args:
      cmd: the command every process runs.
      make_envs: ``(slots, restart count) -> environments``, one per slot, in rank order.
      log_dir: folder of ``rank<r>.log``, ``rank<r>.pid`` and the heartbeats ``rank<r>.heartbeat``.
      nproc: ``(MIN, MAX)``; ``MIN == MAX`` never shrinks.
      max_restarts: restarts allowed (0: the first failure ends the job with its status).
      exit_timeout, kill_grace: as in :func:`run_processes`.

    Returns:
      0 when a start ended with every process done; the failing process's status (as
      :func:`run_processes`) when it is not restarted (``max_restarts`` 0, a config error); 1 when the
      restarts are used up or no group of at least MIN processes remains (one line says why).
    """
    low, high = nproc
    st = _Restarts(low, high, max_restarts, healthy=list(range(high)), active=list(range(high)))
    while True:
        header = (f"===== {PREFIX} attempt {st.count + 1} (restart {st.count}): rank {{rank}} of {len(st.active)}, "
                  f"slot {{slot}} =====") if max_restarts or low < high else None
        outcome = attempt(cmd, make_envs(st.active, st.count), list(range(len(st.active))), log_dir,
                           stream_rank=0, exit_timeout=exit_timeout, kill_grace=kill_grace, slots=st.active,
                           header=header, append=st.count > 0)
        beat = outcome.rank0 or {}
        st.starts.append((beat.get("resumed_from"), beat.get("step")))
        status = _next_start(st, outcome, beat.get("step"))
        if status is not None:
            for line in st.summary():
                say(line)
            if st.reason:  # the last line: why the job ended
                sys.stderr.write(f"{PREFIX}: {st.reason}; logs in {log_dir}\n")
            elif status:
                say(f"failed with status {status}; per-rank logs in {log_dir}")
            return status


def _next_start(st: _Restarts, outcome: Outcome, last_step: int | None) -> int | None:
    """After a start ended: the job's status when it is over, else ``None`` with ``st`` set up for the
    next start (the slot the start is blamed on counted, dropped and the group shrunk when
    :data:`DROP_AFTER` is reached)."""
    if outcome.status == 0 or outcome.failed is None:
        return outcome.status
    p, cause = outcome.culprit, outcome.cause()
    if not outcome.restartable:
        st.reason = f"{cause}: a config error is the same at every start; not restarting"
        return outcome.status
    times = st.record_failure(p.slot)
    if st.count >= st.max_restarts:
        st.reason = (f"rank {p.rank} (slot {p.slot}) failed first in {times} start(s) in a row (last: "
                     f"{outcome.what()}); giving up after --max-restarts {st.max_restarts}")
        return 1
    if st.low < st.high and times >= DROP_AFTER:
        st.healthy.remove(p.slot)
        n = shrink_size(st.low, st.high, len(st.healthy))
        if n is None:
            st.reason = (f"slot {p.slot} failed first in {times} starts in a row and was dropped; "
                         f"{len(st.healthy)} slot(s) remain, and no count n with {st.low} <= n <= "
                         f"{len(st.healthy)} divides {st.high}; giving up")
            return 1
        say(f"slot {p.slot} failed first in {times} starts in a row: dropped; shrinking to {n} process(es) "
             f"on slots {st.healthy[:n]}")
        st.active, st.streak = st.healthy[:n], (None, 0)
    st.count += 1
    at = f" at step {last_step} (rank 0's last finished step)" if last_step is not None else ""
    st.history.append(f"restart {st.count}: {cause}{at}")
    say(f"restart {st.count}/{st.max_restarts}: {cause}{at}; starting {len(st.active)} process(es) again "
         f"(attempt {st.count + 1})")
    return None


# ------------------------------------------------------------------------ CLI
def _refuse(msg: str) -> None:
    """A bad value on the command line: one line on stderr (no usage, unlike ``parser.error``).

    Raises:
        SystemExit: always, with status 2.
    """
    sys.stderr.write(f"{PREFIX}: error: {msg}\n")
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jaxcolossal.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", required=True, dest="nproc",
                    help="processes to start on this machine: N, or MIN:MAX to start MAX and, with "
                         "--max-restarts, shrink to no fewer than MIN when a slot keeps failing")
    ap.add_argument("--max-restarts", "--max_restarts", type=int, default=0, dest="max_restarts",
                    help="restart the whole group at most this many times when a process fails (default 0: "
                         "the first failure ends the job); the processes resume from the newest checkpoint")
    ap.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    ap.add_argument("--node-rank", "--node_rank", type=int, default=0, dest="node_rank",
                    help="index of this machine (default 0)")
    ap.add_argument("--master-addr", "--master_addr", default="127.0.0.1", dest="master_addr",
                    help="address of the machine running rank 0 (default 127.0.0.1)")
    ap.add_argument("--master-port", "--master_port", type=int, default=0, dest="master_port",
                    help="coordinator port (default: a free port; required with --nnodes > 1)")
    ap.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                    help="cpu: simulated host devices per process; gpu: one GPU per process "
                         "(default auto: gpu if /dev/nvidia0 exists)")
    ap.add_argument("--devices-per-proc", type=int, default=None, dest="devices_per_proc",
                    help=f"CPU devices per process (default {DEFAULT_TOTAL_DEVICES} / nproc)")
    ap.add_argument("--timeout", type=int, default=None,
                    help="collective timeout in seconds, passed as JAXCOLOSSAL_COLLECTIVE_TIMEOUT "
                         "(default: that variable, else 300)")
    ap.add_argument("--kill-grace", type=float, default=5.0, dest="kill_grace",
                    help="seconds between SIGTERM and SIGKILL when stopping processes, >= 0 (default 5)")
    ap.add_argument("--log-dir", default=None, dest="log_dir",
                    help="folder for rank<r>.log (default: a new temporary folder)")
    ap.add_argument("-m", "--module", action="store_true",
                    help="run the program as a module (python -m), like torchrun -m")
    ap.add_argument("program", help="script (or module with -m) to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the program")
    return ap


def _checked_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, every value checked (one line and status 2 for a bad one, :func:`_refuse`);
    adds ``low``/``high`` (``--nproc``), ``platform`` (resolved) and ``devices`` (per process)."""
    a = _parser().parse_args(argv)
    try:
        a.low, a.high = parse_nproc(a.nproc)
    except ValueError as e:
        _refuse(str(e))
    a.nproc = a.high
    if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        _refuse(f"need --nnodes >= 1 and 0 <= --node-rank < --nnodes, got {a.nnodes} and {a.node_rank}")
    if a.nnodes > 1 and not a.master_port:
        _refuse("--master-port is required with --nnodes > 1 (every node must use the same one)")
    if a.timeout is not None and a.timeout < 1:
        _refuse(f"--timeout must be >= 1 second, got {a.timeout}")
    if a.max_restarts < 0:
        _refuse(f"--max-restarts must be >= 0, got {a.max_restarts}")
    if not math.isfinite(a.kill_grace) or a.kill_grace < 0:
        _refuse(f"--kill-grace must be a number of seconds >= 0 (e.g. --kill-grace 5), got {a.kill_grace:g}")
    if a.nnodes > 1 and (a.max_restarts or a.low < a.high):
        _refuse("--max-restarts and --nproc MIN:MAX are for one machine (--nnodes 1); across machines restart "
                "with SLURM --requeue, a Kubernetes JobSet or torchrun's elastic agent (docs/fault_tolerance.md)")
    if a.low < a.high and not a.max_restarts:
        _refuse(f"--nproc {a.low}:{a.high} shrinks the group at a restart: give --max-restarts >= {DROP_AFTER - 1}")
    a.platform = _detect_platform() if a.platform == "auto" else a.platform
    a.devices = _devices_per_proc(a)
    return a


def _devices_per_proc(a: argparse.Namespace) -> int | None:
    """CPU devices per process: ``--devices-per-proc``, else 8 / MAX; ``None`` on GPUs."""
    devices = a.devices_per_proc
    if a.platform != "cpu":
        if devices is not None:
            _refuse("--devices-per-proc applies to --platform cpu only")
        return None
    if devices is None:
        if a.nproc > DEFAULT_TOTAL_DEVICES or DEFAULT_TOTAL_DEVICES % a.nproc:
            _refuse(f"--nproc {a.nproc} does not divide {DEFAULT_TOTAL_DEVICES} devices; give --devices-per-proc "
                    f"(e.g. --nproc {a.nproc} --devices-per-proc 2), or --nproc one of "
                    f"{[n for n in range(1, DEFAULT_TOTAL_DEVICES + 1) if DEFAULT_TOTAL_DEVICES % n == 0]}")
        return DEFAULT_TOTAL_DEVICES // a.nproc
    if devices < 1:
        _refuse(f"--devices-per-proc must be >= 1, got {devices}")
    return devices


def _env_factory(a: argparse.Namespace, timeout: int | None, port: int,
                 log_dir: str) -> Callable[[Sequence[int], int], list]:
    """``(slots, restart count) -> environments`` of one start: :func:`build_env` for ranks 0..n-1 over the
    slots kept (``LOCAL_RANK`` the slot), plus the restart count (the launcher's own restarts added to
    the count of an engine that restarts the launcher itself, :func:`restart_count` of its environment),
    the slot, the planned devices, the heartbeat folder (``log_dir``) and the job's start (now, unless
    set already or this launcher is an outer engine's restart). A new free coordinator port at each
    restart unless ``--master-port`` was given."""
    planned = a.nnodes * a.nproc * (a.devices if a.platform == "cpu" else 1)
    try:  # under an engine that restarts this launcher (a JobSet, sbatch --requeue): its count comes first
        outer = restart_count(os.environ)
    except ValueError as e:
        _refuse(str(e))
    common = {HEARTBEAT_DIR_ENV: os.path.abspath(log_dir)}
    if outer == 0 and not os.environ.get(JOB_START_ENV, "").strip():
        common[JOB_START_ENV] = repr(time.time())

    def make(slots: Sequence[int], restart: int) -> list[dict[str, str]]:
        p = port if restart == 0 or a.master_port else free_port(a.master_addr)
        n = len(slots)
        envs = []
        for i, slot in enumerate(slots):
            env = build_env(os.environ, rank=a.node_rank * n + i, local_rank=slot, world_size=a.nnodes * n,
                            local_world_size=n, node_rank=a.node_rank, master_addr=a.master_addr, master_port=p,
                            platform=a.platform, devices_per_proc=a.devices, timeout=timeout)
            env.update({RESTART_COUNT_ENV: str(outer + restart), SLOT_ENV: str(slot), **common})
            if restart:  # a fresh run never changes its config (JAXCOLOSSAL_PLANNED_DEVICES: keep the global batch)
                env[PLANNED_DEVICES_ENV] = str(planned)
            envs.append(env)
        return envs
    return make


def main(argv: Sequence[str] | None = None) -> int:
    a = _checked_args(argv)
    timeout = a.timeout
    if timeout is None:
        raw = os.environ.get(_TIMEOUT_ENV, "").strip()
        timeout = int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_TIMEOUT
        pass_timeout = None  # the children read the same variable themselves
    else:
        pass_timeout = timeout

    port = a.master_port or free_port(a.master_addr)
    world = a.nnodes * a.nproc
    ranks = [a.node_rank * a.nproc + i for i in range(a.nproc)]
    cmd = [sys.executable, "-m", a.program, *a.args] if a.module else [sys.executable, a.program, *a.args]
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="jaxcolossal-run-")
    make_envs = _env_factory(a, pass_timeout, port, log_dir)
    per = f"{a.devices} CPU device(s) each" if a.platform == "cpu" else "one GPU each"
    restarts = f"; up to {a.max_restarts} restart(s)" if a.max_restarts else ""
    shrink = f", shrinking to no fewer than {a.low}" if a.low < a.high else ""
    say(f"starting {a.nproc} process(es) (ranks {ranks[0]}..{ranks[-1]} of {world}; {per}); "
         f"coordinator {a.master_addr}:{port}; timeout {timeout} s{restarts}{shrink}; logs in {log_dir}")
    if a.max_restarts:  # it says why it ended
        return run_with_restarts(cmd, make_envs, log_dir, nproc=(a.low, a.high), max_restarts=a.max_restarts,
                                 exit_timeout=timeout, kill_grace=a.kill_grace)
    status = run_processes(cmd, make_envs(range(a.nproc), 0), ranks, log_dir,
                           stream_rank=0 if a.node_rank == 0 else ranks[0], exit_timeout=timeout,
                           kill_grace=a.kill_grace)
    if status:
        say(f"failed with status {status}; per-rank logs in {log_dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
