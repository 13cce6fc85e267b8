"""A stand-in for the training loop without JAX, for the hang-blame tests of the launcher.

The ranks of one start step in lockstep through a file barrier (each waits in step N until every rank
has reached it, as a collective waits), with the real hang watchdog and heartbeat of the training loop
(:class:`HangWatchdog`, :class:`Heartbeat` in ``$JAXCOLOSSAL_HEARTBEAT_DIR``, which the launcher sets).

    STALL_DIR=DIR       the barrier's folder (shared by the ranks)
    STALL_STEPS=N       steps to run (default 40), 20 ms each
    STALL_SLOT=S:K      the process in launcher slot S stops itself (SIGSTOP) before its step K, at every
                        start (a host that keeps hanging)
    STALL_HANG_S=T      the hang watchdog's timeout (default 1.5 s)

A stopped process stops all its threads: its heartbeat goes stale, and the other ranks wait at step K
until their watchdogs exit with status 75.
"""
import os
import signal
import time
from pathlib import Path

import runtime_only  # noqa: F401  (before jaxcolossal: the runtime's modules without jax)

from jaxcolossal.runtime.faults import restart_count  # noqa: E402
from jaxcolossal.runtime.heartbeat import Heartbeat  # noqa: E402
from jaxcolossal.runtime.watchdog import HangWatchdog  # noqa: E402


def barrier(folder: Path, attempt: int, step: int, rank: int, world: int) -> None:
    (folder / f"a{attempt}.s{step}.r{rank}").touch()
    while not all((folder / f"a{attempt}.s{step}.r{r}").exists() for r in range(world)):
        time.sleep(0.005)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt, slot = restart_count(os.environ), os.environ.get("JAXCOLOSSAL_SLOT", "")
    folder = Path(os.environ["STALL_DIR"])
    stop_slot, stop_at = (os.environ.get("STALL_SLOT") or "-1:0").split(":")
    beat = Heartbeat.from_env(os.environ, rank, world, attempt)
    hang = HangWatchdog(float(os.environ.get("STALL_HANG_S", "1.5")), 10, process_index=rank, heartbeat=beat).start()
    beat.resumed(0)
    for step in range(1, int(os.environ.get("STALL_STEPS", "40")) + 1):
        if slot == stop_slot and step == int(stop_at):
            print(f"STALL slot {slot} (rank {rank}) stops itself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        hang.phase(f"in step {step}'s barrier")
        time.sleep(0.02)
        barrier(folder, attempt, step, rank, world)
        hang.step_done(step)
        beat.step_done(step)
    hang.stop()
    print(f"DONE rank {rank} of {world}, slot {slot}", flush=True)


if __name__ == "__main__":
    main()
