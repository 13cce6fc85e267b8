"""Mixture-of-experts MLP for the LLaMA, DeepSeek and GPT-OSS families (``model.num_experts > 0``):
Mixtral (softmax router, top-2, renormalised), Qwen3-MoE (softmax, top-k, ``norm_topk_prob`` as its
config says), DeepSeek-MoE's layout (fine-grained experts, shared experts, the first ``first_k_dense``
layers dense, sigmoid scores), DeepSeek-V3's router (group-limited top-k, the score-correction bias that
chooses but does not weight, ``routed_scaling_factor``: :func:`choose_experts`) and GPT-OSS's options: a
router bias (``model.router_bias``), biased experts (``model.expert_bias``) and the clamped SwiGLU
(``model.swiglu_limit``).

Params of one MoE layer, stacked over the ``L_moe`` MoE layers (``E`` experts of size ``f_e``,
shared experts ``f_s = num_shared_experts · f_e``)::

    router       [L, d, E]       (layers, embed, None)
    router_score_bias [L, E]     (layers, None)                     with router_score_correction (frozen)
    moe_w_gate   [L, E, d, f_e]  (layers, expert, embed, mlp)       moe_w_up likewise
    moe_w_down   [L, E, f_e, d]  (layers, expert, mlp, embed)
    shared_w_gate/up [L, d, f_s], shared_w_down [L, f_s, d]          (as a dense MLP)
    router_bias  [L, E]          (layers, None)                      model.router_bias
    moe_gate_bias, moe_up_bias [L, E, f_e]  (layers, expert, mlp)    model.expert_bias
    moe_down_bias [L, E, d]      (layers, expert, embed)             model.expert_bias

The router runs on the whole batch (fp32 logits), so the load-balancing and z losses and the load
statistics are those of the global batch; the experts run in :func:`jaxcolossal.parallel.expert.routed_experts`.
The load-balancing loss combines the MoE layers as ``model.router_aux_loss_form`` says: ``pooled``
(Hugging Face's: one loss over the statistics summed over the layers, :func:`pooled_aux_loss`) or
``per_layer`` (the mean of the layers' losses); :func:`finish` makes it from the layers' sums.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxcolossal.config import ModelConfig
from jaxcolossal.models.layers.vocab import Sharder, no_shard
from jaxcolossal.parallel.expert import routed_experts

STATS = ("moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_slots", "expert_load", "router_prob")
"""What each MoE layer adds to the loss's statistics: the two losses (summed over layers), the
dropped and routed (token, expert) slots, each expert's slots ``[E]`` and its routing probability
summed over the tokens ``[E]`` (the pooled loss's two sums). :func:`finish` turns the summed losses
into the microbatch's."""


def layer_shapes_and_axes(cfg: ModelConfig) -> dict:
    """``{name: (shape, logical axes)}`` of one MoE layer's MLP, stacked over the MoE layers."""
    L, d, E, f = cfg.moe_layers, cfg.hidden_size, cfg.num_experts, cfg.expert_size
    out = {
        "router": ((L, d, E), ("layers", "embed", None)),
        "moe_w_gate": ((L, E, d, f), ("layers", "expert", "embed", "mlp")),
        "moe_w_up": ((L, E, d, f), ("layers", "expert", "embed", "mlp")),
        "moe_w_down": ((L, E, f, d), ("layers", "expert", "mlp", "embed")),
    }
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * f
        out.update({"shared_w_gate": ((L, d, fs), ("layers", "embed", "mlp")),
                    "shared_w_up": ((L, d, fs), ("layers", "embed", "mlp")),
                    "shared_w_down": ((L, fs, d), ("layers", "mlp", "embed"))})
    if cfg.router_score_correction:  # DeepSeek-V3's e_score_correction_bias (zero at initialisation)
        out["router_score_bias"] = ((L, E), ("layers", None))
    if cfg.router_bias:
        out["router_bias"] = ((L, E), ("layers", None))
    if cfg.expert_bias:
        out.update({"moe_gate_bias": ((L, E, f), ("layers", "expert", "mlp")),
                    "moe_up_bias": ((L, E, f), ("layers", "expert", "mlp")),
                    "moe_down_bias": ((L, E, d), ("layers", "expert", "embed"))})
    return out


def _group_limited(choice: jax.Array, cfg: ModelConfig) -> jax.Array:
    """DeepSeek-V3's group-limited routing: ``choice [T, E]`` with the experts outside each token's
    ``topk_group`` best groups of ``n_group`` set to ``-inf``; a group's score is the sum of its two best
    experts' (transformers' ``DeepseekV3TopkRouter``)."""
    t, e = choice.shape
    g = cfg.n_group
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(t, g, e // g), 2)[0], axis=-1)       # [T, G]
    best = jax.lax.top_k(group_scores, cfg.topk_group)[1]                                      # [T, topk_group]
    keep = jnp.any(best[:, :, None] == jnp.arange(g)[None, None, :], axis=1)                  # [T, G]
    return jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)


def choose_experts(scores: jax.Array, cfg: ModelConfig, score_bias: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts and their weights from the router's fp32 scores ``[T, E]``.

    The experts are chosen by ``scores + score_bias`` (DeepSeek-V3's ``e_score_correction_bias``
    ``[E]``, ``model.router_score_correction``), within the token's best groups when ``model.n_group``
    > 1 (:func:`_group_limited`); their weights are the scores themselves, without the bias, summed to
    one when ``norm_topk_prob`` (DeepSeek-V3 adds 1e-20 to the sum), then times
    ``routed_scaling_factor``, as transformers' ``DeepseekV3TopkRouter`` computes them (for
    softmax routers without a bias or groups: ``lax.top_k`` of the scores, Mixtral's). The choice
    carries no gradient, so the bias gets none: it stays frozen in training (it is updated outside
    the gradient in the DeepSeek-V3 paper; transformers keeps it as a buffer).

    Returns:
        ``(top_i int32 [T, k], top_w fp32 [T, k])``.
    """
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    choice = jax.lax.stop_gradient(choice)
    if cfg.n_group > 1:
        choice = _group_limited(choice, cfg)
    top_i = jax.lax.top_k(choice, cfg.num_experts_per_tok)[1]
    top_w = jnp.take_along_axis(scores, top_i, axis=-1)
    if cfg.norm_topk_prob:
        eps = 1e-20 if cfg.router_scoring == "sigmoid" else 0.0
        top_w = top_w / (jnp.sum(top_w, axis=-1, keepdims=True) + eps)
    if cfg.routed_scaling_factor != 1.0:
        top_w = top_w * cfg.routed_scaling_factor
    return top_i, top_w


EXPERT_BIASES = ("moe_gate_bias", "moe_up_bias", "moe_down_bias")
"""The routed experts' bias leaves (``model.expert_bias``), in the order of
:func:`jaxcolossal.parallel.expert.routed_experts`' ``biases``."""


def route(x: jax.Array, w_router: jax.Array, cfg: ModelConfig, data_axes: tuple = (),
          score_bias: jax.Array | None = None, b_router: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict]:
    """Each token's top-k experts and weights (:func:`choose_experts`), and the router's losses and load.

    Args:
        x: ``[T, d]`` tokens (compute dtype); ``w_router``: ``[d, E]``.
        data_axes: inside a ``shard_map`` manual over the data axes (a pipeline), those axes: the
            statistics are summed over them, so that they are the whole microbatch's.
        score_bias: fp32 ``[E]``, DeepSeek-V3's score-correction bias (chooses, does not weight).
        b_router: ``[E]``, the router's bias (GPT-OSS), added to the logits; ``None``: none. GPT-OSS's
            top-k of the logits then softmax over the chosen equals softmax, top-k, renormalised.

    Returns:
        ``(top_i int32 [T, k], top_w fp32 [T, k], stats)``; ``stats``: ``moe_aux_loss`` (this layer's
        Switch load-balancing loss in Hugging Face's terms: ``E · Σ_e f_e · P_e`` with ``f_e`` the
        expert's top-k slots per token and ``P_e`` its mean routing probability), ``moe_z_loss``
        (ST-MoE: mean of ``logsumexp(logits)²``), ``expert_load`` (fp32 ``[E]`` slots per expert, summed
        over the data shards) and ``router_prob`` (fp32 ``[E]``: the routing probabilities summed over
        the tokens of ``x``, not over the data shards, so that in a pipeline its gradient stays local).
    """
    logits = jnp.einsum("td,de->te", x, w_router, preferred_element_type=jnp.float32)
    if b_router is not None:
        logits = logits + b_router.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if cfg.router_scoring == "softmax" else jax.nn.sigmoid(logits)
    top_i, top_w = choose_experts(scores, cfg, score_bias)

    def total(a):  # summed over the data shards
        return jax.lax.psum(a, data_axes) if data_axes else a

    load = total(jnp.sum(jax.nn.one_hot(top_i, cfg.num_experts, dtype=jnp.float32), axis=(0, 1)))
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    prob = jnp.sum(probs, axis=0)
    tokens = total(jnp.asarray(x.shape[0], jnp.float32))
    aux = cfg.num_experts * jnp.sum(load / tokens * total(prob) / tokens)
    z = total(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)) / tokens
    return top_i, top_w, {"moe_aux_loss": aux, "moe_z_loss": z, "expert_load": load, "router_prob": prob}


@jax.custom_vjp
def with_loss_gradient(y: jax.Array, loss: jax.Array, weight: float) -> jax.Array:
    """``y``, whose backward pass also gives ``loss`` the cotangent ``weight``: the gradient of
    ``weight · loss`` added to the step's, where the loss itself cannot join the summed loss (a
    pipeline stage passes on activations only)."""
    return y


def _wlg_fwd(y, loss, weight):
    return y, (loss, weight)


def _wlg_bwd(res, dy):
    loss, weight = res  # 0·loss + weight: a cotangent that varies over the same manual axes as the loss
    return dy, loss * 0 + weight, None


with_loss_gradient.defvjp(_wlg_fwd, _wlg_bwd)


def moe_mlp(h: jax.Array, lp: dict, cfg: ModelConfig, mesh=None, manual: tuple | None = None) -> tuple[jax.Array, dict]:
    """The MoE MLP of one layer: ``h [b, t, d]`` -> ``([b, t, d], stats)`` (:data:`STATS`). The
    shared experts, when there are any, run on every token as a dense SwiGLU MLP and add to the
    routed experts' output. ``mesh``: the run's mesh (``None``: one device). ``manual``: inside a
    pipeline's ``shard_map``, ``(ep, data axes, weight)``
    (:attr:`jaxcolossal.parallel.sharding.Sharder.manual_experts`): the tokens go over the manual ``ep``
    axis directly and the router losses' gradient joins with ``weight``
    (:func:`with_loss_gradient`; the pooled load-balancing loss joins through the pipeline's stream
    instead, :func:`pooled_loss_gradient`)."""
    b, t, d = h.shape
    x = h.reshape(b * t, d)
    top_i, top_w, stats = route(x, lp["router"], cfg, manual[1] if manual else (), lp.get("router_score_bias"),
                                lp.get("router_bias"))
    biases = tuple(lp[n] for n in EXPERT_BIASES) if cfg.expert_bias else None
    y, dropped = routed_experts(x, top_i, top_w, lp["moe_w_gate"], lp["moe_w_up"], lp["moe_w_down"],
                                cfg.capacity_factor, mesh, manual_ep=manual[0] if manual else None, biases=biases,
                                swiglu_limit=cfg.swiglu_limit)
    if manual:  # the per-layer router losses, 1/L each as finish averages them, for this shard's tokens
        losses = cfg.router_z_loss_coef * stats["moe_z_loss"]
        if cfg.router_aux_loss_form == "per_layer":
            losses = cfg.router_aux_loss_coef * stats["moe_aux_loss"] + losses
        y = with_loss_gradient(y, losses, manual[2] / max(cfg.moe_layers, 1))
    if "shared_w_gate" in lp:
        g = jnp.einsum("td,df->tf", x, lp["shared_w_gate"])
        u = jnp.einsum("td,df->tf", x, lp["shared_w_up"])
        y = y + jnp.einsum("tf,fd->td", jax.nn.silu(g) * u, lp["shared_w_down"])
    stats.update(moe_dropped=dropped, moe_slots=jnp.asarray(top_i.size, jnp.float32))
    return y.reshape(b, t, d), stats


def zero_stats(cfg: ModelConfig) -> dict:
    """:data:`STATS` at zero (the layer scan's carry starts from it)."""
    z, e = jnp.zeros((), jnp.float32), jnp.zeros((cfg.num_experts,), jnp.float32)
    return {"moe_aux_loss": z, "moe_z_loss": z, "moe_dropped": z, "moe_slots": z, "expert_load": e, "router_prob": e}


def pooled_aux_loss(load: jax.Array, prob: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The load-balancing loss of all the MoE layers at once, as transformers'
    ``load_balancing_loss_func`` (``models/mixtral/modeling_mixtral.py``; Qwen3-MoE's is the same
    function) computes it with ``attention_mask=None``: ``E · Σ_e F_e · P_e``, ``F_e = load_e / R``
    (the expert's top-k slots per row, HF's ``tokens_per_expert``), ``P_e = prob_e / R`` (its mean
    routing probability, softmax over all ``E`` experts, ``router_prob_per_expert``), ``R`` the
    rows: tokens × MoE layers, ``Σ_e load_e / k``. ``load`` carries no gradient (HF's ``histc``).

    Args:
        load: fp32 ``[E]``, the experts' top-k slots summed over the tokens and the MoE layers.
        prob: fp32 ``[E]``, their routing probabilities summed likewise (in a pipeline: over this
            data shard's tokens only, the rest coming from the other shards' terms).

    Returns:
        fp32 scalar; 0 for no tokens.
    """
    rows = jnp.sum(load) / cfg.num_experts_per_tok
    return cfg.num_experts * jnp.sum(jax.lax.stop_gradient(load) * prob) / jnp.maximum(rows, 1.0) ** 2


def finish(stats: dict, cfg: ModelConfig) -> dict:
    """The microbatch's statistics from the MoE layers' sums (:data:`STATS`, summed over the layer
    scan): ``moe_aux_loss`` becomes the load-balancing loss in ``model.router_aux_loss_form``
    (``pooled``: :func:`pooled_aux_loss` of the summed ``expert_load`` and ``router_prob``;
    ``per_layer``: the mean of the layers' losses), ``moe_z_loss`` the mean of the layers' (the
    same in both forms: every layer sees the same tokens); the rest stay sums. fp32 scalars."""
    layers = max(cfg.moe_layers, 1)
    if cfg.router_aux_loss_form == "pooled":
        aux = pooled_aux_loss(stats["expert_load"], stats["router_prob"], cfg)
    else:
        aux = stats["moe_aux_loss"] / layers
    return {**stats, "moe_aux_loss": aux, "moe_z_loss": stats["moe_z_loss"] / layers}


def loss_terms(stats: dict, cfg: ModelConfig, tokens: jax.Array | int) -> jax.Array:
    """What the MoE layers add to a summed loss over ``tokens`` tokens (:func:`finish`'s ``stats``):
    ``tokens ×`` (the coefficients × the router losses), so that after the step's division by the
    token count the loss carries ``router_aux_loss_coef · aux + router_z_loss_coef · z``."""
    return tokens * (cfg.router_aux_loss_coef * stats["moe_aux_loss"] + cfg.router_z_loss_coef * stats["moe_z_loss"])


def pipeline_stream(cfg: ModelConfig) -> dict:
    """What a pipeline passes on beside the activations for the pooled loss: fp32 ``[E]``
    ``expert_load`` and ``router_prob`` at zero, summed over the layers as the microbatch goes
    through the stages (:func:`add_to_stream`)."""
    e = jnp.zeros((cfg.num_experts,), jnp.float32)
    return {"expert_load": e, "router_prob": e}


def add_to_stream(stream: dict, stats: dict) -> dict:
    """``stream`` (:func:`pipeline_stream`) plus one layer's ``expert_load`` and ``router_prob``."""
    return {k: stream[k] + stats[k] for k in stream}


def pooled_loss_gradient(stream: dict, cfg: ModelConfig) -> jax.Array:
    """In a pipeline's last stage: a term for one data shard's summed loss that is 0 in value and
    whose gradient, summed over the data shards, is that of ``tokens × router_aux_loss_coef ×``
    :func:`pooled_aux_loss` of the microbatch (``tokens``: the microbatch's, all shards'). It is
    linear in ``router_prob`` (this shard's) given the global ``expert_load``, so the shards' terms
    add up to the whole microbatch's. fp32 scalar. (The loss metric stays the cross-entropy, as for
    the per-layer losses, whose gradient joins through :func:`with_loss_gradient`.)"""
    tokens = jnp.sum(stream["expert_load"]) / (cfg.num_experts_per_tok * max(cfg.moe_layers, 1))
    g = tokens * cfg.router_aux_loss_coef * pooled_aux_loss(stream["expert_load"], stream["router_prob"], cfg)
    return g - jax.lax.stop_gradient(g)


def lm_loss_with_router(hidden_and_stats: Callable, head_loss: Callable) -> tuple[Callable, Callable]:
    """A family's ``(loss_and_stats, loss_sum)`` for layers that may be mixtures of experts, from its
    ``hidden_and_stats(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions, dropout_key) ->
    (h [b, t, d], stats)`` and ``head_loss`` (:func:`jaxcolossal.models.layers.vocab.lm_loss`).

    ``loss_and_stats(params, tokens, targets, cfg, shard, vocab_parallel, mask, segment_ids, positions,
    dropout_key) -> (loss, stats)``: the summed next-token cross-entropy (nats, fp32 scalar) of int
    ``tokens``/``targets [b, t]`` (with ``mask [b, t]``, of the masked-in tokens), plus with experts the
    router losses at their coefficients (:func:`loss_terms`), and the router statistics (``{}`` for a
    dense model). ``loss_sum``: its loss alone."""

    def loss_and_stats(params: dict, tokens: jax.Array, targets: jax.Array, cfg: ModelConfig,
                       shard: Sharder = no_shard, vocab_parallel: bool = False, mask: jax.Array | None = None,
                       segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                       dropout_key: jax.Array | None = None) -> tuple[jax.Array, dict]:
        h, stats = hidden_and_stats(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions, dropout_key)
        loss = head_loss(params, h, targets, cfg, shard, mask)
        if cfg.moe:
            n = tokens.size if mask is None else jnp.sum(mask.astype(jnp.float32))
            loss = loss + loss_terms(stats, cfg, n)
        return loss, stats

    def loss_sum(params: dict, tokens: jax.Array, targets: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                 vocab_parallel: bool = False, mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
        return loss_and_stats(params, tokens, targets, cfg, shard, vocab_parallel, mask, segment_ids, positions,
                              dropout_key)[0]

    loss_and_stats.__doc__ = loss_sum.__doc__ = lm_loss_with_router.__doc__
    return loss_and_stats, loss_sum
