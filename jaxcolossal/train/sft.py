"""``training.objective=sft``: the language-model objective of pre-training and supervised
fine-tuning, beside the step that differentiates it (:mod:`jaxcolossal.train.step`); registered in
:data:`jaxcolossal.train.objective.OBJECTIVES`.

The loss is the family's own ``loss_and_stats`` (the summed next-token cross-entropy over the
masked-in tokens, and a mixture of experts' router statistics), divided by the step's token count
(:func:`jaxcolossal.posttrain.loss_terms.token_count`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxcolossal.models.layers import moe
from jaxcolossal.posttrain.loss_terms import token_count

Metrics = dict[str, Any]


def moe_metrics(stats: dict, cfg) -> Metrics:
    """A mixture of experts' step metrics from the router statistics summed over the microbatches
    (:func:`jaxcolossal.models.layers.moe.finish`'s): ``moe_aux_loss`` (in
    ``model.router_aux_loss_form``) and ``moe_z_loss``, means over the microbatches,
    ``moe_dropped_share`` (of the routed (token, expert) slots) and ``expert_load`` (fp32 ``[E]``:
    each expert's share of the slots, over all MoE layers). ``{}`` for a dense model."""
    if not stats:
        return {}
    per = cfg.training.gradient_accumulation_steps
    load = stats["expert_load"]
    return {"moe_aux_loss": stats["moe_aux_loss"] / per, "moe_z_loss": stats["moe_z_loss"] / per,
            "moe_dropped_share": stats["moe_dropped"] / jnp.maximum(stats["moe_slots"], 1.0),
            "expert_load": load / jnp.maximum(jnp.sum(load), 1.0)}


class Sft:
    """The language-model objective: the family's ``loss_and_stats`` (summed cross-entropy, and a
    mixture of experts' router statistics), the mean over the step's masked-in tokens.

    ``__call__(params, tokens, targets, ...)`` with int32 ``[b, t]`` rows and an optional loss
    ``mask [b, t]``: ``(summed loss, router statistics)`` (``{}`` for a dense model).
    """

    name = "sft"
    batch_fields: tuple = ()
    data_format = None  # any pre-training or SFT format: text, jsonl, parquet, datasets, chat
    reads = "pre-training and SFT read token windows or conversations"
    evaluation = "loss"  # the language-model loss over the fixed held-out batches
    reference_label = ""  # no reference model

    def __init__(self, family, cfg):
        self.family, self.cfg = family, cfg

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None):
        extra = {} if dropout_key is None else {"dropout_key": dropout_key}
        return self.family.loss_and_stats(params, tokens, targets, mcfg, shard, vocab_parallel, mask,
                                          segment_ids=segment_ids, positions=positions, **extra)

    def count(self, inputs, mask=None, fields=None):
        """The step's tokens, or its masked-in tokens (fp32 scalar: :func:`token_count`)."""
        return token_count(inputs, mask)

    def zero_stats(self) -> dict:
        """A mixture of experts' router statistics at zero; ``{}`` for a dense model."""
        return moe.zero_stats(self.cfg.model) if self.cfg.model.moe else {}

    def metrics(self, stats: dict, count) -> dict:
        """A mixture of experts' step metrics (:func:`moe_metrics`); ``{}`` for a dense model."""
        return moe_metrics(stats, self.cfg)

    @staticmethod
    def held_out_parts(val: float) -> tuple[str, str]:
        """``("validation loss", "X nats/token")``: the mean loss ``val`` over the held-out tokens."""
        return "validation loss", f"{val:.4f} nats/token"

    @staticmethod
    def loader(data: Any, cfg, plan) -> Any:
        """The training loader: the data format's own ``data`` (windows, conversations)."""
        return data
