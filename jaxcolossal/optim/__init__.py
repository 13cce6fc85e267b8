"""Optimizers: fused AdamW (Pallas kernel + pure-jnp reference)."""
from jaxcolossal.optim.fused_adamw import (
    BYTES_PER_PARAM_F32,
    DEFAULT_BLOCK_SIZE,
    FusedAdam,
    FusedAdamW,
    FusedAdamWConfig,
    FusedAdamWState,
    HybridAdam,
    adamw_update,
    adamw_update_kernel,
    adamw_update_reference,
    fused_adamw,
    fused_adamw_apply,
    shard_local,
)

__all__ = [
    "BYTES_PER_PARAM_F32",
    "DEFAULT_BLOCK_SIZE",
    "FusedAdam",
    "FusedAdamW",
    "FusedAdamWConfig",
    "FusedAdamWState",
    "HybridAdam",
    "adamw_update",
    "adamw_update_kernel",
    "adamw_update_reference",
    "fused_adamw",
    "fused_adamw_apply",
    "shard_local",
]
