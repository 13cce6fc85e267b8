"""A real 2-process launch on CPU: launch_from_env -> jax.distributed.initialize -> collectives.

Each process simulates 2 CPU devices, so the job has 4 devices. The processes run an
allgather of their rank and a jitted sum over a global array built from per-process
data, and print the results; the test checks both processes agree on the right values.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mh import tagged_json

REPO = Path(__file__).resolve().parents[2]

WORKER = r"""
import json
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcolossal.runtime.launch import launch_from_env

key = launch_from_env(seed=7, verbose=False)
rank = jax.process_index()
gathered = multihost_utils.process_allgather(np.array([rank], np.int32))
mesh = Mesh(np.array(jax.devices()), ("d",))
local = np.arange(2, dtype=np.float32) + 2 * rank  # process 0: [0, 1], process 1: [2, 3]
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local, (4,))
total = jax.jit(lambda a: (a * a).sum(), out_shardings=NamedSharding(mesh, P()))(x)
print("RESULT " + json.dumps(dict(
    rank=rank,
    process_count=jax.process_count(),
    device_count=jax.device_count(),
    local_device_count=jax.local_device_count(),
    gathered=np.asarray(gathered).ravel().tolist(),
    total=float(total),
    key=np.asarray(jax.random.key_data(key)).tolist(),
)), flush=True)
"""

_STRIP = ("SLURM_", "OMPI_", "PMI_", "JAX_LOCAL_DEVICE_IDS", "JAX_COORDINATOR")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_two_process_launch_from_env():
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP)}
    base.update(
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(REPO), base.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    procs = []
    for rank in range(2):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", WORKER], env=env, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        pytest.fail("2-process launch did not finish within 120 s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    results = []
    for rank, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"process {rank} exited with {rc}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
        found = tagged_json(out)
        assert len(found) == 1, f"process {rank} printed no result:\n{out}\n{err[-4000:]}"
        results.append(found[0])

    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["process_count"] == 2
        assert r["device_count"] == 4
        assert r["local_device_count"] == 2
        assert r["gathered"] == [0, 1]
        assert r["total"] == 0.0 + 1.0 + 4.0 + 9.0
    assert results[0]["key"] == results[1]["key"] == [0, 7]
