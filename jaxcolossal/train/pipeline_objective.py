"""A post-training objective's gradient over a pipeline (``parallel.pipeline_parallel_size > 1`` with
``training.objective`` ``dpo``): the pipeline runs the decoder layers, the objective its own head.

The pipeline's GPipe forward ticks (:func:`jaxcolossal.parallel.pipeline_executor.make_pipeline_hidden`)
give the last layer's output of every row; the family's final norm (``family.final_norm``) makes the
hidden states the objective's head reads (``hidden=``: :func:`jaxcolossal.posttrain.loss_terms.policy_token_logps`
skips the forward), and the objective runs on each data shard's microbatches exactly as in the plain step
(:mod:`jaxcolossal.train.step`): the same split ``[n, k, b, ...]``, the same step fields, the same
per-shard ``vmap`` and statistics. DPO's frozen reference runs through the same pipeline, without
gradient (``ref_hidden=``); precomputed reference log-probs come with the batch. The gradient is JAX's
autodiff of the whole: GPipe's backward through the ticks, the head's outside, reduced onto the ZeRO
gradient sharding.

The objective's microbatches are the pipeline's (``m``, :func:`jaxcolossal.config.derived.pipeline_microbatches`),
so a config whose ``training.gradient_accumulation_steps`` differs is refused (the objective's
per-microbatch terms count them).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config.derived import pipeline_microbatches
from jaxcolossal.parallel.mesh import DATA_AXES
from jaxcolossal.parallel.pipeline_executor import make_pipeline_hidden
from jaxcolossal.parallel.sharding import constrain
from jaxcolossal.train.objective import make_objective
from jaxcolossal.train.step_fields import SHARD_AXIS, add_step_fields, shard_sum


class PipelinedObjectiveGrad:
    """``grad_fn(params, inputs, targets, scale, mask, ..., with_stats, reference, fields) -> (loss_sum,
    grads[, None, stats])``: :func:`jaxcolossal.train.step.make_grad_fn`'s contract for an objective
    over a pipeline (module docstring). ``grads``: fp32, of the objective's mean loss, unscaled, on the
    ZeRO gradient sharding (``plan.specs.opt`` for ZeRO-1)."""

    def __init__(self, plan):
        cfg = plan.cfg
        self.plan, self.cfg, self.mesh, self.family = plan, cfg, plan.mesh, plan.family
        self.objective = make_objective(plan.family, cfg)
        self.hidden = make_pipeline_hidden(plan)
        self.n, self.k = plan.data_size, pipeline_microbatches(cfg, plan.mesh_shape["pp"])
        inner = plan.sharder.inner()
        self.inner, self.vocab_parallel = inner, inner.is_sharded("vocab")
        self.grad_specs = plan.specs.opt if cfg.parallel.zero_stage == 1 else plan.specs.grads
        self.per_shard = jax.vmap(self._loss, in_axes=(None, 0, 0, 0, None), axis_name=SHARD_AXIS,
                                  spmd_axis_name=DATA_AXES)

    def _loss(self, params, x, y, aux, reference):
        """One data shard's microbatch: the objective's summed loss and statistics."""
        extra = {"shard_axis": SHARD_AXIS} if getattr(self.objective, "wants_shard_axis", False) else {}
        return self.objective(params, x, y, self.cfg.model, self.inner, self.vocab_parallel, reference=reference,
                              **aux, **extra)

    def final_hidden(self, params, inputs, segment_ids=None, positions=None) -> jax.Array:
        """The final-norm hidden states ``[B, t, d]`` of ``params`` (the policy or a reference copy)."""
        return self.family.final_norm(params, self.hidden(params, inputs, None, segment_ids, positions),
                                      self.cfg.model)

    def split(self, a: jax.Array) -> jax.Array:
        """``[B, ...] -> [n, k, B/(n·k), ...]``: data shard, microbatch, rows (the plain step's split)."""
        B = a.shape[0]
        return jax.lax.with_sharding_constraint(a.reshape((self.n, self.k, B // (self.n * self.k)) + a.shape[1:]),
                                                NamedSharding(self.mesh, P(DATA_AXES)))

    def total(self, inputs, targets, aux: dict, coef, reference, rows: dict) -> Callable:
        """``params -> (loss × coef, (summed loss, statistics))`` over the step's microbatches; ``rows``: the
        batch's ``segment_ids``/``positions`` (``[B, t]``), or empty."""
        xs, ys = self.split(inputs), self.split(targets)

        def f(params):
            aux_all = aux | {"hidden": self.split(self.final_hidden(params, inputs, **rows))}
            loss, stats = jnp.zeros((), jnp.float32), self.objective.zero_stats()
            for j in range(self.k):
                s, st = self.per_shard(params, xs[:, j], ys[:, j], {k: a[:, j] for k, a in aux_all.items()},
                                       reference)
                loss = loss + jnp.sum(s)
                stats = jax.tree.map(jnp.add, stats, shard_sum(self.objective, st))
            return loss * coef, (loss, stats)
        return f

    def __call__(self, params, inputs, targets, scale, mask=None, segment_ids=None, positions=None, frozen=None,
                 step=None, with_stats=False, reference=None, fields=None):
        coef = scale / self.objective.count(inputs, mask, fields)
        rows = {} if segment_ids is None else {"segment_ids": segment_ids, "positions": positions}
        aux = {"mask": self.split(mask.astype(jnp.float32))} | {k: self.split(a) for k, a in rows.items()}
        aux = add_step_fields(self.objective, aux | {k: self.split(a) for k, a in (fields or {}).items()})
        if reference is not None and getattr(self.objective, "reference_in_step", False):  # DPO's frozen
            # reference: its own pass through the pipeline, no gradient (GRPO's log-probs are the rollout's)
            aux["ref_hidden"] = self.split(jax.lax.stop_gradient(self.final_hidden(reference, inputs, **rows)))
        (_, (loss_sum, stats)), grads = jax.value_and_grad(self.total(inputs, targets, aux, coef, reference, rows),
                                                           has_aux=True)(params)
        grads = constrain(jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads), self.mesh, self.grad_specs)
        if with_stats:
            return loss_sum, grads, None, stats
        return loss_sum, grads
