"""Pipeline parallelism's executor: a scan over the ticks of a schedule table (GPipe, 1F1B,
interleaved; the tables are :mod:`jaxcolossal.parallel.pipeline_schedule`).

Layout
------
The train state keeps every stacked layer leaf as ``[L, ...]`` (``L = model.num_layers``) with the
``layers`` dimension sharded over the mesh axis ``pp`` (contiguous blocks of ``L/p`` layers per
device), so checkpoints and Hugging Face export do not depend on ``p``. Inside the step each leaf
is viewed as ``[p, v, Lc, ...]`` (``v = num_model_chunks``, ``Lc = L/(p·v)`` layers per chunk):
device ``s``, chunk ``c`` holds *virtual stage* ``k = c·p + s``, i.e. the global layers
``[k·Lc, (k+1)·Lc)`` (Megatron-LM's interleaved assignment). For ``v = 1`` the view is a free
reshape (device ``s`` already holds stage ``s``). For ``v > 1`` it is a permutation of the layer
dimension across ``pp``: XLA emits an all-to-all that moves ``(v-1)/v`` of each device's layer
weights (compute dtype) per step, and the transposed all-to-all for the fp32 gradients. That is
the price of keeping the ``[L, ...]`` state layout; under ZeRO-3 it rides on the weight gather.

Executor
--------
One ``jax.shard_map`` that is *manual* over ``pp`` and the data axes ``dp``/``fsdp`` and
*automatic* over ``tp``: tensor parallelism keeps working unchanged through the model's
``with_sharding_constraint`` annotations (Megatron column/row-parallel, vocab-parallel
embedding and cross-entropy), while the pipeline and data parallelism are explicit:

* a ``lax.scan`` over the schedule's ticks; ``lax.ppermute`` over ``pp`` moves activations
  ``[mb, t, d]`` forward (ring ``s -> s+1``) and cotangents back (ring ``s -> s-1``). What moves is
  whatever the family's ``pipeline_stages`` passes between stages: with a mixture of experts' pooled
  load-balancing loss, a pytree of the activations and the layers' router sums, whose cotangent
  carries that loss's gradient back;
* the embedding runs in the first virtual stage, final norm + LM head + loss in the last
  (``lax.cond`` on the static per-tick table; idle slots are skipped the same way). With tied
  embeddings both uses accumulate into the same gradient;
* every device differentiates with respect to a *varying* copy of its weights
  (``jax.lax.pcast(..., to='varying')``), so its gradient stays local and unreduced over the
  microbatches (no per-microbatch psum), and is reduced **once per step** at the end: an
  all-reduce (``psum``) over the data group for ZeRO 0, a reduce-scatter (``psum_scatter``)
  over ``fsdp`` onto the optimizer (ZeRO-1) or gradient (ZeRO 2/3) sharding; the embedding/head
  gradients are also summed over ``pp``. (So ZeRO-2 holds a full fp32 gradient buffer for the
  stage during the step, like ZeRO-1: reduce-scattering every microbatch would cost ``m``
  collectives per step, which is why Colossal-AI pairs pipelines with ZeRO <= 1);
* under ZeRO-3 the stage's weights (and the embedding/head) are all-gathered over ``fsdp``
  **once per step**, before the tick loop; every microbatch reuses the gathered copy.

The gradient contract is :func:`jaxcolossal.train.step.make_grad_fn`'s:
``grad_fn(params, inputs, targets, scale) -> (loss_sum, grads)`` with fp32 grads of the mean loss
carrying ``plan.specs.grads`` (``plan.specs.opt`` for ZeRO-1, as the non-pipelined step).

Schedules (``p`` stages, ``m`` microbatches, ``v`` chunks per device)
--------------------------------------------------------------------
* ``gpipe`` (Huang et al., 2019, GPipe): all forwards, then all backwards; the backward is JAX's
  autodiff of the forward scan, so the scan's residuals for all ``m`` microbatches are live at
  once (activation memory grows with ``m``). Idle ticks run the stage (and the head) on a
  placeholder and discard it with a ``where``, not a ``cond``: autodiff of a ``cond`` inside the
  tick scan saves its operands once per tick, the stage's weights included, which held
  ``m + p − 1`` copies of them (the medium LLaMA at pp 4: 692 -> 344 MiB per device). It differentiates with respect to fp32 copies of the
  weights that each tick casts to the compute dtype, so the microbatch gradients are summed in
  fp32, as in the lock-step schedules. ``m·v + p − 1`` forward ticks; bubble
  ``(p − 1)/(m·v + p − 1)``. With ``v > 1`` it is the circular (looped) pipeline: a tick's chunk
  index differs per tick, so its weights are sliced inside each layer's checkpointed body
  (:func:`jaxcolossal.parallel.layer_scan.scan_chunk`); slicing the chunk first made the slice a
  residual of every tick, ``m·v + p − 1`` copies of a chunk's weights.
* ``1f1b`` (PipeDream-Flush, Narayanan et al., 2021): lock-step one-forward-one-backward. Each
  tick has one forward slot and one backward slot; stage ``s`` runs the forward of microbatch
  ``t − s`` and the backward of microbatch ``t − (2p − 2 − s)``. The backward is a per-microbatch
  ``jax.vjp`` of the stage that recomputes the stage forward from its stashed input, so only the
  stage *inputs* are kept: ``2(p − 1 − s) + 1 ≤ 2p − 1`` of them on stage ``s``, whatever ``m``.
  ``m + 2p − 2`` ticks; bubble ``(2p − 2)/(m + 2p − 2)``.
* ``interleaved`` (Megatron-LM, Narayanan et al., 2021): the same lock-step over ``V = v·p``
  virtual stages placed round-robin. Microbatches go in groups of ``p`` (``m % p == 0``); device
  ``s`` runs its forward units in the order (group, chunk, microbatch in group) starting at tick
  ``s``, and its backward units in the order (group, chunk reversed, microbatch) starting at tick
  ``V − 1 + p − 1 − s``. Activations then leave device ``p−1``/chunk ``c`` exactly when device 0
  needs them for chunk ``c+1``. ``m·v + (v + 1)·p − 2`` ticks of one chunk each; bubble
  ``((v + 1)·p − 2)/(m·v + (v + 1)·p − 2)``, which is below 1F1B's exactly when
  ``(v − 1)(p − 2) > 0`` (p > 2: at p = 2 the lock-step forms tie). Stash: ``2V − 1`` chunk
  inputs. Both lock-step tick counts are the minimum for a lock-step schedule whose first
  backward waits for the first microbatch to traverse all ``V`` virtual stages.

Every device runs the same number of ticks and the same collectives in the same order (the
``cond`` branches of a stage are taken alike by its tp and data peers, and the ``ppermute`` s sit
outside them), and :func:`_after` orders a tick's collectives through buffers so that XLA's CPU
runtime cannot start them in different orders on different devices: a pipelined step cannot
deadlock. docs/pipeline.md has the measurements.
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.parallel.layer_scan import scan_chunk, scan_layers
from jaxcolossal.parallel.mesh import DATA_AXES, EP_AXIS, PP_AXIS, SP_AXIS, ZERO_AXIS, entry_axes
from jaxcolossal.parallel.pipeline_schedule import (
    CHUNK,
    FIRST,
    LAST,
    MB,
    SLOT,
    VALID,
    PipelineSchedule,
    pipeline_schedule_for,
)
from jaxcolossal.parallel.sequence import zigzag_batch, zigzag_order
from jaxcolossal.parallel.sharding import Sharder, is_spec

MANUAL_AXES = (PP_AXIS,) + DATA_AXES
"""The mesh axes the executor's ``shard_map`` is manual over (``sp`` too under ring attention)."""


# ----------------------------------------------------------------------------- helpers


def _keep(spec: P, keep) -> P:
    """``spec`` with only the mesh axes for which ``keep(name)`` holds, in every entry."""
    out = []
    for e in spec:
        names = entry_axes(e)
        kept = tuple(a for a in names if keep(a))
        out.append(kept if len(kept) > 1 else kept[0] if kept else None)
    return P(*out)


def _manual(spec: P, axes: tuple) -> P:
    """Keep only the manual mesh axes of a spec (shard_map specs may not name automatic ones)."""
    return _keep(spec, lambda a: a in axes)


def _without(spec: P, axis: str) -> P:
    """``spec`` with mesh axis ``axis`` removed from every entry."""
    return _keep(spec, lambda a: a != axis)


def _zero_dim(spec: P) -> int | None:
    """Index of the dimension that a spec shards over ``fsdp`` (None if none)."""
    for i, e in enumerate(spec):
        if e == ZERO_AXIS or (isinstance(e, tuple) and ZERO_AXIS in e):
            return i
    return None


def _vary(x: jax.Array, axes: tuple) -> jax.Array:
    """``pcast`` ``x`` to varying over those of ``axes`` (of size > 1) it is not varying over yet.

    Size-1 axes are left alone, so nothing needs a (trivial, but not free) psum over them, except
    ``ep``: the experts' weights come in split over it (their ``shard_map`` spec names it), so what they
    compute varies over it even at size 1, and a layer's output must match its input's type.
    """
    sizes = jax.sharding.get_abstract_mesh().shape
    have = jax.typeof(x).manual_axis_type.varying
    missing = tuple(a for a in axes if a not in have and (sizes[a] > 1 or a == EP_AXIS))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _after(a: Any, *deps: Any) -> Any:
    """``a``, exactly, but computed only once every array in ``deps`` exists (pytrees: the
    dependency goes into ``a``'s first leaf, from every leaf of ``deps``).

    It orders the collectives of a tick: forward slot, backward slot, the forward send, the
    backward send, each one reading a buffer written after the previous one. XLA's CPU runtime
    runs independent thunks concurrently and in whatever order they become ready, separately on
    each simulated device; two independent collective-bearing subgraphs (say a tp all-reduce in
    one chunk's layer loop and the pp collective-permute) can then start in a different order on
    two peers, and with few threads the blocking rendezvous deadlock (observed on this 2-core
    machine). ``lax.optimization_barrier`` does not help: the runtime orders thunks by buffers.

    The dependency is ``a[0,...,0] += where(isfinite(d), d, 0) * 0`` for one element ``d`` of
    each dep: XLA does not fold a float multiply by zero, the result is bit-identical (up to the
    sign of a zero), and its transpose orders the backward pass the same way (the cotangent
    flows through one element, never through a sum, so it cannot overflow).
    """
    z = jnp.zeros((), jnp.float32)
    for d in jax.tree.leaves(deps):
        d0 = d[(0,) * d.ndim].astype(jnp.float32)  # an element, not a ravel (which gathers a sharded d whole)
        z = z + jnp.where(jnp.isfinite(d0), d0, 0.0) * 0.0
    leaves, tree = jax.tree.flatten(a)
    first = leaves[0]
    leaves[0] = first.at[(0,) * first.ndim].add(z.astype(first.dtype))
    return jax.tree.unflatten(tree, leaves)


def _pick(cond: jax.Array, a: Any, b: Any) -> Any:
    """``where(cond, a, b)`` leaf by leaf (the activations may be a pytree: ``pipeline_stages``)."""
    return jax.tree.map(lambda u, v: jnp.where(cond, u, v), a, b)


def _to_chunks(a: jax.Array, p: int, v: int) -> jax.Array:
    """``[L, ...] -> [p, v, Lc, ...]``: element ``[s, c]`` is virtual stage ``c·p + s``."""
    L = a.shape[0]
    return jnp.swapaxes(a.reshape(v, p, L // (p * v), *a.shape[1:]), 0, 1)


def _from_chunks(a: jax.Array) -> jax.Array:
    """Inverse of :func:`_to_chunks`."""
    p, v, lc = a.shape[:3]
    return jnp.swapaxes(a, 0, 1).reshape(p * v * lc, *a.shape[3:])


def _dyn(a: jax.Array, i, n: int) -> jax.Array:
    return a[0] if n == 1 else jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)


def _dyn_add(acc: jax.Array, i, val: jax.Array, n: int) -> jax.Array:
    if n == 1:
        return acc + val[None]
    cur = jax.lax.dynamic_index_in_dim(acc, i, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(acc, cur + val, i, 0)


# ----------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class _Layout:
    """What the executor needs of a plan, decided once: the schedule, the manual axes, and the
    specs of the stage's layers and the other leaves, as parameters and as gradients."""

    plan: Any
    sched: PipelineSchedule
    seq_ring: bool
    manual_axes: tuple
    lay_param_specs: Any
    lay_grad_specs: Any
    oth_param_specs: dict
    oth_grad_specs: dict
    out_grad_specs: Any
    gather_outside: bool
    frozen_lay_specs: Any = None
    frozen_oth_specs: Any = None

    @property
    def sp(self) -> int:
        return self.plan.mesh_shape.get(SP_AXIS, 1)

    def vary(self, x: jax.Array) -> jax.Array:
        return _vary(x, self.manual_axes)

    def psum(self, x: jax.Array, axes: tuple) -> jax.Array:
        """``psum`` over those of ``axes`` of size > 1 (XLA keeps a trivial all-reduce as a copy), and over
        a size-1 ``ep`` that ``x`` varies over (a mixture of experts at ep 1: :func:`_vary`)."""
        varying = jax.typeof(x).manual_axis_type.varying
        axes = tuple(a for a in axes if self.plan.mesh_shape[a] > 1 or (a == EP_AXIS and a in varying))
        return jax.lax.psum(x, axes) if axes else x

    def gather(self, x: jax.Array, spec: P) -> jax.Array:
        """ZeRO-3: the whole stage's weights, once per step."""
        d = _zero_dim(spec)
        return x if d is None else jax.lax.all_gather(x, ZERO_AXIS, axis=d, tiled=True)

    def reduce(self, g: jax.Array, spec: P, over_pp: bool) -> jax.Array:
        """Once per step: an all-reduce (ZeRO 0/1) or a reduce-scatter onto ``spec`` (2/3)."""
        d = _zero_dim(spec)
        seq = (SP_AXIS,) if self.seq_ring else ()
        data = DATA_AXES if d is None else tuple(a for a in DATA_AXES if a != ZERO_AXIS)
        if EP_AXIS in {a for e in spec for a in entry_axes(e)}:  # an expert's gradient: its tokens came over ep
            data = tuple(a for a in data if a != EP_AXIS)
        axes = ((PP_AXIS,) if over_pp else ()) + data + seq
        if d is not None and self.plan.mesh_shape["tp"] > 1:
            # XLA all-gathers a reduce-scatter's operand over the automatic tp axis first (the whole
            # gradient on every device); an all-reduce keeps it tp-sharded: sum, keep this rank's slice
            g = self.psum(g, axes + (ZERO_AXIS,))
            size = g.shape[d] // self.plan.mesh_shape[ZERO_AXIS]
            return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(ZERO_AXIS) * size, size, axis=d)
        g = self.psum(g, axes)
        return g if d is None else jax.lax.psum_scatter(g, ZERO_AXIS, scatter_dimension=d, tiled=True)


def _staged(specs: Any) -> Any:
    """A tree of stacked-layer specs (``P`` leaves ``[L, ...]``) as the pipeline holds the layers:
    ``[pp, v, Lc, ...]``, the stage dimension on ``pp``."""
    return jax.tree.map(lambda s: P(PP_AXIS, None, None, *tuple(s)[1:]), specs, is_leaf=is_spec)


def _layout(plan) -> _Layout:
    """The :class:`_Layout` of a plan with ``pp > 1``."""
    cfg, shape = plan.cfg, plan.mesh_shape
    zero = cfg.parallel.zero_stage
    # ring attention: the shard_map is manual over sp as well; each device runs its zig-zag
    # sequence block through every op and the ring's ppermutes run inside it (no nested shard_map)
    seq_ring = cfg.parallel.sequence_parallelism_mode == "ring_attn" and shape.get(SP_AXIS, 1) > 1
    for s in jax.tree.leaves(plan.specs.params["layers"], is_leaf=is_spec):
        assert tuple(s)[0] == PP_AXIS, "make_plan must map the layers dimension to pp"
    # ZeRO-1 reduces straight onto the optimizer sharding, as the non-pipelined step does: each
    # rank only needs its slice for the update (a reduce-scatter instead of an all-reduce)
    out_grad_specs = plan.specs.opt if zero == 1 else plan.specs.grads
    lay_params = _staged(plan.specs.params["layers"])
    others = {k: s for k, s in plan.specs.params.items() if k != "layers"}
    gather_outside = zero == 3 and shape["tp"] > 1
    frozen = plan.frozen_specs or {"layers": {}}  # LoRA: the frozen base, staged as the params
    f_lay, f_oth = _staged(frozen["layers"]), {k: s for k, s in frozen.items() if k != "layers"}
    if gather_outside:  # ZeRO-3 with tp: XLA would all-gather over the automatic tp axis too inside the
        # shard_map (every device the whole weights); gathered over fsdp before it, they stay tp-sharded
        lay_params, others, f_lay, f_oth = jax.tree.map(lambda s: _without(s, ZERO_AXIS), (lay_params, others, f_lay, f_oth),
                                                        is_leaf=is_spec)
    return _Layout(frozen_lay_specs=f_lay, frozen_oth_specs=f_oth,plan=plan, sched=pipeline_schedule_for(cfg, shape[PP_AXIS]), seq_ring=seq_ring,
                   manual_axes=MANUAL_AXES + ((SP_AXIS,) if seq_ring else ()), lay_param_specs=lay_params,
                   lay_grad_specs=_staged(out_grad_specs["layers"]), oth_param_specs=others,
                   oth_grad_specs={k: s for k, s in out_grad_specs.items() if k != "layers"},
                   out_grad_specs=out_grad_specs, gather_outside=gather_outside)


# ----------------------------------------------------------------------------- one device's ticks


class _Ticks:
    """One device's view inside the ``shard_map``: its stage's chunks, the other leaves, its data
    shard's microbatches, and the tick functions of the schedule (module doc)."""

    def __init__(self, lay: _Layout, layers, others, xs, ys, coef, frozen_layers, frozen_others, rows=None):
        plan, sched = lay.plan, lay.sched
        self.lay, self.m, self.v, self.coef = lay, sched.m, sched.v, coef
        self.lockstep = sched.bwd is not None
        self.ring_f = [(i, (i + 1) % sched.p) for i in range(sched.p)]
        self.ring_b = [(i, (i - 1) % sched.p) for i in range(sched.p)]
        shard, positions = self._sharder(xs)
        embed, layer_for, head = plan.family.pipeline_stages(plan.cfg.model, shard, shard.is_sharded("vocab"),
                                                             positions)
        remat = plan.cfg.model.remat
        # the stage's activations, as varying as the received ones (a MoE's pooled-loss stream is a pytree
        # beside them, created at zero inside the embedding: pipeline_stages)
        self.embed, self.head_loss = (lambda o, tok: jax.tree.map(lay.vary, embed(o, tok))), head
        self.chunk = lambda lp, x: scan_layers(layer_for(x), x, lp, remat)
        self.chunk_at = lambda stage, c, x: scan_chunk(layer_for(x), x, stage, c, remat)
        # per-row segment ids and positions (GRPO's left-padded rows): the stages are built per microbatch
        self.rows = None if rows is None else tuple(r.reshape((sched.m, -1) + r.shape[1:]) for r in rows)
        self.stages_for = lambda seg, pos: plan.family.pipeline_stages(plan.cfg.model, shard, shard.is_sharded("vocab"),
                                                                      pos, seg)
        self.layers = jax.tree.map(lambda a, s: lay.vary(lay.gather(a, s)[0]), layers, lay.lay_param_specs)
        self.others = jax.tree.map(lambda a, s: lay.vary(lay.gather(a, s)), others, lay.oth_param_specs)
        # LoRA: the frozen base beside the trained adapters (never differentiated); else empty
        self.frozen_layers = jax.tree.map(lambda a, s: lay.vary(lay.gather(a, s)[0]), frozen_layers, lay.frozen_lay_specs)
        self.frozen_others = jax.tree.map(lambda a, s: lay.vary(lay.gather(a, s)), frozen_others, lay.frozen_oth_specs)
        b, t = xs.shape
        self.xs, self.ys = xs.reshape(self.m, b // self.m, t), ys.reshape(self.m, b // self.m, t)
        self.stage = jax.lax.axis_index(PP_AXIS)
        self.f_rows = jax.lax.dynamic_index_in_dim(jnp.asarray(sched.fwd), self.stage, 1, keepdims=False)  # [T, 6]
        shapes = jax.eval_shape(self.embed, self.whole({}, self.others)[1], self.xs[0])  # [mb, t, d], or (that, stream)
        self.act = jax.tree.map(lambda s: lay.vary(jnp.zeros(s.shape, s.dtype)), shapes)

    def _sharder(self, xs) -> tuple[Sharder, jax.Array | None]:
        """The activation sharder inside the ``shard_map`` (the manual axes map to nothing) and the
        tokens' positions (ring attention: this device's zig-zag block, at its original positions)."""
        lay, plan = self.lay, self.lay.plan
        local = {"batch": None, "layers": None, **({"seq": None} if lay.seq_ring else {})}
        shard = Sharder(jax.sharding.get_abstract_mesh(), {**plan.rules, **local},
                        plan.cfg.parallel.sequence_parallelism_mode).with_fp8(plan.cfg.precision.fp8)
        if plan.cfg.model.moe:  # the experts over the manual ep axis; the router losses are the microbatch's
            # (summed over the data axes, so one value for all shards): a microbatch's share of the step, 1/m
            data = tuple(a for a in DATA_AXES if plan.mesh_shape[a] > 1)
            shard = shard.with_manual_experts(plan.mesh_shape["ep"], data, 1.0 / self.m)
        if not lay.seq_ring:
            return shard, None
        tl = xs.shape[1]
        order = jnp.asarray(zigzag_order(tl * lay.sp, lay.sp), jnp.int32)
        positions = jax.lax.dynamic_slice_in_dim(order, jax.lax.axis_index(SP_AXIS) * tl, tl)
        return shard.zigzagged(), jnp.broadcast_to(positions, (xs.shape[0] // self.m, tl))

    def zero_loss(self) -> jax.Array:
        return self.lay.vary(jnp.zeros((), jnp.float32))

    def whole(self, layers, others):
        """The trained layers' and other leaves with the frozen base's beside them (LoRA)."""
        return {**self.frozen_layers, **layers}, {**self.frozen_others, **others}

    def microbatch_stages(self, mb) -> tuple[Callable, Callable, Callable]:
        """``(embed, chunk, chunk_at)`` for microbatch ``mb``: the step's own, or with per-row segment ids
        and positions (``rows``) the stages built for that microbatch's rows (a GPipe forward only)."""
        if self.rows is None:
            return self.embed, self.chunk, self.chunk_at
        seg, pos = (jax.lax.dynamic_index_in_dim(r, mb, 0, keepdims=False) for r in self.rows)
        embed, layer_for, _ = self.stages_for(seg, pos)
        remat = self.lay.plan.cfg.model.remat
        return (lambda o, tok: jax.tree.map(self.lay.vary, embed(o, tok)),
                lambda lp, x: scan_layers(layer_for(x), x, lp, remat),
                lambda stage, c, x: scan_chunk(layer_for(x), x, stage, c, remat))

    def forward_slot(self, row, recv, layers, others):
        """Embedding (first virtual stage only) then the chunk, skipped in idle slots."""
        layers, others = self.whole(layers, others)
        valid = row[VALID] == 1
        embed, chunk, chunk_at = self.microbatch_stages(row[MB])
        x = jax.lax.cond(valid & (row[FIRST] == 1), lambda: embed(others, self.xs[row[MB]]), lambda: recv)
        if not self.lockstep and self.v > 1:  # circular GPipe: a per-tick slice of the chunk's weights would be
            # a residual of every tick (see the module doc); slice each layer's inside its body
            return x, _pick(valid, chunk_at(layers, row[CHUNK], x), x)
        lp = jax.tree.map(lambda a: _dyn(a, row[CHUNK], self.v), layers)
        if self.lay.seq_ring or not self.lockstep:  # seq_ring: every device runs the ring's ppermutes at every
            # tick; GPipe: a cond's residuals are not loop-invariant, so autodiff of the tick scan would
            # save the stage's weights once per tick (see the module doc)
            return x, _pick(valid, chunk(lp, x), x)
        return x, jax.lax.cond(valid, lambda: chunk(lp, x), lambda: x)

    def gpipe_grads(self):
        """GPipe: the forward ticks, differentiated by autodiff of their scan. Returns ``(loss,
        layer grads, other grads)``, unreduced. The gradient is taken with respect to fp32 copies
        cast to the compute dtype inside each tick: the cast's transpose makes each tick's weight
        cotangent fp32, so the scan's transpose sums the microbatches in fp32."""
        dtype = self.lay.plan.compute_dtype

        def cast(tree, dt):
            return jax.tree.map(lambda a: a.astype(dt), tree)

        def loss_of(layers32, others32):
            def tick(carry, row):
                recv, loss = carry
                layers, others = cast((layers32, others32), dtype)
                _, y = self.forward_slot(row, recv, layers, others)
                last = (row[VALID] == 1) & (row[LAST] == 1)
                l = jnp.where(last, self.head_loss(self.whole({}, others)[1], y, self.ys[row[MB]]), 0.0)
                y = _after(y, l)  # the head's collectives before the send
                return (jax.lax.ppermute(y, PP_AXIS, self.ring_f), loss + l), None

            (_, loss), _ = jax.lax.scan(tick, (self.act, self.zero_loss()), self.f_rows)
            return loss

        loss, vjp = jax.vjp(loss_of, *cast((self.layers, self.others), jnp.float32))
        return (loss, *vjp(self.lay.vary(self.coef)))

    def gpipe_outputs(self):
        """GPipe's forward ticks, differentiable (their autodiff is GPipe's backward): the last virtual
        stage's output of every microbatch, ``[m, mb, t, d]`` on the last stage, zeros elsewhere. The
        weights enter as fp32 copies cast inside each tick, as in :meth:`gpipe_grads`, so the microbatches'
        weight cotangents are summed in fp32."""
        dtype = self.lay.plan.compute_dtype
        weights32 = jax.tree.map(lambda a: a.astype(jnp.float32), (self.layers, self.others))

        def tick(carry, row):
            recv, out = carry
            layers, others = jax.tree.map(lambda a: a.astype(dtype), weights32)
            _, y = self.forward_slot(row, recv, layers, others)
            last = (row[VALID] == 1) & (row[LAST] == 1)
            cur = jax.lax.dynamic_index_in_dim(out, row[MB], 0, keepdims=False)
            out = jax.lax.dynamic_update_index_in_dim(out, jnp.where(last, y, cur), row[MB], 0)
            return (jax.lax.ppermute(_after(y, out), PP_AXIS, self.ring_f), out), None

        out = self.lay.vary(jnp.zeros((self.m,) + self.act.shape, self.act.dtype))
        (_, out), _ = jax.lax.scan(tick, (self.act, out), self.f_rows)
        return out

    def backward_slot(self, br, xb, recv_b, g_lay, g_oth, loss):
        """Recompute the chunk from its stashed input, pull back the cotangent (from the loss in the
        last virtual stage, else received), accumulate the gradients."""
        lp = jax.tree.map(lambda a: _dyn(a, br[CHUNK], self.v), self.layers)
        base = jax.tree.map(lambda a: _dyn(a, br[CHUNK], self.v), self.frozen_layers)
        yb, chunk_vjp = jax.vjp(lambda lp, x: self.chunk({**base, **lp}, x), lp, xb)

        def add_f32(acc, g):
            return jax.tree.map(lambda A, b: A + b.astype(jnp.float32), acc, g)

        def with_head(g_oth, loss):
            l, head_vjp = jax.vjp(lambda o, h: self.head_loss({**self.frozen_others, **o}, h, self.ys[br[MB]]),
                                  self.others, yb)
            g_head, dy = head_vjp(self.lay.vary(self.coef))
            return jax.tree.map(lambda d, y: d.astype(y.dtype), dy, yb), add_f32(g_oth, g_head), loss + l

        dy, g_oth, loss = jax.lax.cond(br[LAST] == 1, with_head, lambda g_oth, loss: (recv_b, g_oth, loss), g_oth, loss)
        g_lp, dx = chunk_vjp(dy)
        g_lay = jax.tree.map(lambda G, g: _dyn_add(G, br[CHUNK], g.astype(jnp.float32), self.v), g_lay, g_lp)

        def with_embed(g_oth):
            _, emb_vjp = jax.vjp(lambda o: self.embed({**self.frozen_others, **o}, self.xs[br[MB]]), self.others)
            return add_f32(g_oth, emb_vjp(dx)[0])

        return dx, g_lay, jax.lax.cond(br[FIRST] == 1, with_embed, lambda g: g, g_oth), loss

    def lockstep_tick(self, carry, rows):
        """1F1B / interleaved: one forward slot, one backward slot, then the two sends."""
        recv_f, recv_b, stash, g_lay, g_oth, loss = carry
        fr, br = rows
        x, y = self.forward_slot(fr, recv_f, self.layers, self.others)  # stash the forward's input
        stash = jax.tree.map(lambda st, a: jax.lax.dynamic_update_index_in_dim(st, a, fr[SLOT], 0), stash, x)
        xb = _after(jax.tree.map(lambda st: jax.lax.dynamic_index_in_dim(st, br[SLOT], 0, keepdims=False), stash),
                    y)  # after the forward
        if self.lay.seq_ring:  # computed in idle slots too, and dropped: a ring's ppermute under a
            # stage-dependent cond would be matched with the other stage's pp send
            out = self.backward_slot(br, xb, recv_b, g_lay, g_oth, loss)
            dx, g_lay, g_oth, loss = _pick(br[VALID] == 1, out, (recv_b, g_lay, g_oth, loss))
        else:
            dx, g_lay, g_oth, loss = jax.lax.cond(br[VALID] == 1, self.backward_slot,
                                                  lambda br, xb, recv_b, *acc: (recv_b, *acc),
                                                  br, xb, recv_b, g_lay, g_oth, loss)
        recv_f = jax.lax.ppermute(_after(y, dx), PP_AXIS, self.ring_f)
        recv_b = jax.lax.ppermute(_after(dx, recv_f), PP_AXIS, self.ring_b)  # one send at a time
        return (recv_f, recv_b, stash, g_lay, g_oth, loss), None

    def lockstep_grads(self):
        """1F1B / interleaved: the tick scan with a stash of stage inputs. Returns ``(loss, layer
        grads, other grads)``, unreduced, fp32."""
        sched = self.lay.sched
        b_rows = jax.lax.dynamic_index_in_dim(jnp.asarray(sched.bwd), self.stage, 1, keepdims=False)

        def f32z(a):
            return self.lay.vary(jnp.zeros(a.shape, jnp.float32))

        stash = jax.tree.map(lambda a: self.lay.vary(jnp.zeros((sched.num_slots,) + a.shape, a.dtype)), self.act)
        init = (self.act, self.act, stash,
                jax.tree.map(f32z, self.layers), jax.tree.map(f32z, self.others), self.zero_loss())
        (_, _, _, g_layers, g_others, loss), _ = jax.lax.scan(self.lockstep_tick, init, (self.f_rows, b_rows))
        return loss, g_layers, g_others


def _body(lay: _Layout) -> Callable:
    """The ``shard_map`` body: one device's ticks, then the gradients reduced once per step, one
    group of collectives after the other (:func:`_after`)."""
    unstaged = jax.tree.map(lambda s: P(*tuple(s)[1:]), lay.lay_grad_specs, is_leaf=is_spec)

    def body(layers, others, frozen_layers, frozen_others, xs, ys, coef):
        # layers: leaves [1, v, Lc, ...] (this device's chunks); others: embedding / head leaves.
        # frozen_*: LoRA's base weights, likewise (else empty). xs, ys: int32 [B/N, t] (this data
        # shard); coef: scale / (B·t).
        ticks = _Ticks(lay, layers, others, xs, ys, coef, frozen_layers, frozen_others)
        loss, g_layers, g_others = ticks.lockstep_grads() if ticks.lockstep else ticks.gpipe_grads()
        loss = lay.psum(loss, lay.manual_axes)
        g_layers = jax.tree.map(lambda g, s: lay.reduce(_after(g, loss), s, False)[None], g_layers, unstaged)
        done = jax.tree.leaves(g_layers)
        g_others = jax.tree.map(lambda g, s: lay.reduce(_after(g, *done), s, True), g_others, lay.oth_grad_specs)
        return loss, g_layers, g_others
    return body


def _staged_inputs(lay: _Layout, mesh, params: dict, frozen: dict | None) -> tuple:
    """``(layers, others, frozen layers, frozen others)`` as the executor's ``shard_map`` takes them: the
    stacked layers ``[L, ...]`` viewed as ``[p, v, Lc, ...]`` on the staged specs, the other leaves as they
    are (gathered over ``fsdp`` first when ZeRO-3 meets tp: ``gather_outside``); ``frozen``: LoRA's base, or
    None."""
    p, v = lay.sched.p, lay.sched.v

    def put(a, s):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s))

    frozen = frozen or {"layers": {}}
    layers = jax.tree.map(lambda a, s: put(_to_chunks(a, p, v), s), params["layers"], lay.lay_param_specs)
    f_layers = jax.tree.map(lambda a, s: put(_to_chunks(a, p, v), s), frozen["layers"], lay.frozen_lay_specs)
    others = {k: a for k, a in params.items() if k != "layers"}
    f_others = {k: a for k, a in frozen.items() if k != "layers"}
    if lay.gather_outside:
        others = {k: put(a, lay.oth_param_specs[k]) for k, a in others.items()}
        f_others = {k: put(a, lay.frozen_oth_specs[k]) for k, a in f_others.items()}
    return layers, others, f_layers, f_others


# ----------------------------------------------------------------------------- the forward of an objective


def make_pipeline_hidden(plan) -> Callable:
    """``hidden(params, inputs, frozen=None) -> [B, t, d]``: the last decoder layer's output of every row
    (before the final norm: ``family.final_norm``) over the pipeline's GPipe forward ticks, for an
    objective's own head (:mod:`jaxcolossal.train.pipeline_objective`). Differentiable: its autodiff is
    GPipe's backward (the weights' cotangents summed over the microbatches in fp32, reduced over the
    data group and ``pp`` by the ``shard_map``'s transpose).

    ``params``: the model's params (``plan.specs.params``; under LoRA the adapters, ``frozen`` the base),
    or a reference copy laid out alike; ``inputs``: int32 ``[B, t]`` sharded over the data axes, each data
    shard's rows split into the pipeline's ``m`` microbatches as the train step splits them;
    ``segment_ids``/``positions``: int ``[B, t]`` alike, or None (GRPO's left-padded rows: the pads are
    kept out of attention, positions count from a row's first real token). The output
    is sharded over the data axes like ``inputs``, in the compute dtype. A dense model only (the config
    refuses a mixture of experts and ring attention here)."""
    lay, mesh = _layout(plan), plan.mesh
    data = tuple(a for a in DATA_AXES if plan.mesh_shape[a] > 1)
    batch = data if len(data) > 1 else data[0] if data else None

    def manual(tree):
        return jax.tree.map(lambda s: _manual(s, lay.manual_axes), tree, is_leaf=lambda x: isinstance(x, P))

    def body(layers, others, frozen_layers, frozen_others, xs, rows):
        ticks = _Ticks(lay, layers, others, xs, xs, None, frozen_layers, frozen_others, rows or None)
        out = lay.psum(ticks.gpipe_outputs(), (PP_AXIS, EP_AXIS))  # the last stage's values, on every stage
        return out.reshape((xs.shape[0],) + out.shape[2:])

    smap = jax.shard_map(
        body, mesh=mesh, axis_names=set(lay.manual_axes),
        in_specs=(manual(lay.lay_param_specs), manual(lay.oth_param_specs), manual(lay.frozen_lay_specs),
                  manual(lay.frozen_oth_specs), P(batch, None), P(batch, None)),
        out_specs=P(batch, None, None))

    def hidden(params, inputs, frozen=None, segment_ids=None, positions=None):
        rows = () if segment_ids is None else (segment_ids, positions)
        return smap(*_staged_inputs(lay, mesh, params, frozen), inputs, rows)

    return hidden


# ----------------------------------------------------------------------------- the grad function


def make_pipeline_grad_fn(plan) -> Callable:
    """``grad_fn(params, inputs, targets, scale) -> (loss_sum, grads)`` over a pipelined step.

    Args:
        plan: a :class:`jaxcolossal.train.state.TrainPlan` with ``mesh_shape["pp"] > 1``.

    ``inputs``/``targets``: int32 ``[B, t]`` sharded ``P(("dp", "fsdp"), None)``; each
    data shard's ``B/N`` rows are split into ``m`` microbatches of ``B/(N·m)``. Returns the fp32
    summed loss and fp32 gradients of the mean loss (divided by ``B·t``, unscaled), sharded as
    ``plan.specs.grads`` (for ZeRO-1 as ``plan.specs.opt``, like the non-pipelined step).

    Raises:
        NotImplementedError: a loss mask or packed segments (the config refuses them first).
    """
    lay, mesh = _layout(plan), plan.mesh

    def manual(tree):
        return jax.tree.map(lambda s: _manual(s, lay.manual_axes), tree, is_leaf=lambda x: isinstance(x, P))

    data = tuple(a for a in DATA_AXES if plan.mesh_shape[a] > 1)
    tok_spec = P(data if len(data) > 1 else data[0] if data else None, SP_AXIS if lay.seq_ring else None)
    smap = jax.shard_map(
        _body(lay), mesh=mesh, axis_names=set(lay.manual_axes),
        in_specs=(manual(lay.lay_param_specs), manual(lay.oth_param_specs), manual(lay.frozen_lay_specs),
                  manual(lay.frozen_oth_specs), tok_spec, tok_spec, P()),
        out_specs=(P(), manual(lay.lay_grad_specs), manual(lay.oth_grad_specs)))

    def put(a, s):
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s))

    def grad_fn(params, inputs, targets, scale, mask=None, segment_ids=None, positions=None, frozen=None, step=None):
        if mask is not None or segment_ids is not None or positions is not None:
            raise NotImplementedError(
                "a loss mask or packed segments (batch['loss_mask'], ['segment_ids']) are not supported with "
                "pipeline_parallel_size > 1 yet; train such batches with parallel.pipeline_parallel_size=1")
        B, t = inputs.shape
        coef = (scale / (B * t)).astype(jnp.float32)
        if lay.seq_ring:  # zig-zag order, so that the causal ring keeps every device busy (parallel.sequence)
            inputs, targets, *_ = zigzag_batch(inputs, targets, sp=lay.sp)
        # LoRA's base beside the adapters (step: its dropout, refused with a pipeline)
        loss_sum, g_layers, g_others = smap(*_staged_inputs(lay, mesh, params, frozen), inputs, targets, coef)
        g_layers = jax.tree.map(lambda g, s: put(_from_chunks(g), s), g_layers, lay.out_grad_specs["layers"])
        grads = jax.tree.map(lambda g: g / scale, {**g_others, "layers": g_layers})
        return loss_sum, grads

    return grad_fn
