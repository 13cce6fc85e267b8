"""Model families.

Each family is a module exposing the same pure functions over a params dict —
``padded_vocab_size(cfg, tp)``, ``param_shapes_and_axes(cfg, vocab)``, ``init_params(cfg, key, tp)``,
``forward(params, tokens, cfg, shard, vocab_parallel)``, ``loss_sum(...)``, ``head_loss(...)`` and
``pipeline_stages(cfg, shard, vocab_parallel, positions)`` (the forward cut at a pipeline's stage
boundaries) — plus an NNX module class. The train step and the pipeline only talk to that
interface (:func:`get_family`); no generic code names a family.
"""

from types import ModuleType

import jax

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models import gpt2, llama, lora
from jaxcolossal.models.gpt2 import GPT2LMHeadModel
from jaxcolossal.models.llama import LlamaForCausalLM, count_params, padded_vocab_size, param_axes

FAMILIES = {"llama": llama, "gpt2": gpt2}


def get_family(cfg: ModelConfig) -> ModuleType:
    """The module implementing ``cfg.type``.

    Raises:
        ConfigError: an unknown model type.
    """
    if cfg.type not in FAMILIES:
        raise ConfigError(f"model.type={cfg.type!r}: allowed values are {sorted(FAMILIES)}")
    return FAMILIES[cfg.type]


def param_layout(cfg: ModelConfig, tp: int = 1) -> tuple[int, dict, dict]:
    """``(padded vocab, shapes, logical axes)`` of every parameter of ``cfg``'s family, as two
    pytrees of tuples mirroring the params dict; no arrays are created."""
    family = get_family(cfg)
    vocab = family.padded_vocab_size(cfg, tp)
    table = family.param_shapes_and_axes(cfg, vocab)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)
    shapes = jax.tree.map(lambda sa: sa[0], table, is_leaf=is_pair)
    axes = jax.tree.map(lambda sa: sa[1], table, is_leaf=is_pair)
    return vocab, shapes, axes


def adapter_layout(cfg: ModelConfig, shapes: dict, axes: dict) -> tuple[dict, dict]:
    """``(shapes, logical axes)`` of ``cfg.model.lora``'s adapters (:mod:`jaxcolossal.models.lora`)
    for the base model's :func:`param_layout` trees."""
    table = lora.adapter_shapes_and_axes(cfg.lora, {n: (shapes["layers"][n], axes["layers"][n]) for n in shapes["layers"]})
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)  # noqa: E731
    return (jax.tree.map(lambda sa: sa[0], table, is_leaf=is_pair), jax.tree.map(lambda sa: sa[1], table, is_leaf=is_pair))


__all__ = ["adapter_layout", "param_layout", "LlamaForCausalLM", "GPT2LMHeadModel", "count_params", "param_axes", "padded_vocab_size", "get_family", "FAMILIES"]
