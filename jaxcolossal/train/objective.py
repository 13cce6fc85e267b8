"""Training objectives as plug-ins: what the one train step (:mod:`jaxcolossal.train.step`)
differentiates, looked up by name in one registry (:data:`OBJECTIVES`).

Post-training adds an *objective* on the same state, sharding, step and loop, not a second trainer:
``training.objective`` picks it (:func:`make_objective`), and the step calls it where it called the
family's language-model loss. Each objective is one file and one line here:

* ``sft`` (:mod:`jaxcolossal.train.sft`, beside the step): the summed next-token cross-entropy
  over the (masked-in) tokens, divided by the step's token count. Pre-training and SFT.
* ``dpo`` (:mod:`jaxcolossal.posttrain.dpo`): Direct Preference Optimization and TRL's 14 other
  preference losses (IPO, robust, AOT, APO, ...) over interleaved preference pairs, as TRL's ``DPOTrainer``.
* ``grpo`` (:mod:`jaxcolossal.posttrain.grpo`): Group Relative Policy Optimization, DAPO and
  Dr. GRPO over completions sampled from the policy, as TRL's ``GRPOTrainer``.
* ``reward`` (:mod:`jaxcolossal.posttrain.reward`): a reward model's score head on preference pairs,
  as TRL's ``RewardTrainer``.

The terms they share (sequence log-probs, the k3 KL estimator, the normalisers) are
:mod:`jaxcolossal.posttrain.loss_terms`. Each objective's ``data_format`` is the config's check of
``training.objective`` against ``data.format``: this module declares it to the config floor
(:func:`jaxcolossal.config.objective_checks.declare_objective`) when the package is imported.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import jax

from jaxcolossal.config import Config
from jaxcolossal.config.objective_checks import declare_objective
from jaxcolossal.posttrain.dpo import Dpo
from jaxcolossal.posttrain.grpo import Grpo
from jaxcolossal.posttrain.reward import Reward
from jaxcolossal.train.sft import Sft


class Objective(Protocol):
    """What the step, the loop and the config's checks ask of an objective.

    Called as ``objective(params, tokens, targets, mcfg, shard, vocab_parallel, mask, segment_ids,
    positions, dropout_key=None, reference=None, **fields) -> (summed loss, stats)`` inside the step's
    trace: ``tokens``/``targets`` int32 ``[b, t]``, ``mask`` ``[b, t]`` or None, ``fields`` the batch's
    arrays named in :attr:`batch_fields` (each ``[b, ...]``: GRPO's ``[b, t]``, DPO's precomputed reference
    log-probs ``[b, 1]``; split into microbatches like the tokens),
    ``reference`` the reference model's params (or None); the summed loss is an fp32 scalar and
    ``stats`` a dict of fp32 arrays that the step sums over data shards and microbatches. The step
    divides the summed loss by :meth:`count` over the whole step and reports :meth:`metrics`.
    """

    name: ClassVar[str]
    """``training.objective``'s value that picks it."""
    batch_fields: ClassVar[tuple[str, ...]]
    """The batch's extra arrays (``[B, ...]``) passed to the call by name, beside tokens and mask (an
    instance may set its own: DPO's ``ref_logps`` with ``posttrain.precompute_ref_log_probs``); each
    ``[B, t]`` unless named in an optional ``row_fields`` (``[B, 1]``), as the compile-only batch builds them."""
    data_format: ClassVar[str | None]
    """The ``data.format`` it reads, and only it does; None: any format no objective claims."""
    reads: ClassVar[str]
    """What it reads, for the config's refusal of another ``data.format`` (``DPO reads preference pairs``)."""
    evaluation: ClassVar[str]
    """How its held-out evaluation runs (:func:`jaxcolossal.train.evaluate.held_out`): ``loss``
    (the language-model loss over the fixed batches), ``objective`` (its own loss and metrics over
    the fixed batches, with the reference) or ``rollouts`` (the on-policy loader's ``evaluate``)."""
    reference_label: ClassVar[str]
    """Whose frozen reference copy the memory report names (``DPO's``); empty without one."""

    # Optional, read with getattr where used: ``headline_metrics`` (an ``objective`` evaluation's two
    # metrics in its log line), ``batches`` (the objective's own reading of its data format, in place of
    # :data:`jaxcolossal.data.formats.FORMATS`'), ``shard_reductions`` (statistics combined over the data
    # shards by other than a sum), ``wants_shard_axis``, ``step_fields``, ``reference_in_step`` (the frozen
    # reference runs in the step: over a pipeline the step passes its hidden states as ``ref_hidden``).
    # Over a pipeline (jaxcolossal.train.pipeline_objective) the call also gets ``hidden``: the policy's
    # final-norm hidden states [b, t, d], which the objective's head reads in place of the model's forward.

    def __init__(self, family: Any, cfg: Config) -> None: ...

    def __call__(self, params: Any, tokens: jax.Array, targets: jax.Array, mcfg: Any, shard: Any,
                 vocab_parallel: bool, mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, dropout_key: jax.Array | None = None,
                 reference: Any = None, **fields: jax.Array) -> tuple[jax.Array, dict]: ...

    def count(self, inputs: jax.Array, mask: jax.Array | None = None, fields: dict | None = None) -> jax.Array:
        """What the step's summed loss divides by (fp32 scalar): tokens, pairs or rows; ``fields``: the
        batch's :attr:`batch_fields` (GRPO reads TRL's token count of the generation from them)."""

    def zero_stats(self) -> dict:
        """The statistics at zero (fp32 arrays), the accumulation's start; ``{}``: none kept."""

    def metrics(self, stats: dict, count: jax.Array) -> dict:
        """The step's metrics from the summed statistics and :meth:`count`."""

    @staticmethod
    def held_out_parts(val: float) -> tuple[str, str]:
        """``(name, value with its unit)`` of a held-out evaluation's value ``val``."""

    @staticmethod
    def loader(data: Any, cfg: Config, plan: Any) -> Any:
        """The training loader over the data format's ``data``: itself, or an on-policy phase over it."""


OBJECTIVES: dict[str, type[Objective]] = {
    Sft.name: Sft,    # jaxcolossal/train/sft.py: pre-training and SFT
    Dpo.name: Dpo,    # jaxcolossal/posttrain/dpo.py
    Grpo.name: Grpo,  # jaxcolossal/posttrain/grpo.py
    Reward.name: Reward,  # jaxcolossal/posttrain/reward.py
}
"""Every objective by its ``training.objective`` name, one line each."""

for _objective in OBJECTIVES.values():  # the config's objective/format check reads what each declares
    declare_objective(_objective.name, _objective.data_format, _objective.reads)


def objective_class(cfg: Config) -> type[Objective]:
    """The class ``cfg.training.objective`` names in :data:`OBJECTIVES` (its declarations, no instance).

    Raises:
        KeyError: a name no objective is registered under (the config's schema allows none).
    """
    return OBJECTIVES[cfg.training.objective]


def make_objective(family: Any, cfg: Config) -> Objective:
    """The objective ``cfg.training.objective`` names (:data:`OBJECTIVES`), for ``family``'s model.

    Raises:
        KeyError: as :func:`objective_class`.
    """
    return objective_class(cfg)(family, cfg)
