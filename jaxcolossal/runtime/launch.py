"""Process launch in the style of Colossal-AI, ending in ``jax.distributed.initialize``.

Colossal-AI (``colossalai/initialize.py``) starts a job with ``launch`` or one of
``launch_from_torch`` / ``launch_from_slurm`` / ``launch_from_openmpi``, each of
which reads the launcher's environment variables, creates the torch process group
and seeds every RNG.  Here the process group is JAX's distributed runtime: every
launcher resolves ``(rank, world_size, host, port, local_rank)`` and hands them to
:func:`launch`, which calls :func:`jax.distributed.initialize`.

Two JAX rules shape the API:

* ``jax.distributed.initialize`` must run before JAX's backend starts, i.e. before
  the first array is created or ``jax.devices()`` is called.  Call a launcher
  first thing in the program.
* ``XLA_FLAGS`` is read when the backend starts, so :func:`simulate_devices` must
  also run before that.

As Colossal-AI does at import time, importing this module sets
``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless it is already set.

No silent hangs: one timeout, ``JAXCOLOSSAL_COLLECTIVE_TIMEOUT`` seconds (default 300, read by
:func:`collective_timeout`), bounds every way a multi-process job can wait for a peer that is
gone. :func:`launch` passes it to ``jax.distributed.initialize`` as the shutdown-barrier timeout
(and as the heartbeat timeout, capped at JAX's 100 s), so a dead process takes the others down;
on CPU it also sets ``--xla_cpu_collective_timeout_seconds`` so a gloo collective whose peer
never arrives fails instead of waiting for ever. NCCL has no such timeout, so the training loop
runs a :class:`~jaxcolossal.train.guard.StepWatchdog` that aborts a process making no progress
for that long.
``python -m jaxcolossal.run --timeout S`` sets the variable for every process it starts.
"""
from __future__ import annotations

import os
import random
import re
import sys
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax._src import xla_bridge as _xla_bridge

from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.platforms import cuda_plugin_installed, nvidia_device_present

# Colossal-AI sets this at import so that communication kernels are issued in order
# with compute on a single hardware queue; keep a user's own value.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

__all__ = [
    "simulate_devices",
    "set_seed",
    "launch",
    "launch_from_env",
    "launch_from_torch",
    "launch_from_slurm",
    "launch_from_openmpi",
    "collective_timeout",
    "COLLECTIVE_TIMEOUT_ENV",
    "WATCHDOG_EXIT_CODE",
    "COORDINATOR_PORT_ENV",
    "coordinator_port",
]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"

COLLECTIVE_TIMEOUT_ENV = "JAXCOLOSSAL_COLLECTIVE_TIMEOUT"
DEFAULT_COLLECTIVE_TIMEOUT = 300  # seconds; PyTorch's NCCL watchdog uses 600, JAX's shutdown barrier 300
_MAX_HEARTBEAT_TIMEOUT = 100  # jax.distributed.initialize's own default
WATCHDOG_EXIT_CODE = 124  # as timeout(1)

# Names read by each launcher.  A tuple entry lists alternatives, first preferred.
_TORCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_VARS = ("SLURM_PROCID", ("SLURM_NPROCS", "SLURM_NTASKS"), "SLURM_LOCALID")
_OPENMPI_VARS = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
)


# --------------------------------------------------------------------------- helpers
def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """Return ``value`` as int; TypeError if not an int, ValueError if outside [low, high]."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise ValueError(f"{name} must be >= {low}{upper}, got {value}")
    return value


def backend_started() -> bool:
    """Whether JAX's backend has started (XLA_FLAGS and distributed init are then too late)."""
    return _xla_bridge.backends_are_initialized()


def _cpu_may_be_used(platforms: str | None | object = ...) -> bool:
    """Whether the CPU platform may be among JAX's platforms, decided without starting a backend.

    ``platforms`` defaults to ``jax.config.jax_platforms`` (initialised from
    ``JAX_PLATFORMS``). True when it is unset/empty or lists ``cpu``; False when it
    names only accelerators (e.g. ``cuda`` or ``tpu``).
    """
    if platforms is ...:
        platforms = jax.config.jax_platforms
    if not platforms:
        return True
    return "cpu" in [p.strip().lower() for p in platforms.split(",")]


def _cuda_plugin_without_gpu() -> bool:
    """A CUDA plugin is installed (``pip install -e ".[gpu-compile]"``, for compiling for GPUs
    without one) on a machine with no NVIDIA device node: jax would try to start a GPU backend,
    fail, and log the failure before falling back to the CPU."""
    return cuda_plugin_installed() and not nvidia_device_present()


def use_cpu_without_gpu() -> None:
    """Pin jax to the CPU where a CUDA plugin is installed but no NVIDIA device is present (and no
    ``JAX_PLATFORMS`` is set), so that the plugin does not try a GPU and log a traceback: for tools
    that run on the host's arrays only (``scripts/convert_hf.py``). A no-op once jax's backend has
    started."""
    if not jax.config.jax_platforms and not backend_started() and _cuda_plugin_without_gpu():
        jax.config.update("jax_platforms", "cpu")


def _with_device_count_flag(xla_flags: str, n: int) -> str:
    """Return ``xla_flags`` with any host-device-count flag replaced by ``=n`` (pure)."""
    kept = [
        tok for tok in xla_flags.split()
        if not re.fullmatch(re.escape(_DEVICE_COUNT_FLAG) + r"(=.*)?", tok)
    ]
    return " ".join(kept + [f"{_DEVICE_COUNT_FLAG}={n}"])


def _format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets (``[::1]:29500``)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _read_env(
    names: Sequence[str | tuple[str, ...]],
    env: Mapping[str, str],
    *,
    optional: Sequence[str] = (),
    strings: Sequence[str] = (),
    source: str = "the launcher",
) -> dict[str, int | str | None]:
    """Read launcher variables from ``env`` (pure: it only looks at ``env``).

    Args:
      names: variable names; a tuple lists alternatives, the first present one wins and
        the result is keyed by the first name of the tuple.
      env: the environment mapping, e.g. ``os.environ``. An empty value counts as unset.
      optional: names that may be missing; they map to ``None``.
      strings: names kept as strings; all others are parsed as integers.
      source: launcher name used in error messages.

    Returns:
      ``{name: value}`` for every entry of ``names``.

    Raises:
      RuntimeError: one or more required variables are unset; the message names all of them.
      ValueError: a variable that must be an integer is not; the message names it.
    """
    out: dict[str, int | str | None] = {}
    missing: list[str] = []
    for entry in names:
        alternatives = (entry,) if isinstance(entry, str) else tuple(entry)
        key = alternatives[0]
        found = next((a for a in alternatives if env.get(a, "").strip() != ""), None)
        if found is None:
            if key in optional:
                out[key] = None
            else:
                missing.append(" or ".join(alternatives))
            continue
        raw = env[found].strip()
        if key in strings:
            out[key] = raw
        else:
            try:
                out[key] = int(raw)
            except ValueError:
                raise ValueError(
                    f"environment variable {found} must be an integer, got {raw!r}"
                ) from None
    if missing:
        raise RuntimeError(
            f"Could not find environment variable(s) {', '.join(missing)} set by {source}; "
            "they are needed to launch."
        )
    return out


def collective_timeout(env: Mapping[str, str] | None = None) -> int:
    """Seconds a process may wait for its peers: ``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT``, default 300.

    Used for the distributed shutdown barrier, the heartbeat (capped at 100 s), the CPU (gloo)
    collective timeout and the training loop's :class:`~jaxcolossal.train.guard.StepWatchdog`.

    Raises:
      ValueError: the variable is set but is not a positive integer.
    """
    env = os.environ if env is None else env
    raw = env.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_COLLECTIVE_TIMEOUT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV} must be a positive integer (seconds), got {raw!r}")
    return value


def _install_fail_fast_excepthook() -> None:
    """Make an uncaught exception end a multi-process job's process at once.

    Python would otherwise run ``jax.distributed.shutdown`` at exit, which waits at the shutdown
    barrier (up to the collective timeout) while the other processes sit in a collective that
    this one will never join. Exiting without it lets them fail fast ("connection closed" from
    gloo, a failed heartbeat from the coordination service) and a launcher see the failure now.
    The traceback is printed first by the previous hook. Installed once by :func:`launch`.
    """
    previous = sys.excepthook
    if getattr(previous, "_jaxcolossal_fail_fast", False):
        return

    def hook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
            if not issubclass(exc_type, KeyboardInterrupt):
                sys.stderr.write(
                    f"jaxcolossal: uncaught {exc_type.__name__} in process {jax.process_index()} of "
                    f"{jax.process_count()}; exiting now (status 1) without waiting for the other "
                    f"processes at the distributed shutdown barrier.\n")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    hook._jaxcolossal_fail_fast = True
    sys.excepthook = hook


def _set_flag_default(xla_flags: str, flag: str, value: object) -> str:
    """Append ``flag=value`` to ``xla_flags`` unless the flag is already there (the user's wins)."""
    if any(re.fullmatch(re.escape(flag) + r"(=.*)?", tok) for tok in xla_flags.split()):
        return xla_flags
    return " ".join(xla_flags.split() + [f"{flag}={value}"])


# --------------------------------------------------------------------------- public
GPU_MEMORY_FRACTION = "0.9"
"""The share of each GPU's memory JAX preallocates for the run (``XLA_PYTHON_CLIENT_MEM_FRACTION``;
jax's own default is 0.75): the planner's rule that a layout fits in 90% of the memory, and
NVIDIA's recommendation for LLM training (JAX-Toolbox)."""


def gpu_memory_fraction(fraction: str = GPU_MEMORY_FRACTION) -> str:
    """Set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to ``fraction`` unless it is set already (the user's
    value wins), before JAX's backend starts; returns the value in effect. It only sizes the GPU
    allocator's pool (inert on the CPU). ``scripts/train.py`` calls it; call it first in a
    notebook that trains on GPUs."""
    return os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)


def simulate_devices(n: int) -> None:
    """Make the host (CPU) platform expose ``n`` devices, for CPU runs and notebooks.

    Sets ``--xla_force_host_platform_device_count=n`` in ``XLA_FLAGS``, replacing an
    existing value of that flag and keeping the other flags. XLA reads the flag when
    JAX's backend starts, so call this before any JAX computation.

    Accelerator rule (decided without starting the backend): the call is a no-op when
    ``jax_platforms`` / ``JAX_PLATFORMS`` is set and does not list ``cpu`` (e.g.
    ``JAX_PLATFORMS=cuda``). When it is unset the flag is set; it changes only the CPU
    platform, so on a GPU/TPU host the accelerator devices JAX uses are unaffected.
    If the backend already started and its default platform is not CPU, it is a no-op.

    There is no Colossal-AI counterpart (torch needs no device simulation); it plays
    the role of starting ``n`` processes with ``torchrun --nproc_per_node=n`` on CPU.

    Args:
      n: number of host devices, >= 1.

    Raises:
      TypeError: ``n`` is not an int.
      ValueError: ``n`` < 1.
      RuntimeError: JAX's backend is already started with a different number of CPU
        devices (the flag can no longer take effect: restart the process or the
        notebook kernel), or ``jax_num_cpu_devices`` is set to a different count
        (that option overrides the flag).
    """
    n = _check_int("n", n, 1)
    if not _cpu_may_be_used():
        return
    use_cpu_without_gpu()  # else the CUDA plugin tries a GPU and logs a traceback
    if backend_started():
        if jax.default_backend() != "cpu":
            return
        have = len(jax.local_devices(backend="cpu"))
        if have != n:
            raise RuntimeError(
                f"simulate_devices({n}): JAX's backend is already initialised with {have} "
                f"CPU device(s); XLA_FLAGS is only read when the backend starts. Call "
                f"simulate_devices before any JAX computation (restart the process or "
                f"notebook kernel)."
            )
        return
    num_cpu = jax.config.jax_num_cpu_devices
    if num_cpu is not None and num_cpu >= 0 and num_cpu != n:
        raise RuntimeError(
            f"simulate_devices({n}): jax_num_cpu_devices is set to {num_cpu}, which "
            f"overrides {_DEVICE_COUNT_FLAG}; unset it or set it to {n}."
        )
    os.environ["XLA_FLAGS"] = _with_device_count_flag(os.environ.get("XLA_FLAGS", ""), n)


def set_seed(seed: int) -> jax.Array:
    """Seed Python's ``random`` and NumPy's global RNG, and return ``jax.random.key(seed)``.

    Mirrors ``colossalai.utils.set_seed`` (which seeds ``random``, NumPy and torch).
    JAX has no global RNG state, so the JAX key is returned for the caller to thread
    through. Creating the key starts JAX's backend: in a multi-process run call it
    after :func:`launch` (the launchers do so).

    Args:
      seed: integer seed in ``[0, 2**32 - 1]`` (NumPy's range).

    Returns:
      A new-style typed PRNG key (``jax.random.key``); equal on every process.

    Raises:
      TypeError: ``seed`` is not an int.
      ValueError: ``seed`` is outside ``[0, 2**32 - 1]``.
    """
    seed = _check_int("seed", seed, 0, 2**32 - 1)
    random.seed(seed)
    np.random.seed(seed)
    return jax.random.key(seed)


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    *,
    local_device_ids: int | Sequence[int] | str | None = None,
    initialization_timeout: int = 300,
    cpu_collectives: str | None = "gloo",
    collective_timeout_s: int | None = None,
    heartbeat_timeout_s: int | None = None,
) -> jax.Array:
    """Join the distributed JAX job and seed the RNGs; mirrors ``colossalai.launch``.

    Validates the arguments; where the CPU may be used (:func:`simulate_devices`'s rule) sets
    ``jax_cpu_collectives_implementation``; calls ``jax.distributed.initialize`` (skipped for
    ``world_size == 1``: one process needs no coordinator); seeds with :func:`set_seed`; logs on
    process 0. With ``world_size > 1`` an uncaught exception then ends the process at once, after
    its traceback (``os._exit(1)``), instead of at the distributed shutdown barrier.

    Args:
      rank: global process index, ``0 <= rank < world_size`` (Colossal-AI's rank is
        per GPU; here it is per JAX process, which may own several devices).
      world_size: number of processes, >= 1.
      host: address of process 0 (hostname, IPv4 or IPv6 literal; IPv6 is put in
        brackets, e.g. ``[::1]:29500``).
      port: TCP port of the coordinator on ``host``, 1..65535.
      local_rank: index of this process on its node, or None.
      seed: RNG seed, see :func:`set_seed`.
      verbose: log the initialised world on process 0.
      local_device_ids: devices this process owns (JAX's own cluster detection is switched
        off, so this choice is final). None: ``[local_rank]`` when
        ``local_rank`` is given (one device per process, as with torchrun, Slurm and
        Open MPI and as JAX's own Slurm/Open MPI detection does), else all local
        devices. ``"all"``: every local device even though ``local_rank`` is given
        (one process per host). An int or a sequence of ints is passed as is. Only
        GPU platforms honour it; on CPU every process sees all its host devices.
      initialization_timeout: seconds to wait for all processes to connect.
      cpu_collectives: ``"gloo"``, ``"mpi"`` or ``"megascale"`` for cross-process
        collectives on CPU; None leaves JAX's setting unchanged.
      collective_timeout_s: seconds a process waits for a peer that is gone (default
        :func:`collective_timeout`, i.e. ``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT`` or 300). It becomes
        ``shutdown_timeout_seconds`` and, capped at 100, ``heartbeat_timeout_seconds`` of
        ``jax.distributed.initialize``; when the CPU may be used,
        ``--xla_cpu_collective_timeout_seconds`` is added to ``XLA_FLAGS`` unless already there.
      heartbeat_timeout_s: seconds without a heartbeat before a process is declared dead, >= 1
        (``parallel.heartbeat_timeout_s``); None: ``collective_timeout_s`` capped at 100.

    Returns:
      ``jax.random.key(seed)``.

    Raises:
      TypeError: an integer argument is not an int, or ``host`` is not a string.
      ValueError: ``world_size`` < 1, ``rank`` outside ``[0, world_size)``, ``port``
        outside 1..65535, ``local_rank`` < 0, empty ``host``, negative
        ``initialization_timeout``, an unknown ``cpu_collectives`` or a bad
        ``local_device_ids`` string.
      RuntimeError: JAX's backend already started (``jax.distributed.initialize``
        must come first) or the distributed runtime is already initialised; errors
        from ``jax.distributed.initialize`` itself (e.g. timeout) propagate.
    """
    world_size, rank, host, port, local_rank, initialization_timeout, collective_timeout_s = _check_launch_args(
        rank, world_size, host, port, local_rank, initialization_timeout, cpu_collectives, collective_timeout_s)
    device_ids = _device_ids(local_device_ids, local_rank)
    coordinator = _format_address(host, port)
    if world_size > 1:
        _initialize(coordinator, world_size, rank, device_ids, initialization_timeout, cpu_collectives,
                    collective_timeout_s, heartbeat_timeout_s)
    key = set_seed(seed)
    if verbose:
        get_dist_logger().info(
            f"Distributed environment is initialized, world size: {jax.process_count()} "
            f"process(es), {jax.device_count()} device(s); coordinator {coordinator}; "
            f"seed {seed}",
            ranks=[0],
        )
    return key


def _check_launch_args(rank, world_size, host, port, local_rank, initialization_timeout, cpu_collectives,
                       collective_timeout_s) -> tuple:
    """:func:`launch`'s arguments checked (its ``Raises``), with ``host`` stripped and the default
    collective timeout filled in."""
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    if not isinstance(host, str):
        raise TypeError(f"host must be a str, got {type(host).__name__}")
    host = host.strip()
    if not host:
        raise ValueError("host must be a non-empty address")
    port = _check_int("port", port, 1, 65535)
    if local_rank is not None:
        local_rank = _check_int("local_rank", local_rank, 0)
    initialization_timeout = _check_int("initialization_timeout", initialization_timeout, 0)
    if collective_timeout_s is None:
        collective_timeout_s = collective_timeout()
    collective_timeout_s = _check_int("collective_timeout_s", collective_timeout_s, 1)
    if cpu_collectives is not None and not isinstance(cpu_collectives, str):
        raise TypeError(f"cpu_collectives must be a str or None, got {cpu_collectives!r}")
    return world_size, rank, host, port, local_rank, initialization_timeout, collective_timeout_s


def _device_ids(local_device_ids, local_rank: int | None) -> list[int] | None:
    """The ``local_device_ids`` :func:`launch` passes on (its argument's rules)."""
    if isinstance(local_device_ids, str):
        if local_device_ids != "all":
            raise ValueError(f"local_device_ids string must be 'all', got {local_device_ids!r}")
        return None
    if local_device_ids is None:
        return None if local_rank is None else [local_rank]
    if _is_int(local_device_ids):
        return [_check_int("local_device_ids", local_device_ids, 0)]
    return [_check_int("local_device_ids[i]", d, 0) for d in local_device_ids]


def _initialize(coordinator: str, world_size: int, rank: int, device_ids, initialization_timeout: int,
                cpu_collectives: str | None, collective_timeout_s: int, heartbeat_s: int | None) -> None:
    """``jax.distributed.initialize`` with CPU collectives and timeouts set, and the fail-fast hook;
    ``heartbeat_s`` None: the collective timeout capped at 100 s."""
    heartbeat_s = (min(collective_timeout_s, _MAX_HEARTBEAT_TIMEOUT) if heartbeat_s is None
                   else _check_int("heartbeat_timeout_s", heartbeat_s, 1))
    if backend_started():
        raise RuntimeError(
            "launch() must run before any JAX computation: the backend has already "
            "started, so jax.distributed.initialize can no longer take effect."
        )
    if _cpu_may_be_used():
        if cpu_collectives is not None:
            jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        os.environ["XLA_FLAGS"] = _set_flag_default(
            os.environ.get("XLA_FLAGS", ""), _CPU_COLLECTIVE_TIMEOUT_FLAG, collective_timeout_s)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=world_size,
        process_id=rank,
        local_device_ids=device_ids,
        # every value is given: keep JAX's Slurm/Open MPI detection from replacing
        # local_device_ids=None ("all") with [SLURM_LOCALID] and hiding the other GPUs
        cluster_detection_method="deactivate",
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_s,
        shutdown_timeout_seconds=collective_timeout_s,
    )
    _install_fail_fast_excepthook()


def _launch_kwargs(verbose, local_device_ids, initialization_timeout, cpu_collectives, heartbeat_timeout_s=None):
    return dict(
        verbose=verbose,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        cpu_collectives=cpu_collectives,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )


def launch_from_env(
    seed: int = 1024,
    verbose: bool = True,
    *,
    local_device_ids: int | Sequence[int] | str | None = None,
    initialization_timeout: int = 300,
    cpu_collectives: str | None = "gloo",
    heartbeat_timeout_s: int | None = None,
) -> jax.Array:
    """Launch from the torchrun-style environment; mirrors ``colossalai.launch_from_torch``.

    Reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (set by ``torchrun`` or by hand) and calls :func:`launch`, with the coordinator on
    :func:`coordinator_port` (``MASTER_PORT``, or ``MASTER_PORT + 1`` under torchrun's elastic agent,
    whose own store holds ``MASTER_PORT``). If NONE of them is set
    it is a single-process run: nothing is initialised, the RNGs are just seeded. An
    empty value counts as unset.

    Args:
      seed, verbose, local_device_ids, initialization_timeout, cpu_collectives, heartbeat_timeout_s: as in
        :func:`launch` (``LOCAL_RANK`` becomes ``local_rank``).

    Returns:
      ``jax.random.key(seed)``.

    Raises:
      RuntimeError: some but not all five variables are set; the message names every
        missing one.
      ValueError: a variable that must be an integer is not (the message names it), or
        any ValueError of :func:`launch` (e.g. bad port).
    """
    kwargs = _launch_kwargs(verbose, local_device_ids, initialization_timeout, cpu_collectives, heartbeat_timeout_s)
    if all(os.environ.get(n, "").strip() == "" for n in _TORCH_VARS):
        return set_seed(seed)
    v = _read_env(_TORCH_VARS, os.environ, strings=("MASTER_ADDR",), source="torchrun")
    return launch(
        rank=v["RANK"], world_size=v["WORLD_SIZE"], host=v["MASTER_ADDR"],
        port=coordinator_port(os.environ), local_rank=v["LOCAL_RANK"], seed=seed, **kwargs,
    )


COORDINATOR_PORT_ENV = "JAXCOLOSSAL_COORDINATOR_PORT"
"""The port of ``jax.distributed``'s coordinator when it must differ from ``MASTER_PORT`` (read by
:func:`coordinator_port`)."""


def coordinator_port(env: Mapping[str, str]) -> int:
    """The port :func:`launch_from_env` gives ``jax.distributed``'s coordinator (on ``MASTER_ADDR``):
    ``$JAXCOLOSSAL_COORDINATOR_PORT`` when set; else, under torchrun's elastic agent with its store shared
    with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``: the agent's own TCPStore already listens on
    ``MASTER_PORT``), ``MASTER_PORT + 1``; else ``MASTER_PORT``. The same on every process, with no
    exchange (docs/fault_tolerance.md).

    Raises:
        RuntimeError: ``MASTER_PORT`` is unset (and no coordinator port is given).
        ValueError: a port that is not an integer, or ``MASTER_PORT + 1`` above 65535.
    """
    if env.get(COORDINATOR_PORT_ENV, "").strip():
        return int(_read_env((COORDINATOR_PORT_ENV,), env, source="the user")[COORDINATOR_PORT_ENV])
    port = int(_read_env(("MASTER_PORT",), env, source="torchrun")["MASTER_PORT"])
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() != "true":
        return port
    if port >= 65535:
        raise ValueError(f"MASTER_PORT={port} is torchrun's agent store; the coordinator takes MASTER_PORT + 1, "
                         f"which is not a port: set {COORDINATOR_PORT_ENV}")
    return port + 1


launch_from_torch = launch_from_env


def launch_from_slurm(
    host: str,
    port: int,
    seed: int = 1024,
    verbose: bool = True,
    *,
    local_device_ids: int | Sequence[int] | str | None = None,
    initialization_timeout: int = 300,
    cpu_collectives: str | None = "gloo",
) -> jax.Array:
    """Launch inside ``srun``; mirrors ``colossalai.launch_from_slurm``.

    Reads ``SLURM_PROCID`` (rank), ``SLURM_NPROCS`` or, failing that,
    ``SLURM_NTASKS`` (world size) and the optional ``SLURM_LOCALID`` (local rank),
    then calls :func:`launch` with ``host``/``port`` as the coordinator.

    Args:
      host: address of the node running rank 0 (e.g. the first of
        ``scontrol show hostnames $SLURM_JOB_NODELIST``).
      port: free TCP port on that node, 1..65535.
      seed, verbose, local_device_ids, initialization_timeout, cpu_collectives: as in
        :func:`launch`.

    Returns:
      ``jax.random.key(seed)``.

    Raises:
      RuntimeError: a required variable is unset; the message names every missing one.
      ValueError: a variable is not an integer (named), or any ValueError of
        :func:`launch`.
    """
    v = _read_env(_SLURM_VARS, os.environ, optional=("SLURM_LOCALID",), source="Slurm")
    return launch(
        rank=v["SLURM_PROCID"], world_size=v["SLURM_NPROCS"], host=host, port=port,
        local_rank=v["SLURM_LOCALID"], seed=seed,
        **_launch_kwargs(verbose, local_device_ids, initialization_timeout, cpu_collectives),
    )


def launch_from_openmpi(
    host: str,
    port: int,
    seed: int = 1024,
    verbose: bool = True,
    *,
    local_device_ids: int | Sequence[int] | str | None = None,
    initialization_timeout: int = 300,
    cpu_collectives: str | None = "gloo",
) -> jax.Array:
    """Launch inside ``mpirun`` (Open MPI); mirrors ``colossalai.launch_from_openmpi``.

    Reads ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK`` and
    ``OMPI_COMM_WORLD_SIZE``, then calls :func:`launch` with ``host``/``port`` as
    the coordinator.

    Args:
      host: address of the node running rank 0.
      port: free TCP port on that node, 1..65535.
      seed, verbose, local_device_ids, initialization_timeout, cpu_collectives: as in
        :func:`launch`.

    Returns:
      ``jax.random.key(seed)``.

    Raises:
      RuntimeError: a variable is unset; the message names every missing one.
      ValueError: a variable is not an integer (named), or any ValueError of
        :func:`launch`.
    """
    v = _read_env(_OPENMPI_VARS, os.environ, source="Open MPI")
    return launch(
        rank=v["OMPI_COMM_WORLD_RANK"], world_size=v["OMPI_COMM_WORLD_SIZE"], host=host,
        port=port, local_rank=v["OMPI_COMM_WORLD_LOCAL_RANK"], seed=seed,
        **_launch_kwargs(verbose, local_device_ids, initialization_timeout, cpu_collectives),
    )
