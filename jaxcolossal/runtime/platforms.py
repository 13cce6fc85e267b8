"""What this machine offers JAX, decided without starting a backend: a CUDA plugin installed (the
``gpu-compile`` extra, or ``jax[cuda12]``) and an NVIDIA device present."""

from __future__ import annotations

import importlib.util
import os

CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def cuda_plugin_installed() -> bool:
    """Whether a CUDA plugin for jax can be imported here."""
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def nvidia_device_present() -> bool:
    """Whether the machine has an NVIDIA device node (``/dev/nvidiactl`` or ``/dev/nvidia0``)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


FP8_MIN_CAPABILITY = 8.9
"""The first CUDA compute capability with FP8 tensor cores (Ada; Hopper 9.0, Blackwell 10.0)."""


def fp8_refusal(device_name: str, compute_capability: str | None) -> str:
    """Why ``precision.fp8`` cannot run on a GPU of ``compute_capability`` (``"8.0"``, ``"9.0a"``),
    or ``""`` when it can (or the capability is unknown)."""
    if not compute_capability or float(str(compute_capability).rstrip("a")) >= FP8_MIN_CAPABILITY:
        return ""
    return (f"precision.fp8=true: {device_name} (compute capability {compute_capability}) has no FP8 tensor cores; "
            f"FP8 needs Ada, Hopper or Blackwell ({FP8_MIN_CAPABILITY} and up)")
