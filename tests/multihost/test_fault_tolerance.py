"""Issue 44 with real processes over gloo: a crash and a restart that resumes from the emergency
checkpoints (one process's local folder deleted: its peer's replica restores it), the goodput of
that job, and a SIGSTOPped rank caught by the other's hang watchdog (exit 75, stacks in its log)."""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
from mh import REPO, TINY, _stop, clean_env, launcher, read_metrics, run

from jaxcolossal.runtime.faults import HANG_EXIT_CODE

WRAPPER = str(REPO / "tests" / "multihost" / "fault_wrapper.py")


def _losses(records):
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


@pytest.mark.timeout(300)
def test_crash_then_restart_resumes_from_the_peer_replica_bit_exact_with_goodput(tmp_path):
    # attempt 0: persistent steps every 3, emergency every 2; rank 1 dies after step 5
    args = [*TINY, "training.max_steps=8", "checkpoint.save_every=3", "checkpoint.local_every=2",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.local_dir={tmp_path / 'local'}",
            f"logging.run_dir={tmp_path / 'run'}", "training.resume=auto", "parallel.zero_stage=2"]
    env = clean_env(JAXCOLOSSAL_TEST_CRASH="1:5")
    t0 = time.time()
    first = run(launcher(2, WRAPPER, *args, timeout_s=60, log_dir=tmp_path / "logs0"), env, timeout=140)
    assert first.returncode == 1 and "FAULT crash rank 1 after step 5" in first.stderr + \
        (tmp_path / "logs0" / "rank1.log").read_text(), first.describe()
    assert sorted(os.listdir(tmp_path / "local" / "rank1")) == ["replica_of_rank0", "step_2", "step_4"]
    shutil.rmtree(tmp_path / "local" / "rank1")  # rank 1's disk is lost: its own copy and rank 0's replica
    # attempt 1: the launcher's restart (restart count 1) resumes from emergency step 4 (persistent: 3)
    second = run(launcher(2, WRAPPER, *args, timeout_s=60, log_dir=tmp_path / "logs1"),
                 clean_env(JAXCOLOSSAL_RESTART_COUNT="1"), timeout=140)
    assert second.returncode == 0, second.describe()
    outside = time.time() - t0  # the job's wall time seen from outside: both launchers, the test's pause between
    log = (tmp_path / "run" / "train.log").read_text()
    assert "resumed from step 4 of the emergency (local) checkpoints" in log, log[-3000:]
    records = read_metrics(tmp_path / "run")
    starts = [i for i, r in enumerate(records) if r.get("event") == "run_start"]
    before, after = dict(_losses(records[starts[0]:starts[1]])), dict(_losses(records[starts[1]:]))
    assert min(after) == 5 and max(after) == 8
    for step in set(before) & set(after):  # steps computed in both attempts: bit-identical losses
        assert before[step] == after[step], (step, before[step], after[step])
    g = next(r for r in records if r.get("event") == "goodput")
    print("GOODPUT", json.dumps(g))
    # the failed attempt's last step on rank 0's timeline (dispatched, the one before it finished)
    last_step_first = [r for r in map(json.loads, open(tmp_path / "run" / "goodput.jsonl"))
                       if r["attempt"] == 0][-1]["step"]
    assert last_step_first >= max(before) and g["steps_lost"] == last_step_first - 4
    assert abs(g["goodput_accounted"] - 1) <= 0.02 and 0 < g["goodput"] < 1
    # the timeline covers the job as measured from outside, less the launchers' own start and teardown
    print(f"GOODPUT wall {g['goodput_wall_s']:.1f} s of {outside:.1f} s measured outside")
    assert outside - 20 <= g["goodput_wall_s"] <= outside
    assert g["goodput_restart_s"] > 0 and g["goodput_wasted_s"] > 0
    assert f"restart 1: resumed from step 4 (local), {last_step_first - 4} step" in log


def _wait_for(pred, timeout, what):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _logged_step(run_dir) -> int:
    try:
        return max((r["step"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in r), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.timeout(200)
def test_sigstopped_rank_is_caught_by_the_others_hang_watchdog(tmp_path):
    hang_timeout = 4
    run_dir, logs, pids = tmp_path / "run", tmp_path / "logs", tmp_path / "pids"
    pids.mkdir()
    # the collective-timeout watchdog (60 s) and gloo's own timeout out of the way: the hang watchdog decides
    env = clean_env(JAXCOLOSSAL_TEST_PID_DIR=str(pids), XLA_FLAGS="--xla_cpu_collective_timeout_seconds=600")
    cmd = launcher(2, WRAPPER, *TINY, "training.max_steps=400", f"logging.run_dir={run_dir}",
                   f"fault_tolerance.hang_timeout_s={hang_timeout}", "fault_tolerance.hang_factor=10",
                   timeout_s=60, log_dir=logs)
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        _wait_for(lambda: _logged_step(run_dir) >= 5, 120, "step 5")
        rank1 = int((pids / "rank1.pid").read_text())
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, err = p.communicate(timeout=60)
        ended = time.monotonic() - stopped_at
    finally:
        _stop(p)
    text = (logs / "rank0.log").read_text()
    assert p.returncode == HANG_EXIT_CODE, err[-4000:] + text[-4000:]
    assert "jaxcolossal hang watchdog: process 0: no step finished for" in text, text[-4000:]
    # issue 54 item 14: the line names the process that stopped, from the heartbeats in the log folder
    assert re.search(r"Process 1 is the one that stopped: no heartbeat for [\d.]+ s", text), text[-4000:]
    assert "the heartbeats blame rank 1: no heartbeat for" in err, err[-4000:]
    assert "Thread 0x" in text and "most recent call first" in text  # faulthandler's stacks of every thread
    idle = float(re.search(r"no step finished for ([\d.]+) s", text).group(1))
    phase = re.search(r"last known phase: ([^.]+)\.", text).group(1)
    print(f"HANG detected after {idle:.1f} s without a step (limit {hang_timeout} s); launcher ended "
          f"{ended:.1f} s after SIGSTOP; phase: {phase}")
    assert hang_timeout <= idle <= hang_timeout + 2
    assert ended < hang_timeout + 15
