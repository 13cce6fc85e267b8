"""Training objectives: what the one train step (:mod:`jaxcolossal.train.step`) differentiates.

Post-training adds an *objective* on the same state, sharding, step and loop, not a second trainer:
``training.objective`` picks it (:func:`make_objective`), and the step calls it where it called the
family's language-model loss.

* ``sft`` — the summed next-token cross-entropy over the (masked-in) tokens: the family's own
  ``loss_and_stats``, divided by the step's token count. Pre-training and SFT.
* ``dpo`` — Direct Preference Optimization (Rafailov et al., 2023), its IPO variant (Azar et al.,
  2023) and conservative DPO (label smoothing), as TRL's ``DPOTrainer`` computes them (trl 1.16,
  ``DPOTrainer._compute_loss``). The batch holds preference pairs as interleaved rows (row ``2i``
  chosen, ``2i + 1`` rejected: :func:`jaxcolossal.data.preference.pair_rows`), whose loss masks cover
  the response tokens only; the policy's and the reference's sequence log-probs are the masked sums
  of per-token log-probs (:func:`jaxcolossal.models.layers.logprobs.token_logprobs`, chunked over tokens and vocabulary), and the loss is the
  mean over the step's pairs.
* ``grpo`` — Group Relative Policy Optimization (Shao et al., 2024) and its variants (DAPO, Dr. GRPO),
  as TRL's ``GRPOTrainer._compute_loss`` computes them (trl 1.16): rows are prompts with completions
  sampled from the policy (:mod:`jaxcolossal.posttrain.rollout`), whose loss masks cover the
  completion tokens; the batch also carries each row's group-normalised advantage and the per-token
  log-probs of the policy that sampled it (``num_iterations > 1``) and of the reference (``beta > 0``).

An objective is called as ``objective(params, tokens, targets, cfg, shard, vocab_parallel, mask,
segment_ids, positions, dropout_key=None, reference=None, **fields) -> (summed loss, stats)``, where
``fields`` are the batch's arrays that the objective names in ``batch_fields`` (each ``[B, t]``, split
into microbatches like the tokens); the step divides the summed loss by :meth:`count` over the whole
step, sums ``stats`` over data shards and microbatches, and reports :meth:`metrics` of them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcolossal.config.derived import grpo_epsilon_high, grpo_off_policy, posttrain_loss_type
from jaxcolossal.models.layers import moe
from jaxcolossal.models.layers.logprobs import token_logprobs

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
"""TRL's ``DPOTrainer`` metric names, each a mean over the step's pairs (trl 1.16 ``_compute_loss``)."""


def token_count(inputs: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The tokens a step's mean loss divides by (fp32 scalar): ``B·t``, or with a loss mask the
    masked-in tokens of the whole global batch (at least 1, so an all-masked step is a zero update)."""
    if mask is None:
        return jnp.asarray(inputs.shape[0] * inputs.shape[1], jnp.float32)
    return jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)


class Sft:
    """The language-model objective: the family's ``loss_and_stats`` (summed cross-entropy, and a
    mixture of experts' router statistics), the mean over the step's masked-in tokens."""

    name = "sft"
    batch_fields: tuple = ()

    def __init__(self, family, cfg):
        self.family, self.cfg = family, cfg

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None):
        extra = {} if dropout_key is None else {"dropout_key": dropout_key}
        return self.family.loss_and_stats(params, tokens, targets, mcfg, shard, vocab_parallel, mask,
                                          segment_ids=segment_ids, positions=positions, **extra)

    def count(self, inputs, mask=None):
        return token_count(inputs, mask)

    def zero_stats(self) -> dict:
        return moe.zero_stats(self.cfg.model) if self.cfg.model.moe else {}

    def metrics(self, stats: dict, count) -> dict:
        return {}


def sequence_logps(family, params, tokens, targets, mask, mcfg, shard, vocab_parallel, dropout_key=None):
    """The masked sums of per-token log-probs, fp32 ``[b]``: ``sum_t mask[b, t] · log p(targets[b, t])``
    (TRL's ``per_token_logps.sum(dim=1)`` over the completion). ``tokens``/``targets`` int32 ``[b, t]``,
    ``mask`` ``[b, t]`` (1 = a response token), sharded ``("batch", "seq")``."""
    extra = {} if dropout_key is None else {"dropout_key": dropout_key}
    h = family.hidden_states(params, tokens, mcfg, shard, vocab_parallel, None, None, **extra)
    lp = token_logprobs(h, family.head_weight(params, mcfg), targets, mask, mcfg.vocab_size, shard,
                        mcfg.loss_chunk_tokens, mcfg.loss_chunk_vocab,
                        mcfg.final_logit_softcapping)  # chunked: never the whole fp32 logits
    return jnp.sum(lp, axis=-1)


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_len, rejected_len,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[jax.Array, dict]:
    """Per-pair DPO loss and TRL's six metrics, each fp32 ``[P]`` (means over pairs are the step's).

    Args:
        chosen_logps, rejected_logps: the policy's sequence log-probs of each pair's responses.
        ref_chosen_logps, ref_rejected_logps: the reference model's (no gradient flows into them).
        chosen_len, rejected_len: response tokens of each (IPO's per-token averages; at least 1).
        beta: DPO's β (IPO's τ), > 0.
        loss_type: ``sigmoid``: ``-logσ(βΔ)``; with ``label_smoothing = ε`` conservative DPO
            ``-(1-ε)·logσ(βΔ) - ε·logσ(-βΔ)`` (Mitchell, 2023; TRL's ``sigmoid`` before 1.0, and
            its ``robust``/``aot`` spelling of ε), ``Δ = (π_c - ref_c) - (π_r - ref_r)``.
            ``ipo``: ``(Δ_c/|c| - Δ_r/|r| - 1/(2β))²`` with each log-ratio averaged over its
            response tokens (TRL 1.16's length-normalised IPO).

    Returns ``(loss [P], {name: [P]})`` with :data:`DPO_METRICS`: ``rewards/chosen = β·(π_c - ref_c)``,
    ``rewards/rejected`` likewise, ``rewards/accuracies = [reward_c > reward_r]``, ``rewards/margins =
    reward_c - reward_r``, ``logps/chosen = π_c``, ``logps/rejected = π_r`` (TRL's definitions).

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * delta)
        if label_smoothing:
            loss = loss - label_smoothing * jax.nn.log_sigmoid(-beta * delta)
    elif loss_type == "ipo":
        ipo_delta = chosen_ratio / jnp.maximum(chosen_len, 1.0) - rejected_ratio / jnp.maximum(rejected_len, 1.0)
        loss = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"posttrain.loss_type={loss_type!r}: expected sigmoid or ipo")
    rc, rr = jax.lax.stop_gradient(beta * chosen_ratio), jax.lax.stop_gradient(beta * rejected_ratio)
    metrics = {"rewards/chosen": rc, "rewards/rejected": rr, "rewards/accuracies": (rc > rr).astype(jnp.float32),
               "rewards/margins": rc - rr, "logps/chosen": jax.lax.stop_gradient(chosen_logps),
               "logps/rejected": jax.lax.stop_gradient(rejected_logps)}
    return loss, metrics


class Dpo:
    """The DPO objective over interleaved preference rows (module docstring).

    ``__call__(params, tokens, targets, ...)`` with int32 ``[2P, t]`` rows (``2i`` chosen, ``2i+1``
    rejected) and ``mask [2P, t]``: ``(sum over the P pairs of the loss, {metric: sum over pairs})``.
    ``reference``: the reference model's params dict (the frozen initial copy, or under LoRA the base
    without adapters): its log-probs are computed under ``stop_gradient`` in the same step.
    """

    name = "dpo"
    batch_fields: tuple = ()

    def __init__(self, family, cfg):
        self.family, self.cfg, self.post = family, cfg, cfg.posttrain

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None):
        # the phases: policy log-probs, reference log-probs (no gradient), the per-pair loss
        mask = mask.astype(jnp.float32)
        pol = sequence_logps(self.family, params, tokens, targets, mask, mcfg, shard, vocab_parallel, dropout_key)
        ref_params = jax.lax.stop_gradient(reference)
        ref = jax.lax.stop_gradient(sequence_logps(self.family, ref_params, tokens, targets, mask, mcfg, shard,
                                                   vocab_parallel))
        lens = jnp.sum(mask, axis=-1)
        p = self.post
        loss, metrics = dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], lens[0::2], lens[1::2], p.beta,
                                 posttrain_loss_type(self.cfg), p.label_smoothing)
        return jnp.sum(loss), {k: jnp.sum(v) for k, v in metrics.items()}

    def count(self, inputs, mask=None):
        """The step's pairs (fp32 scalar): half its rows."""
        return jnp.asarray(inputs.shape[0] // 2, jnp.float32)

    def zero_stats(self) -> dict:
        return {k: jnp.zeros((), jnp.float32) for k in DPO_METRICS}

    def metrics(self, stats: dict, count) -> dict:
        """TRL's six metrics: the step's sums over pairs divided by its pairs."""
        return {k: stats[k] / count for k in DPO_METRICS}


GRPO_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""TRL's ``GRPOTrainer`` loss metrics, each a mean over the step's completion tokens (trl 1.16)."""


def grpo_token_loss(logps, old_logps, ref_logps, advantages, mask, epsilon: float, epsilon_high: float,
                    beta: float) -> tuple[jax.Array, dict]:
    """GRPO's per-token loss (TRL 1.16 ``GRPOTrainer._compute_loss``, token-level importance sampling),
    fp32 ``[b, t]``, and the token sums of :data:`GRPO_METRICS` (plus ``tokens``).

    ``ratio = exp(logps - old_logps)``; ``loss = -min(ratio·A, clip(ratio, 1-ε, 1+ε_high)·A)``, plus
    with ``beta > 0`` ``β·(exp(ref - logps) - (ref - logps) - 1)`` (the k3 KL estimator).

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
        d = ref_logps - logps
        kl = jnp.exp(d) - d - 1
        loss = loss + beta * kl
    low = ((coef1 < 1 - epsilon) & (adv < 0)).astype(jnp.float32)
    high = ((coef1 > 1 + epsilon_high) & (adv > 0)).astype(jnp.float32)
    sums = {"kl": kl, "clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
            "clip_ratio/region_mean": jnp.maximum(low, high)}
    stats = {k: jnp.sum(jax.lax.stop_gradient(v) * mask) for k, v in sums.items()}
    stats["tokens"] = jnp.sum(mask)
    return loss, stats


def grpo_loss_sum(token_loss, mask, loss_type: str) -> jax.Array:
    """The step's numerator of GRPO's loss (the step divides by :meth:`Grpo.count`): ``grpo``, the sum
    over rows of each row's masked mean; ``bnpo``/``dapo``/``dr_grpo``, the masked sum over tokens.

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    if loss_type == "grpo":
        return jnp.sum(jnp.sum(token_loss * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0))
    if loss_type in ("bnpo", "dapo", "dr_grpo"):
        return jnp.sum(token_loss * mask)
    raise ValueError(f"posttrain.loss_type={loss_type!r}: expected grpo, bnpo, dr_grpo or dapo")


def policy_token_logps(family, params, tokens, targets, mask, mcfg, shard, vocab_parallel, segment_ids=None,
                       positions=None, dropout_key=None) -> jax.Array:
    """Per-token log-probs of ``targets`` under ``params``, fp32 ``[b, t]``, 0 where ``mask`` is 0,
    through the chunked path (:func:`jaxcolossal.models.layers.logprobs.token_logprobs`).
    ``segment_ids``/``positions`` (int ``[b, t]``) keep a left-padded prompt's pads out of attention
    and count positions from its first real token, as the sampler does."""
    extra = {} if dropout_key is None else {"dropout_key": dropout_key}
    h = family.hidden_states(params, tokens, mcfg, shard, vocab_parallel, segment_ids, positions, **extra)
    return token_logprobs(h, family.head_weight(params, mcfg), targets, mask, mcfg.vocab_size, shard,
                          mcfg.loss_chunk_tokens, mcfg.loss_chunk_vocab, mcfg.final_logit_softcapping)


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
        return {k: jnp.zeros((), jnp.float32) for k in GRPO_METRICS + ("tokens",)}

    def metrics(self, stats: dict, count) -> dict:
        """TRL's ``kl`` (with ``beta > 0``) and ``clip_ratio/*``: token sums over the step's completion tokens."""
        n = jnp.maximum(stats["tokens"], 1.0)
        return {k: stats[k] / n for k in GRPO_METRICS if k != "kl" or self.post.beta}


def make_objective(family, cfg) -> Any:
    """The objective ``cfg.training.objective`` names: :class:`Sft`, :class:`Dpo` or :class:`Grpo`."""
    return {"dpo": Dpo, "grpo": Grpo}.get(cfg.training.objective, Sft)(family, cfg)
