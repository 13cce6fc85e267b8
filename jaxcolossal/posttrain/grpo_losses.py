"""GRPO's per-token losses, as TRL 1.16's ``GRPOTrainer._compute_loss`` computes them: the importance
ratio (per token, or per sequence: GSPO), the eight loss types' policy terms (``grpo``, ``bnpo``,
``dr_grpo``, ``dapo``, ``luspo`` clip the ratio; ``cispo`` clips a detached ratio; ``sapo`` softens
it; ``vespo`` weighs the sequence by a gamma function of its ratio), the k3 KL term with TRL's
importance-ratio bias correction, two-sided ``delta`` clipping and the high-entropy token mask.

Every function is traced inside the train step on one microbatch (all of it, or one data shard's
rows); arrays are fp32 ``[b, t]`` over the completion tokens unless said otherwise. The step's
normalisation and the metrics are :class:`jaxcolossal.posttrain.grpo.Grpo`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxcolossal.config.derived import GRPO_CLIPPED_LOSSES
from jaxcolossal.posttrain.loss_terms import k3_kl


@dataclass(frozen=True)
class GrpoTerms:
    """The settings the per-token loss reads (``posttrain.*`` keys of the same names, TRL's)."""

    loss_type: str
    epsilon: float
    epsilon_high: float
    beta: float
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    delta: float = 0.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo: tuple = (2.0, 3.0, 3.0, 2.0)  # k_pos, lambda_pos, k_neg, lambda_neg

    @classmethod
    def from_config(cls, cfg, loss_type: str, epsilon_high: float, beta: float) -> "GrpoTerms":
        p = cfg.posttrain
        return cls(loss_type, p.epsilon, epsilon_high, beta, p.use_bias_correction_kl, p.importance_sampling_level,
                   p.delta, p.sapo_temperature_pos, p.sapo_temperature_neg,
                   (p.vespo_k_pos, p.vespo_lambda_pos, p.vespo_k_neg, p.vespo_lambda_neg))


def importance_ratio(log_ratio: jax.Array, mask: jax.Array, level: str) -> jax.Array:
    """``exp`` of the log importance weights: per token (``token``: ``[b, t]``) or per sequence
    (``sequence``, GSPO: the masked mean of the row's log-ratios, ``[b, 1]``)."""
    if level == "token":
        return jnp.exp(log_ratio)
    per_row = jnp.sum(log_ratio * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    return jnp.exp(per_row)[:, None]


def gamma_weights(adv: jax.Array, log_ratio: jax.Array, mask: jax.Array, vespo: tuple) -> jax.Array:
    """VESPO's sequence weight ``φ(w) = e^λ·w^k·e^{-λw}`` of the sequence ratio ``w = exp(Σ log-ratio)``
    (log-ratios clamped to ±20, ``log w`` to ``[log 1e-8, 20]``), ``k, λ`` by the advantage's sign;
    fp32 ``[b, 1]``, no gradient (TRL's ``get_gamma_weights`` under ``no_grad``). ``adv``: ``[b, 1]``."""
    k_pos, lam_pos, k_neg, lam_neg = vespo
    lower = math.log(1e-8)
    seq = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * mask, axis=-1, keepdims=True)
    log_w = jnp.clip(seq, lower, 20.0)
    nonneg = adv >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lam_pos, lam_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
    return jax.lax.stop_gradient(phi)


def policy_term(terms: GrpoTerms, coef1, adv, logps, log_ratio, mask) -> tuple:
    """The loss type's per-token policy loss (``[b, t]``, or ``[b, 1]`` for sequence-level ratios
    where the type allows), for ``vespo`` its weights ``φ`` (else ``None``), and the ratio as the clip
    metrics read it (capped at ``delta`` when two-sided clipping is on, as TRL reassigns it).
    ``coef1``: the importance ratio; ``adv``: ``[b, 1]``.

    Raises:
        ValueError: an unknown loss type.
    """
    lt = terms.loss_type
    if lt == "cispo":
        clamped = jax.lax.stop_gradient(jnp.minimum(coef1, terms.epsilon_high))
        return -clamped * adv * logps, None, coef1
    if lt in GRPO_CLIPPED_LOSSES:
        coef2 = jnp.clip(coef1, 1 - terms.epsilon, 1 + terms.epsilon_high)
        if terms.delta:  # two-sided clipping: the unclipped ratio capped at delta
            coef1 = jnp.minimum(coef1, terms.delta)
        return -jnp.minimum(coef1 * adv, coef2 * adv), None, coef1
    if lt == "sapo":
        temps = jnp.where(adv > 0, terms.sapo_temperature_pos, terms.sapo_temperature_neg)
        return -(jax.nn.sigmoid(temps * (coef1 - 1)) * 4 / temps) * adv, None, coef1
    if lt == "vespo":
        phi = gamma_weights(adv, log_ratio, mask, terms.vespo)
        return -phi * adv * logps, phi, coef1
    raise ValueError(f"posttrain.loss_type={lt!r}: not a GRPO loss")


def masked_quantile(values: jax.Array, mask: jax.Array, q: float) -> jax.Array:
    """``torch.quantile`` (linear interpolation) of the entries of ``values`` where ``mask`` is 1, any
    shape; fp32 scalar (``+inf`` when no entry is masked in, so that nothing passes ``>=``)."""
    flat, keep = values.reshape(-1), mask.reshape(-1) > 0
    n = jnp.sum(keep)
    ordered = jnp.sort(jnp.where(keep, flat, jnp.inf))
    pos = q * jnp.maximum(n - 1, 0).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    frac = pos - lo
    a, b = ordered[lo], ordered[hi]
    return jnp.where(n > 0, a + frac * (b - a), jnp.inf)


def high_entropy_mask(entropies: jax.Array, mask: jax.Array, quantile: float, shard_axis: str | None) -> jax.Array:
    """TRL's ``get_high_entropy_mask``: 1 on the masked-in tokens whose entropy is at least the
    ``1 - quantile`` quantile of the microbatch's masked-in entropies, fp32 ``[b, t]``. ``shard_axis``:
    the vmapped data-shard axis when each call sees one shard's rows (the quantile is then of the
    whole microbatch's, gathered over it, as TRL gathers over its processes)."""
    ent, m = jax.lax.stop_gradient(entropies), mask
    if shard_axis is not None:
        ent_all, m_all = jax.lax.all_gather(ent, shard_axis), jax.lax.all_gather(m, shard_axis)
    else:
        ent_all, m_all = ent, m
    threshold = masked_quantile(ent_all, m_all, 1.0 - quantile)
    return ((ent * m >= threshold) & (m > 0)).astype(jnp.float32)


def grpo_token_loss(terms: GrpoTerms, logps, old_logps, ref_logps, adv, mask, entropy_mask=None) -> tuple:
    """GRPO's per-token loss, fp32 ``[b, t]`` (or ``[b, 1]`` broadcastable, sequence-level), and its parts
    for the metrics: ``{"kl": [b, t] | None, "coef1": ratio, "phi": vespo's weights | None}``.

    The phases, in TRL's order: the importance ratio; the k3 KL (``beta > 0``), times the ratio with
    ``use_bias_correction_kl``; the loss type's policy term; the high-entropy mask on it; ``+ β·KL``.
    ``old_logps``/``ref_logps`` carry no gradient; ``adv``: ``[b]``.
    """
    adv = adv[:, None]
    log_ratio = logps - old_logps
    coef1 = importance_ratio(log_ratio, mask, terms.importance_sampling_level)
    kl = None
    if terms.beta:
        kl = k3_kl(ref_logps, logps)
        if terms.use_bias_correction_kl:
            kl = kl * coef1
    loss, phi, coef1 = policy_term(terms, coef1, adv, logps, log_ratio, mask)
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if kl is not None:
        loss = loss + terms.beta * kl
    return loss, {"kl": kl, "coef1": coef1, "phi": phi, "adv": adv}


def rloo_sequence_loss(terms: GrpoTerms, logps, old_logps, adv, mask) -> tuple:
    """TRL 1.16 ``RLOOTrainer._compute_loss``'s per-completion loss, fp32 ``[b, 1]``: the ratio of the
    completion's summed log-probs ``exp(Σ logp - Σ logp_old)``, PPO's clipped objective
    ``-min(ratio·A, clip(ratio, 1-ε, 1+ε_high)·A)`` on it (the KL is in the reward, not here), and the
    parts for the metrics. ``logps``/``old_logps``/``mask``: ``[b, t]``; ``adv``: ``[b]``."""
    adv = adv[:, None]
    seq = jnp.sum(logps * mask, axis=-1, keepdims=True)
    old_seq = jnp.sum(old_logps * mask, axis=-1, keepdims=True)
    coef1 = jnp.exp(seq - old_seq)
    coef2 = jnp.clip(coef1, 1 - terms.epsilon, 1 + terms.epsilon_high)
    loss = -jnp.minimum(coef1 * adv, coef2 * adv)
    return loss, {"kl": None, "coef1": coef1, "phi": None, "adv": adv}
