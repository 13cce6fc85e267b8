"""The train step's part for offloaded state (``offload`` section; :mod:`jaxcolossal.memory.placement`
decides which leaves live in pinned host memory): moving offloaded leaves into device memory, and
the optimizer update split between the leaves in device memory and the offloaded ones, which are
updated on the host (``compute_on``) or streamed through the device one leaf at a time.

Sources: ZeRO-Offload (Ren et al., 2021) and Colossal-AI's Gemini / HybridAdam (CPU Adam for
host-resident state); JAX's "Memories and host offloading" guide (memory kinds, ``compute_on``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.memory.placement import DEVICE, HOST
from jaxcolossal.models.layers.lora import merge
from jaxcolossal.parallel.sharding import constrain
from jaxcolossal.train.optimizer import optimizer_parts


def to_device(tree: Any, shardings: Any, keep: Any = None) -> Any:
    """Inside the step: move each leaf whose target sharding is in pinned host memory into device
    memory (same spec); device-resident leaves pass through. ``tree`` may be ``None``. ``keep``:
    an optional same-structure tree of bool, True for leaves that stay in host memory (the stacked
    layers, which the layer scan streams in one layer at a time:
    :func:`jaxcolossal.parallel.layer_scan.fetch_layer`)."""
    if tree is None:
        return None
    keep = keep if keep is not None else jax.tree.map(lambda _: False, shardings)
    return jax.tree.map(lambda x, s, k: jax.device_put(x, s.with_memory_kind(DEVICE))
                        if s.memory_kind == HOST and not k else x, tree, shardings, keep, is_leaf=lambda x: x is None)


def streamed_in_scan(plan: Any, whole_model: bool = False) -> Any:
    """Param-shaped tree of bool: True for the leaves stacked over ``layers`` (the layer scan's
    inputs), which offloaded compute params keep in host memory until the scan body fetches one
    layer (without pipeline parallelism, where offloaded params are refused anyway).
    ``whole_model``: shaped as the model's whole params dict (LoRA's frozen base and adapters)."""
    axes = merge(plan.frozen_axes, plan.param_axes) if whole_model else plan.param_axes
    return jax.tree.map(lambda a: bool(a) and a[0] == "layers", axes, is_leaf=lambda x: isinstance(x, tuple))


def _split(tree: Any, where: Any) -> Any:
    """``tree`` (param-shaped) with the leaves where ``where`` is False replaced by ``None``."""
    return jax.tree.map(lambda w, x: x if w else None, where, tree)


def _is_none(x: Any) -> bool:
    """The ``is_leaf`` that keeps ``None`` leaves (a missing part) in a flattened tree."""
    return x is None


def _first_present(*trees: Any) -> Any:
    """One tree from several of the same structure in which each leaf is present (not ``None``) in
    at least one; the first present value wins (optimizer states split by placement share their
    step count, so the first part's is taken)."""
    flat, treedef = jax.tree.flatten(trees[0], is_leaf=_is_none)
    rest = [jax.tree.leaves(t, is_leaf=_is_none) for t in trees[1:]]
    return jax.tree.unflatten(treedef, [next((x for x in (a, *others) if x is not None), None)
                                        for a, *others in zip(flat, *rest)])


def make_offload_update(plan: Any, shardings: Any, tier: Any = None) -> Callable:
    """``update(grads, opt_state, master, finite, step) -> (new_master, new_params, opt_state)`` for a
    state with offloaded optimizer leaves (``plan.placement.optim``), from the config's optimizer
    parts (:func:`jaxcolossal.train.optimizer.optimizer_parts`). ``tier``: the
    :class:`~jaxcolossal.train.nvme.NvmeTier` when the offloaded leaves live on NVMe (then their
    places in ``opt_state``/``master`` hold tokens, and ``step`` is the state's step count).

    The global-norm clipping runs first, on the device, over all gradients; the leaves in device
    memory are updated as usual. Then, by ``offload.optimizer_device``:

    * ``host``: the offloaded leaves' fp32 gradients move down (4 B/param), AdamW updates master and
      moments in place in host memory (``compute_on("device_host")``, Colossal-AI's CPU Adam in
      HybridAdam), and the new compute-dtype params move up (p B/param).
    * ``device``: the offloaded leaves are **streamed one at a time**: leaf i's master and moments
      move in, are updated by the (fused) AdamW, and move out; an ``optimization_barrier`` makes leaf
      i+1's move-in wait for leaf i's results, so that device memory holds about one leaf's optimizer
      state at a time, never the whole offloaded state (ZeRO-Offload's streamed update; the
      largest leaf's K bytes/param is what :func:`jaxcolossal.memory.budget.device_need` reserves).

    * ``device`` with the NVMe tier: the same stream, but leaf i's master and moments are read from
      their files (``io_callback``, each device its shard) and written back to the other
      generation; the read of leaf i+1 waits only for leaf i−1's write (one leaf of prefetch), and
      the first read waits for the commit of the previous step's files.

    A non-finite step keeps the old values on both sides. Raises nothing beyond the optimizer's own
    errors.
    """
    if tier is not None and plan.placement.optimizer_device != "device":
        raise ValueError("the NVMe tier is updated by streaming through the device: offload.optimizer_device=device")
    return _OffloadUpdate(plan, shardings, tier)


def _keep_if(finite):
    return lambda new, old: jax.tree.map(lambda x, y: jnp.where(finite, x, y), new, old)


def _adam_step(adam, g, s, p, finite):
    """One optax update of ``p`` with state ``s``; a non-finite step keeps both."""
    upd, s_new = adam.update(g, s, p)
    keep = _keep_if(finite)
    return keep(optax.apply_updates(p, upd), p), keep(s_new, s)


def _none(x) -> bool:
    return x is None


def _move(tree, shardings, kind):
    """Leaves with a sharding go to memory ``kind``; ``None`` passes."""
    return jax.tree.map(lambda x, s: x if s is None or x is None else jax.device_put(x, s.with_memory_kind(kind)),
                        tree, shardings, is_leaf=_none)


class _OffloadUpdate:
    """:func:`make_offload_update`'s update, its phases as methods: the device-resident leaves, then
    the offloaded ones on the host (:meth:`host`) or streamed through the device (:meth:`stream`)."""

    def __init__(self, plan: Any, shardings: Any, tier: Any):
        t, self.mesh, self.specs, self.tier, self.mixed = plan.cfg.training, plan.mesh, plan.specs, tier, plan.mixed
        self.off = plan.placement.optim
        self.on_dev = jax.tree.map(lambda w: not w, self.off)
        parts = optimizer_parts(t, plan, param_specs=_split(self.specs.opt, self.on_dev))
        self.adam_dev, self.clip = parts[-1], (parts[0] if len(parts) == 2 else None)
        self.master_sh = shardings.master if plan.mixed else shardings.params
        self.dtype = plan.compute_dtype
        if plan.placement.optimizer_device == "host":
            self.adam_host = optimizer_parts(t, None, on_host=True)[-1]
            self.on_host = compute_on("device_host")(jax.jit(self._host_fn))
            self.offloaded = self.host
            return
        flat_off, treedef = jax.tree.flatten(self.off)
        self.param_index = [i for i, w in enumerate(flat_off) if w]
        self.groups = [jax.tree.unflatten(treedef, [j == i for j in range(len(flat_off))]) for i in self.param_index]
        self.adams = [optimizer_parts(t, plan, param_specs=_split(self.specs.opt, sel))[-1] for sel in self.groups]
        self.offloaded = self.stream

    def cast(self, tree):
        return jax.tree.map(lambda x: x.astype(self.dtype), tree)

    # ---- offload.optimizer_device=host

    def _host_fn(self, g, s, p, finite):
        p_new, s_new = _adam_step(self.adam_host, g, s, p, finite)
        return p_new, self.cast(p_new), s_new

    def host(self, grads, adam_state, master, finite, step=None):
        """The fp32 gradients down, AdamW in host memory, the new compute params up."""
        off, sh = self.off, self.master_sh
        host_sh = jax.tree.map(lambda s: s.with_memory_kind(HOST), _split(sh, off))
        repl_host = NamedSharding(self.mesh, P()).with_memory_kind(HOST)
        g_h = jax.device_put(_split(grads, off), host_sh)
        s_h = optax.tree_map_params(self.adam_host, lambda x, w: x if w else None, adam_state, off,
                                    transform_non_params=lambda x: jax.device_put(x, repl_host))
        p_h = jax.device_put(_split(master, off), host_sh)  # fp32: params on the device
        p_new, c_new, s_new = self.on_host(g_h, s_h, p_h, jax.device_put(finite, repl_host))
        dev_sh = jax.tree.map(lambda s: s.with_memory_kind(DEVICE), _split(sh, off))
        return p_new, jax.device_put(c_new, dev_sh), s_new

    # ---- offload.optimizer_device=device: one leaf at a time

    def _nvme_parts(self, p, s):
        """The tree of one leaf's NVMe-resident parts: master (mixed precision), then m, v."""
        return (p, s) if self.mixed else s

    def _read(self, n: int, p_in, s_in, step, written):
        """Leaf ``n``'s master and moments read from the NVMe tier once leaf n−1's write is done."""
        slots = self.tier.by_param[self.param_index[n]]
        flat, td = jax.tree.flatten(self._nvme_parts(p_in, s_in))
        assert len(flat) == len(slots), (len(flat), len(slots))
        parts_in = jax.tree.unflatten(td, self.tier.read(slots, step, written[max(len(written) - 2, 0)]))
        return parts_in if self.mixed else (p_in, parts_in)

    def _write(self, n: int, p_new, s_new, s_sh, step, written):
        """Leaf ``n``'s new master and moments written to the other generation; tokens take their places."""
        slots = self.tier.by_param[self.param_index[n]]
        s_parts = jax.tree.map(lambda x, sh: None if sh is None else x, s_new, s_sh, is_leaf=_none)
        flat, td = jax.tree.flatten(self._nvme_parts(p_new, s_parts))
        tokens = self.tier.write(slots, step, flat)
        written.append(tokens[0])
        parts_out = jax.tree.unflatten(td, tokens)
        p_out, s_out = parts_out if self.mixed else (p_new, parts_out)
        count = jax.tree.map(lambda x, sh: x if sh is None else None, s_new, s_sh, is_leaf=_none)  # stays
        return p_out, _first_present(s_out, count)

    def stream(self, grads, adam_state, master, finite, step=None):
        """Each offloaded leaf's state moved in, updated, and moved out (or read from and written to
        the NVMe tier) before the next one comes in."""
        new_p, new_c, new_s, prev = [], [], [], None
        ins = [(_split(master, sel), optax.tree_map_params(adam, lambda x, w: x if w else None, adam_state, sel,
                                                           transform_non_params=lambda _: None))  # m, v
               for sel, adam in zip(self.groups, self.adams)]
        if self.tier is not None:  # the previous step's files are complete: commit them first
            leaves = [x for p, s in ins for x in jax.tree.leaves(self._nvme_parts(p, s))]
            written = [self.tier.commit_tokens(step, leaves)]
        for n, (sel, adam) in enumerate(zip(self.groups, self.adams)):
            p_in, s_in = ins[n]
            s_sh = optax.tree_map_params(adam, lambda x, w, sh: sh if w else None, adam_state, sel, self.master_sh,
                                         transform_non_params=lambda _: None)
            p_sh = _split(self.master_sh, sel)
            if self.tier is not None:  # read leaf i once leaf i-1's write is done (leaf i-1 overlaps it)
                p_in, s_in = self._read(n, p_in, s_in, step, written)
            elif prev is not None:  # leaf i+1 comes in only once leaf i's results exist
                (p_in, s_in), _ = jax.lax.optimization_barrier(((p_in, s_in), prev))
            # the step count (shared, on the device) rejoins after the barrier
            s_in = _first_present(s_in, optax.tree_map_params(adam, lambda x: None, adam_state))
            p_new, s_new = _adam_step(adam, _split(grads, sel), _move(s_in, s_sh, DEVICE), _move(p_in, p_sh, DEVICE),
                                      finite)
            new_c.append(self.cast(p_new))
            if self.tier is not None:
                p_out, s_out = self._write(n, p_new, s_new, s_sh, step, written)
                new_p.append(p_out)
                new_s.append(s_out)
            else:
                new_p.append(_move(p_new, p_sh, HOST))
                new_s.append(_move(s_new, s_sh, HOST))
                prev = (new_p[-1], new_s[-1])
        return _first_present(*new_p), _first_present(*new_c), _first_present(*new_s)

    # ---- the whole update

    def __call__(self, grads, opt_state, master, finite, step=None):
        if self.clip is not None:
            grads, _ = self.clip.update(grads, opt_state[0])
        adam_state, on_dev = opt_state[-1], self.on_dev
        # the leaves that stay in device memory
        s_d = optax.tree_map_params(self.adam_dev, lambda x, w: x if w else None, adam_state, on_dev)
        p_d_new, s_d_new = _adam_step(self.adam_dev, _split(grads, on_dev), s_d, _split(master, on_dev), finite)
        c_d_new = constrain(self.cast(p_d_new), self.mesh, _split(self.specs.opt, on_dev))
        p_o_new, c_o_new, s_o_new = self.offloaded(grads, adam_state, master, finite,
                                                   step if self.tier is not None else None)
        new_master = jax.tree.map(lambda w, a, b: b if w else a, self.off, p_d_new, p_o_new)
        new_params = jax.tree.map(lambda w, a, b: b if w else a, self.off, c_d_new, c_o_new)
        new_state = _first_present(s_d_new, s_o_new)
        return new_master, new_params, ((opt_state[0], new_state) if self.clip is not None else (new_state,))
