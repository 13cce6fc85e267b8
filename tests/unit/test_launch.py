"""Tests for jaxcolossal.runtime.launch and jaxcolossal.runtime.dist_logger (single process).

``jax.distributed.initialize`` is replaced by a recorder: these tests check what the
launchers would pass to it. tests/multihost/test_launch_real.py runs the real thing.
"""
import importlib
import logging
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxcolossal.runtime import dist_logger

L = importlib.import_module("jaxcolossal.runtime.launch")  # the module (the package re-exports a function named launch)

ALL_LAUNCH_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NPROCS", "SLURM_NTASKS", "SLURM_LOCALID",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
)


@pytest.fixture
def calls(monkeypatch):
    """Clean launcher environment; records jax.distributed.initialize calls.

    Each record also holds the CPU collectives setting at call time, to check that it
    was set before initialize. The backend of this test process has started (other
    tests ran computations), so launch's "backend already started" guard is patched off.
    """
    for name in ALL_LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    saved_impl = jax.config.jax_cpu_collectives_implementation
    records = []

    def fake_initialize(**kwargs):
        kwargs["_cpu_collectives"] = jax.config.jax_cpu_collectives_implementation
        records.append(kwargs)

    monkeypatch.setattr(jax.distributed, "initialize", fake_initialize)
    monkeypatch.setattr(L, "backend_started", lambda: False)
    yield records
    jax.config.update("jax_cpu_collectives_implementation", saved_impl)


def _key_data(key):
    return np.asarray(jax.random.key_data(key)).tolist()


def _set(monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))


# ------------------------------------------------------------------ launch_from_env
def test_launch_from_env_ipv4(calls, monkeypatch):
    _set(monkeypatch, RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, MASTER_ADDR="10.1.2.3", MASTER_PORT=29500)
    key = L.launch_from_env(seed=42, verbose=False)
    assert len(calls) == 1
    c = calls[0]
    assert c["coordinator_address"] == "10.1.2.3:29500"
    assert c["num_processes"] == 4
    assert c["process_id"] == 3
    assert c["local_device_ids"] == [1]
    assert c["initialization_timeout"] == 300
    assert _key_data(key) == _key_data(jax.random.key(42))


@pytest.mark.parametrize(
    "addr, expected",
    [("::1", "[::1]:29501"), ("fe80::1:2", "[fe80::1:2]:29501"), ("[::1]", "[::1]:29501")],
)
def test_launch_from_env_ipv6_in_brackets(calls, monkeypatch, addr, expected):
    _set(monkeypatch, RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, MASTER_ADDR=addr, MASTER_PORT=29501)
    L.launch_from_env(verbose=False)
    assert calls[0]["coordinator_address"] == expected
    assert calls[0]["process_id"] == 0 and calls[0]["num_processes"] == 2


def test_launch_from_torch_is_alias():
    assert L.launch_from_torch is L.launch_from_env


def test_launch_from_env_without_variables_is_single_process(calls):
    key = L.launch_from_env(seed=5)
    assert calls == []
    assert _key_data(key) == _key_data(jax.random.key(5))
    # Python and NumPy RNGs were seeded with 5 too.
    assert random.random() == random.Random(5).random()
    assert np.random.rand() == np.random.RandomState(5).rand()


def test_launch_from_env_names_exactly_the_missing_variables(calls, monkeypatch):
    _set(monkeypatch, RANK=0, WORLD_SIZE=2)
    with pytest.raises(
        RuntimeError,
        match=r"Could not find environment variable\(s\) LOCAL_RANK, MASTER_ADDR, MASTER_PORT set by torchrun;",
    ):
        L.launch_from_env(verbose=False)
    assert calls == []


def test_launch_from_env_empty_value_counts_as_missing(calls, monkeypatch):
    _set(monkeypatch, RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, MASTER_ADDR="", MASTER_PORT=1234)
    with pytest.raises(RuntimeError, match=r"variable\(s\) MASTER_ADDR set by"):
        L.launch_from_env(verbose=False)


def test_launch_from_env_non_integer_names_variable(calls, monkeypatch):
    _set(monkeypatch, RANK="one", LOCAL_RANK=0, WORLD_SIZE=2, MASTER_ADDR="h", MASTER_PORT=1234)
    with pytest.raises(ValueError, match=r"environment variable RANK must be an integer, got 'one'"):
        L.launch_from_env(verbose=False)
    assert calls == []


def test_launch_from_env_bad_port_from_env(calls, monkeypatch):
    _set(monkeypatch, RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, MASTER_ADDR="h", MASTER_PORT=70000)
    with pytest.raises(ValueError, match="port"):
        L.launch_from_env(verbose=False)
    assert calls == []


# ------------------------------------------------------------------ slurm / openmpi
def test_launch_from_slurm(calls, monkeypatch):
    _set(monkeypatch, SLURM_PROCID=5, SLURM_NPROCS=8, SLURM_LOCALID=1, SLURM_NTASKS=99)
    L.launch_from_slurm("node-17", 12345, verbose=False, initialization_timeout=30)
    c = calls[0]
    assert (c["coordinator_address"], c["num_processes"], c["process_id"]) == ("node-17:12345", 8, 5)
    assert c["local_device_ids"] == [1]
    assert c["initialization_timeout"] == 30


def test_launch_from_slurm_ntasks_fallback_and_optional_localid(calls, monkeypatch):
    _set(monkeypatch, SLURM_PROCID=2, SLURM_NTASKS=3)
    L.launch_from_slurm("2001:db8::7", 80, verbose=False)
    c = calls[0]
    assert (c["coordinator_address"], c["num_processes"], c["process_id"]) == ("[2001:db8::7]:80", 3, 2)
    assert c["local_device_ids"] is None


def test_launch_from_slurm_missing(calls, monkeypatch):
    _set(monkeypatch, SLURM_LOCALID=0)
    with pytest.raises(
        RuntimeError, match=r"variable\(s\) SLURM_PROCID, SLURM_NPROCS or SLURM_NTASKS set by Slurm;"
    ):
        L.launch_from_slurm("h", 1234, verbose=False)
    _set(monkeypatch, SLURM_PROCID=0)
    with pytest.raises(RuntimeError, match=r"variable\(s\) SLURM_NPROCS or SLURM_NTASKS set by Slurm;"):
        L.launch_from_slurm("h", 1234, verbose=False)
    assert calls == []


def test_launch_from_openmpi(calls, monkeypatch):
    _set(monkeypatch, OMPI_COMM_WORLD_RANK=6, OMPI_COMM_WORLD_LOCAL_RANK=2, OMPI_COMM_WORLD_SIZE=7)
    L.launch_from_openmpi("::1", 29500, verbose=False)
    c = calls[0]
    assert (c["coordinator_address"], c["num_processes"], c["process_id"]) == ("[::1]:29500", 7, 6)
    assert c["local_device_ids"] == [2]


def test_launch_from_openmpi_missing(calls, monkeypatch):
    _set(monkeypatch, OMPI_COMM_WORLD_RANK=0)
    with pytest.raises(
        RuntimeError,
        match=r"variable\(s\) OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_SIZE set by Open MPI;",
    ):
        L.launch_from_openmpi("h", 1234, verbose=False)
    assert calls == []


def test_read_env_is_pure():
    env = {"A": " 3 ", "B": "x", "D": "4"}
    out = L._read_env(("A", "B", ("C", "D"), "E"), env, optional=("E",), strings=("B",))
    assert out == {"A": 3, "B": "x", "C": 4, "E": None}


# ------------------------------------------------------------------ launch
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, world_size=2), "rank must be < world_size=2"),
        (dict(rank=-1, world_size=2), "rank must be >= 0"),
        (dict(rank=0, world_size=0), "world_size must be >= 1"),
        (dict(port=0), "port must be >= 1 and <= 65535"),
        (dict(port=65536), "port must be >= 1 and <= 65535"),
        (dict(host="  "), "host must be a non-empty"),
        (dict(local_rank=-1), "local_rank must be >= 0"),
        (dict(local_device_ids="some"), "must be 'all'"),
    ],
)
def test_launch_bad_arguments(calls, kwargs, match):
    args = dict(rank=0, world_size=2, host="127.0.0.1", port=29500, verbose=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        L.launch(**args)
    assert calls == []


def test_launch_bad_types(calls):
    with pytest.raises(TypeError, match="rank must be an int"):
        L.launch("0", 2, "h", 29500, verbose=False)
    with pytest.raises(TypeError, match="port must be an int"):
        L.launch(0, 2, "h", 29500.0, verbose=False)
    assert calls == []


def test_launch_single_process_skips_initialize(calls):
    key = L.launch(0, 1, "127.0.0.1", 29500, seed=9, verbose=False)
    assert calls == []
    assert _key_data(key) == _key_data(jax.random.key(9))


@pytest.mark.parametrize(
    "local_rank, ids, expected",
    [(3, None, [3]), (3, "all", None), (None, None, None), (3, [0, 1], [0, 1]), (None, 2, [2])],
)
def test_launch_local_device_ids(calls, local_rank, ids, expected):
    L.launch(1, 2, "h", 1, local_rank=local_rank, verbose=False, local_device_ids=ids)
    assert calls[0]["local_device_ids"] == expected


def test_launch_sets_cpu_collectives_before_initialize(calls):
    L.launch(0, 2, "h", 1234, verbose=False, cpu_collectives="mpi")
    assert calls[0]["_cpu_collectives"] == "mpi"


def test_launch_leaves_cpu_collectives_alone_without_cpu(calls, monkeypatch):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    monkeypatch.setattr(L, "_cpu_may_be_used", lambda: False)
    L.launch(0, 2, "h", 1234, verbose=False, cpu_collectives="mpi")
    assert calls[0]["_cpu_collectives"] == "gloo"


def test_launch_after_backend_started_raises(calls, monkeypatch):
    monkeypatch.setattr(L, "backend_started", lambda: True)
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        L.launch(0, 2, "h", 1234, verbose=False)
    assert calls == []


def test_launch_sets_cuda_device_max_connections():
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") is not None


# ------------------------------------------------------------------ set_seed
def test_set_seed():
    k = L.set_seed(123)
    a, b = random.random(), np.random.rand()
    k2 = L.set_seed(123)
    assert (random.random(), np.random.rand()) == (a, b)
    assert _key_data(k) == _key_data(k2) == _key_data(jax.random.key(123))
    assert _key_data(L.set_seed(124)) != _key_data(k)
    with pytest.raises(ValueError, match="seed"):
        L.set_seed(-1)
    with pytest.raises(TypeError, match="seed"):
        L.set_seed(1.5)


# ------------------------------------------------------------------ simulate_devices
def test_device_count_flag_replaced_and_other_flags_kept():
    flags = "--xla_foo=1 --xla_force_host_platform_device_count=8 --xla_bar"
    assert L._with_device_count_flag(flags, 2) == (
        "--xla_foo=1 --xla_bar --xla_force_host_platform_device_count=2"
    )
    assert L._with_device_count_flag("", 3) == "--xla_force_host_platform_device_count=3"


@pytest.mark.parametrize(
    "platforms, expected",
    [(None, True), ("", True), ("cpu", True), ("cuda,cpu", True), ("cuda", False), ("tpu", False)],
)
def test_cpu_may_be_used(platforms, expected):
    assert L._cpu_may_be_used(platforms) is expected


def test_simulate_devices_sets_flag_before_backend(monkeypatch):
    monkeypatch.setattr(L, "backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=8")
    L.simulate_devices(4)
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"


def test_simulate_devices_noop_on_accelerator(monkeypatch):
    monkeypatch.setattr(L, "backend_started", lambda: False)
    monkeypatch.setattr(L, "_cpu_may_be_used", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    L.simulate_devices(4)
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1"


def test_simulate_devices_after_backend_started(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    n = len(jax.local_devices(backend="cpu"))  # starts the backend (8 from conftest)
    L.simulate_devices(n)  # same count: fine
    with pytest.raises(RuntimeError, match=f"already initialised with {n} CPU device"):
        L.simulate_devices(n + 1)
    with pytest.raises(ValueError):
        L.simulate_devices(0)


def test_simulate_devices_takes_effect_in_fresh_process():
    """In a fresh interpreter (no XLA_FLAGS), the flag set by simulate_devices is used."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    script = (
        "from jaxcolossal.runtime.launch import simulate_devices\n"
        "simulate_devices(3)\n"
        "import jax\n"
        "print('COUNT', len(jax.local_devices(backend='cpu')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "COUNT 3" in out.stdout


# ------------------------------------------------------------------ dist logger
class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def fake_rank(monkeypatch):
    jax.devices()  # backend started, so the logger asks jax.process_index()
    state = {"rank": 0}
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: state["rank"])
    return state


def _new_logger(**kwargs):
    lg = dist_logger.get_dist_logger(f"test-{uuid.uuid4().hex}", **kwargs)
    h = _ListHandler()
    lg.logger.addHandler(h)
    return lg, h


def test_logger_ranks_filter(fake_rank):
    lg, h = _new_logger()
    fake_rank["rank"] = 1
    lg.info("everyone")
    lg.info("only0", ranks=[0])
    lg.warning("only1", ranks=[1])
    lg.error("zero-or-one", ranks=[0, 1])
    lg.debug("below level")
    assert h.messages == ["[rank 1] everyone", "[rank 1] only1", "[rank 1] zero-or-one"]
    fake_rank["rank"] = 0
    lg.info("only0", ranks=[0])
    lg.set_level("DEBUG")
    lg.debug("dbg", ranks=[0])
    assert h.messages[3:] == ["[rank 0] only0", "[rank 0] dbg"]


def test_logger_same_name_same_object_no_duplicate_handlers(tmp_path, fake_rank):
    name = f"test-{uuid.uuid4().hex}"
    a = dist_logger.get_dist_logger(name, log_file=tmp_path / "a.log", level="WARNING")
    n_handlers = len(a.logger.handlers)
    b = dist_logger.get_dist_logger(name, log_file=tmp_path / "a.log")
    c = dist_logger.get_dist_logger(name)
    assert a is b is c
    assert n_handlers == 2  # stderr + file
    assert len(a.logger.handlers) == n_handlers
    assert a.logger.level == logging.WARNING  # a later call does not reset the level
    assert a.logger.propagate is False


def test_logger_file_written_by_process_0_only(tmp_path, fake_rank):
    path = tmp_path / "sub" / "run.log"
    lg = dist_logger.get_dist_logger(f"test-{uuid.uuid4().hex}", log_file=path)
    fake_rank["rank"] = 1
    lg.info("from one")
    assert not path.exists()
    fake_rank["rank"] = 0
    lg.info("from zero")
    for h in lg.logger.handlers:
        h.flush()
    text = path.read_text()
    assert "[rank 0] from zero" in text
    assert "from one" not in text


def test_logger_bad_level():
    with pytest.raises(ValueError, match="unknown logging level"):
        dist_logger.get_dist_logger(f"test-{uuid.uuid4().hex}", level="LOUD")
