"""A small multi-process JAX program for the failure tests: steps of a cross-process all-reduce.

Run under ``python -m jaxcolossal.run`` (or with the torchrun variables set by hand). Each step
sums a global array built from per-process data, with a :class:`StepWatchdog` as in the training
loop. ``JAXCOLOSSAL_TEST_FAULT=kind:rank:step`` makes one process misbehave at one step:

* ``hang``: it sleeps for an hour, alive (heartbeats go on) but out of the collectives;
* ``die``: it ends at once with ``os._exit(3)``;
* ``leave``: it leaves the loop and exits normally (status 0).

Prints ``STEP <rank> <step> <value>`` per step and ``DONE <rank>`` at the end.
"""
import os
import sys
import time

from jaxcolossal.runtime.launch import collective_timeout, launch_from_env
from jaxcolossal.train.guard import StepWatchdog

launch_from_env(verbose=False)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

steps = int(os.environ.get("JAXCOLOSSAL_TEST_STEPS", "6"))
kind, fault_rank, fault_step = (os.environ.get("JAXCOLOSSAL_TEST_FAULT", "none:-1:-1").split(":") + ["-1", "-1"])[:3]
fault_rank, fault_step = int(fault_rank), int(fault_step)
rank = jax.process_index()
mesh = Mesh(np.array(jax.devices()), ("d",))
n_local = jax.local_device_count()
sharding = NamedSharding(mesh, P("d"))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))

with StepWatchdog(collective_timeout()) as watchdog:
    for step in range(steps):
        if rank == fault_rank and step == fault_step:
            print(f"FAULT {kind} {rank} {step}", flush=True)
            if kind == "hang":
                time.sleep(3600)
            elif kind == "die":
                os._exit(3)
            elif kind == "leave":
                break
        local = np.full((n_local,), float(step), np.float32)
        x = jax.make_array_from_process_local_data(sharding, local, (n_local * jax.process_count(),))
        print(f"STEP {rank} {step} {float(total(x))}", flush=True)
        watchdog.kick(f"step {step}")
print(f"DONE {rank}", flush=True)
sys.exit(0)
