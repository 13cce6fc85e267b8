"""Heterogeneous memory: which shards of the train state live in device memory and which in pinned
host memory (Colossal-AI's Gemini placement and ``cpu_offload``, ZeRO-Offload).

The split of concerns is the one the design asks for: :mod:`jaxcolossal.sharding` decides the
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

**Formulas** (docs/offload.md), per device, with Ψ the parameters of one model-parallel rank, p/K
the bytes per parameter of the compute copy / optimizer state (``train.state.BYTES_PER_PARAM``),
N the ZeRO group, and f̂ₒ, f̂ₚ the fractions reached::

    device = p·Ψ·(1 − f̂ₚ)/N₃ + K·Ψ·(1 − f̂ₒ)/N₁        host = p·Ψ·f̂ₚ/N₃ + K·Ψ·f̂ₒ/N₁

where N₃ = N with ZeRO-3 (else 1) and N₁ = N with ZeRO ≥ 1 (else 1). The fp32 gradient buffer
exists only inside the step and is always on the device.

**Auto placement** (:func:`auto`): Gemini's ``ChunkManager.optimize_chunk_config(memory_limit)``
as a search: every pair of fractions on a grid is scored by its predicted device bytes
(:func:`device_need`) and its host↔device traffic per step (:func:`traffic`); of those under the
limit, the least traffic wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxcolossal.config import Config, ConfigError, parse_bytes
from jaxcolossal.mesh import platform
from jaxcolossal.sharding import shard_bytes

HOST = "pinned_host"
DEVICE = "device"
GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The fractions :func:`auto` tries for each of offload_optim_frac and offload_param_frac."""
MAX_SUBSETS = 100_000
"""Above this many distinct host totals, :func:`choose` falls back to a greedy pass."""
CAPACITY_MARGIN = 0.9
"""The share of a device's reported capacity a run may plan for when no limit is given."""

_is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731


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
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_shape)[0]]


def local_elements(shapes: Any, specs: Any, mesh_shape: Mapping[str, int]) -> Any:
    """Elements per device of each parameter leaf under ``specs`` (a param-shaped tree of ints)."""
    return jax.tree.map(lambda s, sp: shard_bytes(s, jnp.uint8, sp, mesh_shape), shapes, specs, is_leaf=_is_shape)


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


# ----------------------------------------------------------------------------- bytes


def state_bytes(placement: Placement, shapes: Any, specs: Any, mesh_shape: Mapping[str, int],
                precision: str, nvme: bool = False) -> dict[str, int]:
    """Per-device bytes of the persistent model state by memory kind (the formulas above), plus
    the fp32 gradient buffer that the step holds on the device: ``{"device", "host", "grads",
    "nvme"}``. ``nvme``: the offloaded optimizer state lives in the NVMe tier's files
    (``offload.nvme_path``), not in host memory."""
    from jaxcolossal.train.state import BYTES_PER_PARAM
    b = BYTES_PER_PARAM[precision]
    opt = local_elements(shapes, specs.opt, mesh_shape)
    par = local_elements(shapes, specs.params, mesh_shape)
    grads = sum(jax.tree.leaves(local_elements(shapes, specs.grads, mesh_shape))) * b["g"]
    split = lambda sizes, where: (sum(s for s, w in zip(jax.tree.leaves(sizes), jax.tree.leaves(where)) if not w),
                                  sum(s for s, w in zip(jax.tree.leaves(sizes), jax.tree.leaves(where)) if w))
    od, oh = split(opt, placement.optim)
    pd, ph = split(par, placement.params)
    opt_host = b["K"] * oh
    return {"device": b["p"] * pd + b["K"] * od, "host": b["p"] * ph + (0 if nvme else opt_host), "grads": grads,
            "nvme": opt_host if nvme else 0}


def formula_bytes(psi_local: int, n: int, zero_stage: int, precision: str, optim_frac: float,
                  param_frac: float) -> dict[str, float]:
    """docs/offload.md's formulas: ``{"device", "host"}`` bytes per device of params + optimizer
    state for Ψ = ``psi_local`` parameters per model-parallel rank over a ZeRO group of ``n``, and
    ``"optim_host"``, the optimizer state's share of ``host`` (what the NVMe tier holds instead)."""
    from jaxcolossal.train.state import BYTES_PER_PARAM
    b = BYTES_PER_PARAM[precision]
    n3 = n if zero_stage >= 3 else 1
    n1 = n if zero_stage >= 1 else 1
    optim_host = b["K"] * psi_local * optim_frac / n1
    return {"device": b["p"] * psi_local * (1 - param_frac) / n3 + b["K"] * psi_local * (1 - optim_frac) / n1,
            "host": b["p"] * psi_local * param_frac / n3 + optim_host, "optim_host": optim_host}


def device_need(placement: Placement, cfg: Config, shapes: Any, specs: Any, mesh_shape: Mapping[str, int],
                backend: str | None = None) -> dict:
    """Predicted per-device peak: the state on the device during the step (the device-resident
    part, plus the offloaded compute params that are in device memory during the step: see
    below) + the fp32 gradients + activations and temporaries
    (:func:`jaxcolossal.activations.step_peak`: the saved residuals traced from the model code,
    one layer's backward, the gradients in flight, per layout and ``backend``) + with
    ``optimizer_device=device`` one offloaded leaf's optimizer state streamed in (the largest).
    ``backend``: ``"gpu"``, ``"cpu"``, or ``None`` for the platform JAX runs on (the run's own).
    Returns the parts, ``"total"`` and ``"host"`` (the pinned host bytes per device); ``"state"``
    includes ``"compression"``, the gradient-compression state (error-feedback residuals, PowerSGD's
    ``Q``: :func:`jaxcolossal.train.compression.state_bytes`).

    Offloaded compute params: a leaf stacked over ``layers`` streams in one layer at a time inside
    the layer scan (two layers counted: the one in use and the next), except with
    ``model.remat=none``, where the backward pass keeps every layer's fetched weights (then the
    whole leaf counts); the other leaves (embedding, head, final norm) move in whole."""
    from jaxcolossal.train.state import BYTES_PER_PARAM
    sb = state_bytes(placement, shapes, specs, mesh_shape, cfg.precision.mode, bool(cfg.offload.nvme_path))
    opt = jax.tree.leaves(local_elements(shapes, specs.opt, mesh_shape))
    offl = [s for s, w in zip(opt, jax.tree.leaves(placement.optim)) if w]
    stream = max(offl, default=0) * BYTES_PER_PARAM[cfg.precision.mode]["K"] if placement.optimizer_device == "device" else 0
    par = jax.tree.leaves(local_elements(shapes, specs.params, mesh_shape))
    layers = [n for n, _ in _stacked(shapes)]
    streamed = cfg.model.remat != "none"
    params_in = sum((min(2, n) * e // n if n and streamed else e)
                    for e, w, n in zip(par, jax.tree.leaves(placement.params), layers) if w) * \
        BYTES_PER_PARAM[cfg.precision.mode]["p"]
    from jaxcolossal.models import param_layout
    from jaxcolossal.train.compression import state_bytes as compression_bytes
    comp = compression_bytes(cfg.parallel, shapes, param_layout(cfg.model, mesh_shape["tp"])[2]) \
        if cfg.parallel.gradient_compression != "none" else 0
    from jaxcolossal.activations import step_peak
    state = sb["device"] + params_in + comp
    if backend is None:
        backend = "cpu" if jax.default_backend() == "cpu" else "gpu"
    peak = step_peak(cfg, mesh_shape, state, sb["grads"], backend)
    acts = peak["activations"]
    parts = {"state": state, "grads": sb["grads"], "activations": acts, "stream": stream,
             "host": sb["host"], "nvme": sb["nvme"], "compression": comp, "peak": peak}
    parts["total"] = parts["state"] + sb["grads"] + acts + stream
    return parts


def _stacked(shapes: Any) -> list[tuple[int, Any]]:
    """Per param leaf (flatten order): ``(L, shape)`` for a leaf under ``layers`` (stacked ``[L, ...]``,
    streamed by the layer scan), ``(0, shape)`` for the others."""
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    return [((s[0] if any(getattr(k, "key", None) == "layers" for k in path) else 0), s) for path, s in flat]


def traffic(placement: Placement, shapes: Any, specs: Any, mesh_shape: Mapping[str, int], precision: str) -> int:
    """Host↔device bytes per step per device: an offloaded optimizer leaf moves its state in and out
    (``2·K``/param, ``optimizer_device=device``) or its fp32 gradient down and its new compute
    params up (``4 + p``, ``host``); an offloaded compute leaf moves in (twice when stacked: the
    forward and the backward's recomputation fetch each layer), its compute-dtype gradient down
    and up, and its new values out (``5·p``, or ``4·p`` unstacked)."""
    from jaxcolossal.train.state import BYTES_PER_PARAM
    b = BYTES_PER_PARAM[precision]
    opt = jax.tree.leaves(local_elements(shapes, specs.opt, mesh_shape))
    par = jax.tree.leaves(local_elements(shapes, specs.params, mesh_shape))
    per_opt = 2 * b["K"] if placement.optimizer_device == "device" else b["g"] + b["p"]
    per_par = [(5 if n else 4) * b["p"] for n, _ in _stacked(shapes)]
    return int(sum(s for s, w in zip(opt, jax.tree.leaves(placement.optim)) if w) * per_opt
               + sum(s * k for s, w, k in zip(par, jax.tree.leaves(placement.params), per_par) if w))


def device_limit(cfg: Config, devices: list | None = None) -> int:
    """``offload.device_memory_limit`` in bytes, or the first device's reported capacity × 0.9
    (:data:`CAPACITY_MARGIN`), or 0 when neither is known (the CPU reports none)."""
    limit = parse_bytes(cfg.offload.device_memory_limit, "offload.device_memory_limit")
    if limit or devices is None:
        return limit
    try:
        stats = devices[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics
        stats = {}
    cap = stats.get("bytes_limit", 0)
    return int(cap * CAPACITY_MARGIN) if cap else 0


def gib(x: float) -> str:
    return f"{x / 2**30:,.2f} GiB" if abs(x) >= 2**30 else f"{x / 2**20:,.2f} MiB"


def auto(cfg: Config, shapes: Any, specs: Any, mesh_shape: Mapping[str, int], limit: int,
         backend: str | None = None) -> tuple[Placement, str]:
    """The fractions on :data:`GRID` whose predicted device bytes fit ``limit`` with the least
    host↔device traffic (ties: the smaller fractions), and the lines that explain the choice.

    Raises:
        ConfigError: nothing fits, with the smallest need found.
    """
    od = cfg.offload.optimizer_device
    # compute params can be offloaded under ZeRO-3 without pipeline parallelism (they lower the peak
    # only with a remat policy: see device_need)
    can_params = cfg.parallel.zero_stage == 3 and mesh_shape.get("pp", 1) == 1 and cfg.model.remat != "none"
    param_grid = GRID if can_params else (cfg.offload.offload_param_frac,)
    rows = []
    for fo in GRID:
        for fp in param_grid:
            pl = make_placement(fo, fp, od, shapes, specs, mesh_shape)
            need = device_need(pl, cfg, shapes, specs, mesh_shape, backend)
            rows.append((need["total"] <= limit, traffic(pl, shapes, specs, mesh_shape, cfg.precision.mode),
                         fo + fp, pl, need))
    fits = [r for r in rows if r[0]]
    lines = [f"offload auto: device_memory_limit {gib(limit)}; predicted device bytes per device "
             f"(state + grads + activations + stream) and host↔device traffic per step:"]
    for ok, tr, _, pl, need in rows:
        lines.append(f"  optim {pl.asked_optim_frac:4.2f} (reached {pl.optim_frac:4.2f})  param {pl.asked_param_frac:4.2f} "
                     f"(reached {pl.param_frac:4.2f})  device {gib(need['total']):>12}  host {gib(need['host']):>12}  "
                     f"traffic {gib(tr):>12}  {'fits' if ok else 'over'}")
    if not fits:
        best = min(rows, key=lambda r: r[4]["total"])
        raise ConfigError(
            f"offload.placement_policy=auto: nothing fits offload.device_memory_limit={gib(limit)}: the smallest "
            f"predicted need is {gib(best[4]['total'])} (offload_optim_frac={best[3].asked_optim_frac:g}, "
            f"offload_param_frac={best[3].asked_param_frac:g}; activations {gib(best[4]['activations'])}); "
            "use more devices, a higher zero_stage, model.remat=full or a smaller microbatch")
    _, tr, _, pl, need = min(fits, key=lambda r: (r[1], r[2]))
    lines.append(f"offload auto: chose offload_optim_frac={pl.asked_optim_frac:g} offload_param_frac="
                 f"{pl.asked_param_frac:g} (device {gib(need['total'])} ≤ {gib(limit)}, traffic {gib(tr)}/step)")
    return pl, "\n".join(lines)


def check_host(cfg: Config, placement: Placement, shapes: Any, specs: Any, mesh_shape: Mapping[str, int],
               local_devices: int) -> int:
    """The pinned host bytes one process needs (``local_devices`` × the host bytes per device),
    checked against ``offload.host_memory_limit`` when it is given.

    Raises:
        ConfigError: above the limit, with the shortfall in bytes.
    """
    host = state_bytes(placement, shapes, specs, mesh_shape, cfg.precision.mode,
                       bool(cfg.offload.nvme_path))["host"] * local_devices
    limit = parse_bytes(cfg.offload.host_memory_limit, "offload.host_memory_limit")
    if limit and host > limit:
        raise ConfigError(
            f"the offloaded state needs {gib(host)} of pinned host memory per process ({local_devices} devices × "
            f"{gib(host / local_devices)}) but offload.host_memory_limit allows {gib(limit)}: short by "
            f"{host - limit:,} bytes; offload less (offload_optim_frac/offload_param_frac), raise zero_stage or "
            "use more nodes")
    return host


def _no_offload_fits(cfg: Config, shapes: Any, specs: Any, mesh_shape: Mapping[str, int], limit: int,
                     backend: str | None) -> str:
    """The advice when no offload fraction fits with the config's ``optimizer_device``: the host
    update when it fits (it streams nothing through the device), else the changes that still apply."""
    if cfg.offload.optimizer_device == "device":
        host = make_placement(1.0, cfg.offload.offload_param_frac, "host", shapes, specs, mesh_shape)
        if device_need(host, cfg, shapes, specs, mesh_shape, backend)["total"] <= limit:
            return "offload.offload_optim_frac=1 offload.optimizer_device=host would fit (the update on the CPU)"
    ways = ["use more devices"] + (["a higher zero_stage"] if cfg.parallel.zero_stage < 3 else []) \
        + (["model.remat=full"] if cfg.model.remat != "full" else []) \
        + (["a smaller microbatch (gradient accumulation)"] if mesh_shape.get("pp", 1) == 1 else
           ["more pipeline microbatches"])
    return "no offload setting fits either: " + ", ".join(ways[:-1]) + " or " + ways[-1]


def resolve(cfg: Config, shapes: Any, specs: Any, mesh_shape: Mapping[str, int],
            devices: list | None = None, backend: str | None = None) -> tuple[Placement, str]:
    """The run's :class:`Placement` from the ``offload`` section, checked against the device limit
    before anything is compiled; with ``placement_policy=auto`` the fractions are chosen here (the
    config keeps what the user wrote; the plan holds the choice). Returns the placement and a report (``""`` when silent).

    Raises:
        ConfigError: the predicted need is above the limit (the shortfall in bytes and the offload
            settings that would fit), or auto finds nothing that fits.
    """
    o = cfg.offload
    limit = device_limit(cfg, devices)
    if backend is None and devices:  # the memory model of the platform the mesh compiles for
        backend = platform(devices)
    if o.placement_policy == "auto":
        if not limit:
            raise ConfigError("offload.placement_policy=auto needs offload.device_memory_limit (e.g. 80GB): this "
                              "backend reports no device capacity")
        pl, report = auto(cfg, shapes, specs, mesh_shape, limit, backend)
        check_host(cfg, pl, shapes, specs, mesh_shape, cfg.offload.devices_per_host if devices is None else
                   sum(1 for d in devices if d.process_index == jax.process_index()))
        return pl, report
    pl = make_placement(o.offload_optim_frac, o.offload_param_frac, o.optimizer_device, shapes, specs, mesh_shape)
    check_host(cfg, pl, shapes, specs, mesh_shape, cfg.offload.devices_per_host if devices is None else
               sum(1 for d in devices if d.process_index == jax.process_index()))
    if limit:
        need = device_need(pl, cfg, shapes, specs, mesh_shape, backend)
        if need["total"] > limit:
            try:
                fit, _ = auto(cfg, shapes, specs, mesh_shape, limit, backend)
                hint = (f"offload.offload_optim_frac={fit.asked_optim_frac:g}"
                        + (f" offload.offload_param_frac={fit.asked_param_frac:g}" if fit.asked_param_frac else "")
                        + " would fit (or offload.placement_policy=auto)")
            except ConfigError:
                hint = _no_offload_fits(cfg, shapes, specs, mesh_shape, limit, backend)
            raise ConfigError(
                f"the run needs {gib(need['total'])} per device ({need['total']:,} bytes: state {gib(need['state'])}, "
                f"fp32 grads {gib(need['grads'])}, activations ≈{gib(need['activations'])}"
                + (f", optimizer stream {gib(need['stream'])}" if need["stream"] else "")
                + f") but offload.device_memory_limit allows {gib(limit)}: short by {need['total'] - limit:,} bytes; "
                + hint)
    return pl, ""


# ----------------------------------------------------------------------------- memory kinds


def with_kind(sharding: NamedSharding, host: bool) -> NamedSharding:
    """``sharding`` in pinned host memory when ``host``, else in device memory."""
    return sharding.with_memory_kind(HOST if host else DEVICE)


def place_state(shardings: Any, placement: Placement, tx: Any, mixed: bool) -> Any:
    """The train state's shardings (a ``TrainState`` of ``NamedSharding``) with the memory kinds of
    ``placement``: offloaded compute params, master copy and optimizer moments in pinned host
    memory; counters, the loss scaler and the rest in device memory."""
    import optax
    is_sh = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    params = jax.tree.map(with_kind, shardings.params, placement.params, is_leaf=is_sh)
    master = jax.tree.map(with_kind, shardings.master, placement.optim, is_leaf=is_sh) if mixed else None
    opt = optax.tree_map_params(tx, with_kind, shardings.opt_state, placement.optim,
                                transform_non_params=lambda s: with_kind(s, False), is_leaf=is_sh)
    dev = lambda t: jax.tree.map(lambda s: with_kind(s, False), t, is_leaf=is_sh)  # noqa: E731
    return shardings.replace(step=dev(shardings.step), params=params, master=master, opt_state=opt,
                             scaler=dev(shardings.scaler))


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

