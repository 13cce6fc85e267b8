"""``training.objective=grpo``: Group Relative Policy Optimization (Shao et al., 2024) and its variants
(DAPO, Dr. GRPO, BNPO, CISPO, SAPO, LUSPO, VESPO; GSPO's sequence-level ratio), as TRL's
``GRPOTrainer._compute_loss`` computes them, and with ``posttrain.advantage=rloo`` TRL's
``RLOOTrainer._compute_loss`` (trl 1.16; the per-token math in :mod:`jaxcolossal.posttrain.grpo_losses`);
registered in :data:`jaxcolossal.train.objective.OBJECTIVES`.

Rows are prompts with completions sampled from the policy (:mod:`jaxcolossal.posttrain.rollout`,
this objective's on-policy loader), whose loss masks cover the completion tokens; the batch also
carries each row's advantage (group-normalised, or RLOO's leave-one-out), the per-token log-probs of
the policy that sampled it (off-policy, or RLOO's KL in the reward) and of the reference (``beta > 0``),
and the generation's completion tokens per optimizer step (``tokens_per_step``, TRL's
``num_items_in_batch`` over the generation's steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcolossal.config.derived import (GRPO_CLIPPED_LOSSES, GRPO_LOSS_TYPES, grpo_epsilon_high, grpo_off_policy,
                                         posttrain_beta, posttrain_loss_type)
from jaxcolossal.data.prompts import PromptSplit
from jaxcolossal.posttrain.grpo_losses import GrpoTerms, grpo_token_loss, high_entropy_mask, rloo_sequence_loss
from jaxcolossal.posttrain.loss_terms import masked_sum, policy_token_logps, sum_of_row_means, token_count
from jaxcolossal.posttrain.rollout import Rollouts
from jaxcolossal.runtime.dist_logger import get_dist_logger

SHARD_REDUCTIONS = {"clip_ratio/low_min": jnp.min, "clip_ratio/high_max": jnp.max}
"""The metrics whose data shards' values combine by a min or a max (TRL's ``nanmin``/``nanmax`` over
the sequences its processes gather); every other sum adds up."""


RLOO_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                "clip_ratio/region_mean")
"""TRL 1.16 ``RLOOTrainer._compute_loss``'s metrics (its ``kl`` is a rollout metric: the KL is in the reward)."""


def grpo_metric_names(loss_type: str, beta: float) -> tuple[str, ...]:
    """The metrics TRL 1.16's ``GRPOTrainer._compute_loss`` logs for ``loss_type`` (``kl`` with ``beta``)."""
    names = (("kl",) if beta else ()) + ("entropy",)
    if loss_type in GRPO_CLIPPED_LOSSES:
        return names + ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                        "clip_ratio/low_min", "clip_ratio/high_max")
    return names + {"cispo": ("cispo_clip_ratio",), "vespo": ("vespo/phi_seq_mean",)}.get(loss_type, ())


def grpo_loss_sum(token_loss, mask, loss_type: str, microbatch_tokens) -> jax.Array:
    """The numerator of GRPO's loss over the rows a call sees (fp32 scalar; the step divides the sum of
    the numerators by :meth:`Grpo.count`): ``grpo``/``sapo``, the sum over rows of each row's masked
    mean; ``bnpo``, the masked sum over the microbatch's tokens ``microbatch_tokens``; the others
    (``dapo``, ``dr_grpo``, ``cispo``, ``vespo``, ``luspo``), the masked sum. ``token_loss``: ``[b, t]``
    or ``[b, 1]``; ``mask``: ``[b, t]``.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    if loss_type == "rloo":  # one loss per completion, every row counted
        return jnp.sum(token_loss)
    token_loss = jnp.broadcast_to(token_loss, mask.shape)
    if loss_type in ("grpo", "sapo"):
        return sum_of_row_means(token_loss, mask)
    if loss_type == "bnpo":
        return masked_sum(token_loss, mask) / microbatch_tokens
    if loss_type in GRPO_LOSS_TYPES:
        return masked_sum(token_loss, mask)
    raise ValueError(f"posttrain.loss_type={loss_type!r}: expected one of {', '.join(GRPO_LOSS_TYPES)}")


def grpo_metric_sums(names, parts, entropies, mask, terms: GrpoTerms, microbatch_tokens, microbatch_rows,
                     every_row: bool = False) -> dict:
    """Each metric of ``names`` as the call's share of its microbatch's value (TRL's per-microbatch
    ``global_masked_mean``: a token sum over ``microbatch_tokens``, or for a per-sequence quantity a row
    sum over ``microbatch_rows``), the ``*_min``/``*_max`` ones as this call's min or max over its rows
    of each row's masked mean (:data:`SHARD_REDUCTIONS`; rows with no token left out, as TRL's ``nanmin``
    leaves them, unless ``every_row``: RLOO's per-sequence flags count every row). fp32 scalars, no gradient."""
    mask_rows = jnp.sum(mask, axis=-1)

    def mean(x):  # x: [b, t] over the tokens, or [b, 1] one value per sequence
        x = jax.lax.stop_gradient(x.astype(jnp.float32))
        if x.shape[-1] == 1:
            return jnp.sum(x) / microbatch_rows
        return jnp.sum(x * mask) / microbatch_tokens

    def row_means(x):  # each row's masked mean ([b]); rows with no token are left out of the min/max
        x = x.astype(jnp.float32)
        return x[:, 0] if x.shape[-1] == 1 else jnp.sum(x * mask, -1) / jnp.maximum(mask_rows, 1.0)

    coef1, adv = parts["coef1"], parts["adv"]
    low = (coef1 < 1 - terms.epsilon) & (adv < 0)
    high = (coef1 > 1 + terms.epsilon_high) & (adv > 0)
    has = (mask_rows > 0) | every_row
    values = {
        "kl": lambda: mean(parts["kl"]), "entropy": lambda: mean(entropies),
        "clip_ratio/low_mean": lambda: mean(low), "clip_ratio/high_mean": lambda: mean(high),
        "clip_ratio/region_mean": lambda: mean(low | high),
        "clip_ratio/low_min": lambda: jnp.min(jnp.where(has, row_means(low), jnp.inf)),
        "clip_ratio/high_max": lambda: jnp.max(jnp.where(has, row_means(high), -jnp.inf)),
        "cispo_clip_ratio": lambda: mean((coef1 > terms.epsilon_high) & (adv > 0)),
        "vespo/phi_seq_mean": lambda: mean(parts["phi"])}
    return {k: values[k]() for k in names}


class Grpo:
    """The GRPO objective (module docstring) over rows of a left-padded prompt and its completion.

    ``__call__(params, tokens, targets, ..., mask, segment_ids, positions, advantages, old_logps,
    ref_logps, tokens_per_step, microbatch_tokens, shard_axis)``: ``tokens``/``targets`` int32 ``[b, t]``, ``mask [b, t]``
    on the completion tokens, ``advantages [b, t]`` (each row's, repeated), ``old_logps``/``ref_logps``
    fp32 ``[b, t]``, ``microbatch_tokens`` fp32 ``[b, t]`` (the completion tokens of the whole
    microbatch this call's rows belong to, repeated; the step fills it: :attr:`step_fields`; absent,
    the call's own). Returns ``(summed loss, the metrics' sums)``. On-policy (``num_iterations == 1``,
    one step per generation: :func:`~jaxcolossal.config.derived.grpo_off_policy`) the old log-probs are
    the policy's own under ``stop_gradient`` (TRL's shortcut: the ratio is 1, its gradient is not).
    """

    name = "grpo"
    batch_fields: tuple = ("advantages", "old_logps", "ref_logps", "tokens_per_step")
    step_fields: tuple = ("microbatch_tokens",)  # computed by the step from the loss mask
    shard_reductions = SHARD_REDUCTIONS
    wants_shard_axis = True  # top_entropy_quantile's quantile spans the microbatch's data shards
    data_format = "prompts"
    reads = "GRPO samples completions of prompts"
    evaluation = "rollouts"  # the on-policy loader's greedy completions of the held-out prompts, scored
    reference_label = "GRPO's (beta > 0)"

    def __init__(self, family, cfg):
        self.family, self.cfg, self.post = family, cfg, cfg.posttrain
        self.loss_type = posttrain_loss_type(cfg)
        self.beta = posttrain_beta(cfg)
        self.terms = GrpoTerms.from_config(cfg, self.loss_type, grpo_epsilon_high(cfg), self.beta)
        self.off_policy = grpo_off_policy(cfg)
        self.k = cfg.training.gradient_accumulation_steps
        self.microbatch_rows = float(cfg.training.batch_size // self.k)
        self.rloo = cfg.posttrain.advantage == "rloo"
        self.metric_names = RLOO_METRICS if self.rloo else grpo_metric_names(self.loss_type, self.beta)

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None, advantages=None, old_logps=None, ref_logps=None,
                 tokens_per_step=None, microbatch_tokens=None, shard_axis=None, hidden=None):
        # the phases: log-probs and entropies at the temperature, the entropy mask, the per-token loss,
        # its normalised sum, the metrics. hidden: a pipeline's final-norm hidden states of the policy
        # (jaxcolossal.train.pipeline_objective)
        mask = mask.astype(jnp.float32)
        p = self.post
        logps, more = policy_token_logps(self.family, params, tokens, targets, mask, mcfg, shard, vocab_parallel,
                                         segment_ids, positions, dropout_key, p.temperature, extras=("entropy",),
                                         hidden=hidden)
        ent = more["entropy"]
        mb_tokens = jnp.maximum(jnp.sum(mask) if microbatch_tokens is None else microbatch_tokens[0, 0], 1.0)
        entropy_mask = None
        if p.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(ent, mask, p.top_entropy_quantile, shard_axis)
        old = jax.lax.stop_gradient(old_logps if self.off_policy else logps)
        if self.rloo:  # RLOOTrainer: the KL is in the advantages (the rollout's), one clipped loss per completion
            loss, parts = rloo_sequence_loss(self.terms, logps, old, advantages[:, 0], mask)
        else:
            ref = jax.lax.stop_gradient(ref_logps) if self.beta else None
            loss, parts = grpo_token_loss(self.terms, logps, old, ref, advantages[:, 0], mask, entropy_mask)
        stats = grpo_metric_sums(self.metric_names, parts, ent, mask, self.terms, mb_tokens, self.microbatch_rows,
                                 every_row=self.rloo)
        return grpo_loss_sum(loss, mask, "rloo" if self.rloo else self.loss_type, mb_tokens), stats

    def count(self, inputs, mask=None, fields=None):
        """What the summed loss divides by (fp32 scalar): the step's rows (``grpo``, ``sapo``, ``luspo``), its
        microbatches (``bnpo``: each one's numerator is already its mean), rows × ``max_completion_length``
        (``dr_grpo``), or for ``dapo``, ``cispo`` and ``vespo`` TRL's ``num_items_in_batch`` over the
        optimizer steps of a generation: the generation's completion tokens over its steps
        (``fields["tokens_per_step"]``, the loader's), else the step's own completion tokens (the same when
        a generation feeds one step)."""
        rows = jnp.asarray(inputs.shape[0], jnp.float32)
        if self.rloo or self.loss_type in ("grpo", "sapo", "luspo"):
            return rows
        if self.loss_type == "bnpo":
            return jnp.asarray(self.k, jnp.float32)
        if self.loss_type == "dr_grpo":
            return rows * self.post.max_completion_length
        if fields and "tokens_per_step" in fields:
            return jnp.maximum(jnp.asarray(fields["tokens_per_step"], jnp.float32).reshape(-1)[0], 1.0)
        return token_count(inputs, mask)

    def zero_stats(self) -> dict:
        """The metrics' per-microbatch sums at zero (fp32 scalars)."""
        return {k: jnp.zeros((), jnp.float32) for k in self.metric_names}

    def metrics(self, stats: dict, count) -> dict:
        """TRL's metrics (:func:`grpo_metric_names`) as TRL logs them for a step: the mean over its
        microbatches of each microbatch's value."""
        return {k: stats[k] / self.k for k in self.metric_names}

    @staticmethod
    def held_out_parts(val: float) -> tuple[str, str]:
        """``("held-out reward (greedy)", "X")``: ``val`` is minus the held-out mean reward."""
        return "held-out reward (greedy)", f"{-val:.4f}"

    @staticmethod
    def loader(data: PromptSplit, cfg, plan) -> Rollouts:
        """The training loader: the rollout phase that samples, scores and lays out each step's batch
        from the prompts format's split ``data`` (:class:`jaxcolossal.posttrain.rollout.Rollouts`),
        after one line naming its shape (prompts × completions, steps per rollout, rewards).

        Raises:
            ConfigError: as :class:`jaxcolossal.posttrain.rollout.Rollouts` refuses what trains nothing.
        """
        t, po = cfg.training, cfg.posttrain
        get_dist_logger().info(f"GRPO: {t.batch_size // po.num_generations} prompts x {po.num_generations} "
                               f"completions of up to {po.max_completion_length} tokens per rollout, "
                               f"{po.num_iterations} step(s) per rollout; rewards {po.reward_funcs}", ranks=[0])
        return Rollouts(cfg, plan, data.train, data.tokenizer, plan.batch_sharding, held=data.held)
