"""Activation checkpointing (rematerialization) policies by name, for the layer scan.

``model.remat`` picks what the backward pass keeps from the forward pass of each layer; the rest
is recomputed (Chen et al., 2016; Korthikanti et al., 2022 for selective recomputation). The
names follow MaxText's ``remat_policy`` and Colossal-AI's gradient checkpointing:

================  =================================================================  ==========
name              kept per layer (everything else is recomputed)                     recompute
================  =================================================================  ==========
``none``          everything (no checkpointing)                                      none
``save_qkv_proj`` the q/k/v projections' outputs (MaxText ``save_qkv_proj``)         most of it
``selective``     every projection's output: q/k/v, attention out, MLP gate/up/down  norms, RoPE,
                  (MaxText ``minimal``-style)                                        attention
``dots``          every matmul without batch dims (``dots_with_no_batch_dims``)      elementwise
``full``          only the layer input (Colossal-AI ``gradient_checkpointing``)      the layer
``offload``       what ``selective`` keeps, moved to pinned host memory in the       as
                  forward and back for the backward (``offload.activations=host``)   ``selective``
================  =================================================================  ==========

Model code tags the tensors with :func:`jax.ad_checkpoint.checkpoint_name` using the names in
:data:`PROJECTIONS`; this module is the one place that maps a policy name to what is saved.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name

QKV = ("query_proj", "key_proj", "value_proj")
PROJECTIONS = QKV + ("out_proj", "mlp_gate", "mlp_up", "mlp_down")
"""Names of the tagged projection outputs (:func:`tag`), in every model family."""

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names(*QKV),
    "selective": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(PROJECTIONS),
        offload_src="device", offload_dst="pinned_host"),
}
"""``model.remat`` name -> ``jax.checkpoint`` policy (``None``: no checkpointing)."""


def tag(x: jax.Array, name: str) -> jax.Array:
    """Name ``x`` for the policies above (identity outside ``jax.checkpoint``)."""
    return checkpoint_name(x, name)


def _on_host(x: jax.Array) -> bool:
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def fetch_layer(p: Any) -> Any:
    """``p`` with the leaves that live in host memory moved into device memory; device-resident
    leaves pass through. The scan body calls it on one layer's params (``offload.offload_param_frac``
    under ZeRO-3), so that device memory holds one layer's offloaded weights at a time; their
    gradients go back to host memory layer by layer in the backward pass (the transpose of the
    move), and the step fetches those the same way."""
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device) if _on_host(a) else a, p)


def scan_layers(layer: Callable, x: jax.Array, stacked: dict, remat: str) -> jax.Array:
    """``x = layer(x, params_i)`` for each layer's params in ``stacked`` (leading dim ``[L]``), as one
    ``lax.scan`` whose body is checkpointed with the ``remat`` policy. Stacked leaves in host
    memory are streamed in one layer at a time (:func:`fetch_layer`).

    Raises:
        KeyError: an unknown policy name (the config validates it first).
    """
    body = lambda carry, p: (layer(carry, fetch_layer(p)), None)
    policy = POLICIES[remat]
    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, stacked)[0]
