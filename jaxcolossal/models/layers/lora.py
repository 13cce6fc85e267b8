"""LoRA adapters (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the
LLaMA family's projections, in Hugging Face PEFT's convention (``model.lora``).

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

WEIGHTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
"""LoRA target -> the stacked LLaMA weight it adapts."""
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
"""LoRA target -> its module path inside a Hugging Face ``LlamaDecoderLayer`` (PEFT's names)."""
EQUATIONS = {"wq": "btd,dhq->bthq", "wk": "btd,dkq->btkq", "wv": "btd,dkq->btkq", "wo": "bthq,hqd->btd",
             "w_gate": "btd,df->btf", "w_up": "btd,df->btf", "w_down": "btf,fd->btd"}
"""Each adaptable weight's projection, as :func:`jaxcolossal.models.llama.model.decoder_layer` runs it."""
RANK_AXIS = "lora_rank"
DROPOUT_KEY = "lora_dropout_key"
"""The per-layer PRNG keys ``[L]`` that a training step's layer scan carries beside the weights
when ``model.lora.dropout > 0`` (:func:`jaxcolossal.models.llama.hidden_states`)."""
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


def _split_weight(eq: str) -> tuple[str, str]:
    """The weight's input and output letters of a projection ``eq`` (``"btd,dhq->bthq"``: d, hq)."""
    lhs, rhs, out = operands(eq)
    return "".join(c for c in rhs if c in lhs), "".join(c for c in rhs if c in out)


def adapter_shapes_and_axes(lora: LoraConfig, base_layers: dict) -> dict:
    """``{"layers": {name: (shape, logical axes)}}`` of the adapters of ``lora.targets``, from the
    base model's stacked layer table (:func:`jaxcolossal.models.llama.param_shapes_and_axes`'s
    ``"layers"``): ``A [L, *in, r]``, ``B [L, r, *out]``."""
    out = {}
    for target in lora.target_list:
        name = WEIGHTS[target]
        shape, axes = base_layers[name]
        w_in, _ = _split_weight(EQUATIONS[name])
        n_in = len(w_in)
        out[name + SUFFIX_A] = ((*shape[:1 + n_in], lora.rank), (*axes[:1 + n_in], RANK_AXIS))
        out[name + SUFFIX_B] = ((shape[0], lora.rank, *shape[1 + n_in:]), (axes[0], RANK_AXIS, *axes[1 + n_in:]))
    return {"layers": out}


def init_adapters(lora: LoraConfig, shapes: dict, key: jax.Array) -> dict:
    """fp32 adapters for ``shapes`` (:func:`adapter_shapes_and_axes`'s shapes): each ``A`` from
    PEFT's ``kaiming_uniform_(a=sqrt(5))``, i.e. uniform in ``±1/sqrt(fan_in)`` (fan_in: the
    projection's input size), each ``B`` zero, so the adapted model starts equal to the base."""
    names = sorted(n for n in shapes["layers"] if n.endswith(SUFFIX_A))
    keys = dict(zip(names, jax.random.split(key, max(len(names), 1))))
    out = {}
    for name, shape in shapes["layers"].items():
        if name.endswith(SUFFIX_A):
            bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))
            out[name] = jax.random.uniform(keys[name], shape, jnp.float32, -bound, bound)
        else:
            out[name] = jnp.zeros(shape, jnp.float32)
    return {"layers": out}


def merge(frozen: Any, adapters: Any) -> Any:
    """The model's params dict: the frozen base tree with the adapter leaves added to its
    ``"layers"`` (``frozen`` ``None``: ``adapters`` are the whole params, no LoRA)."""
    if frozen is None:
        return adapters
    return {**frozen, "layers": {**frozen["layers"], **adapters["layers"]}}


def adapt(eq: str, x: jax.Array, y: jax.Array, lp: dict, name: str, lora: LoraConfig,
          dropout_key: jax.Array | None = None) -> jax.Array:
    """``y + (alpha/rank) · (dropout(x) A) B`` when layer params ``lp`` hold adapters for weight
    ``name`` (else ``y``). ``eq``: the base projection (``"btd,dhq->bthq"``); ``x``, ``y``: its
    input and output (compute dtype, any sharding); ``dropout_key``: this layer's key when
    ``lora.dropout > 0`` and training (``None``: no dropout). Returns ``y``'s shape and dtype."""
    a = lp.get(name + SUFFIX_A)
    if a is None:
        return y
    lhs, _, out = operands(eq)
    w_in, w_out = _split_weight(eq)
    mid = "".join(c for c in lhs if c not in w_in) + "r"
    if dropout_key is not None and lora.dropout > 0:
        keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, list(WEIGHTS.values()).index(name)), 1.0 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
    h = project(f"{lhs},{w_in}r->{mid}", x, a)
    delta = project(f"{mid},r{w_out}->{out}", h, lp[name + SUFFIX_B])
    return y + (delta * lora.scale).astype(y.dtype)


def merged_weights(params: dict, lora: LoraConfig) -> dict:
    """``params`` with each adapted weight replaced by ``W + (alpha/rank) · A B`` (fp32) and the
    adapter leaves removed: the full model PEFT's ``merge_and_unload`` gives."""
    layers = dict(params["layers"])
    for target in lora.target_list:
        name = WEIGHTS[target]
        if name + SUFFIX_A not in layers:
            continue
        a, b = layers.pop(name + SUFFIX_A), layers.pop(name + SUFFIX_B)
        w_in, w_out = _split_weight(EQUATIONS[name])
        delta = jnp.einsum(f"L{w_in}r,Lr{w_out}->L{w_in}{w_out}", jnp.asarray(a, jnp.float32),
                           jnp.asarray(b, jnp.float32))
        layers[name] = jnp.asarray(layers[name], jnp.float32) + lora.scale * delta
    return {**params, "layers": layers}


def split(params: dict) -> tuple[dict, dict]:
    """``(base, adapters)``: the inverse of :func:`merge`."""
    layers = params["layers"]
    base = {**params, "layers": {n: v for n, v in layers.items() if not _is_adapter(n)}}
    return base, {"layers": {n: v for n, v in layers.items() if _is_adapter(n)}}


def _is_adapter(name: str) -> bool:
    """Whether the layer leaf ``name`` is a LoRA adapter (``..._lora_a`` / ``..._lora_b``)."""
    return name.endswith((SUFFIX_A, SUFFIX_B))

