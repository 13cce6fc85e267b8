"""Out of memory, explained: when XLA reports a run out of device memory, the predicted per-device
breakdown of the layout next to what XLA reported, and the cheapest single changes that would fit
(the seed's "systematic OOM troubleshooting", as a program). The training loop's guard calls it."""

from __future__ import annotations

import copy
import math
import re

from jaxcolossal.config import Config, ConfigError, gib
from jaxcolossal.memory import budget
from jaxcolossal.memory.budget import device_need
from jaxcolossal.parallel.mesh import data_size, platform

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")
"""Substrings by which XLA's runtime and compiler report an allocation that did not fit."""


def is_oom(error: BaseException) -> bool:
    """True when ``error`` is XLA reporting device memory exhausted (at compile time or in a step)."""
    return any(m in str(error) for m in OOM_MARKERS)


def oom_changes(cfg: Config, run_mesh: dict, backend: str = "gpu") -> list[tuple[str, dict]]:
    """Single-key changes that lower the per-device need, each with its predicted need, cheapest
    first (on the run's devices; a change of zero_stage re-splits the data group into dp/fsdp;
    the seed's "systematic OOM troubleshooting", as a program): a higher ``zero_stage``,
    ``model.remat=full``, twice the gradient accumulation (half the microbatch), the optimizer
    state (then the ZeRO-3 params) in host memory. Changes that do not apply (ZeRO-3 already,
    an odd microbatch, ...) are left out."""
    t, p, o = cfg.training, cfg.parallel, cfg.offload
    n = data_size(run_mesh)
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
            out.append((name, budget.need(c, math.prod(run_mesh.values()), backend)))
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
    cfg, shape = plan.cfg, plan.mesh_shape
    backend = platform(plan.mesh)  # the memory model of the platform the run compiles for
    need = device_need(plan.placement, cfg, plan.param_shapes, plan.specs, shape, backend)
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
    for name, n in oom_changes(cfg, shape, backend):
        mark = ("fits" if n["total"] <= capacity else "over") if capacity else f"{n['total'] / need['total']:.0%}"
        lines.append(f"  {name:<48} {gib(n['total']):>12}  {mark}")
    lines.append("(activations: the residuals traced from the model code and the layout's buffers; their measured error: docs/planner.md)")
    return "\n".join(lines)
