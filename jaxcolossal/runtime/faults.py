"""Fault tolerance's shared vocabulary: exit codes, restart counters and the shrink rule.

The model is torchrun's (docs/fault_tolerance.md): when a process dies or hangs, the launcher stops
the whole group and starts it again; the restarted processes resume from the newest checkpoint.
Everything here is pure (it reads the mapping it is given, never ``os.environ`` by itself), so the
launcher (:mod:`jaxcolossal.runtime.run`), the training loop and the tests share one definition.

* :data:`HANG_EXIT_CODE` (75): the status a process's hang watchdog exits with; the launcher names it
  "hung" and restarts the group.
* :func:`restart_count`: which start of the job this is (0: the first), from our launcher
  (``JAXCOLOSSAL_RESTART_COUNT``), torchrun's elastic agent (``TORCHELASTIC_RESTART_COUNT``) or a
  requeued SLURM job (``SLURM_RESTART_COUNT``).
* :func:`parse_nproc` and :func:`shrink_size`: ``--nproc MIN:MAX`` and the process count a shrunk
  group restarts on.
* :func:`steps_lost`: the one definition of the steps a failure loses, for the launcher and goodput.
"""
from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence

__all__ = [
    "HANG_EXIT_CODE", "NO_PROGRESS_EXIT_CODE", "CONFIG_ERROR_EXIT_CODE", "RESTART_COUNT_ENV", "SLOT_ENV",
    "PLANNED_DEVICES_ENV", "RESTART_COUNT_VARS", "restart_count", "planned_devices", "describe_exit",
    "parse_nproc", "shrink_size", "JOB_START_ENV", "job_start", "steps_lost",
]

HANG_EXIT_CODE = 75
"""The exit status of a process whose hang watchdog found no step finishing in time (after dumping
every thread's stack to its log). ``python -m jaxcolossal.run`` reports it as "hung (exit 75)" and,
with ``--max-restarts``, restarts the group. 75 is ``EX_TEMPFAIL`` of sysexits.h: try again."""

NO_PROGRESS_EXIT_CODE = 124
"""The exit status of :class:`jaxcolossal.train.guard.StepWatchdog` (a process making no progress
for the collective timeout; as timeout(1)); ``jaxcolossal.runtime.launch.WATCHDOG_EXIT_CODE``."""

CONFIG_ERROR_EXIT_CODE = 2
"""scripts/train.py's status for a config error (one line, before anything compiles): it is the
same at every start, so the launcher never restarts a group for it (e.g. a layout that is not valid
on the fewer devices of a shrunk group)."""

RESTART_COUNT_ENV = "JAXCOLOSSAL_RESTART_COUNT"
"""Set by ``python -m jaxcolossal.run`` in every process: 0 on the first start, n on the n-th restart."""

SLOT_ENV = "JAXCOLOSSAL_SLOT"
"""Set by ``python -m jaxcolossal.run``: the launcher slot a process occupies, 0..MAX-1 (with
``--nproc MIN:MAX``), stable across restarts; unlike ``RANK``, which is renumbered 0..n-1 after a
shrink."""

PLANNED_DEVICES_ENV = "JAXCOLOSSAL_PLANNED_DEVICES"
"""The devices the job was configured for (all of ``--nproc MAX``'s processes); set by
``python -m jaxcolossal.run`` on every start, or by hand (e.g. a SLURM job requeued on fewer nodes).
When it differs from the devices a run has, the run keeps the global batch by raising the gradient
accumulation (:func:`jaxcolossal.config.keep_global_batch`)."""

JOB_START_ENV = "JAXCOLOSSAL_JOB_START"
"""Set by ``python -m jaxcolossal.run`` in every process of every start: when the launcher started the
job (seconds since the epoch), unless the variable is set already or the launcher is itself a restart
of an outer engine's (then it does not know). Goodput counts the time from it, so a start that failed
before its goodput record began is counted too (:func:`jaxcolossal.runtime.goodput.summarize`)."""

RESTART_COUNT_VARS = (RESTART_COUNT_ENV, "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
"""Where :func:`restart_count` looks, first found wins: our launcher, torchrun's elastic agent,
SLURM (``sbatch --requeue``: the times the job was requeued)."""


def _non_negative_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"environment variable {name} must be a non-negative integer, got {raw!r}")
    return value


def restart_count(env: Mapping[str, str]) -> int:
    """Which restart of the job this process belongs to: 0 on the first start (or with no launcher).

    Reads the first of :data:`RESTART_COUNT_VARS` set to a non-empty value in ``env``.

    Raises:
        ValueError: that variable is not a non-negative integer (the message names it).
    """
    for name in RESTART_COUNT_VARS:
        raw = env.get(name, "").strip()
        if raw:
            return _non_negative_int(name, raw)
    return 0


def planned_devices(env: Mapping[str, str]) -> int | None:
    """``$JAXCOLOSSAL_PLANNED_DEVICES`` (:data:`PLANNED_DEVICES_ENV`): the devices the job was
    configured for, or ``None`` when unset or empty.

    Raises:
        ValueError: it is set but not a positive integer.
    """
    raw = env.get(PLANNED_DEVICES_ENV, "").strip()
    if not raw:
        return None
    value = _non_negative_int(PLANNED_DEVICES_ENV, raw)
    if value < 1:
        raise ValueError(f"environment variable {PLANNED_DEVICES_ENV} must be >= 1, got {raw!r}")
    return value


def job_start(env: Mapping[str, str]) -> float | None:
    """``$JAXCOLOSSAL_JOB_START`` (:data:`JOB_START_ENV`) in seconds since the epoch, ``None`` when unset.

    Raises:
        ValueError: it is set but is not a positive number (the message names it).
    """
    raw = env.get(JOB_START_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"environment variable {JOB_START_ENV} must be a time in seconds since the epoch, "
                         f"got {raw!r}")
    return value


def steps_lost(starts: Sequence[tuple[int | None, int | None]]) -> list[int | None]:
    """The steps each restart lost: the one definition, for the launcher's restart lines and goodput's.

    A failure loses the steps done since the checkpoint the next start restores (the newest committed
    one): they are computed again. ``starts`` holds, for each start of the job in order, what process 0
    recorded: ``(resumed_from, last_done)``, the step it restored (0: fresh) and the last step it
    finished (the restored one before its first step), each ``None`` when the start ended before it got
    there (e.g. a process that failed at import).

    Returns one entry per start: ``None`` for the first start and for a start that did not restore;
    else ``max(0, last_done - resumed_from)`` with ``last_done`` of the newest earlier start that
    restored (0 when none did: no step was done). The job's steps lost is the sum of the entries: a step lost twice (in two failures) counts
    twice, as it is computed three times.
    """
    out: list[int | None] = []
    last_done: int | None = None
    for i, (resumed, done) in enumerate(starts):
        if resumed is None:
            out.append(None)
            continue
        out.append(None if i == 0 else 0 if last_done is None else max(0, last_done - resumed))
        last_done = done if done is not None else resumed
    return out


def describe_exit(returncode: int) -> str:
    """A process's end in words, from ``Popen.returncode``: ``killed by SIGKILL``, ``hung (exit 75)``,
    ``made no progress (exit 124)``, ``exited with status 1``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    if returncode == HANG_EXIT_CODE:
        return f"hung (exit {HANG_EXIT_CODE})"
    if returncode == NO_PROGRESS_EXIT_CODE:
        return f"made no progress (exit {NO_PROGRESS_EXIT_CODE})"
    return f"exited with status {returncode}"


def parse_nproc(text: str) -> tuple[int, int]:
    """``--nproc``'s value: ``N`` (a fixed group, ``(N, N)``) or ``MIN:MAX`` (start ``MAX`` processes,
    shrink down to no fewer than ``MIN``).

    Raises:
        ValueError: one line: not an integer or ``MIN:MAX``, a count below 1, or ``MIN > MAX``.
    """
    parts = text.strip().split(":")
    if len(parts) not in (1, 2) or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise ValueError(f"--nproc must be N or MIN:MAX (integers), got {text!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < 1:
        raise ValueError(f"--nproc must be >= 1 (N or MIN:MAX), got {text!r}")
    if low > high:
        raise ValueError(f"--nproc MIN:MAX needs MIN <= MAX, got {text!r}")
    return low, high


def shrink_size(low: int, high: int, healthy: int) -> int | None:
    """The process count a group of ``high`` slots restarts on when ``healthy`` of them remain:
    the largest ``n`` with ``low <= n <= healthy`` that divides ``high`` (so the devices of the
    configured layout split evenly: 4 slots, 3 healthy -> 2; 8 slots, 7 healthy -> 4), or ``None``
    when there is none (the job cannot go on).

    Raises:
        ValueError: ``low`` < 1 or ``low`` > ``high``.
    """
    if low < 1 or low > high:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    for n in range(min(healthy, high), low - 1, -1):
        if high % n == 0:
            return n
    return None
