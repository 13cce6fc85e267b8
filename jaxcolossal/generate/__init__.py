"""Sampling from a causal LM: the KV-cached batched sampler (:mod:`~jaxcolossal.generate.sampler`,
:mod:`~jaxcolossal.generate.sampling`), the old windowed one kept as a baseline
(:mod:`~jaxcolossal.generate.windowed`) and :func:`~jaxcolossal.generate.text.printable`."""

from jaxcolossal.generate.sampler import (
           Generated,
           generate,
           left_align,
           make_generator,
           pad_prompts,
           training_param_specs,
)
from jaxcolossal.generate.sampling import Sampling, next_token
from jaxcolossal.generate.text import printable
from jaxcolossal.generate.windowed import sample_tokens

__all__ = ["Generated", "Sampling", "generate", "left_align", "make_generator", "next_token", "pad_prompts",
           "printable", "sample_tokens", "training_param_specs"]
