"""The optimizer from the training config: global-norm clipping then AdamW with warmup and
cosine decay (optax). Weight decay skips norm scales and biases (:func:`decay_mask`).
``training.adam_freeze_step`` freezes Adam's second moment after that many steps (1-bit Adam's
``freeze_step``, :func:`scale_by_adam_frozen_variance`), which compressed gradients need."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcolossal.config import TrainingConfig
from jaxcolossal.optim import fused_adamw


def lr_schedule(t: TrainingConfig) -> optax.Schedule:
    """The learning rate of optimizer step ``s`` (0-based), as Colossal-AI's warmup schedules:
    linear warmup ``learning_rate · (s + 1) / warmup_steps`` — the first step already moves —
    reaching ``learning_rate`` at step ``warmup_steps − 1``, then cosine decay towards
    ``learning_rate · min_learning_rate_ratio``, reached at the last step (``max_steps − 1``) when
    there is a warmup."""
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
        decay_steps=max(t.max_steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_learning_rate_ratio)
    shift = 1 if t.warmup_steps > 0 else 0  # without warmup, step 0 runs at the peak
    return lambda step: base(step + shift)


NO_DECAY_SUFFIXES = ("norm", "norm_bias", "_bias")
NO_DECAY_PREFIXES = ("b_",)
NO_DECAY_NAMES = {"bq", "bk", "bv", "bo"}


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: weight matrices and embeddings, not norm scales,
    LayerNorm biases or linear biases (the Hugging Face / Megatron convention)."""
    def keep(path, _):
        last = path[-1]
        name = str(getattr(last, "key", getattr(last, "name", last)))
        return not (name.endswith(NO_DECAY_SUFFIXES) or name.startswith(NO_DECAY_PREFIXES) or name in NO_DECAY_NAMES)
    return jax.tree_util.tree_map_with_path(keep, params)


def scale_by_adam_frozen_variance(b1: float, b2: float, eps: float, freeze_step: int,
                                  momentum_step: int | None = None) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` whose second moment stops changing after ``freeze_step`` updates.

    Follows 1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale
    Training with Adam's Convergence Speed"; DeepSpeed's ``OnebitAdam(freeze_step=...)``): Adam's
    variance is non-linear in the gradient, so it breaks error feedback, which only preserves the
    *sum* of the gradients sent over time. With the variance frozen the update is momentum SGD
    with a fixed per-element preconditioner, linear in the gradient, and an element whose
    accumulated residual is sent late moves its weight as far as if it had been sent step by
    step. Without freezing, such a late, large value inflates the element's second moment and
    damps its later steps (measured in docs/communication.md).

    Update ``t`` (1-based): ``mu = b1·mu + (1−b1)·g`` always; ``nu = b2·nu + (1−b2)·g²`` only while
    ``t ≤ freeze_step``, and after it only where ``nu`` is still 0 (an element that had no gradient
    before the freeze, such as the embedding row of a token not seen yet: frozen at 0, its steps
    would be ``mu/eps``; it takes its variance from its first gradient and freezes then); the step
    is ``mu/(1−b1^t) / (sqrt(nu/(1−b2^min(t, freeze_step))) + eps)``.
    Until the freeze it is ``optax.scale_by_adam`` to the bit. The state is optax's
    ``ScaleByAdamState`` (``count`` int32 scalar; ``mu``, ``nu`` fp32 like the params, sharded as
    the optimizer state). ``freeze_step`` ≥ 1.

    ``momentum_step`` (DGC's momentum correction, ``parallel.momentum_correction``): from update
    ``momentum_step + 1`` on, ``mu = g``: the gradient that arrives is already a momentum, summed
    from the shards' own (:func:`jaxcolossal.parallel.compression.topk_reduce`), so none is added on
    top; an element still without a variance takes it from ``(g − b1·mu_prev)/(1 − b1)``, the
    gradient that momentum stands for. ``None``: never.
    """
    if freeze_step < 1:
        raise ValueError(f"freeze_step must be >= 1, got {freeze_step}")
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        frozen = state.count >= freeze_step  # this update is past the freeze
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        grads = updates
        if momentum_step is not None:  # the shards' momentum arrives with the gradient
            corrected = state.count >= momentum_step
            mu = jax.tree.map(lambda m, g: jnp.where(corrected, g, m), mu, updates)
            # the gradient it stands for, for the variance of elements not yet seen (below)
            grads = jax.tree.map(lambda g, m: jnp.where(corrected, (g - b1 * m) / (1 - b1), g), updates, state.mu)
        fresh = optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2)
        # an element never seen before the freeze (nu = 0: an embedding row of a token not yet met)
        # gets its variance from its first gradient, then freezes: else its step would be m/eps
        nu = jax.tree.map(lambda old, new: jnp.where(frozen & (old > 0), old, new), state.nu, fresh)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, jnp.minimum(count, freeze_step))
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(adam.init, update_fn)


def momentum_step_of(plan: Any) -> int | None:
    """The update from which the optimizer's first moment is the incoming gradient: the first
    compressed step under ``parallel.momentum_correction`` (``compression_warmup_steps``), else
    ``None``."""
    p = None if plan is None else plan.cfg.parallel
    return p.compression_warmup_steps if p is not None and p.momentum_correction else None


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` (same state, ``optax.EmptyState``; the same result where the
    norm is under ``max_norm``), with the clipped update formed as ``g · (max_norm / norm)``, one
    scalar factor, instead of optax's ``(g / norm) · max_norm`` (within an ulp of it).

    Why: XLA treats a floating-point divide as expensive and will not duplicate it into its two
    consumers (Adam's two moments), so optax's form materialises a clipped copy of every gradient,
    and for the embedding and LM head at a large vocabulary those copies are the step's peak
    (0.25× the fp32 logits in the 1-layer LLaMA of ``tests/integration/test_logprobs.py``). A
    multiply by a scalar is fused into each consumer instead.
    """

    def update_fn(updates, state, params=None):
        del params
        g_norm = optax.tree.norm(updates)
        factor = jnp.where(g_norm < max_norm, 1.0, max_norm / g_norm)
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def optimizer_parts(t: TrainingConfig, plan: Any = None, *, on_host: bool = False,
                    param_specs: Any = None) -> list[optax.GradientTransformation]:
    """The transformations :func:`build_optimizer` chains: ``[clip_by_global_norm, adamw]``
    (``[adamw]`` when ``max_grad_norm`` is 0). The train step uses them one by one when part of
    the optimizer state is updated on the host (``offload.optimizer_device=host``).

    ``on_host``: the AdamW for ``compute_on("device_host")``: the fused optimizer's plain-JAX
    reference, on global arrays (no ``shard_map``, no Pallas kernel). ``param_specs``: the specs the
    fused optimizer's ``shard_map`` follows (default ``plan.specs.opt``; a tree with ``None`` for the
    leaves it does not update).
    """
    sched = lr_schedule(t)
    mask = decay_mask  # a callable: optax applies it to the params tree
    if t.optimizer == "fused_adamw":
        if on_host:
            local = {"impl": "reference"}
        else:
            local = {} if plan is None else {"mesh": plan.mesh, "param_specs": plan.specs.opt
                                             if param_specs is None else param_specs}
        adam = fused_adamw(sched, b1=t.adam_beta1, b2=t.adam_beta2, eps=t.adam_eps,
                           weight_decay=t.weight_decay, mask=mask, **local)
    elif t.adam_freeze_step > 0:  # optax.adamw with the variance frozen (1-bit Adam)
        adam = optax.chain(
            scale_by_adam_frozen_variance(t.adam_beta1, t.adam_beta2, t.adam_eps, t.adam_freeze_step,
                                          momentum_step_of(plan)),
            optax.add_decayed_weights(t.weight_decay, mask), optax.scale_by_learning_rate(sched))
    else:
        adam = optax.adamw(sched, b1=t.adam_beta1, b2=t.adam_beta2, eps=t.adam_eps,
                           weight_decay=t.weight_decay, mask=mask)
    parts = [clip_by_global_norm(t.max_grad_norm)] if t.max_grad_norm > 0 else []
    return parts + [adam]


def build_optimizer(t: TrainingConfig, plan: Any = None) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm)`` (skipped when 0) followed by AdamW.

    ``training.optimizer = "fused_adamw"`` selects :func:`jaxcolossal.optim.fused_adamw`
    (Colossal-AI's HybridAdam); ``"adamw"`` is ``optax.adamw``. The global norm is over the
    global (sharded) gradient arrays, so each parameter counts exactly once.

    With a :class:`~jaxcolossal.train.state.TrainPlan`, the fused optimizer runs its per-leaf
    update inside ``shard_map`` on each device's local shard of the ZeRO optimizer-state
    sharding (``plan.specs.opt``), so the update never gathers. The state is the chain's tuple
    (one entry per part of :func:`optimizer_parts`).
    """
    return optax.chain(*optimizer_parts(t, plan))
