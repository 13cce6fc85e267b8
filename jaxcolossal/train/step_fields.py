"""What the train step adds to an objective's microbatches and does with its statistics, shared by the
plain step (:mod:`jaxcolossal.train.step`) and the pipelined one (:mod:`jaxcolossal.train.pipeline_objective`):
the per-microbatch token counts an objective asks for (``step_fields``), and the data shards' statistics
combined (:func:`shard_sum`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

SHARD_AXIS = "data_shard"
"""The name of the vmapped data-shard axis of the per-shard gradients (an objective's collective over
the shards of one microbatch names it)."""


def microbatch_tokens(mask: jax.Array) -> jax.Array:
    """Each microbatch's masked-in tokens over all its data shards, repeated on its rows: fp32
    ``[n, k, b, t]`` from the split loss mask ``[n, k, b, t]`` (data shard, microbatch, rows)."""
    per_microbatch = jnp.sum(mask, axis=(0, 2, 3))
    return jnp.broadcast_to(per_microbatch[None, :, None, None], mask.shape)


def add_step_fields(objective: Any, aux: dict) -> dict:
    """``aux`` (the split batch, ``[n, k, b, ...]``) with the step fields ``objective.step_fields`` names:
    ``microbatch_tokens`` (each microbatch's loss tokens) and ``microbatch_chosen_tokens`` (those of the
    chosen rows of preference pairs: rows ``2i``)."""
    needed = getattr(objective, "step_fields", ())
    aux = dict(aux)
    if "microbatch_tokens" in needed:
        aux["microbatch_tokens"] = microbatch_tokens(aux["mask"])
    if "microbatch_chosen_tokens" in needed:
        chosen = (jnp.arange(aux["mask"].shape[2]) % 2 == 0).astype(jnp.float32)[None, None, :, None]
        aux["microbatch_chosen_tokens"] = microbatch_tokens(aux["mask"] * chosen)
    return aux


def shard_sum(objective: Any, stats: dict) -> dict:
    """The per-shard statistics ``[N, ...]`` combined over the data shards: summed, or by the objective's
    own reduction (``shard_reductions``: GRPO's ``clip_ratio/low_min`` is a min)."""
    special = getattr(objective, "shard_reductions", {})
    if not special:
        return jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)
    return {k: special.get(k, jnp.sum)(a, axis=0) for k, a in stats.items()}
