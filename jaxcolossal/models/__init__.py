"""Model families. Each exposes pure functions over a params dict plus an NNX module."""

from jaxcolossal.models.llama import LlamaForCausalLM, count_params, param_axes, padded_vocab_size

__all__ = ["LlamaForCausalLM", "count_params", "param_axes", "padded_vocab_size"]
