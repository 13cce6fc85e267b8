"""Pipeline parallelism: static schedule tables and a scan-based executor (GPipe, 1F1B, interleaved).

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
  ``[mb, t, d]`` forward (ring ``s -> s+1``) and cotangents back (ring ``s -> s-1``);
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
  (:func:`jaxcolossal.models.remat.scan_chunk`); slicing the chunk first made the slice a
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
from typing import Callable

import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcolossal.config import Config, ConfigError, pipeline_microbatches
from jaxcolossal.sequence import SP_AXIS, zigzag_batch, zigzag_order
from jaxcolossal.sharding import Sharder

PP_AXIS = "pp"
DATA_AXES = ("dp", "fsdp")
MANUAL_AXES = (PP_AXIS,) + DATA_AXES
ZERO_AXIS = "fsdp"

# table columns
VALID, MB, CHUNK, SLOT, FIRST, LAST = range(6)


# ----------------------------------------------------------------------------- schedule tables


@dataclass(frozen=True)
class PipelineSchedule:
    """A static schedule: what each of ``p`` devices runs at each of ``T`` ticks.

    Attributes:
        kind: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        p, m, v: stages (devices on ``pp``), microbatches, chunks (virtual stages) per device.
        fwd: int32 ``[T, p, 6]``: per tick and device the forward slot's (valid, microbatch,
            chunk, stash slot, is-first-virtual-stage, is-last-virtual-stage).
        bwd: the same for the backward slot, or ``None`` for ``gpipe`` (autodiff mirrors ``fwd``).
        num_slots: stash entries per device (stage inputs kept for the backward).
    """

    kind: str
    p: int
    m: int
    v: int
    fwd: np.ndarray
    bwd: np.ndarray | None
    num_slots: int

    @property
    def num_ticks(self) -> int:
        return int(self.fwd.shape[0])

    @property
    def bubble_fraction(self) -> float:
        """Idle (device, slot) pairs over all pairs in the table (forward and backward slots
        alike; for ``gpipe`` the backward pass mirrors the forward table)."""
        busy = int(self.fwd[..., VALID].sum()) + (int(self.bwd[..., VALID].sum()) if self.bwd is not None else 0)
        slots = self.fwd[..., VALID].size * (2 if self.bwd is not None else 1)
        return 1.0 - busy / slots

    @property
    def bubble_formula(self) -> float:
        """The closed form of :attr:`bubble_fraction` (module docstring)."""
        p, m, v = self.p, self.m, self.v
        if self.kind == "gpipe":
            return (p - 1) / (m * v + p - 1)
        return ((v + 1) * p - 2) / (m * v + (v + 1) * p - 2)


def _unit(j: int, c: int, p: int, v: int, reverse: bool) -> int:
    """Position of (microbatch j, chunk c) in a device's forward (or backward) unit order:
    groups of p microbatches, then chunks (reversed for the backward), then the microbatch."""
    g, r = divmod(j, p)
    cc = v - 1 - c if reverse else c
    return g * v * p + cc * p + r


@functools.lru_cache(maxsize=256)
def make_schedule(kind: str, p: int, m: int, v: int = 1) -> PipelineSchedule:
    """Build the static table for ``kind`` over ``p`` stages, ``m`` microbatches, ``v`` chunks
    (cached: the planner asks for the same tables for many layouts; treat them as read-only).

    Raises:
        ConfigError: ``v > 1`` with ``m`` not a multiple of ``p``, or an unknown kind.
    """
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ConfigError(f"parallel.pipeline_schedule={kind!r}: allowed values are ['gpipe', '1f1b', 'interleaved']")
    if v > 1 and m % p:
        raise ConfigError(f"{v} model chunks need num_microbatches divisible by pipeline_parallel_size: "
                          f"{m} % {p} != 0")
    V = v * p
    units = m * v
    lockstep = kind != "gpipe"
    T = units + (V + p - 2 if lockstep else p - 1)
    S = 2 * V - 1 if lockstep else 1
    fwd = np.zeros((T, p, 6), np.int32)
    bwd = np.zeros((T, p, 6), np.int32)
    # idle slots still write their (stale) input to the stash: to slot (t - s) mod S, the slot of
    # the unit this device would start at tick t, which no waiting unit holds (check_schedule)
    for t in range(T):
        for s in range(p):
            fwd[t, s, SLOT] = (t - s) % S
            bwd[t, s, SLOT] = (t - s) % S
    for j in range(m):
        for c in range(v):
            for s in range(p):
                k = c * p + s
                uf = _unit(j, c, p, v, reverse=False)
                tf = s + uf
                fwd[tf, s] = (1, j, c, uf % S, k == 0, k == V - 1)
                if lockstep:
                    tb = (V - 1) + (p - 1 - s) + _unit(j, c, p, v, reverse=True)
                    bwd[tb, s] = (1, j, c, uf % S, k == 0, k == V - 1)
    fwd.setflags(write=False)
    bwd.setflags(write=False)
    sched = PipelineSchedule(kind, p, m, v, fwd, bwd if lockstep else None, S)
    check_schedule(sched)
    return sched


def check_schedule(s: PipelineSchedule) -> None:
    """Assert the data dependencies of a table (used at build time and by the tests).

    Forward of (j, k+1) is exactly one tick after forward of (j, k) on the next device; backward
    of (j, k-1) exactly one tick after backward of (j, k) on the previous device; the last
    virtual stage's backward is in the tick of its forward; every unit runs once; a stash slot is
    never overwritten while its unit waits for its backward.
    """
    p, v, m = s.p, s.v, s.m
    V = p * v
    where_f, where_b = {}, {}
    for t in range(s.num_ticks):
        for d in range(p):
            row = s.fwd[t, d]
            if row[VALID]:
                key = (int(row[MB]), int(row[CHUNK]) * p + d)
                assert key not in where_f
                where_f[key] = (t, int(row[SLOT]))
            if s.bwd is not None and s.bwd[t, d, VALID]:
                row = s.bwd[t, d]
                key = (int(row[MB]), int(row[CHUNK]) * p + d)
                assert key not in where_b
                where_b[key] = (t, int(row[SLOT]))
    assert len(where_f) == m * V
    for (j, k), (t, _) in where_f.items():
        if k + 1 < V:
            assert where_f[(j, k + 1)][0] == t + 1, (j, k)
    if s.bwd is None:
        return
    assert len(where_b) == m * V
    for (j, k), (t, slot) in where_b.items():
        tf, fslot = where_f[(j, k)]
        assert slot == fslot and t >= tf
        if k == V - 1:
            assert t == tf
        if k > 0:
            assert where_b[(j, k - 1)][0] == t + 1, (j, k)
        # no other forward on this device writes the slot during (tf, t]
        d = k % p
        for tt in range(tf + 1, t + 1):
            assert s.fwd[tt, d, SLOT] != slot, (j, k, tt)


# ----------------------------------------------------------------------------- model pieces


def _stage_fns(cfg: Config, shard: Sharder, vocab_parallel: bool, positions: jax.Array | None = None):
    """``embed(others, tokens)``, ``chunk(layer_params, x)``, ``head_loss(others, x, targets)`` and
    ``chunk_at(stage_params, c, x)`` for the configured model family: the model's forward cut at
    the stage boundaries.

    ``tokens``/``targets``: int32 ``[mb, t]``; ``x``: ``[mb, t, d]`` in the compute dtype;
    ``layer_params``: the family's layer leaves with a leading ``[Lc]``; ``chunk_at``: chunk ``c``
    (traced int32) of ``stage_params`` (leaves ``[v, Lc, ...]``), slicing each layer's weights in
    the checkpointed body (:func:`jaxcolossal.models.remat.scan_chunk`); ``head_loss`` returns
    the summed fp32 cross-entropy of the microbatch. ``positions``: int32 ``[mb, t]``, the tokens'
    positions when they are not ``arange(t)`` (ring attention: this device's zig-zag block).
    """
    from jaxcolossal.models import get_family, llama
    from jaxcolossal.models.remat import scan_chunk, scan_layers
    from jaxcolossal.models.vocab import embed_lookup

    m = cfg.model
    family = get_family(m)
    name = family.__name__.rsplit(".", 1)[-1]

    def lookup(table, tokens):  # Megatron's VocabParallelEmbedding when vocab_parallel, as in the model
        return embed_lookup(table, tokens, shard, vocab_parallel, m.embedding_impl)

    if name == "llama":
        def embed(o, tokens):
            return shard(lookup(o["embed_tokens"], tokens), ("batch", "seq", "embed"))

        def layer_for(x):
            cos, sin = llama.rope_tables(x.shape[1], m.head_dim, m.rope_theta, positions)
            return lambda h, p: llama.decoder_layer(h, p, m, cos, sin, shard, positions=positions)

        def head_loss(o, x, y):
            return llama.head_loss(o, llama.rms_norm(x, o["final_norm"], m.rms_norm_eps), y, m, shard)
    elif name == "gpt2":
        def embed(o, tokens):
            x = lookup(o["wte"], tokens)
            wpe = o["wpe"][: tokens.shape[1]][None] if positions is None else jnp.take(o["wpe"], positions, axis=0)
            return shard(x + wpe.astype(x.dtype), ("batch", "seq", "embed"))

        def layer_for(x):
            return lambda h, p: family.decoder_layer(h, p, m, shard, positions=positions)

        def head_loss(o, x, y):
            h = family.layer_norm(x, o["final_norm"], o["final_norm_bias"], m.layer_norm_eps)
            return family.head_loss(o, h, y, m, shard)
    else:
        raise ConfigError(f"pipeline parallelism has no stage split for model.type={m.type!r}")

    def chunk(lp, x):
        return scan_layers(layer_for(x), x, lp, m.remat)

    def chunk_at(stage, c, x):
        return scan_chunk(layer_for(x), x, stage, c, m.remat)
    return embed, chunk, head_loss, chunk_at


# ----------------------------------------------------------------------------- helpers


def _keep(spec: P, keep) -> P:
    """``spec`` with only the mesh axes for which ``keep(name)`` holds, in every entry."""
    out = []
    for e in spec:
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        kept = tuple(a for a in names if keep(a))
        out.append(kept if len(kept) > 1 else kept[0] if kept else None)
    return P(*out)


def _manual(spec: P, axes=MANUAL_AXES) -> P:
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


def _vary(x: jax.Array, axes=MANUAL_AXES) -> jax.Array:
    """``pcast`` ``x`` to varying over those of ``axes`` (of size > 1) it is not varying over yet.

    Size-1 axes are left alone, so nothing needs a (trivial, but not free) psum over them.
    """
    sizes = jax.sharding.get_abstract_mesh().shape
    have = jax.typeof(x).manual_axis_type.varying
    missing = tuple(a for a in axes if a not in have and sizes[a] > 1)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _after(a: jax.Array, *deps: jax.Array) -> jax.Array:
    """``a``, exactly, but computed only once every array in ``deps`` exists.

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
    for d in deps:
        d0 = d[(0,) * d.ndim].astype(jnp.float32)  # an element, not a ravel (which gathers a sharded d whole)
        z = z + jnp.where(jnp.isfinite(d0), d0, 0.0) * 0.0
    idx = (0,) * a.ndim
    return a.at[idx].add(z.astype(a.dtype))


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


# ----------------------------------------------------------------------------- the grad function


def pipeline_schedule_for(cfg: Config, p: int) -> PipelineSchedule:
    """The schedule a config asks for on ``p`` pipeline stages."""
    par = cfg.parallel
    return make_schedule(par.pipeline_schedule, p, pipeline_microbatches(cfg, p), par.num_model_chunks)


def make_pipeline_grad_fn(plan) -> Callable:
    """``grad_fn(params, inputs, targets, scale) -> (loss_sum, grads)`` over a pipelined step.

    Args:
        plan: a :class:`jaxcolossal.train.state.TrainPlan` with ``mesh_shape["pp"] > 1``.

    ``inputs``/``targets``: int32 ``[B, t]`` sharded ``P(("dp", "fsdp"), None)``; each
    data shard's ``B/N`` rows are split into ``m`` microbatches of ``B/(N·m)``. Returns the fp32
    summed loss and fp32 gradients of the mean loss (divided by ``B·t``, unscaled), sharded as
    ``plan.specs.grads`` (for ZeRO-1 as ``plan.specs.opt``, like the non-pipelined step).
    """
    cfg, mesh = plan.cfg, plan.mesh
    p = plan.mesh_shape[PP_AXIS]
    sched = pipeline_schedule_for(cfg, p)
    m, v = sched.m, sched.v
    zero = cfg.parallel.zero_stage
    fwd_tab = jnp.asarray(sched.fwd)
    bwd_tab = jnp.asarray(sched.bwd) if sched.bwd is not None else None
    S = sched.num_slots
    lockstep = sched.bwd is not None
    ring_f = [(i, (i + 1) % p) for i in range(p)]
    ring_b = [(i, (i - 1) % p) for i in range(p)]
    # ring attention: the shard_map is manual over sp as well; each device runs its zig-zag
    # sequence block through every op and the ring's ppermutes run inside it (no nested shard_map).
    # The chunks then run in idle slots too, their results dropped: a collective-permute is a
    # rendezvous of every device it names, and one run under a stage-dependent lax.cond (by one
    # stage's devices only) is matched with the other stage's pp send; on the CPU backend the
    # result is silently wrong (measured). The idle slots are the bubble, time the devices wait anyway.
    sp = plan.mesh_shape.get(SP_AXIS, 1)
    seq_ring = cfg.parallel.sequence_parallelism_mode == "ring_attn" and sp > 1
    seq_axes = (SP_AXIS,) if seq_ring else ()  # summed over like the data axes
    manual_axes = MANUAL_AXES + seq_axes
    vary = lambda x: _vary(x, manual_axes)  # noqa: E731

    is_spec = lambda x: isinstance(x, P)
    lay_param_specs = jax.tree.map(lambda s: P(PP_AXIS, None, None, *tuple(s)[1:]),
                                   plan.specs.params["layers"], is_leaf=is_spec)
    # ZeRO-1 reduces straight onto the optimizer sharding, as the non-pipelined step does: each
    # rank only needs its slice for the update (a reduce-scatter instead of an all-reduce).
    out_grad_specs = plan.specs.opt if zero == 1 else plan.specs.grads
    lay_grad_specs = jax.tree.map(lambda s: P(PP_AXIS, None, None, *tuple(s)[1:]),
                                  out_grad_specs["layers"], is_leaf=is_spec)
    oth_param_specs = {k: s for k, s in plan.specs.params.items() if k != "layers"}
    oth_grad_specs = {k: s for k, s in out_grad_specs.items() if k != "layers"}
    for s in jax.tree.leaves(plan.specs.params["layers"], is_leaf=is_spec):
        assert tuple(s)[0] == PP_AXIS, "make_plan must map the layers dimension to pp"
    gather_outside = zero == 3 and plan.mesh_shape["tp"] > 1
    if gather_outside:  # ZeRO-3 with tp: XLA would all-gather over the automatic tp axis too inside the
        # shard_map (every device the whole weights); gathered over fsdp before it, they stay tp-sharded
        lay_param_specs = jax.tree.map(lambda s: _without(s, ZERO_AXIS), lay_param_specs, is_leaf=is_spec)
        oth_param_specs = jax.tree.map(lambda s: _without(s, ZERO_AXIS), oth_param_specs, is_leaf=is_spec)

    def gather(x, spec):  # ZeRO-3: the whole stage's weights, once per step
        d = _zero_dim(spec)
        return x if d is None else jax.lax.all_gather(x, ZERO_AXIS, axis=d, tiled=True)

    def reduce(g, spec, over_pp):  # once per step: all-reduce (ZeRO 0/1) or reduce-scatter (2/3)
        d = _zero_dim(spec)
        axes = ((PP_AXIS,) if over_pp else ()) + (DATA_AXES if d is None else ("dp",)) + seq_axes
        if d is not None and plan.mesh_shape["tp"] > 1:
            # XLA all-gathers a reduce-scatter's operand over the automatic tp axis first (the whole
            # gradient on every device); an all-reduce keeps it tp-sharded: sum, keep this rank's slice
            g = _psum(g, axes + (ZERO_AXIS,))
            size = g.shape[d] // plan.mesh_shape[ZERO_AXIS]
            return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(ZERO_AXIS) * size, size, axis=d)
        g = _psum(g, axes)
        return g if d is None else jax.lax.psum_scatter(g, ZERO_AXIS, scatter_dimension=d, tiled=True)

    def _psum(x, axes):  # skip size-1 axes: XLA keeps a trivial all-reduce as a copy
        axes = tuple(a for a in axes if plan.mesh_shape[a] > 1)
        return jax.lax.psum(x, axes) if axes else x

    def body(layers, others, xs, ys, coef):
        # layers: leaves [1, v, Lc, ...] (this device's chunks); others: embedding / head leaves.
        # xs, ys: int32 [B/N, t] (this data shard); coef: scale / (B·t).
        local = {"batch": None, "layers": None, **({"seq": None} if seq_ring else {})}  # manual: this device's part
        shard = Sharder(jax.sharding.get_abstract_mesh(), {**plan.rules, **local},
                        plan.cfg.parallel.sequence_parallelism_mode)
        positions = None
        if seq_ring:  # this device's zig-zag block of the sequence, at the tokens' original positions
            shard = shard.zigzagged()
            tl = xs.shape[1]
            order = jnp.asarray(zigzag_order(tl * sp, sp), jnp.int32)
            positions = jax.lax.dynamic_slice_in_dim(order, jax.lax.axis_index(SP_AXIS) * tl, tl)
            positions = jnp.broadcast_to(positions, (xs.shape[0] // m, tl))
        embed, chunk, head_loss, chunk_at = _stage_fns(cfg, shard, shard.is_sharded("vocab"), positions)
        layers = jax.tree.map(lambda a, s: vary(gather(a, s)[0]), layers, lay_param_specs, is_leaf=None)
        others = jax.tree.map(lambda a, s: vary(gather(a, s)), others, oth_param_specs)
        b, t = xs.shape
        xs = xs.reshape(m, b // m, t)
        ys = ys.reshape(m, b // m, t)
        stage = jax.lax.axis_index(PP_AXIS)
        f_rows = jax.lax.dynamic_index_in_dim(fwd_tab, stage, 1, keepdims=False)  # [T, 6]
        d = cfg.model.hidden_size
        act = jnp.zeros((b // m, t, d), plan.compute_dtype)
        act = vary(act)

        zero_loss = lambda: vary(jnp.zeros((), jnp.float32))
        add_f32 = lambda acc, g: jax.tree.map(lambda A, b: A + b.astype(jnp.float32), acc, g)

        def forward_slot(row, recv, layers, others):
            """Embedding (first virtual stage only) then the chunk, skipped in idle slots."""
            valid = row[VALID] == 1
            x = jax.lax.cond(valid & (row[FIRST] == 1), lambda: embed(others, xs[row[MB]]), lambda: recv)
            if not lockstep and v > 1:  # circular GPipe: a per-tick slice of the chunk's weights would be
                # a residual of every tick (see the module doc); slice each layer's inside its body
                return x, jnp.where(valid, chunk_at(layers, row[CHUNK], x), x)
            lp = jax.tree.map(lambda a: _dyn(a, row[CHUNK], v), layers)
            if seq_ring or not lockstep:  # seq_ring: every device runs the ring's ppermutes at every tick
                # (see below); GPipe: a cond's residuals are not loop-invariant, so autodiff of the
                # tick scan would save the stage's weights once per tick (see the module doc)
                return x, jnp.where(valid, chunk(lp, x), x)
            return x, jax.lax.cond(valid, lambda: chunk(lp, x), lambda: x)

        if not lockstep:
            # Differentiate w.r.t. fp32 copies, cast to the compute dtype inside each tick: the
            # cast's transpose makes each tick's weight cotangent fp32, so the scan's transpose
            # sums the microbatches in fp32 (with the compute-dtype weights closed over, it would
            # sum them in that dtype). The ZeRO-3 gather above still moves compute-dtype values.
            cast = lambda tree, dtype: jax.tree.map(lambda a: a.astype(dtype), tree)

            def loss_of(layers32, others32):
                def tick(carry, row):
                    recv, loss = carry
                    layers, others = cast((layers32, others32), plan.compute_dtype)
                    _, y = forward_slot(row, recv, layers, others)
                    l = jnp.where((row[VALID] == 1) & (row[LAST] == 1), head_loss(others, y, ys[row[MB]]), 0.0)
                    y = _after(y, l)  # the head's collectives before the send
                    return (jax.lax.ppermute(y, PP_AXIS, ring_f), loss + l), None

                (_, loss), _ = jax.lax.scan(tick, (act, zero_loss()), f_rows)
                return loss

            loss, vjp = jax.vjp(loss_of, *cast((layers, others), jnp.float32))
            g_layers, g_others = vjp(vary(coef))
        else:
            b_rows = jax.lax.dynamic_index_in_dim(bwd_tab, stage, 1, keepdims=False)
            f32z = lambda a: vary(jnp.zeros(a.shape, jnp.float32))

            def backward_slot(br, xb, recv_b, g_lay, g_oth, loss):
                """Recompute the chunk from its stashed input, pull back the cotangent (from the
                loss in the last virtual stage, else received), accumulate the gradients."""
                lp = jax.tree.map(lambda a: _dyn(a, br[CHUNK], v), layers)
                yb, chunk_vjp = jax.vjp(chunk, lp, xb)

                def with_head(g_oth, loss):
                    l, head_vjp = jax.vjp(lambda o, h: head_loss(o, h, ys[br[MB]]), others, yb)
                    g_head, dy = head_vjp(vary(coef))
                    return dy.astype(yb.dtype), add_f32(g_oth, g_head), loss + l

                dy, g_oth, loss = jax.lax.cond(br[LAST] == 1, with_head,
                                               lambda g_oth, loss: (recv_b, g_oth, loss), g_oth, loss)
                g_lp, dx = chunk_vjp(dy)
                g_lay = jax.tree.map(lambda G, g: _dyn_add(G, br[CHUNK], g.astype(jnp.float32), v), g_lay, g_lp)

                def with_embed(g_oth):
                    _, emb_vjp = jax.vjp(lambda o: embed(o, xs[br[MB]]), others)
                    return add_f32(g_oth, emb_vjp(dx)[0])

                g_oth = jax.lax.cond(br[FIRST] == 1, with_embed, lambda g: g, g_oth)
                return dx, g_lay, g_oth, loss

            def tick(carry, rows):
                recv_f, recv_b, stash, g_lay, g_oth, loss = carry
                fr, br = rows
                # forward slot: microbatch fr[MB] through chunk fr[CHUNK]; stash its input
                x, y = forward_slot(fr, recv_f, layers, others)
                stash = jax.lax.dynamic_update_index_in_dim(stash, x, fr[SLOT], 0)
                # backward slot: microbatch br[MB] back through chunk br[CHUNK]
                xb = jax.lax.dynamic_index_in_dim(stash, br[SLOT], 0, keepdims=False)
                xb = _after(xb, y)  # the backward slot starts after the forward slot
                if seq_ring:  # computed in idle slots too, and dropped (see seq_ring above)
                    out = backward_slot(br, xb, recv_b, g_lay, g_oth, loss)
                    dx, g_lay, g_oth, loss = jax.tree.map(lambda a, b: jnp.where(br[VALID] == 1, a, b), out,
                                                          (recv_b, g_lay, g_oth, loss))
                else:
                    dx, g_lay, g_oth, loss = jax.lax.cond(
                        br[VALID] == 1, backward_slot, lambda br, xb, recv_b, *acc: (recv_b, *acc),
                        br, xb, recv_b, g_lay, g_oth, loss)
                recv_f = jax.lax.ppermute(_after(y, dx), PP_AXIS, ring_f)
                recv_b = jax.lax.ppermute(_after(dx, recv_f), PP_AXIS, ring_b)  # one send at a time
                return (recv_f, recv_b, stash, g_lay, g_oth, loss), None

            init = (act, act, vary(jnp.zeros((S,) + act.shape, act.dtype)),
                    jax.tree.map(f32z, layers), jax.tree.map(f32z, others), zero_loss())
            (_, _, _, g_layers, g_others, loss), _ = jax.lax.scan(tick, init, (f_rows, b_rows))

        # once per step, one group of collectives after the other (see _after)
        loss = _psum(loss, manual_axes)
        g_layers = jax.tree.map(lambda g, s: reduce(_after(g, loss), s, False)[None], g_layers,
                                jax.tree.map(lambda s: P(*tuple(s)[1:]), lay_grad_specs, is_leaf=is_spec))
        done = jax.tree.leaves(g_layers)
        g_others = jax.tree.map(lambda g, s: reduce(_after(g, *done), s, True), g_others, oth_grad_specs)
        return loss, g_layers, g_others

    manual = lambda tree: jax.tree.map(lambda s: _manual(s, manual_axes), tree, is_leaf=is_spec)
    data = tuple(a for a in DATA_AXES if plan.mesh_shape[a] > 1)
    tok_spec = P(data if len(data) > 1 else data[0] if data else None, SP_AXIS if seq_ring else None)
    smap = jax.shard_map(
        body, mesh=mesh, axis_names=set(manual_axes),
        in_specs=(manual(lay_param_specs), manual(oth_param_specs), tok_spec, tok_spec, P()),
        out_specs=(P(), manual(lay_grad_specs), manual(oth_grad_specs)))

    def grad_fn(params, inputs, targets, scale, mask=None, segment_ids=None, positions=None):
        if mask is not None or segment_ids is not None or positions is not None:
            raise NotImplementedError(
                "a loss mask or packed segments (batch['loss_mask'], ['segment_ids']) are not supported with "
                "pipeline_parallel_size > 1 yet; train such batches with parallel.pipeline_parallel_size=1")
        B, t = inputs.shape
        coef = (scale / (B * t)).astype(jnp.float32)
        if seq_ring:  # zig-zag order, so that the causal ring keeps every device busy (sequence.py)
            inputs, targets, *_ = zigzag_batch(inputs, targets, sp=sp)
        layers = jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(
            _to_chunks(a, p, v), NamedSharding(mesh, s)), params["layers"], lay_param_specs)
        others = {k: a for k, a in params.items() if k != "layers"}
        if gather_outside:
            others = {k: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, oth_param_specs[k]))
                      for k, a in others.items()}
        loss_sum, g_layers, g_others = smap(layers, others, inputs, targets, coef)
        g_layers = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(_from_chunks(g), NamedSharding(mesh, s)),
                                g_layers, out_grad_specs["layers"])
        grads = {**g_others, "layers": g_layers}
        grads = jax.tree.map(lambda g: g / scale, grads)
        return loss_sum, grads

    return grad_fn
