"""The LLaMA family (:mod:`~jaxcolossal.models.llama.model`), with the mixtures of experts on its
attention (Mixtral, Qwen3-MoE, DeepSeek-style layers), and its Hugging Face format
(:mod:`~jaxcolossal.models.llama.hf`, :mod:`~jaxcolossal.models.llama.hf_moe`)."""

from jaxcolossal.models.family import family_from
from jaxcolossal.models.llama import hf, model
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

FAMILY = family_from("llama", model, hf, LlamaForCausalLM, embedding="embed_tokens")
"""The LLaMA family's :class:`~jaxcolossal.models.family.Family` record."""

__all__ = ["FAMILY", "LlamaForCausalLM", "forward", "head_loss", "head_weight", "hidden_states", "init_params",
           "loss_and_stats", "loss_sum", "param_shapes_and_axes", "pipeline_stages"]
