"""Values on the wire in fewer bytes: bf16, or fp8 e4m3 with a per-tensor scale, bit-cast to
unsigned integers so that no backend widens them (XLA:CPU would move a bf16 collective as fp32),
and ZeRO-3's weight all-gather in those encodings (ZeRO++'s qwZ).

The primitives of the low-precision gradient reduction (:mod:`jaxcolossal.parallel.compression`)
and of the layer scan's weight gather (:mod:`jaxcolossal.parallel.layer_scan`); which dtype a run moves
is :func:`jaxcolossal.config.weight_gather_dtype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import WIRE_BYTES  # noqa: F401  (re-exported beside the encodings)

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn: the per-tensor scale maps each shard's ``max|g|`` onto it."""

WIRE = {"bf16": (jnp.bfloat16, jnp.uint16), "fp8": (jnp.float8_e4m3fn, jnp.uint8)}
"""``communication_dtype`` -> (the value's dtype, the unsigned integer it crosses the wire as)."""



def encode(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """fp32 ``x`` -> (its ``kind`` encoding bit-cast to uint16/uint8, the fp32 scale). bf16: scale 1;
    fp8 e4m3: ``scale = max|x| / 448``, 1 for an all-zero (or denormal) ``x`` (a non-finite ``x`` gives a non-finite scale, so a NaN is
    never hidden: the step's non-finite check sees it after decoding)."""
    dt, it = WIRE[kind]
    if kind == "fp8":
        amax = jnp.max(jnp.abs(x))
        # an all-zero (or denormal) block, e.g. unseen tokens' embedding rows: scale 1, not 0/0
        scale = jnp.where(amax >= FP8_MAX * jnp.finfo(jnp.float32).tiny, amax / FP8_MAX, 1.0)
        q = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(dt)
        q = jnp.where(jnp.isfinite(scale), q, jnp.asarray(jnp.nan, dt))
    else:
        scale, q = jnp.ones((), jnp.float32), x.astype(dt)
    return jax.lax.bitcast_convert_type(q, it), scale


def decode(u: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """Inverse of :func:`encode`: fp32 ``value · scale`` (``scale`` broadcasts from the left)."""
    x = jax.lax.bitcast_convert_type(u, WIRE[kind][0]).astype(jnp.float32)
    return x * scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim))


def gather_lowp(w: jax.Array, gathered: P, sharded: P, mesh: Mesh, kind: str) -> jax.Array:
    """ZeRO-3's weight all-gather moved in ``kind`` (``bf16`` or ``fp8``): ZeRO++'s quantized
    weights (qwZ, Wang et al., 2023) and Colossal-AI's ``fp8_communication`` for the parameter
    all-gather.

    ``w``: one layer's weight leaf in the compute dtype, stored sharded as ``sharded`` (ZeRO-3's
    ``fsdp`` split). It is encoded where it lies (:func:`encode`: fp8 e4m3 with one per-tensor
    scale, ``max|w| / 448`` over the whole tensor, a scalar all-reduce), crosses the wire
    bit-cast to ``uint8``/``uint16`` as the all-gather to ``gathered`` (the same spec without
    ``fsdp``; tp stays), and is decoded on arrival. Returns the gathered weight in ``w``'s dtype,
    rounded to ``kind`` (e4m3 keeps 3 mantissa bits: a relative error up to 2⁻⁴ per element).

    The backward pass is the straight-through estimator (ZeRO++'s): the cotangent of the decoded
    weight is the cotangent of ``w``, in its own dtype, so the gradient's reduce-scatter is not
    quantized by this (``communication_dtype`` quantizes it in its own way, :func:`lowp_reduce`).
    """
    def put(a, spec):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    @jax.custom_vjp
    def run(w):
        u, scale = encode(w.astype(jnp.float32), kind)
        u = put(put(u, sharded), gathered)  # encoded on the shards, then gathered: the wire moves u
        return decode(u, scale, kind).astype(w.dtype)

    run.defvjp(lambda w: (run(w), None), lambda _, ct: (ct,))
    return run(w)
