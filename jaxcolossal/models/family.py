"""The model-family interface: what the train step, the pipeline, the planner and the Hugging
Face reader and writer ask of a family, as one typed record (:class:`Family`).

A family is a folder, ``jaxcolossal/models/<family>/`` with ``model.py`` (pure functions over a
params dict and an NNX module) and ``hf.py`` (its Hugging Face ``config.json`` and key mapping),
whose ``__init__`` builds one :class:`Family`; :data:`jaxcolossal.models.FAMILIES` registers it
under its ``model.type``. Families import shared layers (:mod:`jaxcolossal.models.layers`), never
each other. docs/design.md ("Adding a model family") walks through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import jax
from flax import nnx

from jaxcolossal.models.layers.vocab import init_vocab_padded


@dataclass(frozen=True)
class Family:
    """One model family. Every field is required; the shapes are the family's own module doc's.

    Model (``cfg``: :class:`jaxcolossal.config.ModelConfig`; ``params``: the pure params dict,
    stacked layers ``[L, ...]``; ``shard``: a :data:`jaxcolossal.models.layers.vocab.Sharder`):

    * ``module``: the Flax NNX module class (``Module(cfg, rngs=..., tp=1)``).
    * ``padded_vocab_size(cfg, tp) -> int``; ``param_shapes_and_axes(cfg, vocab) -> {name: (shape,
      logical axes)}`` (no arrays); ``init_params(cfg, key, tp) -> params`` (fp32, jit-able).
    * ``hidden_states(params, tokens [b, t], cfg, shard, vocab_parallel, segment_ids, positions,
      ...) -> [b, t, d]``; ``head_weight(params, cfg) -> [d, v]``; ``forward(...) -> fp32 logits
      [b, t, v_padded]``.
    * ``head_loss``, ``loss_sum`` (:func:`jaxcolossal.models.layers.vocab.lm_loss` builds both) and
      ``loss_and_stats(params, tokens, targets, cfg, shard, vocab_parallel, mask, ...) ->
      (summed loss, stats)`` (``stats``: a mixture of experts' router statistics, ``{}`` otherwise).
    * ``pipeline_stages(cfg, shard, vocab_parallel, positions) -> (embed, layer_for, head)``: the
      forward cut at a pipeline's stage boundaries (:mod:`jaxcolossal.parallel.pipeline_executor`);
      ``final_norm(params, x [b, t, d], cfg) -> [b, t, d]``: the norm after the last layer (what a
      pipeline's last stage hands an objective's own head).

    Hugging Face (``jaxcolossal.models.hf_io`` reads and writes the folders):

    * ``hf_architectures``: ``{model_type: architecture class}`` of the forms it reads.
    * ``config_from_hf(config.json dict, model_type) -> ModelConfig``; ``config_to_hf(cfg) -> dict``.
    * ``params_from_hf(get, has, cfg) -> (params, used keys)``; ``params_to_hf(params, cfg) -> dict``.
    * ``embedding``: the name of the vocabulary-padded input embedding (``embed_tokens``, ``wte``).
    * ``init_from_keys``: the model keys, beyond the shared sizes, that ``model.init_from`` checks.
    * ``lora_b_from_hf(name, b [out_features, rank], cfg) -> {weight: [rank, *out]}`` and
      ``lora_b_to_hf(name, parts, cfg) -> [out_features, rank]``: one layer's PEFT LoRA B of the module
      adapting weight ``name``, where its output rows are not the weight's flattened outputs (permuted or
      fused rows, :mod:`jaxcolossal.models.peft`); ``None`` (the default): they are.

    KV-cached decoding (:mod:`jaxcolossal.generate`), ``None`` for a family without it (every registered
    family has it):

    * ``init_cache(cfg, batch, length, dtype) -> cache`` (a tree of ``[L, b, S, ...]`` arrays);
      ``cache_axes(cfg) -> `` the same tree of logical-axis tuples.
    * ``forward_cached(params, tokens [b, t], cache, index, positions [b, t], kv_valid [b, S], cfg,
      shard, last_only) -> (fp32 logits [b, t, v_padded], cache)``.
    """

    name: str
    module: type
    padded_vocab_size: Callable
    param_shapes_and_axes: Callable
    init_params: Callable
    hidden_states: Callable
    head_weight: Callable
    forward: Callable
    head_loss: Callable
    loss_sum: Callable
    loss_and_stats: Callable
    pipeline_stages: Callable
    final_norm: Callable
    hf_architectures: dict
    config_from_hf: Callable
    config_to_hf: Callable
    params_from_hf: Callable
    params_to_hf: Callable
    embedding: str
    init_from_keys: tuple
    init_cache: Callable | None = None
    cache_axes: Callable | None = None
    forward_cached: Callable | None = None
    lora_b_from_hf: Callable | None = None
    lora_b_to_hf: Callable | None = None


MODEL_FUNCTIONS = ("padded_vocab_size", "param_shapes_and_axes", "init_params", "hidden_states", "head_weight",
                   "forward", "head_loss", "loss_sum", "loss_and_stats", "pipeline_stages", "final_norm")
"""The :class:`Family` fields that a family's ``model`` module defines under the same names."""

DECODE_FUNCTIONS = ("init_cache", "cache_axes", "forward_cached")
"""The optional :class:`Family` fields of KV-cached decoding, from the family's ``model`` module when it has them."""

HF_FUNCTIONS = ("config_from_hf", "config_to_hf", "params_from_hf", "params_to_hf")
"""The :class:`Family` fields that a family's ``hf`` module defines under the same names."""

HF_LORA_FUNCTIONS = ("lora_b_from_hf", "lora_b_to_hf")
"""The optional :class:`Family` fields of PEFT's LoRA layout, from the family's ``hf`` module when it has them."""


def family_from(name: str, model: ModuleType, hf: ModuleType, module: type, embedding: str) -> Family:
    """The :class:`Family` of a family folder: its ``model`` module's :data:`MODEL_FUNCTIONS`, its ``hf``
    module's :data:`HF_FUNCTIONS` with ``ARCHITECTURES`` and ``INIT_FROM_KEYS`` (and :data:`HF_LORA_FUNCTIONS`
    where it has them), the NNX ``module``
    class and the name of its vocabulary-padded ``embedding``.

    Raises:
        TypeError: a function of the interface that the family does not define (named).
    """
    missing = [f"{m.__name__}.{f}" for m, names in ((model, MODEL_FUNCTIONS), (hf, HF_FUNCTIONS + ("ARCHITECTURES",
               "INIT_FROM_KEYS"))) for f in names if not hasattr(m, f)]
    if missing:
        raise TypeError(f"model family {name!r} lacks {', '.join(missing)} (jaxcolossal.models.family.Family)")
    return Family(name=name, module=module, **{f: getattr(model, f) for f in MODEL_FUNCTIONS},
                  hf_architectures=hf.ARCHITECTURES, **{f: getattr(hf, f) for f in HF_FUNCTIONS},
                  embedding=embedding, init_from_keys=hf.INIT_FROM_KEYS,
                  **{f: getattr(model, f, None) for f in DECODE_FUNCTIONS},
                  **{f: getattr(hf, f, None) for f in HF_LORA_FUNCTIONS})


def param_axes(model: nnx.Module) -> dict:
    """Pure dict of logical-axis tuples, one per parameter of ``model`` (any family)."""
    state = nnx.state(model, nnx.Param)
    return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["axes"]), state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def count_params(params: Any) -> int:
    """Number of parameter elements (padded vocabulary rows included)."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def stacked_params(module: nnx.Module, cfg: Any, table: dict, key: jax.Array, init_leaf: Callable,
                   min_keys: int = 0) -> None:
    """Set a family module's ``nnx.Param`` attributes from its ``param_shapes_and_axes`` table:
    ``embed_tokens``, the ``layers`` (and ``dense_layers``) stacks as ``nnx.Dict``, ``final_norm`` and,
    when untied, ``lm_head``; each drawn by ``init_leaf(key, name, shape, cfg)`` with its own key split
    from ``key`` (``max(min_keys, leaves)`` keys, in the table's order), its padded vocabulary rows zero
    (:func:`jaxcolossal.models.layers.vocab.init_vocab_padded`), its logical ``axes`` as metadata."""
    n_leaves = len(table["layers"]) + len(table.get("dense_layers", {})) + 3
    keys = iter(jax.random.split(key, max(min_keys, n_leaves)))

    def make(name, shape, axes):
        return nnx.Param(init_vocab_padded(init_leaf, next(keys), name, shape, axes, cfg), axes=axes)

    module.embed_tokens = make("embed_tokens", *table["embed_tokens"])
    module.layers = nnx.Dict({n: make(n, *sa) for n, sa in table["layers"].items()})
    if "dense_layers" in table:
        module.dense_layers = nnx.Dict({n: make(n, *sa) for n, sa in table["dense_layers"].items()})
    module.final_norm = make("final_norm", *table["final_norm"])
    if "lm_head" in table:
        module.lm_head = make("lm_head", *table["lm_head"])
