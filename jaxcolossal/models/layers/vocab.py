"""The vocabulary ends of a language model: the input embedding and the LM head + cross-entropy.

Both ends cost memory or FLOPs that grow with the vocabulary ``v`` (128256 for LLaMA-3), so they
live here, shared by every model family and by the pipeline's first and last stages:

* :func:`embed_lookup` — the token embedding. With the vocabulary sharded over ``tp`` it is
  Megatron's ``VocabParallelEmbedding`` (Shoeybi et al., 2019): each tp rank gathers the ids that
  fall in its vocabulary range from its local shard, zeroes the others, and the partial rows are
  summed over tp (one all-reduce of ``[b, t, d]``). Its gradient is a scatter-add into the local
  shard only. No one-hot tensor, no ``2·T·v·d/tp`` matmul FLOPs (``model.embedding_impl=one_hot``
  keeps that older formulation for comparison).
* :func:`lm_head_loss` — the LM-head matmul fused with the cross-entropy (Wijmans et al., 2024,
  *Cut Your Losses in Large-Vocabulary Language Models*; the Liger kernel's fused linear
  cross-entropy; Megatron's vocab-parallel cross-entropy): minus the masked sum of
  :func:`jaxcolossal.models.layers.logprobs.token_logprobs`, which runs over chunks of
  ``model.loss_chunk_tokens`` tokens and, inside each, over chunks of ``model.loss_chunk_vocab``
  vocabulary columns per device with an online log-sum-exp, so no more than one chunk's fp32
  logits ``[chunk_tokens, chunk_vocab]`` exist at a time, forward or backward (a ``custom_vjp``
  that recomputes each chunk's logits in the backward: ``8·T·v·d`` FLOPs for value and gradient
  instead of ``6``). ``model.loss_chunk_tokens=0`` materializes all logits (the unfused reference
  path), as does any per-device token count for which :func:`fused_pays` is false.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxcolossal.config import ModelConfig
from jaxcolossal.models.layers.linear import project, take_rows
from jaxcolossal.models.layers.logprobs import (
    PAD_LOGIT,
    Sharder,
    batch_shards,
    no_shard,
    soft_cap,
    token_logprobs,
    vocab_shards,
)

# ----------------------------------------------------------------------------- input embedding


def embed_lookup(table: jax.Array, tokens: jax.Array, shard: Sharder = no_shard, vocab_parallel: bool = False,
                 impl: str = "gather") -> jax.Array:
    """Rows of ``table [v, d]`` for int32 ``tokens [b, t]``: ``[b, t, d]`` in the table's dtype.

    Args:
        table: the (padded) embedding, sharded ``("vocab", "embed")``: over ``tp`` on ``v``.
        tokens: ids in ``[0, v)``; the caller has checked them against the tokenizer.
        shard: the activation sharder (:class:`jaxcolossal.parallel.sharding.Sharder`).
        vocab_parallel: whether ``vocab`` is split over more than one device.
        impl: ``gather`` (Megatron's masked gather, the default) or ``one_hot`` (a one-hot
            ``[b, t, v]`` contracted with the table: ``2·b·t·v·d/tp`` FLOPs, kept for comparison).

    The masked gather is written for the SPMD partitioner, not with manual collectives: the table
    is viewed as ``[n, v/n, d]`` (``n`` = the vocab shards, the leading dim on ``tp``), each shard
    gathers ``tokens - shard_offset`` where that falls in ``[0, v/n)`` and zeroes the rest, and the
    sum over ``n`` is the all-reduce over tp.
    """
    if not vocab_parallel:
        return take_rows(table, tokens)
    if impl == "one_hot":
        onehot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
        return project("btv,vd->btd", shard(onehot, ("batch", "seq", "vocab")), table)
    n = vocab_shards(shard)
    v, d = table.shape
    rows_per = v // n
    parts = shard(table.reshape(n, rows_per, d), ("vocab", None, "embed"))
    local = tokens[None] - (jnp.arange(n, dtype=tokens.dtype) * rows_per)[:, None, None]
    local = shard(local, ("vocab", "batch", "seq"))
    hit = (local >= 0) & (local < rows_per)
    rows = jax.vmap(lambda p, i: take_rows(p, jnp.clip(i, 0, rows_per - 1)))(parts, local)
    rows = shard(jnp.where(hit[..., None], rows, jnp.zeros((), rows.dtype)), ("vocab", "batch", "seq", "embed"))
    return jnp.sum(rows, axis=0)


# ----------------------------------------------------------------------------- LM head + loss


def logits(h: jax.Array, w: jax.Array, vocab_size: int, shard: Sharder = no_shard, softcap: float = 0.0) -> jax.Array:
    """fp32 logits ``[b, t, v]`` of hidden ``h [b, t, d]`` and head ``w [d, v]`` (sharded on ``vocab``),
    soft-capped to ``softcap · tanh(logits / softcap)`` when ``softcap`` > 0 (Gemma's
    ``final_logit_softcapping``); the padded columns ``>= vocab_size`` are :data:`PAD_LOGIT`."""
    out = shard(jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32), ("batch", "seq", "vocab"))
    out = soft_cap(out, softcap)
    if out.shape[-1] != vocab_size:
        col = jax.lax.broadcasted_iota(jnp.int32, out.shape, 2)
        out = jnp.where(col < vocab_size, out, PAD_LOGIT)
    return out


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Sum over tokens of ``-log softmax(logits)[target]`` (fp32 scalar), never gathering the vocab.

    With ``logits [b, t, v]`` sharded on ``vocab`` over tp this is Megatron's vocab-parallel
    cross-entropy: max and sum-exp are local reductions plus all-reduces over tp, and the target
    logit is a masked local sum plus an all-reduce. ``mask [b, t]`` (optional) weights each token.
    """
    lse = jax.nn.logsumexp(logits, axis=-1)
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    picked = jnp.sum(jnp.where(col == targets[..., None], logits, 0.0), axis=-1)
    per_token = lse - picked
    if mask is not None:
        per_token = per_token * mask
    return jnp.sum(per_token)


def fused_pays(tokens: int, hidden: int, chunk_tokens: int) -> bool:
    """Whether the fused, chunked head needs less memory than the full logits, for ``tokens``
    tokens per device.

    In rows of ``v/tp`` fp32 values: the full path holds the logits and their gradient
    (``2·tokens``); the fused one holds the fp32 ``dW`` (``hidden``) and one chunk's logits,
    exponentials and gradient (``3·chunk_tokens``). So the fused path is taken when
    ``2·tokens > hidden + 3·chunk_tokens`` (the compiled temporaries in ``scripts/lean_step.py``
    agree: at 2048 tokens, hidden 2048 and chunks of 1024 the fused step was larger). That was
    measured before the vocabulary was chunked too; the chunked path now holds only a vocab
    chunk's fp32 ``dW`` and logits, so the test is conservative. It is kept because the planner's
    memory model (:mod:`jaxcolossal.memory.activations`) follows it.
    """
    return chunk_tokens > 0 and 2 * tokens > hidden + 3 * chunk_tokens


def lm_head_loss(h: jax.Array, w: jax.Array, targets: jax.Array, vocab_size: int, shard: Sharder = no_shard,
                 chunk_tokens: int = 0, mask: jax.Array | None = None, force_fused: bool = False,
                 chunk_vocab: int = 0, softcap: float = 0.0) -> jax.Array:
    """Summed next-token cross-entropy (nats, fp32 scalar) of the head ``w`` on hidden states ``h``.

    Args:
        h: ``[b, t, d]`` final-norm hidden states in the compute dtype, sharded ``("batch", "seq", "embed")``.
        w: ``[d, v]`` the LM head (``embed_tokens.T`` when tied), ``v`` padded, sharded on ``vocab``.
        targets: int32 ``[b, t]``.
        vocab_size: the real vocabulary; columns ``>= vocab_size`` never receive probability.
        chunk_tokens: tokens per device per chunk (``model.loss_chunk_tokens``); 0 materializes
            the whole ``[b, t, v]`` fp32 logits and differentiates them by autodiff, as does any
            value for which :func:`fused_pays` is false.
        mask: optional ``[b, t]`` per-token weights (1 = counted).
        force_fused: take the chunked path whenever ``chunk_tokens > 0``, even where
            :func:`fused_pays` says it costs more memory (tests and measurements).
        chunk_vocab: vocabulary columns per device per chunk (``model.loss_chunk_vocab``); 0: a
            device's whole vocabulary shard in one chunk.
        softcap: the final logit soft-cap (``model.final_logit_softcapping``, Gemma; 0: none): the
            cross-entropy is of ``softcap · tanh(h @ w / softcap)``, on both paths.

    The chunked path is minus the masked sum of :func:`jaxcolossal.models.layers.logprobs.token_logprobs`
    (chunked over tokens and vocabulary, online log-sum-exp, a backward that recomputes each
    chunk's logits). Returns the sum, not the mean: the train step divides by the tokens of the
    whole step. The gradient with respect to ``h`` is cast to ``h``'s dtype only after the incoming
    cotangent (the fp16 loss scale) has multiplied it, so small gradients do not underflow.
    """
    b, t, d = h.shape
    rows = b // batch_shards(shard, b)  # a device's rows: the chunks are sized per device
    if chunk_tokens <= 0 or not (force_fused or fused_pays(rows * t, d, chunk_tokens)):
        return cross_entropy_sum(logits(h, w, vocab_size, shard, softcap), targets, mask)
    return -jnp.sum(token_logprobs(h, w, targets, mask, vocab_size, shard, chunk_tokens, chunk_vocab, softcap))


def lm_loss(hidden_states: Callable, head_weight: Callable) -> tuple[Callable, Callable]:
    """A family's ``(head_loss, loss_sum)`` from its ``hidden_states(params, tokens, cfg, shard,
    vocab_parallel, segment_ids, positions) -> [b, t, d]`` and ``head_weight(params, cfg) -> [d, v]``.

    ``head_loss(params, h, targets, cfg, shard, mask=None)``: the summed cross-entropy of final
    hidden states ``h [b, t, d]`` through the fused, chunked LM head (:func:`lm_head_loss`), its logits
    soft-capped by ``model.final_logit_softcapping`` (0 but in Gemma).
    ``loss_sum(params, tokens, targets, cfg, shard, vocab_parallel, mask, segment_ids, positions)``:
    the summed next-token cross-entropy (nats, fp32 scalar) of int ``tokens``/``targets [b, t]``;
    with a ``mask [b, t]`` (1 = trained on) only the masked-in tokens count; ``dropout_key``: a PRNG
    key for ``model.lora.dropout`` in a training step (passed on to ``hidden_states``)."""

    def head_loss(params: dict, h: jax.Array, targets: jax.Array, cfg, shard: Sharder = no_shard,
                  mask: jax.Array | None = None) -> jax.Array:
        return lm_head_loss(h, head_weight(params, cfg), targets, cfg.vocab_size, shard, cfg.loss_chunk_tokens, mask,
                            chunk_vocab=cfg.loss_chunk_vocab, softcap=cfg.final_logit_softcapping)

    def loss_sum(params: dict, tokens: jax.Array, targets: jax.Array, cfg, shard: Sharder = no_shard,
                 vocab_parallel: bool = False, mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
        extra = {} if dropout_key is None else {"dropout_key": dropout_key}  # LoRA's dropout, in training
        h = hidden_states(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions, **extra)
        return head_loss(params, h, targets, cfg, shard, mask)

    head_loss.__doc__ = loss_sum.__doc__ = lm_loss.__doc__
    return head_loss, loss_sum


def padded_vocab_size(cfg: ModelConfig, tp: int = 1) -> int:
    """Vocabulary padded up to a multiple of ``vocab_pad_multiple * tp`` (Colossal-AI pads to
    64·tp). Padded rows are initialised to zero, never looked up, and never predicted: their
    logits are masked to -1e30."""
    mult = cfg.vocab_pad_multiple * tp
    return int(math.ceil(cfg.vocab_size / mult) * mult)


def init_vocab_padded(init_leaf: Callable, key: jax.Array, name: str, shape: tuple, axes: tuple,
                      cfg: ModelConfig) -> jax.Array:
    """``init_leaf(key, name, shape, cfg)``, except that a parameter with a ``vocab`` axis is
    drawn at its unpadded size ``cfg.vocab_size`` on that axis and zero-padded to ``shape``.

    So ``embed_tokens [v, d]`` is ``[vocab_size, d]`` random rows then ``v - vocab_size`` zero
    rows (``lm_head [d, v]``: zero columns), and the real rows take the same values whatever
    ``v`` is, i.e. whatever ``tp`` and ``vocab_pad_multiple`` are; the padding is zero as in a
    Hugging Face import (:mod:`jaxcolossal.models.hf_io`).
    """
    if "vocab" not in axes:
        return init_leaf(key, name, shape, cfg)
    i = axes.index("vocab")
    real = cfg.vocab_size
    x = init_leaf(key, name, (*shape[:i], real, *shape[i + 1:]), cfg)
    pad = [(0, 0)] * len(shape)
    pad[i] = (0, shape[i] - real)
    return jnp.pad(x, pad)

