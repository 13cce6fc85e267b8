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
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Mapping, Sequence

__all__ = ["main", "build_env", "free_port", "run_processes", "DEFAULT_TOTAL_DEVICES"]

DEFAULT_TOTAL_DEVICES = 8
_TIMEOUT_ENV = "JAXCOLOSSAL_COLLECTIVE_TIMEOUT"  # = jaxcolossal.runtime.launch.COLLECTIVE_TIMEOUT_ENV
_DEFAULT_TIMEOUT = 300
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_PREFIX = "jaxcolossal.run"


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


# ------------------------------------------------------------------------ processes
@dataclass
class _Proc:
    rank: int
    popen: subprocess.Popen
    log_path: str
    started: float
    threads: list = field(default_factory=list)
    log_file: IO | None = None


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


def _say(msg: str) -> None:
    sys.stderr.write(f"[{_PREFIX}] {msg}\n")
    sys.stderr.flush()


def run_processes(
    cmd: Sequence[str],
    envs: Sequence[Mapping[str, str]],
    ranks: Sequence[int],
    log_dir: str,
    *,
    stream_rank: int | None = 0,
    exit_timeout: float = _DEFAULT_TIMEOUT,
    kill_grace: float = 5.0,
    poll: float = 0.1,
) -> int:
    """Start ``cmd`` once per environment and supervise the processes until all have ended.

    Args:
      cmd: the command (argv) every process runs.
      envs: one environment per process.
      ranks: the global rank of each process (names the log files ``rank<r>.log``).
      log_dir: folder of the log files (created).
      stream_rank: the rank whose output is also streamed to this process's stdout/stderr.
      exit_timeout: after a process ends with 0, seconds the others have to end too.
      kill_grace: seconds between SIGTERM and SIGKILL when stopping processes.

    Returns:
      0 when every process ended with 0; else the status of the first process that failed
      (128 + N for signal N), or 1 when the others did not follow a clean exit in time.
    """
    os.makedirs(log_dir, exist_ok=True)
    procs: list[_Proc] = []
    with _caught_signals() as stop_signal:
        try:
            for rank, env in zip(ranks, envs):
                procs.append(_start(cmd, env, rank, os.path.join(log_dir, f"rank{rank}.log"), rank == stream_rank))
            first_clean_exit: list[float] = []
            while True:
                status = _check(procs, stop_signal, stream_rank, exit_timeout, kill_grace, first_clean_exit)
                if status is not None:
                    return status
                time.sleep(poll)
        finally:
            _clean_up(procs)


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


def _start(cmd: Sequence[str], env: Mapping[str, str], rank: int, path: str, stream: bool) -> _Proc:
    """One process, its output to ``path`` (and, when ``stream``, to this process's stdout/stderr too)."""
    log_file = open(path, "wb")
    if not stream:
        popen = subprocess.Popen(list(cmd), env=dict(env), stdout=log_file, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        return _Proc(rank, popen, path, time.monotonic(), log_file=log_file)
    popen = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    p = _Proc(rank, popen, path, time.monotonic(), log_file=log_file)
    out, err = getattr(sys.stdout, "buffer", None), getattr(sys.stderr, "buffer", None)
    for src, dst in ((popen.stdout, out), (popen.stderr, err)):
        t = threading.Thread(target=_pump, args=(src, [log_file], dst), daemon=True)
        t.start()
        p.threads.append(t)
    return p


def _check(procs: list[_Proc], stop_signal: list[int], stream_rank: int | None, exit_timeout: float,
           kill_grace: float, first_clean_exit: list[float]) -> int | None:
    """One look at the processes: the job's exit status once it is over (a signal, a failure, all
    done, or the rest not following a clean exit in time), else ``None``."""
    running = [p for p in procs if p.popen.poll() is None]
    failed = [p for p in procs if p.popen.returncode not in (None, 0)]
    if stop_signal:
        _say(f"received signal {stop_signal[0]}; stopping {len(running)} process(es)")
        _stop_all(procs, kill_grace)
        return 128 + stop_signal[0]
    if failed:
        first = min(failed, key=lambda p: p.rank)
        code = first.popen.returncode
        what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        _say(f"rank {first.rank} {what} after {time.monotonic() - first.started:.1f} s; "
             f"stopping the other {len(running)} process(es)")
        _stop_all(procs, kill_grace)
        if first.rank != stream_rank:
            tail = _tail(first.log_path)
            _say(f"last lines of {first.log_path}:\n{tail}" if tail else f"log: {first.log_path}")
        return _exit_status(code)
    if not running:
        return 0
    if len(running) < len(procs):  # some ended with 0, the rest still runs
        first_clean_exit[:] = first_clean_exit or [time.monotonic()]
        if time.monotonic() - first_clean_exit[0] > exit_timeout + kill_grace:
            _say(f"rank(s) {', '.join(str(p.rank) for p in running)} still running {exit_timeout + kill_grace:.0f} s "
                 "after another rank finished; stopping them (a collective mismatch or a hang?)")
            _stop_all(procs, kill_grace)
            return 1
    return None


def _clean_up(procs: list[_Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            _stop_all([p], 0)
        for t in p.threads:
            t.join(timeout=5)
        if p.log_file:
            p.log_file.close()


# ------------------------------------------------------------------------ CLI
def _refuse(msg: str) -> None:
    """A bad value on the command line: one line on stderr (no usage, unlike ``parser.error``).

    Raises:
        SystemExit: always, with status 2.
    """
    sys.stderr.write(f"{_PREFIX}: error: {msg}\n")
    raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jaxcolossal.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", type=int, required=True,
                    dest="nproc", help="processes to start on this machine")
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
                    help="seconds between SIGTERM and SIGKILL when stopping processes (default 5)")
    ap.add_argument("--log-dir", default=None, dest="log_dir",
                    help="folder for rank<r>.log (default: a new temporary folder)")
    ap.add_argument("-m", "--module", action="store_true",
                    help="run the program as a module (python -m), like torchrun -m")
    ap.add_argument("program", help="script (or module with -m) to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the program")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if a.nproc < 1:
        _refuse(f"--nproc must be >= 1, got {a.nproc}")
    if a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        _refuse(f"need --nnodes >= 1 and 0 <= --node-rank < --nnodes, got {a.nnodes} and {a.node_rank}")
    if a.nnodes > 1 and not a.master_port:
        _refuse("--master-port is required with --nnodes > 1 (every node must use the same one)")
    if a.timeout is not None and a.timeout < 1:
        _refuse(f"--timeout must be >= 1 second, got {a.timeout}")
    platform = _detect_platform() if a.platform == "auto" else a.platform
    devices = a.devices_per_proc
    if platform == "cpu":
        if devices is None:
            if a.nproc > DEFAULT_TOTAL_DEVICES or DEFAULT_TOTAL_DEVICES % a.nproc:
                _refuse(f"--nproc {a.nproc} does not divide {DEFAULT_TOTAL_DEVICES} devices; give --devices-per-proc "
                        f"(e.g. --nproc {a.nproc} --devices-per-proc 2), or --nproc one of "
                        f"{[n for n in range(1, DEFAULT_TOTAL_DEVICES + 1) if DEFAULT_TOTAL_DEVICES % n == 0]}")
            devices = DEFAULT_TOTAL_DEVICES // a.nproc
        elif devices < 1:
            _refuse(f"--devices-per-proc must be >= 1, got {devices}")
    elif devices is not None:
        _refuse("--devices-per-proc applies to --platform cpu only")

    timeout = a.timeout
    if timeout is None:
        raw = os.environ.get(_TIMEOUT_ENV, "").strip()
        timeout = int(raw) if raw.isdigit() and int(raw) > 0 else _DEFAULT_TIMEOUT
        pass_timeout = None  # the children read the same variable themselves
    else:
        pass_timeout = timeout

    port = a.master_port or free_port(a.master_addr)
    world = a.nnodes * a.nproc
    ranks = [a.node_rank * a.nproc + i for i in range(a.nproc)]
    envs = [build_env(os.environ, rank=r, local_rank=i, world_size=world, local_world_size=a.nproc,
                      node_rank=a.node_rank, master_addr=a.master_addr, master_port=port,
                      platform=platform, devices_per_proc=devices, timeout=pass_timeout)
            for i, r in enumerate(ranks)]
    cmd = [sys.executable, "-m", a.program, *a.args] if a.module else [sys.executable, a.program, *a.args]
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="jaxcolossal-run-")
    per = f"{devices} CPU device(s) each" if platform == "cpu" else "one GPU each"
    _say(f"starting {a.nproc} process(es) (ranks {ranks[0]}..{ranks[-1]} of {world}; {per}); "
         f"coordinator {a.master_addr}:{port}; timeout {timeout} s; logs in {log_dir}")
    status = run_processes(cmd, envs, ranks, log_dir, stream_rank=0 if a.node_rank == 0 else ranks[0],
                           exit_timeout=timeout, kill_grace=a.kill_grace)
    if status:
        _say(f"failed with status {status}; per-rank logs in {log_dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
