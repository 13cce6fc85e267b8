"""Dry-run planning: parameter count, mesh and per-device model-state memory, with no devices.

``python scripts/train.py --config configs/llama_80l_example.yaml --dry-run`` prints this for a
config far too large to train here. Everything is arithmetic over the same sharding rules the
train step uses (:func:`jaxcolossal.sharding.state_specs`); with pipeline parallelism the
stacked ``layers`` dimension is split over ``pp``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxcolossal.config import Config, ConfigError, validate
from jaxcolossal.mesh import mesh_shape
from jaxcolossal.metrics import flops_per_token, param_count
from jaxcolossal.models import param_layout
from jaxcolossal.placement import device_need, gib, resolve
from jaxcolossal.sharding import rules_for, shard_bytes, state_specs
from jaxcolossal.train.state import BYTES_PER_PARAM


def dry_run(cfg: Config, num_devices: int | None = None) -> str:
    """A printable plan for ``cfg`` on ``num_devices`` (default: the product of the explicit
    parallel sizes).

    Raises:
        ConfigError: a ``-1`` size without ``num_devices``, or any impossible setting.
    """
    p = cfg.parallel
    if num_devices is None:
        sizes = (p.data_parallel_size, p.tensor_parallel_size, p.pipeline_parallel_size)
        if -1 in sizes:
            raise ConfigError("--dry-run needs explicit parallel sizes (no -1) to know the device count")
        num_devices = math.prod(sizes)
    validate(cfg, num_devices=num_devices)
    rp = p.resolve(num_devices)
    shape, vocab, shapes, specs = _layout(cfg, num_devices)
    b = BYTES_PER_PARAM[cfg.precision.mode]
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)

    def per_device(spec_tree, nbytes):
        vals = jax.tree.map(lambda s, sp: shard_bytes(s, jnp.uint8, sp, shape) * nbytes, shapes, spec_tree,
                            is_leaf=is_shape)
        return sum(jax.tree.leaves(vals))

    params = per_device(specs.params, b["p"])
    grads = per_device(specs.grads, b["g"])
    opt = per_device(specs.opt, b["K"])
    n = param_count(cfg.model)
    t = cfg.training
    fpt = flops_per_token(cfg.model, t.seq_len, cfg.model.remat != "none")
    gib = lambda x: f"{x / 2**30:,.2f} GiB" if x >= 2**30 else f"{x / 2**20:,.2f} MiB"
    lines = [
        f"model      {cfg.model.type}, {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
        f"{cfg.model.num_attention_heads} heads / {cfg.model.num_key_value_heads} kv heads, "
        f"intermediate {cfg.model.intermediate_size}, vocab {cfg.model.vocab_size} (padded {vocab})",
        f"parameters {n['total']:,} ({n['total'] / 1e9:.2f} B)",
        f"devices    {num_devices}; mesh {shape} (pp × dp × fsdp × tp)",
        f"precision  {cfg.precision.mode}: p={b['p']} g={b['g']} K={b['K']} bytes/param; zero_stage {p.zero_stage}",
        f"per-device model state: params {gib(params)}, grads {gib(grads)}, optimizer {gib(opt)}, "
        f"total {gib(params + grads + opt)}",
        f"batch      {t.batch_size} sequences × {t.seq_len} tokens per step, "
        f"{t.gradient_accumulation_steps} accumulation microbatches",
        f"FLOPs/token {fpt['6N+attn']:.3e} (6N+attn), {fpt['colossal']:.3e} (Colossal-AI 2N(3+recompute))",
    ]
    lines += _offload_lines(cfg, shapes, specs, shape)
    if p.zero_stage > 0 and rp.data_parallel_size == 1:
        lines.append(f"note       zero_stage {p.zero_stage} with data_parallel_size 1 shards nothing: "
                     "ZeRO splits state over the data-parallel group")
    if rp.pipeline_parallel_size > 1:
        from jaxcolossal.pipeline import pipeline_schedule_for
        s = pipeline_schedule_for(cfg, rp.pipeline_parallel_size)
        lines.append(f"pipeline   {s.p} stages × {s.v} chunk(s), schedule {s.kind}, {s.m} microbatches, "
                     f"{s.num_ticks} ticks, bubble {s.bubble_fraction:.1%} (docs/pipeline.md)")
    return "\n".join(lines)


def _offload_lines(cfg: Config, shapes, specs, shape) -> list[str]:
    """The offload plan (:mod:`jaxcolossal.placement`): device and host bytes per device and per
    8-device node, and whether the run fits ``offload.device_memory_limit`` when one is given."""
    o = cfg.offload
    limit = o.device_memory_limit
    try:
        pl, report = resolve(cfg, shapes, specs, shape)
    except ConfigError as e:
        return [f"offload    does not fit: {e}"]
    need = device_need(pl, cfg, shapes, specs, shape)
    lines = [report] if report else []
    lines.append(f"offload    optim {pl.asked_optim_frac:g} (reached {pl.optim_frac:.3f}), params {pl.asked_param_frac:g} "
                 f"(reached {pl.param_frac:.3f}), update on the {pl.optimizer_device}, activations {o.activations}")
    lines.append(f"memory     per device: device {gib(need['total'])} (state {gib(need['state'])}, fp32 grads "
                 f"{gib(need['grads'])}, activations ≈{gib(need['activations'])}"
                 + (f", optimizer stream {gib(need['stream'])}" if need["stream"] else "")
                 + f"); pinned host {gib(need['host'])} per device, {gib(o.devices_per_host * need['host'])} per "
                 f"{o.devices_per_host}-device host"
                 + (f"; NVMe tier {gib(need['nvme'])} per device in {o.nvme_path}" if need["nvme"] else "")
                 + (f"; fits offload.device_memory_limit={limit}" if limit else "")
                 + (f" and offload.host_memory_limit={o.host_memory_limit}" if o.host_memory_limit else ""))
    return lines


# ----------------------------------------------------------------------------- out of memory

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")
"""Substrings by which XLA's runtime and compiler report an allocation that did not fit."""


def is_oom(error: BaseException) -> bool:
    """True when ``error`` is XLA reporting device memory exhausted (at compile time or in a step)."""
    return any(m in str(error) for m in OOM_MARKERS)


def _layout(cfg: Config, num_devices: int) -> tuple[dict, int, object, object]:
    """``(mesh shape, padded vocab, param shapes, ZeRO specs)`` of ``cfg`` on ``num_devices``, by the
    same rules as the train step (the stacked ``layers`` dimension split over ``pp``)."""
    shape = mesh_shape(cfg.parallel.resolve(num_devices))
    vocab, shapes, axes = param_layout(cfg.model, shape["tp"])
    specs = state_specs(axes, shapes, cfg.parallel.zero_stage, shape, rules_for(cfg.parallel, pipeline=True))
    return shape, vocab, shapes, specs


def _need(cfg: Config, num_devices: int) -> dict:
    """:func:`jaxcolossal.placement.device_need` for ``cfg`` on ``num_devices`` (the mesh as the
    config resolves it; static fractions; no limit checked)."""
    from jaxcolossal.placement import make_placement
    shape, _, shapes, specs = _layout(cfg, num_devices)
    o = cfg.offload
    pl = make_placement(o.offload_optim_frac, o.offload_param_frac, o.optimizer_device, shapes, specs, shape)
    return device_need(pl, cfg, shapes, specs, shape)


def oom_changes(cfg: Config, run_mesh: dict) -> list[tuple[str, dict]]:
    """Single-key changes that lower the per-device need, each with its predicted need, cheapest
    first (on the run's devices; a change of zero_stage re-splits the data group into dp/fsdp;
    the seed's "systematic OOM troubleshooting", as a program): a higher ``zero_stage``,
    ``model.remat=full``, twice the gradient accumulation (half the microbatch), the optimizer
    state (then the ZeRO-3 params) in host memory. Changes that do not apply (ZeRO-3 already,
    an odd microbatch, ...) are left out."""
    import copy
    t, p, o = cfg.training, cfg.parallel, cfg.offload
    n = run_mesh["dp"] * run_mesh["fsdp"]
    tries = []
    if p.zero_stage < 3 and n > 1:
        tries.append((f"parallel.zero_stage={p.zero_stage + 1}", lambda c: setattr(c.parallel, "zero_stage",
                                                                                   p.zero_stage + 1)))
    if cfg.model.remat != "full":
        tries.append(("model.remat=full", lambda c: setattr(c.model, "remat", "full")))
    micro = t.batch_size // t.gradient_accumulation_steps
    if run_mesh["pp"] == 1 and micro % (2 * n) == 0:
        tries.append((f"training.gradient_accumulation_steps={2 * t.gradient_accumulation_steps}",
                      lambda c: setattr(c.training, "gradient_accumulation_steps", 2 * t.gradient_accumulation_steps)))
    if o.offload_optim_frac < 1:
        tries.append(("offload.offload_optim_frac=1", lambda c: setattr(c.offload, "offload_optim_frac", 1.0)))
    if p.zero_stage == 3 and run_mesh["pp"] == 1 and o.offload_param_frac < 1:
        def params_out(c):
            c.offload.offload_param_frac = 1.0
            if c.model.remat == "none":  # streamed params lower the peak only with a remat policy
                c.model.remat = "full"
        tries.append(("offload.offload_param_frac=1" + (" model.remat=full" if cfg.model.remat == "none" else ""),
                      params_out))
    out = []
    for name, change in tries:
        c = copy.deepcopy(cfg)
        change(c)
        try:
            out.append((name, _need(c, math.prod(run_mesh.values()))))
        except ConfigError:  # the change does not fit this model (a dimension its axis does not divide)
            continue
    return sorted(out, key=lambda r: r[1]["total"])


def explain_oom(plan, error: BaseException, compiled: object = None, capacity: int = 0) -> str:
    """What to print when a run runs out of device memory: the predicted per-device breakdown of
    the current layout next to what XLA reported (the error's figure, and the compiled step's
    ``memory_analysis()`` when there is one), and the cheapest single changes by predicted need,
    marked ``fits`` when below ``capacity`` (bytes; 0 = unknown).

    ``plan``: the run's :class:`~jaxcolossal.train.state.TrainPlan`. Raises nothing.
    """
    import re
    cfg, shape = plan.cfg, plan.mesh_shape
    need = device_need(plan.placement, cfg, plan.param_shapes, plan.specs, shape)
    msg = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"out of device memory: {msg[:300]}",
             f"predicted per device for this layout (mesh {shape}, zero_stage {cfg.parallel.zero_stage}, "
             f"{cfg.precision.mode}, remat {cfg.model.remat}): {gib(need['total'])} = state {gib(need['state'])} + "
             f"fp32 grads {gib(need['grads'])} + activations ≈{gib(need['activations'])}"
             + (f" + optimizer stream {gib(need['stream'])}" if need["stream"] else "")]
    asked = re.search(r"allocat\w* (\d[\d,]*) ?bytes", str(error)) or re.search(r"(\d[\d,]*) ?bytes", str(error))
    if asked:
        lines.append(f"XLA reported:  {int(asked.group(1).replace(',', '')):,} bytes in the failing allocation")
    mem = getattr(compiled, "memory_analysis", lambda: None)() if compiled is not None else None
    if mem is not None:
        parts = {k: getattr(mem, f"{k}_size_in_bytes", 0) or 0 for k in ("argument", "output", "temp", "alias")}
        total = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
        lines.append(f"compiled step: {gib(total)} = arguments {gib(parts['argument'])} + outputs "
                     f"{gib(parts['output'])} + temporaries {gib(parts['temp'])} - donated {gib(parts['alias'])}")
    if capacity:
        lines.append(f"device memory: {gib(capacity)} usable (offload.device_memory_limit, or the device's "
                     "capacity × 0.9)")
    lines.append("cheapest changes (one key each; predicted per-device need):")
    for name, n in oom_changes(cfg, shape):
        mark = ("fits" if n["total"] <= capacity else "over") if capacity else f"{n['total'] / need['total']:.0%}"
        lines.append(f"  {name:<48} {gib(n['total']):>12}  {mark}")
    lines.append("(the activation term is an estimate that runs low on XLA's CPU backend: docs/offload.md)")
    return "\n".join(lines)
