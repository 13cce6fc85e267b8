"""Model families and the layers they share.

Each family is a folder (:mod:`~jaxcolossal.models.llama`, :mod:`~jaxcolossal.models.gpt2`,
:mod:`~jaxcolossal.models.gemma`) whose
``FAMILY`` is a :class:`~jaxcolossal.models.family.Family`: pure functions over a params dict, an
NNX module class, and its Hugging Face format. :data:`FAMILIES` registers them by ``model.type``;
the train step, the pipeline and the planner only talk to that record (:func:`get_family`), and
no generic code names a family. Shared layers are :mod:`jaxcolossal.models.layers`; reading and
writing Hugging Face folders is :mod:`jaxcolossal.models.hf_io`, PEFT adapters :mod:`jaxcolossal.models.peft`.
"""

import jax

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models import deepseek, gemma, gpt2, gpt_oss, llama
from jaxcolossal.models.family import Family, count_params, param_axes
from jaxcolossal.models.gemma import GemmaForCausalLM
from jaxcolossal.models.gpt2 import GPT2LMHeadModel
from jaxcolossal.models.layers import lora
from jaxcolossal.models.layers.vocab import padded_vocab_size
from jaxcolossal.models.llama import LlamaForCausalLM
from jaxcolossal.models.score_head import with_score_head

FAMILIES: dict[str, Family] = {f.name: with_score_head(f) for f in (llama.FAMILY, gpt2.FAMILY, deepseek.FAMILY,
                                                                 gemma.FAMILY, gpt_oss.FAMILY)}
"""``model.type`` -> its :class:`~jaxcolossal.models.family.Family`; adding a family is one line here. Each
takes ``model.num_labels`` (a reward model's score head in place of ``lm_head``:
:mod:`jaxcolossal.models.score_head`)."""


def get_family(cfg: ModelConfig) -> Family:
    """The :class:`~jaxcolossal.models.family.Family` implementing ``cfg.type``.

    Raises:
        ConfigError: an unknown model type.
    """
    if cfg.type not in FAMILIES:
        raise ConfigError(f"model.type={cfg.type!r}: allowed values are {sorted(FAMILIES)}")
    return FAMILIES[cfg.type]


def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _split_pairs(table: dict) -> tuple[dict, dict]:
    """A ``{name: (shape, axes)}`` tree as two trees, ``(shapes, axes)``."""
    return (jax.tree.map(lambda sa: sa[0], table, is_leaf=_is_pair), jax.tree.map(lambda sa: sa[1], table, is_leaf=_is_pair))


def param_layout(cfg: ModelConfig, tp: int = 1) -> tuple[int, dict, dict]:
    """``(padded vocab, shapes, logical axes)`` of every parameter of ``cfg``'s family, as two
    pytrees of tuples mirroring the params dict; no arrays are created."""
    family = get_family(cfg)
    vocab = family.padded_vocab_size(cfg, tp)
    return (vocab, *_split_pairs(family.param_shapes_and_axes(cfg, vocab)))


def adapter_layout(cfg: ModelConfig, shapes: dict, axes: dict) -> tuple[dict, dict]:
    """``(shapes, logical axes)`` of ``cfg.lora``'s adapters (:mod:`jaxcolossal.models.layers.lora`) for the
    base model's :func:`param_layout` trees (``cfg``: the model config), on every stacked-layer group
    (``{group: {name: shape}}``, groups of :data:`jaxcolossal.models.layers.lora.STACKS`)."""
    table = {g: {n: (shapes[g][n], axes[g][n]) for n in shapes[g]} for g in lora.STACKS if g in shapes}
    return _split_pairs(lora.adapter_shapes_and_axes(cfg.lora, table, cfg.lora_targets))


__all__ = ["adapter_layout", "param_layout", "Family", "LlamaForCausalLM", "GPT2LMHeadModel", "GemmaForCausalLM",
           "count_params",
           "param_axes", "padded_vocab_size", "get_family", "FAMILIES"]
