"""Batched, KV-cached generation for any family with a decode path (``Family.forward_cached``):
one prefill of the left-padded prompts, then the decode steps in a ``lax.while_loop``, all in one
jitted program (no host round-trip per token), optionally on the training mesh.

Semantics follow Hugging Face transformers' ``generate``: prompts left-padded with an
``attention_mask``, each row's positions counted from its first real token, the pads never attended
to; greedy or sampled (:mod:`jaxcolossal.generate.sampling`); a row stops at ``eos_id`` (one id, or a
list of them: a row stops at any, as ``generation_config.json``'s ``eos_token_id: [128001, 128008,
128009]`` makes LLaMA 3 stop) and is filled with ``pad_id`` after it; the loop ends when every row has
stopped or at ``max_new_tokens``. On a mesh, a batch that the data axes do not divide is padded with
one-token rows that are dropped from the result (:func:`generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.generate.eos import EosIds, eos_ids
from jaxcolossal.generate.refill import refill_loop
from jaxcolossal.generate.sampling import Sampling, next_token
from jaxcolossal.models import param_layout
from jaxcolossal.models.layers.decode_attention import kernel_choice
from jaxcolossal.parallel.layer_scan import fetch_layer
from jaxcolossal.parallel.sharding import RULES, Sharder, entry_axes, logical_to_spec, state_specs


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists of different lengths: ``(tokens int32 [b, P], mask bool [b, P])``, ``P``
    the longest prompt.

    Raises:
        ValueError: no prompts, or an empty one.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generation needs at least one prompt, each of at least one token")
    width = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
        mask[i, width - len(p):] = True
    return tokens, mask


def left_align(tokens: np.ndarray, mask: np.ndarray, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Padded prompts ``[b, P]`` with their ``mask`` (right- or left-padded) as left-padded ones (what
    the sampler takes): each row's masked-in tokens, in order, moved to the right end."""
    tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
    return pad_prompts([row[m] for row, m in zip(tokens, mask)], pad_id)


@dataclass(frozen=True)
class Generated:
    """What :func:`generate` returns: ``tokens`` int32 ``[b, max_new_tokens]`` (``pad_id`` after a row's
    end) and ``lengths`` int ``[b]``, the tokens each row generated (its eos included)."""

    tokens: np.ndarray
    lengths: np.ndarray
    decode_steps: int | None = None
    """The decode steps the loop ran (after the prefill's first token)."""
    slots: int | None = None
    """The cache rows decoded at once: the batch (static), or ``make_generator``'s ``slots`` (refill)."""

    @property
    def utilisation(self) -> float:
        """Decode-slot utilisation: the share of the slot-steps that decoded a live row,
        ``Σ (lengths − 1) / (slots · decode_steps)`` (1.0 when no decode step ran)."""
        if not self.decode_steps:
            return 1.0
        return float(np.sum(self.lengths - 1)) / (self.slots * self.decode_steps)

    def rows(self) -> list[list[int]]:
        """Each row's generated tokens, up to and including its eos."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def _prefill(family, cfg, params, tokens, mask, total: int, dtype, shard) -> tuple:
    """Phase 1: the prompts' forward into an empty cache of ``total`` slots. Returns the last
    position's logits ``[b, v_padded]``, the cache, the slots' validity ``[b, total]`` and each row's next
    position ``[b]``."""
    b, width = tokens.shape
    cache = family.init_cache(cfg, b, total, dtype)
    cache = jax.tree.map(lambda c, a: shard(c, a), cache, family.cache_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
    kv_valid = jnp.zeros((b, total), bool).at[:, :width].set(mask)
    logits, cache = family.forward_cached(params, tokens, cache, jnp.int32(0), positions, kv_valid, cfg, shard,
                                          last_only=True)
    return logits[:, 0], cache, kv_valid, jnp.sum(mask, axis=1).astype(jnp.int32)


def _decode_loop(family, cfg, params, state: dict, width: int, max_new: int, sampling: Sampling,
                 eos: tuple[int, ...], pad_id: int, shard) -> dict:
    """Phase 2: the decode steps as a ``lax.while_loop``. ``state``: ``i`` (tokens generated), ``tok``
    (the last ones ``[b]``), ``out [b, max_new]``, ``done [b]``, ``cache``, ``kv_valid``, ``pos [b]``, ``key``."""

    def cond(s):
        return (s["i"] < max_new) & ~jnp.all(s["done"])

    def body(s):
        slot = width + s["i"] - 1  # the slot of the token sampled last
        kv_valid = s["kv_valid"].at[:, slot].set(True)
        logits, cache = family.forward_cached(params, s["tok"][:, None], s["cache"], slot, s["pos"][:, None],
                                              kv_valid, cfg, shard)
        key, sub = jax.random.split(s["key"])
        tok, done = _choose(logits[:, 0, : cfg.vocab_size], sub, sampling, s["done"], eos, pad_id)
        return dict(i=s["i"] + 1, tok=tok, out=s["out"].at[:, s["i"]].set(tok), done=done, cache=cache,
                    kv_valid=kv_valid, pos=s["pos"] + 1, key=key)

    return jax.lax.while_loop(cond, body, state)


def _choose(logits, key, sampling: Sampling, done, eos: tuple[int, ...], pad_id) -> tuple[jax.Array, jax.Array]:
    """The next tokens int32 ``[b]`` (``pad_id`` for a row already done) and the rows done after them
    (bool ``[b]``): a row is done once its token is any of the ``eos`` ids (none: never)."""
    tok = jnp.where(done, pad_id, next_token(logits, key, sampling))
    if eos:
        done = done | jnp.isin(tok, jnp.asarray(eos, jnp.int32))
    return tok, done


def make_generator(family, cfg, max_new_tokens: int, sampling: Sampling = Sampling(greedy=True),
                   eos_id: EosIds = None, pad_id: int = 0, mesh: Mesh | None = None,
                   param_specs: Any = None, dtype=None, rules=RULES, fp8: bool = False,
                   decode_kernel: bool | None = None, slots: int | None = None, stats: bool = False) -> Callable:
    """A jitted ``(params, tokens [b, P], mask [b, P], key) -> (out int32 [b, max_new_tokens], lengths
    int32 [b])`` for left-padded prompts (:func:`pad_prompts`): the prefill, then the decode loop.
    ``stats``: a third output, the decode steps run (int32 scalar; :attr:`Generated.utilisation`).

    ``slots``: decode the ``b`` prompts in that many cache rows with refill (continuous batching,
    :mod:`jaxcolossal.generate.refill`): a slot whose row ended takes the next prompt, in the same loop.
    ``None`` or ``≥ b``: one static batch (every row decodes until the last one ends). Greedy completions are
    the same either way. On a mesh the data axes must divide ``slots`` (:func:`generate` rounds it up).
    ``eos_id``: the end-of-text id, or a list of them (a row stops at the first token that is any of
    them; transformers' ``generate`` with a list ``eos_token_id``), or None (never stop early).

    On a ``mesh`` the params come in with ``param_specs`` (the training layout: tp, ZeRO-3's fsdp; a
    tree of ``PartitionSpec``), the prompts and outputs with the batch over the data axes, and the
    cache is constrained to the family's ``cache_axes`` by the rules (kv heads over tp, batch over the
    data axes). The cache is in ``dtype`` (``None``: the embedding's dtype, the compute dtype).
    ``fp8``: the projections multiply in FP8, as a ``precision.fp8`` run trains.

    ``decode_kernel``: the decode steps' attention as the Pallas flash-decoding kernel
    (:mod:`jaxcolossal.models.layers.decode_attention`; the prefill always runs XLA's attention).
    ``None`` (default): on for a GPU mesh, off on any other; without a mesh, decided when lowering
    (the kernel for CUDA). ``True``: the kernel (Triton on GPUs, the Pallas interpreter elsewhere: for
    tests); ``False``: XLA's attention. Shapes the kernel does not take run XLA's attention either way
    (:func:`~jaxcolossal.models.layers.decode_attention.kernel_refusal`).

    Raises:
        ValueError: a family without a decode path, ``max_new_tokens < 1``, bad ``sampling``, an
            ``eos_id`` that is not an id (a non-negative int) or a list of them, or ``slots < 1``.
    """
    eos = eos_ids(eos_id)
    if slots is not None and slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if family.forward_cached is None:
        raise ValueError(f"model family {family.name!r} has no KV-cached decode path yet")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling.check()
    shard = Sharder(mesh, rules).with_fp8(fp8).with_decode_kernel(kernel_choice(decode_kernel, mesh))

    def run(params, tokens, mask, key):
        params = fetch_layer(params)  # offloaded (host-memory) params into device memory
        width = tokens.shape[1]
        if slots is not None and slots < tokens.shape[0]:
            out, lengths, steps = refill_loop(family, cfg, params, tokens, mask, key, slots, max_new_tokens, sampling,
                                              eos, pad_id, dtype or params[family.embedding].dtype, shard)
            return (out, lengths, steps) if stats else (out, lengths)
        logits, cache, kv_valid, pos = _prefill(family, cfg, params, tokens, mask, width + max_new_tokens,
                                                dtype or params[family.embedding].dtype, shard)
        key, sub = jax.random.split(key)
        done0 = jnp.zeros(tokens.shape[:1], bool)
        tok, done = _choose(logits[:, : cfg.vocab_size], sub, sampling, done0, eos, pad_id)
        out = jnp.full((tokens.shape[0], max_new_tokens), pad_id, jnp.int32).at[:, 0].set(tok)
        s = _decode_loop(family, cfg, params, dict(i=jnp.int32(1), tok=tok, out=out, done=done, cache=cache,
                                                   kv_valid=kv_valid, pos=pos, key=key), width, max_new_tokens,
                         sampling, eos, pad_id, shard)
        out, lengths = s["out"], _lengths(s["out"], eos, s["i"])
        return (out, lengths, s["i"] - 1) if stats else (out, lengths)

    if mesh is None:
        return jax.jit(run)
    batch = NamedSharding(mesh, logical_to_spec(("batch", None), rules))
    params_in = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs, is_leaf=lambda x: isinstance(x, P))
    outs = (batch, NamedSharding(mesh, logical_to_spec(("batch",), rules))) + (NamedSharding(mesh, P()),) * stats
    return jax.jit(run, in_shardings=(params_in, batch, batch, NamedSharding(mesh, P())), out_shardings=outs)


def training_param_specs(cfg, mesh: Mesh, zero_stage: int, rules=RULES) -> Any:
    """The ``PartitionSpec`` tree of the compute params as training lays them out on ``mesh`` (tp, and
    with ZeRO-3 the ``fsdp`` shards: :func:`jaxcolossal.parallel.sharding.state_specs`).

    Raises:
        ConfigError: a dimension that its mesh axes do not divide."""
    shape = {k: int(v) for k, v in mesh.shape.items()}
    _, shapes, axes = param_layout(cfg, shape["tp"])
    return state_specs(axes, shapes, zero_stage, shape, rules).params


def _lengths(out: jax.Array, eos: tuple[int, ...], steps: jax.Array) -> jax.Array:
    """Tokens generated per row, int32 ``[b]``: up to and including the first of any of the ``eos``
    ids, else all ``steps``."""
    if not eos:
        return jnp.full(out.shape[:1], steps, jnp.int32)
    hit = jnp.isin(out, jnp.asarray(eos, jnp.int32))
    first = jnp.argmax(hit, axis=1).astype(jnp.int32) + 1
    return jnp.where(jnp.any(hit, axis=1), first, steps)


def data_shards(mesh: Mesh | None, rules=RULES) -> int:
    """How many shards the batch dimension has on ``mesh``: the product of the sizes of the mesh axes
    that the rules' ``batch`` entry names (1 without a mesh)."""
    if mesh is None:
        return 1
    shape = dict(mesh.shape)
    entry = logical_to_spec(("batch",), rules)[0]
    return int(np.prod([shape[a] for a in entry_axes(entry)], dtype=np.int64))


def pad_batch(tokens: np.ndarray, mask: np.ndarray, multiple: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompts ``[b, P]`` and their ``mask`` with rows appended up to the next multiple of
    ``multiple``: each a one-token prompt (``pad_id`` at the last column, masked in, so that its
    attention has a real key), to be dropped from the result."""
    extra = -tokens.shape[0] % multiple
    if not extra:
        return tokens, mask
    rows = np.full((extra, tokens.shape[1]), pad_id, tokens.dtype)
    row_mask = np.zeros((extra, tokens.shape[1]), bool)
    row_mask[:, -1] = True
    return np.concatenate([tokens, rows]), np.concatenate([mask, row_mask])


def generate(family, cfg, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(greedy=True), eos_id: EosIds = None, pad_id: int = 0,
             seed: int = 0, mesh: Mesh | None = None, param_specs: Any = None, dtype=None,
             rules=RULES, fp8: bool = False, decode_kernel: bool | None = None, slots: int | None = None) -> Generated:
    """Generate up to ``max_new_tokens`` tokens after each of ``prompts`` (token lists of any lengths)
    with :func:`make_generator` (compiled on every call: reuse :func:`make_generator` to sample
    repeatedly). ``params``: the family's params (fp32 or the compute ``dtype``; on a ``mesh``, laid
    out as ``param_specs``). ``eos_id``: an id or a list of ids (any of them ends a row) or None.
    ``decode_kernel``: as :func:`make_generator`'s. ``slots``: decode in that many cache rows with refill
    (:func:`make_generator`; on a mesh rounded up to a multiple of :func:`data_shards`); the result's
    ``decode_steps`` and ``slots`` give the decode-slot utilisation (:attr:`Generated.utilisation`).

    On a ``mesh`` whose data axes do not divide the number of prompts, the batch is padded with
    one-token rows (:func:`pad_batch`) up to a multiple of :func:`data_shards`; they are dropped from
    the result, which has one row per prompt either way.

    Raises ValueError as :func:`pad_prompts` and :func:`make_generator`."""
    tokens, mask = pad_prompts(prompts, pad_id)
    shards = data_shards(mesh, rules)
    tokens, mask = pad_batch(tokens, mask, shards, pad_id)
    if slots is not None:
        slots = min(-(-slots // shards) * shards, tokens.shape[0])
    fn = make_generator(family, cfg, max_new_tokens, sampling, eos_id, pad_id, mesh, param_specs, dtype, rules, fp8,
                        decode_kernel, slots, stats=True)
    out, lengths, steps = fn(params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(seed))
    n = len(prompts)
    return Generated(np.asarray(out)[:n], np.asarray(lengths)[:n], int(steps), slots or tokens.shape[0])
