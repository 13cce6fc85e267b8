"""The sequence-classification score head (``model.num_labels=1``: reward models), for every family.

Transformers' ``*ForSequenceClassification`` models (``GenericForSequenceClassification``,
``GPT2ForSequenceClassification``) are the causal LM's backbone with its ``lm_head`` replaced by
``score = nn.Linear(hidden, num_labels, bias=False)`` (``score.weight [num_labels, d]``), applied to
the final-norm hidden states and read at each row's last non-pad token. Here the same change is made
to any family's params, outside the family (a family never knows about it):

* the params table (:func:`score_table`): ``lm_head`` dropped (no memory, no gradient; a tied
  embedding stays, as the input embedding), ``score`` added, fp32 ``[d, num_labels]`` with logical
  axes ``("embed", None)``, sharded through the rules table like every other leaf;
* a fresh init (:func:`with_score_params`): ``score`` drawn from ``normal(0, initializer_range)``, as
  transformers' ``_init_weights`` draws an ``nn.Linear`` it finds missing in a causal-LM checkpoint;
* the Hugging Face names: :data:`SEQCLS_ARCHITECTURES` (``model_type`` -> class) and the key
  ``score.weight`` (:mod:`jaxcolossal.models.hf_io` reads and writes them);
* the pooling (:func:`last_non_pad` / :func:`pooled_scores`): the rightmost position whose input
  token is not ``pad_token_id`` (transformers 5's ``(arange(t) * (ids != pad)).argmax(-1)``, which
  is 0 for a row of pads only).

:func:`with_score_head` wraps a :class:`~jaxcolossal.models.family.Family` so that its
``param_shapes_and_axes`` and ``init_params`` apply the first two when ``cfg.num_labels`` is set and
are the family's own otherwise; :data:`jaxcolossal.models.FAMILIES` registers every family so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.family import Family

SCORE = "score"
"""The params-dict name of the score head, fp32 ``[d, num_labels]`` (transformers' ``score.weight.T``)."""

SCORE_HF_KEY = "score.weight"
"""The score head's Hugging Face key, ``[num_labels, d]``."""

SCORE_AXES = ("embed", None)
"""The score head's logical axes: its rows follow the hidden dimension's rule, its one column is whole."""

SEQCLS_ARCHITECTURES = {
    "llama": "LlamaForSequenceClassification", "mistral": "MistralForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification", "qwen3": "Qwen3ForSequenceClassification",
    "phi3": "Phi3ForSequenceClassification", "olmo2": "Olmo2ForSequenceClassification",
    "mixtral": "MixtralForSequenceClassification", "qwen3_moe": "Qwen3MoeForSequenceClassification",
    "gpt2": "GPT2ForSequenceClassification", "deepseek_v3": "DeepseekV3ForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification", "gemma3_text": "Gemma3TextForSequenceClassification",
    "gpt_oss": "GptOssForSequenceClassification",
}
"""Hugging Face ``model_type`` -> its sequence-classification class in transformers 5 (each one's
backbone keys are the causal LM's: ``model.*``, GPT-2's ``transformer.*``)."""


def seqcls_architecture(model_type: str) -> str:
    """The sequence-classification class of an exported ``model_type`` (:data:`SEQCLS_ARCHITECTURES`).

    Raises:
        ConfigError: a ``model_type`` with none in transformers (one line)."""
    if model_type not in SEQCLS_ARCHITECTURES:
        raise ConfigError(f"model.num_labels: transformers has no sequence-classification class for "
                          f"model_type={model_type!r} (known: {', '.join(SEQCLS_ARCHITECTURES)})")
    return SEQCLS_ARCHITECTURES[model_type]


def is_seqcls(hf: dict) -> bool:
    """Whether a ``config.json`` dict is a sequence-classification model's (its ``architectures``)."""
    return any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures") or [])


def score_table(table: dict, cfg: ModelConfig) -> dict:
    """A family's ``{name: (shape, axes)}`` table with the score head (``cfg.num_labels > 0``):
    ``lm_head`` dropped, ``score`` ``([d, num_labels], ("embed", None))`` added; unchanged otherwise."""
    if not cfg.num_labels:
        return table
    out = {k: v for k, v in table.items() if k != "lm_head"}
    out[SCORE] = ((cfg.hidden_size, cfg.num_labels), SCORE_AXES)
    return out


def init_score(cfg: ModelConfig, key: jax.Array) -> jax.Array:
    """A fresh score head, fp32 ``[d, num_labels]`` from ``normal(0, initializer_range)`` (transformers'
    ``_init_weights`` of ``nn.Linear``)."""
    return cfg.initializer_range * jax.random.normal(key, (cfg.hidden_size, cfg.num_labels), jnp.float32)


def with_score_params(params: dict, cfg: ModelConfig, key: jax.Array) -> dict:
    """``params`` (a causal LM's dict) with ``lm_head`` dropped and a fresh ``score`` (:func:`init_score`)
    when ``cfg.num_labels > 0`` and it has none; unchanged otherwise. Works on jax or numpy arrays."""
    if not cfg.num_labels or SCORE in params:
        return params
    out = {k: v for k, v in params.items() if k != "lm_head"}
    out[SCORE] = init_score(cfg, key)
    return out


def with_score_head(family: Family) -> Family:
    """``family`` whose ``param_shapes_and_axes(cfg, vocab)`` and ``init_params(cfg, key, tp)`` give the
    score-head layout when ``cfg.num_labels > 0`` (:func:`score_table`, :func:`with_score_params`; the
    score drawn from ``fold_in(key, 1_000_003)``, apart from the family's own keys) and the family's
    own layout otherwise."""
    table, init = family.param_shapes_and_axes, family.init_params

    def param_shapes_and_axes(cfg, vocab):
        return score_table(table(cfg, vocab), cfg)

    def init_params(cfg, key, tp=1):
        params = init(cfg, key, tp)
        return with_score_params(params, cfg, jax.random.fold_in(key, 1_000_003)) if cfg.num_labels else params

    return dataclasses.replace(family, param_shapes_and_axes=param_shapes_and_axes, init_params=init_params)


def last_non_pad(tokens: jax.Array, pad_id: int) -> jax.Array:
    """int32 ``[b]``: each row's rightmost position whose token is not ``pad_id`` (0 for a row of pads
    only), of int ``tokens [b, t]`` (transformers' ``last_non_pad_token``, any padding side)."""
    idx = jnp.arange(tokens.shape[-1], dtype=jnp.int32)
    return jnp.argmax(idx * (tokens != pad_id).astype(jnp.int32), axis=-1).astype(jnp.int32)


def pooled_scores(hidden: jax.Array, score: jax.Array, tokens: jax.Array, pad_id: int) -> jax.Array:
    """fp32 ``[b, num_labels]``: the score head at each row's last non-pad token (:func:`last_non_pad`),
    as transformers' ``*ForSequenceClassification.forward`` pools its logits. ``hidden``: the family's
    final-norm hidden states ``[b, t, d]`` (any float dtype); ``score`` ``[d, num_labels]``; ``tokens``
    int ``[b, t]``. The hidden row is gathered first and the head applied in fp32."""
    at = last_non_pad(tokens, pad_id)
    h = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0]  # [b, d]
    return jnp.einsum("bd,dl->bl", h.astype(jnp.float32), score.astype(jnp.float32))
