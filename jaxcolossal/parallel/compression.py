"""The data-parallel gradient reduction in fewer bytes: low-precision communication
(``parallel.communication_dtype``) and gradient compression (``parallel.gradient_compression``).

``communication_dtype`` ``bf16`` / ``fp8`` (ZeRO++'s quantized gradient reduction, Wang et al.,
2023, and Colossal-AI's ``fp8_communication``): each shard's fp32 gradient is cast to bf16, or to
fp8 e4m3 with a per-tensor scale (its shard's ``max|g| / 448``), and the reduction becomes an
**all-to-all** (each shard sends chunk j of its gradient to shard j) + a local fp32 sum of the N
chunks received, + (where every rank needs the whole sum, ZeRO-0) an **all-gather** of the summed
chunks, re-encoded the same way. Sums are never taken in the low precision. The payload crosses the
wire bit-cast to ``uint16``/``uint8`` (XLA's CPU backend would otherwise widen a bf16 collective to
fp32 and an fp8 one to fp16). Bytes each device sends, ring algorithms, M elements:
fp32 all-reduce ``2(N−1)/N·4M``; bf16 ``2(N−1)/N·2M`` (2×); fp8 ``2(N−1)/N·M`` (4×); under ZeRO-1/2/3
(reduce-scatter only) ``(N−1)/N·4M`` against ``(N−1)/N·bM``.

``powersgd`` (Vogels et al., 2019; PyTorch DDP's PowerSGD hook): each weight matrix's gradient
M (``n × m``, with stacked layers as a batch) is replaced by a rank-r approximation: ``P = Σ M_i Q``
(all-reduce, ``n·r``), ``P̂ = orthonormal(P)``, ``Q = Σ M_iᵀ P̂`` (all-reduce, ``m·r``), sum
``≈ P̂ Qᵀ``; ``Q`` is kept for the next step (warm start, one power iteration per step), and with
error feedback each shard keeps ``M_i − P̂Qᵀ/N``. Leaves where ``r·(n+m)`` is not below half of
``n·m`` (norm scales, biases) are all-reduced uncompressed.

(Top-k, below.)

``topk`` (Lin et al., 2018, Deep Gradient Compression; the seed's top-k selection by magnitude):
instead of an all-reduce of each whole fp32 gradient, every data shard keeps the
``k = ceil(compression_ratio · M)`` elements of its gradient (``M`` per leaf) largest in
magnitude, and the shards **all-gather** those values (fp32) and their indices (int32): the bytes
on the wire per leaf fall from ``4·M`` (the all-reduce's result) to ``8·k·N`` (the all-gather's,
N = the data group). Every rank then scatter-adds the ``N·k`` pairs into a dense gradient, so the
optimizer sees the same array everywhere, as after an all-reduce.

**Error feedback** (``parallel.error_feedback``, default on): what a shard did not send stays in
a per-shard fp32 residual (``TrainState.residual``, ``[N, ...]`` sharded over the data group)
and is added to its next step's gradient, so no gradient is lost, only delayed; without it the
unsent part is dropped. The residual is part of the train state: saved, restored, and equal
after a resume.

Data-parallel traffic only (the step applies this where it would all-reduce the gradients once
per step: ``zero_stage`` 0 and 1, without tensor or pipeline parallelism; the config refuses
the rest).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import ConfigError
from jaxcolossal.parallel.mesh import DATA_AXES, entry_axes
from jaxcolossal.parallel.sharding import is_shape
from jaxcolossal.parallel.wire import decode, encode


def _data_dim(spec: P) -> int | None:
    """The dimension of ``spec`` that a data axis (``dp``/``fsdp``) shards, or None."""
    for i, e in enumerate(spec):
        names = entry_axes(e)
        if any(a in DATA_AXES for a in names):
            return i
    return None


def _lowp_block(a: jax.Array, dim: int | None, n: int, kind: str) -> jax.Array:
    """Inside ``shard_map``: ``a`` is this shard's fp32 gradient block (param-shaped, tp-local).
    Returns its sum over the data group, either the chunk of dimension ``dim`` this shard owns
    (ZeRO's sharded result: all-to-all + local sum) or, for ``dim=None``, the whole sum (then the
    summed chunks are all-gathered too)."""
    if dim is not None:
        x = jnp.moveaxis(a, dim, 0)
        x = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    else:
        flat = a.reshape(-1)
        pad = (-flat.size) % n
        x = jnp.pad(flat, (0, pad)).reshape(n, -1)
    u, s = encode(x, kind)
    got = jax.lax.all_to_all(u, DATA_AXES, 0, 0, tiled=True)        # row j: shard j's chunk for me

    def gather_scale(s):  # fp8: every sender's scale; bf16: ones
        return jax.lax.all_gather(s, DATA_AXES) if kind == "fp8" else jnp.ones((n,))

    scales = gather_scale(s)                                          # [n] fp32, one per sender (bf16: 1)
    mine = jnp.sum(decode(got, scales, kind), axis=0)                 # fp32 sum, never low precision
    if dim is not None:
        return jnp.moveaxis(mine, 0, dim)
    u, s = encode(mine, kind)
    every = decode(jax.lax.all_gather(u, DATA_AXES), gather_scale(s), kind)
    return every.reshape(-1)[: a.size].reshape(a.shape)


def lowp_reduce(grads: Any, per_shard_specs: Any, target_specs: Any, kind: str, mesh: Mesh) -> Any:
    """Sum per-shard fp32 gradients over the data group, moving them in ``kind`` (bf16 or fp8).

    Args:
        grads: fp32 tree, each leaf ``[N, ...]`` (N = dp·fsdp) with ``per_shard_specs``
            (``P(("dp", "fsdp"), *tp spec)``).
        target_specs: the result's specs: the ZeRO gradient (or optimizer) sharding, whose
            ``fsdp`` dimension makes the reduction a reduce-scatter; replicated over the data group
            (ZeRO-0) it is a full all-reduce.
        kind: ``"bf16"`` or ``"fp8"`` (:data:`WIRE`).

    Returns:
        fp32 param-shaped sums with ``target_specs``. Tensor-parallel dims stay where they are.

    Raises:
        ValueError: a mesh with both ``dp`` and ``fsdp`` above 1 (ZeRO shards over the whole data group).
    """
    shape = dict(mesh.shape)
    n = shape["dp"] * shape["fsdp"]
    if shape["dp"] > 1 and shape["fsdp"] > 1:
        raise ValueError(f"communication_dtype={kind} needs dp or fsdp to be 1 (got {shape})")

    def leaf(g, ps, ts):
        dim = _data_dim(ts)

        def fn(b):
            return _lowp_block(b[0], dim, n, kind)

        return jax.shard_map(fn, mesh=mesh, in_specs=ps, out_specs=ts, check_vma=False)(g)

    return jax.tree.map(leaf, grads, per_shard_specs, target_specs)


def topk_count(size: int, ratio: float) -> int:
    """Elements a shard sends of a leaf with ``size`` elements: ``ceil(ratio · size)``, at least 1."""
    return max(1, min(size, math.ceil(ratio * size)))


def _topk_leaf(g: jax.Array, e: jax.Array | None, ratio: float, mesh: Mesh, u: jax.Array | None = None,
               beta: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One leaf: ``g`` fp32 ``[N, *shape]`` per-shard gradients (sharded over the data group on dim
    0), ``e`` the residual of the same shape or ``None``, ``u`` the shards' momentum (momentum
    correction) or ``None``. Returns the dense sum over the shards of what they sent (fp32
    ``shape``, replicated), the new residual and the new momentum (``[N, *shape]``; ``None``
    without ``u``)."""
    n, shape = g.shape[0], g.shape[1:]
    m = math.prod(shape)
    k = topk_count(m, ratio)
    rows = P(DATA_AXES, None)
    if u is not None:  # DGC's momentum correction: the shard's own momentum is what accumulates
        u = beta * u + (1 - beta) * g
        g = u
    flat = jax.lax.with_sharding_constraint((g if e is None else g + e).reshape(n, m), NamedSharding(mesh, rows))

    def select(f):  # on each device, its own shard's rows (XLA would gather a global top_k first)
        _, i = jax.lax.top_k(jnp.abs(f), k)
        v = jnp.take_along_axis(f, i, axis=1)
        return v, i, f.at[jnp.arange(f.shape[0])[:, None], i].set(0.0)  # what was not sent

    vals, idx, residual = jax.shard_map(select, mesh=mesh, in_specs=rows, out_specs=(rows, rows, rows))(flat)
    # the exchange: values and indices all-gathered over the data group
    everywhere = NamedSharding(mesh, P())
    vals = jax.lax.with_sharding_constraint(vals, everywhere)
    idx = jax.lax.with_sharding_constraint(idx, everywhere)
    dense = jnp.zeros((m,), jnp.float32).at[idx.reshape(-1)].add(vals.reshape(-1))
    return dense.reshape(shape), residual.reshape(g.shape), u


def topk_reduce(grads: Any, residual: Any, ratio: float, mesh: Mesh, momentum: float | None = None
                ) -> tuple[Any, Any]:
    """Top-k compressed sum over the data group of per-shard gradients.

    Args:
        grads: fp32 param-shaped tree, each leaf ``[N, ...]`` (N = dp·fsdp), sharded
            ``P(("dp", "fsdp"), ...)``: the step's unreduced per-shard gradient sums.
        residual: the same shapes (error feedback), or ``None`` (none kept); with ``momentum``,
            ``{"error": tree, "velocity": tree}`` of those shapes.
        ratio: ``parallel.compression_ratio`` in (0, 1].
        mesh: the device mesh.
        momentum: β₁ for DGC's momentum correction (Lin et al., 2018, §3.2;
            ``parallel.momentum_correction``): each shard's ``velocity = β₁·velocity + (1 − β₁)·g``
            (Adam's first moment, of its own gradient) is added to its error and the top-k of that
            sum is sent. The velocity is not reset where an element was sent (DGC's "momentum
            factor masking" is left out: it drops a (1 − β₁) share of every element sent often, so
            that at ratio 1 the run would train 10× slower; without it, ratio 1 is exactly Adam).
            ``None``: the gradient itself is sent.

    Returns:
        ``(summed, new_residual)``: fp32 param-shaped sums (replicated; the caller constrains them
        to the gradient sharding) and the residual (same structure as ``residual``).
    """
    leaves, treedef = jax.tree.flatten(grads)
    if momentum is not None:
        res, vel = jax.tree.leaves(residual["error"]), jax.tree.leaves(residual["velocity"])
    else:
        res = jax.tree.leaves(residual) if residual is not None else [None] * len(leaves)
        vel = [None] * len(leaves)
    out = [_topk_leaf(g, e, ratio, mesh, u, momentum or 0.0) for g, e, u in zip(leaves, res, vel)]
    summed = jax.tree.unflatten(treedef, [o[0] for o in out])

    def tree(j):
        return jax.tree.unflatten(treedef, [o[j] for o in out])

    if momentum is not None:
        return summed, {"error": tree(1), "velocity": tree(2)}
    return summed, (tree(1) if residual is not None else None)


def wire_bytes(shapes: Any, ratio: float, n: int) -> dict[str, int]:
    """Predicted result bytes per step of the gradient exchange: ``{"dense": 4·Σ M}`` (the
    all-reduce's result) and ``{"topk": 8·N·Σ k}`` (values + indices, all-gathered)."""
    sizes = [math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))]
    return {"dense": 4 * sum(sizes), "topk": 8 * n * sum(topk_count(m, ratio) for m in sizes)}


# ----------------------------------------------------------------------------- PowerSGD

def leaf_name(path) -> str:
    """``"layers.wq"`` for a tree path: the key of a leaf in PowerSGD's state dicts."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def matrix_view(shape: tuple, axes: tuple, rank: int) -> tuple[int, int, int] | None:
    """How PowerSGD sees a parameter of ``shape`` (logical ``axes``): ``(lead, n, m)`` — the
    leading ``lead`` dims (the stacked ``layers``) are a batch, the rest is split into an ``n × m``
    matrix at the point that makes ``n + m`` smallest (the fewest factor bytes; ``wo [L, h, hd,
    d]`` becomes ``(h·hd) × d``) — or ``None`` when rank-``rank`` factors would not halve the bytes
    (``rank·(n+m) ≥ n·m/2``: norm scales, biases, tiny matrices), so the leaf is sent whole."""
    lead = 1 if axes and axes[0] in ("layers", "stage") else 0
    rest = shape[lead:]
    if len(rest) < 2:
        return None
    n, m = min(((math.prod(rest[:k]), math.prod(rest[k:])) for k in range(1, len(rest))), key=sum)
    return (lead, n, m) if 2 * rank * (n + m) < n * m else None


def powersgd_views(param_shapes: Any, param_axes: Any, rank: int) -> dict[str, tuple]:
    """``{leaf name: (shape, lead, n, m)}`` of the leaves PowerSGD compresses."""
    shapes = jax.tree_util.tree_flatten_with_path(param_shapes, is_leaf=is_shape)[0]
    axes = jax.tree.leaves(param_axes, is_leaf=lambda x: isinstance(x, tuple))
    out = {}
    for (path, shape), ax in zip(shapes, axes):
        view = matrix_view(tuple(shape), tuple(ax), rank)
        if view is not None:
            out[leaf_name(path)] = (tuple(shape),) + view
    return out


def powersgd_init(views: dict, rank: int, n_data: int, error_feedback: bool, seed: int = 0) -> dict:
    """The PowerSGD state: ``{"q": {name: fp32 [*batch, m, r] N(0, 1)}}`` (PyTorch's hook also
    starts from a seeded normal ``Q``), plus ``"error": {name: fp32 zeros [N, *shape]}`` with error
    feedback."""
    state = {"q": {}}
    for i, (name, (shape, lead, _, m)) in enumerate(sorted(views.items())):
        state["q"][name] = jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), shape[:lead] + (m, rank),
                                             jnp.float32)
    if error_feedback:
        state["error"] = {name: jnp.zeros((n_data,) + shape, jnp.float32) for name, (shape, *_) in views.items()}
    return state


def powersgd_specs(views: dict, error_feedback: bool) -> dict:
    """Specs of :func:`powersgd_init`'s state: ``Q`` replicated, each error ``[N, ...]`` over the
    data group."""
    specs = {"q": {name: P() for name in views}}
    if error_feedback:
        specs["error"] = {name: P(DATA_AXES) for name in views}
    return specs


_HI = jax.lax.Precision.HIGHEST


def orthonormalize(p: jax.Array, eps: float = 1e-8) -> jax.Array:
    """Orthonormal columns spanning ``p [..., n, r]``'s, by modified Gram–Schmidt (PyTorch's
    PowerSGD hook does the same; a zero column stays zero instead of dividing by 0). Pure matmuls
    and elementwise ops, unrolled over the r ≤ a few dozen columns: no LAPACK call (on XLA's CPU
    backend a batched QR custom call inside the step deadlocked the 8 simulated devices)."""
    cols = []
    for j in range(p.shape[-1]):
        c = p[..., j]
        for prev in cols:
            c = c - jnp.sum(prev * c, axis=-1, keepdims=True) * prev
        cols.append(c / (jnp.linalg.norm(c, axis=-1, keepdims=True) + eps))
    return jnp.stack(cols, axis=-1)


def _powersgd_block(g: jax.Array, q: jax.Array, lead: int, n: int, m: int, n_data: int):
    """Inside ``shard_map``: one shard's fp32 ``g [1, *shape]`` (error already added), the shared
    ``q [*batch, m, r]``. Returns (the approximate sum over shards ``[*shape]``, this shard's new
    error ``[1, *shape]``, the new ``q``)."""
    shape = g.shape[1:]
    mat = g.reshape(shape[:lead] + (n, m))
    p = jax.lax.psum(jnp.matmul(mat, q, precision=_HI), DATA_AXES)            # all-reduce n·r
    p = orthonormalize(p)                                                     # orthonormal columns
    q_new = jax.lax.psum(jnp.matmul(jnp.swapaxes(mat, -1, -2), p, precision=_HI), DATA_AXES)  # m·r
    approx = jnp.matmul(p, jnp.swapaxes(q_new, -1, -2), precision=_HI)       # ≈ Σ_i M_i
    return approx.reshape(shape), (mat - approx / n_data).reshape(g.shape), q_new


def powersgd_reduce(grads: Any, state: dict, views: dict, mesh: Mesh) -> tuple[Any, dict]:
    """PowerSGD sum over the data group of per-shard gradients (module doc).

    Args:
        grads: fp32 param-shaped tree, each leaf ``[N, ...]`` sharded ``P(("dp", "fsdp"), ...)``.
        state: :func:`powersgd_init`'s ``{"q", "error"?}``.
        views: :func:`powersgd_views`.

    Returns:
        ``(summed, new_state)``: fp32 param-shaped sums (replicated; compressed leaves are the
        rank-r approximation of the sum) and the new ``Q`` (and errors).
    """
    n_data = mesh.shape["dp"] * mesh.shape["fsdp"]
    rows = P(DATA_AXES)
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
    out, new_q, new_e = [], {}, {}
    for path, g in flat:
        name = leaf_name(path)
        if name not in views:
            out.append(jnp.sum(g, axis=0))  # sent whole: an all-reduce
            continue
        _, lead, n, m = views[name]
        if "error" in state:
            g = g + state["error"][name]
        fn = jax.shard_map(lambda a, q, lead=lead, n=n, m=m: _powersgd_block(a, q, lead, n, m, n_data),
                           mesh=mesh, in_specs=(rows, P()), out_specs=(P(), rows, P()), check_vma=False)
        approx, err, q = fn(g, state["q"][name])
        out.append(approx)
        new_q[name], new_e[name] = q, err
    new_state = {"q": new_q, **({"error": new_e} if "error" in state else {})}
    return jax.tree.unflatten(treedef, out), new_state


def powersgd_wire(views: dict, param_shapes: Any, rank: int) -> dict[str, int]:
    """Predicted all-reduce result bytes per step (fp32): ``{"dense": 4·Σ size, "powersgd":
    4·(Σ batch·(n+m)·r over compressed leaves + Σ size of the rest)}``."""
    sizes = [math.prod(s) for s in jax.tree.leaves(param_shapes, is_leaf=lambda x: isinstance(x, tuple))]
    comp = sum(math.prod(shape) for shape, *_ in views.values())
    factors = sum(math.prod(shape[:lead]) * (n + m) * rank for shape, lead, n, m in views.values())
    return {"dense": 4 * sum(sizes), "powersgd": 4 * (sum(sizes) - comp + factors)}


def state_bytes(parallel: Any, param_shapes: Any, param_axes: Any) -> int:
    """Per-device bytes of the compression state (:attr:`TrainState.residual`): top-k's
    error-feedback residual, 4 bytes per parameter (each device its own shard's; 8 with momentum
    correction's velocity); PowerSGD's
    errors for the compressed leaves (4 bytes per parameter, with error feedback) plus its
    replicated ``Q`` factors. 0 without compression. Compression runs without tp/pp, so every
    device holds whole leaves."""
    sizes = [math.prod(s) for s in jax.tree.leaves(param_shapes, is_leaf=lambda x: isinstance(x, tuple))]
    if parallel.gradient_compression == "topk":  # the residual, and the momentum-correction velocity
        return 4 * sum(sizes) * (2 if parallel.momentum_correction else 1) if parallel.error_feedback else 0
    if parallel.gradient_compression == "powersgd":
        views = powersgd_views(param_shapes, param_axes, parallel.powersgd_rank)
        q = sum(math.prod(shape[:lead]) * m * parallel.powersgd_rank for shape, lead, _, m in views.values())
        err = sum(math.prod(v[0]) for v in views.values()) if parallel.error_feedback else 0
        return 4 * (q + err)
    return 0


def check_powersgd(parallel: Any, param_shapes: Any, param_axes: Any) -> None:
    """Refuse a ``powersgd_rank`` that compresses no leaf of the model (it would silently send
    every gradient whole).

    Raises:
        ConfigError: naming the rank and the largest one that would compress something."""
    if parallel.gradient_compression != "powersgd" or powersgd_views(param_shapes, param_axes, parallel.powersgd_rank):
        return
    ones = powersgd_views(param_shapes, param_axes, 1)
    best = max((n * m / (2 * (n + m)) for _, _, n, m in ones.values()), default=0)
    raise ConfigError(f"parallel.powersgd_rank={parallel.powersgd_rank} compresses no parameter of this model (a "
                      "matrix n × m is compressed only where rank·(n+m) < n·m/2)"
                      + (f": use a rank below {best:.0f}" if best > 1 else ": use gradient_compression=none"))
