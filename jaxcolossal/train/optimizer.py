"""The optimizer from the training config: global-norm clipping then AdamW with warmup and
cosine decay (optax). Weight decay skips norm scales and biases (:func:`decay_mask`)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxcolossal.config import TrainingConfig


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


NO_DECAY_SUFFIXES = ("norm", "norm_bias")
NO_DECAY_NAMES = {"bq", "bk", "bv", "bo", "b_fc", "b_proj"}


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: weight matrices and embeddings, not norm scales,
    LayerNorm biases or linear biases (the Hugging Face / Megatron convention)."""
    def keep(path, _):
        last = path[-1]
        name = str(getattr(last, "key", getattr(last, "name", last)))
        return not (name.endswith(NO_DECAY_SUFFIXES) or name in NO_DECAY_NAMES)
    return jax.tree_util.tree_map_with_path(keep, params)


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
        from jaxcolossal.optim import fused_adamw
        if on_host:
            local = {"impl": "reference"}
        else:
            local = {} if plan is None else {"mesh": plan.mesh, "param_specs": plan.specs.opt
                                             if param_specs is None else param_specs}
        adam = fused_adamw(sched, b1=t.adam_beta1, b2=t.adam_beta2, eps=t.adam_eps,
                           weight_decay=t.weight_decay, mask=mask, **local)
    else:
        adam = optax.adamw(sched, b1=t.adam_beta1, b2=t.adam_beta2, eps=t.adam_eps,
                           weight_decay=t.weight_decay, mask=mask)
    parts = [optax.clip_by_global_norm(t.max_grad_norm)] if t.max_grad_norm > 0 else []
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
