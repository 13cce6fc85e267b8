"""Post-training's terms in the memory model: the frozen reference copy that DPO and GRPO (``beta > 0``)
hold in the train state, and GRPO's rollout phase (:mod:`jaxcolossal.posttrain.rollout`), per device.

A GRPO iteration runs three programs on the training mesh while the whole train state stays resident
(params, fp32 master and optimizer state, the reference): the sampler (prefill and KV-cached decode
loop, :func:`jaxcolossal.generate.make_generator`), the per-token log-probs of the old policy and the
reference (a forward of the rollout rows through the chunked log-prob path), and the train step. The
planner's GRPO peak is ``max(step peak, rollout peak)``:

* the step peak: :func:`jaxcolossal.memory.budget.device_need`'s, the reference counted in its state;
* the rollout peak: the resident state + the sampler's temporaries + the rollout batch, where the
  sampler's temporaries are, as XLA:GPU lays them out (tests/gpu_compile/test_grpo_compile.py, the
  Llama-3-8B shape on 8 H200s):

  - the KV cache twice (:func:`kv_cache_bytes`: the decode loop's carry, read and written in place,
    keeps up to a second cache-sized buffer live beside it, a key cache in the attention's layout);
  - the prefill's fp32 attention scores of one layer: ``rows × heads/tp × (P + C) × P × 4`` bytes (the
    prompts attend over the whole cache's slots);
  - under ZeRO-3 one layer's weights gathered whole (compute dtype, split over tp only).

The log-prob program is a forward (no residuals kept) of the same rows the step differentiates, so the
step's peak bounds it; it is not modelled on its own.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxcolossal.config import BYTES_PER_PARAM, COMPUTE_DTYPES, Config
from jaxcolossal.config.derived import grpo_generation_batch, grpo_prompt_length, holds_reference, rollout_reshards, rollout_tp
from jaxcolossal.memory.placement import local_elements
from jaxcolossal.models import get_family, param_layout
from jaxcolossal.parallel.decode_layout import decode_mesh_shape, decode_spec
from jaxcolossal.parallel.mesh import DATA_AXES, entry_axes
from jaxcolossal.parallel.sharding import RULES, is_shape, logical_to_spec, shard_bytes

ROLLOUT_FIELDS = ("inputs", "targets", "loss_mask", "segment_ids", "positions", "advantages", "old_logps",
                  "ref_logps", "tokens_per_step")
"""The rollout batch's fields: each ``[B, seq_len]``, int32 or fp32 (4 bytes), split over the data axes."""


def reference_bytes(cfg: Config, shapes: Any, specs: Any, mesh_shape: Mapping[str, int]) -> int:
    """Per-device bytes of the frozen reference copy (the initial params in the compute dtype, sharded
    like the params: ``specs.params`` of the base model's ``shapes``), or 0 when the state holds none
    (SFT, GRPO with ``beta = 0``, a LoRA base as the reference: :func:`holds_reference`)."""
    if not holds_reference(cfg):
        return 0
    return sum(jax.tree.leaves(local_elements(shapes, specs.params, mesh_shape))) * \
        BYTES_PER_PARAM[cfg.precision.mode]["p"]


def kv_cache_slot(cfg: Config) -> tuple[str, bool]:
    """What one slot (token) of the sampler's cache holds, read from the family's ``init_cache``: the
    layers and each array's numbers per layer (LLaMA ``"2 layers × (k 2×32 + v 2×32)"``: kv heads × head
    dim; DeepSeek ``"3 layers × (latent 512 + k_rope 64)"``), and whether the family's ``cache_axes``
    split any of it over tp."""
    family = get_family(cfg.model)
    cache = jax.eval_shape(lambda: family.init_cache(cfg.model, 1, 1, jnp.float32))
    flat = jax.tree_util.tree_flatten_with_path(cache)[0]
    names = {}
    for path, x in flat:  # each array [L, b, S, ...] of each stack of layers
        names.setdefault(str(getattr(path[-1], "key", path[-1])), "×".join(map(str, x.shape[3:])) or "1")
    layers = sum(x.shape[0] for path, x in flat if str(getattr(path[-1], "key", path[-1])) == next(iter(names)))
    axes = jax.tree.leaves(family.cache_axes(cfg.model), is_leaf=lambda x: isinstance(x, tuple))
    over_tp = any("tp" in entry_axes(e) for a in axes for e in logical_to_spec(a, RULES) if e is not None)
    return f"{layers} layers × (" + " + ".join(f"{n} {d}" for n, d in names.items()) + ")", over_tp


def cache_rows(cfg: Config, data: int) -> int:
    """The sampler's cache rows for a GRPO rollout: the generation batch
    (:func:`~jaxcolossal.config.derived.grpo_generation_batch`), or with refill ``posttrain.rollout_slots``
    rounded up to a multiple of the sampler's ``data`` shards, whichever is fewer."""
    rows, slots = grpo_generation_batch(cfg), cfg.posttrain.rollout_slots
    return min(rows, -(-slots // data) * data) if slots else rows


def kv_cache_bytes(cfg: Config, mesh_shape: Mapping[str, int]) -> int:
    """Per-device bytes of the sampler's KV cache for a GRPO rollout: :func:`cache_rows` rows (the
    generation batch, ``batch_size`` by default, or the refill's slots) × ``P + C``
    slots (the prompt width :func:`grpo_prompt_length` and ``max_completion_length``) × what a slot
    holds (:func:`kv_cache_slot`: LLaMA's layers × 2 × kv heads × head dim, DeepSeek's layers × (latent +
    rotary key)) × the compute dtype's bytes, each leaf split as the rules table splits the family's
    ``cache_axes`` (the rows over the data axes, the kv heads over tp)."""
    t, po = cfg.training, cfg.posttrain
    family = get_family(cfg.model)
    dtype = COMPUTE_DTYPES[cfg.precision.mode]
    slots = grpo_prompt_length(cfg) + po.max_completion_length
    cache = jax.eval_shape(lambda: family.init_cache(cfg.model, cache_rows(cfg, _data_size(mesh_shape)), slots, dtype))
    axes = family.cache_axes(cfg.model)
    per_leaf = jax.tree.map(lambda a, x: shard_bytes(x.shape, x.dtype, logical_to_spec(a, RULES), mesh_shape),
                            axes, cache, is_leaf=lambda x: isinstance(x, tuple))
    return sum(jax.tree.leaves(per_leaf))


def _data_size(mesh_shape: Mapping[str, int]) -> int:
    return math.prod(mesh_shape.get(a, 1) for a in DATA_AXES)


def _gathered_layer_bytes(cfg: Config, shapes: Any, mesh_shape: Mapping[str, int]) -> int:
    """ZeRO-3 over a data group > 1: one layer's weights gathered whole for its forward (the compute
    dtype, split over tp only); 0 otherwise."""
    if cfg.parallel.zero_stage < 3 or _data_size(mesh_shape) == 1:
        return 0
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)[0]
    per_layer = sum(math.prod(s) // s[0] for path, s in flat
                    if any(getattr(k, "key", None) == "layers" for k in path))
    return per_layer * BYTES_PER_PARAM[cfg.precision.mode]["p"] // mesh_shape.get("tp", 1)


def decode_shape(cfg: Config, mesh_shape: Mapping[str, int]) -> dict[str, int]:
    """The mesh shape the rollout's sampler runs on: the decode layout's
    (:func:`jaxcolossal.parallel.decode_layout.decode_mesh_shape`, ``posttrain.rollout_tp`` or
    :func:`~jaxcolossal.config.derived.rollout_tp` within ``offload.devices_per_host``), or the
    training mesh's where the rollout does not reshard (:func:`~jaxcolossal.config.derived.rollout_reshards`)."""
    n = math.prod(mesh_shape.values())
    tp = rollout_tp(cfg, n, cfg.offload.devices_per_host)
    if not rollout_reshards(cfg, mesh_shape, tp):
        return dict(mesh_shape)
    return decode_mesh_shape(n, tp, mesh_shape.get("ep", 1))


def decode_copy_bytes(cfg: Config, dshape: Mapping[str, int]) -> int:
    """Per-device bytes of the params' decode copy: each base param in the compute dtype, split as
    :func:`~jaxcolossal.parallel.decode_layout.decode_spec` splits its rules-table spec over the
    decode mesh ``dshape`` (tp, the experts over ep; whole over the data axes); 0 on the training
    layout. LoRA's adapters ride along and are not counted (rank × (in + out) a layer)."""
    if cfg.posttrain.rollout_layout != "decode":
        return 0
    _, shapes, axes = param_layout(cfg.model, dshape.get("tp", 1))
    flat_s = jax.tree.leaves(shapes, is_leaf=is_shape)
    flat_a = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    total = 0
    for shape, ax in zip(flat_s, flat_a):
        spec = decode_spec(logical_to_spec(ax, RULES), tuple(shape), dshape)
        split = math.prod(dshape[a] for e in spec for a in entry_axes(e))
        total += math.prod(shape) // split
    return total * BYTES_PER_PARAM[cfg.precision.mode]["p"]


def rollout_need(cfg: Config, shapes: Any, mesh_shape: Mapping[str, int], state: int) -> dict:
    """GRPO's rollout phase per device (module docstring), bytes: ``decode_copy`` (the params in the
    decode layout, :func:`decode_copy_bytes`), ``kv_cache`` (one cache), ``scores`` (the prefill's fp32
    attention scores of one layer), ``gathered`` (ZeRO-3's gathered layer, on the training layout
    only), ``temporaries`` (the sampler's: twice the cache + scores + gathered), ``batch`` (the rollout
    batch's :data:`ROLLOUT_FIELDS`) and ``total`` (``state`` — the resident train state, the reference
    included — + decode copy + temporaries + batch); ``decode_shape``, the sampler's mesh shape.
    ``shapes``: the base model's param shapes; ``mesh_shape``: the training mesh's."""
    t, m = cfg.training, cfg.model
    dshape = decode_shape(cfg, mesh_shape)
    data, tp = _data_size(dshape), dshape.get("tp", 1)
    rows = max(1, cache_rows(cfg, data) // data)
    prompt = grpo_prompt_length(cfg)
    slots = prompt + cfg.posttrain.max_completion_length
    kv = kv_cache_bytes(cfg, dshape)
    scores = rows * max(1, m.num_attention_heads // tp) * slots * prompt * jnp.dtype(jnp.float32).itemsize
    copy = decode_copy_bytes(cfg, dshape) if rollout_reshards(cfg, mesh_shape, dshape["tp"]) else 0
    gathered = 0 if copy else _gathered_layer_bytes(cfg, shapes, mesh_shape)
    temporaries = 2 * kv + scores + gathered
    batch = len(ROLLOUT_FIELDS) * max(1, t.batch_size // _data_size(mesh_shape)) * t.seq_len * 4
    return {"decode_copy": copy, "kv_cache": kv, "scores": scores, "gathered": gathered, "temporaries": temporaries,
            "batch": batch, "total": state + copy + temporaries + batch, "decode_shape": dshape}
