"""What a layout costs in device and host memory, per device, and the offload placement that fits
a device budget: the formulas of docs/offload.md, the activations of :mod:`jaxcolossal.memory.activations`,
and Gemini's auto placement as a search.

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

import copy
from typing import Any, Mapping

import jax

from jaxcolossal.config import BYTES_PER_PARAM, Config, ConfigError, gib, parse_bytes
from jaxcolossal.config.derived import grpo_generation_batch
from jaxcolossal.memory.activations import step_peak
from jaxcolossal.memory.placement import Placement, local_elements, make_placement
from jaxcolossal.memory.rollout import reference_bytes, rollout_need
from jaxcolossal.models import adapter_layout, param_layout
from jaxcolossal.parallel.compression import state_bytes as compression_bytes
from jaxcolossal.parallel.mesh import mesh_shape as resolved_shape
from jaxcolossal.parallel.mesh import platform
from jaxcolossal.parallel.sharding import is_shape, rules_for, state_specs

GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The fractions :func:`auto` tries for each of offload_optim_frac and offload_param_frac."""
CAPACITY_MARGIN = 0.9
"""The share of a device's reported capacity a run may plan for when no limit is given."""


def _split_by(sizes: Any, where: Any) -> tuple[int, int]:
    """``(sum of sizes where False, sum where True)`` over two trees of the same structure."""
    return (sum(s for s, w in zip(jax.tree.leaves(sizes), jax.tree.leaves(where)) if not w),
            sum(s for s, w in zip(jax.tree.leaves(sizes), jax.tree.leaves(where)) if w))


def state_bytes(placement: Placement, shapes: Any, specs: Any, mesh_shape: Mapping[str, int],
                precision: str, nvme: bool = False) -> dict[str, int]:
    """Per-device bytes of the persistent model state by memory kind (the formulas above), plus
    the fp32 gradient buffer that the step holds on the device: ``{"device", "host", "grads",
    "nvme"}``. ``nvme``: the offloaded optimizer state lives in the NVMe tier's files
    (``offload.nvme_path``), not in host memory."""
    b = BYTES_PER_PARAM[precision]
    opt = local_elements(shapes, specs.opt, mesh_shape)
    par = local_elements(shapes, specs.params, mesh_shape)
    grads = sum(jax.tree.leaves(local_elements(shapes, specs.grads, mesh_shape))) * b["g"]
    od, oh = _split_by(opt, placement.optim)
    pd, ph = _split_by(par, placement.params)
    opt_host = b["K"] * oh
    return {"device": b["p"] * pd + b["K"] * od, "host": b["p"] * ph + (0 if nvme else opt_host), "grads": grads,
            "nvme": opt_host if nvme else 0}


def formula_bytes(psi_local: int, n: int, zero_stage: int, precision: str, optim_frac: float,
                  param_frac: float) -> dict[str, float]:
    """docs/offload.md's formulas: ``{"device", "host"}`` bytes per device of params + optimizer
    state for Ψ = ``psi_local`` parameters per model-parallel rank over a ZeRO group of ``n``, and
    ``"optim_host"``, the optimizer state's share of ``host`` (what the NVMe tier holds instead)."""
    b = BYTES_PER_PARAM[precision]
    n3 = n if zero_stage >= 3 else 1
    n1 = n if zero_stage >= 1 else 1
    optim_host = b["K"] * psi_local * optim_frac / n1
    return {"device": b["p"] * psi_local * (1 - param_frac) / n3 + b["K"] * psi_local * (1 - optim_frac) / n1,
            "host": b["p"] * psi_local * param_frac / n3 + optim_host, "optim_host": optim_host}


def device_need(placement: Placement, cfg: Config, shapes: Any, specs: Any, mesh_shape: Mapping[str, int],
                backend: str = "gpu") -> dict:
    """Predicted per-device peak: the state on the device during the step (the device-resident
    part, plus the offloaded compute params that are in device memory during the step: see
    below) + the fp32 gradients + activations and temporaries
    (:func:`jaxcolossal.memory.activations.step_peak`: the saved residuals traced from the model code,
    one layer's backward, the gradients in flight, per layout and ``backend``) + with
    ``optimizer_device=device`` one offloaded leaf's optimizer state streamed in (the largest).
    ``backend``: ``"gpu"`` (XLA:GPU's buffers, the default) or ``"cpu"`` (XLA:CPU's, for simulated
    devices): the platform the mesh compiles for (:func:`jaxcolossal.parallel.mesh.platform`).
    Returns the parts, ``"total"`` and ``"host"`` (the pinned host bytes per device); ``"state"``
    includes ``"compression"``, the gradient-compression state (error-feedback residuals, PowerSGD's
    ``Q``: :func:`jaxcolossal.parallel.compression.state_bytes`).

    Offloaded compute params: a leaf stacked over ``layers`` streams in one layer at a time inside
    the layer scan (two layers counted: the one in use and the next), except with
    ``model.remat=none``, where the backward pass keeps every layer's fetched weights (then the
    whole leaf counts); the other leaves (embedding, head, final norm) move in whole.

    LoRA (``model.lora.rank > 0``): ``shapes``/``specs`` are the base model's; the state is the frozen
    base in the compute dtype (sharded as ZeRO shards params) plus the adapters' params, gradients and
    optimizer state; the activations and temporaries are full training's (an over-estimate by the
    base's weight-gradient buffers, which a LoRA step does not hold).

    Post-training (:mod:`jaxcolossal.memory.rollout`): the frozen reference copy (DPO, GRPO with
    ``beta > 0``) is part of ``"state"`` and is also ``"reference"``; GRPO adds ``"rollout"`` (the
    rollout phase: :func:`~jaxcolossal.memory.rollout.rollout_need`) and ``"step_total"`` (the train
    step's need), and its ``"total"`` is the larger of the step's and the rollout's."""
    base_shapes, reference = shapes, reference_bytes(cfg, shapes, specs, mesh_shape)
    frozen = 0
    if cfg.model.lora.enabled:  # the base frozen in the compute dtype; the trained state is the adapters'
        frozen = sum(jax.tree.leaves(local_elements(shapes, specs.params, mesh_shape))) * \
            BYTES_PER_PARAM[cfg.precision.mode]["p"]
        shapes, specs = lora_layout(cfg, shapes, mesh_shape)
        placement = make_placement(0.0, 0.0, "device", shapes, specs, mesh_shape)
    sb = state_bytes(placement, shapes, specs, mesh_shape, cfg.precision.mode, bool(cfg.offload.nvme_path))
    sb["device"] += frozen
    opt = jax.tree.leaves(local_elements(shapes, specs.opt, mesh_shape))
    offl = [s for s, w in zip(opt, jax.tree.leaves(placement.optim)) if w]
    stream = max(offl, default=0) * BYTES_PER_PARAM[cfg.precision.mode]["K"] if placement.optimizer_device == "device" else 0
    par = jax.tree.leaves(local_elements(shapes, specs.params, mesh_shape))
    layers = [n for n, _ in _stacked(shapes)]
    streamed = cfg.model.remat != "none"
    params_in = sum((min(2, n) * e // n if n and streamed else e)
                    for e, w, n in zip(par, jax.tree.leaves(placement.params), layers) if w) * \
        BYTES_PER_PARAM[cfg.precision.mode]["p"]
    comp = compression_bytes(cfg.parallel, shapes, param_layout(cfg.model, mesh_shape["tp"])[2]) \
        if cfg.parallel.gradient_compression != "none" else 0
    state = sb["device"] + params_in + comp + reference
    peak = step_peak(cfg, mesh_shape, state, sb["grads"], backend)
    acts = peak["activations"]
    parts = {"state": state, "grads": sb["grads"], "activations": acts, "stream": stream,
             "host": sb["host"], "nvme": sb["nvme"], "compression": comp, "peak": peak, "reference": reference}
    parts["total"] = parts["state"] + sb["grads"] + acts + stream
    if cfg.training.objective == "grpo":  # the rollout phase holds the state, the KV cache and the batch
        parts["step_total"] = parts["total"]
        parts["rollout"] = rollout_need(cfg, base_shapes, mesh_shape, state)
        parts["total"] = max(parts["total"], parts["rollout"]["total"])
    return parts


def _stacked(shapes: Any) -> list[tuple[int, Any]]:
    """Per param leaf (flatten order): ``(L, shape)`` for a leaf under ``layers`` (stacked ``[L, ...]``,
    streamed by the layer scan), ``(0, shape)`` for the others."""
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)[0]
    return [((s[0] if any(getattr(k, "key", None) == "layers" for k in path) else 0), s) for path, s in flat]


def traffic(placement: Placement, shapes: Any, specs: Any, mesh_shape: Mapping[str, int], precision: str) -> int:
    """Host↔device bytes per step per device: an offloaded optimizer leaf moves its state in and out
    (``2·K``/param, ``optimizer_device=device``) or its fp32 gradient down and its new compute
    params up (``4 + p``, ``host``); an offloaded compute leaf moves in (twice when stacked: the
    forward and the backward's recomputation fetch each layer), its compute-dtype gradient down
    and up, and its new values out (``5·p``, or ``4·p`` unstacked)."""
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


def auto(cfg: Config, shapes: Any, specs: Any, mesh_shape: Mapping[str, int], limit: int,
         backend: str = "gpu") -> tuple[Placement, str]:
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
            + _ways_to_fit(cfg, mesh_shape))
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
    return "no offload setting fits either: " + _ways_to_fit(cfg, mesh_shape)


def _ways_to_fit(cfg: Config, mesh_shape: Mapping[str, int]) -> str:
    """The changes beyond offload that lower the need and are not already set: more devices, a
    higher ``zero_stage`` (below 3), ``model.remat=full`` (when not full), a smaller microbatch
    (more accumulation steps, or more pipeline microbatches)."""
    ways = ["use more devices"] + ([f"parallel.zero_stage={cfg.parallel.zero_stage + 1}"]
                                   if cfg.parallel.zero_stage < 3 else []) \
        + (["model.remat=full"] if cfg.model.remat != "full" else []) \
        + (["a smaller microbatch (training.gradient_accumulation_steps)"] if mesh_shape.get("pp", 1) == 1 else
           ["more pipeline microbatches"])
    return ", ".join(ways[:-1]) + " or " + ways[-1]


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
    if backend is None:  # the memory model of the platform the mesh compiles for (a plan: a GPU's)
        backend = platform(devices) if devices else "gpu"
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
        needed = device_need(pl, cfg, shapes, specs, mesh_shape, backend)
        if needed["total"] > limit:
            hint = _over_limit_hint(cfg, pl, needed, shapes, specs, mesh_shape, limit, backend)
            raise ConfigError(
                f"the run needs {gib(needed['total'])} per device ({needed['total']:,} bytes: state {gib(needed['state'])}, "
                f"fp32 grads {gib(needed['grads'])}, activations ≈{gib(needed['activations'])}"
                + (f", optimizer stream {gib(needed['stream'])}" if needed["stream"] else "")
                + f") but offload.device_memory_limit allows {gib(limit)}: short by {needed['total'] - limit:,} bytes; "
                + hint)
    return pl, ""


def _over_limit_hint(cfg: Config, pl: Placement, needed: dict, shapes: Any, specs: Any, mesh_shape: Mapping[str, int],
                     limit: int, backend: str) -> str:
    """What would fit ``limit``: for a GRPO run whose rollout alone is over it, a rollout setting
    (:func:`_rollout_fit`); else the offload fractions :func:`auto` finds, or why none does."""
    if "rollout" in needed and needed["step_total"] <= limit < needed["rollout"]["total"]:
        return _rollout_fit(cfg, pl, shapes, specs, mesh_shape, limit, backend)
    try:
        fit, _ = auto(cfg, shapes, specs, mesh_shape, limit, backend)
        return (f"offload.offload_optim_frac={fit.asked_optim_frac:g}"
                + (f" offload.offload_param_frac={fit.asked_param_frac:g}" if fit.asked_param_frac else "")
                + " would fit (or offload.placement_policy=auto)")
    except ConfigError:
        return _no_offload_fits(cfg, shapes, specs, mesh_shape, limit, backend)


def _rollout_fit(cfg: Config, pl: Placement, shapes: Any, specs: Any, mesh_shape: Mapping[str, int], limit: int,
                 backend: str) -> str:
    """The first of: refill in fewer cache rows (``posttrain.rollout_slots``, halving), decoding on the
    training layout (no decode copy), that brings GRPO's rollout phase under ``limit``."""
    rows = grpo_generation_batch(cfg)
    tries = [{"rollout_slots": rows // 2 ** k} for k in range(1, 8) if rows // 2 ** k >= 1] + \
        [{"rollout_layout": "training"}]
    for change in tries:
        c = copy.deepcopy(cfg)
        for k, v in change.items():
            setattr(c.posttrain, k, v)
        if device_need(pl, c, shapes, specs, mesh_shape, backend)["rollout"]["total"] <= limit:
            return " ".join(f"posttrain.{k}={v}" for k, v in change.items()) + " would fit the rollout phase"
    return ("the rollout phase is over the limit with every rollout setting (posttrain.rollout_slots, "
            "rollout_layout=training): use more devices or shorter completions")


# ----------------------------------------------------------------------------- a config on N devices


def lora_layout(cfg: Config, shapes: Any, mesh_shape: Mapping[str, int]) -> tuple[Any, Any]:
    """``(shapes, ZeRO specs)`` of ``model.lora``'s adapters on the base model of ``shapes``."""
    _, _, axes = param_layout(cfg.model, mesh_shape["tp"])
    a_shapes, a_axes = adapter_layout(cfg.model, shapes, axes)
    return a_shapes, state_specs(a_axes, a_shapes, cfg.parallel.zero_stage, mesh_shape,
                                 rules_for(cfg.parallel, pipeline=True))


def layout(cfg: Config, num_devices: int) -> tuple[dict, int, Any, Any]:
    """``(mesh shape, padded vocab, param shapes, ZeRO specs)`` of ``cfg`` on ``num_devices``, by the
    same rules as the train step (the stacked ``layers`` dimension split over ``pp``)."""
    shape = resolved_shape(cfg.parallel.resolve(num_devices))
    vocab, shapes, axes = param_layout(cfg.model, shape["tp"])
    specs = state_specs(axes, shapes, cfg.parallel.zero_stage, shape, rules_for(cfg.parallel, pipeline=True))
    return shape, vocab, shapes, specs


def need(cfg: Config, num_devices: int, backend: str = "gpu") -> dict:
    """:func:`device_need` for ``cfg`` on ``num_devices`` (the mesh as the config resolves it; the
    static offload fractions; no limit checked), with ``backend``'s memory terms (``"gpu"``: XLA:GPU;
    ``"cpu"``: XLA:CPU's own, for simulated devices)."""
    shape, _, shapes, specs = layout(cfg, num_devices)
    o = cfg.offload
    pl = make_placement(o.offload_optim_frac, o.offload_param_frac, o.optimizer_device, shapes, specs, shape)
    return device_need(pl, cfg, shapes, specs, shape, backend)
