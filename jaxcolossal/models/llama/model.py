"""LLaMA (Touvron et al., 2023): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Two layers of API:

* pure functions over a params dict — :func:`forward`, :func:`loss_sum` — used by the train
  step, and
* :class:`LlamaForCausalLM`, a Flax NNX module that owns those params as ``nnx.Param`` with
  logical-axis metadata (``axes=``) and calls the same functions. ``nnx.state(model,
  nnx.Param)`` gives the params; :func:`param_axes` their logical axes.

The decoder layers are stacked on a leading ``layers`` dimension and run by ``lax.scan`` so that
compile time does not grow with depth. Shapes (b batch, t sequence, d hidden, h heads, k kv
heads, q head dim, f intermediate, v padded vocab, L layers)::

    embed_tokens  [v, d]        (vocab, embed)
    layers.attn_norm [L, d]     (layers, embed)
    layers.wq     [L, d, h, q]  (layers, embed, heads, head_dim)     column-parallel
    layers.wk/wv  [L, d, k, q]  (layers, embed, kv_heads, head_dim)  column-parallel
    layers.wo     [L, h, q, d]  (layers, heads, head_dim, embed)     row-parallel
    layers.mlp_norm [L, d]      (layers, embed)
    layers.w_gate/w_up [L, d, f] (layers, embed, mlp)                column-parallel
    layers.w_down [L, f, d]     (layers, mlp, embed)                 row-parallel
    final_norm    [d]           (embed,)
    lm_head       [d, v]        (embed, vocab)  absent when tie_word_embeddings

Initialisation depends only on the seed, never on the layout: the vocabulary rows of
``embed_tokens`` (columns of ``lm_head``) are drawn at their unpadded ``vocab_size`` and the
padding rows/columns added by :func:`jaxcolossal.models.layers.vocab.padded_vocab_size` are zero
(:func:`jaxcolossal.models.layers.vocab.init_vocab_padded`), and
the random draws do not depend on how the state is sharded.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcolossal.config import ModelConfig
from jaxcolossal.models.family import stacked_params
from jaxcolossal.models.layers import moe, vocab
from jaxcolossal.models.layers.attention import attention, write_slots
from jaxcolossal.models.layers.decode_attention import attend_cache
from jaxcolossal.models.layers.linear import column_parallel, row_parallel, tp_overlaps
from jaxcolossal.models.layers.lora import DROPOUT_KEY, EQUATIONS, adapt, with_dropout_keys
from jaxcolossal.models.layers.norm import rms_norm
from jaxcolossal.models.layers.rope import apply_rope, rope_tables
from jaxcolossal.models.layers.vocab import Sharder, embed_lookup, no_shard, padded_vocab_size
from jaxcolossal.parallel.layer_scan import fetch_layer, scan_layers, tag


def _layer_table(cfg: ModelConfig, L: int, experts: bool) -> dict:
    """One stack of ``L`` decoder layers: attention and norms, then a dense MLP or (``experts``) the
    MoE MLP of :func:`jaxcolossal.models.layers.moe.layer_shapes_and_axes`."""
    d, h, k, q, f = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.intermediate_size)
    layers = {
        "attn_norm": ((L, d), ("layers", "embed")),
        "wq": ((L, d, h, q), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, d, k, q), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ((L, d, k, q), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ((L, h, q, d), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm": ((L, d), ("layers", "embed")),
    }
    if cfg.qk_norm and cfg.qk_norm_scope == "head":  # Qwen3: RMSNorm over each head of q and k
        layers.update(q_norm=((L, q), ("layers", "head_dim")), k_norm=((L, q), ("layers", "head_dim")))
    elif cfg.qk_norm:  # OLMo-2: over the whole q and k projections
        layers.update(q_norm=((L, h, q), ("layers", "heads", "head_dim")),
                      k_norm=((L, k, q), ("layers", "kv_heads", "head_dim")))
    if cfg.attention_bias != "none":  # Qwen2: q/k/v; HF LLaMA's attention_bias: q/k/v/o
        layers.update(bq=((L, h, q), ("layers", "heads", "head_dim")), bk=((L, k, q), ("layers", "kv_heads", "head_dim")),
                      bv=((L, k, q), ("layers", "kv_heads", "head_dim")))
        if cfg.attention_bias == "all":
            layers.update(bo=((L, d), ("layers", "embed")))
    if experts:
        layers.update(moe.layer_shapes_and_axes(cfg))
        return layers
    layers.update(w_gate=((L, d, f), ("layers", "embed", "mlp")), w_up=((L, d, f), ("layers", "embed", "mlp")),
                  w_down=((L, f, d), ("layers", "mlp", "embed")))
    if cfg.mlp_bias:
        layers.update(b_gate=((L, f), ("layers", "mlp")), b_up=((L, f), ("layers", "mlp")), b_down=((L, d), ("layers", "embed")))
    return layers


def param_shapes_and_axes(cfg: ModelConfig, vocab: int) -> dict:
    """``{name: (shape, logical_axes)}`` for every parameter (the table in the module doc). A mixture
    of experts (``model.num_experts``) stacks its MoE layers as ``layers`` and the first
    ``first_k_dense`` dense ones as ``dense_layers``."""
    d = cfg.hidden_size
    out = {"embed_tokens": ((vocab, d), ("vocab", "embed")),
           "layers": _layer_table(cfg, cfg.moe_layers or cfg.num_layers, cfg.moe),
           "final_norm": ((d,), ("embed",))}
    if cfg.moe and cfg.first_k_dense:
        out["dense_layers"] = _layer_table(cfg, cfg.first_k_dense, False)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((d, vocab), ("embed", "vocab"))
    return out


def _init_leaf(key, name: str, shape, cfg: ModelConfig) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, jnp.float32)
    if name in BIASES:
        return jnp.zeros(shape, jnp.float32)
    std = cfg.initializer_range
    if name in ("wo", "w_down", "moe_w_down", "shared_w_down"):  # GPT-2 / Megatron scaled init of the residual projections
        std = std / math.sqrt(2 * cfg.num_layers)
    return std * jax.random.normal(key, shape, jnp.float32)


class LlamaForCausalLM(nnx.Module):
    """LLaMA decoder with a causal-LM head, as a Flax NNX module.

    Args:
        cfg: the model section of the config.
        rngs: ``nnx.Rngs`` for initialisation (normal(0, initializer_range); residual output
            projections scaled by 1/sqrt(2L); norms at one; the padded vocabulary rows of
            ``embed_tokens`` and columns of ``lm_head`` zero, the real ones drawn at
            ``vocab_size`` so that they do not depend on ``tp``: :func:`init_vocab_padded`).
        tp: tensor-parallel size, only to pad the vocabulary (:func:`jaxcolossal.models.layers.vocab.padded_vocab_size`).

    Params are fp32 ``nnx.Param`` with logical ``axes`` metadata. ``__call__(tokens)`` maps
    int32 ``[b, t]`` tokens to fp32 logits ``[b, t, vocab_size]`` (padding removed).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, tp: int = 1):
        self.cfg = cfg
        self.vocab = padded_vocab_size(cfg, tp)
        # 16 keys at least: the dense models' draws stay as they were
        stacked_params(self, cfg, param_shapes_and_axes(cfg, self.vocab), rngs.params(), _init_leaf, min_keys=16)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.cfg)[..., : self.cfg.vocab_size]


def init_params(cfg: ModelConfig, key: jax.Array, tp: int = 1) -> dict:
    """fp32 params (pure dict) of a fresh :class:`LlamaForCausalLM`; jit-able."""
    return nnx.to_pure_dict(nnx.state(LlamaForCausalLM(cfg, rngs=nnx.Rngs(params=key), tp=tp), nnx.Param))


# ----------------------------------------------------------------------------- the computation

BIASES = ("bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down")
"""The bias leaves of ``model.attention_bias`` and ``model.mlp_bias`` (zero at initialisation)."""


def _norm_in(x: jax.Array, scale: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A sub-block's input: ``rms_norm(x)`` with pre-norms (LLaMA), ``x`` itself with post-norms (OLMo-2)."""
    return rms_norm(x, scale, cfg.rms_norm_eps) if cfg.norm_position == "pre" else x


def _norm_out(y: jax.Array, scale: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A sub-block's output before the residual: ``y`` with pre-norms, ``rms_norm(y)`` with post-norms."""
    return y if cfg.norm_position == "pre" else rms_norm(y, scale, cfg.rms_norm_eps)


def _qk_norm(q: jax.Array, k: jax.Array, lp: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Qwen3's RMSNorm over each head of q ``[b, t, h, q]`` and k, or OLMo-2's over the whole projection
    (the last two dims; under tp the mean square is summed over the tp shards of the heads)."""
    if cfg.qk_norm_scope == "head":
        return rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return (rms_norm(q, lp["q_norm"], cfg.rms_norm_eps, axes=(-2, -1)),
            rms_norm(k, lp["k_norm"], cfg.rms_norm_eps, axes=(-2, -1)))


def layer_window(lp: dict, cfg: ModelConfig):
    """This layer's attention window: the per-layer constant ``lp["window"]`` when the layers differ
    (:func:`layer_extras`), else the one window of every layer (a Python int; 0: full attention)."""
    return lp["window"] if "window" in lp else max(cfg.layer_windows, default=0)


def layer_extras(cfg: ModelConfig, first: int, count: int) -> dict:
    """The per-layer constants of layers ``first .. first + count − 1`` for the layer scan
    (:func:`jaxcolossal.parallel.layer_scan.scan_layers`): each layer's window ``[count]`` when the
    layers' windows differ (``model.layer_types``), else none."""
    windows = cfg.layer_windows
    if len(set(windows)) <= 1:
        return {}
    return {"window": jnp.asarray(windows[first:first + count], jnp.int32)}


def project_qkv(x: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard) -> tuple:
    """The first phase of the attention half: the pre-norm (none with post-norms), the q/k/v
    projections (with their biases and LoRA), the q/k norm and RoPE (the rotated dimensions of
    ``cos``/``sin``). x ``[b, t, d]`` -> q ``[b, t, h, q]``, k/v ``[b, t, k, q]`` (compute dtype)."""
    overlap = tp_overlaps(shard, x.shape[1])  # Megatron-SP's gathers/scatters as ring matmuls
    column = partial(column_parallel, shard, overlap)
    # + the LoRA adapters where model.lora puts them (with its dropout when the step passes a key)
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    h = _norm_in(x, lp["attn_norm"], cfg)
    biases = [lp["bq"], lp["bk"], lp["bv"]] if "bq" in lp else None
    q, k, v = column(h, [("btd,dhq->bthq", lp["wq"], "h"), ("btd,dkq->btkq", lp["wk"], "k"),
                         ("btd,dkq->btkq", lp["wv"], "k")], biases)
    q, k, v = (lora(EQUATIONS[n], h, y, name=n) for n, y in (("wq", q), ("wk", k), ("wv", v)))
    q = tag(shard(q, ("batch", "seq", "heads", "head_dim")), "query_proj")
    k = tag(shard(k, ("batch", "seq", "kv_heads", "head_dim")), "key_proj")
    v = tag(shard(v, ("batch", "seq", "kv_heads", "head_dim")), "value_proj")
    if "q_norm" in lp:  # Qwen3's per-head / OLMo-2's whole-projection RMSNorm, before RoPE
        q, k = _qk_norm(q, k, lp, cfg)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(x: jax.Array, a: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """The last phase of the attention half: the output projection of the attended values ``a [b,
    t, h, q]`` (with its bias and LoRA; OLMo-2's post-norm) added to the residual ``x [b, t, d]`` -> ``[b, t, d]``."""
    row = partial(row_parallel, shard, tp_overlaps(shard, x.shape[1]))
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    a = shard(a, ("batch", "seq", "heads", "head_dim"))
    o = lora(EQUATIONS["wo"], a, row("bthq,hqd->btd", a, lp["wo"], "h", lp.get("bo")), name="wo")
    return shard(x + _norm_out(tag(o, "out_proj"), lp["attn_norm"], cfg), ("batch", "seq", "embed"))


def attention_block(x: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard,
                    segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """The attention half of a pre-norm LLaMA block with its residual: x ``[b, t, d]`` -> ``[b, t, d]``."""
    q, k, v = project_qkv(x, lp, cfg, cos, sin, shard)
    window = layer_window(lp, cfg)
    a = attention(q, k, v, cfg.attention_impl, segment_ids, shard, positions, **({"window": window} if
                                                                                  _windowed(cfg) else {}))
    return attention_output(x, a, lp, cfg, shard)


def _windowed(cfg: ModelConfig) -> bool:
    return any(cfg.layer_windows)


def moe_decoder_layer(carry: tuple, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard,
                      segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> tuple:
    """A block whose MLP is a mixture of experts (:func:`jaxcolossal.models.layers.moe.moe_mlp`):
    ``(x [b, t, d], stats) -> (x, stats + this layer's)`` (the layer scan's carry)."""
    x, acc = carry
    x = attention_block(x, lp, cfg, cos, sin, shard, segment_ids, positions)
    manual = getattr(shard, "manual_experts", None)  # inside a pipeline's shard_map
    mesh = None if manual else getattr(shard, "mesh", None)
    y, stats = moe.moe_mlp(_norm_in(x, lp["mlp_norm"], cfg), lp, cfg, mesh, manual)
    return shard(x + _norm_out(y, lp["mlp_norm"], cfg), ("batch", "seq", "embed")), jax.tree.map(jnp.add, acc, stats)


def mlp_block(x: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """The dense SwiGLU half of a pre-norm LLaMA block with its residual: x ``[b, t, d]`` -> ``[b, t, d]``."""
    overlap = tp_overlaps(shard, x.shape[1])
    column = partial(column_parallel, shard, overlap)
    row = partial(row_parallel, shard, overlap)
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    h = _norm_in(x, lp["mlp_norm"], cfg)
    biases = [lp["b_gate"], lp["b_up"]] if "b_gate" in lp else None
    g, u = column(h, [("btd,df->btf", lp["w_gate"], "f"), ("btd,df->btf", lp["w_up"], "f")], biases)
    g, u = lora(EQUATIONS["w_gate"], h, g, name="w_gate"), lora(EQUATIONS["w_up"], h, u, name="w_up")
    g = tag(shard(g, ("batch", "seq", "mlp")), "mlp_gate")
    u = tag(shard(u, ("batch", "seq", "mlp")), "mlp_up")
    act = jax.nn.silu(g) * u
    down = row("btf,fd->btd", act, lp["w_down"], "f", lp.get("b_down"))
    y = tag(lora(EQUATIONS["w_down"], act, down, name="w_down"), "mlp_down")
    return shard(x + _norm_out(y, lp["mlp_norm"], cfg), ("batch", "seq", "embed"))


def decoder_layer(x: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """One pre-norm LLaMA block. x ``[b, t, d]`` in the compute dtype (``positions``: the tokens'
    positions, for sequence-parallel attention's mask)."""
    x = attention_block(x, lp, cfg, cos, sin, shard, segment_ids, positions)
    return mlp_block(x, lp, cfg, shard)


def hidden_states(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                  vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
    """Final-norm hidden states ``[b, t, d]`` in the params' dtype for int ``tokens [b, t]``.

    The embedding is :func:`jaxcolossal.models.layers.vocab.embed_lookup` (Megatron's vocab-parallel
    masked gather when ``vocab_parallel``); the layers run in one ``lax.scan`` checkpointed by the
    ``model.remat`` policy (:mod:`jaxcolossal.parallel.layer_scan`). Packed rows (``data.packing_mask``)
    pass ``segment_ids`` and ``positions`` (int ``[b, t]``): attention stays within a document and
    RoPE positions restart at each document. ``dropout_key``: LoRA's dropout in a training step
    (``model.lora.dropout``; one key per layer is split from it).
    """
    return hidden_and_stats(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions, dropout_key)[0]


def hidden_and_stats(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                     vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> tuple:
    """:func:`hidden_states` and the MoE layers' statistics (:data:`jaxcolossal.models.layers.moe.STATS`
    summed over the layers, the router losses the microbatch's: :func:`jaxcolossal.models.layers.moe.finish`;
    ``{}`` for a dense model)."""
    params = with_dropout_keys(params, cfg.lora, dropout_key)  # LoRA's dropout: one key per layer, every stack
    layers = params["layers"]
    x = shard(embed_lookup(params["embed_tokens"], tokens, shard, vocab_parallel, cfg.embedding_impl),
              ("batch", "seq", "embed"))
    cos, sin = rope_tables(tokens.shape[1], cfg, positions)

    def dense(h, lp):
        return decoder_layer(h, lp, cfg, cos, sin, shard, segment_ids, positions)

    stats = {}
    k = cfg.first_k_dense if "dense_layers" in params else 0
    if k:  # DeepSeek's first k dense layers, their own stack
        plain = shard.without_layer_specs() if hasattr(shard, "without_layer_specs") else shard
        x = scan_layers(dense, x, params["dense_layers"], cfg.remat, plain, layer_extras(cfg, 0, k))
    extras = layer_extras(cfg, k, cfg.num_layers - k)
    if cfg.moe:
        def routed(c, lp):
            return moe_decoder_layer(c, lp, cfg, cos, sin, shard, segment_ids, positions)

        x, stats = scan_layers(routed, (x, moe.zero_stats(cfg)), layers, cfg.remat, shard, extras)
        stats = moe.finish(stats, cfg)
    else:
        x = scan_layers(dense, x, layers, cfg.remat, shard, extras)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), stats


def head_weight(params: dict, cfg: ModelConfig) -> jax.Array:
    """The LM head ``[d, v]``: ``embed_tokens.T`` when tied, else ``lm_head``."""
    return params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]


def logits_from_hidden(params: dict, h: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """fp32 logits ``[b, t, v]`` (padded vocab, sharded on ``vocab``); padded columns are -1e30."""
    return vocab.logits(h, head_weight(params, cfg), cfg.vocab_size, shard)


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
            vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None) -> jax.Array:
    """Logits ``[b, t, v_padded]`` (fp32) for int ``tokens [b, t]`` (packed rows: ``segment_ids``,
    ``positions`` as in :func:`hidden_states`)."""
    h = hidden_states(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions)
    return logits_from_hidden(params, h, cfg, shard)


head_loss, _ = vocab.lm_loss(hidden_states, head_weight)


# ----------------------------------------------------------------------------- the KV-cached decode path

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")
"""Logical axes of one cache array ``[L, b, S, k, q]``: kv heads over ``tp``, the batch over the data
axes (the rules table), the slots unsplit."""


def _stacks(cfg: ModelConfig) -> dict:
    """``{stack name: number of layers}``: ``layers`` and, for DeepSeek's first dense layers, ``dense_layers``."""
    out = {"layers": cfg.moe_layers or cfg.num_layers} if cfg.moe else {"layers": cfg.num_layers}
    if cfg.moe and cfg.first_k_dense:
        out["dense_layers"] = cfg.first_k_dense
    return out


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty KV cache: ``{stack: {"k", "v"}}``, each ``[L, batch, length, k, q]`` zeros of ``dtype``
    (the compute dtype), one per stack of layers (:func:`cache_axes` gives their logical axes)."""
    return {name: {kv: jnp.zeros((n, batch, length, cfg.num_key_value_heads, cfg.head_dim), dtype) for kv in "kv"}
            for name, n in _stacks(cfg).items()}


def cache_axes(cfg: ModelConfig) -> dict:
    """The logical axes of :func:`init_cache`'s tree (:data:`CACHE_AXES` for every leaf)."""
    return {name: {kv: CACHE_AXES for kv in "kv"} for name in _stacks(cfg)}


def _cached_stack(x: jax.Array, layers: dict, cache: dict, cfg: ModelConfig, cos, sin, shard: Sharder,
                  index: jax.Array, kv_valid: jax.Array, experts: bool, extras: dict) -> tuple[jax.Array, dict]:
    """One stack of layers over ``x [b, t, d]`` as a ``lax.scan`` over (layer params, layer cache):
    each layer writes its new keys/values at slot ``index`` and attends over the whole cache, its
    mask from ``kv_valid [b, S]`` and the layer's window (``extras``: :func:`layer_extras`).
    Returns ``(x, the stack's updated cache)``."""
    cache_spec = CACHE_AXES[1:]

    def body(h, xs):
        lp, e, kc, vc = xs
        lp = {**lp, **e}
        q, k, v = project_qkv(h, lp, cfg, cos, sin, shard)
        kc = shard(write_slots(kc, k, index), cache_spec)
        vc = shard(write_slots(vc, v, index), cache_spec)
        a = attend_cache(q, kc, vc, index, kv_valid, shard, layer_window(lp, cfg))
        h = attention_output(h, a.astype(h.dtype), lp, cfg, shard)
        if experts:
            mesh = getattr(shard, "mesh", None)
            y, _ = moe.moe_mlp(_norm_in(h, lp["mlp_norm"], cfg), lp, cfg, mesh)
            h = shard(h + _norm_out(y, lp["mlp_norm"], cfg), ("batch", "seq", "embed"))
        else:
            h = mlp_block(h, lp, cfg, shard)
        return h, (kc, vc)

    x, (ks, vs) = jax.lax.scan(body, x, (fetch_layer(layers), extras, cache["k"], cache["v"]))
    return x, {"k": ks, "v": vs}


def forward_cached(params: dict, tokens: jax.Array, cache: dict, index: jax.Array, positions: jax.Array,
                   kv_valid: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                   last_only: bool = False) -> tuple[jax.Array, dict]:
    """The forward of ``t`` new tokens against a KV cache: a prefill (``t`` = the prompt) or one decode
    step (``t = 1``), as Hugging Face's ``LlamaForCausalLM`` with ``past_key_values`` computes it.

    Args:
        tokens: int ``[b, t]``, written to the cache slots ``index .. index + t - 1`` (every row the same
            slots; rows of different lengths are left-padded, their pads marked invalid in ``kv_valid``).
        cache: :func:`init_cache`'s tree, ``[L, b, S, k, q]`` leaves (sharded as :func:`cache_axes`).
        index: int32 scalar, the first slot written, or int32 ``[b]``, one per row
            (:func:`~jaxcolossal.models.layers.attention.write_slots`).
        positions: int ``[b, t]``, the tokens' RoPE positions (per row: a left-padded row starts at 0
            at its first real token).
        kv_valid: bool ``[b, S]``: the slots that hold real tokens once these are written.
        last_only: the logits of the last position only (``t`` becomes 1 in the result).

    Returns:
        ``(logits, cache)``: fp32 logits ``[b, t, v_padded]`` (padded columns -1e30), and the cache with
        this call's keys and values written. Dropless routing for a mixture of experts is exact; with a
        ``capacity_factor`` the pads of a prefill take capacity like real tokens.
    """
    x = shard(embed_lookup(params["embed_tokens"], tokens, shard, False, cfg.embedding_impl), ("batch", "seq", "embed"))
    cos, sin = rope_tables(tokens.shape[1], cfg, positions)
    out = {}
    k = cfg.first_k_dense if "dense_layers" in params else 0
    if k:
        x, out["dense_layers"] = _cached_stack(x, params["dense_layers"], cache["dense_layers"], cfg, cos, sin,
                                               shard, index, kv_valid, False, layer_extras(cfg, 0, k))
    x, out["layers"] = _cached_stack(x, params["layers"], cache["layers"], cfg, cos, sin, shard, index, kv_valid,
                                     cfg.moe, layer_extras(cfg, k, cfg.num_layers - k))
    h = rms_norm(x[:, -1:] if last_only else x, params["final_norm"], cfg.rms_norm_eps)
    return logits_from_hidden(params, h, cfg, shard), out


loss_and_stats, loss_sum = moe.lm_loss_with_router(hidden_and_stats, head_loss)
"""The summed LM loss with the router's losses, and the router statistics
(:func:`jaxcolossal.models.layers.moe.lm_loss_with_router`)."""


def final_norm(params: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final norm of the last decoder layer's output ``x [b, t, d]`` (``params``: the non-layer leaves
    suffice), what :func:`hidden_states` returns and the LM head reads."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def pipeline_stages(cfg: ModelConfig, shard: Sharder = no_shard, vocab_parallel: bool = False,
                    positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> tuple[Callable, Callable, Callable]:
    """The forward cut at a pipeline's stage boundaries (:mod:`jaxcolossal.parallel.pipeline_executor`):
    ``embed(others, tokens [mb, t]) -> x``; ``layer_for(x) -> layer(x, layer_params)`` (one decoder
    layer, RoPE tables for ``x``'s length); ``head(others, x, targets) -> summed fp32 loss`` (final
    norm, LM head, cross-entropy). ``x``, what passes between the stages: the activations ``[mb, t,
    d]``, or for a mixture of experts with the pooled load-balancing loss (``model.router_aux_loss_form``)
    ``(activations, stream)`` with the layers' router sums (:func:`jaxcolossal.models.layers.moe.pipeline_stream`),
    whose loss the head adds in gradient only (:func:`jaxcolossal.models.layers.moe.pooled_loss_gradient`).
    ``others``: the non-layer params. ``positions``: int32 ``[mb, t]`` when not ``arange(t)`` (ring
    attention's zig-zag block)."""
    pooled = cfg.moe and cfg.router_aux_loss_form == "pooled"

    def embed(o, tokens):
        x = shard(embed_lookup(o["embed_tokens"], tokens, shard, vocab_parallel, cfg.embedding_impl),
                  ("batch", "seq", "embed"))
        return (x, moe.pipeline_stream(cfg)) if pooled else x

    def moe_layer(cos, sin):  # the per-layer router losses join through their gradient (moe.with_loss_gradient)
        def layer(c, p):
            h, stats = moe_decoder_layer((c[0] if pooled else c, moe.zero_stats(cfg)), p, cfg, cos, sin, shard,
                                         segment_ids=segment_ids, positions=positions)
            return (h, moe.add_to_stream(c[1], stats)) if pooled else h
        return layer

    def layer_for(x):
        cos, sin = rope_tables((x[0] if pooled else x).shape[1], cfg, positions)
        if cfg.moe:
            return moe_layer(cos, sin)
        return lambda h, p: decoder_layer(h, p, cfg, cos, sin, shard, segment_ids=segment_ids, positions=positions)

    def head(o, x, y):
        h = x[0] if pooled else x
        loss = head_loss(o, final_norm(o, h, cfg), y, cfg, shard)
        return loss + moe.pooled_loss_gradient(x[1], cfg) if pooled else loss
    return embed, layer_for, head
