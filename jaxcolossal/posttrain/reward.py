"""``training.objective=reward``: a reward model (a causal LM's backbone with a scalar score head,
``model.num_labels=1``: :mod:`jaxcolossal.models.score_head`) trained on preference pairs as TRL 1.16's
``RewardTrainer.compute_loss`` trains it; registered in :data:`jaxcolossal.train.objective.OBJECTIVES`.

Each row's reward is the score head applied to the family's final-norm hidden state at the row's last
token that is not the pad id (transformers' ``LlamaForSequenceClassification`` pooling; the pad id is
the one the preference rows are padded with, :func:`jaxcolossal.data.reward_pairs.pad_token_id`, and
the export's ``pad_token_id``). Over the ``P`` pairs of a batch (interleaved rows, ``2i`` chosen,
``2i + 1`` rejected: :func:`jaxcolossal.data.preference.pair_rows`)::

    loss = mean_i -logsigmoid(r_c,i - r_r,i - margin_i)  +  c · mean_i (r_c,i + r_r,i)^2

with ``margin`` the pairs' ``margin`` field (zero without one, TRL's margin-free branch) and ``c``
``posttrain.center_rewards_coefficient`` (0: off, TRL's None). The metrics are TRL's, each computed per
microbatch as ``compute_loss`` computes it per call and averaged over the step's microbatches as TRL's
``log`` averages the calls: ``accuracy`` (the pairs' share with ``r_c > r_r``), ``margin`` (the mean of
``r_c - r_r``), ``min_reward``/``mean_reward``/``max_reward`` over the microbatch's rewards (chosen and
rejected, gathered over the data shards: a min and a max across them).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcolossal.data.reward_pairs import pad_token_id, reward_batches
from jaxcolossal.models.score_head import SCORE, pooled_scores

REWARD_METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")
"""TRL 1.16 ``RewardTrainer``'s metric names, in its order (its ``num_tokens`` is the loader's:
:meth:`jaxcolossal.data.loader.PairLoader.step_metrics`)."""

SHARD_REDUCTIONS = {"min_reward": jnp.min, "max_reward": jnp.max, "microbatches": jnp.max}
"""The statistics combined over the data shards otherwise than by a sum (the step's ``shard_reductions``)."""


def reward_loss(chosen: jax.Array, rejected: jax.Array, margin: jax.Array | None = None,
                center_rewards_coefficient: float = 0.0) -> tuple[jax.Array, dict]:
    """The per-pair loss, fp32 ``[P]``, and the microbatch's metric statistics (fp32 scalars).

    Args:
        chosen, rejected: the rewards ``r_c``, ``r_r``, fp32 ``[P]``.
        margin: fp32 ``[P]`` or None (TRL's ``inputs["margin"]``).
        center_rewards_coefficient: ``c``; 0 adds nothing.

    Returns ``(-logsigmoid(r_c - r_r - margin) + c·(r_c + r_r)^2 [P], stats)``: the mean over pairs of the
    first is TRL's ``compute_loss``. ``stats``: sums over pairs of ``accuracy`` (``[r_c > r_r]``) and
    ``margin`` (``r_c - r_r``), the sum of all ``2P`` rewards (``mean_reward``), their ``min_reward`` and
    ``max_reward``, and ``microbatches`` = 1; none carries a gradient.
    """
    z = chosen - rejected - (0.0 if margin is None else margin)
    loss = -jax.nn.log_sigmoid(z)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen + rejected) ** 2
    rc, rr = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
    both = jnp.concatenate([rc, rr])
    stats = {"accuracy": jnp.sum((rc > rr).astype(jnp.float32)), "margin": jnp.sum(rc - rr),
             "min_reward": jnp.min(both), "mean_reward": jnp.sum(both), "max_reward": jnp.max(both),
             "microbatches": jnp.ones((), jnp.float32)}
    return loss, stats


class Reward:
    """The reward-model objective over interleaved preference rows (module docstring).

    ``__call__(params, tokens, targets, ..., margin=...)`` with int32 ``[2P, t]`` rows (``2i`` chosen,
    ``2i+1`` rejected) and the batch field ``margin`` (float32 ``[2P, t]``, each row its pair's margin):
    ``(sum over the P pairs of the loss, statistics)``. ``params`` holds ``score`` ``[d, 1]`` and no
    ``lm_head``; ``targets`` and ``mask`` are not read (the reward reads the whole row).
    """

    name = "reward"
    batch_fields: tuple = ("margin",)
    shard_reductions = SHARD_REDUCTIONS
    data_format = "preference"
    reads = "reward models read preference pairs"
    evaluation = "objective"  # the held-out pairs' loss and TRL's metrics
    headline_metrics = ("accuracy", "margin")
    reference_label = ""  # no reference model
    batches = staticmethod(reward_batches)  # the preference rows with each pair's margin

    def __init__(self, family, cfg):
        self.family, self.cfg = family, cfg
        self.pad_id = pad_token_id(cfg.data.tokenizer)
        self.center = float(cfg.posttrain.center_rewards_coefficient)

    def rewards(self, params, tokens, mcfg, shard, vocab_parallel, dropout_key=None) -> jax.Array:
        """fp32 ``[b]``: each row's score at its last non-pad token (:func:`pooled_scores`)."""
        extra = {} if dropout_key is None else {"dropout_key": dropout_key}
        h = self.family.hidden_states(params, tokens, mcfg, shard, vocab_parallel, None, None, **extra)
        return pooled_scores(h, params[SCORE], tokens, self.pad_id)[:, 0]

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None, margin=None):
        r = self.rewards(params, tokens, mcfg, shard, vocab_parallel, dropout_key)
        m = None if margin is None else margin[0::2, 0].astype(jnp.float32)
        loss, stats = reward_loss(r[0::2], r[1::2], m, self.center)
        return jnp.sum(loss), stats

    def count(self, inputs, mask=None, fields=None):
        """The step's pairs (fp32 scalar): half its rows."""
        return jnp.asarray(inputs.shape[0] // 2, jnp.float32)

    def zero_stats(self) -> dict:
        """The statistics at zero (fp32 scalars), the microbatch accumulation's start."""
        return {k: jnp.zeros((), jnp.float32) for k in (*REWARD_METRICS, "microbatches")}

    def metrics(self, stats: dict, count) -> dict:
        """TRL's five metrics: ``accuracy``, ``margin`` (per pair) and ``mean_reward`` (per reward) the
        step's means; ``min_reward``/``max_reward`` the mean over its microbatches of each one's extreme."""
        k = jnp.maximum(stats["microbatches"], 1.0)
        return {"accuracy": stats["accuracy"] / count, "margin": stats["margin"] / count,
                "min_reward": stats["min_reward"] / k, "mean_reward": stats["mean_reward"] / (2 * count),
                "max_reward": stats["max_reward"] / k}

    @staticmethod
    def held_out_parts(val: float) -> tuple[str, str]:
        """``("held-out reward-model loss", "X per pair")``: the held-out pairs' mean loss ``val``."""
        return "held-out reward-model loss", f"{val:.4f} per pair"

    @staticmethod
    def loader(data: Any, cfg, plan) -> Any:
        """The training loader: the margin pair loader ``data`` itself (off-policy)."""
        return data
