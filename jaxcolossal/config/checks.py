"""Validation: every combination the sharding, the pipeline and the kernels cannot run, refused
before anything is compiled with the key and what to set (:func:`validate`, which runs the ranges
of :mod:`jaxcolossal.config.ranges` and the objective's checks of
:mod:`jaxcolossal.config.objective_checks` too)."""

from __future__ import annotations

import math
import os

from jaxcolossal.config.architecture import check_architecture
from jaxcolossal.config.derived import pipeline_microbatches, prefetches_weights, rollout_tp_sizes, weight_gather_dtype
from jaxcolossal.config.objective_checks import check_objective
from jaxcolossal.config.ranges import check_ranges
from jaxcolossal.config.schema import (
    LORA_TARGETS,
    Config,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    parse_bytes,
    parse_step_range,
    yaml_list,
)
from jaxcolossal.errors import ConfigError


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Reject impossible combinations before anything is compiled.

    With ``num_devices`` also resolves the mesh and checks every divisibility that the
    sharding needs (heads by tp, hidden size by the ZeRO group, batch by the data group).

    Raises:
        ConfigError: naming the key(s) and the allowed values.
    """
    p = cfg.parallel
    check_ranges(cfg)
    _check_model(cfg)
    check_architecture(cfg)
    _check_data(cfg)
    _check_features(cfg)
    _check_logging(cfg)
    _check_lora(cfg)
    check_objective(cfg)
    _check_moe(cfg)
    _check_offload(cfg)
    _check_compression(p)
    _check_freeze(cfg)
    _check_momentum_correction(cfg)
    _check_sequence(cfg, p)
    if p.tensor_parallel_size != -1:
        _check_tp(cfg.model, p.tensor_parallel_size)
    if p.pipeline_parallel_size != -1:
        _check_pipeline(cfg, p.pipeline_parallel_size)
    if num_devices is not None:
        _check_devices(cfg, num_devices)


def _check_model(cfg: Config) -> None:
    """The model's shape, the batch's split into microbatches, and the precision flags."""
    m, t, pr = cfg.model, cfg.training, cfg.precision
    if m.hidden_size % m.num_attention_heads and not m.attention_head_dim and m.type != "deepseek":
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_key_value_heads={m.num_key_value_heads} (grouped-query attention)")
    if m.head_dim % 2 and m.type != "deepseek":
        raise ConfigError(f"the head size (model.attention_head_dim, else hidden_size / num_attention_heads) = "
                          f"{m.head_dim} must be even for RoPE")
    if t.seq_len > m.max_position_embeddings and m.rope.type != "dynamic":
        grpo = (f" (a GRPO row: the prompt + posttrain.max_completion_length={cfg.posttrain.max_completion_length} "
                "tokens)" if t.objective == "grpo" else "")
        raise ConfigError(f"training.seq_len={t.seq_len}{grpo} exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings}")
    if t.micro_batch_size == 0 and t.batch_size % t.gradient_accumulation_steps:
        raise ConfigError(
            f"training.batch_size={t.batch_size} (global) is not divisible by "
            f"training.gradient_accumulation_steps={t.gradient_accumulation_steps}")
    if pr.bf16 and pr.fp16:
        raise ConfigError("precision: bf16 and fp16 are both true; choose one (neither means fp32)")
    if pr.fp8 and not pr.bf16:
        raise ConfigError(f"precision.fp8=true runs on top of bf16: set precision.bf16=true (now {pr.mode})")
    if pr.min_scale > pr.max_scale:
        raise ConfigError(f"precision.min_scale={pr.min_scale:g} is above precision.max_scale={pr.max_scale:g}")
    if t.resume is not False and not cfg.checkpoint.dir:
        raise ConfigError(f"training.resume={yaml_list([t.resume])[1:-1]} needs checkpoint.dir (the folder to "
                          "resume from)")
    if cfg.checkpoint.local_every and not cfg.checkpoint.dir:
        raise ConfigError(f"checkpoint.local_every={cfg.checkpoint.local_every} needs checkpoint.dir: an emergency "
                          "checkpoint is restored only against the persistent ones (set checkpoint.dir=checkpoints/run1)")


def _check_data(cfg: Config) -> None:
    """The tokenizer (``auto`` resolved here, once) and the data format against the corpus."""
    d = cfg.data
    if d.tokenizer == "auto":  # resolved here, once: everything after sees a concrete tokenizer
        init = cfg.model.init_from
        d.tokenizer = init if init and os.path.isfile(os.path.join(init, "tokenizer.json")) else "byte"
    tok = d.tokenizer
    if tok != "byte" and not (os.path.isfile(tok) or any(os.path.isfile(os.path.join(tok, f))
                                                         for f in ("tokenizer.json", "tokenizer.model"))):
        raise ConfigError(f"data.tokenizer={tok!r}: expected 'byte' or a tokenizer folder holding tokenizer.json "
                          "(Hugging Face) or tokenizer.model (SentencePiece), or that file; "
                          + ("the folder has no tokenizer.json" if os.path.isdir(tok) else "no such file or folder"))
    if d.format == "chat" and d.corpus == "stdlib":
        raise ConfigError("data.format=chat needs data.corpus: JSON-lines files of conversations "
                          "({'messages': [...]} or {'prompt', 'response'} per line)")
    if d.packing_mask and d.format in ("chat", "preference"):
        raise ConfigError("data.packing_mask=true applies to the pre-training formats, not data.format=chat "
                          "(a chat row holds one conversation)")
    if d.skip_long_examples and d.format not in ("chat", "preference"):
        raise ConfigError(f"data.skip_long_examples=true applies to data.format=chat, not {d.format} "
                          "(pre-training windows are cut from one stream, never too long)")
    if d.format in ("parquet", "datasets", "jsonl") and d.corpus == "stdlib":
        raise ConfigError(f"data.format={d.format} needs data.corpus: the files (or, for datasets, "
                          "the saved folder) to read")


MOE_KEYS = ("num_shared_experts", "first_k_dense", "moe_intermediate_size", "capacity_factor", "router_scoring",
            "router_aux_loss_form", "n_group", "topk_group", "routed_scaling_factor", "router_score_correction",
            "router_bias", "expert_bias")

MOE_FAMILIES = ("llama", "deepseek", "gpt_oss")
"""The families with mixture-of-experts layers."""


def _check_moe(cfg: Config) -> None:
    """A mixture of experts: top-k within the experts, the experts over ``ep``, the family, and the
    features it does not run with yet."""
    m, p = cfg.model, cfg.parallel
    ep = p.expert_parallel_size
    if not m.moe:
        default = ModelConfig()
        set_keys = [f"model.{k}" for k in MOE_KEYS if getattr(m, k) != getattr(default, k)]
        if set_keys or ep > 1:
            raise ConfigError(f"{', '.join(set_keys) or f'parallel.expert_parallel_size={ep}'} needs a mixture of "
                              "experts: set model.num_experts (e.g. 8)")
        return
    if m.type not in MOE_FAMILIES:
        raise ConfigError(f"model.num_experts={m.num_experts}: the {m.type} family has no mixture-of-experts layer "
                          f"(model.type {', '.join(MOE_FAMILIES)} have)")
    if m.num_experts_per_tok > m.num_experts:
        raise ConfigError(f"model.num_experts_per_tok={m.num_experts_per_tok} is more than model.num_experts="
                          f"{m.num_experts}: each token picks its top-k of the experts")
    if m.first_k_dense >= m.num_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} leaves no MoE layer of model.num_layers={m.num_layers}")
    if m.num_experts % ep:
        raise ConfigError(f"parallel.expert_parallel_size={ep} does not divide model.num_experts={m.num_experts}: "
                          "each ep rank holds num_experts / ep experts")
    pipelined = p.pipeline_parallel_size not in (1,)
    if pipelined and (p.tensor_parallel_size not in (1,) or m.first_k_dense or cfg.precision.fp16
                      or p.pipeline_schedule == "gpipe"):
        raise ConfigError("a mixture of experts in a pipeline needs parallel.tensor_parallel_size=1, "
                          "model.first_k_dense=0, no fp16, and pipeline_schedule 1f1b or interleaved (for now)")
    off = {"parallel.sequence_parallelism_mode / sequence_parallel_size": p.sequence_parallelism_mode != "none",
           "parallel.gradient_compression": p.gradient_compression != "none",
           "parallel.communication_dtype": p.communication_dtype != "fp32",
           "offload": cfg.offload.offload_optim_frac > 0 or cfg.offload.offload_param_frac > 0
           or cfg.offload.placement_policy == "auto" or bool(cfg.offload.nvme_path)}
    for key, on in off.items():
        if on:
            default = "none and 1" if key.startswith("parallel.sequence") else "its default"
            raise ConfigError(f"model.num_experts={m.num_experts}: a mixture of experts does not run with {key} yet "
                              f"(set it to {default})")


LORA_FAMILIES = ("llama", "gemma", "gpt_oss", "deepseek")
"""The families whose projections carry LoRA's adapters (:data:`jaxcolossal.models.layers.lora.WEIGHTS`):
LLaMA's names and equations; a mixture of experts (GPT-OSS, Mixtral) on its attention; DeepSeek on its
multi-head latent attention (:attr:`jaxcolossal.config.ModelConfig.lora_target_choices`)."""


def _check_lora_targets(m: ModelConfig) -> None:
    """Every named ``model.lora.targets`` is a projection of the model (:attr:`ModelConfig.lora_target_choices`).

    Raises: ConfigError naming the absent ones and the allowed ones."""
    absent = [t for t in m.lora.target_list if t not in m.lora_target_choices]
    if not absent:
        return
    what = ("multi-head latent attention" + (" with a q latent" if m.q_lora_rank else " without a q latent")
            if m.type == "deepseek" else "a mixture of experts (LoRA adapts its attention)" if m.moe
            else "a LLaMA-like model")
    raise ConfigError(f"model.lora.targets={m.lora.targets!r}: {', '.join(absent)} "
                      f"{'is not a projection' if len(absent) == 1 else 'are not projections'} of "
                      f"model.type={m.type} ({what}): allowed: comma-separated {', '.join(m.lora_target_choices)}, "
                      "or all" + (" (the default q,v is LLaMA's)" if m.lora.targets == LoraConfig().targets else ""))


def _check_lora(cfg: Config) -> None:
    """``model.lora``: known targets, a family with adapters (:data:`LORA_FAMILIES`), and the features it does not run
    with."""
    lo, m, p, o = cfg.model.lora, cfg.model, cfg.parallel, cfg.offload
    named = [t.strip() for t in lo.targets.split(",") if t.strip()]
    unknown = [t for t in named if t not in LORA_TARGETS and named != ["all"]]
    if unknown or not named:
        raise ConfigError(f"model.lora.targets={lo.targets!r}: " + (f"unknown target(s) {', '.join(unknown)}; " if unknown
                          else "no target; ") + f"allowed: comma-separated {', '.join(LORA_TARGETS)}, or all")
    if not lo.enabled:
        default = LoraConfig()
        set_keys = [f"model.lora.{k}" for k in ("alpha", "dropout", "targets", "init_from")
                    if getattr(lo, k) != getattr(default, k)]
        if set_keys:
            raise ConfigError(f"model.lora.rank=0 turns LoRA off, but {', '.join(set_keys)} is set: give "
                              "model.lora.rank > 0 (e.g. 8; with model.lora.init_from any positive value, the "
                              "adapter's own rank replaces it)")
        return
    if m.type not in LORA_FAMILIES:
        raise ConfigError(f"model.lora.rank={lo.rank}: LoRA is implemented for model.type {', '.join(LORA_FAMILIES)}, "
                          f"not {m.type!r}")
    if named != ["all"]:
        _check_lora_targets(m)
    off = {"parallel.gradient_compression": p.gradient_compression != "none",
           "offload.offload_optim_frac / offload_param_frac": o.offload_optim_frac > 0 or o.offload_param_frac > 0,
           "offload.placement_policy=auto": o.placement_policy == "auto", "offload.nvme_path": bool(o.nvme_path)}
    for key, on in off.items():
        if on:
            raise ConfigError(f"model.lora.rank={lo.rank}: LoRA does not run with {key} yet (set it to its default)")
    if lo.dropout > 0 and p.pipeline_parallel_size not in (1,):
        raise ConfigError(f"model.lora.dropout={lo.dropout:g}: the pipeline carries no dropout keys yet: set "
                          "model.lora.dropout=0, or parallel.pipeline_parallel_size=1")
    if lo.dropout > 0 and (prefetches_weights(cfg) or weight_gather_dtype(cfg, 2)):
        raise ConfigError(f"model.lora.dropout={lo.dropout:g}: ZeRO-3's prefetching layer scan (parallel.overlap with "
                          "model.remat=full) and its low-precision weight gathers (parallel.communication_dtype) carry "
                          "no dropout keys yet: set parallel.overlap=false and parallel.communication_dtype=fp32, another "
                          "model.remat, or model.lora.dropout=0")


def _check_logging(cfg: Config) -> None:
    """``logging.profile_steps``: a range that ends by ``training.max_steps``."""
    steps = parse_step_range(cfg.logging.profile_steps, "logging.profile_steps")
    if steps is not None and steps[1] > cfg.training.max_steps:
        raise ConfigError(f"logging.profile_steps={cfg.logging.profile_steps}: the run ends at training.max_steps="
                          f"{cfg.training.max_steps}, before step {steps[1]}; trace steps within it, e.g. "
                          f"logging.profile_steps={min(3, cfg.training.max_steps)}-{min(5, cfg.training.max_steps)}")


def _check_features(cfg: Config) -> None:
    """Attention kernels, packing and loss masks against pipeline parallelism."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    pipelined = p.pipeline_parallel_size not in (1,)
    if m.attention_impl == "flash" and pipelined:
        raise ConfigError("model.attention_impl=flash is not supported with pipeline parallelism yet (the Pallas "
                          "kernel inside the pipeline's shard_map): use xla"
                          + ("" if p.sequence_parallelism_mode == "ring_attn" else " or cudnn")
                          + ", or pipeline_parallel_size=1")
    if d.packing_mask and m.attention_impl == "cudnn":
        raise ConfigError("data.packing_mask=true needs model.attention_impl xla or flash (segment ids), not 'cudnn'")
    if d.packing_mask and pipelined:
        raise ConfigError("data.packing_mask=true is not supported with pipeline parallelism yet: "
                          "set parallel.pipeline_parallel_size=1")
    if d.format == "chat" and pipelined:
        raise ConfigError("data.format=chat (a loss mask) is not supported with pipeline parallelism yet: "
                          "set parallel.pipeline_parallel_size=1")


def _check_devices(cfg: Config, num_devices: int) -> None:
    """The sizes resolved on ``num_devices``: tp and sp again, the batch over the data group (and
    over the pipeline's microbatches), the hidden size over the ZeRO group. Sets
    ``training.batch_size`` from ``micro_batch_size`` when that is given."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    rp = p.resolve(num_devices)
    _check_tp(m, rp.tensor_parallel_size)
    _check_sequence(cfg, rp)
    dp = rp.data_parallel_size
    if dp % p.expert_parallel_size:
        raise ConfigError(f"parallel.expert_parallel_size={p.expert_parallel_size} does not divide data_parallel_size="
                          f"{dp} ({num_devices} devices / tp {rp.tensor_parallel_size} / pp {rp.pipeline_parallel_size}"
                          f" / sp {rp.sequence_parallel_size}): the ep axis is carved out of the data-parallel group")
    if t.micro_batch_size:
        t.batch_size = t.micro_batch_size * t.gradient_accumulation_steps * dp
    micro = t.batch_size // t.gradient_accumulation_steps
    if micro % dp:
        raise ConfigError(
            f"the microbatch of training.batch_size / gradient_accumulation_steps = {micro} sequences "
            f"is not divisible by the data-parallel size {dp}")
    if t.objective in ("dpo", "reward") and (micro // dp) % 2:
        raise ConfigError(f"training.objective={t.objective}: each data shard's microbatch holds {micro // dp} "
                          "sequences "
                          f"(training.batch_size={t.batch_size} / gradient_accumulation_steps / data-parallel size "
                          f"{dp}); it must hold whole preference pairs, an even number of sequences")
    if rp.pipeline_parallel_size > 1:
        _check_pipeline(cfg, rp.pipeline_parallel_size)
        mb = pipeline_microbatches(cfg, rp.pipeline_parallel_size)
        if t.batch_size % (dp * mb):
            raise ConfigError(
                f"training.batch_size={t.batch_size} does not split into parallel.num_microbatches={mb} "
                f"pipeline microbatches per data-parallel shard (data_parallel_size={dp}): "
                f"it must be divisible by {dp} × {mb} = {dp * mb}")
    _check_rollout_tp(cfg, num_devices)
    zero_group = dp // p.expert_parallel_size
    if p.zero_stage > 0 and m.hidden_size % zero_group:
        raise ConfigError(
            f"parallel.zero_stage={p.zero_stage} shards the hidden dimension over the data-parallel "
            f"group: model.hidden_size={m.hidden_size} is not divisible by "
            + (f"{zero_group} (data_parallel_size={dp} / expert_parallel_size={p.expert_parallel_size})"
               if p.expert_parallel_size > 1 else f"data_parallel_size={dp}"))


def _check_rollout_tp(cfg: Config, num_devices: int) -> None:
    """GRPO's explicit ``posttrain.rollout_tp`` against the model and the devices (:func:`rollout_tp_sizes`).

    Raises:
        ConfigError: one line naming the key and the sizes that work."""
    po = cfg.posttrain
    if cfg.training.objective != "grpo" or po.rollout_layout != "decode" or not po.rollout_tp:
        return
    sizes = rollout_tp_sizes(cfg, num_devices)
    if po.rollout_tp not in sizes:
        raise ConfigError(f"posttrain.rollout_tp={po.rollout_tp} does not split {num_devices} devices, the heads "
                          f"({cfg.model.num_attention_heads}, {cfg.model.num_key_value_heads} kv), the MLP and the "
                          f"{cfg.training.batch_size} rollout rows evenly; sizes that do: {sizes} (0: the largest "
                          "within a host)")


def _check_sequence(cfg: Config, p: ParallelConfig) -> None:
    """Sequence parallelism against the model and the other sizes (:mod:`jaxcolossal.parallel.sequence`).
    Sizes still ``-1`` are checked again once resolved."""
    m, t = cfg.model, cfg.training
    mode, sp, tp = p.sequence_parallelism_mode, p.sequence_parallel_size, p.tensor_parallel_size
    if sp == -1 or tp == -1:
        return
    if sp < 1:
        raise ConfigError(f"parallel.sequence_parallel_size={sp}: must be a positive integer or -1")
    if mode == "none":
        if sp > 1:
            raise ConfigError(f"parallel.sequence_parallel_size={sp} needs parallel.sequence_parallelism_mode: "
                              "all_to_all (DeepSpeed-Ulysses) or ring_attn (ring attention)")
        return
    if mode == "split_gather":
        if sp != 1:
            raise ConfigError("parallel.sequence_parallelism_mode=split_gather (Megatron-SP) splits the sequence "
                              f"over the tensor-parallel group: set sequence_parallel_size=1 (got {sp}), or use "
                              "all_to_all / ring_attn for a separate sp axis")
        if tp < 2:
            raise ConfigError("parallel.sequence_parallelism_mode=split_gather (Megatron-SP) needs "
                              f"tensor_parallel_size > 1 (got {tp}): it splits the sequence over the tp group")
        if t.seq_len % tp:
            raise ConfigError(f"training.seq_len={t.seq_len} is not divisible by tensor_parallel_size={tp} "
                              "(split_gather splits the sequence over the tp group)")
        return
    if sp < 2:
        raise ConfigError(f"parallel.sequence_parallelism_mode={mode} needs sequence_parallel_size > 1 (got {sp})")
    if p.pipeline_parallel_size != 1 and mode != "ring_attn":
        raise ConfigError(f"parallel.sequence_parallelism_mode={mode} is not supported with pipeline parallelism "
                          "yet (ring_attn is): set pipeline_parallel_size=1 or sequence_parallelism_mode=ring_attn")
    if p.gradient_compression != "none":
        raise ConfigError("parallel.gradient_compression is not supported with sequence parallelism yet: set "
                          "sequence_parallel_size=1 or gradient_compression=none")
    blocks = 2 * sp if mode == "ring_attn" else sp
    if t.seq_len % blocks:
        why = "2·sp blocks, the zig-zag split" if mode == "ring_attn" else "sp blocks"
        raise ConfigError(f"training.seq_len={t.seq_len} is not divisible by {blocks} "
                          f"(sequence_parallelism_mode={mode} splits it into {why})")
    if mode == "all_to_all":
        for key in ("num_attention_heads", "num_key_value_heads"):
            if getattr(m, key) % (sp * tp):
                raise ConfigError(
                    f"parallel.sequence_parallelism_mode=all_to_all (Ulysses) splits the heads over "
                    f"sequence_parallel_size × tensor_parallel_size = {sp} × {tp} = {sp * tp}, which does not "
                    f"divide model.{key}={getattr(m, key)}; use ring_attn, or sizes that divide")
    if mode == "ring_attn" and m.attention_impl != "xla":
        raise ConfigError("parallel.sequence_parallelism_mode=ring_attn runs its own blockwise attention (the "
                          f"ring's online softmax): set model.attention_impl=xla, not {m.attention_impl!r}")


def _check_freeze(cfg: Config) -> None:
    """``training.adam_freeze_step`` (1-bit Adam's frozen variance) is built for ``optax``'s AdamW
    in device memory only."""
    t, o = cfg.training, cfg.offload
    if t.adam_freeze_step > 0:
        if t.optimizer != "adamw":
            raise ConfigError(f"training.adam_freeze_step is supported with training.optimizer=adamw, not "
                              f"{t.optimizer!r}: set training.optimizer=adamw or training.adam_freeze_step=0")
        if o.offload_optim_frac > 0 or o.placement_policy == "auto" or o.nvme_path:
            raise ConfigError("training.adam_freeze_step is not supported with an offloaded optimizer state yet: "
                              "set offload.offload_optim_frac=0 offload.placement_policy=static offload.nvme_path='', "
                              "or training.adam_freeze_step=0")


def _check_momentum_correction(cfg: Config) -> None:
    """``parallel.momentum_correction`` (DGC) replaces the optimizer's momentum from the first
    compressed step: it needs top-k with error feedback and Adam's variance frozen."""
    p, t = cfg.parallel, cfg.training
    if not p.momentum_correction:
        return
    fixes = []
    if p.gradient_compression != "topk":
        fixes.append(f"parallel.gradient_compression=topk (got {p.gradient_compression})")
    elif not p.error_feedback:
        fixes.append("parallel.error_feedback=true (the velocity's unsent part is the residual)")
    if t.adam_freeze_step <= 0:
        fixes.append("training.adam_freeze_step > 0 (the variance frozen, so that the update is linear in what "
                     "arrives), e.g. equal to parallel.compression_warmup_steps")
    if fixes:
        raise ConfigError("parallel.momentum_correction=true needs " + " and ".join(fixes)
                          + "; or set parallel.momentum_correction=false")


def _check_compression(p: ParallelConfig) -> None:
    """``parallel.gradient_compression`` and ``communication_dtype`` against the rest (see
    :class:`ParallelConfig`; the ratio's and rank's ranges are in :data:`jaxcolossal.config.ranges.RANGES`)."""
    c = p.gradient_compression
    if c != "none":
        fixes = []  # every change it needs, in one message
        if p.zero_stage > 1:
            fixes.append(f"zero_stage 0 or 1 (got {p.zero_stage}: ZeRO-2/3 split the one gradient reduction per "
                         "step over the microbatches)")
        if p.tensor_parallel_size not in (1,) or p.pipeline_parallel_size not in (1,):
            fixes.append("no tensor or pipeline parallelism yet (set tensor_parallel_size=1 and "
                         "pipeline_parallel_size=1)")
        if fixes:
            raise ConfigError(f"parallel.gradient_compression={c} is supported with " + "; and ".join(fixes))
    if p.communication_dtype != "fp32":
        if c != "none":
            raise ConfigError(f"parallel.communication_dtype={p.communication_dtype} applies to the plain gradient "
                              f"reduction, not with gradient_compression={c}: set one of them")
        if p.pipeline_parallel_size not in (1,):
            raise ConfigError(f"parallel.communication_dtype={p.communication_dtype} is not supported with pipeline "
                              "parallelism yet: set pipeline_parallel_size=1 or communication_dtype=fp32")
        if p.sequence_parallel_size not in (1,):
            raise ConfigError(f"parallel.communication_dtype={p.communication_dtype} is not supported with sequence "
                              "parallelism yet: set sequence_parallel_size=1 or communication_dtype=fp32")


def _check_offload(cfg: Config) -> None:
    """The ``offload`` section against the rest (see :class:`OffloadConfig`)."""
    o, m = cfg.offload, cfg.model
    parse_bytes(o.device_memory_limit, "offload.device_memory_limit")
    parse_bytes(o.host_memory_limit, "offload.host_memory_limit")
    if o.offload_param_frac > 0 and cfg.parallel.zero_stage != 3:
        raise ConfigError(f"offload.offload_param_frac={o.offload_param_frac:g} needs parallel.zero_stage=3 "
                          f"(got {cfg.parallel.zero_stage}): below ZeRO-3 every device keeps the whole compute "
                          "copy; offload the optimizer state with offload.offload_optim_frac instead")
    if o.offload_param_frac > 0 and cfg.parallel.pipeline_parallel_size != 1:
        raise ConfigError("offload.offload_param_frac > 0 is not supported with pipeline parallelism yet: set "
                          "parallel.pipeline_parallel_size=1 or offload only the optimizer state")
    if o.nvme_path:
        if o.optimizer_device != "device":
            raise ConfigError(f"offload.nvme_path={o.nvme_path!r} streams each leaf's optimizer state from its files "
                              "through the device: set offload.optimizer_device=device (got "
                              f"{o.optimizer_device!r})")
        if o.placement_policy == "static" and not o.offload_optim_frac:
            raise ConfigError(f"offload.nvme_path={o.nvme_path!r} holds the offloaded optimizer state, but "
                              "offload.offload_optim_frac is 0: set the fraction to put there (e.g. 1.0)")
        if os.path.exists(o.nvme_path) and not os.path.isdir(o.nvme_path):
            raise ConfigError(f"offload.nvme_path={o.nvme_path!r} is a file, not a folder")
    if o.activations == "host":
        if m.remat not in ("none", "offload"):
            raise ConfigError(f"offload.activations=host saves the layer projections in host memory "
                              f"(model.remat=offload), but model.remat={m.remat!r}; choose one")
        m.remat = "offload"
    if o.placement_policy == "auto" and (o.offload_optim_frac or o.offload_param_frac):
        raise ConfigError("offload.placement_policy=auto chooses offload_optim_frac and offload_param_frac itself; "
                          "leave them at 0, or set placement_policy=static to give them")


def _check_pipeline(cfg: Config, pp: int) -> None:
    """The pipeline errors that need no device count (docs/pipeline.md)."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    v = p.num_model_chunks
    if pp == 1:
        return
    if p.pipeline_schedule == "interleaved" and v < 2:
        raise ConfigError("parallel.pipeline_schedule=interleaved needs parallel.num_model_chunks >= 2 "
                          f"(got {v}); use 1f1b for one chunk per device")
    if p.pipeline_schedule == "1f1b" and v > 1:
        raise ConfigError(f"parallel.num_model_chunks={v} needs parallel.pipeline_schedule interleaved "
                          "(or gpipe, the circular pipeline); 1f1b runs one chunk per device")
    if m.num_layers % (pp * v):
        raise ConfigError(
            f"model.num_layers={m.num_layers} is not divisible by pipeline_parallel_size × num_model_chunks "
            f"= {pp} × {v} = {pp * v}: every (virtual) stage must hold the same number of layers")
    if p.num_microbatches > 0 and t.gradient_accumulation_steps > 1 \
            and t.gradient_accumulation_steps != p.num_microbatches:
        raise ConfigError(
            f"with pipeline parallelism the pipeline microbatches replace gradient accumulation: "
            f"parallel.num_microbatches={p.num_microbatches} and training.gradient_accumulation_steps="
            f"{t.gradient_accumulation_steps} disagree; set only one of them")
    mb = pipeline_microbatches(cfg, pp)
    if v > 1 and mb % pp:
        raise ConfigError(
            f"parallel.num_microbatches={mb} with {v} model chunks: the interleaved schedule runs microbatches "
            f"in groups of pipeline_parallel_size={pp}, so it needs a multiple of {pp} (at least {pp})")
    if t.micro_batch_size == 0 and t.batch_size % mb:
        raise ConfigError(
            f"training.batch_size={t.batch_size} is not divisible by parallel.num_microbatches={mb}")


def _check_tp(m: ModelConfig, tp: int) -> None:
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    g = math.gcd(*(getattr(m, k) for k in keys))
    valid = [d for d in range(1, g + 1) if g % d == 0]
    for key in keys:
        v = getattr(m, key)
        if v % tp:
            raise ConfigError(
                f"parallel.tensor_parallel_size={tp} does not divide model.{key}={v} "
                f"(Megatron tensor parallelism splits heads and the MLP evenly over tp); "
                f"allowed values for this model: {valid}")
