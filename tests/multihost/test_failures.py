"""No silent hangs: a process that leaves early, hangs or dies ends every process, in bounded time.

Each case runs 2 real processes with ``JAXCOLOSSAL_COLLECTIVE_TIMEOUT`` of a few seconds (the
default is 300 s). The mechanisms (see jaxcolossal/runtime/launch.py and jaxcolossal/runtime/run.py):

* gloo sees mismatched collectives, or a peer whose connection closed, and raises;
* ``--xla_cpu_collective_timeout_seconds`` (set by ``launch``) ends a gloo wait on CPU;
* the :class:`StepWatchdog` of the loop aborts a process making no progress (the GPU path:
  NCCL has no timeout; here the gloo timeout is set high to leave the watchdog alone);
* the coordination service's heartbeat and shutdown barrier end the survivors of a death;
* ``python -m jaxcolossal.run`` stops the others as soon as one process fails.
"""
import subprocess
import sys
import time

import pytest
from mh import REPO, TINY, clean_env, free_port, launcher, run

from jaxcolossal.runtime.run import build_env

WORKER = str(REPO / "tests" / "multihost" / "collective_worker.py")
OVERRIDES = str(REPO / "tests" / "multihost" / "rank_overrides.py")

# What a process or the launcher says when a job is ended for a mismatch, hang or death.
CLEAR_ERRORS = (
    "Is there a distributed collective mismatch in your code?",  # gloo, mismatched sizes
    "made no progress for",                                        # StepWatchdog
    "Timed out waiting",                                           # gloo collective timeout
    "Shutdown barrier has failed",                                 # coordination service
    "Connection closed by peer", "Connection reset by peer",       # gloo, peer gone
    "detected fatal errors",                                       # coordination service
)


def _all_output(res, log_dir):
    text = res.stdout + res.stderr
    for f in sorted(log_dir.glob("rank*.log")):
        text += f.read_text(errors="replace")
    return text


@pytest.mark.timeout(150)
def test_train_rank_leaving_the_loop_early_ends_the_job(tmp_path):
    # scripts/train.py where rank 1 stops after 2 steps and rank 0 wants 40: rank 1 goes on to
    # the final evaluation while rank 0 is in step 3, a genuine collective mismatch.
    timeout = 10
    logs = tmp_path / "logs"
    env = clean_env(JAXCOLOSSAL_TEST_RANK_OVERRIDES="1:training.max_steps=2")
    cmd = launcher(2, OVERRIDES, *TINY, "training.max_steps=40", "parallel.zero_stage=3",
                   f"logging.run_dir={tmp_path / 'run'}", timeout_s=timeout, log_dir=logs)
    res = run(cmd, env, timeout=130)
    text = _all_output(res, logs)
    assert res.returncode != 0, res.describe()
    assert "[jaxcolossal.run] rank" in res.stderr and "stopping the other" in res.stderr, res.describe()
    assert any(m in text for m in CLEAR_ERRORS), res.describe()
    # bounded: start-up and compile (~25 s here) + at most about two timeouts
    assert res.seconds < 60 + 2 * timeout, res.describe()


@pytest.mark.timeout(90)
def test_hung_process_is_caught_by_the_step_watchdog(tmp_path):
    # Rank 1 hangs at step 3, alive (its heartbeat goes on). With the gloo timeout out of the way
    # (as with NCCL on GPU, which has none) the watchdog must end the job: status 124.
    timeout = 6
    logs = tmp_path / "logs"
    env = clean_env(JAXCOLOSSAL_TEST_FAULT="hang:1:3", XLA_FLAGS="--xla_cpu_collective_timeout_seconds=600")
    res = run(launcher(2, WORKER, timeout_s=timeout, log_dir=logs), env, timeout=70)
    text = _all_output(res, logs)
    assert res.returncode == 124, res.describe()
    assert "made no progress for" in text and "last progress: step 2" in text, res.describe()
    assert "FAULT hang 1 3" in text
    assert res.seconds < 15 + 2 * timeout, res.describe()


@pytest.mark.timeout(90)
def test_dead_process_ends_the_others_without_a_launcher(tmp_path):
    # Under srun or mpirun no launcher of ours stops the survivors: rank 0 must end by itself
    # when rank 1 dies in the middle of the job.
    timeout = 6
    port = free_port()
    base = clean_env(JAXCOLOSSAL_TEST_FAULT="die:1:3", JAXCOLOSSAL_TEST_STEPS="1000")
    procs = []
    for r in range(2):
        env = build_env(base, rank=r, local_rank=r, world_size=2, local_world_size=2, master_port=port,
                        platform="cpu", devices_per_proc=2, timeout=timeout)
        procs.append(subprocess.Popen([sys.executable, WORKER], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    t0 = time.monotonic()
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - t0
    assert procs[1].returncode == 3, outs[1][-3000:]
    assert "FAULT die 1 3" in outs[1]
    assert procs[0].returncode != 0, outs[0][-3000:]
    assert "DONE 0" not in outs[0]
    assert any(m in outs[0] for m in CLEAR_ERRORS), outs[0][-5000:]
    assert elapsed < 15 + 2 * timeout, outs[0][-3000:]
