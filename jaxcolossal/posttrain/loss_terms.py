"""The terms every objective builds its loss from (:mod:`jaxcolossal.train.objective`'s registry):
log-probabilities of a batch's target tokens under a family, the k3 KL estimator, and the
normalisers that turn a step's summed loss into a mean.

Log-probs go through the chunked path (:func:`jaxcolossal.models.layers.logprobs.token_logprobs`:
never the whole fp32 logits). Every function here is traced inside the one train step; none holds
state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcolossal.models.layers.logprobs import token_logprobs

# ----------------------------------------------------------------------------- log-probs


def policy_token_logps(family, params, tokens, targets, mask, mcfg, shard, vocab_parallel, segment_ids=None,
                       positions=None, dropout_key=None, temperature: float = 1.0, extras: tuple[str, ...] = (),
                       hidden=None):
    """Per-token log-probs of ``targets`` under ``params``, fp32 ``[b, t]``, 0 where ``mask`` is 0,
    through the chunked path (:func:`jaxcolossal.models.layers.logprobs.token_logprobs`).
    ``tokens``/``targets`` int32 ``[b, t]``; ``mask`` ``[b, t]`` (1 = a token trained on).
    ``segment_ids``/``positions`` (int ``[b, t]``) keep a left-padded prompt's pads out of attention
    and count positions from its first real token, as the sampler does. ``temperature``: of the
    logits (TRL's GRPO log-probs are those of ``logits / temperature``); ``extras``: also those per-token
    statistics (:data:`jaxcolossal.models.layers.logprobs.EXTRAS`: entropy, mean logit, top-1), fp32
    ``[b, t]`` without gradient, returned as ``(logps, {name: stat})``. ``hidden``: the final-norm hidden
    states ``[b, t, d]`` when a pipeline computed them (:mod:`jaxcolossal.train.pipeline_objective`); the
    model's forward is then not run here."""
    extra = {} if dropout_key is None else {"dropout_key": dropout_key}
    h = hidden if hidden is not None else family.hidden_states(params, tokens, mcfg, shard, vocab_parallel,
                                                               segment_ids, positions, **extra)
    return token_logprobs(h, family.head_weight(params, mcfg), targets, mask, mcfg.vocab_size, shard,
                          mcfg.loss_chunk_tokens, mcfg.loss_chunk_vocab, mcfg.final_logit_softcapping,
                          temperature, extras)


def sequence_logps(family, params, tokens, targets, mask, mcfg, shard, vocab_parallel, dropout_key=None):
    """The masked sums of per-token log-probs, fp32 ``[b]``: ``sum_t mask[b, t] · log p(targets[b, t])``
    (TRL's ``per_token_logps.sum(dim=1)`` over the completion). ``tokens``/``targets`` int32 ``[b, t]``,
    ``mask`` ``[b, t]`` (1 = a response token), sharded ``("batch", "seq")``; no packing (segment
    ids and positions are the row's own)."""
    lp = policy_token_logps(family, params, tokens, targets, mask, mcfg, shard, vocab_parallel, None, None,
                            dropout_key)
    return jnp.sum(lp, axis=-1)


# ----------------------------------------------------------------------------- the KL estimator


def k3_kl(ref_logps: jax.Array, logps: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of ``KL(π ‖ π_ref)`` per token, fp32 like its inputs (any shape, the
    two alike): ``exp(ref - logp) - (ref - logp) - 1``, never negative (TRL's ``per_token_kl``)."""
    d = ref_logps - logps
    return jnp.exp(d) - d - 1


# ----------------------------------------------------------------------------- normalisers


def token_count(inputs: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The tokens a step's mean loss divides by (fp32 scalar): ``B·t`` of ``inputs [B, t]``, or with a
    loss ``mask [B, t]`` the masked-in tokens of the whole global batch (at least 1, so an
    all-masked step is a zero update)."""
    if mask is None:
        return jnp.asarray(inputs.shape[0] * inputs.shape[1], jnp.float32)
    return jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)


def sum_of_row_means(token_loss: jax.Array, mask: jax.Array) -> jax.Array:
    """Each row's mean over its masked-in tokens, summed over the rows (fp32 scalar; a row with no
    token counts 0): the numerator of a loss that weighs every sequence alike. ``token_loss``,
    ``mask``: ``[b, t]``."""
    return jnp.sum(jnp.sum(token_loss * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0))


def masked_sum(token_loss: jax.Array, mask: jax.Array) -> jax.Array:
    """The masked-in tokens' loss summed (fp32 scalar): the numerator of a loss that weighs every
    token alike. ``token_loss``, ``mask``: ``[b, t]``."""
    return jnp.sum(token_loss * mask)
