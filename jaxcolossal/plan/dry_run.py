"""``scripts/train.py --dry-run``: the plan of one config, with no device: parameters, per-device
model state and memory, the mesh, the traffic of the gradient reduction, the offload plan and the
pipeline's schedule. Arithmetic over the same sharding rules as the train step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxcolossal.config import BYTES_PER_PARAM, Config, ConfigError, gib, precision_label, validate, weight_gather_dtype
from jaxcolossal.config.derived import grpo_prompt_length, posttrain_beta
from jaxcolossal.memory.activations import describe
from jaxcolossal.memory.budget import device_need, layout, lora_layout, need, resolve
from jaxcolossal.memory.rollout import ROLLOUT_FIELDS, kv_cache_slot
from jaxcolossal.metrics import flops_per_token, param_count
from jaxcolossal.models import param_layout
from jaxcolossal.parallel.compression import check_powersgd
from jaxcolossal.parallel.mesh import DATA_AXES
from jaxcolossal.parallel.pipeline_schedule import pipeline_schedule_for
from jaxcolossal.parallel.sharding import is_shape, shard_bytes
from jaxcolossal.plan.collectives import dp_gradient_bytes


@dataclass(frozen=True)
class DryRunPlan:
    """The dry run of one config: its printable ``lines``, and ``offload_refusal``, the reason the
    run itself would be refused before compiling for ``offload.device_memory_limit`` (None when it
    fits, or when no limit is set)."""

    lines: tuple[str, ...]
    offload_refusal: str | None = None

    @property
    def text(self) -> str:
        """The plan as printed, one line per entry of :attr:`lines`."""
        return "\n".join(self.lines)


def dry_run(cfg: Config, num_devices: int | None = None) -> str:
    """:func:`plan_dry_run`'s printable text.

    Raises:
        ConfigError: as :func:`plan_dry_run`.
    """
    return plan_dry_run(cfg, num_devices).text


def plan_dry_run(cfg: Config, num_devices: int | None = None) -> DryRunPlan:
    """The plan of ``cfg`` on ``num_devices`` (default: the product of the explicit parallel sizes):
    parameters, per-device model state, the mesh, the offload plan, the gradient traffic, the
    pipeline's schedule (:class:`DryRunPlan`).

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
    shape, vocab, shapes, specs = layout(cfg, num_devices)
    check_powersgd(cfg.parallel, shapes, param_layout(cfg.model, shape["tp"])[2])
    b = BYTES_PER_PARAM[cfg.precision.mode]

    def per_device(spec_tree, nbytes, of=None):
        vals = jax.tree.map(lambda s, sp: shard_bytes(s, jnp.uint8, sp, shape) * nbytes,
                            shapes if of is None else of, spec_tree, is_leaf=is_shape)
        return sum(jax.tree.leaves(vals))

    params = per_device(specs.params, b["p"])
    grads = per_device(specs.grads, b["g"])
    opt = per_device(specs.opt, b["K"])
    lora = cfg.model.lora
    if lora.enabled:  # the base frozen in the compute dtype (as params), the adapters trained
        frozen = params
        a_shapes, a_specs = lora_layout(cfg, shapes, shape)
        params = frozen + per_device(a_specs.params, b["p"], a_shapes)
        grads, opt = per_device(a_specs.grads, b["g"], a_shapes), per_device(a_specs.opt, b["K"], a_shapes)
    n = param_count(cfg.model)
    t = cfg.training
    fpt = flops_per_token(cfg.model, t.seq_len, cfg.model.remat != "none")
    lines = [
        f"model      {cfg.model.type}, {cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
        f"{cfg.model.num_attention_heads} heads / {cfg.model.num_key_value_heads} kv heads, "
        f"intermediate {cfg.model.intermediate_size}, vocab {cfg.model.vocab_size} (padded {vocab})",
        f"parameters {n['total']:,} ({n['total'] / 1e9:.2f} B)" + _experts_line(cfg, shape, n),
        f"devices    {num_devices}; mesh {shape} (pp × dp × fsdp × ep × sp × tp)",
        f"precision  {precision_label(cfg)}: p={b['p']} g={b['g']} K={b['K']} bytes/param; zero_stage {p.zero_stage}"
        + _zero_groups_note(cfg, shape),
        f"per-device model state: params {gib(params)}, grads {gib(grads)}, optimizer {gib(opt)}, "
        f"total {gib(params + grads + opt)}"
        + (f"\nLoRA       rank {lora.rank} on {', '.join(cfg.model.lora_targets)}: "
           f"{sum(math.prod(x) for x in jax.tree.leaves(a_shapes, is_leaf=is_shape)):,} trained parameters; the "
           f"base frozen in {cfg.precision.mode} ({gib(frozen)} of the params)" if lora.enabled else ""),
        f"batch      {t.batch_size} sequences × {t.seq_len} tokens per step, "
        + (f"{t.gradient_accumulation_steps} accumulation microbatches" if rp.pipeline_parallel_size == 1
           else "in the pipeline's microbatches (below)"),
        f"FLOPs/token {fpt['6N+attn']:.3e} (6N+attn), {fpt['colossal']:.3e} (Colossal-AI 2N(3+recompute))",
    ]
    if t.objective == "dpo":  # DPO's reference policy: a second copy of the weights, or none
        lines.append(_dpo_line(cfg, per_device(specs.params, b["p"])))
    offload, refusal = _offload_lines(cfg, shapes, specs, shape)
    if t.objective == "grpo":
        lines.append(_grpo_line(cfg, num_devices, shape))
    lines += offload
    lines.append(_communication_line(cfg, rp))
    if p.zero_stage > 0 and rp.data_parallel_size == 1:
        lines.append(f"note       zero_stage {p.zero_stage} with data_parallel_size 1 shards nothing: "
                     "ZeRO splits state over the data-parallel group")
    if rp.pipeline_parallel_size > 1:
        s = pipeline_schedule_for(cfg, rp.pipeline_parallel_size)
        lines.append(f"pipeline   {s.p} stages × {s.v} chunk(s), schedule {s.kind}, {s.m} microbatches, "
                     f"{s.num_ticks} ticks, bubble {s.bubble_fraction:.1%} (docs/pipeline.md)")
    return DryRunPlan(tuple(lines), refusal)


def _reference_copy(cfg: Config) -> str:
    """Whose weights the frozen reference copy holds: ``the initial params`` or ``posttrain.ref_model=PATH``."""
    return f"posttrain.ref_model={cfg.posttrain.ref_model}" if cfg.posttrain.ref_model else "the initial params"


def _dpo_line(cfg: Config, copy_bytes: int) -> str:
    """DPO's reference line: the frozen copy (``copy_bytes`` per device, the weights in the compute dtype
    sharded like the params), the LoRA base (0 B), or with ``posttrain.precompute_ref_log_probs`` the
    log-probs computed before training: the copy's bytes saved, 8 B per pair stored
    (:mod:`jaxcolossal.train.ref_logps`), 4 B per row in each batch."""
    po, pairs = cfg.posttrain, cfg.training.batch_size // 2
    stored = ("stored 8 B per pair (2 fp32) in " + (f"{cfg.checkpoint.dir}/ref_logps/" if cfg.checkpoint.dir
                                                    else "host memory (no checkpoint.dir)")
              + ", 4 B per row in each batch")
    if po.reference == "lora_base":
        what = "= the frozen base without the adapters: no second copy of the weights (0 B)"
        if po.precompute_ref_log_probs:
            what += ("; its log-probs precomputed before training (posttrain.precompute_ref_log_probs): no "
                     f"reference forward in the steps; {stored}")
    elif po.precompute_ref_log_probs:
        what = (f"log-probs precomputed before training with {_reference_copy(cfg)} "
                f"(posttrain.precompute_ref_log_probs): no frozen copy in the state (0 B; {gib(copy_bytes)} per "
                f"device saved) and no reference forward in the steps; {stored}")
    else:
        what = (f"= a frozen copy of {_reference_copy(cfg)} in {cfg.precision.mode}, sharded like them: "
                f"{gib(copy_bytes)} per device more")
    return f"DPO        reference {what}; {pairs} pairs per step"


def _grpo_line(cfg: Config, num_devices: int, shape: dict) -> str:
    """GRPO's line (:mod:`jaxcolossal.memory.rollout`): the reference copy (``beta > 0``), the rollout
    (prompts × generations, the prompt and completion widths), the sampler's KV cache and the rollout
    batch per device, and the rollout's peak against the step's (the plan's peak is the larger)."""
    t, po = cfg.training, cfg.posttrain
    b = BYTES_PER_PARAM[cfg.precision.mode]
    n = need(cfg, num_devices, "gpu")  # the config's static offload fractions, as the step's line
    r, ref = n["rollout"], n["reference"]
    slot, over_tp = kv_cache_slot(cfg)
    dshape = r["decode_shape"]
    data, tp = math.prod(dshape[a] for a in DATA_AXES), dshape["tp"]
    prompt = grpo_prompt_length(cfg)
    reference = (f"reference = a frozen copy of {_reference_copy(cfg)} in {cfg.precision.mode}: {gib(ref)} per device"
                 if ref else "no reference copy (" + ("beta 0" if posttrain_beta(cfg) == 0 else "the LoRA base") + ", 0 B)")
    return (f"GRPO       {reference}; rollouts of {t.batch_size // po.num_generations} prompts × {po.num_generations} "
            f"generations = {t.batch_size} rows of {prompt} prompt + {po.max_completion_length} completion tokens\n"
            + (f"rollout    decode layout tp {tp} × data {data} (posttrain.rollout_layout=decode): the params "
               f"resharded once per rollout, a copy of {gib(r['decode_copy'])} per device\n" if r["decode_copy"] else
               "rollout    decoding on the training layout (posttrain.rollout_layout=training)\n")
            + f"rollout    KV cache {gib(r['kv_cache'])} per device ({t.batch_size} rows × {prompt + po.max_completion_length} "
            f"slots × {slot} × {b['p']} B, rows over data {data}, "
            + (f"kv heads over tp {tp}" if over_tp else "whole on every tp rank")
            + f"); rollout batch {gib(r['batch'])} per device "
            f"({len(ROLLOUT_FIELDS)} fp32/int32 [{t.batch_size}, {t.seq_len}] fields); rollout peak {gib(r['total'])} "
            f"(state + " + (f"decode copy {gib(r['decode_copy'])} + " if r["decode_copy"] else "")
            + f"2 × KV cache + prefill scores {gib(r['scores'])}"
            + (f" + a gathered layer {gib(r['gathered'])}" if r["gathered"] else "")
            + f" + batch), step peak {gib(n['step_total'])}: the plan's peak is the "
            + ("rollout's" if r["total"] > n["step_total"] else "step's"))


def _zero_groups_note(cfg: Config, shape: dict) -> str:
    """With experts split over ``ep`` and ZeRO on: the group each part's state is sharded over ("" otherwise;
    :func:`jaxcolossal.parallel.sharding.zero_groups`)."""
    ep, fsdp = shape.get("ep", 1), shape.get("fsdp", 1)
    if not cfg.model.moe or cfg.parallel.zero_stage == 0 or ep == 1:
        return ""
    if shape.get("pp", 1) > 1:
        return f" (over fsdp {fsdp}; with pp the dense part's state is not split over ep)"
    return f" (the dense part's state over the data group fsdp × ep = {fsdp * ep}, the experts' over fsdp {fsdp})"


def _experts_line(cfg: Config, shape: dict, n: dict) -> str:
    """A mixture of experts' shape, its active parameters (Mixtral's count; without the input embedding,
    GPT-OSS's model card's) and the experts each device holds ("" when dense)."""
    m = cfg.model
    if not m.moe:
        return ""
    lean = (n["active"] - n["embedding"]) / 1e9
    return (f"; {n['active']:,} ({n['active'] / 1e9:.2f} B) active per token ({lean:.2f} B without the input embedding)\n"
            f"experts    {m.num_experts} of width {m.expert_size}, top-{m.num_experts_per_tok}, in {m.moe_layers} layers"
            + (f", {m.num_shared_experts} shared" if m.num_shared_experts else "")
            + (f" ({m.capacity_factor:g} capacity)" if m.capacity_factor else " (dropless)")
            + f"; ep {shape['ep']}: {m.num_experts // shape['ep']} per device and layer")


def _communication_line(cfg: Config, rp) -> str:
    """The dry run's line on the data-parallel traffic: how the gradients are reduced
    (``parallel.communication_dtype``, ``gradient_compression`` and its options) and the bytes each
    device sends for it per step (:func:`dp_gradient_bytes`), and whether ZeRO-3 gathers the
    layers' weights in ``communication_dtype`` (ZeRO++'s qwZ)."""
    p = cfg.parallel
    dp = rp.data_parallel_size
    if p.gradient_compression == "topk":
        how = (f"top-k {p.compression_ratio:g}" + (" with error feedback" if p.error_feedback else " without error feedback")
               + (" and momentum correction" if p.momentum_correction else ""))
    elif p.gradient_compression == "powersgd":
        how = f"PowerSGD rank {p.powersgd_rank}" + ("" if p.error_feedback else " without error feedback")
    else:
        reduces_all = p.zero_stage == 0 or (cfg.model.moe and p.zero_stage == 1)  # MoE: per microbatch
        how = ("all-reduce" if reduces_all else "reduce-scatter") + f" in {p.communication_dtype}"
    if p.compression_warmup_steps and p.gradient_compression != "none":
        how += f" after {p.compression_warmup_steps} dense steps"
    sent = dp_gradient_bytes(cfg, dp, rp.tensor_parallel_size, rp.pipeline_parallel_size)
    line = f"comm       data-parallel gradients over {dp}: {how}, {sent / 2**20:,.2f} MiB sent per device per step"
    kind = weight_gather_dtype(cfg, dp)
    return line + (f"; ZeRO-3 layer weights gathered in {kind}" if kind else "")


def _offload_lines(cfg: Config, shapes, specs, shape) -> tuple[list[str], str | None]:
    """``(lines, refusal)``: the offload plan (:mod:`jaxcolossal.memory.placement`), device and host
    bytes per device and per 8-device node, and whether the run fits ``offload.device_memory_limit``
    when one is given; ``refusal`` is the reason it does not (None when it fits)."""
    o = cfg.offload
    limit = o.device_memory_limit
    try:
        pl, report = resolve(cfg, shapes, specs, shape, backend="gpu")
    except ConfigError as e:
        return [f"offload    does not fit: {e}"], str(e)
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
    lines.append(f"           {describe(need['peak'])}")
    return lines, None
