"""Planning with no devices: the dry run of one config, the layout planner, and out-of-memory help.

``python -m jaxcolossal.plan --model llama3_70b --devices 16 --device h200 --seq 4096 --global-batch 512``
searches the layouts (dp/tp/pp sizes, ZeRO stage, remat, accumulation) for a model on a cluster
and prints the fastest that fit (:func:`report`, docs/planner.md).

``python scripts/train.py --config configs/llama_80l_example.yaml --dry-run`` prints this for a
config far too large to train here. Everything is arithmetic over the same sharding rules the
train step uses (:func:`jaxcolossal.sharding.state_specs`); with pipeline parallelism the
stacked ``layers`` dimension is split over ``pp``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxcolossal.config import Config, ConfigError, validate
from jaxcolossal.mesh import mesh_shape, platform
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
        sizes = (p.data_parallel_size, p.tensor_parallel_size, p.pipeline_parallel_size, p.sequence_parallel_size)
        if -1 in sizes:
            raise ConfigError("--dry-run needs explicit parallel sizes (no -1) to know the device count")
        num_devices = math.prod(sizes)
    validate(cfg, num_devices=num_devices)
    rp = p.resolve(num_devices)
    shape, vocab, shapes, specs = _layout(cfg, num_devices)
    from jaxcolossal.train.compression import check_powersgd
    check_powersgd(cfg.parallel, shapes, param_layout(cfg.model, shape["tp"])[2])
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
        f"devices    {num_devices}; mesh {shape} (pp × dp × fsdp × sp × tp)",
        f"precision  {cfg.precision.mode}: p={b['p']} g={b['g']} K={b['K']} bytes/param; zero_stage {p.zero_stage}",
        f"per-device model state: params {gib(params)}, grads {gib(grads)}, optimizer {gib(opt)}, "
        f"total {gib(params + grads + opt)}",
        f"batch      {t.batch_size} sequences × {t.seq_len} tokens per step, "
        + (f"{t.gradient_accumulation_steps} accumulation microbatches" if rp.pipeline_parallel_size == 1
           else "in the pipeline's microbatches (below)"),
        f"FLOPs/token {fpt['6N+attn']:.3e} (6N+attn), {fpt['colossal']:.3e} (Colossal-AI 2N(3+recompute))",
    ]
    lines += _offload_lines(cfg, shapes, specs, shape)
    lines.append(_communication_line(cfg, rp))
    if p.zero_stage > 0 and rp.data_parallel_size == 1:
        lines.append(f"note       zero_stage {p.zero_stage} with data_parallel_size 1 shards nothing: "
                     "ZeRO splits state over the data-parallel group")
    if rp.pipeline_parallel_size > 1:
        from jaxcolossal.pipeline import pipeline_schedule_for
        s = pipeline_schedule_for(cfg, rp.pipeline_parallel_size)
        lines.append(f"pipeline   {s.p} stages × {s.v} chunk(s), schedule {s.kind}, {s.m} microbatches, "
                     f"{s.num_ticks} ticks, bubble {s.bubble_fraction:.1%} (docs/pipeline.md)")
    return "\n".join(lines)


def _communication_line(cfg: Config, rp) -> str:
    """The dry run's line on the data-parallel traffic: how the gradients are reduced
    (``parallel.communication_dtype``, ``gradient_compression`` and its options) and the bytes each
    device sends for it per step (:func:`dp_gradient_bytes`), and whether ZeRO-3 gathers the
    layers' weights in ``communication_dtype`` (ZeRO++'s qwZ)."""
    from jaxcolossal.train.compression import weight_gather_dtype
    p = cfg.parallel
    dp = rp.data_parallel_size
    if p.gradient_compression == "topk":
        how = (f"top-k {p.compression_ratio:g}" + (" with error feedback" if p.error_feedback else " without error feedback")
               + (" and momentum correction" if p.momentum_correction else ""))
    elif p.gradient_compression == "powersgd":
        how = f"PowerSGD rank {p.powersgd_rank}" + ("" if p.error_feedback else " without error feedback")
    else:
        how = ("all-reduce" if p.zero_stage == 0 else "reduce-scatter") + f" in {p.communication_dtype}"
    if p.compression_warmup_steps and p.gradient_compression != "none":
        how += f" after {p.compression_warmup_steps} dense steps"
    sent = dp_gradient_bytes(cfg, dp, rp.tensor_parallel_size, rp.pipeline_parallel_size)
    line = f"comm       data-parallel gradients over {dp}: {how}, {sent / 2**20:,.2f} MiB sent per device per step"
    kind = weight_gather_dtype(cfg, dp)
    return line + (f"; ZeRO-3 layer weights gathered in {kind}" if kind else "")


def _offload_lines(cfg: Config, shapes, specs, shape) -> list[str]:
    """The offload plan (:mod:`jaxcolossal.placement`): device and host bytes per device and per
    8-device node, and whether the run fits ``offload.device_memory_limit`` when one is given."""
    o = cfg.offload
    limit = o.device_memory_limit
    try:
        pl, report = resolve(cfg, shapes, specs, shape, backend="gpu")
    except ConfigError as e:
        return [f"offload    does not fit: {e}"]
    need = device_need(pl, cfg, shapes, specs, shape, "gpu")
    lines = [report] if report else []
    lines.append(f"offload    optim {pl.asked_optim_frac:g} (reached {pl.optim_frac:.3f}), params {pl.asked_param_frac:g} "
                 f"(reached {pl.param_frac:.3f}), update on the {pl.optimizer_device}, activations {o.activations}")
    lines.append(f"memory     per device: device {gib(need['total'])} (state {gib(need['state'])}"
                 + (f" incl. {cfg.parallel.gradient_compression} state {gib(need['compression'])}"
                    if need["compression"] else "") + ", fp32 grads "
                 f"{gib(need['grads'])}, activations ≈{gib(need['activations'])}"
                 + (f", optimizer stream {gib(need['stream'])}" if need["stream"] else "")
                 + f"); pinned host {gib(need['host'])} per device, {gib(o.devices_per_host * need['host'])} per "
                 f"{o.devices_per_host}-device host"
                 + (f"; NVMe tier {gib(need['nvme'])} per device in {o.nvme_path}" if need["nvme"] else "")
                 + (f"; fits offload.device_memory_limit={limit}" if limit else "")
                 + (f" and offload.host_memory_limit={o.host_memory_limit}" if o.host_memory_limit else ""))
    from jaxcolossal.activations import describe
    lines.append(f"           {describe(need['peak'])}")
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


def _need(cfg: Config, num_devices: int, backend: str | None = None) -> dict:
    """:func:`jaxcolossal.placement.device_need` for ``cfg`` on ``num_devices`` (the mesh as the
    config resolves it; static fractions; no limit checked; ``backend`` as
    :func:`jaxcolossal.placement.device_need`)."""
    from jaxcolossal.placement import make_placement
    shape, _, shapes, specs = _layout(cfg, num_devices)
    o = cfg.offload
    pl = make_placement(o.offload_optim_frac, o.offload_param_frac, o.optimizer_device, shapes, specs, shape)
    return device_need(pl, cfg, shapes, specs, shape, backend)


def oom_changes(cfg: Config, run_mesh: dict, backend: str | None = None) -> list[tuple[str, dict]]:
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
            out.append((name, _need(c, math.prod(run_mesh.values()), backend)))
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


# ----------------------------------------------------------------------------- the layout planner


@dataclass(frozen=True)
class Device:
    """One accelerator kind: memory (bytes), dense bf16 peak (FLOP/s), the bandwidths (bytes/s,
    per device, one direction) inside a node (NVLink) and between nodes (InfiniBand), and the
    fixed cost of one collective (seconds: the α of Hockney's α–β model; 10 µs, the order of
    NCCL's small-message latency over NVLink, an assumption no GPU here has measured).

    Two fields describe devices that are not GPUs, and are off for every entry of :data:`DEVICES`:

    * ``shared_host``: the devices are simulated, threads of one host that share its cores
      (``--xla_force_host_platform_device_count``). A stage idle in the pipeline's bubble leaves
      its cores to the others, so the bubble costs only the work idle ticks do: GPipe's, which
      compute on a placeholder (docs/pipeline.md); 1F1B and interleaved skip them.
    * ``memory_cost``: seconds per byte of the memory the step touches per device, as
      :func:`cost_terms` counts it (``memory``: the predicted need, state, gradients and
      activations, plus the fp32 gradients once per microbatch). On a CPU a step's time grows
      with it, beyond the FLOPs: the optimizer update reads and writes the whole state, each
      microbatch writes its weight gradients and adds them up, what the forward saves for the
      backward leaves the caches, and XLA:CPU allocates the temporaries anew each run. A GPU's
      HBM moves these bytes in a time negligible next to its matmuls (0).
      ``scripts/plan_vs_time.py`` measures it for the CPU (docs/planner.md: the cost of the
      activations alone, its first form, ranked the CPU's layouts worse).
    """

    name: str
    memory: float
    peak: float
    intra_bw: float
    inter_bw: float
    per_node: int = 8
    latency: float = 10e-6
    shared_host: bool = False
    memory_cost: float = 0.0


DEVICES = {  # NVIDIA datasheets; inter-node: one 400 Gb/s NIC per GPU (200 Gb/s for A100)
    "a100-40": Device("A100 40GB", 40e9, 312e12, 300e9, 25e9),
    "a100-80": Device("A100 80GB", 80e9, 312e12, 300e9, 25e9),
    "h100": Device("H100 80GB", 80e9, 989e12, 450e9, 50e9),
    "h200": Device("H200 141GB", 141e9, 989e12, 450e9, 50e9),
    "b200": Device("B200 192GB", 192e9, 2250e12, 900e9, 50e9),
}
"""``--device`` names. NVLink bandwidths are per direction (H100/H200: 900 GB/s bidirectional)."""


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
    """Matmul FLOPs per device of one train step, as XLA compiles it (``jaxcolossal.hlo.dot_flops``).

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
    compiled program of a pipeline counts every tick's compute branch (:func:`jaxcolossal.hlo.dot_flops`:
    the costliest branch of each ``cond``), idle ticks too: that static count is this over
    ``1 − bubble``.
    """
    from jaxcolossal.models import get_family
    m, t = cfg.model, cfg.training
    n = param_count(m)
    table = get_family(m).param_shapes_and_axes(m, m.vocab_size)["layers"]
    matrix = lambda names: sum(math.prod(sh) for k, (sh, ax) in table.items()
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


def _ring(n: int) -> float:
    """Bytes each device sends per byte of a ring all-gather / reduce-scatter over ``n`` devices."""
    return (n - 1) / n if n > 1 else 0.0


def dp_gradient_bytes(cfg: Config, dp: int, tp: int = 1, pp: int = 1, k: int | None = None) -> float:
    """Bytes each device sends per step for the data-parallel gradient reduction (ring counts, as
    :attr:`jaxcolossal.hlo.Collective.sent`), with the ``parallel`` section's communication
    settings (docs/communication.md):

    * fp32: ZeRO-0 an all-reduce ``2(N−1)/N·4Ψ``; ZeRO-1 a reduce-scatter ``(N−1)/N·4Ψ``, ZeRO-2/3
      one per microbatch (``k``);
    * ``communication_dtype`` bf16/fp8: the same with 2 / 1 bytes per element (an all-to-all, plus
      the all-gather under ZeRO-0; fp8's per-shard scales are left out);
    * ``powersgd``: all-reduces of the rank-r factors, plus the leaves sent whole;
    * ``topk``: all-gathers of ``N·k`` values and int32 indices per leaf.

    ``Ψ`` is per model-parallel shard (``/(tp·pp)``); ``k`` defaults to the accumulation steps.
    """
    from jaxcolossal.train.compression import WIRE_BYTES, powersgd_views, powersgd_wire, wire_bytes
    p = cfg.parallel
    k = cfg.training.gradient_accumulation_steps if k is None else k
    ring = _ring(dp)
    if p.gradient_compression != "none":  # the result bytes compression.py predicts, times the ring factor
        _, shapes, axes = param_layout(cfg.model, 1)
        if p.gradient_compression == "powersgd":
            return 2 * ring * powersgd_wire(powersgd_views(shapes, axes, p.powersgd_rank), shapes,
                                            p.powersgd_rank)["powersgd"]
        return ring * wire_bytes(shapes, p.compression_ratio, dp)["topk"]
    psi = param_count(cfg.model)["total"] / (tp * pp)
    b = WIRE_BYTES[p.communication_dtype]
    if p.zero_stage == 0:
        return 2 * ring * b * psi
    return ring * b * psi * (k if p.zero_stage >= 2 else 1)


BACKENDS = ("gpu", "cpu")


def collective_terms(cfg: Config, num_devices: int, backend: str = "gpu") -> list[tuple[str, str, float, str]]:
    """The collectives of one train step, as ``(kind, mesh axis, bytes each device sends, what)``
    terms (ring counts, as :attr:`jaxcolossal.hlo.Collective.sent`; :func:`collective_bytes` sums
    them per kind). ``N`` the data group, ``k`` the microbatches, ``b·s`` the tokens of one
    microbatch per data shard, ``d`` the hidden size, ``Ψ_t`` the parameters per tp (and pp) shard,
    ``E`` the embedding table's share of it:

    * the gradient reduction: ZeRO-0 an all-reduce of ``4Ψ_t`` per step; ZeRO-1 a reduce-scatter;
      ZeRO-2/3 one per microbatch, of everything but the embedding, whose gradient comes from the
      microbatch's tokens (all-gathered, int32) and its ``b·s·d`` cotangent (an all-to-all)
      instead; with ``communication_dtype`` or compression, :func:`dp_gradient_bytes`;
    * the parameter all-gathers: ZeRO-1/2 ``Ψ_t`` once per step after the update; ZeRO-3 each
      layer's weights twice per microbatch (forward and backward; with the prefetch, ``k·L + 1``
      per pass: the first layer's gather is the same for every microbatch), in
      ``communication_dtype`` where narrower (qwZ), the head once per step, and the embedding
      lookup as its gradient (tokens and an all-to-all, per microbatch);
    * Megatron TP over ``t``, per microbatch: the vocab-parallel embedding's and the head's
      ``b·s·d`` all-reduces, the cross-entropy's three ``b·s`` ones, and per layer 2 in the
      forward, one per column-parallel projection's input gradient in the backward (2 where XLA
      reassociates them: its GPU pipeline), and 1 more with ``remat=full`` (the attention's; the
      MLP's output is not recomputed); under Megatron-SP each becomes an all-gather and a
      reduce-scatter, each gather done again in the backward for the weights' gradients (TP
      collective matmul: one ring of ``t − 1`` permutes per projection, 4 forward, 4 backward, 3
      redone under ``remat=full``; the embedding and head then 3 gathers and 2 all-reduces);
    * sp: Ulysses' four all-to-alls per layer (q, k, v to heads, the output back), forward and
      backward; ring attention's k/v hops, below;
    * pp: an activation forward and a gradient backward per schedule tick, idle or not
      (collective-permutes); with tp, Megatron's all-reduces in every tick (GPipe: 2 forward in
      its forward ticks and the backward's in its backward ticks; 1F1B and interleaved: the
      forward again in the backward); ZeRO 1–3 reduce once per step with the pipeline's own
      reduce-scatter (with tp an all-reduce and a slice) and gather once; the leaves every stage
      holds have their gradients all-reduced over pp; the interleaved schedule also moves the
      stage's layer weights into its chunks and their gradients back (all-to-alls over pp);
    * sp (ring attention): the k/v hops, ``sp − 1`` per layer forward and as many backward, and
      the gradient all-reduce over sp.

    ``backend``: ``gpu`` (default) or ``cpu``, what XLA's pipeline of that backend makes of the
    same program: the CPU's has no ReduceScatterCreator and no AllReduceReassociate (so every
    reduce-scatter is an all-reduce and a slice, and each projection's input gradient is
    all-reduced on its own), and it promotes bf16 collectives to fp32 (AllReducePromotion,
    FloatNormalization; ``xla/service/cpu/cpu_compiler.cc``). Checked per kind against the
    compiled CPU step's HLO (``tests/unit/test_planner.py``: 18 layouts, every kind within 5%).

    Raises:
        ValueError: an unknown ``backend``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    from jaxcolossal.models import get_family
    from jaxcolossal.placement import local_elements
    from jaxcolossal.train.compression import WIRE_BYTES, weight_gather_dtype
    from jaxcolossal.train.step import prefetches_weights
    cpu = backend == "cpu"
    p, m, t = cfg.parallel, cfg.model, cfg.training
    rp = p.resolve(num_devices)
    n, tp, pp, sp = (rp.data_parallel_size, rp.tensor_parallel_size, rp.pipeline_parallel_size,
                     rp.sequence_parallel_size)
    shape, _, shapes, specs = _layout(cfg, num_devices)
    k, ticks = t.gradient_accumulation_steps, 0
    if pp > 1:
        from jaxcolossal.pipeline import pipeline_schedule_for
        sched = pipeline_schedule_for(cfg, pp)
        k, ticks = sched.m, sched.num_ticks
    zero, layers = p.zero_stage, m.num_layers // pp
    wide = lambda nbytes: 4 if cpu and nbytes == 2 else nbytes  # noqa: E731  (the CPU's fp32 promotion)
    a_bytes = wide(2 if cfg.precision.mode != "fp32" else 4)
    p_bytes = wide(BYTES_PER_PARAM[cfg.precision.mode]["p"])
    flat = jax.tree_util.tree_flatten_with_path(local_elements(shapes, specs.base, shape))[0]
    name = lambda path: str(getattr(path[-1], "key", path[-1]))  # noqa: E731
    in_layers = lambda path: any(getattr(q, "key", None) == "layers" for q in path)  # noqa: E731
    psi = sum(e for _, e in flat)
    embed = sum(e for path, e in flat if name(path) in ("embed_tokens", "wte", "wpe"))
    per_layer = sum(e for path, e in flat if in_layers(path)) / max(layers, 1)
    shared = psi - per_layer * layers                               # embedding, head, final norm
    rows = t.batch_size // (n * k)                                 # b: per data shard and microbatch
    tokens = rows * t.seq_len // sp
    act = tokens * m.hidden_size * a_bytes                          # one [b, s, d] activation
    ring = _ring
    terms: list[tuple[str, str, float, str]] = []
    size = {"dp": n, "tp": tp, "sp": sp, "pp": pp}
    add = lambda kind, axis, b, what: terms.append((kind, axis, b, what)) if size[axis] > 1 and b else None  # noqa: E731
    # ---- the data group
    if n > 1:
        if p.gradient_compression != "none" or p.communication_dtype != "fp32":
            kind = {"topk": "all-gather", "powersgd": "all-reduce"}.get(p.gradient_compression, "all-to-all")
            add(kind, "dp", dp_gradient_bytes(cfg, n, tp, pp, k), "gradient reduction")
        elif zero <= 1 or pp > 1:  # once per step (a pipeline reduces every ZeRO stage once per step)
            # the pipeline's ZeRO 1-3 is a psum_scatter of its own; with tp, an all-reduce and a slice
            summed = pp > 1 and (zero == 0 or tp > 1)
            rs = zero >= 1 and (not cpu or pp > 1) and not summed
            own = psi - (shared if summed else 0)  # the stages' shared leaves: summed over pp, below
            add("reduce-scatter" if rs else "all-reduce", "dp", (1 if rs else 2) * ring(n) * 4 * own,
                "gradient reduction")
        else:
            rest = psi - (embed if tp == 1 else 0)  # a vocab-parallel embedding's gradient is reduced too
            add("all-reduce" if cpu else "reduce-scatter", "dp", k * (2 if cpu else 1) * ring(n) * 4 * rest,
                "gradient reduction, per microbatch")
        lowp = p.communication_dtype != "fp32"  # the embedding's gradient is then in the gradient reduction
        if zero >= 2 and embed and tp == 1 and pp == 1 and (zero == 3 or not lowp):
            # the embedding's gradient (and ZeRO-3's lookup): the microbatch's tokens and its [b, s, d] rows
            times = k * ((2 if zero == 3 else 1) - (1 if lowp else 0))
            add("all-gather", "dp", times * ring(n) * 4 * n * rows * t.seq_len, "embedding: the tokens")
            add("all-to-all", "dp", times * ring(n) * act, "embedding: the [b, s, d] rows")
        if zero in (1, 2) or (zero == 3 and pp > 1):  # (a pipeline's ZeRO-3: the stage's weights, once per step)
            add("all-gather", "dp", ring(n) * p_bytes * psi, "parameters after the update")
        if zero == 3 and pp == 1:
            lowp = weight_gather_dtype(cfg, n)
            w_bytes = WIRE_BYTES[lowp] if lowp else p_bytes
            gathers = 2 * (k * layers + 1) if prefetches_weights(cfg) else 2 * k * layers
            add("all-gather", "dp", gathers * ring(n) * w_bytes * per_layer, "ZeRO-3 layer weights")
            # the head and final norm: once per step (the gather is loop-invariant), but with a compute
            # dtype narrower than the params' and a remat policy, once more per microbatch (as compiled)
            heads = 1 + (k if cfg.precision.mode != "fp32" and m.remat != "none" else 0)
            add("all-gather", "dp", heads * ring(n) * p_bytes * (shared - embed),
                "ZeRO-3 head and norm")
    # ---- tensor parallelism
    if tp > 1:
        table = get_family(m).param_shapes_and_axes(m, m.vocab_size)["layers"]
        column = sum(1 for sh, ax in table.values() if len(ax) >= 3 and ax[1] == "embed")
        full = m.remat == "full"
        per = 2 + (column if cpu else 2) + (1 if full else 0)  # all-reduces per layer: forward, backward, redone
        count = k * (per * layers + 2)
        if pp > 1:
            # a pipeline tick runs its chunk's forward and backward under a cond (GPipe: the forward ticks,
            # then the backward ticks, from stashed activations; 1F1B and interleaved: both in every tick, the
            # forward again in the backward), on idle ticks too as far as the program says
            v = p.num_model_chunks if p.pipeline_schedule == "interleaved" else 1
            per += 0 if p.pipeline_schedule == "gpipe" else 2
            add("all-reduce", "tp", ticks * (per * layers / v + 2) * 2 * ring(tp) * act, "Megatron TP activations")
        elif p.sequence_parallelism_mode == "split_gather":
            if p.overlap and t.seq_len >= p.collective_matmul_min_seq:  # 4 rings forward, 4 backward, 3 redone
                add("collective-permute", "tp", k * layers * (8 + (3 if full else 0)) * ring(tp) * act,
                    "TP collective matmul")
                add("all-gather", "tp", k * 3 * ring(tp) * act, "Megatron-SP: embedding and head")
                add("all-reduce", "tp", k * 2 * 2 * ring(tp) * act, "Megatron-SP: embedding and head")
            else:  # each all-reduce a reduce-scatter; the gathers also again for the weights' gradients
                gathers = k * ((per + 1 + (1 if full else 0)) * layers + 3)
                add("all-gather", "tp", gathers * ring(tp) * act, "Megatron-SP")
                add("all-reduce" if cpu else "reduce-scatter", "tp", count * (2 if cpu else 1) * ring(tp) * act,
                    "Megatron-SP")
        else:
            add("all-reduce", "tp", count * 2 * ring(tp) * act, "Megatron TP activations")
        add("all-reduce", "tp", (ticks if pp > 1 else k) * 3 * 2 * ring(tp) * tokens * 4,
            "vocab-parallel cross-entropy")
    # ---- pipeline and ring attention
    if pp > 1:
        add("collective-permute", "pp", 2 * ticks * act, "pipeline: an activation and a gradient per tick")
        if p.pipeline_schedule == "interleaved":  # the stage's layers re-laid out into chunks, and back
            stage = 4 * per_layer * layers
            add("all-to-all", "pp", ring(pp) * stage * (p_bytes / 4 / (n if zero == 3 else 1) + (1 / n if zero >= 1 else 1)),
                "interleaved: the layers into chunks and their gradients back")
        # the embedding, head and final norm, held by every stage: their gradients summed over pp (over
        # the data group too in the same all-reduce under ZeRO-0, and ZeRO-1 with tp)
        group = pp * (n if zero == 0 or tp > 1 else 1)
        add("all-reduce", "pp", 2 * ring(group) * 4 * shared, "pipeline: shared leaves' gradients")
    if sp > 1:
        heads = lambda h: tokens * h * m.head_dim * a_bytes / max(tp, 1)  # noqa: E731  (one [b, s/sp, h, hd])
        if p.sequence_parallelism_mode == "all_to_all":  # Ulysses: q, k, v to heads and the output back, per
            add("all-to-all", "sp", 2 * layers * k * ring(sp) * (2 * heads(m.num_attention_heads)  # layer, fwd + bwd
                                                               + 2 * heads(m.num_key_value_heads)), "Ulysses")
        else:
            add("collective-permute", "sp", 2 * layers * k * (sp - 1) * 2 * heads(m.num_key_value_heads),
                "ring attention k/v, forward and backward")
        add("all-reduce", "sp", 2 * ring(sp) * 4 * psi, "gradients over sp")
    return terms


def collective_bytes(cfg: Config, num_devices: int, backend: str = "gpu") -> dict[str, float]:
    """Bytes each device sends per step, per collective kind (:func:`collective_terms` summed):
    ``{kind: bytes}``, the kinds of :data:`jaxcolossal.hlo.COLLECTIVES` that occur."""
    out: dict[str, float] = {}
    for kind, _, b, _ in collective_terms(cfg, num_devices, backend):
        out[kind] = out.get(kind, 0.0) + b
    return out


def collective_count(cfg: Config, num_devices: int) -> int:
    """Collectives one device takes part in per step, each paying :attr:`Device.latency` once
    (the α term; the bytes are costed separately). ``L`` layers per stage, ``k`` microbatches,
    ``n`` parameter leaves:

    * data parallel: ZeRO-0/1 one reduction per leaf per step; ZeRO-2/3 one per layer (+ the
      embedding and the head) per microbatch, inside the backward scan; ZeRO-1/2 one parameter
      all-gather per leaf after the update; ZeRO-3 two gathers per layer per microbatch
      (forward and backward);
    * tp: Megatron's 2 all-reduces per layer forward and 2 backward per microbatch, 2 more with a
      remat policy that recomputes the forward; under Megatron-SP each is an all-gather and a
      reduce-scatter, and with the TP collective matmul each of those a ring of tp − 1 permutes;
    * pp: a send each way per schedule tick; sp (ring attention): ``sp − 1`` hops per layer,
      forward and twice backward.
    """
    rp = cfg.parallel.resolve(num_devices)
    dp, tp, pp, sp = (rp.data_parallel_size, rp.tensor_parallel_size, rp.pipeline_parallel_size,
                      rp.sequence_parallel_size)
    zero, m = cfg.parallel.zero_stage, cfg.model
    k = cfg.training.gradient_accumulation_steps
    ticks = 0
    if pp > 1:
        from jaxcolossal.pipeline import pipeline_schedule_for
        sched = pipeline_schedule_for(cfg, pp)
        k, ticks = sched.m, sched.num_ticks
    layers = m.num_layers // pp
    leaves = len(jax.tree.leaves(param_layout(m, 1)[1], is_leaf=lambda x: isinstance(x, tuple)))
    count = 0
    if dp > 1:
        count += leaves if zero <= 1 else k * (layers + 2)
        count += leaves if zero in (1, 2) else 2 * k * (layers + 2) if zero == 3 else 0
    if tp > 1:
        per_layer = 4 + (2 if m.remat != "none" else 0)  # all-reduces: 2 forward, 2 backward, 2 recomputed
        if cfg.parallel.sequence_parallelism_mode == "split_gather":  # each an all-gather + a reduce-scatter
            per_layer *= 2
            if cfg.parallel.overlap and cfg.training.seq_len >= cfg.parallel.collective_matmul_min_seq:
                per_layer *= tp - 1  # TP collective matmul: each a ring of tp − 1 permutes
        count += k * layers * per_layer
    count += 2 * ticks
    if sp > 1:
        count += 3 * k * layers * (sp - 1)
    return count


def cost_terms(cfg: Config, num_devices: int, shared_host: bool = False, backend: str = "gpu") -> dict:
    """The quantities :func:`predict` multiplies by a :class:`Device`'s constants, per device per step:

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
      :func:`jaxcolossal.placement.device_need` breakdown for ``backend``.
    """
    need = _need(cfg, num_devices, backend)
    flops = compiled_flops(cfg, num_devices)
    pp = cfg.parallel.resolve(num_devices).pipeline_parallel_size
    bubble = 0.0
    micro = cfg.training.gradient_accumulation_steps
    if pp > 1:
        from jaxcolossal.config import pipeline_microbatches
        from jaxcolossal.pipeline import pipeline_schedule_for
        micro = pipeline_microbatches(cfg, pp)
        bubble = pipeline_schedule_for(cfg, pp).bubble_fraction
        if not shared_host or cfg.parallel.pipeline_schedule == "gpipe":  # GPipe's idle ticks compute
            flops /= 1 - bubble
    return {"flops": flops, "bubble": bubble, "collectives": collective_count(cfg, num_devices),
            "bytes": [(axis, b) for _, axis, b, _ in collective_terms(cfg, num_devices, backend)],
            "activations": need["activations"], "memory": need["total"] + micro * need["grads"], "need": need}


def predict(cfg: Config, num_devices: int, device: Device, efficiency: float = 0.45, backend: str = "gpu") -> Layout:
    """Predicted memory and step time of ``cfg`` on ``num_devices`` of ``device`` (docs/planner.md).

    * memory: :func:`jaxcolossal.placement.device_need` (the state by the ZeRO formulas, fp32
      gradients, and :func:`jaxcolossal.activations.step_peak`: the residuals JAX saves for the
      model's backward pass, traced at the per-device shapes, with the buffers each layout adds),
      against 90% of the device's memory;
    * compute: the matmul FLOPs the compiled step does (:func:`compiled_flops`: dense attention
      and the remat policy's recomputation) at ``efficiency`` × the bf16 peak (half of it in
      fp32: TF32 tensor cores),
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
    compute = terms["flops"] / (peak * efficiency) + terms["memory"] * device.memory_cost
    bw = lambda span: device.intra_bw if span <= device.per_node else device.inter_bw  # noqa: E731
    span = {"tp": tp, "sp": sp * tp, "dp": dp * sp * tp, "pp": num_devices}  # tp innermost, then sp, dp, pp
    comm = sum(b / bw(span[axis]) for axis, b in terms["bytes"]) + terms["collectives"] * device.latency
    step = compute + comm
    model_flops = fpt * tokens / num_devices
    return Layout(overrides={}, need=need, fits=need["total"] <= 0.9 * device.memory, step_s=step, compute_s=compute,
                  comm_s=comm, bubble=terms["bubble"], tokens_per_s=tokens / step, tflops=model_flops / step / 1e12,
                  mfu=model_flops / step / peak)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(cfg: Config, num_devices: int, device: Device, efficiency: float = 0.45) -> tuple[list[Layout], dict]:
    """Every layout of ``cfg``'s model on ``num_devices``: tp (within a node) × pp × dp, ZeRO 0–3
    (0–1 with a pipeline), remat none/full, gradient accumulation (pipeline microbatches) 1, 2, 4,
    … up to the per-replica batch; from 8k tokens on, also ring attention over sp (tp·sp within a
    node, no pipeline). Returns the layouts sorted fastest first, and for each (zero, tp, pp, dp,
    sp) family the smallest predicted memory among its layouts (bytes), for the families where
    none fits."""
    import copy
    m, t = cfg.model, cfg.training
    out, smallest = [], {}
    sps = [1] + ([d for d in (2, 4, 8) if d <= device.per_node] if t.seq_len >= 8192 else [])
    for tp, sp in ((tp, sp) for tp in _divisors(num_devices) for sp in sps
                   if tp * sp <= device.per_node and num_devices % (tp * sp) == 0):
        for pp in (d for d in _divisors(num_devices // (tp * sp)) if m.num_layers % d == 0 and (sp == 1 or d == 1)):
            dp = num_devices // (tp * pp * sp)
            if t.batch_size % dp:
                continue
            per_replica = t.batch_size // dp
            for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                if zero and dp == 1:
                    continue
                for remat in ("none", "full"):
                    for k in (d for d in _divisors(per_replica) if d & (d - 1) == 0):
                        if pp > 1 and k < pp:
                            continue
                        ov = {"parallel.data_parallel_size": dp, "parallel.tensor_parallel_size": tp,
                              "parallel.pipeline_parallel_size": pp, "parallel.zero_stage": zero,
                              "model.remat": remat}
                        c = copy.deepcopy(cfg)
                        c.parallel = dataclasses.replace(
                            c.parallel, data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            zero_stage=zero, sequence_parallel_size=sp,
                            sequence_parallelism_mode="ring_attn" if sp > 1 else "none")
                        if sp > 1:
                            ov.update({"parallel.sequence_parallel_size": sp,
                                       "parallel.sequence_parallelism_mode": "ring_attn", "model.attention_impl": "xla"})
                            c.model.attention_impl = "xla"
                        c.model.remat = remat
                        c.training.micro_batch_size = 0
                        if pp > 1:
                            c.parallel.num_microbatches = k
                            c.training.gradient_accumulation_steps = 1
                            ov["parallel.num_microbatches"] = k
                        else:
                            c.training.gradient_accumulation_steps = k
                            ov["training.gradient_accumulation_steps"] = k
                        try:
                            lay = predict(c, num_devices, device, efficiency)
                        except ConfigError:
                            continue
                        lay.overrides = ov
                        out.append(lay)
                        fam = (zero, tp, pp, dp, sp)
                        smallest[fam] = min(smallest.get(fam, math.inf), lay.need["total"])
    fitting = {(lay.overrides["parallel.zero_stage"], lay.overrides["parallel.tensor_parallel_size"],
                lay.overrides["parallel.pipeline_parallel_size"], lay.overrides["parallel.data_parallel_size"],
                lay.overrides.get("parallel.sequence_parallel_size", 1))
               for lay in out if lay.fits}
    rejected = {f: b for f, b in smallest.items() if f not in fitting}
    return sorted(out, key=lambda lay: (not lay.fits, lay.step_s)), rejected


def run_overrides(cfg: Config, layout: Layout, model: dict | None = None) -> dict:
    """The ``key=value`` overrides that make ``scripts/train.py`` run ``layout`` exactly as planned:
    the layout's own keys, the planned sequence length and global batch (``micro_batch_size=0``,
    so a preset's per-device batch does not override it), the precision, and ``model`` (the model
    section's keys when the model came from a Hugging Face ``config.json``)."""
    t = cfg.training
    out = dict(model or {})
    out.update(layout.overrides)
    out.update({"training.seq_len": t.seq_len, "training.batch_size": t.batch_size, "training.micro_batch_size": 0,
                "precision.bf16": str(cfg.precision.mode == "bf16").lower(),
                "precision.fp16": str(cfg.precision.mode == "fp16").lower()})
    return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _bytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def report(cfg: Config, num_devices: int, device: Device, efficiency: float = 0.45, top: int = 8,
           source: str = "--config CONFIG", model_overrides: dict | None = None) -> str:
    """The planner's printout: the fastest fitting layouts as Colossal-AI's benchmark table
    (strategy, batch per DP, samples/s, TFLOPS per device, memory), why each other family failed,
    and the command line that runs the best."""
    layouts, rejected = search(cfg, num_devices, device, efficiency)
    t = cfg.training
    n = param_count(cfg.model)["total"]
    lines = [f"model {cfg.model.type} {_count(n)} parameters, seq {t.seq_len}, global batch {t.batch_size}; "
             f"{num_devices} × {device.name} ({device.memory / 1e9:.0f} GB, {device.peak / 1e12:.0f} TFLOP/s bf16, "
             f"{device.per_node} per node); {cfg.precision.mode}; efficiency {efficiency:g} of peak",
             f"{len(layouts)} layouts considered, {sum(lay.fits for lay in layouts)} fit in 90% of the memory",
             "",
             "| strategy | accumulation / microbatches | batch per DP | samples/s | tokens/s | TFLOPS/device | MFU | "
             "memory/device | step (compute + comm) |",
             "|---|---|---|---|---|---|---|---|---|"]
    best = [lay for lay in layouts if lay.fits][:top]
    for lay in best:
        o = lay.overrides
        k = o.get("parallel.num_microbatches", o.get("training.gradient_accumulation_steps", 1))
        lines.append(f"| {lay.strategy()} | {k} | {t.batch_size // o['parallel.data_parallel_size']} | "
                     f"{lay.tokens_per_s / t.seq_len:,.2f} | {lay.tokens_per_s:,.0f} | {lay.tflops:,.1f} | "
                     f"{lay.mfu:.1%} | {_bytes(lay.need['total'])} | {lay.step_s:.2f} s "
                     f"({lay.compute_s:.2f} + {lay.comm_s:.2f}"
                     + (f", bubble {lay.bubble:.0%}" if lay.bubble else "") + ") |")
    if not best:
        lines.append("| (no layout fits: see below) | | | | | | | | |")
    if rejected:
        lines.append("")
        lines.append("rejected (the smallest predicted memory of each family, over remat and accumulation):")
        for (zero, tp, pp, dp, sp), need in sorted(rejected.items(), key=lambda kv: kv[1]):
            fam = (f"ZeRO-{zero} dp{dp}" + (f" sp{sp} ring" if sp > 1 else "") + (f" tp{tp}" if tp > 1 else "")
                   + (f" pp{pp}" if pp > 1 else ""))
            lines.append(f"  {fam}: {_bytes(need)} > {_bytes(0.9 * device.memory)}")
    if best:
        ov = " ".join(f"{k}={v}" for k, v in run_overrides(cfg, best[0], model_overrides).items())
        lines += ["", f"run the best: python scripts/train.py {source + ' ' if source else ''}{ov}"]
        if model_overrides:
            lines.append("(add model.init_from=<the Hugging Face folder> to start from its weights)")
    lines.append("(predictions: memory by the ZeRO formulas and the residuals traced from the model code, time by FLOPs at the "
                 "efficiency and ring volumes at the link bandwidths, no overlap; docs/planner.md)")
    return "\n".join(lines)


SEED_TABLE = (
    # (row, preset, device, devices, global batch, parallel overrides or None, published figure)
    ("7B, 8×H200, ZeRO-2 dp8, 36 per DP", "llama2_7b", "h200", 8, 288,
     dict(data_parallel_size=8, tensor_parallel_size=1, pipeline_parallel_size=1, zero_stage=2),
     (17.13, 534.18)),
    ("70B, 16×H200, ZeRO-2 dp16, 2 per DP (batch assumed)", "llama3_70b", "h200", 16, 32,
     dict(data_parallel_size=16, tensor_parallel_size=1, pipeline_parallel_size=1, zero_stage=2),
     (3.27, 469.1)),
    ("7B, B200, ZeRO-1 dp2 tp2 pp4 (2·2·4 = 16 devices), 36 per DP (batch assumed)", "llama2_7b", "b200", 16, 72,
     dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=4, zero_stage=1), None),
    ("70B, 16×B200, 2 per DP (batch assumed)", "llama3_70b", "b200", 16, 32, None, None),
)
"""Colossal-AI's published benchmark rows (its README; docs/planner.md): seq 4096, bf16, activation
checkpointing. The published figures are (samples/s, TFLOPS/GPU in Colossal-AI's ``8N`` convention,
which counts the recomputation); ``None`` where we have no figure. The 70B rows use the
``llama3_70b`` preset (Colossal-AI's 70B runs were LLaMA-2 70B: 128k vs 32k vocabulary)."""


def seed_table(efficiency: float = 0.45) -> str:
    """The planner's prediction for each row of :data:`SEED_TABLE` beside the published figure, and
    the layout it prefers on the same model and devices with its own prediction (markdown)."""
    import copy
    import os
    from jaxcolossal.config import load_config
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = ["| row | published | predicted for the row's layout | planner's choice |",
             "|---|---|---|---|"]
    for row, preset, dev_name, n, batch, par, published in SEED_TABLE:
        device = DEVICES[dev_name]
        cfg = load_config(os.path.join(root, "configs", "bench", f"{preset}.yaml"),
                          overrides=["training.seq_len=4096", f"training.batch_size={batch}", "training.micro_batch_size=0",
                                     "model.remat=full", "training.gradient_accumulation_steps=1"])

        def show(lay: Layout) -> str:
            fit = "" if lay.fits else f"; **does not fit**: {_bytes(lay.need['total'])} > {_bytes(0.9 * device.memory)}"
            return (f"{lay.tokens_per_s / 4096:,.2f} samples/s, {lay.tflops:,.0f} TFLOPS, MFU {lay.mfu:.1%}, "
                    f"{_bytes(lay.need['total'])}{fit}")

        mine = "—"
        if par is not None:
            c = copy.deepcopy(cfg)
            c.parallel = dataclasses.replace(c.parallel, **par)
            if par["pipeline_parallel_size"] > 1:
                c.parallel.num_microbatches = max(par["pipeline_parallel_size"],
                                                  batch // par["data_parallel_size"] // 2)
            try:
                mine = show(predict(c, n, device, efficiency))
            except ConfigError as e:
                mine = f"refused: {e}"
        layouts, _ = search(cfg, n, device, efficiency)
        best = next((lay for lay in layouts if lay.fits), None)
        choice = f"{best.strategy()}: {show(best)}" if best else "no layout fits"
        pub = (f"{published[0]:g} samples/s, {published[1]:g} TFLOPS (8N) = {published[1] * 6 / 8:,.0f} (6N)"
               if published else "(no figure in our references)")
        lines.append(f"| {row} | {pub} | {mine} | {choice} |")
    lines.append(f"(TFLOPS per device in the 6N + attention convention, MFU against the bf16 peak; Colossal-AI's "
                 f"8N convention counts the recomputation, so its figures are shown converted to 6N too; efficiency "
                 f"{efficiency:g} of the peak; predictions as in docs/planner.md)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxcolossal.plan``: pick a layout for a model on a cluster before renting it."""
    import argparse
    import os
    import sys

    from jaxcolossal.config import config_from_dict, load_config
    ap = argparse.ArgumentParser(prog="python -m jaxcolossal.plan", description=main.__doc__)
    if argv is None:
        argv = sys.argv[1:]
    if "--seed-table" in argv:  # Colossal-AI's published rows beside the planner's predictions
        print(seed_table())
        return 0
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a benchmark preset: configs/bench/<name>.yaml (llama_1b, llama3_8b, llama3_70b, ...)")
    src.add_argument("--config", help="a config file")
    src.add_argument("--hf-config", help="a Hugging Face config.json, or its folder (LLaMA or GPT-2)")
    ap.add_argument("--devices", type=int, required=True, help="number of accelerators")
    ap.add_argument("--device", default="h100", help=f"one of {sorted(DEVICES)} (default h100)")
    ap.add_argument("--memory-gb", type=float, help="override the device memory (GB)")
    ap.add_argument("--peak-tflops", type=float, help="override the bf16 peak (TFLOP/s)")
    ap.add_argument("--devices-per-node", type=int, help="default 8")
    ap.add_argument("--intra-gbps", type=float, help="intra-node bandwidth per device, GB/s")
    ap.add_argument("--inter-gbps", type=float, help="inter-node bandwidth per device, GB/s")
    ap.add_argument("--seq", type=int, help="sequence length (default: the config's)")
    ap.add_argument("--global-batch", type=int, help="sequences per step (default: the config's batch_size, or its "
                    "micro_batch_size × --devices)")
    ap.add_argument("--efficiency", type=float, default=0.45, help="fraction of peak the matmuls reach (0.45)")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args(argv)
    try:
        a.device = a.device.lower()
        if a.device not in DEVICES:
            raise ConfigError(f"--device {a.device!r}: known devices are {sorted(DEVICES)}; or give --memory-gb and "
                              "--peak-tflops with the closest one")
        for flag, value in (("--memory-gb", a.memory_gb), ("--peak-tflops", a.peak_tflops),
                            ("--intra-gbps", a.intra_gbps), ("--inter-gbps", a.inter_gbps)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} {value:g}: must be a positive number")
        if a.devices_per_node is not None and a.devices_per_node < 1:
            raise ConfigError(f"--devices-per-node {a.devices_per_node}: must be at least 1")
        if not (math.isfinite(a.efficiency) and 0 < a.efficiency <= 1):
            raise ConfigError(f"--efficiency {a.efficiency:g}: the fraction of the peak the matmuls reach, in (0, 1]")
        if a.top < 1:
            raise ConfigError(f"--top {a.top}: must be at least 1")
        dev = DEVICES[a.device]
        dev = dataclasses.replace(
            dev, memory=a.memory_gb * 1e9 if a.memory_gb is not None else dev.memory,
            peak=a.peak_tflops * 1e12 if a.peak_tflops is not None else dev.peak,
            per_node=a.devices_per_node if a.devices_per_node is not None else dev.per_node,
            intra_bw=a.intra_gbps * 1e9 if a.intra_gbps is not None else dev.intra_bw,
            inter_bw=a.inter_gbps * 1e9 if a.inter_gbps is not None else dev.inter_bw)
        if a.devices < 1:
            raise ConfigError(f"--devices {a.devices}: must be at least 1")
        training = {k: v for k, v in (("seq_len", a.seq), ("batch_size", a.global_batch)) if v is not None}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        model_overrides = None
        if a.model or a.config:
            path = a.config or os.path.join(root, "configs", "bench", f"{a.model}.yaml")
            if not os.path.exists(path):
                presets = sorted(f[:-5] for f in os.listdir(os.path.join(root, "configs", "bench")) if f.endswith(".yaml"))
                raise ConfigError(f"no such config: {path}" + (f"; the presets are {presets}" if a.model else ""))
            cfg = load_config(path, overrides=[f"training.{k}={v}" for k, v in training.items()])
            source = f"--config {path if a.config else f'configs/bench/{a.model}.yaml'}"
        else:
            from jaxcolossal.models.hf import config_from_hf, read_hf_config
            if not os.path.exists(a.hf_config):
                raise ConfigError(f"--hf-config {a.hf_config}: no such file or folder")
            folder = a.hf_config if os.path.isdir(a.hf_config) else os.path.dirname(os.path.abspath(a.hf_config))
            model = dataclasses.asdict(config_from_hf(read_hf_config(folder)))
            cfg = config_from_dict({"model": model, "training": training, "precision": {"bf16": True}})
            default = dataclasses.asdict(load_config(os.path.join(root, "configs", "llama_tiny.yaml")).model)
            model_overrides = {f"model.{k}": v for k, v in model.items() if v != default.get(k) and k != "remat"}
            source = ""
        if not a.global_batch and cfg.training.micro_batch_size:
            cfg.training.batch_size = cfg.training.micro_batch_size * a.devices
        cfg.training.micro_batch_size = 0
        text = report(cfg, a.devices, dev, a.efficiency, a.top, source, model_overrides)
        print(text)
        if text.splitlines()[1].startswith("0 layouts considered"):
            print(f"error: no layout of this model on {a.devices} devices accepts a global batch of "
                  f"{cfg.training.batch_size} × {cfg.training.seq_len} tokens (the batch must divide over the "
                  "data-parallel group, the layers over pp, the heads over tp): try a batch that is a multiple of "
                  "the device count", file=sys.stderr)
            return 1
        if "run the best:" not in text:
            print(f"error: no layout of this model fits {a.devices} × {dev.name}: more devices, a shorter sequence, "
                  "a smaller batch, or the offload section (docs/offload.md)", file=sys.stderr)
            return 1
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
