"""The GPT-2 family (:mod:`~jaxcolossal.models.gpt2.model`) and its Hugging Face format
(:mod:`~jaxcolossal.models.gpt2.hf`)."""

from jaxcolossal.models.family import Family
from jaxcolossal.models.gpt2 import hf
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
from jaxcolossal.models.layers.vocab import padded_vocab_size

FAMILY = Family(
    name="gpt2", module=GPT2LMHeadModel, padded_vocab_size=padded_vocab_size,
    param_shapes_and_axes=param_shapes_and_axes, init_params=init_params, hidden_states=hidden_states,
    head_weight=head_weight, forward=forward, head_loss=head_loss, loss_sum=loss_sum,
    loss_and_stats=loss_and_stats, pipeline_stages=pipeline_stages, hf_architectures=hf.ARCHITECTURES,
    config_from_hf=hf.config_from_hf, config_to_hf=hf.config_to_hf, params_from_hf=hf.params_from_hf,
    params_to_hf=hf.params_to_hf, embedding="wte", init_from_keys=hf.INIT_FROM_KEYS)
"""The GPT-2 family's :class:`~jaxcolossal.models.family.Family` record."""

__all__ = ["FAMILY", "GPT2LMHeadModel", "forward", "head_loss", "head_weight", "hidden_states", "init_params",
           "loss_and_stats", "loss_sum", "padded_vocab_size", "param_shapes_and_axes", "pipeline_stages"]
