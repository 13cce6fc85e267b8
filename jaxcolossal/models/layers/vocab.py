"""The vocabulary ends of a language model: the input embedding and the LM head + cross-entropy.

Both ends cost memory or FLOPs that grow with the vocabulary ``v`` (128256 for LLaMA-3), so they
live here, shared by every model family and by the pipeline's first and last stages:

* :func:`embed_lookup` — the token embedding. With the vocabulary sharded over ``tp`` it is
  Megatron's ``VocabParallelEmbedding`` (Shoeybi et al., 2019): each tp rank gathers the ids that
  fall in its vocabulary range from its local shard, zeroes the others, and the partial rows are
  summed over tp (one all-reduce of ``[b, t, d]``). Its gradient is a scatter-add into the local
  shard only. No one-hot tensor, no ``2·T·v·d/tp`` matmul FLOPs (``model.embedding_impl=one_hot``
  keeps that older formulation for comparison).
* :func:`lm_head_loss` — the LM-head matmul fused with the cross-entropy over chunks of tokens
  (Wijmans et al., 2024, *Cut Your Losses in Large-Vocabulary Language Models*; the Liger
  kernel's fused linear cross-entropy; Megatron's vocab-parallel cross-entropy). A ``lax.scan``
  runs over chunks of ``model.loss_chunk_tokens`` tokens per device; each chunk's fp32 logits
  ``[chunk, v/tp]`` exist only inside one iteration. Under differentiation the forward pass also
  computes the chunk's gradients (``softmax - onehot``) and contracts them at once into
  ``dh [b, t, d]`` and ``dW [d, v]`` (a ``jax.custom_vjp``), so the backward recomputes nothing
  and the head costs exactly the ``6·T·v·d`` FLOPs of the unfused step.
  ``model.loss_chunk_tokens=0`` materializes all logits (the unfused reference path).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxcolossal.config import ModelConfig
from jaxcolossal.models.layers.linear import project, take_rows

Sharder = Callable[[jax.Array, tuple], jax.Array]

PAD_LOGIT = -1e30
"""Logit given to the padded vocabulary columns (``vocab_pad_multiple``): softmax weight 0."""


def no_shard(x, axes):
    return x


def vocab_shards(shard: Sharder) -> int:
    """How many ways ``shard``'s rules split the ``vocab`` axis (1 without a mesh)."""
    size = getattr(shard, "axis_size", None)
    return size("vocab") if size is not None else 1


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


def logits(h: jax.Array, w: jax.Array, vocab_size: int, shard: Sharder = no_shard) -> jax.Array:
    """fp32 logits ``[b, t, v]`` of hidden ``h [b, t, d]`` and head ``w [d, v]`` (sharded on ``vocab``);
    the padded columns ``>= vocab_size`` are :data:`PAD_LOGIT`."""
    out = shard(jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32), ("batch", "seq", "vocab"))
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


def chunk_positions(batch: int, seq: int, chunk_tokens: int) -> int:
    """Sequence positions per chunk: ``chunk_tokens`` tokens spread over ``batch`` rows, in ``[1, seq]``."""
    return max(1, min(seq, math.ceil(chunk_tokens / max(batch, 1))))


def fused_pays(tokens: int, hidden: int, chunk_tokens: int) -> bool:
    """Whether the fused, chunked head needs less memory than the full logits, for ``tokens``
    tokens per device.

    In rows of ``v/tp`` fp32 values: the full path holds the logits and their gradient
    (``2·tokens``); the fused one holds the fp32 ``dW`` (``hidden``) and one chunk's logits,
    exponentials and gradient (``3·chunk_tokens``). So the fused path is taken when
    ``2·tokens > hidden + 3·chunk_tokens`` (the compiled temporaries in ``scripts/lean_step.py``
    agree: at 2048 tokens, hidden 2048 and chunks of 1024 the fused step was larger).
    """
    return chunk_tokens > 0 and 2 * tokens > hidden + 3 * chunk_tokens


def lm_head_loss(h: jax.Array, w: jax.Array, targets: jax.Array, vocab_size: int, shard: Sharder = no_shard,
                 chunk_tokens: int = 0, mask: jax.Array | None = None, force_fused: bool = False) -> jax.Array:
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
        force_fused: take the fused path whenever ``chunk_tokens > 0``, even where
            :func:`fused_pays` says it costs more memory (tests and measurements).

    Returns the sum, not the mean: the train step divides by the tokens of the whole step. The
    gradient with respect to ``h`` is cast to ``h``'s dtype only after the incoming cotangent (the
    fp16 loss scale) has multiplied it, so small gradients do not underflow.
    """
    b, t, d = h.shape
    rows = b // batch_shards(shard, b)  # a device's rows: the chunks are sized per device
    if chunk_tokens <= 0 or not (force_fused or fused_pays(rows * t, d, chunk_tokens)):
        return cross_entropy_sum(logits(h, w, vocab_size, shard), targets, mask)
    c = chunk_positions(rows, t, chunk_tokens)
    n = math.ceil(t / c)
    valid = jnp.ones((b, t), jnp.float32) if mask is None else mask.astype(jnp.float32)
    if n * c != t:  # pad the sequence to whole chunks; padded positions have weight 0
        pad = ((0, 0), (0, n * c - t))
        h = jnp.pad(h, pad + ((0, 0),))
        targets = jnp.pad(targets, pad)
        valid = jnp.pad(valid, pad)

    def to_chunks(a):  # [b, n*c, ...] -> [n, b, c, ...]: the batch dim keeps its sharding
        return jnp.moveaxis(a.reshape((b, n, c) + a.shape[2:]), 1, 0)

    return _fused_loss(shard, vocab_size)(to_chunks(h), w, to_chunks(targets), to_chunks(valid))


def batch_shards(shard: Sharder, b: int) -> int:
    """How many ways ``shard``'s rules split a batch of ``b`` rows (1 when they do not divide it)."""
    size = getattr(shard, "axis_size", None)
    n = size("batch") if size is not None else 1
    return n if n > 1 and b % n == 0 else 1


def _zeros_varying_like(shape, dtype, *refs) -> jax.Array:
    """Zeros that vary over the same manual mesh axes as ``refs`` (inside ``shard_map``, e.g. the
    pipeline's stages), so that a ``lax.scan`` carry keeps one type; plain zeros elsewhere."""
    z = jnp.zeros(shape, dtype)
    axes = set()
    for r in refs:
        aval = jax.typeof(r)
        mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; other releases expose ``aval.vma``
        axes |= set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())
    if not axes:
        return z
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(z, tuple(sorted(axes)), to="varying")
    return jax.lax.pvary(z, tuple(sorted(axes)))


def _fused_loss(shard: Sharder, vocab_size: int):
    """The chunked loss as a ``custom_vjp`` over ``(h_chunks [n,b,c,d], w, targets [n,b,c], valid)``.

    The forward rule saves ``dh [n,b,c,d]`` and ``dW [d,v]`` in fp32 (the gradient of the summed
    loss); the backward rule only scales them by the incoming cotangent and casts them to the
    inputs' dtypes (carried as empty arrays, since residuals must be arrays). The logits'
    gradient ``softmax - onehot`` (values in [-1, 1]) is formed in fp32 and cast to the compute
    dtype for its two matmuls, which accumulate in fp32, as Liger's fused linear cross-entropy does.
    """

    def chunk_loss(hc, w, yc, vc):
        lg = logits(hc, w, vocab_size, shard)
        lse = jax.nn.logsumexp(lg, axis=-1)
        col = jax.lax.broadcasted_iota(jnp.int32, lg.shape, 2)
        picked = jnp.sum(jnp.where(col == yc[..., None], lg, 0.0), axis=-1)
        return lg, lse, col, jnp.sum((lse - picked) * vc)

    def primal(hs, w, ys, vs):
        w = shard(w, ("embed", "vocab"))  # ZeRO-3: gathered once, not in every chunk

        def body(acc, xs):
            hc, yc, vc = xs
            return acc + chunk_loss(hc, w, yc, vc)[3], None
        loss, _ = jax.lax.scan(body, _zeros_varying_like((), jnp.float32, hs, w, ys, vs), (hs, ys, vs))
        return loss

    @jax.custom_vjp
    def fused(hs, w, ys, vs):
        return primal(hs, w, ys, vs)

    def fwd(hs, w, ys, vs):
        w_in = w
        w = shard(w, ("embed", "vocab"))  # ZeRO-3: gathered once, not in every chunk
        nb = batch_shards(shard, hs.shape[1])

        def per_shard(a):  # [b, ...] -> [nb, b/nb, ...]
            return a.reshape((nb, a.shape[0] // nb) + a.shape[1:])

        def body(carry, xs):
            acc, dw = carry
            hc, yc, vc = xs
            lg, lse, col, loss = chunk_loss(hc, w, yc, vc)
            # d loss / d logits = (softmax - onehot(target)) · weight, in fp32
            dlg = (jnp.exp(lg - lse[..., None]) - (col == yc[..., None])) * vc[..., None]
            dlg = shard(dlg.astype(hc.dtype), ("batch", "seq", "vocab"))
            dh = shard(jnp.einsum("bcv,dv->bcd", dlg, w, preferred_element_type=jnp.float32),
                       ("batch", "seq", "embed"))
            # each data shard sums its own rows' dW: no reduction inside the loop, one after it
            dw = dw + shard(jnp.einsum("nbcd,nbcv->ndv", per_shard(hc), per_shard(dlg),
                                       preferred_element_type=jnp.float32), ("batch", "embed", "vocab"))
            return (acc + loss, dw), dh
        dw0 = shard(_zeros_varying_like((nb,) + w.shape, jnp.float32, hs, w, ys, vs), ("batch", "embed", "vocab"))
        loss0 = _zeros_varying_like((), jnp.float32, hs, w, ys, vs)
        (loss, dw), dh = jax.lax.scan(body, (loss0, dw0), (hs, ys, vs))
        dw = shard(jnp.sum(dw, axis=0), ("embed", "vocab"))
        return loss, (dh, dw, jnp.zeros((0,), hs.dtype), jnp.zeros((0,), w_in.dtype))

    def bwd(res, g):
        dh, dw, h_like, w_like = res
        return (dh * g).astype(h_like.dtype), (dw * g).astype(w_like.dtype), None, None

    fused.defvjp(fwd, bwd)
    return fused


def lm_loss(hidden_states: Callable, head_weight: Callable) -> tuple[Callable, Callable]:
    """A family's ``(head_loss, loss_sum)`` from its ``hidden_states(params, tokens, cfg, shard,
    vocab_parallel, segment_ids, positions) -> [b, t, d]`` and ``head_weight(params, cfg) -> [d, v]``.

    ``head_loss(params, h, targets, cfg, shard, mask=None)``: the summed cross-entropy of final
    hidden states ``h [b, t, d]`` through the fused, chunked LM head (:func:`lm_head_loss`).
    ``loss_sum(params, tokens, targets, cfg, shard, vocab_parallel, mask, segment_ids, positions)``:
    the summed next-token cross-entropy (nats, fp32 scalar) of int ``tokens``/``targets [b, t]``;
    with a ``mask [b, t]`` (1 = trained on) only the masked-in tokens count; ``dropout_key``: a PRNG
    key for ``model.lora.dropout`` in a training step (passed on to ``hidden_states``)."""

    def head_loss(params: dict, h: jax.Array, targets: jax.Array, cfg, shard: Sharder = no_shard,
                  mask: jax.Array | None = None) -> jax.Array:
        return lm_head_loss(h, head_weight(params, cfg), targets, cfg.vocab_size, shard, cfg.loss_chunk_tokens, mask)

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

