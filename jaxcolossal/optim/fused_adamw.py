"""Fused AdamW: one pass over each parameter leaf, backed by a Pallas kernel.

AdamW (decoupled weight decay) with exactly the semantics of ``optax.adamw``
(``eps_root=0``, ``nesterov=False``, ``mu_dtype=float32``)::

    count  <- count + 1                      (saturating int32, optax.safe_increment)
    m      <- (1 - b1) * g + b1 * m
    v      <- (1 - b2) * g * g + b2 * v
    m_hat  =  m / (1 - b1 ** count)
    v_hat  =  v / (1 - b2 ** count)
    u      =  m_hat / (sqrt(v_hat) + eps)    (eps outside the sqrt)
    u      =  u + wd * p                     (only where the mask is True)
    p      <- p + (-lr) * u                  (lr = schedule(count before increment))

Two per-leaf implementations share ONE signature:

* :func:`adamw_update_reference` -- plain ``jax.numpy``; XLA fuses it.
* :func:`adamw_update_kernel` -- a ``pl.pallas_call`` that reads ``p, g, m, v``
  and writes ``p, m, v`` in a single pass (Triton lowering on GPU,
  ``interpret=True`` anywhere). :func:`adamw_update` picks between them by the
  platform the program is lowered for. ``p, m, v`` are aliased input->output, so with
  donated buffers the update is in place.

Bytes moved per parameter (the roofline of an elementwise optimizer): reads
``p`` (4 B f32 / 2 B bf16), ``g`` (4 B f32 / 2 B bf16/f16), ``m`` (4 B), ``v``
(4 B); writes ``p``, ``m``, ``v`` -> **28 bytes/param** when p and g are f32
(22 B with bf16 p and g). An unfused ``update`` followed by
``optax.apply_updates`` additionally writes and re-reads the ``updates`` tree
(+8 B/param f32) unless XLA fuses them.

On top of the per-leaf functions, :func:`fused_adamw` builds an
``optax.GradientTransformationExtraArgs`` (drop-in for ``optax.adamw``), and
:func:`fused_adamw_apply` (also ``tx.apply``) returns new params directly from
the kernel, skipping the ``updates`` tree and the separate add.

ZeRO / FSDP: with ``mesh=`` and ``param_specs=`` the per-leaf update runs
inside ``jax.shard_map`` on each device's LOCAL shard of ``p, g, m, v``
(optimizer state sharded like the params), so no all-gather is ever emitted:
AdamW is elementwise, and the only non-local inputs (``lr``, ``count``) are
replicated scalars.

Sources:
  * I. Loshchilov & F. Hutter, "Decoupled Weight Decay Regularization",
    ICLR 2019, https://arxiv.org/abs/1711.05101
  * D. Kingma & J. Ba, "Adam: A Method for Stochastic Optimization", 2015.
  * Colossal-AI ``colossalai.nn.optimizer.HybridAdam`` / ``FusedAdam``
    (multi-tensor CUDA Adam kernels, ``adamw_mode=True``).
  * NVIDIA apex ``apex.optimizers.FusedAdam`` (multi_tensor_adam).
  * optax ``optax.adamw`` / ``scale_by_adam`` (reference semantics).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

__all__ = [
    "FusedAdamWState",
    "FusedAdamWConfig",
    "FusedAdamW",
    "adamw_update_reference",
    "adamw_update_kernel",
    "adamw_update",
    "shard_local",
    "fused_adamw",
    "fused_adamw_apply",
    "HybridAdam",
    "FusedAdam",
    "BYTES_PER_PARAM_F32",
    "DEFAULT_BLOCK_SIZE",
]

#: Bytes moved per parameter by one fused AdamW step with f32 p and g:
#: read p, g, m, v (4 x 4 B) + write p, m, v (3 x 4 B).
BYTES_PER_PARAM_F32 = 28

#: Elements per Pallas program (a power of two, as Triton requires).
DEFAULT_BLOCK_SIZE = 1024

_IMPLS = ("auto", "kernel", "reference")


# --------------------------------------------------------------------------
# Per-leaf update functions (one shared signature)
# --------------------------------------------------------------------------


def _check_leaf(p, g, m, v):
    for name, x in (("g", g), ("m", m), ("v", v)):
        if x.shape != p.shape:
            raise ValueError(
                f"adamw_update: {name}.shape {x.shape} != p.shape {p.shape}")
    if not jnp.issubdtype(p.dtype, jnp.floating):
        raise TypeError(f"adamw_update: p must be floating, got {p.dtype}")
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise TypeError(f"adamw_update: g must be floating, got {g.dtype}")
    for name, x in (("m", m), ("v", v)):
        if x.dtype != jnp.float32:
            raise TypeError(
                f"adamw_update: {name} must be float32 (optimizer state), "
                f"got {x.dtype}")


def _static_hparams(b1, b2, eps, weight_decay):
    try:
        return float(b1), float(b2), float(eps), float(weight_decay)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(
            "adamw_update: b1, b2, eps and weight_decay must be concrete "
            "Python/NumPy scalars (they are compiled into the kernel); only "
            "lr and count may be traced.") from e


def _bias_corrections(b1, b2, count):
    """``1 - b**count`` in float32, computed exactly as optax does."""
    count = jnp.asarray(count, jnp.int32)
    return 1 - b1**count, 1 - b2**count


def _adamw_math(p, g, m, v, lr, bc1, bc2, *, b1, b2, eps, weight_decay):
    """The AdamW arithmetic on f32 values, op-for-op as optax.adamw."""
    m = (1 - b1) * g + b1 * m
    v = (1 - b2) * (g * g) + b2 * v
    u = (m / bc1) / (jnp.sqrt(v / bc2) + eps)
    if weight_decay != 0.0:
        u = u + weight_decay * p
    new_p = p + (-lr) * u
    return new_p, m, v


def adamw_update_reference(p, g, m, v, *, lr, b1, b2, eps, weight_decay,
                           count):
    """One AdamW step on one leaf, in plain ``jax.numpy`` (XLA-fused).

    Args:
      p: parameter, any shape, float32 or bfloat16 (computed in f32, cast back).
      g: gradient, same shape, float32 / bfloat16 / float16 (cast to f32).
      m: first moment, same shape, float32.
      v: second moment, same shape, float32.
      lr: learning rate, Python float or traced f32 scalar (already evaluated
        from the schedule at the pre-increment count).
      b1, b2, eps, weight_decay: concrete Python floats. ``weight_decay`` is
        the decoupled decay for THIS leaf (pass 0.0 where the mask is False).
      count: int32 scalar (may be traced): the step count AFTER increment,
        i.e. 1 on the first step; used for bias correction.

    Returns:
      ``(new_p, new_m, new_v)`` with the dtypes/shapes/shardings of the inputs.

    Bytes moved: 28 B/param for f32 p and g (reads p, g, m, v; writes p, m, v),
    when XLA fuses the elementwise ops into one loop (it normally does).

    Raises:
      ValueError: shapes of g, m, v differ from p.
      TypeError: m or v not float32; p or g not floating; b1/b2/eps/
        weight_decay traced.
    """
    _check_leaf(p, g, m, v)
    b1, b2, eps, weight_decay = _static_hparams(b1, b2, eps, weight_decay)
    bc1, bc2 = _bias_corrections(b1, b2, count)
    lr = jnp.asarray(lr, jnp.float32)
    new_p, new_m, new_v = _adamw_math(
        p.astype(jnp.float32), g.astype(jnp.float32), m, v, lr, bc1, bc2,
        b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    return new_p.astype(p.dtype), new_m, new_v


def _adamw_kernel(s_ref, p_ref, g_ref, m_ref, v_ref, p_out, m_out, v_out, *,
                  b1, b2, eps, weight_decay):
    # Scalars come in as a (4,) f32 block [lr, bc1, bc2, 0]; integer-index
    # loads are scalar loads in the Triton lowering (cf. jax's Pallas GPU
    # paged_attention `lengths_ref[0]`) and plain indexing when interpreted.
    lr = s_ref[0]
    bc1 = s_ref[1]
    bc2 = s_ref[2]
    p = p_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    new_p, new_m, new_v = _adamw_math(
        p, g, m_ref[...], v_ref[...], lr, bc1, bc2,
        b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    p_out[...] = new_p.astype(p_out.dtype)
    m_out[...] = new_m
    v_out[...] = new_v


def _pick_block(n: int, block_size: int) -> int:
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a positive power of two, got {block_size}")
    return min(block_size, pl.next_power_of_2(max(n, 1)))


def adamw_update_kernel(p, g, m, v, *, lr, b1, b2, eps, weight_decay, count,
                        interpret=False, block_size=DEFAULT_BLOCK_SIZE):
    """One AdamW step on one leaf as a single Pallas kernel (one HBM pass).

    Same signature and semantics as :func:`adamw_update_reference`, plus:

    Args:
      interpret: run the kernel with the Pallas interpreter (any backend;
        used for CPU tests). Without it the kernel lowers through Triton and
        needs a GPU.
      block_size: elements per program, a power of two (Triton requirement).
        Leaves smaller than the block use the next power of two >= size.

    Layout: the leaf is flattened to 1-D (a free bitcast) and, only when its
    size is not a multiple of the block, zero-padded up to one and sliced back
    afterwards (an extra copy for such ragged leaves; LLaMA-style shapes are
    multiples of 1024 and take no padding). Grid = ``n_padded // block``;
    each program reads one block of p, g, m, v and writes p, m, v.
    ``lr`` and the two bias corrections are passed as one (4,) f32 array.
    ``input_output_aliases`` maps p->new_p, m->new_m, v->new_v so donated
    buffers are updated in place.

    Bytes moved: 28 B/param (f32 p, g), 22 B/param (bf16 p, g).

    Raises:
      ValueError: shape mismatch, bad block_size, or called on a non-GPU
        backend without ``interpret=True``.
      TypeError: as :func:`adamw_update_reference`.
    """
    _check_leaf(p, g, m, v)
    b1, b2, eps, weight_decay = _static_hparams(b1, b2, eps, weight_decay)
    where = _concrete_platform(p)
    if not interpret and where not in (None, "gpu", "cuda", "rocm"):
        raise ValueError(
            f"adamw_update_kernel: the Pallas kernel lowers via Triton and "
            f"needs a GPU (the arrays are on {where!r}); pass interpret=True or "
            f"use adamw_update_reference.")
    shape, n = p.shape, p.size
    if n == 0:
        return p, m, v
    block = _pick_block(n, block_size)
    n_pad = pl.cdiv(n, block) * block

    def flat(x):
        x = x.reshape(n)
        return jnp.pad(x, (0, n_pad - n)) if n_pad != n else x

    bc1, bc2 = _bias_corrections(b1, b2, count)
    scalars = jnp.stack([
        jnp.asarray(lr, jnp.float32), bc1.astype(jnp.float32),
        bc2.astype(jnp.float32), jnp.zeros((), jnp.float32)])

    kernel = functools.partial(_adamw_kernel, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    new_p, new_m, new_v = _pallas_update(kernel, scalars, [flat(x) for x in (p, g, m, v)], block, interpret)

    def unflat(x):
        return (x[:n] if n_pad != n else x).reshape(shape)

    return unflat(new_p), unflat(new_m), unflat(new_v)


def _pallas_update(kernel, scalars, flat: list, block: int, interpret: bool):
    """The ``pl.pallas_call`` over 1-D ``p, g, m, v`` of a whole number of blocks: ``(new p, m, v)``,
    p, m, v aliased input->output (updated in place when donated)."""
    p, g = flat[0], flat[1]
    n_pad = p.shape[0]
    vec = pl.BlockSpec((block,), lambda i: (i,))
    compiler_params = None
    if not interpret:  # Triton, not Mosaic GPU (jax's default Pallas GPU backend since 0.10)
        from jax.experimental.pallas import triton as pltriton  # heavy: loads the CUDA plugin's Triton bindings
        compiler_params = pltriton.CompilerParams(num_warps=4, num_stages=1)
    p_bytes = 2 * p.dtype.itemsize + g.dtype.itemsize + 16  # 28 for f32
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n_pad,), p.dtype), jax.ShapeDtypeStruct((n_pad,), jnp.float32),
                   jax.ShapeDtypeStruct((n_pad,), jnp.float32)),
        grid=(n_pad // block,),
        in_specs=[pl.BlockSpec((4,), lambda i: (0,)), vec, vec, vec, vec],
        out_specs=(vec, vec, vec),
        input_output_aliases={1: 0, 3: 1, 4: 2},
        interpret=interpret,
        compiler_params=compiler_params,
        cost_estimate=pl.CostEstimate(flops=16 * n_pad, transcendentals=n_pad, bytes_accessed=p_bytes * n_pad),
        name="fused_adamw",
    )(scalars, *flat)


def _concrete_platform(x) -> str | None:
    """The platform of a concrete array's devices; ``None`` while tracing (the platform is then
    the one being lowered for, known only to :func:`jax.lax.platform_dependent`)."""
    try:
        return next(iter(x.devices())).platform
    except Exception:  # noqa: BLE001 - a tracer has no devices
        return None


def _resolve_impl(impl: str) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    return impl


def _positional(f: Callable) -> Callable:
    """``f(p, g, m, v, *, lr, count)`` taking ``lr`` and ``count`` positionally too (as
    ``jax.lax.platform_dependent`` passes its operands)."""
    def call(p, g, m, v, lr, count):
        return f(p, g, m, v, lr=lr, count=count)
    return call


def adamw_update(p, g, m, v, *, lr, b1, b2, eps, weight_decay, count,
                 impl="auto", interpret=False, block_size=DEFAULT_BLOCK_SIZE):
    """Dispatch one leaf's AdamW step to the kernel or the reference.

    ``impl="auto"`` takes :func:`adamw_update_kernel` where the program is lowered for CUDA and
    :func:`adamw_update_reference` for any other platform, decided when lowering
    (``jax.lax.platform_dependent``): by the platform of the devices the step is compiled for,
    never the host's, so a deviceless compile for a GPU fleet holds the Triton kernel.
    ``"kernel"`` / ``"reference"`` force one. ``interpret`` and ``block_size`` are forwarded to
    the kernel. Raises ValueError on an unknown ``impl``; otherwise as the chosen implementation.
    """
    kernel = functools.partial(adamw_update_kernel, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                               interpret=interpret, block_size=block_size)
    reference = functools.partial(adamw_update_reference, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    impl = _resolve_impl(impl)
    if impl == "kernel":
        return kernel(p, g, m, v, lr=lr, count=count)
    if impl == "reference":
        return reference(p, g, m, v, lr=lr, count=count)
    lr, count = jnp.asarray(lr, jnp.float32), jnp.asarray(count, jnp.int32)
    return jax.lax.platform_dependent(p, g, m, v, lr, count, cuda=_positional(kernel), default=_positional(reference))


def shard_local(fn: Callable, mesh: jax.sharding.Mesh, spec) -> Callable:
    """Run a per-leaf update ``fn`` on each device's LOCAL shard.

    Returns ``wrapped(p, g, m, v, *, lr, count, **static)`` that calls
    ``fn(p_l, g_l, m_l, v_l, lr=lr, count=count, **static)`` inside
    ``jax.shard_map(mesh=mesh, in_specs=(spec,)*4 + (P(), P()),
    out_specs=(spec,)*3)``. ``spec`` is the leaf's ``PartitionSpec`` (None =
    replicated); p, g, m, v must all be laid out with it (ZeRO: optimizer
    state sharded like the params). ``lr`` and ``count`` are replicated
    scalars. Because AdamW is elementwise no collective is needed, so the
    compiled program contains no all-gather.
    """
    spec = P() if spec is None else spec

    def wrapped(p, g, m, v, *, lr, count, **static):
        def local(p, g, m, v, lr, count):
            return fn(p, g, m, v, lr=lr, count=count, **static)

        return jax.shard_map(
            local, mesh=mesh, in_specs=(spec,) * 4 + (P(), P()),
            out_specs=(spec,) * 3, check_vma=False,
        )(p, g, m, v, jnp.asarray(lr, jnp.float32),
          jnp.asarray(count, jnp.int32))

    return wrapped


# --------------------------------------------------------------------------
# optax-style transformation
# --------------------------------------------------------------------------


def _f32_zeros_like(p):
    """fp32 zeros of ``p``'s shape and sharding: a fresh Adam moment."""
    return jnp.zeros_like(p, dtype=jnp.float32)


class FusedAdamWState(NamedTuple):
    """State of :func:`fused_adamw`.

    count: int32 scalar, number of completed steps (replicated).
    mu: pytree like params, float32 first moments (sharded like params).
    nu: pytree like params, float32 second moments (sharded like params).
    """
    count: jax.Array
    mu: Any
    nu: Any


class FusedAdamW(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` with a fused ``apply``.

    ``init`` / ``update`` behave as for ``optax.adamw``; ``apply(grads,
    state, params) -> (new_params, new_state)`` writes new params straight
    from the kernel. ``config`` is the :class:`FusedAdamWConfig`.
    """
    __slots__ = ()

    @property
    def config(self) -> "FusedAdamWConfig":
        return self.update.__self__

    def apply(self, grads, state, params):
        return self.config.apply(grads, state, params)


@dataclasses.dataclass(frozen=True, eq=False)
class FusedAdamWConfig:
    """Hyperparameters + implementation choice of a fused AdamW optimizer.

    Built by :func:`fused_adamw`; its bound ``init`` / ``update`` / ``apply``
    are the optimizer's functions.
    """
    learning_rate: Any
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4
    mask: Any = None
    impl: str = "auto"
    interpret: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    mesh: Any = None
    param_specs: Any = None

    def init(self, params) -> FusedAdamWState:
        """Zero f32 moments like ``params`` (same shapes and shardings)."""
        return FusedAdamWState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(_f32_zeros_like, params),
            nu=jax.tree.map(_f32_zeros_like, params))

    def _step(self, grads, state: FusedAdamWState, params):
        if params is None:
            raise ValueError(
                "fused_adamw needs params (decoupled weight decay and the "
                "fused apply read them); call update(grads, state, params).")
        leaves_p, treedef = jax.tree.flatten(params)
        leaves_g = treedef.flatten_up_to(grads)
        leaves_m = treedef.flatten_up_to(state.mu)
        leaves_v = treedef.flatten_up_to(state.nu)
        if self.mask is None:
            leaves_mask = [True] * len(leaves_p)
        else:
            mask = self.mask(params) if callable(self.mask) else self.mask
            leaves_mask = [bool(x) for x in treedef.flatten_up_to(mask)]
        if self.mesh is not None:
            if self.param_specs is None:
                raise ValueError("fused_adamw: mesh= needs param_specs=")
            leaves_spec = treedef.flatten_up_to(self.param_specs)
        else:
            leaves_spec = [None] * len(leaves_p)

        lr = (self.learning_rate(state.count) if callable(self.learning_rate)
              else self.learning_rate)
        lr = jnp.asarray(lr, jnp.float32)
        count = optax.safe_increment(state.count)
        impl = _resolve_impl(self.impl)
        leaf_fn = functools.partial(
            adamw_update, impl=impl, interpret=self.interpret,
            block_size=self.block_size)

        new_p, new_m, new_v = [], [], []
        for p, g, m, v, use_wd, spec in zip(leaves_p, leaves_g, leaves_m,
                                           leaves_v, leaves_mask, leaves_spec):
            kw = dict(b1=self.b1, b2=self.b2, eps=self.eps,
                      weight_decay=self.weight_decay if use_wd else 0.0)
            if self.mesh is not None:
                out = shard_local(leaf_fn, self.mesh, spec)(
                    p, g, m, v, lr=lr, count=count, **kw)
            else:
                out = leaf_fn(p, g, m, v, lr=lr, count=count, **kw)
            new_p.append(out[0])
            new_m.append(out[1])
            new_v.append(out[2])
        unflat = functools.partial(jax.tree.unflatten, treedef)
        return unflat(new_p), FusedAdamWState(count, unflat(new_m),
                                              unflat(new_v))

    def update(self, updates, state, params=None, **extra_args):
        """optax ``update``: returns ``(new_p - p, new_state)``.

        ``updates`` have the params' dtypes. The difference is exact
        (Sterbenz) whenever ``new_p`` is within a factor 2 of ``p``, so
        ``optax.apply_updates(params, updates)`` reproduces the kernel's new
        params bit for bit there; where a parameter crosses zero the delta is
        rounded (by <= half an ulp of the delta; noticeable only for bf16
        params). Costs an extra read of params and a write + read of the
        updates tree vs :meth:`apply`.
        """
        del extra_args
        new_params, new_state = self._step(updates, state, params)
        deltas = jax.tree.map(lambda n, p: n - p, new_params, params)
        return deltas, new_state

    def apply(self, grads, state, params):
        """Fused step: ``(new_params, new_state)`` written by the kernel."""
        return self._step(grads, state, params)


def fused_adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4,
                mask=None, *, impl="auto", interpret=False,
                block_size=DEFAULT_BLOCK_SIZE, mesh=None,
                param_specs=None) -> FusedAdamW:
    """AdamW with a fused single-pass Pallas kernel per leaf (optax API).

    A drop-in for ``optax.adamw(learning_rate, b1, b2, eps, eps_root=0,
    weight_decay=weight_decay, mask=mask)`` with ``mu_dtype=float32``.
    Colossal-AI's ``HybridAdam`` / ``FusedAdam`` (``adamw_mode=True``) are
    aliases of this function: in Colossal-AI they are multi-tensor CUDA
    kernels (HybridAdam additionally runs a CPU Adam for offloaded params);
    here XLA/Pallas plays that role on whatever device holds the shard.

    Args:
      learning_rate: float, or an optax schedule ``count -> lr`` evaluated at
        the pre-increment step count (as optax does).
      b1, b2, eps, weight_decay: concrete floats (compiled into the kernel).
      mask: None (decay everything), a pytree of bools shaped like params, or
        a callable ``params -> that pytree``; weight decay applies where True.
      impl: "auto" (the kernel where the step is lowered for CUDA, the reference for any
        other platform), "kernel", "reference".
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      block_size: kernel elements per program (power of two).
      mesh, param_specs: if given, each leaf's update runs under
        ``jax.shard_map`` on the local shard, with ``param_specs`` a pytree of
        ``PartitionSpec`` (or None = replicated) shaped like params; grads and
        the optimizer state must share the params' layout. No all-gather.

    Returns:
      :class:`FusedAdamW` (an ``optax.GradientTransformationExtraArgs``):
      ``init(params) -> FusedAdamWState``, ``update(grads, state, params) ->
      (updates = new_p - p, state)`` (composes with ``optax.chain`` /
      ``optax.apply_updates``), and ``apply(grads, state, params) ->
      (new_params, state)`` (= :func:`fused_adamw_apply`).

    Shapes/dtypes: any leaf shapes; params f32 or bf16; grads f32/bf16/f16;
    moments f32. Bytes moved per step: 28 B/param (f32) with ``apply``.

    Raises:
      ValueError: unknown ``impl``, missing params, ``mesh`` without
        ``param_specs``, tree-structure mismatches (from ``flatten_up_to``),
        or ``impl="kernel"`` off-GPU without ``interpret=True``.
      TypeError: traced b1/b2/eps/weight_decay.
    """
    _resolve_impl(impl)  # validate early
    _pick_block(1, block_size)
    cfg = FusedAdamWConfig(
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
        weight_decay=weight_decay, mask=mask, impl=impl, interpret=interpret,
        block_size=block_size, mesh=mesh, param_specs=param_specs)
    return FusedAdamW(cfg.init, cfg.update)


def fused_adamw_apply(tx, grads, state, params):
    """Fused AdamW step returning ``(new_params, new_state)`` directly.

    ``tx`` is the :class:`FusedAdamW` returned by :func:`fused_adamw` (or its
    :class:`FusedAdamWConfig`). Equivalent to ``updates, state =
    tx.update(grads, state, params); params = optax.apply_updates(params,
    updates)`` but the kernel writes the new params itself (no ``updates``
    tree, no separate add: 28 B/param f32). Use it in a jitted train step
    with ``donate_argnums`` on params and state so the update is in place.
    Raises TypeError if ``tx`` is neither.
    """
    if isinstance(tx, FusedAdamW):
        tx = tx.config
    if not isinstance(tx, FusedAdamWConfig):
        raise TypeError(
            "fused_adamw_apply expects the result of fused_adamw(...), got "
            f"{type(tx).__name__}")
    return tx.apply(grads, state, params)


#: Colossal-AI name (``colossalai.nn.optimizer.HybridAdam``); same function.
HybridAdam = fused_adamw
#: Colossal-AI / apex name (``FusedAdam`` with ``adamw_mode=True``).
FusedAdam = fused_adamw
