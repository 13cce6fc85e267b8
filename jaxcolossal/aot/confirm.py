"""Search, then confirm: the planner's fastest layouts compiled for the fleet by XLA's GPU compiler.

``python -m jaxcolossal.plan --model llama3_70b --devices 16 --device h200 --confirm 3`` takes the
top ``K`` fitting layouts of the planner's analytic search (:func:`jaxcolossal.plan.search.search`),
compiles each one's real train step for ``--devices`` compile-only GPUs of the ``--device`` kind
(:func:`jaxcolossal.aot.fleet.compile_for`, no GPU needed), and prints, per layout, the predicted
against the compiled per-device peak memory and collective bytes. It then ranks them again by
what was compiled: the layouts whose compiled peak does not fit 90% of the HBM (the planner's own
margin) are dropped, and the rest are ordered by a step time in which the planner's predicted
communication is replaced by the communication the compiled schedule leaves exposed
(:mod:`jaxcolossal.aot.gpu_schedule`: matmuls at the bf16 peak, transfers at the link bandwidths).

The planner itself never imports the training code; this module, above both, does the
compiling, and ``python -m jaxcolossal.plan`` calls it only with ``--confirm``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxcolossal.aot import fleet
from jaxcolossal.aot.target import Target, get_target, gpu_compiler_available
from jaxcolossal.config import Config, ConfigError, config_from_dict
from jaxcolossal.errors import DependencyError
from jaxcolossal.plan.cli import confirm_target
from jaxcolossal.plan.collectives import collective_bytes
from jaxcolossal.plan.cost import Layout
from jaxcolossal.plan.devices import DEVICES, Device
from jaxcolossal.plan.search import run_overrides, search

TARGET_OF = {name: d.target for name, d in DEVICES.items() if d.target}
"""The planner's ``--device`` names that have a GPU compile target (:attr:`Device.target`)."""

FIT = 0.9
"""The share of the HBM a layout may use (the planner's margin, :func:`jaxcolossal.plan.cost.predict`)."""


@dataclass
class Confirmed:
    """One layout, predicted and compiled. Bytes are per device; ``collectives``: ``{kind: (predicted
    bytes sent, compiled bytes sent)}``; ``step_s``: the planner's compute time plus the compiled
    schedule's exposed communication (seconds); ``error``: why it did not compile ("" when it did)."""

    layout: Layout
    predicted: float
    compiled: float = 0.0
    hbm: float = 0.0
    collectives: dict = dataclasses.field(default_factory=dict)
    step_s: float = 0.0
    compile_s: float = 0.0
    error: str = ""
    warned: bool = False
    """XLA's rematerialization pass estimated more than its memory limit before scheduling (its
    warning; the compiled peak above is what the buffer assignment allocates)."""

    @property
    def fits(self) -> bool:
        return not self.error and self.compiled <= FIT * self.hbm


def target_for(device_name: str) -> Target:
    """The compile target of a planner ``--device`` name.

    Raises:
        ConfigError: a device without a target (``a100-40``).
    """
    return get_target(confirm_target(1, device_name))


def layout_config(cfg: Config, layout: Layout) -> Config:
    """``cfg`` with the overrides that run ``layout`` (:func:`jaxcolossal.plan.search.run_overrides`)."""
    overrides = [f"{k}={v}" for k, v in run_overrides(cfg, layout).items()]
    return config_from_dict(dataclasses.asdict(cfg), overrides)


def compile_layout(cfg: Config, layout: Layout, target: Target, num_devices: int, per_host: int) -> Confirmed:
    """One layout compiled for ``num_devices`` of ``target`` (an error is kept in the row, not raised)."""
    c = layout_config(cfg, layout)
    row = Confirmed(layout=layout, predicted=float(layout.need["total"]), hbm=float(target.hbm_bytes))
    try:
        fc = fleet.compile_for(c, target, num_devices, per_host, keep_hlo=False)
    except (ConfigError, ValueError, RuntimeError) as e:
        row.error = str(e).splitlines()[0][:200]
        return row
    predicted = collective_bytes(c, num_devices, "gpu")
    kinds = sorted(set(predicted) | set(fc.collectives))
    row.collectives = {k: (predicted.get(k, 0.0), float(fc.collectives.get(k, {}).get("sent", 0.0))) for k in kinds}
    row.compiled, row.compile_s, row.warned = float(fc.peak), fc.compile_s, bool(fc.compiler_messages)
    row.step_s = layout.compute_s + fc.exposure.exposed_s
    return row


def confirm(cfg: Config, num_devices: int, device_name: str, device: Device, top: int,
            efficiency: float = 0.45) -> list[Confirmed]:
    """The top ``top`` fitting layouts of the analytic search, each compiled (:func:`compile_layout`),
    ranked by what was compiled: those that fit first, fastest first (:class:`Confirmed`).

    Raises:
        ConfigError: ``top`` below 1, or a device without a compile target.
        DependencyError: XLA's GPU compiler is not installed (the ``gpu-compile`` extra).
    """
    confirm_target(top, device_name)
    target = target_for(device_name)
    if not gpu_compiler_available():
        raise DependencyError("--confirm needs XLA's GPU compiler: pip install -e \".[gpu-compile]\"")
    layouts, _ = search(cfg, num_devices, device, efficiency)
    rows = [compile_layout(cfg, lay, target, num_devices, device.per_node)
            for lay in [lay for lay in layouts if lay.fits][:top]]
    return sorted(rows, key=lambda r: (not r.fits, r.step_s if r.fits else r.compiled))


def _gb(b: float) -> str:
    """Bytes as the planner's table prints them (decimal GB, MB below 0.1 GB)."""
    return f"{b / 1e9:,.1f} GB" if b >= 1e8 else f"{b / 1e6:,.2f} MB"


def table(rows: list[Confirmed], num_devices: int, device_name: str) -> str:
    """The printout: predicted against compiled, per layout, in the compiled ranking."""
    lines = [f"confirmed by XLA's GPU compiler for {num_devices} × {device_name} (no GPU; compile-only devices):",
             "| rank | strategy | accumulation / microbatches | memory predicted | memory compiled | error | "
             "collectives predicted | "
             "collectives compiled | step predicted | step, compiled schedule | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lay = r.layout
        o = lay.overrides
        k = o.get("parallel.num_microbatches", o.get("training.gradient_accumulation_steps", 1))
        if r.error:
            lines.append(f"| - | {lay.strategy()} | {k} | {_gb(r.predicted)} | did not compile: {r.error} | | | | "
                         f"{lay.step_s:.2f} s | | dropped |")
            continue
        pred_c = sum(p for p, _ in r.collectives.values())
        comp_c = sum(c for _, c in r.collectives.values())
        verdict = ("fits" + (" (XLA's remat pass warned)" if r.warned else "") if r.fits
                   else f"dropped: {_gb(r.compiled)} > {FIT:.0%} of {_gb(r.hbm)}")
        lines.append(f"| {i if r.fits else '-'} | {lay.strategy()} | {k} | {_gb(r.predicted)} | {_gb(r.compiled)} | "
                     f"{(r.predicted - r.compiled) / r.compiled:+.1%} | {_gb(pred_c)} | {_gb(comp_c)} | "
                     f"{lay.step_s:.2f} s | {r.step_s:.2f} s | {verdict} |")
    lines.append("(memory: the planner's prediction against arguments + outputs − donated + temporaries of the compiled "
                 "step; collectives: bytes each device sends per step; the compiled step: the planner's compute time "
                 "plus the communication XLA's schedule leaves exposed, docs/gpu.md)")
    return "\n".join(lines)


def report(cfg: Config, num_devices: int, device_name: str, device: Device, top: int, efficiency: float = 0.45,
           source: str = "", model_overrides: dict | None = None) -> str:
    """:func:`confirm`'s :func:`table`, ending in the command that runs the best compiled layout
    (``python -m jaxcolossal.plan ... --confirm K`` prints it after the analytic table); ``source``
    and ``model_overrides``: as :func:`jaxcolossal.plan.search.report` takes them.

    Raises:
        ConfigError, DependencyError: as :func:`confirm`.
    """
    rows = confirm(cfg, num_devices, device_name, device, top, efficiency)
    lines = [table(rows, num_devices, device.name)]
    best = next((r for r in rows if r.fits), None)
    if best is None:
        lines.append("none of these layouts fits once compiled: confirm more (a larger --confirm), or see the "
                     "rejected families above")
    else:
        ov = " ".join(f"{k}={v}" for k, v in run_overrides(cfg, best.layout, model_overrides).items())
        lines.append(f"run the best compiled: python scripts/train.py {source + ' ' if source else ''}{ov}")
    return "\n".join(lines)
