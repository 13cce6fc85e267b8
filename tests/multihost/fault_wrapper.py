"""Run scripts/train.py with test-only faults, for the fault-tolerance tests.

    JAXCOLOSSAL_TEST_PID_DIR=DIR     each rank writes its pid to DIR/rank<RANK>.pid at start
    JAXCOLOSSAL_TEST_CRASH=R:N       rank R ends itself with status 1 (os._exit) one second after its
                                     step N finished, in the first attempt only (restart count 0)
    JAXCOLOSSAL_TEST_KILL9=R:N       the same, with SIGKILL to itself (``kill -9``) instead of os._exit

The second resembles ``kill -9`` of one rank mid-run: nothing of the loop runs after it, and the
launcher stops the other ranks.
"""
import os
import runpy
import signal
import sys
import time
from pathlib import Path

from jaxcolossal.runtime import goodput
from jaxcolossal.runtime.faults import restart_count

REPO = Path(__file__).resolve().parents[2]


def _crash_after(rank: str, step: int, kill9: bool = False) -> None:
    original = goodput.GoodputRecorder.step_done

    def step_done(self, done: int) -> None:
        original(self, done)
        if done == step:
            sys.stderr.write(f"FAULT {'kill -9' if kill9 else 'crash'} rank {rank} after step {done}\n")
            sys.stderr.flush()
            time.sleep(1.0)  # the emergency checkpoint written before this step reaches the disk
            if kill9:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)

    goodput.GoodputRecorder.step_done = step_done


if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    if os.environ.get("JAXCOLOSSAL_TEST_PID_DIR"):
        Path(os.environ["JAXCOLOSSAL_TEST_PID_DIR"], f"rank{rank}.pid").write_text(str(os.getpid()))
    for var in ("JAXCOLOSSAL_TEST_CRASH", "JAXCOLOSSAL_TEST_KILL9"):
        crash = os.environ.get(var, "")
        if crash and crash.split(":")[0] == rank and restart_count(os.environ) == 0:
            _crash_after(rank, int(crash.split(":")[1]), kill9=var.endswith("KILL9"))
    sys.argv = [str(REPO / "scripts" / "train.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
