"""The GPT-2 family (:mod:`~jaxcolossal.models.gpt2.model`) and its Hugging Face format
(:mod:`~jaxcolossal.models.gpt2.hf`)."""

from jaxcolossal.models.family import family_from
from jaxcolossal.models.gpt2 import hf, model
from jaxcolossal.models.gpt2.model import (
    GPT2LMHeadModel,
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

FAMILY = family_from("gpt2", model, hf, GPT2LMHeadModel, embedding="wte")
"""The GPT-2 family's :class:`~jaxcolossal.models.family.Family` record."""

__all__ = ["FAMILY", "GPT2LMHeadModel", "forward", "head_loss", "head_weight", "hidden_states", "init_params",
           "loss_and_stats", "loss_sum", "param_shapes_and_axes", "pipeline_stages"]
