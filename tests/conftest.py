"""Test setup: simulate 8 CPU devices before JAX's backend starts.

Every parallel configuration in the suite runs on these 8 simulated devices; the
core assertion is that it matches the single-device run.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
