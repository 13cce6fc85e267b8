"""The LLaMA family (:mod:`~jaxcolossal.models.llama.model`), with the mixtures of experts on its
attention (Mixtral, Qwen3-MoE, DeepSeek-style layers), and its Hugging Face format
(:mod:`~jaxcolossal.models.llama.hf`, :mod:`~jaxcolossal.models.llama.hf_moe`)."""

from jaxcolossal.models.family import Family
from jaxcolossal.models.layers.vocab import padded_vocab_size
from jaxcolossal.models.llama import hf
from jaxcolossal.models.llama.model import (
    LlamaForCausalLM,
    forward,
    head_loss,
    head_weight,
    hidden_states,
    init_params,
    loss_and_stats,
    loss_sum,
    param_shapes_and_axes,
    pipeline_stages,
)

FAMILY = Family(
    name="llama", module=LlamaForCausalLM, padded_vocab_size=padded_vocab_size,
    param_shapes_and_axes=param_shapes_and_axes, init_params=init_params, hidden_states=hidden_states,
    head_weight=head_weight, forward=forward, head_loss=head_loss, loss_sum=loss_sum,
    loss_and_stats=loss_and_stats, pipeline_stages=pipeline_stages, hf_architectures=hf.ARCHITECTURES,
    config_from_hf=hf.config_from_hf, config_to_hf=hf.config_to_hf, params_from_hf=hf.params_from_hf,
    params_to_hf=hf.params_to_hf, embedding="embed_tokens", init_from_keys=hf.INIT_FROM_KEYS)
"""The LLaMA family's :class:`~jaxcolossal.models.family.Family` record."""

__all__ = ["FAMILY", "LlamaForCausalLM", "forward", "head_loss", "head_weight", "hidden_states", "init_params",
           "loss_and_stats", "loss_sum", "padded_vocab_size", "param_shapes_and_axes", "pipeline_stages"]
