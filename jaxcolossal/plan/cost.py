"""The planner's time model: the matmul FLOPs XLA compiles, the collectives at the link bandwidths,
the pipeline's bubble, per device per step, and the layout they predict (docs/planner.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxcolossal.config import Config, pipeline_microbatches, validate
from jaxcolossal.memory import budget
from jaxcolossal.metrics import flops_per_token, param_count
from jaxcolossal.models import get_family
from jaxcolossal.parallel.pipeline_schedule import pipeline_schedule_for
from jaxcolossal.plan.collectives import collective_count, collective_terms
from jaxcolossal.plan.devices import Device


@dataclass
class Layout:
    """One candidate: the config overrides, the predicted per-device memory and step time."""

    overrides: dict
    need: dict
    fits: bool
    step_s: float
    compute_s: float
    comm_s: float
    bubble: float
    tokens_per_s: float
    tflops: float
    mfu: float

    def strategy(self) -> str:
        o = self.overrides
        parts = [f"zero{o['parallel.zero_stage']}", f"dp{o['parallel.data_parallel_size']}"]
        if o.get("parallel.sequence_parallel_size", 1) > 1:
            parts.append(f"sp{o['parallel.sequence_parallel_size']} ring")
        if o["parallel.tensor_parallel_size"] > 1:
            parts.append(f"tp{o['parallel.tensor_parallel_size']}")
        if o["parallel.pipeline_parallel_size"] > 1:
            parts.append(f"pp{o['parallel.pipeline_parallel_size']}")
        return " ".join(parts) + f" remat {o['model.remat']}"


def compiled_flops(cfg: Config, num_devices: int) -> float:
    """Matmul FLOPs per device of one train step, as XLA compiles it (``jaxcolossal.aot.hlo.dot_flops``).

    Per token: ``6·N_matmul`` (forward 2, backward 4, for every matrix parameter: the layers, the
    LM head, a tied embedding) plus ``12·L·s·h`` for attention, which XLA computes dense (the
    causal mask halves the useful work, not the matmuls), plus the remat policy's recomputed
    forward matmuls: ``full`` the layers' projections but the MLP's down projection (whose output
    the backward never needs) and attention (``2·N_redone + 4·L·s·h``), ``save_qkv_proj`` those
    but q/k/v, ``dots``/``selective``/``offload`` attention
    only, ``none`` nothing. Divided over the data group and ``tp`` (every matmul and the
    vocabulary are split over tp). Pipelines: divided over ``pp`` too (the idle ticks' work is
    skipped), and under 1F1B and interleaved the backward slot recomputes the stage's forward from
    its stashed input (``2·N_layers + 4·L·s·h`` more per token, on top of the remat policy's). The
    compiled program of a pipeline counts every tick's compute branch (:func:`jaxcolossal.aot.hlo.dot_flops`:
    the costliest branch of each ``cond``), idle ticks too: that static count is this over
    ``1 − bubble``.
    """
    m, t = cfg.model, cfg.training
    n = param_count(m)
    table = get_family(m).param_shapes_and_axes(m, m.vocab_size)["layers"]

    def matrix(names):  # elements of the layers' weight matrices named in ``names``
        return sum(math.prod(sh) for k, (sh, ax) in table.items()
                   if k in names and len([a for a in ax if a != "layers"]) >= 2)

    # the MLP's down projection ends the layer: the backward never needs its output, so it is not recomputed
    redone = matrix(table) - matrix(("w_down", "w_proj"))
    qkv = matrix(("wq", "wk", "wv"))
    attn = 4 * m.num_layers * t.seq_len * m.hidden_size  # q·kᵀ and p·v, forward, per token
    extra = {"none": 0, "full": 2 * redone + attn, "save_qkv_proj": 2 * (redone - qkv) + attn}.get(m.remat, attn)
    pp = cfg.parallel.resolve(num_devices).pipeline_parallel_size
    if pp > 1 and cfg.parallel.pipeline_schedule != "gpipe":  # the backward slot recomputes the stage's
        extra += 2 * matrix(table) + attn                    # forward from its stashed input (docs/pipeline.md)
    per_token = 6 * n["matmul"] + 3 * attn + extra
    return per_token * t.batch_size * t.seq_len / num_devices


def fp8_flops(cfg: Config, num_devices: int) -> float:
    """The part of :func:`compiled_flops` that ``precision.fp8`` runs in FP8 (0 without it): the
    layers' projections, forward and backward, and their recompute (the remat policy's, and the
    1F1B/interleaved backward slot's), per device per step; attention, the embedding and the LM
    head stay in bf16."""
    if not cfg.precision.fp8:
        return 0.0
    m, t = cfg.model, cfg.training
    table = get_family(m).param_shapes_and_axes(m, m.vocab_size)["layers"]

    def matrix(names):  # elements of the layers' weight matrices named in ``names``
        return sum(math.prod(sh) for k, (sh, ax) in table.items()
                   if k in names and len([a for a in ax if a != "layers"]) >= 2)

    layers = matrix(table)
    redone = {"none": 0, "full": layers - matrix(("w_down", "w_proj")),
              "save_qkv_proj": layers - matrix(("w_down", "w_proj", "wq", "wk", "wv"))}.get(m.remat, 0)
    pp = cfg.parallel.resolve(num_devices).pipeline_parallel_size
    if pp > 1 and cfg.parallel.pipeline_schedule != "gpipe":
        redone += layers
    return (6 * layers + 2 * redone) * t.batch_size * t.seq_len / num_devices


def cost_terms(cfg: Config, num_devices: int, shared_host: bool = False, backend: str = "gpu") -> dict:
    """The quantities :func:`predict` multiplies by a :class:`Device`'s constants, per device per step:

    * ``fp8_flops``: the part of them in FP8 (:func:`fp8_flops`), stretched alike;
    * ``flops``: the matmul FLOPs the step's time pays for (:func:`compiled_flops`), over
      ``1 − bubble`` for a pipeline, except on a ``shared_host`` device, where only GPipe's idle
      ticks cost (they compute on a placeholder; 1F1B and interleaved skip theirs);
    * ``bubble``: the pipeline schedule's bubble fraction (0 without a pipeline);
    * ``collectives``: how many collectives one device takes part in (:func:`collective_count`);
    * ``bytes``: ``[(mesh axis, bytes sent)]``, one per :func:`collective_terms` entry (``backend``'s);
    * ``activations``: the predicted activations and temporaries (bytes); ``memory``: the bytes
      the step touches, as :attr:`Device.memory_cost` charges them: the whole predicted need
      (state, gradients, activations) plus the fp32 gradients once per microbatch (pipeline
      microbatches, or accumulation steps); ``need``: the
      :func:`jaxcolossal.memory.budget.device_need` breakdown for ``backend``.
    """
    need = budget.need(cfg, num_devices, backend)
    pp = cfg.parallel.resolve(num_devices).pipeline_parallel_size
    bubble, stretch = 0.0, 1.0
    micro = cfg.training.gradient_accumulation_steps
    if pp > 1:
        micro = pipeline_microbatches(cfg, pp)
        bubble = pipeline_schedule_for(cfg, pp).bubble_fraction
        if not shared_host or cfg.parallel.pipeline_schedule == "gpipe":  # GPipe's idle ticks compute
            stretch = 1 / (1 - bubble)
    flops, fp8 = compiled_flops(cfg, num_devices) * stretch, fp8_flops(cfg, num_devices) * stretch
    return {"flops": flops, "fp8_flops": fp8, "bubble": bubble, "collectives": collective_count(cfg, num_devices),
            "bytes": [(axis, b) for _, axis, b, _ in collective_terms(cfg, num_devices, backend)],
            "activations": need["activations"], "memory": need["total"] + micro * need["grads"], "need": need}


def predict(cfg: Config, num_devices: int, device: Device, efficiency: float = 0.45, backend: str = "gpu") -> Layout:
    """Predicted memory and step time of ``cfg`` on ``num_devices`` of ``device`` (docs/planner.md).

    * memory: :func:`jaxcolossal.memory.budget.device_need` (the state by the ZeRO formulas, fp32
      gradients, and :func:`jaxcolossal.memory.activations.step_peak`: the residuals JAX saves for the
      model's backward pass, traced at the per-device shapes, with the buffers each layout adds),
      against 90% of the device's memory;
    * compute: the matmul FLOPs the compiled step does (:func:`compiled_flops`: dense attention
      and the remat policy's recomputation) at ``efficiency`` × the bf16 peak (half of it in
      fp32: TF32 tensor cores; with ``precision.fp8`` the layers' projections at the FP8 peak,
      :attr:`Device.fp8_peak`, where the device has one),
      divided by ``1 − bubble`` for a pipeline (on a ``shared_host`` device, GPipe's only); plus
      the memory it touches × :attr:`Device.memory_cost` (0 on GPUs); MFU against the same peak;
    * communication, not overlapped: every collective of the step (:func:`collective_terms`, as
      XLA's ``backend`` pipeline emits them: the gradient reduction with the config's
      ``communication_dtype`` or compression, the ZeRO gathers, Megatron TP/SP, the pipeline's
      sends, Ulysses and ring attention), each at the intra-node bandwidth when its group fits in
      one node (the mesh puts ``tp`` innermost, then ``sp``, ``dp``, ``pp``), else inter-node;
      plus :attr:`Device.latency` for each collective (:func:`collective_count`).

    Raises:
        ConfigError: an impossible layout (the config's own checks).
    """
    validate(cfg, num_devices=num_devices)
    rp = cfg.parallel.resolve(num_devices)
    terms = cost_terms(cfg, num_devices, device.shared_host, backend)
    need = terms["need"]
    m, t = cfg.model, cfg.training
    dp, tp, sp = rp.data_parallel_size, rp.tensor_parallel_size, rp.sequence_parallel_size
    tokens = t.batch_size * t.seq_len
    fpt = flops_per_token(m, t.seq_len)["6N+attn"]
    peak = device.peak if cfg.precision.mode != "fp32" else device.peak / 2  # fp32 matmuls on TF32 tensor cores
    f8 = terms["fp8_flops"] if device.fp8_peak else 0.0  # precision.fp8's projections at the FP8 peak
    compute = ((terms["flops"] - f8) / (peak * efficiency) + f8 / (max(device.fp8_peak, 1.0) * efficiency)
               + terms["memory"] * device.memory_cost)

    def bw(span):  # within a node, or across nodes
        return device.intra_bw if span <= device.per_node else device.inter_bw

    ep = rp.expert_parallel_size  # the experts' all-to-all: ep sits inside the data group, outside sp and tp
    span = {"tp": tp, "sp": sp * tp, "ep": ep * sp * tp, "dp": dp * sp * tp, "pp": num_devices}  # tp innermost
    comm = sum(b / bw(span[axis]) for axis, b in terms["bytes"]) + terms["collectives"] * device.latency
    step = compute + comm
    model_flops = fpt * tokens / num_devices
    return Layout(overrides={}, need=need, fits=need["total"] <= 0.9 * device.memory, step_s=step, compute_s=compute,
                  comm_s=comm, bubble=terms["bubble"], tokens_per_s=tokens / step, tflops=model_flops / step / 1e12,
                  mfu=model_flops / step / peak)
