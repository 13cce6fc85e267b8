"""LoRA adapters (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the
LLaMA-like families' projections and DeepSeek's multi-head latent attention, in Hugging Face PEFT's
convention (``model.lora``).

A target projection ``y = x W`` becomes ``y = x W + (alpha / rank) · dropout(x) A B``: ``A`` maps the
projection's input dimensions to ``rank``, ``B`` maps ``rank`` to its output dimensions. Stacked as
the base weights are (``L`` layers), with the rank as a dimension of its own (logical axis
``lora_rank``, never sharded)::

    wq_lora_a  [L, d, r]       (layers, embed, lora_rank)         wq_lora_b  [L, r, h, q]  (layers, lora_rank, heads, head_dim)
    wo_lora_a  [L, h, q, r]    (layers, heads, head_dim, lora_rank)  wo_lora_b  [L, r, d]  (layers, lora_rank, embed)

so an adapter is sharded as its base projection is: on a column-parallel projection (q, k, v,
gate, up) ``B``'s output heads/mlp dimension is on ``tp``; on a row-parallel one (o, down) ``A``'s
input dimension is, and the ``[b, t, r]`` product is summed over ``tp`` (a tiny all-reduce), as in
Megatron's LoRA. ``A`` starts as PEFT's (Kaiming-uniform, bound ``1/sqrt(fan_in)``), ``B`` at zero.

Every stacked-layer group of the params carries its layers' adapters (:data:`STACKS`: ``layers``, and
a mixture of experts' first dense layers ``dense_layers``). A Hugging Face module that fuses two of
the weights kept here (DeepSeek's ``kv_a_proj_with_mqa`` -> ``wkv_a`` and ``wk_rope``, ``kv_b_proj``
-> ``wk_b`` and ``wv_b``) has one adapter, as in PEFT: one A on the first weight and B split into the
weights' outputs (:data:`FUSED`, :func:`adapt_fused`)::

    wkv_a_lora_a [L, d, r]   wkv_a_lora_b [L, r, r_kv]       wk_rope_lora_b [L, r, r_rope]
    wk_b_lora_a  [L, r_kv, r]  wk_b_lora_b [L, r, h, nope]   wv_b_lora_b    [L, r, h, v]

The train state keeps the adapters as its trained params and the base weights apart, frozen
(:attr:`jaxcolossal.train.state.TrainState.frozen`); :func:`merge` puts the two trees together for
the forward. Why not qwix's LoRA: it rewrites a flax module's ``dot_general`` calls, and these
models are pure functions over a stacked params dict whose projections are custom-VJP einsums
(fp32 weight gradients, FP8, TP collective matmuls), sharded by this project's rules table; the
adapters here are two more einsums through the same :func:`jaxcolossal.models.layers.linear.project`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxcolossal.config import LoraConfig
from jaxcolossal.models.layers.linear import project
from jaxcolossal.parallel.collective_matmul import operands

WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down",
           "q_a": "wq_a", "q_b": "wq_b", "kv_a": "wkv_a", "kv_b": "wk_b"}
"""LoRA target -> the stacked weight it adapts, whose ``_lora_a`` holds the adapter's A (LLaMA's names,
and DeepSeek's multi-head latent attention: :mod:`jaxcolossal.models.deepseek.model`)."""
FUSED = {"wkv_a": ("wkv_a", "wk_rope"), "wk_b": ("wk_b", "wv_b")}
"""An adapted weight -> the weights whose outputs one Hugging Face module fuses, in its output order:
DeepSeek's ``kv_a_proj_with_mqa`` (the latent, then the rotary key) and ``kv_b_proj`` (per head the
keys' nope part, then the values). PEFT gives such a module one adapter: one A (``<first>_lora_a``)
and one B, kept here as each weight's part of B's outputs (``<weight>_lora_b``)."""
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
              "q_a": "self_attn.q_a_proj", "q_b": "self_attn.q_b_proj", "kv_a": "self_attn.kv_a_proj_with_mqa",
              "kv_b": "self_attn.kv_b_proj"}
"""LoRA target -> its module path inside a Hugging Face decoder layer (PEFT's names)."""
EQUATIONS = {"wq": "btd,dhq->bthq", "wk": "btd,dkq->btkq", "wv": "btd,dkq->btkq", "wo": "bthq,hqd->btd",
             "w_gate": "btd,df->btf", "w_up": "btd,df->btf", "w_down": "btf,fd->btd",
             "wq_a": "btd,dc->btc", "wq_b": "btc,chq->bthq", "wkv_a": "btd,dc->btc", "wk_rope": "btd,dp->btp",
             "wk_b": "btc,chk->bthk", "wv_b": "btc,chv->bthv"}
"""Each adaptable weight's projection, as the families run it (``c``: a latent, ``p``: the rotary key's
dimensions). ``r`` is never a letter here: :func:`adapt` names the rank with it."""
STACKS = ("dense_layers", "layers")
"""The stacked-layer groups of a params dict that carry adapters, in the order of the model's layers
(a mixture of experts' first dense layers, ``dense_layers``, then ``layers``)."""
RANK_AXIS = "lora_rank"
DROPOUT_KEY = "lora_dropout_key"
"""The per-layer PRNG keys ``[L]`` that a training step's layer scan carries beside the weights
when ``model.lora.dropout > 0`` (:func:`with_dropout_keys`)."""
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def fused(name: str) -> tuple[str, ...]:
    """The weights that share adapted weight ``name``'s A (:data:`FUSED`; else ``name`` alone)."""
    return FUSED.get(name, (name,))


def _split_weight(eq: str) -> tuple[str, str]:
    """The weight's input and output letters of a projection ``eq`` (``"btd,dhq->bthq"``: d, hq)."""
    lhs, rhs, out = operands(eq)
    return "".join(c for c in rhs if c in lhs), "".join(c for c in rhs if c in out)


def _groups(base: dict) -> dict:
    """The stacked-layer tables of ``base``: a whole params table (its :data:`STACKS` groups) or one
    group's table (as ``layers``)."""
    groups = {g: base[g] for g in STACKS if isinstance(base.get(g), dict)}
    return groups or {"layers": base}


def adapter_shapes_and_axes(lora: LoraConfig, base: dict, targets: tuple[str, ...] | None = None) -> dict:
    """``{group: {name: (shape, logical axes)}}`` of the adapters of ``targets`` (default
    ``lora.target_list``; a target whose weight a group lacks is skipped) on every stacked-layer group
    of ``base``: a family's ``param_shapes_and_axes`` table (``layers``, ``dense_layers``) or one
    group's table. Each adapted weight gets ``A [L, *in, r]`` and ``B [L, r, *out]``; a fused module
    (:data:`FUSED`) one A and a B per weight."""
    out = {}
    for group, table in _groups(base).items():
        leaves = {}
        for target in lora.target_list if targets is None else targets:
            if WEIGHTS[target] not in table:
                continue
            for i, name in enumerate(fused(WEIGHTS[target])):
                shape, axes = table[name]
                n_in = len(_split_weight(EQUATIONS[name])[0])
                if i == 0:
                    leaves[name + SUFFIX_A] = ((*shape[:1 + n_in], lora.rank), (*axes[:1 + n_in], RANK_AXIS))
                leaves[name + SUFFIX_B] = ((shape[0], lora.rank, *shape[1 + n_in:]),
                                           (axes[0], RANK_AXIS, *axes[1 + n_in:]))
        if leaves:
            out[group] = leaves
    return out


def init_adapters(lora: LoraConfig, shapes: dict, key: jax.Array) -> dict:
    """fp32 adapters for ``shapes`` (:func:`adapter_shapes_and_axes`'s shapes, ``{group: {name:
    shape}}``): each ``A`` from PEFT's ``kaiming_uniform_(a=sqrt(5))``, i.e. uniform in
    ``±1/sqrt(fan_in)`` (fan_in: the projection's input size), each ``B`` zero, so the adapted model
    starts equal to the base. ``layers`` draws from ``key``, another group from a key folded from it."""
    out = {}
    for group, leaves in shapes.items():
        gkey = key if group == "layers" else jax.random.fold_in(key, 1 + STACKS.index(group))
        names = sorted(n for n in leaves if n.endswith(SUFFIX_A))
        keys = dict(zip(names, jax.random.split(gkey, max(len(names), 1))))
        out[group] = {}
        for name, shape in leaves.items():
            if name.endswith(SUFFIX_A):
                bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))
                out[group][name] = jax.random.uniform(keys[name], shape, jnp.float32, -bound, bound)
            else:
                out[group][name] = jnp.zeros(shape, jnp.float32)
    return out


def merge(frozen: Any, adapters: Any) -> Any:
    """The model's params dict: the frozen base tree with the adapter leaves added to each of its
    stacked-layer groups (``frozen`` ``None``: ``adapters`` are the whole params, no LoRA)."""
    if frozen is None:
        return adapters
    return {**frozen, **{g: {**frozen[g], **leaves} for g, leaves in adapters.items()}}


def with_dropout_keys(params: dict, lora: LoraConfig, key: jax.Array | None) -> dict:
    """``params`` with :data:`DROPOUT_KEY` ``[L]`` added to each stacked-layer group when ``key`` is
    given and ``lora.dropout > 0`` (a training step), else ``params``: ``layers`` splits ``key``, another
    group a key folded from it."""
    if key is None or lora.dropout <= 0:
        return params
    out = dict(params)
    for g in STACKS:
        if g in params:
            n = jax.tree.leaves(params[g])[0].shape[0]
            gkey = key if g == "layers" else jax.random.fold_in(key, 1 + STACKS.index(g))
            out[g] = {**params[g], DROPOUT_KEY: jax.random.split(gkey, n)}
    return out


def _down(eq: str, x: jax.Array, a: jax.Array, name: str, lora: LoraConfig,
          dropout_key: jax.Array | None) -> tuple[jax.Array, str]:
    """``(dropout(x) A, its einsum letters)``: projection ``eq``'s input ``x`` to the rank (``[..., r]``)."""
    lhs, _, _ = operands(eq)
    w_in, _ = _split_weight(eq)
    mid = "".join(c for c in lhs if c not in w_in) + "r"
    if dropout_key is not None and lora.dropout > 0:
        keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, list(WEIGHTS.values()).index(name)),
                                    1.0 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
    return project(f"{lhs},{w_in}r->{mid}", x, a), mid


def _up(eq: str, h: jax.Array, mid: str, b: jax.Array, y: jax.Array, lora: LoraConfig) -> jax.Array:
    """``y + (alpha/rank) · h B``: the rank-space ``h`` (letters ``mid``) out through projection ``eq``'s B."""
    _, w_out = _split_weight(eq)
    delta = project(f"{mid},r{w_out}->{operands(eq)[2]}", h, b)
    return y + (delta * lora.scale).astype(y.dtype)


def adapt(eq: str, x: jax.Array, y: jax.Array, lp: dict, name: str, lora: LoraConfig,
          dropout_key: jax.Array | None = None) -> jax.Array:
    """``y + (alpha/rank) · (dropout(x) A) B`` when layer params ``lp`` hold adapters for weight
    ``name`` (else ``y``). ``eq``: the base projection (``"btd,dhq->bthq"``, no letter ``r``); ``x``,
    ``y``: its input and output (compute dtype, any sharding); ``dropout_key``: this layer's key when
    ``lora.dropout > 0`` and training (``None``: no dropout). Returns ``y``'s shape and dtype."""
    a = lp.get(name + SUFFIX_A)
    if a is None:
        return y
    h, mid = _down(eq, x, a, name, lora, dropout_key)
    return _up(eq, h, mid, lp[name + SUFFIX_B], y, lora)


def adapt_fused(x: jax.Array, ys: tuple, lp: dict, name: str, lora: LoraConfig,
                dropout_key: jax.Array | None = None) -> tuple:
    """:func:`adapt` for a fused module (:data:`FUSED`): ``ys``, the outputs of the weights
    ``fused(name)`` of one input ``x`` (their :data:`EQUATIONS`), each plus its part of the one
    adapter: ``(alpha/rank) · (dropout(x) A) B_i``, one A and one dropout mask for all. ``ys``
    unchanged when ``lp`` holds no adapter for ``name``. Returns a tuple of ``ys``' shapes and dtypes."""
    a = lp.get(name + SUFFIX_A)
    if a is None:
        return tuple(ys)
    h, mid = _down(EQUATIONS[name], x, a, name, lora, dropout_key)
    return tuple(_up(EQUATIONS[n], h, mid, lp[n + SUFFIX_B], y, lora) for n, y in zip(fused(name), ys))


def _merged(layers: dict, scale: float, lead: str, keep_dtype: bool) -> dict:
    """``layers`` (one group, stacked when ``lead`` is ``"L"``, one layer when ``""``) with each adapted
    weight ``W + scale · A B`` (computed in fp32; cast back to ``W``'s dtype when ``keep_dtype``) and
    the adapter leaves removed."""
    layers = dict(layers)
    for owner in [n[:-len(SUFFIX_A)] for n in layers if n.endswith(SUFFIX_A)]:
        a = jnp.asarray(layers.pop(owner + SUFFIX_A), jnp.float32)
        for name in fused(owner):
            w_in, w_out = _split_weight(EQUATIONS[name])
            delta = jnp.einsum(f"{lead}{w_in}r,{lead}r{w_out}->{lead}{w_in}{w_out}", a,
                               jnp.asarray(layers.pop(name + SUFFIX_B), jnp.float32))
            w = layers[name]
            merged = jnp.asarray(w, jnp.float32) + scale * delta
            layers[name] = merged.astype(w.dtype) if keep_dtype else merged
    return layers


def merged_weights(params: dict, lora: LoraConfig) -> dict:
    """``params`` with each adapted weight of every stacked-layer group replaced by ``W + (alpha/rank)
    · A B`` (fp32) and the adapter leaves removed: the full model PEFT's ``merge_and_unload`` gives."""
    return {**params, **{g: _merged(params[g], lora.scale, "L", False) for g in STACKS if g in params}}


def merged_layer(lp: dict, lora: LoraConfig) -> dict:
    """One layer's params ``lp`` (unstacked) with its adapters merged into the weights, each in the
    weight's dtype (``W + (alpha/rank) · A B``, no dropout): what a KV-cached decode path that
    rearranges the weights (DeepSeek's absorbed MLA) runs. ``lp`` itself when it holds no adapter."""
    if not any(_is_adapter(n) for n in lp):
        return lp
    return _merged(lp, lora.scale, "", True)


def split(params: dict) -> tuple[dict, dict]:
    """``(base, adapters)``: the inverse of :func:`merge` (adapters: ``{group: {name: leaf}}``, always
    with ``layers``)."""
    base, adapters = dict(params), {}
    for g in STACKS:
        if g not in params:
            continue
        base[g] = {n: v for n, v in params[g].items() if not _is_adapter(n)}
        leaves = {n: v for n, v in params[g].items() if _is_adapter(n)}
        if leaves or g == "layers":
            adapters[g] = leaves
    return base, adapters


def _is_adapter(name: str) -> bool:
    """Whether the layer leaf ``name`` is a LoRA adapter (``..._lora_a`` / ``..._lora_b``)."""
    return name.endswith((SUFFIX_A, SUFFIX_B))
