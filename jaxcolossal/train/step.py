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
     accumulation buffer, which is sharded over ``fsdp`` (1/N per device), as in DeepSpeed ZeRO-2.
     With fp32 communication the microbatch is differentiated whole (no per-shard vmap), so XLA
     reduces each layer's weight gradient inside the backward layer scan as it is produced, and
     the step never holds a whole unreduced gradient; the weight-gradient matmuls output fp32
     (:mod:`jaxcolossal.models.layers.linear`), so that reduction is fp32 in bf16 runs too. XLA's GPU
     backend emits ``reduce-scatter``; its CPU backend the equivalent ``all-reduce`` +
     ``dynamic-slice``. (``communication_dtype`` bf16/fp8 keep the per-shard form: those
     reductions are written by hand, :func:`jaxcolossal.parallel.compression.lowp_reduce`.)

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

5. **Offload** (``offload`` section): leaves whose sharding lives in pinned host memory
   (:mod:`jaxcolossal.memory.placement`) are moved in where they are used, and the optimizer update of
   the offloaded leaves runs on the host or streams through the device one leaf at a time
   (:mod:`jaxcolossal.train.offload`).

The state buffers are donated.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import prefetches_weights, reduces_layerwise, weight_gather_dtype
from jaxcolossal.models.layers.lora import merge
from jaxcolossal.optim.loss_scale import scaler_update
from jaxcolossal.parallel.compression import lowp_reduce, powersgd_reduce, topk_reduce
from jaxcolossal.parallel.layer_scan import fetch_layer
from jaxcolossal.parallel.mesh import DATA_AXES, platform
from jaxcolossal.parallel.pipeline_executor import make_pipeline_grad_fn
from jaxcolossal.parallel.sequence import zigzag_batch
from jaxcolossal.parallel.sharding import constrain
from jaxcolossal.posttrain.loss_terms import token_count
from jaxcolossal.train.nvme import nvme_tier
from jaxcolossal.train.objective import make_objective
from jaxcolossal.train.offload import make_offload_update, streamed_in_scan, to_device
from jaxcolossal.train.pipeline_objective import PipelinedObjectiveGrad
from jaxcolossal.train.state import TrainPlan, TrainState, powersgd_views_of, state_shardings
from jaxcolossal.train.step_fields import SHARD_AXIS, add_step_fields, shard_sum

Metrics = dict


def _with_leading(spec: P, lead) -> P:
    return P(lead, *spec)


def adam_first_moment(opt_state: Any) -> Any:
    """Adam's first moment ``mu`` (param-shaped fp32, the optimizer state's sharding) from an optax
    state holding one ``ScaleByAdamState``: where momentum correction starts from it.

    Raises:
        ValueError: no ``ScaleByAdamState`` in ``opt_state``.
    """
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(x, optax.ScaleByAdamState)]
    if len(found) != 1:
        raise ValueError(f"momentum correction needs one Adam first moment in the optimizer state, found {len(found)}")
    return found[0].mu


def gathers_lowp(plan: TrainPlan) -> bool:
    """Whether ZeRO-3's weight all-gathers move ``parallel.communication_dtype`` (bf16/fp8) rather
    than the compute dtype (ZeRO++'s qwZ, :func:`jaxcolossal.parallel.wire.gather_lowp`): ZeRO-3
    over a data group > 1, and a wire dtype narrower than the compute dtype (bf16 in a bf16 run
    already moves bf16). The stacked layers' weights only: the embedding, head and final norm are
    gathered as stored."""
    return weight_gather_dtype(plan.cfg, plan.data_size) is not None


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
    With ``pp > 1`` this is :func:`jaxcolossal.parallel.pipeline_executor.make_pipeline_grad_fn` (same contract).
    """
    if plan.mesh_shape["pp"] > 1:  # the LM loss in the pipeline's last stage, or an objective's own head after it
        return PipelinedObjectiveGrad(plan) if pipelines_objective(plan) else make_pipeline_grad_fn(plan)
    return _GradFn(plan)


def pipelines_objective(plan: TrainPlan) -> bool:
    """Whether the step runs a post-training objective over a pipeline (:mod:`jaxcolossal.train.pipeline_objective`)."""
    return plan.mesh_shape["pp"] > 1 and plan.cfg.training.objective != "sft"


class _GradFn:
    """:func:`make_grad_fn`'s function, its phases as methods: each microbatch's loss and gradient
    (:meth:`micro`), their accumulation (:meth:`accumulate`), and the data group's reduction
    (:meth:`reduce`, or :meth:`compress` under gradient compression)."""

    def __init__(self, plan: TrainPlan):
        cfg = plan.cfg
        self.plan, self.cfg, self.mesh, self.family = plan, cfg, plan.mesh, plan.family
        self.objective = make_objective(plan.family, cfg)  # sft: the LM loss; dpo: preference pairs
        self.k, self.n, self.zero = cfg.training.gradient_accumulation_steps, plan.data_size, cfg.parallel.zero_stage
        inner = plan.sharder.inner()
        self.ring = inner.ring  # ring attention: the batch goes in zig-zag order (jaxcolossal.parallel.sequence)
        if self.ring > 1:
            inner = inner.zigzagged()
        if gathers_lowp(plan):  # ZeRO++ qwZ: the layer scan gathers the weight shards in bf16/fp8
            inner = inner.with_lowp_gather(cfg.parallel.communication_dtype, plan.layer_param_specs)
        self.inner, self.vocab_parallel = inner, inner.is_sharded("vocab")
        outer = plan.sharder.zigzagged() if self.ring > 1 else plan.sharder
        if prefetches_weights(cfg):  # the layer scan gathers layer i+1's weights before layer i's compute
            outer = outer.with_layer_prefetch(plan.layer_param_specs)
        self.outer = outer
        self.grad_specs = plan.specs.grads
        self.per_shard_specs = jax.tree.map(lambda s: _with_leading(s, DATA_AXES), plan.specs.base,
                                            is_leaf=lambda x: isinstance(x, P))
        p = cfg.parallel
        self.compressing = p.gradient_compression in ("topk", "powersgd")
        self.views = powersgd_views_of(plan) if p.gradient_compression == "powersgd" else None
        # ZeRO-2/3 with fp32 communication: the gradient of the whole microbatch, so that XLA reduces
        # (-scatters) each layer's weight gradient inside the backward layer scan, as it is produced
        self.layerwise = reduces_layerwise(cfg)
        self.per_shard = jax.vmap(jax.value_and_grad(self._loss(inner, SHARD_AXIS), has_aux=True),
                                  in_axes=(None, 0, 0, 0, None, None, None), axis_name=SHARD_AXIS,
                                  spmd_axis_name=DATA_AXES)
        self.global_grad = jax.value_and_grad(self._loss(outer), has_aux=True)

    def _loss(self, sharder, shard_axis=None):
        lora_base = self.cfg.posttrain.reference == "lora_base"
        # an objective whose statistic spans the microbatch's data shards (GRPO's entropy quantile)
        extra = {"shard_axis": shard_axis} if getattr(self.objective, "wants_shard_axis", False) else {}

        def loss(params, x, y, aux, coef, frozen, reference):  # LoRA: the gradient of the adapters only
            args = (merge(frozen, params), x, y, self.cfg.model, sharder, self.vocab_parallel)
            # DPO's reference: the frozen copy, or under LoRA the base without the adapters
            ref = frozen if (lora_base and frozen is not None) else reference
            s, stats = self.objective(*args, reference=ref, **aux, **extra)
            return s * coef, (s, stats)  # stats: a mixture of experts' router statistics, or DPO's sums
        return loss

    def dropout_keys(self, step, j):
        """LoRA's dropout: microbatch ``j``'s key of optimizer step ``step`` (from ``training.seed``),
        split per data shard for the per-shard gradients (``[N]``); ``None`` without dropout."""
        if not (self.cfg.model.lora.enabled and self.cfg.model.lora.dropout > 0) or step is None:
            return None
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.training.seed), step), j)
        return key if self.layerwise else jax.random.split(key, self.n)

    def micro(self, params, xs, ys, aux, coef, j, frozen=None, step=None, reference=None):
        """Microbatch ``j``'s summed loss and fp32 gradient: of the whole microbatch (layer-wise
        reduction), or per data shard (``[N, ...]``, unreduced). ``frozen``: LoRA's base weights;
        ``step``: the optimizer step (LoRA's dropout keys)."""
        keys = self.dropout_keys(step, j)
        if self.layerwise:  # [N, b, t] -> [N·b, t] (a batch field [N, b, ...] likewise): each device keeps its rows
            def rows(a):
                return a[:, j].reshape((-1,) + a.shape[3:])

            aux_j = {k: rows(a) for k, a in aux.items()} | ({} if keys is None else {"dropout_key": keys})
            (_, (loss, stats)), g = self.global_grad(params, rows(xs), rows(ys), aux_j, coef, frozen, reference)
            g = jax.tree.map(lambda a: a.astype(jnp.float32), fetch_layer(g))
            return loss, constrain(g, self.mesh, self.grad_specs), stats
        aux_j = {k: a[:, j] for k, a in aux.items()} | ({} if keys is None else {"dropout_key": keys})
        (_, (loss, stats)), g = self.per_shard(params, xs[:, j], ys[:, j], aux_j, coef, frozen, reference)
        stats = shard_sum(self.objective, stats)
        # offloaded layers' gradients come back from host memory; fp32 before any reduction
        g = jax.tree.map(lambda a: a.astype(jnp.float32), fetch_layer(g))
        return jnp.sum(loss), constrain(g, self.mesh, self.per_shard_specs), stats

    def reduce(self, g, specs=None):
        """``[N, ...]`` per-shard fp32 gradients summed over the data group onto ``specs`` (in
        ``parallel.communication_dtype`` by all-to-all and all-gather when it is not fp32)."""
        specs = self.grad_specs if specs is None else specs
        lowp = self.cfg.parallel.communication_dtype
        if lowp != "fp32":  # all-to-all (+ all-gather) in bf16/fp8, summed in fp32
            return lowp_reduce(g, self.per_shard_specs, specs, lowp, self.mesh)
        return constrain(jax.tree.map(lambda a: jnp.sum(a, axis=0), g), self.mesh, specs)

    def accumulate(self, params, xs, ys, aux, coef, frozen=None, step=None, reference=None):
        """The loss and the gradients summed over the ``k`` microbatches: ZeRO 2/3 into a sharded
        persistent buffer (each microbatch reduced into it), ZeRO 0/1 into the unreduced per-shard one."""
        sharded = self.zero >= 2 or self.layerwise  # (a mixture of experts reduces layer-wise at any stage)

        def body(carry, j):
            loss_acc, acc, stats_acc = carry
            loss, g, stats = self.micro(params, xs, ys, aux, coef, j, frozen, step, reference)
            if sharded and not self.layerwise:
                g = self.reduce(g)
            return (loss_acc + loss, jax.tree.map(jnp.add, acc, g), jax.tree.map(jnp.add, stats_acc, stats)), None

        if sharded:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            zeros = constrain(zeros, self.mesh, self.grad_specs)
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros((self.n,) + p.shape, jnp.float32), params)
            zeros = constrain(zeros, self.mesh, self.per_shard_specs)
        init = (jnp.zeros((), jnp.float32), zeros, self.objective.zero_stats())
        if self.k == 1:
            return body(init, 0)[0]
        return jax.lax.scan(body, init, jnp.arange(self.k))[0]

    def compress(self, acc, residual, step, first_moment):
        """Gradient compression (+ error feedback): top-k or PowerSGD, after the dense warm-up steps."""
        p, mesh, plan = self.cfg.parallel, self.mesh, self.plan

        def compressed(acc, residual):
            if p.momentum_correction:  # the first compressed step: each shard starts from its share
                # of the optimizer's momentum (1/N of it), so that none of the warm-up's is lost; a
                # cond, so that a ZeRO-1 momentum is gathered at that step only
                def share(v):
                    return constrain(jax.tree.map(lambda a, mu: jnp.broadcast_to(mu / self.n, a.shape), v,
                                                  first_moment), mesh, self.per_shard_specs)

                vel = jax.lax.cond(step == p.compression_warmup_steps, share, lambda v: v, residual["velocity"])
                residual = {**residual, "velocity": vel}
            if p.gradient_compression == "topk":  # each shard sends its largest elements
                summed, residual = topk_reduce(acc, residual, p.compression_ratio, mesh,
                                               self.cfg.training.adam_beta1 if p.momentum_correction else None)
            else:  # rank-r factors of each weight matrix
                summed, residual = powersgd_reduce(acc, residual, self.views, mesh)
            return constrain(summed, mesh, plan.specs.base), residual

        def dense(acc, residual):  # the warm-up: a plain all-reduce, the residual untouched
            return constrain(jax.tree.map(lambda a: jnp.sum(a, axis=0), acc), mesh, plan.specs.base), residual

        if p.compression_warmup_steps > 0 and step is not None:
            summed, residual = jax.lax.cond(step < p.compression_warmup_steps, dense, compressed, acc, residual)
        else:
            summed, residual = compressed(acc, residual)
        return constrain(summed, mesh, plan.specs.opt if self.zero == 1 else self.grad_specs), residual

    def __call__(self, params, inputs, targets, scale, mask=None, segment_ids=None, positions=None, residual=None,
                 step=None, first_moment=None, frozen=None, with_stats=False, reference=None, fields=None):
        B = inputs.shape[0]
        n, k = self.n, self.k
        # the gradient of the mean over the whole step (tokens; DPO: pairs), × the loss scale
        coef = scale / self.objective.count(inputs, mask, fields)
        inputs, targets, mask, segment_ids, positions = zigzag_batch(inputs, targets, mask, segment_ids, positions,
                                                                     self.ring)

        def split(a):  # [B, ...] -> [n, k, B/(n·k), ...]: data shard, microbatch, rows (tokens: [B, t])
            return jax.lax.with_sharding_constraint(a.reshape((n, k, B // (n * k)) + a.shape[1:]),
                                                    NamedSharding(self.mesh, P(DATA_AXES)))

        aux = {name: split(a) for name, a in (("mask", None if mask is None else mask.astype(jnp.float32)),
                                              ("segment_ids", segment_ids), ("positions", positions))
               if a is not None} | {name: split(a) for name, a in (fields or {}).items()}
        aux = add_step_fields(self.objective, aux)  # each microbatch's loss tokens, where the objective asks
        loss_sum, acc, stats = self.accumulate(params, split(inputs), split(targets), aux, coef, frozen, step,
                                               reference)
        # ZeRO-1 reduces straight onto the optimizer-state sharding: each rank only needs its
        # slice for the update, so the step moves Ψ (reduce-scatter) + Ψ (param all-gather) = 2Ψ.
        if self.compressing:
            grads, residual = self.compress(acc, residual, step, first_moment)
        elif self.layerwise:  # reduced inside the backward already
            grads = constrain(acc, self.mesh, self.plan.specs.opt if self.zero == 1 else self.grad_specs)
        else:
            grads = acc if self.zero >= 2 else self.reduce(acc, self.plan.specs.opt if self.zero == 1 else None)
        grads = jax.tree.map(lambda g: g / scale, grads)
        if with_stats:
            return loss_sum, grads, residual, stats
        return (loss_sum, grads, residual) if self.compressing else (loss_sum, grads)


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
        ValueError: ``offload.optimizer_device=host``, ``offload.nvme_path`` or
            ``parallel.momentum_correction`` with ``tx_from_config=False``.

    ``batch``: ``{"inputs", "targets"}`` int32 ``[B, t]`` sharded ``P(("dp", "fsdp"), None)``, and
    optionally ``"loss_mask"`` ``[B, t]`` (1 = trained on, 0 = prompt or padding; any dtype): the
    loss is then the mean over the masked-in tokens of the whole global batch; and optionally
    ``"segment_ids"``/``"positions"`` int32 ``[B, t]`` for packed documents (``data.packing_mask``); and
    the objective's ``batch_fields`` (GRPO's ``[B, t]`` advantages and log-probs; DPO's precomputed
    reference log-probs ``ref_logps`` fp32 ``[B, 1]``), each ``[B, ...]`` split into microbatches like the rows.
    With ``offload.nvme_path`` the state is the *runtime* one (:meth:`jaxcolossal.train.nvme.NvmeTier.spill`:
    tokens in place of the NVMe-resident leaves).
    ``metrics``: fp32 scalars ``loss`` (mean nats/token), ``grad_norm`` (before clipping),
    ``lr``; int32 ``nonfinite`` (1: the step was not applied); in fp16 also ``loss_scale``,
    ``skipped`` and ``consecutive_skips``. With ``training.objective=dpo`` (:mod:`jaxcolossal.posttrain.dpo`)
    the rows are interleaved preference pairs with a ``loss_mask`` on the responses, ``loss`` is the mean
    DPO loss per pair, and TRL's ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (means over the step's pairs) are added.
    """
    step = _TrainStep(plan, tx, schedule, tx_from_config)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, Metrics]:
        return step(state, batch)  # a named function: the profiler's trace and the HLO say jit(train_step)
    # one sharding for every leaf of the batch dict (inputs, targets and the optional loss_mask)
    return jax.jit(train_step, in_shardings=(step.runtime, plan.batch_sharding), out_shardings=(step.runtime, None),
                   donate_argnums=(0,))


def _check_tx(plan: TrainPlan, tier: Any, tx_from_config: bool) -> None:
    """The settings that need the config's own optimizer (updated part by part)."""
    pl = plan.placement
    if tx_from_config:
        return
    if plan.cfg.parallel.momentum_correction:
        raise ValueError("parallel.momentum_correction needs the config's optimizer (tx_from_config=True): its "
                         "first moment is replaced by the shards' momentum from the first compressed step")
    if pl is not None and pl.any_optim and pl.optimizer_device == "host":
        raise ValueError("offload.optimizer_device=host needs the config's optimizer (tx_from_config=True)")
    if tier is not None:
        raise ValueError("offload.nvme_path needs the config's optimizer (tx_from_config=True)")


class _TrainStep:
    """:func:`make_train_step`'s step, its phases as methods: the gradients (:meth:`gradients`),
    the update (:meth:`update`), the new state and the metrics (:meth:`__call__`)."""

    def __init__(self, plan: TrainPlan, tx: optax.GradientTransformation, schedule, tx_from_config: bool):
        self.plan, self.tx, self.schedule = plan, tx, schedule
        self.grad_fn = make_grad_fn(plan)
        self.compress = plan.cfg.parallel.gradient_compression != "none"
        self.fp16 = plan.precision == "fp16"
        self.shardings = state_shardings(plan, tx)
        tier = nvme_tier(plan, tx)
        _check_tx(plan, tier, tx_from_config)
        pl = plan.placement
        split_update = pl is not None and pl.any_optim and tx_from_config
        self.offload_update = make_offload_update(plan, self.shardings, tier) if split_update else None
        self.runtime = tier.shardings if tier is not None else self.shardings  # NVMe leaves: tokens in the state
        self.streamed = streamed_in_scan(plan)
        self.objective = make_objective(plan.family, plan.cfg)
        # the objective's statistics (a mixture of experts' router's; DPO's and GRPO's sums), or none
        self.with_stats = bool(self.objective.zero_stats())

    def gradients(self, state: TrainState, batch: dict, scale):
        """``(loss_sum, fp32 grads, residual, router statistics)`` of the step (:func:`make_grad_fn`)."""
        # offloaded compute params: the stacked layers stream in inside the layer scan, the rest come in first
        params = to_device(state.params, self.shardings.params, self.streamed)
        extra = {"residual": state.residual, "step": state.step} if self.compress else {}
        if self.plan.cfg.parallel.momentum_correction:
            extra["first_moment"] = adam_first_moment(state.opt_state)
        if self.plan.lora:  # the adapters are differentiated; the frozen base comes along (and the step: dropout)
            extra.update(frozen=state.frozen, step=state.step)
        pipelined = pipelines_objective(self.plan)
        if self.with_stats and (self.plan.mesh_shape["pp"] == 1 or pipelined):  # the router's or the objective's
            extra["with_stats"] = True  # statistics come back too
        if state.reference is not None:  # DPO's frozen reference copy
            extra["reference"] = to_device(state.reference, self.shardings.reference)
        if self.objective.batch_fields:  # GRPO: advantages, the old and the reference log-probs
            extra["fields"] = {k: batch[k] for k in self.objective.batch_fields}
        out = self.grad_fn(params, batch["inputs"], batch["targets"], scale, batch.get("loss_mask"),
                           batch.get("segment_ids"), batch.get("positions"), **extra)
        return out[0], out[1], (out[2] if self.compress else None), (out[3] if len(out) > 3 else {})

    def _apply(self, master, opt_state, grads):  # the optimizer step proper (a finite step)
        updates, opt_state = self.tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    def _skippable(self, finite, master, opt_state, grads):
        """``(new master, new optimizer state)``, or the old ones on a non-finite step, updated in place
        by each backend's best form. XLA:GPU: a select of new and old in every leaf's update, which
        fuses into one elementwise kernel that writes the donated buffers in place; a cond there
        returns its branch's results in new buffers, a whole copy of the optimizer state at the
        step's peak (70B ZeRO-3 over 16 H200s: 61.5 GiB of temporaries against 25.1). XLA:CPU: a
        cond, whose branch updates in place, where the select keeps the old moments beside the new
        (8 bytes per parameter more)."""
        if platform(self.plan.mesh) == "gpu":
            new_master, new_opt = self._apply(master, opt_state, grads)

            def keep(new, old):
                return jnp.where(finite, new, old)

            return jax.tree.map(keep, new_master, master), jax.tree.map(keep, new_opt, opt_state)
        return jax.lax.cond(finite, self._apply, lambda m, o, g: (m, o), master, opt_state, grads)

    def update(self, state: TrainState, grads, finite):
        """``(new master, new compute params, new optimizer state)``; a non-finite step changes nothing."""
        plan, mesh, specs, sh = self.plan, self.plan.mesh, self.plan.specs, self.shardings
        master = state.master if plan.mixed else state.params
        grads = constrain(grads, mesh, specs.opt)  # ZeRO-1: each rank keeps its slice
        if self.offload_update is not None:  # offloaded leaves: on the host, or streamed through the device
            new_master, new_params, opt_state = self.offload_update(grads, state.opt_state, master, finite, state.step)
        else:  # any offloaded leaves (another optax tx) are moved in whole, and out by out_shardings
            master = constrain(to_device(master, sh.master if plan.mixed else sh.params), mesh, specs.opt)
            new_master, opt_state = self._skippable(finite, master, to_device(state.opt_state, sh.opt_state), grads)
            new_master = constrain(new_master, mesh, specs.opt)
            # cast each rank's shard first, so the ZeRO all-gather moves compute-dtype values
            new_params = constrain(jax.tree.map(lambda x: x.astype(plan.compute_dtype), new_master), mesh, specs.opt)
        return new_master, constrain(new_params, mesh, specs.params), opt_state

    def _scaler(self, state: TrainState, finite):
        if not self.fp16:
            return state.scaler
        pc = self.plan.cfg.precision
        return scaler_update(state.scaler, finite, growth_factor=pc.growth_factor, backoff_factor=pc.backoff_factor,
                             growth_interval=pc.growth_interval, hysteresis=pc.hysteresis, min_scale=pc.min_scale,
                             max_scale=pc.max_scale)

    def __call__(self, state: TrainState, batch: dict):
        scale = state.scaler.scale if self.fp16 else jnp.ones((), jnp.float32)
        loss_sum, grads, residual, stats = self.gradients(state, batch, scale)
        grad_norm = optax.tree.norm(grads)
        # every precision: a step whose loss or gradients hold NaN/inf is not applied (the norm is
        # non-finite exactly when a gradient is, and the clipping computes it anyway)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss_sum)
        new_master, new_params, opt_state = self.update(state, grads, finite)
        scaler = self._scaler(state, finite)
        if residual is not None:  # error feedback: a skipped (non-finite) step keeps the old residual
            residual = jax.tree.map(lambda x, y: jnp.where(finite, x, y), residual, state.residual)
        new = TrainState(step=state.step + 1, params=new_params, master=new_master if self.plan.mixed else None,
                         opt_state=opt_state, scaler=scaler, residual=residual, frozen=state.frozen,
                         reference=state.reference)
        fields = {k: batch[k] for k in self.objective.batch_fields if k in batch}
        n = self.objective.count(batch["inputs"], batch.get("loss_mask"), fields)  # tokens; DPO: pairs
        metrics = {"loss": loss_sum / n, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
        metrics.update(self.objective.metrics(stats, n))  # a mixture of experts'; DPO's, GRPO's (TRL's names)
        if self.schedule is not None:
            metrics["lr"] = self.schedule(state.step)
        if self.fp16:
            metrics.update(loss_scale=state.scaler.scale, skipped=(~finite).astype(jnp.int32),
                           consecutive_skips=scaler.consecutive_skips)
        return new, metrics


def make_eval_step(plan: TrainPlan) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """Jitted ``eval_step(params, inputs, targets, mask=None, segment_ids=None, positions=None) -> mean
    loss`` (fp32 nats/token; over the masked-in tokens when a loss ``mask [B, t]`` is given)."""
    sharder = plan.sharder
    ring = sharder.ring
    if ring > 1:
        sharder = sharder.zigzagged()
    vp = sharder.is_sharded("vocab")
    cfg, family = plan.cfg.model, plan.family
    streamed = streamed_in_scan(plan, whole_model=True)

    def ev(params, x, y, mask=None, segment_ids=None, positions=None):
        # offloaded params: the stacked layers stream in inside the layer scan, the rest come in now
        params = jax.tree.map(lambda p, s: p if s else fetch_layer(p), params, streamed)
        x, y, mask, segment_ids, positions = zigzag_batch(x, y, mask, segment_ids, positions, ring)
        x = sharder(x, ("batch", "seq"))
        m = None if mask is None else mask.astype(jnp.float32)
        return family.loss_sum(params, x, y, cfg, sharder, vp, m, segment_ids, positions) / token_count(x, mask)

    return jax.jit(ev)


def make_objective_eval_step(plan: TrainPlan) -> Callable:
    """Jitted ``eval(params, reference, inputs, targets, mask, *fields) -> (mean loss, {metric: mean})``:
    the objective's own loss and metrics over a held-out batch (an objective whose ``evaluation`` is
    ``objective``; DPO's interleaved preference rows, ``[2P, t]`` int32, ``mask`` float32, sharded
    over the data group, and TRL's metrics: :class:`jaxcolossal.posttrain.dpo.Dpo`; a reward model's
    with its ``margin`` field ``[2P, t]``: :class:`jaxcolossal.posttrain.reward.Reward`). ``params``: the
    model's whole params dict; ``reference``: the frozen copy, or under LoRA the base;
    with ``posttrain.precompute_ref_log_probs`` None, and DPO's field ``ref_logps`` fp32 ``[2P, 1]`` the rows'
    precomputed reference log-probs (:mod:`jaxcolossal.train.ref_logps`)."""
    cfg, sharder = plan.cfg, plan.sharder
    objective = make_objective(plan.family, cfg)
    vp = sharder.is_sharded("vocab")

    def ev(params, reference, x, y, mask, *fields):  # fields: the objective's batch_fields, in order
        x = sharder(x, ("batch", "seq"))
        named = dict(zip(objective.batch_fields, fields))
        s, stats = objective(params, x, y, cfg.model, sharder, vp, mask.astype(jnp.float32), reference=reference,
                             **named)
        n = objective.count(x)
        return s / n, objective.metrics(stats, n)

    return jax.jit(ev)


def make_logits_fn(plan: TrainPlan) -> Callable[[Any, jax.Array], jax.Array]:
    """Jitted ``logits(params, tokens [b, t]) -> fp32 [b, t, vocab_size]`` (padding removed)."""
    cfg, family = plan.cfg.model, plan.family
    sharder = plan.sharder

    def fn(params, tokens):
        params = fetch_layer(params)  # offloaded params come into device memory
        return family.forward(params, tokens, cfg, sharder, sharder.is_sharded("vocab"))[..., : cfg.vocab_size]

    return jax.jit(fn)
