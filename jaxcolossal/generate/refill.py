"""Continuous batching over the static KV cache: a generation batch of ``Q`` prompts decoded in ``S ≤ Q``
slots, each slot taking the next queued prompt as soon as its row ends (an eos id or ``max_new_tokens``),
all in one jitted ``lax.while_loop`` (:func:`refill_loop`; :func:`jaxcolossal.generate.make_generator`'s
``slots``).

After Orca's iteration-level scheduling (Yu, Jeong, Kim, Kim and Chun, 2022, "Orca: a distributed serving
system for transformer-based generative models", OSDI) as vLLM runs it (Kwon et al., 2023), without the
paged cache: the cache stays ``[L, S, P + max_new, ...]`` and a slot's row is rewritten whole when a prompt
is admitted. Each loop iteration (1) decodes one token in every slot, each row at its own cache column
(``P + step − 1``: the per-row ``index`` of the families' ``forward_cached``,
:func:`~jaxcolossal.models.layers.attention.write_slots`) and position, then (2) admits queued prompts into
the slots whose rows ended, one 1-row prefill each (an inner ``while_loop``): the prompt left-padded to the
batch's width ``P`` in the slot's columns ``[0, P)``, its ``kv_valid`` row reset, its position, step count
and first token set. A row sees exactly the cache, mask and positions it has in the static batch (the same
columns, the same left padding), so greedy completions are the static batch's: refill changes scheduling
only. Stale columns of a slot's previous row are zeros after the rewrite and masked until written.

Limits: the admitted prompt's prefill runs with the batch replicated (``Sharder.inner``: one row cannot be
split over the data axes) and is written into the slot's row with a ``dynamic_update_slice`` that XLA
partitions over the data axes; with sampling (not greedy) the random keys differ from the static batch's, so
the completions are other samples of the same distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcolossal.generate.sampling import Sampling, next_token


def _eos_hit(tok: jax.Array, eos: tuple[int, ...]) -> jax.Array:
    """bool like ``tok``: the token is one of the ``eos`` ids (none: never)."""
    if not eos:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos, jnp.int32))


def _batch_axis(axes: tuple) -> int:
    """The position of ``"batch"`` in a cache leaf's logical axes."""
    return list(axes).index("batch")


def _admit_one(family, cfg, params, s: dict, tokens, mask, max_new: int, sampling: Sampling,
               eos: tuple[int, ...], dtype, shard) -> dict:
    """Admit prompt ``s["next"]`` (of ``tokens``/``mask`` int32/bool ``[Q, P]``) into the first free slot:
    a 1-row prefill into a fresh row of ``P + max_new`` columns (replicated over the data axes), written
    over the slot's cache row; its first token sampled into ``out[next, 0]``. Returns the new state."""
    width = tokens.shape[1]
    total = width + max_new
    r = jnp.argmax(~s["live"]).astype(jnp.int32)  # the first free slot
    q = s["next"]
    row_tok = jax.lax.dynamic_slice_in_dim(tokens, q, 1, axis=0)    # [1, P]
    row_mask = jax.lax.dynamic_slice_in_dim(mask, q, 1, axis=0)     # [1, P]
    positions = jnp.maximum(jnp.cumsum(row_mask, axis=1) - 1, 0).astype(jnp.int32)
    valid = jnp.zeros((1, total), bool).at[:, :width].set(row_mask)
    fresh = family.init_cache(cfg, 1, total, dtype)
    logits, fresh = family.forward_cached(params, row_tok, fresh, jnp.int32(0), positions, valid, cfg,
                                          shard.inner(), last_only=True)
    axes = family.cache_axes(cfg)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    cache = jax.tree.map(lambda c, n, a: shard(jax.lax.dynamic_update_slice_in_dim(c, n, r, axis=_batch_axis(a)), a),
                         s["cache"], fresh, axes, is_leaf=is_axes)
    key, sub = jax.random.split(s["key"])
    tok = next_token(logits[:, 0, : cfg.vocab_size], sub, sampling)[0]
    ended = _eos_hit(tok, eos) | (max_new == 1)
    return dict(s, cache=cache, key=key, next=q + 1,
                kv_valid=jax.lax.dynamic_update_slice_in_dim(s["kv_valid"], valid, r, axis=0),
                pos=s["pos"].at[r].set(jnp.sum(row_mask).astype(jnp.int32)), tok=s["tok"].at[r].set(tok),
                step=s["step"].at[r].set(1), row=s["row"].at[r].set(q), live=s["live"].at[r].set(~ended),
                out=s["out"].at[q, 0].set(tok), lengths=s["lengths"].at[q].set(1))


def _admit(family, cfg, params, s: dict, tokens, mask, max_new: int, sampling: Sampling,
           eos: tuple[int, ...], dtype, shard) -> dict:
    """Admit queued prompts while a slot is free and the queue is not empty (a ``lax.while_loop``)."""
    n = tokens.shape[0]
    return jax.lax.while_loop(
        lambda s: jnp.any(~s["live"]) & (s["next"] < n),
        lambda s: _admit_one(family, cfg, params, s, tokens, mask, max_new, sampling, eos, dtype, shard), s)


def _decode(family, cfg, params, s: dict, width: int, max_new: int, sampling: Sampling, eos: tuple[int, ...],
            pad_id: int, shard) -> dict:
    """One decode step for every slot, each row at its own cache column ``width + step − 1`` (the slot of
    the token sampled last) and position; the new tokens go to ``out[row, step]`` of the live slots."""
    n = s["out"].shape[0]
    live = s["live"]
    index = (width + s["step"] - 1).astype(jnp.int32)  # [S]
    kv_valid = s["kv_valid"] | (jnp.arange(s["kv_valid"].shape[1]) == index[:, None])
    logits, cache = family.forward_cached(params, s["tok"][:, None], s["cache"], index, s["pos"][:, None],
                                          kv_valid, cfg, shard)
    key, sub = jax.random.split(s["key"])
    tok = jnp.where(live, next_token(logits[:, 0, : cfg.vocab_size], sub, sampling), pad_id)
    dest = jnp.where(live, s["row"], n)  # rows out of range: dropped
    step = s["step"] + live.astype(jnp.int32)
    return dict(s, cache=cache, kv_valid=kv_valid, key=key, tok=tok, pos=s["pos"] + 1, step=step,
                out=s["out"].at[dest, s["step"]].set(tok, mode="drop"),
                lengths=s["lengths"].at[dest].set(step, mode="drop"),
                live=live & ~_eos_hit(tok, eos) & (step < max_new), steps=s["steps"] + 1)


def refill_loop(family, cfg, params, tokens: jax.Array, mask: jax.Array, key: jax.Array, slots: int, max_new: int,
                sampling: Sampling, eos: tuple[int, ...], pad_id: int, dtype, shard) -> tuple:
    """Decode the prompts ``tokens``/``mask`` (int32/bool ``[Q, P]``, left-padded) in ``slots`` cache rows
    with refill (module doc). Traced inside :func:`jaxcolossal.generate.make_generator`'s jitted program.

    Returns ``(out int32 [Q, max_new], lengths int32 [Q], steps int32)``: each prompt's tokens in the queue's
    order (``pad_id`` after its end) and how many it generated (its eos included), as the static batch's;
    ``steps`` the decode steps run (slot utilisation: ``Σ (lengths − 1) / (slots · steps)``, the first token
    of a row coming from its prefill)."""
    n, width = tokens.shape
    cache = family.init_cache(cfg, slots, width + max_new, dtype)
    cache = jax.tree.map(lambda c, a: shard(c, a), cache, family.cache_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    zeros = jnp.zeros((slots,), jnp.int32)
    s = dict(cache=cache, kv_valid=jnp.zeros((slots, width + max_new), bool), key=key, next=jnp.int32(0),
             pos=zeros, tok=zeros, step=zeros, row=zeros, live=jnp.zeros((slots,), bool), steps=jnp.int32(0),
             out=jnp.full((n, max_new), pad_id, jnp.int32), lengths=jnp.zeros((n,), jnp.int32))
    args = (tokens, mask, max_new, sampling, eos, dtype, shard)
    s = _admit(family, cfg, params, s, *args)

    def body(s):
        s = _decode(family, cfg, params, s, width, max_new, sampling, eos, pad_id, shard)
        return _admit(family, cfg, params, s, *args)

    s = jax.lax.while_loop(lambda s: jnp.any(s["live"]), body, s)
    return s["out"], s["lengths"], s["steps"]
