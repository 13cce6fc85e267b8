"""Sampling from a causal LM: the KV-cached batched sampler (:mod:`~jaxcolossal.generate.sampler`,
:mod:`~jaxcolossal.generate.sampling`), the ids that end a row (:mod:`~jaxcolossal.generate.eos`), the
old windowed sampler kept as a baseline (:mod:`~jaxcolossal.generate.windowed`) and
:func:`~jaxcolossal.generate.text.printable`."""

from jaxcolossal.generate.eos import EosIds, eos_ids, run_eos_ids
from jaxcolossal.generate.sampler import (
           Generated,
           data_shards,
           generate,
           left_align,
           make_generator,
           pad_batch,
           pad_prompts,
           training_param_specs,
)
from jaxcolossal.generate.sampling import Sampling, next_token
from jaxcolossal.generate.text import printable
from jaxcolossal.generate.windowed import sample_tokens

__all__ = ["EosIds", "Generated", "Sampling", "data_shards", "eos_ids", "generate", "left_align", "make_generator",
           "next_token", "pad_batch", "pad_prompts", "printable", "run_eos_ids", "sample_tokens",
           "training_param_specs"]
