"""Gemma 2 and Gemma 3 text (Gemma Team, 2024/2025): RMSNorm ``x·(1 + w)`` before and after both
sub-blocks, a GeGLU MLP (tanh GELU), embeddings scaled by ``sqrt(hidden_size)``, the softmax scale
``query_pre_attn_scalar^-1/2``, local (sliding-window) and global layers, and, by the config, Gemma 2's
attention and final-logit soft-caps, Gemma 3's per-head q/k RMSNorm and its local layers' own RoPE
base. Follows transformers' ``models/gemma2/modeling_gemma2.py`` and ``models/gemma3/modeling_gemma3.py``.

The same interface as :mod:`jaxcolossal.models.llama` (:class:`jaxcolossal.models.family.Family`):
pure functions over a params dict (:func:`forward`, :func:`loss_sum`, :func:`forward_cached`) and the
NNX module :class:`GemmaForCausalLM`. The layers are stacked on ``layers`` and run by one ``lax.scan``;
what differs between a local and a global layer (its window, its RoPE table) is a per-layer constant
of the scan (:func:`layer_extras`). Shapes (b batch, t sequence, d hidden, h heads, k kv heads, q
head dim, f intermediate, v padded vocab, L layers)::

    embed_tokens        [v, d]        (vocab, embed)                    looked up, times sqrt(d)
    layers.attn_norm    [L, d]        (layers, embed)                   input_layernorm
    layers.wq           [L, d, h, q]  (layers, embed, heads, head_dim)  column-parallel
    layers.wk/wv        [L, d, k, q]  (layers, embed, kv_heads, head_dim)
    layers.q_norm/k_norm [L, q]       (layers, head_dim)                Gemma 3 (``model.qk_norm``)
    layers.wo           [L, h, q, d]  (layers, heads, head_dim, embed)  row-parallel
    layers.attn_post_norm [L, d]      (layers, embed)                   post_attention_layernorm
    layers.mlp_norm     [L, d]        (layers, embed)                   pre_feedforward_layernorm
    layers.w_gate/w_up  [L, d, f]     (layers, embed, mlp)              column-parallel
    layers.w_down       [L, f, d]     (layers, mlp, embed)              row-parallel
    layers.mlp_post_norm [L, d]       (layers, embed)                   post_feedforward_layernorm
    final_norm          [d]           (embed,)
    lm_head             [d, v]        (embed, vocab)   absent when tied (every Gemma checkpoint is)

Every norm scale ``w`` is applied as ``1 + w`` and starts at zero, as transformers initialises it.
The projections carry LLaMA's names and equations, so LoRA (:mod:`jaxcolossal.models.layers.lora`)
adapts them as it does LLaMA's. Initialisation: normal(0, ``initializer_range``), the residual output
projections (``wo``, ``w_down``) divided by ``sqrt(2L)`` as in the LLaMA family; the padded vocabulary
rows are zero (:func:`jaxcolossal.models.layers.vocab.init_vocab_padded`).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcolossal.config import ModelConfig, RopeConfig
from jaxcolossal.models.family import stacked_params
from jaxcolossal.models.layers import vocab
from jaxcolossal.models.layers.attention import attention, write_slots
from jaxcolossal.models.layers.decode_attention import attend_cache
from jaxcolossal.models.layers.linear import column_parallel, row_parallel, tp_overlaps
from jaxcolossal.models.layers.lora import DROPOUT_KEY, EQUATIONS, adapt
from jaxcolossal.models.layers.norm import rms_norm
from jaxcolossal.models.layers.rope import apply_rope, rope_tables
from jaxcolossal.models.layers.vocab import Sharder, embed_lookup, no_shard, padded_vocab_size
from jaxcolossal.parallel.layer_scan import fetch_layer, scan_layers, tag

NORMS = ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm")
"""The four norms of a block: before and after attention, before and after the MLP."""


def param_shapes_and_axes(cfg: ModelConfig, vocab: int) -> dict:
    """``{name: (shape, logical_axes)}`` for every parameter (the table in the module doc)."""
    L, d, h, k, q, f = (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim, cfg.intermediate_size)
    layers = {n: ((L, d), ("layers", "embed")) for n in NORMS}
    layers.update(wq=((L, d, h, q), ("layers", "embed", "heads", "head_dim")),
                  wk=((L, d, k, q), ("layers", "embed", "kv_heads", "head_dim")),
                  wv=((L, d, k, q), ("layers", "embed", "kv_heads", "head_dim")),
                  wo=((L, h, q, d), ("layers", "heads", "head_dim", "embed")),
                  w_gate=((L, d, f), ("layers", "embed", "mlp")), w_up=((L, d, f), ("layers", "embed", "mlp")),
                  w_down=((L, f, d), ("layers", "mlp", "embed")))
    if cfg.qk_norm:  # Gemma 3: an RMSNorm over each head of q and k
        layers.update(q_norm=((L, q), ("layers", "head_dim")), k_norm=((L, q), ("layers", "head_dim")))
    out = {"embed_tokens": ((vocab, d), ("vocab", "embed")), "layers": layers, "final_norm": ((d,), ("embed",))}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((d, vocab), ("embed", "vocab"))
    return out


def _init_leaf(key, name: str, shape, cfg: ModelConfig) -> jax.Array:
    if name.endswith("norm"):  # applied as 1 + w
        return jnp.zeros(shape, jnp.float32)
    std = cfg.initializer_range
    if name in ("wo", "w_down"):  # GPT-2 / Megatron scaled init of the residual projections
        std = std / math.sqrt(2 * cfg.num_layers)
    return std * jax.random.normal(key, shape, jnp.float32)


class GemmaForCausalLM(nnx.Module):
    """Gemma 2/3 decoder with a causal-LM head, as a Flax NNX module.

    Args:
        cfg: the model section of the config (``type=gemma``).
        rngs: ``nnx.Rngs`` for initialisation (module doc).
        tp: tensor-parallel size, only to pad the vocabulary
            (:func:`jaxcolossal.models.layers.vocab.padded_vocab_size`).

    Params are fp32 ``nnx.Param`` with logical ``axes`` metadata. ``__call__(tokens)`` maps int32
    ``[b, t]`` tokens to fp32 logits ``[b, t, vocab_size]`` (padding removed).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, tp: int = 1):
        self.cfg = cfg
        self.vocab = padded_vocab_size(cfg, tp)
        stacked_params(self, cfg, param_shapes_and_axes(cfg, self.vocab), rngs.params(), _init_leaf)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.cfg)[..., : self.cfg.vocab_size]


def init_params(cfg: ModelConfig, key: jax.Array, tp: int = 1) -> dict:
    """fp32 params (pure dict) of a fresh :class:`GemmaForCausalLM`; jit-able."""
    return nnx.to_pure_dict(nnx.state(GemmaForCausalLM(cfg, rngs=nnx.Rngs(params=key), tp=tp), nnx.Param))


# ----------------------------------------------------------------------------- per-layer constants


def _norm(x: jax.Array, scale: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma's RMSNorm: in fp32, times ``1 + scale``, cast back to ``x``'s dtype (transformers'
    ``Gemma2RMSNorm``/``Gemma3RMSNorm``)."""
    return rms_norm(x, scale, cfg.rms_norm_eps, offset=1.0)


def _local_rope(cfg: ModelConfig) -> tuple[bool, ...]:
    """Each layer's RoPE: True where it is Gemma 3's local one (a sliding layer with
    ``model.rope_local_theta`` set), False where it is ``model.rope`` with ``rope_theta``."""
    return tuple(bool(cfg.rope_local_theta) and k == "sliding_attention" for k in cfg.layer_kinds)


def layer_extras(cfg: ModelConfig, first: int, count: int) -> dict:
    """The per-layer constants of layers ``first .. first + count − 1`` for the layer scan
    (:func:`jaxcolossal.parallel.layer_scan.scan_layers`), where the layers differ: ``window``
    (int32 ``[count]``, 0: global) and ``local_rope`` (bool ``[count]``: the local RoPE table)."""
    out = {}
    windows, local = cfg.layer_windows[first:first + count], _local_rope(cfg)[first:first + count]
    if len(set(cfg.layer_windows)) > 1:
        out["window"] = jnp.asarray(windows, jnp.int32)
    if len(set(_local_rope(cfg))) > 1:
        out["local_rope"] = jnp.asarray(local, bool)
    return out


def rope_pair(t: int, cfg: ModelConfig, positions: jax.Array | None = None) -> tuple:
    """``(global, local)`` RoPE tables, each ``(cos, sin)`` ``[t, q]`` (``[b, t, q]`` with ``positions``):
    ``model.rope`` with ``rope_theta`` (Gemma 3's global layers: plain or ``linear``), and plain RoPE
    with ``rope_local_theta`` (its local layers), the same as the global one when that is 0 (Gemma 2)."""
    glob = rope_tables(t, cfg, positions)
    if not cfg.rope_local_theta:
        return glob, glob
    plain = dataclasses.replace(cfg, rope=RopeConfig())
    return glob, rope_tables(t, plain, positions, theta=cfg.rope_local_theta)


def layer_rope(lp: dict, cfg: ModelConfig, tables: tuple) -> tuple[jax.Array, jax.Array]:
    """This layer's ``(cos, sin)`` of :func:`rope_pair`'s ``tables``: chosen by the per-layer constant
    ``lp["local_rope"]`` when the layers differ (:func:`layer_extras`), else the one every layer uses."""
    (cg, sg), (cl, sl) = tables
    if "local_rope" in lp:
        return jnp.where(lp["local_rope"], cl, cg), jnp.where(lp["local_rope"], sl, sg)
    return (cl, sl) if any(_local_rope(cfg)) else (cg, sg)


def layer_window(lp: dict, cfg: ModelConfig):
    """This layer's attention window: ``lp["window"]`` when the layers differ, else the one window
    of every layer (a Python int; 0: global attention)."""
    return lp["window"] if "window" in lp else max(cfg.layer_windows, default=0)


def attention_options(lp: dict, cfg: ModelConfig) -> dict:
    """The options of :func:`jaxcolossal.models.layers.attention.local_attention` that this model sets:
    the ``window``, the softmax ``scale`` ``query_pre_attn_scalar^-1/2`` and Gemma 2's score ``softcap``
    (each only when set, so that a plain configuration keeps the fused kernels)."""
    out = {}
    if any(cfg.layer_windows):
        out["window"] = layer_window(lp, cfg)
    if cfg.query_pre_attn_scalar:
        out["scale"] = cfg.attention_scale
    if cfg.attn_logit_softcapping:
        out["softcap"] = cfg.attn_logit_softcapping
    return out


# ----------------------------------------------------------------------------- the block


def project_qkv(x: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard) -> tuple:
    """The first phase of the attention half: the input norm, the q/k/v projections (with LoRA),
    Gemma 3's per-head q/k norm and RoPE. x ``[b, t, d]`` -> q ``[b, t, h, q]``, k/v ``[b, t, k, q]``
    (compute dtype)."""
    column = partial(column_parallel, shard, tp_overlaps(shard, x.shape[1]))
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    h = _norm(x, lp["attn_norm"], cfg)
    q, k, v = column(h, [("btd,dhq->bthq", lp["wq"], "h"), ("btd,dkq->btkq", lp["wk"], "k"),
                         ("btd,dkq->btkq", lp["wv"], "k")])
    q, k, v = (lora(EQUATIONS[n], h, y, name=n) for n, y in (("wq", q), ("wk", k), ("wv", v)))
    q = tag(shard(q, ("batch", "seq", "heads", "head_dim")), "query_proj")
    k = tag(shard(k, ("batch", "seq", "kv_heads", "head_dim")), "key_proj")
    v = tag(shard(v, ("batch", "seq", "kv_heads", "head_dim")), "value_proj")
    if "q_norm" in lp:  # Gemma 3, before RoPE
        q, k = _norm(q, lp["q_norm"], cfg), _norm(k, lp["k_norm"], cfg)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(x: jax.Array, a: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """The last phase of the attention half: the output projection of the attended values ``a [b, t,
    h, q]`` (with LoRA), its post-norm, added to the residual ``x [b, t, d]`` -> ``[b, t, d]``."""
    row = partial(row_parallel, shard, tp_overlaps(shard, x.shape[1]))
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    a = shard(a, ("batch", "seq", "heads", "head_dim"))
    o = tag(lora(EQUATIONS["wo"], a, row("bthq,hqd->btd", a, lp["wo"], "h"), name="wo"), "out_proj")
    return shard(x + _norm(o, lp["attn_post_norm"], cfg), ("batch", "seq", "embed"))


def mlp_block(x: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """The GeGLU half with its sandwich norms and residual: ``x + post(down(gelu_tanh(gate(n)) · up(n)))``
    with ``n = pre(x)``. x ``[b, t, d]`` -> ``[b, t, d]``."""
    overlap = tp_overlaps(shard, x.shape[1])
    column, row = partial(column_parallel, shard, overlap), partial(row_parallel, shard, overlap)
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    h = _norm(x, lp["mlp_norm"], cfg)
    g, u = column(h, [("btd,df->btf", lp["w_gate"], "f"), ("btd,df->btf", lp["w_up"], "f")])
    g, u = lora(EQUATIONS["w_gate"], h, g, name="w_gate"), lora(EQUATIONS["w_up"], h, u, name="w_up")
    g = tag(shard(g, ("batch", "seq", "mlp")), "mlp_gate")
    u = tag(shard(u, ("batch", "seq", "mlp")), "mlp_up")
    act = jax.nn.gelu(g, approximate=True) * u  # transformers' gelu_pytorch_tanh
    y = tag(lora(EQUATIONS["w_down"], act, row("btf,fd->btd", act, lp["w_down"], "f"), name="w_down"), "mlp_down")
    return shard(x + _norm(y, lp["mlp_post_norm"], cfg), ("batch", "seq", "embed"))


def decoder_layer(x: jax.Array, lp: dict, cfg: ModelConfig, tables: tuple, shard: Sharder = no_shard,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """One Gemma block: x ``[b, t, d]`` (compute dtype) -> ``[b, t, d]``; ``tables``: :func:`rope_pair`'s,
    ``lp``: the layer's params with its per-layer constants (:func:`layer_extras`)."""
    cos, sin = layer_rope(lp, cfg, tables)
    q, k, v = project_qkv(x, lp, cfg, cos, sin, shard)
    a = attention(q, k, v, cfg.attention_impl, segment_ids, shard, positions, **attention_options(lp, cfg))
    return mlp_block(attention_output(x, a, lp, cfg, shard), lp, cfg, shard)


def embed(table: jax.Array, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
          vocab_parallel: bool = False) -> jax.Array:
    """The scaled input embedding ``[b, t, d]``: the rows of ``tokens`` times ``sqrt(hidden_size)``,
    the factor cast to the table's dtype first as transformers does (``Gemma2TextScaledWordEmbedding``)."""
    x = embed_lookup(table, tokens, shard, vocab_parallel, cfg.embedding_impl)
    return shard(x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype), ("batch", "seq", "embed"))


def hidden_states(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                  vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
    """Final-norm hidden states ``[b, t, d]`` in the params' dtype for int ``tokens [b, t]``: the scaled
    embedding, the layers in one checkpointed ``lax.scan`` (``model.remat``), the final norm. Packed
    rows pass ``segment_ids`` and ``positions`` (int ``[b, t]``); ``dropout_key``: LoRA's dropout in a
    training step (one key per layer is split from it)."""
    layers = params["layers"]
    if dropout_key is not None and cfg.lora.dropout > 0:
        layers = {**layers, DROPOUT_KEY: jax.random.split(dropout_key, cfg.num_layers)}
    x = embed(params["embed_tokens"], tokens, cfg, shard, vocab_parallel)
    tables = rope_pair(tokens.shape[1], cfg, positions)

    def layer(h, lp):
        return decoder_layer(h, lp, cfg, tables, shard, segment_ids, positions)

    x = scan_layers(layer, x, layers, cfg.remat, shard, layer_extras(cfg, 0, cfg.num_layers))
    return _norm(x, params["final_norm"], cfg)


def head_weight(params: dict, cfg: ModelConfig) -> jax.Array:
    """The LM head ``[d, v]``: ``embed_tokens.T`` when tied (the unscaled embedding), else ``lm_head``."""
    return params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]


def logits_from_hidden(params: dict, h: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """fp32 logits ``[b, t, v]`` (padded vocab, sharded on ``vocab``), soft-capped by
    ``final_logit_softcapping``; padded columns are -1e30."""
    return vocab.logits(h, head_weight(params, cfg), cfg.vocab_size, shard, cfg.final_logit_softcapping)


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
            vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None) -> jax.Array:
    """Logits ``[b, t, v_padded]`` (fp32) for int ``tokens [b, t]``, as transformers'
    ``Gemma2ForCausalLM``/``Gemma3ForCausalLM`` compute them (packed rows: as :func:`hidden_states`)."""
    h = hidden_states(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions)
    return logits_from_hidden(params, h, cfg, shard)


head_loss, loss_sum = vocab.lm_loss(hidden_states, head_weight)


def loss_and_stats(params: dict, tokens: jax.Array, targets: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                   vocab_parallel: bool = False, mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """``(loss_sum, {})``: the summed next-token cross-entropy (nats, fp32 scalar) of the soft-capped
    logits (:func:`loss_sum`); no statistics (no mixture of experts)."""
    return loss_sum(params, tokens, targets, cfg, shard, vocab_parallel, mask, segment_ids, positions,
                    dropout_key), {}


# ----------------------------------------------------------------------------- the KV-cached decode path

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")
"""Logical axes of one cache array ``[L, b, S, k, q]``: kv heads over ``tp``, the batch over the data
axes, the slots unsplit."""


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty KV cache ``{"layers": {"k", "v"}}``, each ``[L, batch, length, k, q]`` zeros of ``dtype``.
    Local layers keep every slot too and mask those outside their window (:func:`cache_axes`: the axes)."""
    return {"layers": {kv: jnp.zeros((cfg.num_layers, batch, length, cfg.num_key_value_heads, cfg.head_dim), dtype)
                       for kv in "kv"}}


def cache_axes(cfg: ModelConfig) -> dict:
    """The logical axes of :func:`init_cache`'s tree (:data:`CACHE_AXES` for every leaf)."""
    return {"layers": {kv: CACHE_AXES for kv in "kv"}}


def _cached_layers(x: jax.Array, params: dict, cache: dict, cfg: ModelConfig, tables: tuple, shard: Sharder,
                   index: jax.Array, kv_valid: jax.Array) -> tuple[jax.Array, dict]:
    """The layers over ``x [b, t, d]`` as a ``lax.scan`` over (layer params, per-layer constants, layer
    cache): each writes its keys/values at slot ``index`` and attends over the whole cache, masked by
    ``kv_valid [b, S]`` and its window. Returns ``(x, the updated cache)``."""
    cache_spec = CACHE_AXES[1:]

    def body(h, xs):
        lp, e, kc, vc = xs
        lp = {**lp, **e}
        cos, sin = layer_rope(lp, cfg, tables)
        q, k, v = project_qkv(h, lp, cfg, cos, sin, shard)
        kc = shard(write_slots(kc, k, index), cache_spec)
        vc = shard(write_slots(vc, v, index), cache_spec)
        a = attend_cache(q, kc, vc, index, kv_valid, shard, layer_window(lp, cfg), scale=cfg.attention_scale,
                         softcap=cfg.attn_logit_softcapping)
        return mlp_block(attention_output(h, a.astype(h.dtype), lp, cfg, shard), lp, cfg, shard), (kc, vc)

    extras = layer_extras(cfg, 0, cfg.num_layers)
    x, (ks, vs) = jax.lax.scan(body, x, (fetch_layer(params["layers"]), extras, cache["layers"]["k"],
                                         cache["layers"]["v"]))
    return x, {"layers": {"k": ks, "v": vs}}


def forward_cached(params: dict, tokens: jax.Array, cache: dict, index: jax.Array, positions: jax.Array,
                   kv_valid: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                   last_only: bool = False) -> tuple[jax.Array, dict]:
    """The forward of ``t`` new tokens against a KV cache (a prefill, or one decode step with ``t = 1``),
    as transformers' Gemma 2/3 with ``past_key_values`` computes it.

    Args:
        tokens: int ``[b, t]``, written to the cache slots ``index .. index + t - 1`` (left-padded rows'
            pads marked invalid in ``kv_valid``).
        cache: :func:`init_cache`'s tree, ``[L, b, S, k, q]`` leaves (sharded as :func:`cache_axes`).
        index: int32 scalar, the first slot written, or int32 ``[b]``, one per row
            (:func:`~jaxcolossal.models.layers.attention.write_slots`).
        positions: int ``[b, t]``, the tokens' RoPE positions (a left-padded row starts at 0 at its
            first real token).
        kv_valid: bool ``[b, S]``: the slots that hold real tokens once these are written.
        last_only: the logits of the last position only.

    Returns:
        ``(logits, cache)``: fp32 soft-capped logits ``[b, t, v_padded]`` (padded columns -1e30), and
        the cache with this call's keys and values written.
    """
    x = embed(params["embed_tokens"], tokens, cfg, shard)
    x, cache = _cached_layers(x, params, cache, cfg, rope_pair(tokens.shape[1], cfg, positions), shard, index,
                              kv_valid)
    h = _norm(x[:, -1:] if last_only else x, params["final_norm"], cfg)
    return logits_from_hidden(params, h, cfg, shard), cache


def final_norm(params: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final norm of the last decoder layer's output ``x [b, t, d]`` (``params``: the non-layer leaves
    suffice), what :func:`hidden_states` returns and the LM head reads."""
    return _norm(x, params["final_norm"], cfg)


def pipeline_stages(cfg: ModelConfig, shard: Sharder = no_shard, vocab_parallel: bool = False,
                    positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> tuple[Callable, Callable, Callable]:
    """The forward cut at a pipeline's stage boundaries (:mod:`jaxcolossal.parallel.pipeline_executor`):
    ``embed(others, tokens [mb, t]) -> x [mb, t, d]`` (scaled); ``layer_for(x) -> layer(x, layer_params)``;
    ``head(others, x, targets) -> summed fp32 loss`` (final norm, soft-capped LM head, cross-entropy).
    The layers of a pipeline are alike (the config refuses mixed local and global layers there), so
    every layer's window and RoPE table is the static one (:func:`layer_window`, :func:`layer_rope`)."""

    def embed_stage(o, tokens):
        return embed(o["embed_tokens"], tokens, cfg, shard, vocab_parallel)

    def layer_for(x):
        tables = rope_pair(x.shape[1], cfg, positions)
        return lambda h, p: decoder_layer(h, p, cfg, tables, shard, segment_ids=segment_ids, positions=positions)

    def head(o, x, y):
        return head_loss(o, final_norm(o, x, cfg), y, cfg, shard)
    return embed_stage, layer_for, head
