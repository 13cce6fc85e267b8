"""``training.objective=dpo``: Direct Preference Optimization (Rafailov et al., 2023) and the 14 other
losses of TRL's ``DPOTrainer`` (IPO, EXO, NCA, robust DPO, BCO, SPPO, AOT, APO, DiscoPOP, SFT, length-
normalised DPO), each computed as trl 1.16's ``DPOTrainer._compute_loss`` computes it and summed with
``posttrain.loss_weights`` as TRL sums its ``loss_type`` list (MPO); registered in
:data:`jaxcolossal.train.objective.OBJECTIVES`.

The batch holds preference pairs as interleaved rows (row ``2i`` chosen, ``2i + 1`` rejected:
:func:`jaxcolossal.data.preference.pair_rows`), whose loss masks cover the response tokens only;
the policy's and the reference's sequence log-probs are the masked sums of per-token log-probs
(:func:`jaxcolossal.posttrain.loss_terms.sequence_logps`), and the loss is the mean over the step's pairs.

Three losses couple the pairs of a batch, as TRL's couple those of its per-device batch: ``aot`` and
``aot_unpaired`` sort the pairs' log-ratios, ``sft`` is the mean NLL over all the batch's chosen tokens.
Here that batch is one microbatch as the step hands it to the objective: the whole (global) microbatch
under ZeRO-2/3 with fp32 communication (the layer-wise reduction), a data shard's part of it under
ZeRO-0/1 or bf16/fp8 communication (the per-shard gradients, TRL's per-device batch).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxcolossal.config.derived import dpo_loss_types, dpo_loss_weights, posttrain_beta, precomputes_ref_logps
from jaxcolossal.models.layers.logprobs import EXTRAS
from jaxcolossal.posttrain.loss_terms import policy_token_logps, sequence_logps

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
"""TRL's ``DPOTrainer`` metric names, each a mean over the step's pairs (trl 1.16 ``_compute_loss``)."""

log_sigmoid, sigmoid = jax.nn.log_sigmoid, jax.nn.sigmoid


TOKEN_METRICS = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy")
"""TRL 1.16 ``DPOTrainer._compute_loss``'s token metrics (every loss type logs them): the mean entropy
over the response tokens, the mean logit over the chosen and over the rejected response tokens, and the
share of the chosen response tokens that are the model's top-1; each a microbatch's value."""


class MicrobatchTokens(NamedTuple):
    """The response tokens of the microbatch a call's rows belong to (fp32 scalars): all of them and the
    chosen rows' (the step's ``microbatch_tokens``/``microbatch_chosen_tokens`` fields), and this call's
    share of them. A call with no fields (the held-out evaluation, a direct call) is its own microbatch."""

    local: jax.Array
    total: jax.Array
    chosen: jax.Array
    given: bool  # the step's fields were given (static): the call may be one data shard of its microbatch

    @classmethod
    def of(cls, mask, total=None, chosen=None) -> "MicrobatchTokens":
        local = jnp.sum(mask)
        given = total is not None
        total = total[0, 0] if given else local
        chosen = chosen[0, 0] if chosen is not None else jnp.sum(mask[0::2])
        return cls(local, jnp.maximum(total, 1.0), jnp.maximum(chosen, 1.0), given)

    def sft_share(self, chosen_nll_sum, local_pairs: int, microbatch_pairs: int) -> jax.Array:
        """``sft``'s per-pair term: the microbatch's mean NLL over its chosen tokens (TRL's), spread so that
        the call's ``local_pairs`` carry this call's part of ``microbatch_pairs × mean`` (the whole
        microbatch's sum over pairs; a call that is its own microbatch: the plain mean)."""
        pairs = microbatch_pairs if self.given else local_pairs
        return chosen_nll_sum / self.chosen * pairs / local_pairs

    def metric_shares(self, stats: dict, mask) -> dict:
        """This call's share of :data:`TOKEN_METRICS` (sums over its tokens over the microbatch's) and of
        one microbatch (``microbatches``: its tokens over the microbatch's)."""
        chosen, rejected = mask[0::2], mask[1::2]
        rejected_total = jnp.maximum(self.total - self.chosen, 1.0)
        return {"entropy": jnp.sum(stats["entropy"] * mask) / self.total,
                "logits/chosen": jnp.sum(stats["mean_logits"][0::2] * chosen) / self.chosen,
                "logits/rejected": jnp.sum(stats["mean_logits"][1::2] * rejected) / rejected_total,
                "mean_token_accuracy": jnp.sum(stats["is_top1"][0::2] * chosen) / self.chosen,
                "microbatches": self.local / self.total}


class PairTerms(NamedTuple):
    """What every loss reads, fp32, one entry per pair (``[P]``) unless said.

    ``chosen``/``rejected``: the policy's sequence log-probs (``π_c``, ``π_r``); ``ref_chosen``/
    ``ref_rejected``: the reference's (``ref_c``, ``ref_r``); ``chosen_len``/``rejected_len``: each
    response's tokens (the length-normalised losses clamp them at 1, as TRL does); ``sft_nll``: the
    mean NLL over all the batch's chosen tokens (scalar, ``sft`` only; None otherwise); ``beta``,
    ``label_smoothing`` (ε), ``discopop_tau`` (τ): the options, Python floats."""

    chosen: jax.Array
    rejected: jax.Array
    ref_chosen: jax.Array
    ref_rejected: jax.Array
    chosen_len: jax.Array
    rejected_len: jax.Array
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    sft_nll: jax.Array | None = None

    @property
    def chosen_ratio(self) -> jax.Array:
        """TRL's ``chosen_logratios``: ``π_c - ref_c``."""
        return self.chosen - self.ref_chosen

    @property
    def rejected_ratio(self) -> jax.Array:
        """TRL's ``rejected_logratios``: ``π_r - ref_r``."""
        return self.rejected - self.ref_rejected

    @property
    def delta(self) -> jax.Array:
        """TRL's ``delta_score`` (``f_divergence_type=reverse_kl``): ``Δ = (π_c - ref_c) - (π_r - ref_r)``."""
        return self.chosen_ratio - self.rejected_ratio

    @property
    def normalised_delta(self) -> jax.Array:
        """``Δ`` with each log-ratio averaged over its response tokens (``ipo``, ``sigmoid_norm``)."""
        return (self.chosen_ratio / jnp.maximum(self.chosen_len, 1.0)
                - self.rejected_ratio / jnp.maximum(self.rejected_len, 1.0))


# ----------------------------------------------------------------------------- the 15 losses (trl 1.16)


def _smoothed_sigmoid(z: jax.Array, eps: float) -> jax.Array:
    """``-(1-ε)·log σ(z) - ε·log σ(-z)`` (``aot``/``aot_unpaired``'s form, TRL's term order)."""
    return -log_sigmoid(z) * (1 - eps) - log_sigmoid(-z) * eps


def _exo_pair(t: PairTerms) -> jax.Array:
    """EXO-pref (Ji et al., 2024, eq. 16): ``KL(softmax(βΔ) ‖ [1-ε, ε])`` over {chosen, rejected}."""
    z, eps = t.beta * t.delta, jnp.float32(t.label_smoothing)
    return (sigmoid(z) * (log_sigmoid(z) - jnp.log1p(-eps))
            + sigmoid(-z) * (log_sigmoid(-z) - jnp.log(eps)))


def _robust(t: PairTerms) -> jax.Array:
    """Robust DPO (Chowdhury et al., 2024): ``(-(1-ε)·log σ(βΔ) + ε·log σ(-βΔ)) / (1 - 2ε)``."""
    z, eps = t.beta * t.delta, t.label_smoothing
    return (-(1 - eps) * log_sigmoid(z) - (-eps * log_sigmoid(-z))) / (1 - 2 * eps)


def _aot(t: PairTerms) -> jax.Array:
    """AOT, paired: the sorted ``π_c - π_r`` against the sorted ``ref_c - ref_r`` over the batch's pairs."""
    delta = jnp.sort(t.chosen - t.rejected) - jnp.sort(t.ref_chosen - t.ref_rejected)
    return _smoothed_sigmoid(t.beta * delta, t.label_smoothing)


def _aot_unpaired(t: PairTerms) -> jax.Array:
    """AOT, unpaired: the sorted chosen log-ratios against the sorted rejected ones over the batch."""
    delta = jnp.sort(t.chosen_ratio) - jnp.sort(t.rejected_ratio)
    return _smoothed_sigmoid(t.beta * delta, t.label_smoothing)


def _discopop(t: PairTerms) -> jax.Array:
    """DiscoPOP (Chris Lu et al., 2024, eq. 5): the logistic and exponential losses of ``βΔ``, blended by
    ``σ(βΔ/τ)``."""
    logits = t.delta * t.beta
    mod = sigmoid(logits / t.discopop_tau)
    return -log_sigmoid(logits) * (1 - mod) + jnp.exp(-logits) * mod


def _sft(t: PairTerms) -> jax.Array:
    """The batch's chosen-token mean NLL, the same for every pair (TRL expands its scalar alike)."""
    return jnp.broadcast_to(t.sft_nll, t.chosen.shape)


LOSSES: dict[str, Callable[[PairTerms], jax.Array]] = {
    "sigmoid": lambda t: -log_sigmoid(t.beta * t.delta),
    "hinge": lambda t: jax.nn.relu(1 - t.beta * t.delta),
    "ipo": lambda t: (t.normalised_delta - 1 / (2 * t.beta)) ** 2,  # τ = β; per-token log-ratios
    "exo_pair": _exo_pair,
    "nca_pair": lambda t: (-log_sigmoid(t.beta * t.chosen_ratio) - 0.5 * log_sigmoid(-t.beta * t.chosen_ratio)
                           - 0.5 * log_sigmoid(-t.beta * t.rejected_ratio)),
    "robust": _robust,
    "bco_pair": lambda t: -log_sigmoid(t.beta * t.chosen_ratio) - log_sigmoid(-t.beta * t.rejected_ratio),
    "sppo_hard": lambda t: (t.chosen_ratio - 0.5 / t.beta) ** 2 + (t.rejected_ratio + 0.5 / t.beta) ** 2,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": lambda t: (1 - sigmoid(t.beta * t.chosen_ratio)) + sigmoid(t.beta * t.rejected_ratio),
    "apo_down": lambda t: sigmoid(t.beta * t.chosen_ratio) + (1 - sigmoid(t.beta * t.delta)),
    "discopop": _discopop,
    "sft": _sft,
    "sigmoid_norm": lambda t: -log_sigmoid(t.beta * t.normalised_delta),
}
"""Each TRL 1.16 DPO ``loss_type``'s per-pair loss ``[P]`` from :class:`PairTerms`, as
``DPOTrainer._compute_loss`` computes it (``f_divergence_type=reverse_kl``, no WPO weighting, no LD-DPO)."""


def dpo_loss(terms: PairTerms, loss_types: Sequence[str] = ("sigmoid",),
             loss_weights: Sequence[float] | None = None) -> tuple[jax.Array, dict]:
    """The per-pair DPO loss and TRL's six metrics, each fp32 ``[P]`` (their means over pairs are the batch's).

    Args:
        terms: the pairs' log-probs and the options (:class:`PairTerms`).
        loss_types: names of :data:`LOSSES`, summed as TRL sums its ``loss_type`` list.
        loss_weights: one weight per name (TRL's ``loss_weights``); None: 1 each.

    Returns ``(Σ_k w_k · loss_k [P], {name: [P]})``: the mean over pairs of the first is TRL's
    ``Σ_k w_k · per_sequence_loss_k.mean()``. The metrics (:data:`DPO_METRICS`, TRL's definitions):
    ``rewards/chosen = β·(π_c - ref_c)``, ``rewards/rejected`` likewise, ``rewards/accuracies =
    [reward_c > reward_r]``, ``rewards/margins = reward_c - reward_r``, ``logps/chosen = π_c``,
    ``logps/rejected = π_r``.

    Raises:
        ValueError: an unknown loss type, or a weight count unlike the names'.
    """
    weights = (1.0,) * len(loss_types) if loss_weights is None else tuple(loss_weights)
    if len(weights) != len(loss_types) or any(n not in LOSSES for n in loss_types):
        raise ValueError(f"loss_types={list(loss_types)} with loss_weights={list(weights)}: expected names of "
                         f"{', '.join(LOSSES)}, one weight each")
    loss = sum(w * LOSSES[n](terms) for n, w in zip(loss_types, weights))
    rc = jax.lax.stop_gradient(terms.beta * terms.chosen_ratio)
    rr = jax.lax.stop_gradient(terms.beta * terms.rejected_ratio)
    metrics = {"rewards/chosen": rc, "rewards/rejected": rr, "rewards/accuracies": (rc > rr).astype(jnp.float32),
               "rewards/margins": rc - rr, "logps/chosen": jax.lax.stop_gradient(terms.chosen),
               "logps/rejected": jax.lax.stop_gradient(terms.rejected)}
    return loss, metrics


class Dpo:
    """The DPO objective over interleaved preference rows (module docstring).

    ``__call__(params, tokens, targets, ...)`` with int32 ``[2P, t]`` rows (``2i`` chosen, ``2i+1``
    rejected) and ``mask [2P, t]``: ``(sum over the P pairs of the loss, {metric: sum over pairs})``.
    ``reference``: the reference model's params dict (the frozen initial copy or ``posttrain.ref_model``'s,
    or under LoRA the base without adapters): its log-probs are computed under ``stop_gradient`` in the
    same step (:meth:`reference_logps`). With ``posttrain.precompute_ref_log_probs`` they come instead as
    the batch field ``ref_logps``, fp32 ``[2P, 1]`` (each row's reference sequence log-prob, computed by
    the same :meth:`reference_logps` before training: :mod:`jaxcolossal.train.ref_logps`), and
    ``reference`` is None (TRL's ``ref_chosen_logps``/``ref_rejected_logps`` columns).
    """

    name = "dpo"
    batch_fields: tuple = ()
    data_format = "preference"
    reads = "DPO reads preference pairs"
    evaluation = "objective"  # the held-out pairs' DPO loss and TRL metrics, against the reference
    headline_metrics = ("rewards/accuracies", "rewards/margins")  # the held-out evaluation's log line
    reference_label = "DPO's"

    step_fields: tuple = ("microbatch_tokens", "microbatch_chosen_tokens")  # filled by the step from the mask
    reference_in_step = True  # the frozen reference's log-probs are computed in the step (ref_hidden over a pipeline)
    row_fields: tuple = ("ref_logps",)  # batch fields of one value per row, [B, 1]

    def __init__(self, family, cfg):
        self.family, self.cfg, self.post = family, cfg, cfg.posttrain
        self.microbatch_pairs = cfg.training.batch_size // 2 // cfg.training.gradient_accumulation_steps
        self.loss_types, self.loss_weights = dpo_loss_types(cfg), dpo_loss_weights(cfg)
        if precomputes_ref_logps(cfg):  # the reference's log-probs come with the batch
            self.batch_fields = ("ref_logps",)

    def reference_logps(self, reference, tokens, targets, mask, mcfg, shard, vocab_parallel, hidden=None):
        """Each row's reference sequence log-prob, fp32 ``[b]`` without gradient (:func:`sequence_logps` of
        the ``reference`` params over int32 ``tokens``/``targets`` ``[b, t]``, ``mask`` fp32 ``[b, t]``;
        ``hidden``: the reference's final-norm hidden states ``[b, t, d]`` when a pipeline computed them)."""
        ref_params = jax.lax.stop_gradient(reference)
        if hidden is None:
            return jax.lax.stop_gradient(sequence_logps(self.family, ref_params, tokens, targets, mask, mcfg, shard,
                                                        vocab_parallel))
        lp = policy_token_logps(self.family, ref_params, tokens, targets, mask, mcfg, shard, vocab_parallel,
                                hidden=jax.lax.stop_gradient(hidden))
        return jax.lax.stop_gradient(jnp.sum(lp, axis=-1))

    def __call__(self, params, tokens, targets, mcfg, shard, vocab_parallel, mask=None, segment_ids=None,
                 positions=None, dropout_key=None, reference=None, ref_logps=None, microbatch_tokens=None,
                 microbatch_chosen_tokens=None, hidden=None, ref_hidden=None):
        # the phases: policy log-probs (per token, with TRL's token statistics), reference log-probs (no
        # gradient; or the precomputed ones), the loss, the metrics. hidden/ref_hidden: a pipeline's
        # final-norm hidden states of the policy and the reference (jaxcolossal.train.pipeline_objective)
        mask = mask.astype(jnp.float32)
        pol_tok, token_stats = policy_token_logps(self.family, params, tokens, targets, mask, mcfg, shard,
                                                  vocab_parallel, dropout_key=dropout_key, extras=EXTRAS,
                                                  hidden=hidden)
        pol = jnp.sum(pol_tok, axis=-1)
        tokens_mb = MicrobatchTokens.of(mask, microbatch_tokens, microbatch_chosen_tokens)
        if ref_logps is not None:
            ref = ref_logps.reshape(-1).astype(jnp.float32)
        else:
            ref = self.reference_logps(reference, tokens, targets, mask, mcfg, shard, vocab_parallel, ref_hidden)
        lens = jnp.sum(mask, axis=-1)
        sft_nll = None
        if "sft" in self.loss_types:  # TRL: -chosen_per_token_logps[chosen_mask].mean() over the microbatch
            sft_nll = tokens_mb.sft_share(-jnp.sum(pol_tok[0::2]), mask.shape[0] // 2, self.microbatch_pairs)
        p = self.post
        terms = PairTerms(pol[0::2], pol[1::2], ref[0::2], ref[1::2], lens[0::2], lens[1::2], posttrain_beta(self.cfg),
                          p.label_smoothing, p.discopop_tau, sft_nll)
        loss, metrics = dpo_loss(terms, self.loss_types, self.loss_weights)
        sums = {k: jnp.sum(v) for k, v in metrics.items()}
        return jnp.sum(loss), sums | tokens_mb.metric_shares(token_stats, mask)

    def count(self, inputs, mask=None, fields=None):
        """The step's pairs (fp32 scalar): half its rows."""
        return jnp.asarray(inputs.shape[0] // 2, jnp.float32)

    def zero_stats(self) -> dict:
        """TRL's metrics' sums at zero (fp32 scalars), the microbatch accumulation's start."""
        return {k: jnp.zeros((), jnp.float32) for k in DPO_METRICS + TOKEN_METRICS + ("microbatches",)}

    def metrics(self, stats: dict, count) -> dict:
        """TRL's metrics: the pair metrics, the step's sums over pairs divided by its pairs; the token
        metrics, the mean over the step's microbatches of each one's value (as TRL logs them)."""
        per_pair = {k: stats[k] / count for k in DPO_METRICS}
        microbatches = jnp.maximum(stats["microbatches"], 1e-9)
        return per_pair | {k: stats[k] / microbatches for k in TOKEN_METRICS}

    @staticmethod
    def held_out_parts(val: float) -> tuple[str, str]:
        """``("held-out DPO loss", "X per pair")``: the held-out pairs' mean DPO loss ``val``."""
        return "held-out DPO loss", f"{val:.4f} per pair"

    @staticmethod
    def loader(data: Any, cfg, plan) -> Any:
        """The training loader: the preference format's pair loader ``data`` itself (off-policy)."""
        return data
