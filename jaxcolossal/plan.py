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
from jaxcolossal.sharding import RULES, shard_bytes, state_specs
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
    shape = mesh_shape(rp)
    vocab, shapes, axes = param_layout(cfg.model, shape["tp"])
    rules = {**RULES, "layers": "pp"}
    specs = state_specs(axes, shapes, p.zero_stage, shape, rules)
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
