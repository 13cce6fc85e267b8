"""The layer scan: a family's stacked decoder layers ``[L, ...]`` run in one ``lax.scan``
(:func:`scan_layers`), with ZeRO-3's one-layer-ahead weight gather (:func:`prefetched_scan`) and a
pipeline chunk sliced inside each layer's body (:func:`scan_chunk`, for
:mod:`jaxcolossal.parallel.pipeline_executor`), each layer checkpointed by a remat policy by name.

``model.remat`` picks what the backward pass keeps from the forward pass of each layer; the rest
is recomputed (Chen et al., 2016; Korthikanti et al., 2022 for selective recomputation). The
names follow MaxText's ``remat_policy`` and Colossal-AI's gradient checkpointing:

================  =================================================================  ==========
name              kept per layer (everything else is recomputed)                     recompute
================  =================================================================  ==========
``none``          everything (no checkpointing)                                      none
``save_qkv_proj`` the q/k/v projections' outputs (MaxText ``save_qkv_proj``)         most of it
``selective``     every projection's output: q/k/v, attention out, MLP gate/up/down  norms, RoPE,
                  (MaxText ``minimal``-style)                                        attention
``dots``          every matmul without batch dims (``dots_with_no_batch_dims``)      elementwise
``full``          only the layer input (Colossal-AI ``gradient_checkpointing``)      the layer
``offload``       what ``selective`` keeps, moved to pinned host memory in the       as
                  forward and back for the backward (``offload.activations=host``)   ``selective``
================  =================================================================  ==========

Model code tags the tensors with :func:`jax.ad_checkpoint.checkpoint_name` using the names in
:data:`PROJECTIONS`; this module is the one place that maps a policy name to what is saved.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from jaxcolossal.parallel.wire import gather_lowp

QKV = ("query_proj", "key_proj", "value_proj")
PROJECTIONS = QKV + ("out_proj", "mlp_gate", "mlp_up", "mlp_down")
"""Names of the tagged projection outputs (:func:`tag`), in every model family."""

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names(*QKV),
    "selective": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(PROJECTIONS),
        offload_src="device", offload_dst="pinned_host"),
}
"""``model.remat`` name -> ``jax.checkpoint`` policy (``None``: no checkpointing)."""


def tag(x: jax.Array, name: str) -> jax.Array:
    """Name ``x`` for the policies above (identity outside ``jax.checkpoint``)."""
    return checkpoint_name(x, name)


def _on_host(x: jax.Array) -> bool:
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def fetch_layer(p: Any) -> Any:
    """``p`` with the leaves that live in host memory moved into device memory; device-resident
    leaves pass through. The scan body calls it on one layer's params (``offload.offload_param_frac``
    under ZeRO-3), so that device memory holds one layer's offloaded weights at a time; their
    gradients go back to host memory layer by layer in the backward pass (the transpose of the
    move), and the step fetches those the same way."""
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device) if _on_host(a) else a, p)


def scan_layers(layer: Callable, x: jax.Array, stacked: dict, remat: str, shard: Any = None,
                extras: dict | None = None) -> jax.Array:
    """``x = layer(x, params_i)`` for each layer's params in ``stacked`` (leading dim ``[L]``), as one
    ``lax.scan`` whose body is checkpointed with the ``remat`` policy. Stacked leaves in host
    memory are streamed in one layer at a time (:func:`fetch_layer`).

    ``extras``: per-layer constants that are not parameters (``{name: [L, ...] array}``, e.g. each
    layer's attention window), merged into ``params_i`` under their names.

    With ``remat=full`` and a sharder that carries ZeRO-3 layer specs (``shard.layer_specs``,
    :meth:`jaxcolossal.parallel.sharding.Sharder.with_layer_prefetch`: ``parallel.overlap``), the scan
    prefetches instead (:func:`prefetched_scan`). With ``shard.lowp_gather`` (ZeRO-3 with
    ``parallel.communication_dtype`` bf16/fp8) each layer's weights are all-gathered in that
    dtype inside the body (:func:`jaxcolossal.parallel.wire.gather_lowp`).

    Raises:
        KeyError: an unknown policy name (the config validates it first).
    """
    extras = extras or {}
    specs = getattr(shard, "layer_specs", None)
    if specs is not None and remat == "full" and not any(_on_host(a) for a in jax.tree.leaves(stacked)):
        return prefetched_scan(layer, x, stacked, shard.mesh, *specs, extras=extras)
    lowp = getattr(shard, "lowp_gather", None)
    if lowp is not None:  # ZeRO++ qwZ: each layer's weight shards cross the wire in bf16/fp8
        kind, gathered, sharded = lowp

        def fetch(p):
            return jax.tree.map(lambda a, g, s: gather_lowp(a, g, s, shard.mesh, kind), fetch_layer(p), gathered,
                                sharded)
    else:
        fetch = fetch_layer

    def body(carry, xs):
        p, e = xs
        return layer(carry, {**fetch(p), **e}), None

    policy = POLICIES[remat]
    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, (stacked, extras))[0]


_SLICING = ("dynamic_slice", "squeeze")


def scan_chunk(layer: Callable, x: jax.Array, stacked: dict, chunk: jax.Array, remat: str) -> jax.Array:
    """:func:`scan_layers` over chunk ``chunk`` of ``stacked`` (leaves ``[v, Lc, ...]``; ``chunk``: a
    traced int32 scalar that differs per call, as in the circular GPipe's ticks), each layer's
    weights sliced out inside the checkpointed body.

    Slicing the chunk first and scanning over the slice would make the slice a residual of every
    call (autodiff of a scan of such calls keeps one copy of the chunk's weights per call: for
    circular GPipe, ``m·v + p − 1`` copies). Here the body's policy (the ``remat`` one, and in every
    case nothing sliced) recomputes each layer's weights from ``stacked`` in the backward, so the
    only weight residual is ``stacked`` itself, which the calls share.

    Returns:
        ``x`` after the chunk's ``Lc`` layers (same shape and dtype).
    """
    base = POLICIES[remat]

    def policy(prim, *args, **params):  # never save a slice of the weights: recompute it in the backward
        if prim.name in _SLICING:
            return False
        return True if base is None else base(prim, *args, **params)

    def body(h, j):
        p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(a, chunk, 0, False),
                                                                j, 0, False), stacked)
        return layer(h, p), None
    n = jax.tree.leaves(stacked)[0].shape[1]
    return jax.lax.scan(jax.checkpoint(body, policy=policy, prevent_cse=False), x, jnp.arange(n, dtype=jnp.int32))[0]


def _indexed(layer: Callable, extras: dict) -> Callable:
    """``layer(h, w) `` as ``(h, w, i) -> layer(h, w + layer i's constants)`` (``extras``: ``[L, ...]``)."""
    def run(h, w, i):
        return layer(h, {**w, **jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), extras)})
    return run


def prefetched_scan(layer: Callable, x: jax.Array, stacked: dict, mesh: Any, gathered: dict, sharded: dict,
                    extras: dict | None = None) -> jax.Array:
    """:func:`scan_layers` for ZeRO-3 with ``remat=full``, with the weights' all-gathers issued one
    layer ahead (FSDP's forward/backward prefetch; DeepSpeed's ``stage3_prefetch_bucket_size``).

    Forward: the scan carries layer ``i``'s gathered weights; the body gathers layer ``i+1``'s
    from the stacked shards *before* running layer ``i`` (the gather reads only the shards and the
    loop index, so it can overlap the layer's matmuls), and saves only the layer input ``x_i``
    (what ``remat=full`` keeps). Backward (a ``jax.custom_vjp``): a reverse scan that carries
    layer ``i``'s gathered weights, gathers layer ``i−1``'s, recomputes layer ``i`` from ``x_i``
    and pulls the cotangent back; each layer's weight gradient is constrained to the shards'
    sharding, so XLA reduce-scatters it inside the loop, while the next layer's backward runs.

    Args:
        layer: ``layer(x, params_i) -> x`` (may close over other arrays: positions, RoPE tables).
        x: ``[b, t, d]`` activations.
        stacked: the layers' params, each leaf ``[L, ...]`` sharded over ``fsdp``.
        mesh: the mesh of the specs.
        gathered: per leaf, one layer's ``PartitionSpec`` without ``fsdp`` (tp stays).
        sharded: per leaf, one layer's ``PartitionSpec`` as stored (with ``fsdp``).
        extras: per-layer constants ``[L, ...]`` merged into each layer's params (:func:`scan_layers`).

    Returns:
        ``[b, t, d]``, equal to :func:`scan_layers`'s (fp32: to rounding of the summation order).
    """

    n = jax.tree.leaves(stacked)[0].shape[0]
    layer = _indexed(layer, extras or {})

    def put(tree, specs):
        return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)), tree, specs)

    def at(stacked, i):  # layer i's weights, gathered (all-gathered over fsdp)
        return put(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), stacked), gathered)

    fn, consts = jax.closure_convert(layer, x, at(stacked, 0), jnp.int32(0))  # closed-over arrays as arguments

    def forward(x, stacked, consts, keep):
        def body(carry, i):
            h, w = carry
            w_next = at(stacked, jnp.minimum(i + 1, n - 1))  # issued before layer i's compute
            return (fn(h, w, i, *consts), w_next), (h if keep else None)
        (y, _), xs = jax.lax.scan(body, (x, at(stacked, 0)), jnp.arange(n))
        return y, xs

    @jax.custom_vjp
    def run(x, stacked, consts):
        return forward(x, stacked, consts, False)[0]

    def fwd(x, stacked, consts):
        y, xs = forward(x, stacked, consts, True)
        return y, (xs, stacked, consts)

    def bwd(res, dy):
        xs, stacked, consts = res
        fl = [j for j, c in enumerate(consts) if jnp.issubdtype(c.dtype, jnp.inexact)]  # differentiable ones

        def f(h, w, fc, i):
            c = list(consts)
            for j, v in zip(fl, fc):
                c[j] = v
            return fn(h, w, i, *c)

        def body(carry, ix):
            (g, w, dc), (i, h) = carry, ix
            w_prev = at(stacked, jnp.maximum(i - 1, 0))  # issued before layer i's backward
            _, vjp = jax.vjp(partial(f, i=i), h, w, [consts[j] for j in fl])  # layer i recomputed from its input
            dh, dw, dci = vjp(g)
            return (dh, w_prev, [a + b for a, b in zip(dc, dci)]), put(dw, sharded)  # reduce-scattered here
        init = (dy, at(stacked, n - 1), [jnp.zeros_like(consts[j]) for j in fl])
        (dx, _, dc), dws = jax.lax.scan(body, init, (jnp.arange(n), xs), reverse=True)
        dconsts = [None] * len(consts)
        for j, v in zip(fl, dc):
            dconsts[j] = v
        return dx, dws, tuple(dconsts)

    run.defvjp(fwd, bwd)
    return run(x, stacked, tuple(consts))
