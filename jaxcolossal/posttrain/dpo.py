"""``training.objective=dpo``: Direct Preference Optimization (Rafailov et al., 2023), its IPO variant
(Azar et al., 2023) and conservative DPO (label smoothing), as TRL's ``DPOTrainer`` computes them
(trl 1.16, ``DPOTrainer._compute_loss``); registered in :data:`jaxcolossal.train.objective.OBJECTIVES`.

The batch holds preference pairs as interleaved rows (row ``2i`` chosen, ``2i + 1`` rejected:
:func:`jaxcolossal.data.preference.pair_rows`), whose loss masks cover the response tokens only;
the policy's and the reference's sequence log-probs are the masked sums of per-token log-probs
(:func:`jaxcolossal.posttrain.loss_terms.sequence_logps`), and the loss is the mean over the step's pairs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcolossal.config.derived import posttrain_beta, posttrain_loss_type
from jaxcolossal.posttrain.loss_terms import sequence_logps

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
"""TRL's ``DPOTrainer`` metric names, each a mean over the step's pairs (trl 1.16 ``_compute_loss``)."""


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_len, rejected_len,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[jax.Array, dict]:
    """Per-pair DPO loss and TRL's six metrics, each fp32 ``[P]`` (means over pairs are the step's).

    Args:
        chosen_logps, rejected_logps: the policy's sequence log-probs of each pair's responses.
        ref_chosen_logps, ref_rejected_logps: the reference model's (no gradient flows into them).
        chosen_len, rejected_len: response tokens of each (IPO's per-token averages; at least 1).
        beta: DPO's β (IPO's τ), > 0.
        loss_type: ``sigmoid``: ``-logσ(βΔ)``; with ``label_smoothing = ε`` conservative DPO
            ``-(1-ε)·logσ(βΔ) - ε·logσ(-βΔ)`` (Mitchell, 2023; TRL's ``sigmoid`` before 1.0, and
            its ``robust``/``aot`` spelling of ε), ``Δ = (π_c - ref_c) - (π_r - ref_r)``.
            ``ipo``: ``(Δ_c/|c| - Δ_r/|r| - 1/(2β))²`` with each log-ratio averaged over its
            response tokens (TRL 1.16's length-normalised IPO).

    Returns ``(loss [P], {name: [P]})`` with :data:`DPO_METRICS`: ``rewards/chosen = β·(π_c - ref_c)``,
    ``rewards/rejected`` likewise, ``rewards/accuracies = [reward_c > reward_r]``, ``rewards/margins =
    reward_c - reward_r``, ``logps/chosen = π_c``, ``logps/rejected = π_r`` (TRL's definitions).

    Raises:
        ValueError: an unknown ``loss_type``.
    """
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * delta)
        if label_smoothing:
            loss = loss - label_smoothing * jax.nn.log_sigmoid(-beta * delta)
    elif loss_type == "ipo":
        ipo_delta = chosen_ratio / jnp.maximum(chosen_len, 1.0) - rejected_ratio / jnp.maximum(rejected_len, 1.0)
        loss = (ipo_delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"posttrain.loss_type={loss_type!r}: expected sigmoid or ipo")
    rc, rr = jax.lax.stop_gradient(beta * chosen_ratio), jax.lax.stop_gradient(beta * rejected_ratio)
    metrics = {"rewards/chosen": rc, "rewards/rejected": rr, "rewards/accuracies": (rc > rr).astype(jnp.float32),
               "rewards/margins": rc - rr, "logps/chosen": jax.lax.stop_gradient(chosen_logps),
               "logps/rejected": jax.lax.stop_gradient(rejected_logps)}
    return loss, metrics


class Dpo:
    """The DPO objective over interleaved preference rows (module docstring).

    ``__call__(params, tokens, targets, ...)`` with int32 ``[2P, t]`` rows (``2i`` chosen, ``2i+1``
    rejected) and ``mask [2P, t]``: ``(sum over the P pairs of the loss, {metric: sum over pairs})``.
    ``reference``: the reference model's params dict (the frozen initial copy, or under LoRA the base
    without adapters): its log-probs are computed under ``stop_gradient`` in the same step.
    """

    name = "dpo"
    batch_fields: tuple = ()
    data_format = "preference"
    reads = "DPO reads preference pairs"
    evaluation = "objective"  # the held-out pairs' DPO loss and TRL metrics, against the reference
    reference_label = "DPO's"

    def __init__(self, family, cfg):
        self.family, self.cfg, self.post = family, cfg, cfg.posttrain

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None):
        # the phases: policy log-probs, reference log-probs (no gradient), the per-pair loss
        mask = mask.astype(jnp.float32)
        pol = sequence_logps(self.family, params, tokens, targets, mask, mcfg, shard, vocab_parallel, dropout_key)
        ref_params = jax.lax.stop_gradient(reference)
        ref = jax.lax.stop_gradient(sequence_logps(self.family, ref_params, tokens, targets, mask, mcfg, shard,
                                                   vocab_parallel))
        lens = jnp.sum(mask, axis=-1)
        p = self.post
        loss, metrics = dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], lens[0::2], lens[1::2], posttrain_beta(self.cfg),
                                 posttrain_loss_type(self.cfg), p.label_smoothing)
        return jnp.sum(loss), {k: jnp.sum(v) for k, v in metrics.items()}

    def count(self, inputs, mask=None):
        """The step's pairs (fp32 scalar): half its rows."""
        return jnp.asarray(inputs.shape[0] // 2, jnp.float32)

    def zero_stats(self) -> dict:
        """TRL's six metrics' sums at zero (fp32 scalars), the microbatch accumulation's start."""
        return {k: jnp.zeros((), jnp.float32) for k in DPO_METRICS}

    def metrics(self, stats: dict, count) -> dict:
        """TRL's six metrics: the step's sums over pairs divided by its pairs."""
        return {k: stats[k] / count for k in DPO_METRICS}

    @staticmethod
    def held_out_parts(val: float) -> tuple[str, str]:
        """``("held-out DPO loss", "X per pair")``: the held-out pairs' mean DPO loss ``val``."""
        return "held-out DPO loss", f"{val:.4f} per pair"

    @staticmethod
    def loader(data: Any, cfg, plan) -> Any:
        """The training loader: the preference format's pair loader ``data`` itself (off-policy)."""
        return data
