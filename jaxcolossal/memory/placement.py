"""Heterogeneous memory: which shards of the train state live in device memory and which in pinned
host memory (Colossal-AI's Gemini placement and ``cpu_offload``, ZeRO-Offload). This module
decides *where* a shard lives; what a placement costs in bytes, and the choice of one for a
device budget, are :mod:`jaxcolossal.memory.budget`.

The split of concerns is the one the design asks for: :mod:`jaxcolossal.parallel.sharding` decides the
*specs* (what each device holds, by ZeRO stage and tensor parallelism); this module decides the
*memory kind* of each shard (``device`` or ``pinned_host``, JAX's memory kinds). The train step
only follows: it moves an offloaded leaf into device memory where it is used, or updates it on the
host with ``compute_on("device_host")`` (:func:`jaxcolossal.train.step.make_train_step`).

**What a fraction means, exactly.** The unit of placement is a parameter leaf (a stacked leaf
``[L, ...]`` counts as one): its optimizer state (Adam m and v, and the fp32 master copy in mixed
precision) moves as a whole, as do its compute parameters. :func:`choose` takes the set of leaves
whose per-device bytes come closest to the fraction asked (an exact subset-sum over the leaves;
ties: the fewest leaves, found largest first). Fewest and largest, because big transfers reach
the link's bandwidth while small leaves (norm scales, biases) would pay a transfer's latency for
a few bytes. The fraction reached (by bytes, per device) is reported next to the one asked; 0 and
1 are always exact, and with a model's dozen-odd leaves the others land within a few tenths of a
percent (docs/offload.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxcolossal.parallel.sharding import is_named_sharding, is_shape, shard_bytes

HOST = "pinned_host"
DEVICE = "device"
MAX_SUBSETS = 100_000
"""Above this many distinct host totals, :func:`choose` falls back to a greedy pass."""


@dataclass(frozen=True)
class Placement:
    """Where each parameter leaf's state lives.

    Attributes:
        optim: param-shaped tree of bool: True = the leaf's optimizer state (m, v, master) lives in
            pinned host memory.
        params: param-shaped tree of bool: True = the leaf's compute parameters live in pinned host
            memory between steps (ZeRO-3 only).
        optimizer_device: ``device`` or ``host``: where the offloaded optimizer state is updated.
        optim_frac, param_frac: the fractions reached (per-device bytes on the host / all).
        asked_optim_frac, asked_param_frac: the fractions the config asked for.
    """

    optim: Any
    params: Any
    optimizer_device: str = "device"
    optim_frac: float = 0.0
    param_frac: float = 0.0
    asked_optim_frac: float = 0.0
    asked_param_frac: float = 0.0

    @property
    def any_optim(self) -> bool:
        return any(jax.tree.leaves(self.optim))

    @property
    def any_params(self) -> bool:
        return any(jax.tree.leaves(self.params))

    @property
    def active(self) -> bool:
        """True when any part of the state is in host memory."""
        return self.any_optim or self.any_params


def _names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_shape)[0]]


def local_elements(shapes: Any, specs: Any, mesh_shape: Mapping[str, int]) -> Any:
    """Elements per device of each parameter leaf under ``specs`` (a param-shaped tree of ints)."""
    return jax.tree.map(lambda s, sp: shard_bytes(s, jnp.uint8, sp, mesh_shape), shapes, specs, is_leaf=is_shape)


def choose(sizes: Any, frac: float) -> tuple[Any, float]:
    """The leaves to put on the host for ``frac`` of the bytes, and the fraction reached.

    Args:
        sizes: param-shaped tree of per-device sizes (elements or bytes; only ratios matter).
        frac: in [0, 1].

    Returns:
        (tree of bool, reached fraction): largest leaves first, each taken when that brings the
        host's share closer to ``frac`` (module docstring).
    """
    flat, treedef = jax.tree.flatten(sizes)
    names = _names(sizes)
    total = sum(flat)
    if total == 0 or frac <= 0:
        return jax.tree.unflatten(treedef, [False] * len(flat)), 0.0
    if frac >= 1:
        return jax.tree.unflatten(treedef, [True] * len(flat)), 1.0
    target = frac * total
    order = sorted(range(len(flat)), key=lambda i: (-flat[i], names[i]))
    # every reachable host total, each with its fewest-leaves subset (largest leaves found first)
    reach: dict[int, tuple] = {0: ()}
    for i in order:
        for s, sub in list(reach.items()):
            t = s + flat[i]
            if t not in reach or len(reach[t]) > len(sub) + 1:
                reach[t] = sub + (i,)
        if len(reach) > MAX_SUBSETS:  # too many distinct totals: greedy, largest first
            got, chosen = 0, ()
            for j in order:
                if abs(got + flat[j] - target) < abs(got - target):
                    got, chosen = got + flat[j], chosen + (j,)
            reach = {got: chosen}
            break
    got = min(reach, key=lambda s: (abs(s - target), len(reach[s])))
    take = [False] * len(flat)
    for i in reach[got]:
        take[i] = True
    return jax.tree.unflatten(treedef, take), got / total


def make_placement(optim_frac: float, param_frac: float, optimizer_device: str, shapes: Any, specs: Any,
                   mesh_shape: Mapping[str, int]) -> Placement:
    """A :class:`Placement` for the two fractions, from the parameter shapes and the ZeRO specs
    (``specs.opt`` sizes the optimizer state's shards, ``specs.params`` the compute copy's)."""
    optim, fo = choose(local_elements(shapes, specs.opt, mesh_shape), optim_frac)
    params, fp = choose(local_elements(shapes, specs.params, mesh_shape), param_frac)
    return Placement(optim, params, optimizer_device, fo, fp, optim_frac, param_frac)


# ----------------------------------------------------------------------------- memory kinds


def with_kind(sharding: NamedSharding, host: bool) -> NamedSharding:
    """``sharding`` in pinned host memory when ``host``, else in device memory."""
    return sharding.with_memory_kind(HOST if host else DEVICE)


def place_state(shardings: Any, placement: Placement, tx: Any, mixed: bool) -> Any:
    """The train state's shardings (a ``TrainState`` of ``NamedSharding``) with the memory kinds of
    ``placement``: offloaded compute params, master copy and optimizer moments in pinned host
    memory; counters, the loss scaler and the rest in device memory."""
    params = jax.tree.map(with_kind, shardings.params, placement.params, is_leaf=is_named_sharding)
    master = jax.tree.map(with_kind, shardings.master, placement.optim, is_leaf=is_named_sharding) if mixed else None
    opt = optax.tree_map_params(tx, with_kind, shardings.opt_state, placement.optim,
                                transform_non_params=lambda s: with_kind(s, False), is_leaf=is_named_sharding)
    return shardings.replace(step=_on_device(shardings.step), params=params, master=master, opt_state=opt,
                             scaler=_on_device(shardings.scaler))


def _on_device(tree: Any) -> Any:
    """A tree of ``NamedSharding`` in device memory."""
    return jax.tree.map(lambda s: with_kind(s, False), tree, is_leaf=is_named_sharding)


def bytes_by_kind(tree: Any) -> dict[str, int]:
    """Bytes of ``tree``'s arrays on the first addressable device, by memory kind, read from each
    shard's ``sharding.memory_kind``: ``{"device": ..., "pinned_host": ...}``."""
    dev = jax.local_devices()[0]
    out = {DEVICE: 0, HOST: 0}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            if s.device == dev:
                kind = s.data.sharding.memory_kind or DEVICE
                out[HOST if kind == HOST else DEVICE] += s.data.nbytes
    return out

