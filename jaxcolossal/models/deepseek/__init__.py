"""The DeepSeek family (:mod:`~jaxcolossal.models.deepseek.model`): DeepSeek-V3's multi-head latent
attention with the latent in the KV cache, yarn RoPE with mscale, and DeepSeek-MoE with V3's router
(group-limited sigmoid routing, the score-correction bias, ``routed_scaling_factor``, shared experts,
first dense layers); its Hugging Face format ``DeepseekV3ForCausalLM`` (:mod:`~jaxcolossal.models.deepseek.hf`)."""

from jaxcolossal.models.deepseek import hf, model
from jaxcolossal.models.deepseek.model import DeepseekV3ForCausalLM
from jaxcolossal.models.family import family_from

FAMILY = family_from("deepseek", model, hf, DeepseekV3ForCausalLM, embedding="embed_tokens")
"""The DeepSeek family's :class:`~jaxcolossal.models.family.Family` record."""

__all__ = ["FAMILY", "DeepseekV3ForCausalLM"]
