"""Compile a run's real train step for a GPU fleet, without its GPUs (``--compile-for h200x16``).

:func:`compile_for` builds the run exactly as ``scripts/train.py`` would — the config's layout,
precision, remat, offload, optimizer and kernels — over compile-only devices of a target
(:mod:`jaxcolossal.aot.target`), lowers and compiles its train step with XLA's GPU compiler, and
reads the result: per-device memory (``memory_analysis()``) against the device's HBM, the
collectives by kind with the bytes each device sends (:func:`jaxcolossal.aot.hlo.collective_totals`),
the async pairs and the compute scheduled inside each (:mod:`jaxcolossal.aot.gpu_schedule`), the
custom calls (cuDNN attention, Triton kernels) and the compile time.

What a deviceless compile cannot tell (docs/gpu.md): nothing is autotuned (XLA takes its default
GEMM and fusion configurations), nothing runs (no step time, no runtime memory fragmentation),
and on this jaxlib compile-only devices have no memory kinds, so offloaded state compiles as
device memory (:func:`memory_kinds_supported`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.aot import gpu_schedule as schedule
from jaxcolossal.aot import hlo
from jaxcolossal.aot.rollout import compile_rollout, compile_sampler
from jaxcolossal.aot.target import Target, compile_only_devices, topology
from jaxcolossal.config import Config, ConfigError, double_buffers_loops, validate
from jaxcolossal.config.derived import rollout_tp
from jaxcolossal.parallel.decode_layout import decode_mesh, make_reshard
from jaxcolossal.parallel.mesh import make_mesh, platform
from jaxcolossal.runtime import xla_flags
from jaxcolossal.runtime.platforms import fp8_refusal
from jaxcolossal.train.objective import make_objective
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.state import abstract_state, make_plan
from jaxcolossal.train.step import make_train_step

GiB = 2**30
HOST_MEMORY = "pinned_host"


@dataclass
class FleetCompile:
    """What the GPU compiler made of one run's train step for one fleet (:func:`compile_for`).

    Bytes are per device. ``memory``: ``argument``, ``output``, ``alias``, ``temp`` and the
    ``host_*`` counterparts from ``memory_analysis()``; ``collectives``: per kind, as
    :func:`jaxcolossal.aot.hlo.collective_totals`; ``custom_calls``: target -> executions per step;
    ``flops``: matmul FLOPs per device per step (:func:`jaxcolossal.aot.hlo.dot_flops`).
    """

    target: Target
    num_devices: int
    devices_per_host: int
    mesh_shape: dict
    compile_s: float
    memory: dict
    collectives: dict
    exposure: schedule.Exposure
    pairs: list
    custom_calls: dict
    flops: float
    compiler_options: dict
    memory_kinds: bool
    offloaded: bool
    compiler_messages: list = field(default_factory=list)
    hlo_text: str = ""
    matmuls: dict = field(default_factory=dict)
    """Matmul executions per step by inputs (:func:`jaxcolossal.aot.hlo.fp8_matmuls`): ``fp8``,
    ``cublaslt``, ``fusion``, ``other``."""
    rollout: list = field(default_factory=list)
    """GRPO: the rollout phase's programs (:func:`jaxcolossal.aot.rollout.compile_rollout`); ``[]`` otherwise."""

    @property
    def peak(self) -> int:
        """Arguments + outputs − donated aliases + temporaries: the device bytes the step needs."""
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temp"]

    @property
    def hbm(self) -> int:
        return self.target.hbm_bytes

    @property
    def run_peak(self) -> int:
        """The run's peak per device: the step's, or a GRPO rollout program's with the train state beside it."""
        return max([self.peak] + [r.phase_peak for r in self.rollout])

    @property
    def fits(self) -> bool:
        return self.run_peak <= self.hbm

    @property
    def compute_s(self) -> float:
        """The step's matmuls at the target's dense bf16 peak (a lower bound on the step)."""
        return self.flops / self.target.peak_bf16

    def verdict(self) -> str:
        """``fits, N GiB free`` or ``does not fit by N GiB`` (:attr:`run_peak`)."""
        gap = (self.hbm - self.run_peak) / GiB
        return f"fits, {gap:.2f} GiB free" if gap >= 0 else f"does not fit by {-gap:.2f} GiB"


# ----------------------------------------------------------------------------- build and compile


def check_fleet(cfg: Config, num_devices: int, devices_per_host: int, target: Target | None = None) -> None:
    """Everything about the fleet that can be refused before anything compiles.

    Raises:
        ConfigError: the layout does not fit ``num_devices`` (the config's sizes do not multiply
            to it, a batch that does not split, ...), the hosts do not split the devices, a
            setting ``--compile-for`` cannot build (the NVMe tier's files), or ``precision.fp8``
            on a ``target`` without FP8 tensor cores (compute capability below 8.9: the A100).
    """
    why = fp8_refusal(target.description, target.compute_capability) if target is not None else ""
    if cfg.precision.fp8 and why:
        raise ConfigError(why)
    try:
        topology(num_devices, devices_per_host)
    except ValueError as e:
        raise ConfigError(f"--compile-for: {e}") from None
    if cfg.offload.nvme_path:
        raise ConfigError("--compile-for: offload.nvme_path holds state in files between steps; compile without it "
                          "(the step compiles the same with offload.offload_optim_frac alone)")
    name = target.name if target is not None else "NAME"
    cfg.parallel.resolve(num_devices, other_count=f"compile for {{n}} GPUs: --compile-for {name}x{{n}}")
    validate(cfg, num_devices=num_devices)


def memory_kinds_supported(devices: list) -> bool:
    """Whether a sharding over ``devices`` keeps a ``pinned_host`` memory kind. Compile-only devices
    of jaxlib 0.10 report no memories (``addressable_memories()`` is empty), and a
    ``NamedSharding`` over them silently drops the kind: offloaded leaves then compile as device
    buffers (docs/gpu.md has the reproduction)."""
    s = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P(), memory_kind=HOST_MEMORY)
    return s.memory_kind == HOST_MEMORY


def abstract_batch(cfg: Config, plan) -> dict:
    """The train step's batch as ``ShapeDtypeStruct`` s with the batch sharding: ``inputs`` and
    ``targets`` int32 ``[B, t]``; ``loss_mask`` (chat data, DPO's pairs, packing) and ``segment_ids`` /
    ``positions`` (``data.packing_mask``) as the loaders give them; GRPO's rollout batch
    (:mod:`jaxcolossal.posttrain.rollout`) adds the loss mask, segment ids and positions of its
    left-padded rows; and every objective's own fp32 batch fields (``batch_fields``: GRPO's advantages,
    log-probs and ``tokens_per_step``, the reward model's ``margin``, ``[B, t]``; the ``row_fields`` among
    them ``[B, 1]``: DPO's precomputed ``ref_logps``)."""
    shape, sh = (cfg.training.batch_size, cfg.training.seq_len), plan.batch_sharding

    def arr(dtype, width=None):
        return jax.ShapeDtypeStruct(shape if width is None else shape[:1] + (width,), dtype, sharding=sh)

    batch = {"inputs": arr(np.int32), "targets": arr(np.int32)}
    grpo = cfg.training.objective == "grpo"
    if cfg.data.format in ("chat", "preference") or cfg.data.packing_mask or grpo:
        batch["loss_mask"] = arr(np.float32)
    if cfg.data.packing_mask or grpo:
        batch.update(segment_ids=arr(np.int32), positions=arr(np.int32))
    objective = make_objective(plan.family, cfg)
    rows = getattr(objective, "row_fields", ())
    batch.update({k: arr(np.float32, 1 if k in rows else None) for k in objective.batch_fields})
    return batch


@contextlib.contextmanager
def _captured_stderr(sink: list):
    """Collect what the compiler writes to file descriptor 2 (XLA's C++ log: the rematerialization
    pass's warnings), and pass it on to the real stderr afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            sys.stderr.write(text)
            sink.extend(line.strip() for line in text.splitlines()
                        if re.search(r"rematerializ|Can't reduce memory|memory use below", line, re.I))


def _fleet_config(cfg: Config, target: Target) -> Config:
    """``cfg`` with what a fleet implies: ``offload.placement_policy=auto`` without a limit plans for
    the target's HBM × 0.9, as a real GPU's reported capacity would."""
    if cfg.offload.placement_policy == "auto" and not cfg.offload.device_memory_limit:
        cfg = copy.deepcopy(cfg)
        cfg.offload.device_memory_limit = str(int(target.hbm_bytes * 0.9))
    return cfg


def compile_for(cfg: Config, target: Target, num_devices: int, devices_per_host: int | None = None,
                keep_hlo: bool = True, rollout: bool = True) -> FleetCompile:
    """Compile ``cfg``'s train step for ``num_devices`` devices of ``target`` (``devices_per_host``
    per host, default the target's 8) and read what the compiler made of it; for GRPO with ``rollout``
    also the rollout's programs (:func:`jaxcolossal.aot.rollout.compile_rollout`).

    The devices are compile-only (:func:`jaxcolossal.aot.target.compile_only_devices`); the run is
    built as the training loop builds it (mesh, plan, optimizer, the abstract train state, the
    jitted step), with the XLA GPU flags of ``parallel.overlap`` / ``bucket_size_mb`` passed as
    compiler options (:func:`jaxcolossal.runtime.xla_flags.compiler_options`). Every GPU path is chosen by
    the mesh's platform, so the program is the one a GPU run compiles.

    Raises:
        ConfigError: before anything compiles (:func:`check_fleet`), or from the plan (a device
            limit that the predicted need exceeds, ...).
        RuntimeError: the GPU compiler is not installed.
    """
    per_host = devices_per_host or target.devices_per_host
    check_fleet(cfg, num_devices, per_host, target)
    cfg = _fleet_config(cfg, target)
    devices = compile_only_devices(target, num_devices, per_host)
    mesh = make_mesh(cfg.parallel, devices)
    plan = make_plan(cfg, mesh)
    tx = build_optimizer(cfg.training, plan)
    step = make_train_step(plan, tx, lr_schedule(cfg.training))
    options = xla_flags.compiler_options(cfg.parallel.overlap, cfg.parallel.bucket_size_mb, platform(mesh),
                                         double_buffers_loops(cfg), cfg.parallel.nccl_abort_on_error)
    messages: list = []
    t0 = time.perf_counter()
    with _captured_stderr(messages):
        compiled = step.lower(abstract_state(plan, tx), abstract_batch(cfg, plan)).compile(compiler_options=options)
    compile_s = time.perf_counter() - t0
    result = _read(compiled, target, num_devices, per_host, plan, compile_s, options, messages, keep_hlo)
    if rollout and cfg.training.objective == "grpo":  # the state is donated: its bytes are the aliased ones
        result.rollout = compile_rollout(cfg, plan, abstract_state(plan, tx), per_host,
                                         result.memory["alias"] or result.memory["argument"], options)
    return result


def _read(compiled, target: Target, n: int, per_host: int, plan, compile_s: float, options: dict,
          messages: list, keep_hlo: bool) -> FleetCompile:
    """A :class:`FleetCompile` from a compiled step."""
    ma = compiled.memory_analysis()
    memory = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
              for k in ("argument", "output", "alias", "temp", "host_argument", "host_output", "host_temp")}
    text = compiled.as_text()
    pairs = schedule.async_pairs(text, per_host)
    return FleetCompile(
        target=target, num_devices=n, devices_per_host=per_host, mesh_shape=dict(plan.mesh_shape),
        compile_s=compile_s, memory=memory, collectives=hlo.collective_totals(text), pairs=pairs,
        exposure=schedule.exposure(text, target.peak_bf16, target.nvlink_bw, target.network_bw, per_host),
        custom_calls=schedule.custom_calls(text), flops=float(hlo.dot_flops(text)["flops"]), matmuls=hlo.fp8_matmuls(text),
        compiler_options=options, memory_kinds=memory_kinds_supported(list(plan.mesh.devices.flat)),
        offloaded=bool(plan.placement is not None and plan.placement.active), compiler_messages=messages,
        hlo_text=text if keep_hlo else "")


def layout_collectives(cfg: Config, target: Target, num_devices: int) -> dict:
    """What GRPO's decode layout saves, from XLA's GPU compiler over ``num_devices`` compile-only devices of
    ``target`` (the train step is not compiled): bytes per device of the reshard's collectives (once per
    rollout) and of one decode step's on the decode layout (``decode``) and on the training layout
    (``training``), the decode step's bytes by collective kind on the decode layout (``decode_kinds``:
    ``{"all-to-all": bytes, ...}``), and the decode layout's ``rollout_tp`` (``scripts/bench_rollout.py``).

    Raises:
        ConfigError: as :func:`check_fleet`."""
    check_fleet(cfg, num_devices, target.devices_per_host, target)
    plan = make_plan(cfg, make_mesh(cfg.parallel, compile_only_devices(target, num_devices)))
    params = abstract_state(plan, build_optimizer(cfg.training, plan)).model_params
    tp = rollout_tp(cfg, num_devices, target.devices_per_host)
    dmesh = decode_mesh(plan.mesh, tp)
    reshard, specs = make_reshard(params, dmesh)
    dparams = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(dmesh, s)),
                           params, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def per_step(mesh, ps) -> dict:
        text = compile_sampler(cfg, plan, mesh, ps, {}).as_text()
        return {kind: c["bytes"] for kind, c in hlo.decode_loop_collectives(text).items()}

    moved = sum(c["bytes"] for c in hlo.collective_totals(reshard.lower(params).compile().as_text()).values())
    decode = per_step(dmesh, dparams)
    return {"rollout_tp": tp, "reshard": moved, "decode": sum(decode.values()), "decode_kinds": decode,
            "training": sum(per_step(plan.mesh, params).values())}
