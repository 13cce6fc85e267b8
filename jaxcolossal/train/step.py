"""The one jitted train step (and the eval step).

``train_step(state, batch) -> (state, metrics)`` does, in one XLA program:

1. **Gradient accumulation** over ``k = gradient_accumulation_steps`` microbatches with
   ``lax.scan``. The global batch ``[B, t]`` (sharded over the data group, ``N = dp·fsdp``) is
   viewed as ``[N, k, B/(N·k), t]`` — a free reshape, each device keeps its rows — and each
   microbatch is differentiated per data shard with ``vmap(..., spmd_axis_name=("dp", "fsdp"))``,
   which keeps each shard's gradient *unreduced* on its device.

   * ZeRO 0/1: the fp32 per-shard gradients are summed locally across microbatches and reduced
     across the data group **once per step** (one all-reduce per leaf, outside the loop).
   * ZeRO 2/3: each microbatch's gradient is reduced straight into the persistent fp32
     accumulation buffer, which is sharded over ``fsdp`` (1/N per device): a reduce-scatter per
     microbatch, as in DeepSpeed ZeRO-2. XLA's GPU backend emits ``reduce-scatter``; its CPU
     backend emits the equivalent ``all-reduce`` + ``dynamic-slice``.

2. **Mixed precision**: the forward/backward uses the compute-dtype params; gradients are cast
   to fp32 per shard *before* any reduction (fp32 reduction), and the update is applied to the
   fp32 master copy. fp16 adds dynamic loss scaling.
   **Non-finite steps** (every precision): a NaN/inf in the loss or any gradient skips the step
   everywhere, leaving params, master and optimizer state unchanged, and sets the metric
   ``nonfinite``; the loop's guard (``jaxcolossal.train.guard``) decides whether to stop.
3. **Clipping and AdamW** (optax): the global norm is taken over the global gradient arrays,
   so each parameter counts once whatever its sharding.
4. **ZeRO update**: the update runs on the optimizer-state sharding (each rank its shard),
   the new master shard is cast to the compute dtype, and only then re-sharded to the params'
   spec — for ZeRO 1/2 the all-gather moves compute-dtype (2-byte) values, not fp32.

The state buffers are donated.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcolossal.optim.loss_scale import scaler_update
from jaxcolossal.placement import DEVICE, HOST
from jaxcolossal.sharding import DATA_AXES, constrain
from jaxcolossal.train.state import TrainPlan, TrainState, state_shardings

Metrics = dict


def _with_leading(spec: P, lead) -> P:
    return P(lead, *spec)


def token_count(inputs: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The tokens a step's mean loss divides by (fp32 scalar): ``B·t``, or with a loss mask the
    masked-in tokens of the whole global batch (at least 1, so an all-masked step is a zero update)."""
    if mask is None:
        return jnp.asarray(inputs.shape[0] * inputs.shape[1], jnp.float32)
    return jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)


def make_grad_fn(plan: TrainPlan) -> Callable:
    """``grad_fn(params, inputs, targets, scale, mask=None, segment_ids=None, positions=None) ->
    (loss_sum, fp32 grads)`` over one step.

    ``inputs``/``targets``: int32 ``[B, t]`` global arrays sharded over the data group.
    ``scale``: the fp16 loss scale (1.0 otherwise); returned gradients are unscaled and
    normalised by the number of tokens in the step, so they are the gradient of the mean loss.
    ``mask``: optional ``[B, t]`` loss mask (1 = trained on); then only masked-in tokens count and
    the gradient is that of the mean over the masked-in tokens of the *whole* step (all data
    shards and microbatches), not a mean of per-shard or per-microbatch means (:func:`token_count`).
    ``segment_ids``/``positions``: optional int ``[B, t]`` of packed rows (``data.packing_mask``).
    The returned gradients carry the ZeRO gradient sharding (``plan.specs.grads``; for ZeRO-1 the
    optimizer-state sharding, since the one reduction per step goes straight to each rank's slice).
    With ``pp > 1`` this is :func:`jaxcolossal.pipeline.make_pipeline_grad_fn` (same contract).
    """
    if plan.mesh_shape["pp"] > 1:
        from jaxcolossal.pipeline import make_pipeline_grad_fn
        return make_pipeline_grad_fn(plan)
    cfg, mesh, family = plan.cfg, plan.mesh, plan.family
    k = cfg.training.gradient_accumulation_steps
    n = plan.data_size
    zero = cfg.parallel.zero_stage
    inner = plan.sharder.inner()
    vocab_parallel = inner.is_sharded("vocab")
    grad_specs = plan.specs.grads
    per_shard_specs = jax.tree.map(lambda s: _with_leading(s, DATA_AXES), plan.specs.base,
                                   is_leaf=lambda x: isinstance(x, P))

    def shard_loss(params, x, y, aux, coef):
        s = family.loss_sum(params, x, y, cfg.model, inner, vocab_parallel, **aux)
        return s * coef, s

    per_shard = jax.vmap(jax.value_and_grad(shard_loss, has_aux=True), in_axes=(None, 0, 0, 0, None),
                         spmd_axis_name=DATA_AXES)

    def grad_fn(params, inputs, targets, scale, mask=None, segment_ids=None, positions=None):
        B, t = inputs.shape
        coef = scale / token_count(inputs, mask)  # gradient of the mean over the whole step, × loss scale
        split = lambda a: jax.lax.with_sharding_constraint(a.reshape(n, k, B // (n * k), t),
                                                           NamedSharding(mesh, P(DATA_AXES)))
        xs, ys = split(inputs), split(targets)
        aux = {name: split(a) for name, a in (("mask", None if mask is None else mask.astype(jnp.float32)),
                                              ("segment_ids", segment_ids), ("positions", positions))
               if a is not None}

        def micro(j):
            (_, loss), g = per_shard(params, xs[:, j], ys[:, j], {name: a[:, j] for name, a in aux.items()}, coef)
            g = jax.tree.map(lambda a: a.astype(jnp.float32), g)  # fp32 before any reduction
            return jnp.sum(loss), constrain(g, mesh, per_shard_specs)

        def reduce(g, specs=grad_specs):  # [N, ...] per-shard fp32 -> summed over the data group
            return constrain(jax.tree.map(lambda a: jnp.sum(a, axis=0), g), mesh, specs)

        if zero >= 2:  # sharded persistent buffer: reduce(-scatter) each microbatch into it
            def body(carry, j):
                loss_acc, acc = carry
                loss, g = micro(j)
                return (loss_acc + loss, jax.tree.map(jnp.add, acc, reduce(g))), None
            zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), mesh, grad_specs)
        else:  # unreduced per-shard buffer: one reduction per step
            def body(carry, j):
                loss_acc, acc = carry
                loss, g = micro(j)
                return (loss_acc + loss, jax.tree.map(jnp.add, acc, g)), None
            zeros = constrain(jax.tree.map(lambda p: jnp.zeros((n,) + p.shape, jnp.float32), params),
                              mesh, per_shard_specs)

        if k == 1:
            (loss_sum, acc), _ = body((jnp.zeros((), jnp.float32), zeros), 0)
        else:
            (loss_sum, acc), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), jnp.arange(k))
        # ZeRO-1 reduces straight onto the optimizer-state sharding: each rank only needs its
        # slice for the update, so the step moves Ψ (reduce-scatter) + Ψ (param all-gather) = 2Ψ.
        grads = acc if zero >= 2 else reduce(acc, plan.specs.opt if zero == 1 else grad_specs)
        grads = jax.tree.map(lambda g: g / scale, grads)
        return loss_sum, grads

    return grad_fn


def to_device(tree: Any, shardings: Any) -> Any:
    """Inside the step: move each leaf whose target sharding is in pinned host memory into device
    memory (same spec); device-resident leaves pass through. ``tree`` may be ``None``."""
    if tree is None:
        return None
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(DEVICE)) if s.memory_kind == HOST else x,
                        tree, shardings, is_leaf=lambda x: x is None)


def _split(tree: Any, where: Any) -> Any:
    """``tree`` (param-shaped) with the leaves where ``where`` is False replaced by ``None``."""
    return jax.tree.map(lambda w, x: x if w else None, where, tree)


def _first_present(*trees: Any) -> Any:
    """One tree from several of the same structure in which each leaf is present (not ``None``) in
    at least one; the first present value wins (optimizer states split by placement share their
    step count, so the first part's is taken)."""
    none = lambda x: x is None  # noqa: E731
    flat, treedef = jax.tree.flatten(trees[0], is_leaf=none)
    rest = [jax.tree.leaves(t, is_leaf=none) for t in trees[1:]]
    return jax.tree.unflatten(treedef, [next((x for x in (a, *others) if x is not None), None)
                                        for a, *others in zip(flat, *rest)])


def make_offload_update(plan: TrainPlan, shardings: TrainState) -> Callable:
    """``update(grads, opt_state, master, finite) -> (new_master, new_params, opt_state)`` for a state
    with offloaded optimizer leaves (``plan.placement.optim``), from the config's optimizer parts
    (:func:`jaxcolossal.train.optimizer.optimizer_parts`).

    The global-norm clipping runs first, on the device, over all gradients; the leaves in device
    memory are updated as usual. Then, by ``offload.optimizer_device``:

    * ``host``: the offloaded leaves' fp32 gradients move down (4 B/param), AdamW updates master and
      moments in place in host memory (``compute_on("device_host")``, Colossal-AI's CPU Adam in
      HybridAdam), and the new compute-dtype params move up (p B/param).
    * ``device``: the offloaded leaves are **streamed one at a time**: leaf i's master and moments
      move in, are updated by the (fused) AdamW, and move out; an ``optimization_barrier`` makes leaf
      i+1's move-in wait for leaf i's results, so that device memory holds about one leaf's optimizer
      state at a time, never the whole offloaded state (ZeRO-Offload's streamed update; the
      largest leaf's K bytes/param is what :func:`jaxcolossal.placement.device_need` reserves).

    A non-finite step keeps the old values on both sides. Raises nothing beyond the optimizer's own
    errors.
    """
    from jax.experimental.compute_on import compute_on
    from jaxcolossal.train.optimizer import optimizer_parts

    t, mesh, specs = plan.cfg.training, plan.mesh, plan.specs
    off = plan.placement.optim
    on_dev = jax.tree.map(lambda w: not w, off)
    parts = optimizer_parts(t, plan, param_specs=_split(specs.opt, on_dev))
    adam_dev = parts[-1]
    clip = parts[0] if len(parts) == 2 else None
    master_sh = shardings.master if plan.mixed else shardings.params
    host_sh = lambda tree: jax.tree.map(lambda s: s.with_memory_kind(HOST), tree)  # noqa: E731
    dev_sh = lambda tree: jax.tree.map(lambda s: s.with_memory_kind(DEVICE), tree)  # noqa: E731
    dtype = plan.compute_dtype
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)  # noqa: E731
    repl_host = NamedSharding(mesh, P()).with_memory_kind(HOST)

    def keep_if(finite):
        return lambda new, old: jax.tree.map(lambda x, y: jnp.where(finite, x, y), new, old)

    def adam_step(adam, g, s, p, finite):
        upd, s_new = adam.update(g, s, p)
        keep = keep_if(finite)
        p_new = keep(optax.apply_updates(p, upd), p)
        return p_new, keep(s_new, s)

    if plan.placement.optimizer_device == "host":
        adam_host = optimizer_parts(t, None, on_host=True)[-1]

        def host_fn(g, s, p, finite):
            p_new, s_new = adam_step(adam_host, g, s, p, finite)
            return p_new, cast(p_new), s_new

        on_host = compute_on("device_host")(jax.jit(host_fn))

        def offloaded(grads, adam_state, master, finite):  # -> (new master part, new compute part, state part)
            g_h = jax.device_put(_split(grads, off), host_sh(_split(master_sh, off)))
            s_h = optax.tree_map_params(adam_host, lambda x, w: x if w else None, adam_state, off,
                                        transform_non_params=lambda x: jax.device_put(x, repl_host))
            p_h = jax.device_put(_split(master, off), host_sh(_split(master_sh, off)))  # fp32: params on the device
            p_new, c_new, s_new = on_host(g_h, s_h, p_h, jax.device_put(finite, repl_host))
            return p_new, jax.device_put(c_new, dev_sh(_split(master_sh, off))), s_new
    else:
        flat_off, treedef = jax.tree.flatten(off)
        groups = [jax.tree.unflatten(treedef, [j == i for j in range(len(flat_off))])
                  for i, w in enumerate(flat_off) if w]
        adams = [optimizer_parts(t, plan, param_specs=_split(specs.opt, sel))[-1] for sel in groups]
        none = lambda x: x is None  # noqa: E731

        def move(tree, shardings, kind):  # leaves with a sharding go to memory ``kind``; None passes
            return jax.tree.map(lambda x, s: x if s is None or x is None else
                                jax.device_put(x, s.with_memory_kind(kind)), tree, shardings, is_leaf=none)

        def offloaded(grads, adam_state, master, finite):
            new_p, new_c, new_s, prev = [], [], [], None
            for sel, adam in zip(groups, adams):
                p_in = _split(master, sel)
                s_in = optax.tree_map_params(adam, lambda x, w: x if w else None, adam_state, sel,
                                             transform_non_params=lambda _: None)  # this leaf's m, v
                s_sh = optax.tree_map_params(adam, lambda x, w, sh: sh if w else None, adam_state, sel, master_sh,
                                             transform_non_params=lambda _: None)
                if prev is not None:  # leaf i+1 comes in only once leaf i's results exist
                    (p_in, s_in), _ = jax.lax.optimization_barrier(((p_in, s_in), prev))
                # the step count (shared, on the device) rejoins after the barrier
                s_in = _first_present(s_in, optax.tree_map_params(adam, lambda x: None, adam_state))
                p_sh = _split(master_sh, sel)
                p_new, s_new = adam_step(adam, _split(grads, sel), move(s_in, s_sh, DEVICE),
                                         move(p_in, p_sh, DEVICE), finite)
                new_c.append(cast(p_new))
                new_p.append(move(p_new, p_sh, HOST))
                new_s.append(move(s_new, s_sh, HOST))
                prev = (new_p[-1], new_s[-1])
            return _first_present(*new_p), _first_present(*new_c), _first_present(*new_s)

    def update(grads, opt_state, master, finite):
        if clip is not None:
            grads, _ = clip.update(grads, opt_state[0])
        adam_state = opt_state[-1]
        # the leaves that stay in device memory
        s_d = optax.tree_map_params(adam_dev, lambda x, w: x if w else None, adam_state, on_dev)
        p_d_new, s_d_new = adam_step(adam_dev, _split(grads, on_dev), s_d, _split(master, on_dev), finite)
        c_d_new = constrain(cast(p_d_new), mesh, _split(specs.opt, on_dev))
        p_o_new, c_o_new, s_o_new = offloaded(grads, adam_state, master, finite)
        new_master = jax.tree.map(lambda w, a, b: b if w else a, off, p_d_new, p_o_new)
        new_params = jax.tree.map(lambda w, a, b: b if w else a, off, c_d_new, c_o_new)
        new_state = _first_present(s_d_new, s_o_new)
        new_state = (opt_state[0], new_state) if clip is not None else (new_state,)
        return new_master, new_params, new_state

    return update


def make_train_step(plan: TrainPlan, tx: optax.GradientTransformation,
                    schedule: optax.Schedule | None = None,
                    tx_from_config: bool = True) -> Callable[[TrainState, dict], tuple[TrainState, Metrics]]:
    """Build the jitted ``train_step(state, batch) -> (state, metrics)``.

    Args:
        plan: from :func:`jaxcolossal.train.state.make_plan`.
        tx: the optax optimizer (``build_optimizer``).
        schedule: the learning-rate schedule, only to report ``lr`` in the metrics.
        tx_from_config: ``tx`` is ``build_optimizer(plan.cfg.training, plan)``, so that offloaded
            optimizer leaves can be updated part by part (:func:`make_offload_update`); ``False``
            (another optax transformation, as the Booster's) moves them into device memory whole.

    Raises:
        ValueError: ``offload.optimizer_device=host`` with ``tx_from_config=False``.

    ``batch``: ``{"inputs", "targets"}`` int32 ``[B, t]`` sharded ``P(("dp", "fsdp"), None)``, and
    optionally ``"loss_mask"`` ``[B, t]`` (1 = trained on, 0 = prompt or padding; any dtype): the
    loss is then the mean over the masked-in tokens of the whole global batch; and optionally
    ``"segment_ids"``/``"positions"`` int32 ``[B, t]`` for packed documents (``data.packing_mask``).
    ``metrics``: fp32 scalars ``loss`` (mean nats/token), ``grad_norm`` (before clipping),
    ``lr``; int32 ``nonfinite`` (1: the step was not applied); in fp16 also ``loss_scale``,
    ``skipped`` and ``consecutive_skips``.
    """
    grad_fn = make_grad_fn(plan)
    mesh, specs, pc = plan.mesh, plan.specs, plan.cfg.precision
    fp16 = plan.precision == "fp16"
    shardings = state_shardings(plan, tx)
    pl = plan.placement
    if pl is not None and pl.any_optim and pl.optimizer_device == "host" and not tx_from_config:
        raise ValueError("offload.optimizer_device=host needs the config's optimizer (tx_from_config=True)")
    split_update = pl is not None and pl.any_optim and tx_from_config
    offload_update = make_offload_update(plan, shardings) if split_update else None

    def step(state: TrainState, batch: dict):
        scale = state.scaler.scale if fp16 else jnp.ones((), jnp.float32)
        mask = batch.get("loss_mask")
        params = to_device(state.params, shardings.params)  # offloaded compute params come in first
        loss_sum, grads = grad_fn(params, batch["inputs"], batch["targets"], scale, mask,
                                  batch.get("segment_ids"), batch.get("positions"))
        n_tok = token_count(batch["inputs"], mask)
        grad_norm = optax.tree.norm(grads)

        # every precision: a step whose loss or gradients hold NaN/inf is not applied (the norm is
        # non-finite exactly when a gradient is, and the clipping computes it anyway)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss_sum)
        keep = lambda new, old: jax.tree.map(lambda x, y: jnp.where(finite, x, y), new, old)

        master = state.master if plan.mixed else state.params
        master_sh = shardings.master if plan.mixed else shardings.params
        grads = constrain(grads, mesh, specs.opt)  # ZeRO-1: each rank keeps its slice
        if split_update:  # offloaded leaves: updated on the host, or streamed through the device one by one
            new_master, new_params, opt_state = offload_update(grads, state.opt_state, master, finite)
        else:  # any offloaded leaves (another optax tx) are moved in whole, and out by out_shardings
            master = constrain(to_device(master, master_sh), mesh, specs.opt)
            updates, opt_state = tx.update(grads, to_device(state.opt_state, shardings.opt_state), master)
            new_master = constrain(keep(optax.apply_updates(master, updates), master), mesh, specs.opt)
            opt_state = keep(opt_state, to_device(state.opt_state, shardings.opt_state))
            # cast each rank's shard first, so the ZeRO all-gather moves compute-dtype values
            new_params = constrain(jax.tree.map(lambda x: x.astype(plan.compute_dtype), new_master), mesh, specs.opt)
        new_params = constrain(new_params, mesh, specs.params)
        scaler = state.scaler
        if fp16:
            scaler = scaler_update(state.scaler, finite, growth_factor=pc.growth_factor,
                                   backoff_factor=pc.backoff_factor, growth_interval=pc.growth_interval,
                                   hysteresis=pc.hysteresis, min_scale=pc.min_scale, max_scale=pc.max_scale)
        new = TrainState(step=state.step + 1, params=new_params, master=new_master if plan.mixed else None,
                         opt_state=opt_state, scaler=scaler)
        metrics = {"loss": loss_sum / n_tok, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        if fp16:
            metrics.update(loss_scale=state.scaler.scale, skipped=(~finite).astype(jnp.int32),
                           consecutive_skips=scaler.consecutive_skips)
        return new, metrics

    # one sharding for every leaf of the batch dict (inputs, targets and the optional loss_mask)
    return jax.jit(step, in_shardings=(shardings, plan.batch_sharding), out_shardings=(shardings, None),
                   donate_argnums=(0,))


def make_eval_step(plan: TrainPlan) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """Jitted ``eval_step(params, inputs, targets, mask=None, segment_ids=None, positions=None) -> mean
    loss`` (fp32 nats/token; over the masked-in tokens when a loss ``mask [B, t]`` is given)."""
    sharder = plan.sharder
    vp = sharder.is_sharded("vocab")
    cfg, family = plan.cfg.model, plan.family

    def ev(params, x, y, mask=None, segment_ids=None, positions=None):
        x = sharder(x, ("batch", "seq"))
        m = None if mask is None else mask.astype(jnp.float32)
        return family.loss_sum(params, x, y, cfg, sharder, vp, m, segment_ids, positions) / token_count(x, mask)

    return jax.jit(ev)


def make_logits_fn(plan: TrainPlan) -> Callable[[Any, jax.Array], jax.Array]:
    """Jitted ``logits(params, tokens [b, t]) -> fp32 [b, t, vocab_size]`` (padding removed)."""
    cfg, family = plan.cfg.model, plan.family
    sharder = plan.sharder

    def fn(params, tokens):
        return family.forward(params, tokens, cfg, sharder, sharder.is_sharded("vocab"))[..., : cfg.vocab_size]

    return jax.jit(fn)
