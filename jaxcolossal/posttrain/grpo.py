"""``training.objective=grpo``: Group Relative Policy Optimization (Shao et al., 2024) and its variants
(DAPO, Dr. GRPO), as TRL's ``GRPOTrainer._compute_loss`` computes them (trl 1.16); registered in
:data:`jaxcolossal.train.objective.OBJECTIVES`.

Rows are prompts with completions sampled from the policy (:mod:`jaxcolossal.posttrain.rollout`,
this objective's on-policy loader), whose loss masks cover the completion tokens; the batch also
carries each row's group-normalised advantage and the per-token log-probs of the policy that
sampled it (``num_iterations > 1``) and of the reference (``beta > 0``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcolossal.config.derived import grpo_epsilon_high, grpo_off_policy, posttrain_loss_type
from jaxcolossal.data.prompts import PromptSplit
from jaxcolossal.posttrain.loss_terms import k3_kl, masked_sum, policy_token_logps, sum_of_row_means, token_count
from jaxcolossal.posttrain.rollout import Rollouts
from jaxcolossal.runtime.dist_logger import get_dist_logger

GRPO_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""TRL's ``GRPOTrainer`` loss metrics, each a mean over the step's completion tokens (trl 1.16)."""


def grpo_token_loss(logps, old_logps, ref_logps, advantages, mask, epsilon: float, epsilon_high: float,
                    beta: float) -> tuple[jax.Array, dict]:
    """GRPO's per-token loss (TRL 1.16 ``GRPOTrainer._compute_loss``, token-level importance sampling),
    fp32 ``[b, t]``, and the token sums of :data:`GRPO_METRICS` (plus ``tokens``).

    ``ratio = exp(logps - old_logps)``; ``loss = -min(ratio·A, clip(ratio, 1-ε, 1+ε_high)·A)``, plus
    with ``beta > 0`` ``β·(exp(ref - logps) - (ref - logps) - 1)`` (the k3 KL estimator,
    :func:`jaxcolossal.posttrain.loss_terms.k3_kl`).

    Args:
        logps: the policy's per-token log-probs of the completion tokens, fp32 ``[b, t]``.
        old_logps: the sampling policy's (no gradient), ``[b, t]``.
        ref_logps: the reference's (no gradient), ``[b, t]``; ignored when ``beta == 0``.
        advantages: fp32 ``[b]`` or ``[b, t]`` (constant along a row).
        mask: ``[b, t]``, 1 on the completion tokens trained on.
    """
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    coef1 = jnp.exp(logps - old_logps)
    coef2 = jnp.clip(coef1, 1 - epsilon, 1 + epsilon_high)
    loss = -jnp.minimum(coef1 * adv, coef2 * adv)
    kl = jnp.zeros_like(logps)
    if beta:
        kl = k3_kl(ref_logps, logps)
        loss = loss + beta * kl
    low = ((coef1 < 1 - epsilon) & (adv < 0)).astype(jnp.float32)
    high = ((coef1 > 1 + epsilon_high) & (adv > 0)).astype(jnp.float32)
    sums = {"kl": kl, "clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
            "clip_ratio/region_mean": jnp.maximum(low, high)}
    stats = {k: jnp.sum(jax.lax.stop_gradient(v) * mask) for k, v in sums.items()}
    stats["tokens"] = jnp.sum(mask)
    return loss, stats


def grpo_loss_sum(token_loss, mask, loss_type: str) -> jax.Array:
    """The step's numerator of GRPO's loss (fp32 scalar; the step divides by :meth:`Grpo.count`):
    ``grpo``, the sum over rows of each row's masked mean; ``bnpo``/``dapo``/``dr_grpo``, the masked
    sum over tokens. ``token_loss``, ``mask``: ``[b, t]``.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    if loss_type == "grpo":
        return sum_of_row_means(token_loss, mask)
    if loss_type in ("bnpo", "dapo", "dr_grpo"):
        return masked_sum(token_loss, mask)
    raise ValueError(f"posttrain.loss_type={loss_type!r}: expected grpo, bnpo, dr_grpo or dapo")


class Grpo:
    """The GRPO objective (module docstring) over rows of a left-padded prompt and its completion.

    ``__call__(params, tokens, targets, ..., mask, segment_ids, positions, advantages, old_logps,
    ref_logps)``: ``tokens``/``targets`` int32 ``[b, t]``, ``mask [b, t]`` on the completion tokens,
    ``advantages [b, t]`` (each row's, repeated), ``old_logps``/``ref_logps`` fp32 ``[b, t]``. Returns
    ``(summed loss, token sums of the metrics)``. On-policy (``num_iterations == 1``, one step per
    generation: :func:`~jaxcolossal.config.derived.grpo_off_policy`) the old log-probs are
    the policy's own under ``stop_gradient`` (TRL's shortcut: the ratio is 1, its gradient is not).
    """

    name = "grpo"
    batch_fields: tuple = ("advantages", "old_logps", "ref_logps")
    data_format = "prompts"
    reads = "GRPO samples completions of prompts"
    evaluation = "rollouts"  # the on-policy loader's greedy completions of the held-out prompts, scored
    reference_label = "GRPO's (beta > 0)"

    def __init__(self, family, cfg):
        self.family, self.cfg, self.post = family, cfg, cfg.posttrain
        self.loss_type = posttrain_loss_type(cfg)
        self.epsilon_high = grpo_epsilon_high(cfg)
        self.off_policy = grpo_off_policy(cfg)

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None, advantages=None, old_logps=None, ref_logps=None):
        mask = mask.astype(jnp.float32)
        logps = policy_token_logps(self.family, params, tokens, targets, mask, mcfg, shard, vocab_parallel,
                                   segment_ids, positions, dropout_key)
        old = jax.lax.stop_gradient(old_logps if self.off_policy else logps)
        p = self.post
        loss, stats = grpo_token_loss(logps, old, jax.lax.stop_gradient(ref_logps), advantages[:, 0], mask,
                                      p.epsilon, self.epsilon_high, p.beta)
        return grpo_loss_sum(loss, mask, self.loss_type), stats

    def count(self, inputs, mask=None):
        """What the summed loss divides by (fp32 scalar): the step's rows (``grpo``), its completion
        tokens (``bnpo``, ``dapo``) or rows × ``max_completion_length`` (``dr_grpo``)."""
        rows = jnp.asarray(inputs.shape[0], jnp.float32)
        if self.loss_type == "grpo":
            return rows
        if self.loss_type == "dr_grpo":
            return rows * self.post.max_completion_length
        return token_count(inputs, mask)

    def zero_stats(self) -> dict:
        """The metrics' token sums and the token count at zero (fp32 scalars)."""
        return {k: jnp.zeros((), jnp.float32) for k in GRPO_METRICS + ("tokens",)}

    def metrics(self, stats: dict, count) -> dict:
        """TRL's ``kl`` (with ``beta > 0``) and ``clip_ratio/*``: token sums over the step's completion tokens."""
        n = jnp.maximum(stats["tokens"], 1.0)
        return {k: stats[k] / n for k in GRPO_METRICS if k != "kl" or self.post.beta}

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
