"""Launchers under simulated Slurm / Open MPI environments, next to JAX's own cluster detection.

``jax.distributed.initialize()`` with no arguments detects Slurm (``SLURM_JOB_ID``,
``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``; coordinator: the
first node of the step, port ``JAX_COORDINATOR_PORT`` or one derived from the job id) and Open
MPI (``OMPI_MCA_orte_hnp_uri`` plus ``OMPI_COMM_WORLD_*``). The first tests check that our
``launch_from_slurm`` / ``launch_from_openmpi`` resolve the same process id, process count and
device ids as JAX does; the last one runs real 2-process jobs on this machine with both
detections and with our launchers.
"""
import importlib
import subprocess
import sys
import time

import jax
import pytest
from jax._src import clusters
from mh import REPO, clean_env, free_port, tagged_json

from jaxcolossal.train.guard import StepWatchdog

L = importlib.import_module("jaxcolossal.runtime.launch")  # the module (the package re-exports a function named launch)

CLUSTER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JAX_COORDINATOR_PORT",
    "JAX_COORDINATOR_ADDRESS", "JAX_LOCAL_DEVICE_IDS", "JAXCOLOSSAL_COLLECTIVE_TIMEOUT",
    "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_PROCID",
    "SLURM_LOCALID", "SLURM_STEP_NUM_NODES",
    "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
)

SLURM = dict(SLURM_JOB_ID="12345", SLURM_STEP_NODELIST="node[003-004,007],gpu1", SLURM_NTASKS="6",
             SLURM_PROCID="4", SLURM_LOCALID="1", SLURM_STEP_NUM_NODES="3")
OMPI = dict(OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
            OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_LOCAL_RANK="3")


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment; ``env(**vars)`` sets variables."""
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")  # launch() adds the CPU collective timeout flag; restored after

    def set_vars(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))
    return set_vars


@pytest.fixture
def calls(monkeypatch):
    """Records jax.distributed.initialize calls instead of making them."""
    records = []
    saved_impl = jax.config.jax_cpu_collectives_implementation
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: records.append(kw))
    monkeypatch.setattr(L, "backend_started", lambda: False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # launch() installs the fail-fast hook
    yield records
    jax.config.update("jax_cpu_collectives_implementation", saved_impl)


def _jax_detect():
    return clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 300)


def test_jax_detects_slurm_like_launch_from_slurm(env, calls):
    env(**SLURM)
    port = 12345 % 2**12 + 65535 - 2**12 + 1  # JAX's port rule for Slurm
    assert _jax_detect() == (f"node003:{port}", 6, 4, [1])
    env(JAX_COORDINATOR_PORT=29500)
    addr, nproc, pid, ids = _jax_detect()
    assert (addr, nproc, pid, ids) == ("node003:29500", 6, 4, [1])

    L.launch_from_slurm("node003", 29500, verbose=False)
    c = calls[-1]
    assert (c["coordinator_address"], c["num_processes"], c["process_id"], c["local_device_ids"]) == \
        (addr, nproc, pid, ids)
    # Every value is given, so JAX's detection is switched off (it could narrow the devices).
    assert c["cluster_detection_method"] == "deactivate"


def test_slurm_nprocs_is_preferred_but_jax_reads_ntasks(env, calls):
    # SLURM_NPROCS is Colossal-AI's name; JAX reads SLURM_NTASKS. Slurm sets both to the same value.
    env(**SLURM, SLURM_NPROCS="6")
    L.launch_from_slurm("node003", 29500, verbose=False)
    assert calls[-1]["num_processes"] == _jax_detect()[1] == 6


def test_jax_detects_openmpi_like_launch_from_openmpi(env, calls):
    env(**OMPI)
    port = (1531576320 // 2**12) % 2**12 + 65535 - 2**12 + 1  # JAX's port rule for Open MPI
    assert _jax_detect() == (f"10.96.0.1:{port}", 8, 5, [3])
    L.launch_from_openmpi("10.96.0.1", port, verbose=False)
    c = calls[-1]
    assert (c["coordinator_address"], c["num_processes"], c["process_id"], c["local_device_ids"]) == \
        (f"10.96.0.1:{port}", 8, 5, [3])


def test_jax_detects_nothing_without_a_cluster(env):
    env(RANK=1, LOCAL_RANK=1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=1234)
    # torchrun variables are not a JAX cluster: launch_from_env must pass every value itself.
    assert _jax_detect() == (None, None, None, None)


def test_all_local_devices_under_slurm_is_not_narrowed_by_jax(env, calls):
    # One process per node owning every local GPU, inside srun: without 'deactivate', JAX's
    # Slurm detection would set local_device_ids=[SLURM_LOCALID] and hide the other GPUs.
    env(**SLURM)
    L.launch_from_slurm("node003", 29500, verbose=False, local_device_ids="all")
    c = calls[-1]
    assert c["local_device_ids"] is None
    assert c["cluster_detection_method"] == "deactivate"


def test_launch_passes_the_collective_timeout(env, calls):
    env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, MASTER_ADDR="h", MASTER_PORT=1234)
    L.launch_from_env(verbose=False)
    c = calls[-1]
    assert (c["shutdown_timeout_seconds"], c["heartbeat_timeout_seconds"]) == (300, 100)
    assert "--xla_cpu_collective_timeout_seconds=300" in L.os.environ["XLA_FLAGS"]

    env(JAXCOLOSSAL_COLLECTIVE_TIMEOUT=12, XLA_FLAGS="--xla_foo")
    L.launch_from_env(verbose=False)
    c = calls[-1]
    assert (c["shutdown_timeout_seconds"], c["heartbeat_timeout_seconds"]) == (12, 12)
    assert L.os.environ["XLA_FLAGS"] == "--xla_foo --xla_cpu_collective_timeout_seconds=12"

    env(XLA_FLAGS="--xla_cpu_collective_timeout_seconds=900")  # the user's own value wins
    L.launch(0, 2, "h", 1234, verbose=False, collective_timeout_s=7)
    assert calls[-1]["shutdown_timeout_seconds"] == 7
    assert L.os.environ["XLA_FLAGS"] == "--xla_cpu_collective_timeout_seconds=900"

    env(JAXCOLOSSAL_COLLECTIVE_TIMEOUT="soon")
    with pytest.raises(ValueError, match="JAXCOLOSSAL_COLLECTIVE_TIMEOUT must be a positive integer"):
        L.launch_from_env(verbose=False)


def test_step_watchdog_fires_and_stays_quiet(monkeypatch):
    fired = []
    with StepWatchdog(0.3, process_index=1, on_timeout=fired.append) as wd:
        for _ in range(6):  # kicked every 0.1 s: no alarm
            time.sleep(0.1)
            wd.kick("busy")
        assert not fired
        time.sleep(1.0)  # no kick for 1 s > 0.3 s
    assert len(fired) == 1 and wd.fired
    assert "process 1 made no progress" in fired[0] and "last progress: busy" in fired[0]
    off = StepWatchdog(None)
    off.start()
    off.kick()
    off.stop()
    assert not off.enabled and off._thread is None
    with pytest.raises(ValueError, match="timeout must be > 0"):
        StepWatchdog(0)


# ------------------------------------------------------------------ real 2-process jobs
WORKER = r"""
import json, os, sys
mode = sys.argv[1]
import jax
import numpy as np
from jax.experimental import multihost_utils
if mode.startswith("jax-"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()             # everything from the simulated cluster environment
elif mode == "launch_from_slurm":
    from jaxcolossal.runtime.launch import launch_from_slurm
    launch_from_slurm("127.0.0.1", int(os.environ["PORT"]), verbose=False)
elif mode == "launch_from_openmpi":
    from jaxcolossal.runtime.launch import launch_from_openmpi
    launch_from_openmpi("127.0.0.1", int(os.environ["PORT"]), verbose=False)
g = multihost_utils.process_allgather(np.array([jax.process_index()], np.int32))
print("RESULT " + json.dumps(dict(index=jax.process_index(), count=jax.process_count(),
                                  devices=jax.device_count(), gathered=np.asarray(g).ravel().tolist())),
      flush=True)
"""


def _cluster_env(mode: str, rank: int, port: int) -> dict:
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", PORT=str(port))
    if mode in ("jax-slurm", "launch_from_slurm"):
        env.update(SLURM_JOB_ID="777", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
                   SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_STEP_NUM_NODES="1")
    else:
        env.update(OMPI_MCA_orte_hnp_uri="4096.0;tcp://127.0.0.1:1234", OMPI_COMM_WORLD_SIZE="2",
                   OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_RANK=str(rank))
    if mode.startswith("jax-"):
        env["JAX_COORDINATOR_PORT"] = str(port)
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["jax-slurm", "jax-ompi", "launch_from_slurm", "launch_from_openmpi"])
def test_real_two_process_job_under_simulated_cluster(mode, tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode], env=_cluster_env(mode, r, port), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"{mode} rank {r}: status {rc}\n{err[-3000:]}"
        res = tagged_json(out)[0]
        assert res == dict(index=r, count=2, devices=4, gathered=[0, 1])
