"""jaxcolossal: Colossal-AI's large-model training system rebuilt in JAX/XLA on SPMD meshes.

Importing this package does not start JAX's backend, so ``simulate_devices`` still works after
``import jaxcolossal``.
"""

from jaxcolossal import models
from jaxcolossal.booster import (
    Booster,
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from jaxcolossal.config import Config, ConfigError, load_config
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.launch import (
    gpu_memory_fraction,
    launch,
    launch_from_env,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
    set_seed,
    simulate_devices,
)

__version__ = "0.1.0"

__all__ = [
    "Booster", "DDPPlugin", "GeminiPlugin", "HybridParallelPlugin", "LowLevelZeroPlugin", "TorchDDPPlugin",
    "TorchFSDPPlugin",
    "Config", "ConfigError", "load_config", "get_dist_logger", "gpu_memory_fraction", "launch", "launch_from_env",
    "launch_from_openmpi", "launch_from_slurm", "launch_from_torch", "set_seed", "simulate_devices",
    "make_mesh", "models",
]
