"""Test setup: simulate 8 CPU devices before JAX's backend starts.

Every parallel configuration in the suite runs on these 8 simulated devices; the
core assertion is that it matches the single-device run.

Compiled programs are shared across tests through JAX's persistent compilation cache, in a
folder made for this session and removed at its end (the environment variables reach the
training subprocesses too): many tests compile the same step (the single-device baselines, the
main job's default config), and XLA's CPU compile is most of the suite's time. A cache hit is
the same executable (its HLO text and memory analysis included); set
``JAX_COMPILATION_CACHE_DIR`` yourself to choose the folder, or to an empty string to turn it off.

The CPU backend compiles at LLVM optimization level 0 (``--xla_backend_optimization_level=0``):
the suite's programs are tiny, so LLVM's optimization passes cost far more time than they save.
Measured on this 2-core machine in one session, the whole suite on two workers: 480 passed in
13:19 against 19:18 at the default level. XLA's HLO passes (fusion, sharding, scheduling: what
the HLO tests read) do not depend on it: a ZeRO-3 × tp 2 bf16 step compiled to the same HLO text
and the same memory analysis at both levels. Only the machine code differs. Put your own
``--xla_backend_optimization_level`` in ``XLA_FLAGS`` to test at another level. XLA's GPU compiler
(tests/gpu_compile, compile-only devices) reads the same ``XLA_FLAGS``; it also skips autotuning
(``--xla_gpu_autotune_level=0``), which has no GPU to time candidates on there anyway.
"""
import atexit
import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxcolossal-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
if "--xla_gpu_autotune_level" not in _flags:  # tests/gpu_compile: nothing to autotune without a GPU
    _flags += " --xla_gpu_autotune_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's GPU compiler for the compile-only devices of tests/gpu_compile: without this the CUDA plugin's
# version check calls cuInit, finds no GPU, and the plugin does not load
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


SLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def pytest_collection_modifyitems(config, items):
    """Mark the tests listed in ``tests/slow_tests.txt`` ``slow`` (README's command runs ``-m "not slow"``)."""
    with open(SLOW_LIST) as f:
        slow = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow:
            item.add_marker("slow")


def pytest_terminal_summary(terminalreporter):
    """One line that shows the ``gpu_compile`` tests ran (CI's log runs with ``-q``, which names no test)."""
    counts = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        reports = terminalreporter.stats.get(outcome, [])
        n = sum(1 for r in reports if (outcome in ("error", "skipped") or r.when == "call") and "gpu_compile" in getattr(r, "keywords", {}))
        if n:
            counts[outcome] = n
    if counts:
        terminalreporter.write_line("gpu_compile tests (XLA's GPU compiler, no GPU): "
                                    + ", ".join(f"{n} {k}" for k, n in counts.items()))
