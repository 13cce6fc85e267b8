"""Test setup: simulate 8 CPU devices before JAX's backend starts.

Every parallel configuration in the suite runs on these 8 simulated devices; the
core assertion is that it matches the single-device run.

Compiled programs are shared across tests through JAX's persistent compilation cache, in a
folder made for this session and removed at its end (the environment variables reach the
training subprocesses too): many tests compile the same step (the single-device baselines, the
main job's default config), and XLA's CPU compile is most of the suite's time. A cache hit is
the same executable (its HLO text and memory analysis included); set
``JAX_COMPILATION_CACHE_DIR`` yourself to choose the folder, or to an empty string to turn it off.
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

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
