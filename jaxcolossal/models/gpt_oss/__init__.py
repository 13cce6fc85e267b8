"""The GPT-OSS family (:mod:`~jaxcolossal.models.gpt_oss.model`: attention sinks, alternating sliding and
full layers, a mixture of biased experts with the clamped SwiGLU) and its Hugging Face format
(:mod:`~jaxcolossal.models.gpt_oss.hf`: ``GptOssForCausalLM``)."""

from jaxcolossal.models.family import family_from
from jaxcolossal.models.gpt_oss import hf, model
from jaxcolossal.models.gpt_oss.model import (
    GptOssForCausalLM,
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

FAMILY = family_from("gpt_oss", model, hf, GptOssForCausalLM, embedding="embed_tokens")
"""The GPT-OSS family's :class:`~jaxcolossal.models.family.Family` record."""

__all__ = ["FAMILY", "GptOssForCausalLM", "forward", "head_loss", "head_weight", "hidden_states", "init_params",
           "loss_and_stats", "loss_sum", "param_shapes_and_axes", "pipeline_stages"]
