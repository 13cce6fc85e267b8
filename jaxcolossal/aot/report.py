"""The printed and the JSON form of a fleet compile (:class:`jaxcolossal.aot.fleet.FleetCompile`)."""

from __future__ import annotations

import dataclasses

from jaxcolossal.aot.fleet import FleetCompile, GiB
from jaxcolossal.config import Config, gib
from jaxcolossal.memory.budget import need

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _gib(x: float) -> str:
    """GiB from a tenth of one up (the scale of a fleet), else the unit that shows the value."""
    return f"{x / GiB:,.2f} GiB" if abs(x) >= GiB / 10 else gib(x)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if abs(s) >= 1e-3 else f"{s * 1e6:,.1f} µs"


def _header(fc: FleetCompile) -> list[str]:
    t = fc.target
    hosts = fc.num_devices // min(fc.devices_per_host, fc.num_devices)
    mesh = " ".join(f"{k}={v}" for k, v in fc.mesh_shape.items() if v > 1) or "one device"
    return [f"compiled for {fc.num_devices} × {t.description} ({hosts} host{'s' if hosts > 1 else ''} × "
            f"{min(fc.devices_per_host, fc.num_devices)}; {_gib(t.hbm_bytes)} HBM at {t.hbm_bw / 1e12:.2f} TB/s, "
            f"{t.peak_bf16 / 1e12:,.0f} TFLOP/s bf16, NVLink {t.nvlink_bw / 1e9:.0f} GB/s and network "
            f"{t.network_bw / 1e9:.0f} GB/s per GPU per direction; sm_{t.compute_capability}, CUDA {t.cuda_runtime}, "
            f"cuDNN {t.cudnn}) by XLA's GPU compiler without a device, in {fc.compile_s:.1f} s",
            f"mesh {mesh}"]


def _memory(fc: FleetCompile) -> list[str]:
    m = fc.memory
    lines = [f"memory per device: arguments {_gib(m['argument'])} + outputs {_gib(m['output'])} - donated "
             f"{_gib(m['alias'])} + temporaries {_gib(m['temp'])} = peak {_gib(fc.peak)} of {_gib(fc.hbm)} HBM "
             f"({fc.peak / fc.hbm:.0%})"]
    host = m["host_argument"] + m["host_output"] + m["host_temp"]
    if host:
        lines.append(f"  pinned host memory per device: arguments {_gib(m['host_argument'])}, outputs "
                     f"{_gib(m['host_output'])}, temporaries {_gib(m['host_temp'])}")
    if fc.offloaded and not fc.memory_kinds:
        lines.append("  note: this jaxlib's compile-only devices have no memory kinds, so the offloaded state "
                     "compiled as device memory: the peak above counts it on the device (docs/gpu.md)")
    if fc.fits and fc.peak > 0.9 * fc.hbm:
        lines.append("  note: scripts/train.py lets jax preallocate 90% of the HBM (XLA_PYTHON_CLIENT_MEM_FRACTION, "
                     f"jax's default 0.75); this step needs {fc.peak / fc.hbm:.0%}: run with "
                     f"XLA_PYTHON_CLIENT_MEM_FRACTION={min(0.98, fc.peak / fc.hbm + 0.02):.2f}")
    if fc.compiler_messages:
        lines.append("  XLA's rematerialization pass estimated more than the HBM before scheduling (below); the peak "
                     "above is what the buffer assignment allocates, the figure to plan with")
    lines += [f"  XLA: {msg}" for msg in fc.compiler_messages[:3]]
    return lines


def _collectives(fc: FleetCompile) -> list[str]:
    e = fc.exposure.by_kind
    lines = ["collectives per step (bytes each device sends; time at link bandwidth; exposed: what the compute "
             "stream waits for on XLA's schedule, matmuls at peak):"]
    for kind in KINDS:
        c = fc.collectives.get(kind)
        if not c:
            continue
        x = e.get(kind, {"async": 0, "time_s": 0.0, "hidden_s": 0.0, "exposed_s": 0.0, "count": 0})
        lines.append(f"  {kind:<19} {c['count']:>7,} per step  {_gib(c['sent']):>12}  async {x['async']:>6,}  "
                     f"time {_ms(x['time_s']):>11}  hidden {_ms(x['hidden_s']):>11}  exposed {_ms(x['exposed_s']):>11}")
    ex = fc.exposure
    lines.append(f"  communication {_ms(ex.time_s)} per step, {ex.hidden_fraction:.1%} hidden by scheduled "
                 f"compute, {_ms(ex.exposed_s)} exposed; matmuls {fc.flops / 1e12:,.3f} TFLOP per device = "
                 f"{_ms(fc.compute_s)} at peak")
    return lines


def _worst_pairs(fc: FleetCompile, top: int = 5) -> list[str]:
    big = sorted((p for p in fc.pairs if p.sent >= 4096), key=lambda p: -p.sent * p.executions)
    lines = [f"largest collectives (of {len(fc.pairs):,} in the program; window: matmuls scheduled between start and done):"]
    for p in big[:top]:
        lines.append(f"  {p.name:<28} {p.kind:<18} in {p.computation[:28]:<28} ×{p.executions:<5} "
                     f"{_gib(p.sent):>12} {'across hosts' if p.cross_host else 'in a host':<12} "
                     f"window {p.flops_between / 1e9:9.1f} GFLOP ({p.between} ops){'' if p.asynchronous else ' sync'}")
    return lines


def _rollout(fc: FleetCompile) -> list[str]:
    """GRPO: each rollout program's peak, its phase's peak with the train state, its collectives and, for
    the sampler, those of one decode step."""
    if not fc.rollout:
        return []
    lines = ["GRPO rollout programs (per device; phase: with the resident train state beside it):"]
    for r in fc.rollout:
        moved = sum(c["bytes"] for c in r.collectives.values())
        line = (f"  {r.name:<10} peak {_gib(r.memory['peak']):>12} (temporaries {_gib(r.memory['temp'])}), phase "
                f"{_gib(r.phase_peak):>12}; collectives {_gib(moved)}")
        if r.name == "sampler":
            step = ", ".join(f"{k} {_gib(v['bytes'])}" for k, v in sorted(r.per_decode_step.items())) or "none"
            line += f" (the prefill and one decode step); per decode step: {step}"
        lines.append(line)
    return lines


def text(fc: FleetCompile) -> str:
    """The report ``--compile-for`` prints; its last line is :meth:`FleetCompile.verdict`."""
    calls = ", ".join(f"{k} ×{v:,}" for k, v in sorted(fc.custom_calls.items(), key=lambda kv: -kv[1])) or "none"
    options = " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                       for k, v in fc.compiler_options.items()) or "none"
    m = fc.matmuls
    fp8 = ([f"FP8 matmuls per step: {m['fp8']:,} (cuBLASLt FP8 GEMMs {m['cublaslt']:,}, GEMM fusions with FP8 "
            f"operands {m['fusion']:,}); other matmuls {m['other']:,}"] if m.get("fp8") else [])
    return "\n".join(_header(fc) + _memory(fc) + _collectives(fc) + _worst_pairs(fc) + _rollout(fc)
                     + [f"custom calls per step: {calls}"] + fp8
                     + [f"XLA GPU options (parallel.overlap, bucket_size_mb): {options}", fc.verdict()])


def as_json(fc: FleetCompile) -> dict:
    """Everything :func:`text` prints, as plain JSON values (bytes, seconds, counts)."""
    t = fc.target
    return {
        "target": {"name": t.name, "description": t.description, "hbm_bytes": t.hbm_bytes, "hbm_bw": t.hbm_bw,
                   "peak_bf16_flops": t.peak_bf16, "nvlink_bw": t.nvlink_bw, "network_bw": t.network_bw,
                   "sm_count": t.sm_count, "compute_capability": t.compute_capability,
                   "cuda_runtime": t.cuda_runtime, "cudnn": t.cudnn},
        "num_devices": fc.num_devices, "devices_per_host": fc.devices_per_host, "mesh": fc.mesh_shape,
        "compile_s": fc.compile_s, "memory": {**fc.memory, "peak": fc.peak, "hbm": fc.hbm},
        "fits": fc.fits, "verdict": fc.verdict(), "memory_kinds_represented": fc.memory_kinds,
        "offloaded": fc.offloaded, "collectives": fc.collectives,
        "exposure": {"by_kind": fc.exposure.by_kind, "time_s": fc.exposure.time_s, "hidden_s": fc.exposure.hidden_s,
                     "exposed_s": fc.exposure.exposed_s, "hidden_fraction": fc.exposure.hidden_fraction},
        "matmul_flops": fc.flops, "compute_s_at_peak": fc.compute_s, "custom_calls": fc.custom_calls,
        "matmuls": fc.matmuls,
        "compiler_options": fc.compiler_options, "compiler_messages": fc.compiler_messages,
        "async_pairs": [dataclasses.asdict(p) for p in fc.pairs if p.sent >= 4096],
        "rollout": [dataclasses.asdict(r) for r in fc.rollout], "run_peak": fc.run_peak,
    }


def against_prediction(cfg: Config, fc: FleetCompile) -> str:
    """One line: the planner's predicted per-device peak (:func:`jaxcolossal.memory.budget.need`, the
    GPU's memory terms) against the compiled one, for ``--dry-run --compile-for``."""
    predicted = need(cfg, fc.num_devices, backend="gpu")["total"]
    return (f"memory per device: predicted {_gib(predicted)} by the planner, compiled {_gib(fc.run_peak)} "
            f"({(predicted - fc.run_peak) / fc.run_peak:+.1%}); the compiled figure is the one to trust (docs/planner.md)")
