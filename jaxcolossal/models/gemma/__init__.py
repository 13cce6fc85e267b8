"""The Gemma family: Gemma 2 and Gemma 3 text (:mod:`~jaxcolossal.models.gemma.model`), and its Hugging
Face format (:mod:`~jaxcolossal.models.gemma.hf`: ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``)."""

from jaxcolossal.models.family import family_from
from jaxcolossal.models.gemma import hf, model
from jaxcolossal.models.gemma.model import (
    GemmaForCausalLM,
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

FAMILY = family_from("gemma", model, hf, GemmaForCausalLM, embedding="embed_tokens")
"""The Gemma family's :class:`~jaxcolossal.models.family.Family` record."""

__all__ = ["FAMILY", "GemmaForCausalLM", "forward", "head_loss", "head_weight", "hidden_states", "init_params",
           "loss_and_stats", "loss_sum", "param_shapes_and_axes", "pipeline_stages"]
