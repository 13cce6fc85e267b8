"""The config's schema: one dataclass per section, with Colossal-AI's key names.

``model``, ``training``, ``parallel``, ``precision``, plus ``data``, ``checkpoint``, ``logging`` and
``offload``. Each field's type is what :mod:`jaxcolossal.config.load` checks a YAML value against;
:mod:`jaxcolossal.config.checks` checks their ranges and combinations.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxcolossal.errors import ConfigError

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections a LoRA adapter can sit on (PEFT's ``q_proj`` ... ``down_proj``)."""


@dataclass
class LoraConfig:
    """LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), as Hugging
    Face PEFT's ``LoraConfig``: each target projection ``W`` gains ``(alpha / rank) · B A`` with
    ``A [rank, in]`` and ``B [out, rank]`` (B starts at zero, so the model starts unchanged). The
    base weights are frozen in the compute dtype; only the adapters are trained, so the fp32
    master copy, the gradients and the optimizer state (and ZeRO's sharding of them) cover only
    them.

    ``rank``: 0 turns LoRA off. ``targets``: comma-separated, any of ``q, k, v, o, gate, up,
    down`` (``all``: every one). ``dropout``: on the adapters' input, as PEFT's ``lora_dropout``.
    ``init_from``: a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
    to continue training from; its rank, alpha and targets replace these."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "q,v"
    init_from: str = ""

    @property
    def enabled(self) -> bool:
        """True when ``rank > 0``."""
        return self.rank > 0

    @property
    def target_list(self) -> tuple[str, ...]:
        """``targets`` as a tuple in :data:`LORA_TARGETS` order (``all``: every one)."""
        named = {t.strip() for t in self.targets.split(",") if t.strip()}
        if named == {"all"}:
            return LORA_TARGETS
        return tuple(t for t in LORA_TARGETS if t in named)

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of the adapters' product (PEFT's ``scaling``)."""
        return self.alpha / self.rank


@dataclass
class ModelConfig:
    """LLaMA/GPT-2 shape. Names follow Hugging Face ``LlamaConfig``.

    ``init_from``: a local Hugging Face model directory (``config.json`` + safetensors) whose
    weights initialise the run.

    ``remat``: the activation-checkpointing policy of each layer, from least to most recompute:
    ``none``, ``selective`` (keeps every projection's output), ``save_qkv_proj``, ``dots``,
    ``full`` (:mod:`jaxcolossal.parallel.layer_scan`); ``offload`` keeps what ``selective`` keeps, in host
    memory (``offload.activations=host`` sets it).

    ``loss_chunk_tokens``: tokens per device in one chunk of the fused LM head + cross-entropy
    (:func:`jaxcolossal.models.layers.vocab.lm_head_loss`): a chunk's fp32 logits take
    ``loss_chunk_tokens × vocab/tp × 4`` bytes; 0 materializes the logits of all tokens.
    ``embedding_impl``: with the vocabulary split over tp, ``gather`` (Megatron's masked gather)
    or ``one_hot`` (a one-hot matmul, ``2·tokens·vocab·hidden/tp`` FLOPs; for comparison).

    ``qk_norm``: RMSNorm over each head of q and k before RoPE (Qwen3). ``attention_head_dim``: the
    size of one head (0: ``hidden_size / num_attention_heads``; Qwen3 sets its own).

    Mixture of experts (``num_experts > 0``; :mod:`jaxcolossal.models.layers.moe`): each layer after the
    first ``first_k_dense`` replaces its MLP by ``num_experts`` routed SwiGLU experts of
    ``moe_intermediate_size`` (0: ``intermediate_size``), ``num_experts_per_tok`` of them per token,
    plus ``num_shared_experts`` experts every token passes through (DeepSeek-MoE). The router scores
    by ``router_scoring`` (``softmax``: Mixtral, Qwen3-MoE; ``sigmoid``: DeepSeek-V3) and, with
    ``norm_topk_prob``, renormalises the chosen experts' weights to sum to one. The loss adds
    ``router_aux_loss_coef`` × the load-balancing loss (Switch/GShard: ``E · Σ_e f_e · P_e``) and
    ``router_z_loss_coef`` × the router z-loss (ST-MoE: the mean squared log-sum-exp of the router
    logits), each averaged over the MoE layers. ``capacity_factor``: 0 is dropless (tokens sorted by
    expert, grouped matmuls); > 0 gives each expert ``ceil(capacity_factor · tokens · k / E)`` slots
    per device and drops the tokens beyond them (GShard, Switch).

    ``vocab_size`` is the tokenizer's size; the embedding may be padded internally to a
    multiple of ``vocab_pad_multiple * tensor_parallel_size`` (Colossal-AI pads to 64·tp);
    the padding never reaches the user: padded logits are masked and exports strip it.
    """

    type: Literal["llama", "gpt2"] = "llama"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    vocab_size: int = 256
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    vocab_pad_multiple: int = 1
    remat: Literal["none", "save_qkv_proj", "selective", "dots", "full", "offload"] = "none"
    attention_impl: Literal["xla", "cudnn", "flash"] = "xla"
    embedding_impl: Literal["gather", "one_hot"] = "gather"
    loss_chunk_tokens: int = 1024
    init_from: str = ""
    lora: LoraConfig = field(default_factory=LoraConfig)
    qk_norm: bool = False
    attention_head_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0
    router_scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    capacity_factor: float = 0.0

    @property
    def moe(self) -> bool:
        """True when the layers' MLPs are mixtures of experts (``num_experts > 0``)."""
        return self.num_experts > 0

    @property
    def expert_size(self) -> int:
        """One routed expert's intermediate size (``moe_intermediate_size``, else ``intermediate_size``)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_layers(self) -> int:
        """The layers with a mixture of experts (all but the first ``first_k_dense``); 0 when dense."""
        return self.num_layers - self.first_k_dense if self.moe else 0

    @property
    def head_dim(self) -> int:
        """``attention_head_dim`` when set (Qwen3 decouples it), else ``hidden_size / num_attention_heads``."""
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads


@dataclass
class TrainingConfig:
    """Optimisation schedule. ``batch_size`` is global (sequences per optimizer step).

    ``resume``: ``false`` starts fresh (and refuses a ``checkpoint.dir`` that already holds
    checkpoints unless ``checkpoint.overwrite``); ``true`` restores the newest restorable step and
    fails when there is none; ``auto`` restores when there is one and starts fresh otherwise.

    ``nonfinite_policy``: what a step whose loss or gradient norm is NaN/inf does in every
    precision (the update is never applied): ``stop`` ends the run with an error at once;
    ``skip`` skips the step and stops after ``precision.max_consecutive_skips`` in a row. fp16
    overflows follow the loss scaler instead (skip, back off, stop at ``min_scale``).

    ``micro_batch_size`` (Colossal-AI's per-rank micro batch), when > 0, defines the global
    batch instead: ``batch_size = micro_batch_size × gradient_accumulation_steps × dp``, set
    when the config is validated against a device count.

    ``adam_freeze_step`` (DeepSpeed's ``OnebitAdam(freeze_step)``; 0: never): after that many
    optimizer steps Adam's second moment stops changing (1-bit Adam, Tang et al., 2021;
    :func:`jaxcolossal.train.optimizer.scale_by_adam_frozen_variance`). Top-k's error feedback
    needs it: set it to ``parallel.compression_warmup_steps`` (docs/communication.md).

    ``sample_tokens`` / ``sample_prompt``: the text generated at the end of the run (0: none).
    An empty prompt means ``"def "`` for text corpora, and for ``data.format=chat`` the first
    held-out conversation up to its response, rendered by the chat template; with chat a prompt
    you give is the user's turn, and the sample ends at the end-of-text token.
    """

    batch_size: int = 16
    micro_batch_size: int = 0
    seq_len: int = 128
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-3
    min_learning_rate_ratio: float = 0.1
    max_steps: int = 300
    warmup_steps: int = 30
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    adam_freeze_step: int = 0
    max_grad_norm: float = 1.0
    seed: int = 1024
    eval_every: int = 100
    eval_batches: int = 8
    resume: Literal[False, True, "auto"] = False
    nonfinite_policy: Literal["stop", "skip"] = "stop"
    optimizer: Literal["adamw", "fused_adamw"] = "adamw"
    sample_tokens: int = 200
    sample_prompt: str = ""


@dataclass
class ParallelConfig:
    """Device mesh sizes and ZeRO stage. ``-1`` means "the remaining devices".

    Mesh axes are ``(pp, dp, fsdp, tp)``. The data-parallel group of size
    ``data_parallel_size`` is ``dp × fsdp``: with ``zero_stage > 0`` ZeRO shards over the whole
    group (``fsdp = data_parallel_size``, ``dp = 1``); with ``zero_stage == 0`` it is plain DDP
    (``dp = data_parallel_size``).

    ``gradient_compression``: ``none``, ``topk``: each data-parallel shard sends only the
    ``compression_ratio`` fraction of its gradient's elements largest in magnitude (values and
    int32 indices, all-gathered; every rank sums them densely) instead of an all-reduce of the
    whole gradient (Lin et al., 2018, Deep Gradient Compression); or ``powersgd``: each weight
    matrix's gradient is sent as rank-``powersgd_rank`` factors (Vogels et al., 2019). With
    ``error_feedback`` (default) what a shard did not send is added to its next step's gradient
    (a per-shard fp32 residual in the train state, saved in checkpoints). The first
    ``compression_warmup_steps`` steps reduce densely (PyTorch's ``start_powerSGD_iter``, DGC's
    warm-up). Data-parallel traffic only; both need ``zero_stage`` ≤ 1, no tensor, pipeline or sequence parallelism (for now).
    ``momentum_correction`` (top-k with error feedback and ``training.adam_freeze_step``; default
    off): DGC's momentum correction (Lin et al., 2018, §3.2). Each shard keeps its own momentum
    ``u = β₁·u + (1 − β₁)·g`` (starting from 1/N of Adam's at the first compressed step) and sends
    the top-k of ``residual + u``. From then on the optimizer takes what arrives as its first
    moment (no second momentum on top); at ratio 1 this is exactly Adam. DGC's momentum factor
    masking is left out (docs/communication.md). A second per-shard fp32 buffer in the train state.

    ``communication_dtype``: ``fp32`` (default), ``bf16`` or ``fp8`` (e4m3, per-tensor scale):
    the dtype the data-parallel gradient reduction moves (an all-to-all and a local fp32 sum, then
    an all-gather where every rank needs the whole sum; ZeRO++'s qgZ, Colossal-AI's
    ``fp8_communication``), and under ZeRO-3 the dtype each layer's weights are all-gathered in
    where it is narrower than the compute dtype (ZeRO++'s qwZ; the backward is straight-through).
    Any ZeRO stage and tensor parallelism; not with pipeline or sequence
    parallelism or gradient compression (:mod:`jaxcolossal.parallel.compression`).

    ``overlap`` (default true; Colossal-AI's ``overlap_communication``) and ``bucket_size_mb``
    (``reduce_bucket_size_in_m``; 0: XLA's default) set XLA's GPU flags for the latency-hiding
    scheduler, collective pipelining and combine thresholds before the backend starts
    (:mod:`jaxcolossal.runtime.xla_flags`; only on GPUs, only the flags the jaxlib accepts). Under ZeRO-3
    with ``model.remat=full`` (and fp32 communication, no param offload) ``overlap`` also makes the
    layer scan gather layer i+1's weights before layer i runs, forward and backward
    (:func:`jaxcolossal.parallel.layer_scan.prefetched_scan`): one more layer's weights held per device.
    Under Megatron-SP (``split_gather``) ``overlap`` runs the projections as TP collective matmuls
    (:mod:`jaxcolossal.parallel.collective_matmul`) for sequences of at least ``collective_matmul_min_seq``
    tokens (default 0: all; no GPU has measured where it starts to pay).

    Sequence (context) parallelism, Colossal-AI's ``HybridParallelPlugin`` modes
    (:mod:`jaxcolossal.parallel.sequence`): ``sequence_parallel_size`` is the mesh axis ``sp`` (the
    sequence of every activation is split over it) and ``sequence_parallelism_mode`` is
    ``none``, ``split_gather`` (Megatron-SP: the residual stream's sequence split over the ``tp``
    group; needs ``tensor_parallel_size`` > 1 and ``sequence_parallel_size`` 1), ``all_to_all``
    (DeepSpeed-Ulysses: q/k/v swapped from sequence- to head-sharded around attention) or
    ``ring_attn`` (ring attention: k/v blocks passed around the ``sp`` ring, zig-zag order).

    ``expert_parallel_size`` (Colossal-AI's ``ep_size``): the mesh axis ``ep``, carved out of the
    data-parallel group (it must divide ``data_parallel_size``): the batch is split over it as over
    the rest of the group, a mixture of experts' routed experts are split over it, and tokens go to
    their experts' devices and back by all-to-all (:mod:`jaxcolossal.parallel.expert`). ZeRO shards
    the state over the rest of the data group (``data_parallel_size / expert_parallel_size``).
    """

    data_parallel_size: int = -1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    zero_stage: Literal[0, 1, 2, 3] = 0
    num_microbatches: int = 0
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    num_model_chunks: int = 1
    gradient_compression: Literal["none", "topk", "powersgd"] = "none"
    compression_ratio: float = 0.01
    powersgd_rank: int = 4
    compression_warmup_steps: int = 0
    error_feedback: bool = True
    momentum_correction: bool = False
    communication_dtype: Literal["fp32", "bf16", "fp8"] = "fp32"
    overlap: bool = True
    collective_matmul_min_seq: int = 0
    bucket_size_mb: float = 0.0
    sequence_parallel_size: int = 1
    sequence_parallelism_mode: Literal["none", "split_gather", "all_to_all", "ring_attn"] = "none"
    expert_parallel_size: int = 1

    def resolve(self, num_devices: int) -> "ParallelConfig":
        """Return a copy with ``-1`` filled so that dp·sp·tp·pp == ``num_devices``.

        Raises:
            ConfigError: if the sizes cannot multiply to ``num_devices``.
        """
        sizes = {
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "sequence_parallel_size": self.sequence_parallel_size,
        }
        unknown = [k for k, v in sizes.items() if v == -1]
        for k, v in sizes.items():
            if v != -1 and v < 1:
                raise ConfigError(f"parallel.{k}={v}: must be a positive integer or -1 (the remaining devices)")
        if len(unknown) > 1:
            raise ConfigError(f"parallel: at most one of {sorted(sizes)} may be -1, got -1 for {unknown}")
        known = math.prod(v for v in sizes.values() if v != -1)
        if unknown:
            if num_devices % known:
                given = " × ".join(f"{k}={v}" for k, v in sizes.items() if v not in (-1, 1)) or "1"
                divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
                raise ConfigError(
                    f"parallel.{unknown[0]}=-1: the other sizes ({given}) multiply to {known}, "
                    f"which does not divide the {num_devices} devices; their product must be one of "
                    f"{divisors}")
            sizes[unknown[0]] = num_devices // known
        product = math.prod(sizes.values())
        if product != num_devices:
            sp = sizes["sequence_parallel_size"]
            raise ConfigError(
                "parallel: data_parallel_size × tensor_parallel_size × pipeline_parallel_size"
                + (" × sequence_parallel_size" if sp != 1 else "") + " = "
                f"{sizes['data_parallel_size']}×{sizes['tensor_parallel_size']}×"
                f"{sizes['pipeline_parallel_size']}" + (f"×{sp}" if sp != 1 else "")
                + f" = {product}, but there are {num_devices} devices; set "
                f"parallel.data_parallel_size=-1 to use them all, or (simulated CPU devices) run scripts/train.py "
                f"with --devices {product}")
        return dataclasses.replace(self, **sizes)


@dataclass
class PrecisionConfig:
    """Mixed precision. Neither flag: fp32 everywhere. ``bf16``: bf16 compute, fp32 master
    weights and fp32 gradient reduction. ``fp16``: the same in fp16 with dynamic loss scaling
    (Colossal-AI's DynamicGradScaler defaults).

    ``fp8`` (with ``bf16``): the layers' projections (q, k, v, o and the MLP's) multiply in FP8,
    Transformer Engine's recipe with current per-tensor scaling: activations and weights in e4m3,
    gradients in e5m2, each tensor scaled by its own amax in the step that uses it
    (:func:`jaxcolossal.models.layers.linear.project_fp8`). Master weights, optimizer state, the
    embedding, the LM head and attention stay as in bf16. On GPUs with FP8 tensor cores (Hopper,
    Blackwell) XLA turns each into an FP8 GEMM; elsewhere the numerics are emulated."""

    bf16: bool = False
    fp16: bool = False
    fp8: bool = False
    fp16_opt_level: Literal["O1", "O2"] = "O2"
    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**32
    max_consecutive_skips: int = 20

    @property
    def mode(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class DataConfig:
    """Training text. ``corpus``: ``"stdlib"`` (the running Python's standard library sources)
    or comma-separated globs of ``.txt``/``.jsonl`` files. ``tokenizer``: ``byte``, the path of a
    local Hugging Face tokenizer (a folder with ``tokenizer.json``, or the file), or ``auto`` (the
    default): the tokenizer in ``model.init_from`` when that folder has one, else ``byte``.
    ``format``: ``text`` (pre-training: documents joined into one stream, random windows; ``.jsonl``
    files by suffix), ``jsonl`` (every file is JSON lines), ``parquet`` (column ``text_key``, with
    ``pyarrow``), ``datasets`` (``corpus`` is a ``datasets`` ``save_to_disk`` folder), or ``chat`` (instruction fine-tuning: JSON lines of ``messages`` or ``prompt``/``response``, one
    conversation per row, loss on the responses only; :mod:`jaxcolossal.data.chat`).
    ``cache_dir``: where a ``text`` corpus's token stream is cached after the first run
    (:mod:`jaxcolossal.data.cache`); ``""`` tokenizes at every start. ``packing_mask``: windows
    that hold several documents get segment ids and per-document positions, so attention does
    not cross a document boundary and positions restart, and the target that crosses one is
    not trained on (:func:`jaxcolossal.data.loader.packing_fields`)."""

    corpus: str = "stdlib"
    format: Literal["text", "jsonl", "parquet", "datasets", "chat"] = "text"
    text_key: str = "text"
    tokenizer: str = "auto"
    val_fraction: float = 0.05
    max_corpus_bytes: int = 0
    cache_dir: str = "~/.cache/jaxcolossal/tokens"
    packing_mask: bool = False


@dataclass
class CheckpointConfig:
    """Orbax checkpoints under ``dir`` every ``save_every`` steps (0: only at the end).

    ``overwrite``: a fresh run (``training.resume=false``) into a ``dir`` that already holds
    checkpoints deletes them first; without it such a run is refused before anything compiles."""

    dir: str = ""
    save_every: int = 0
    max_to_keep: int = 3
    overwrite: bool = False


@dataclass
class LoggingConfig:
    """Where ``metrics.jsonl`` and the log file go; ``log_every`` in steps. ``tensorboard``: also
    write every logged scalar as TensorBoard events to ``<run_dir>/tensorboard``
    (:class:`jaxcolossal.metrics.MetricsWriter`)."""

    run_dir: str = "runs/default"
    log_every: int = 10
    progress_bar: bool = True
    tensorboard: bool = False


class Bytes(str):
    """A byte count in the config: an integer, or a string with a unit (``"80GB"``, ``"1.5GiB"``,
    ``"512MB"``); ``""`` means "not given". :func:`parse_bytes` reads it."""


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: Any, key: str = "value") -> int:
    """``"80GB"`` -> 80·10⁹, ``"1GiB"`` -> 2³⁰, ``4096`` -> 4096; ``""``/``None`` -> 0 (not given).

    Raises:
        ConfigError: not a non-negative number with one of the units B, KB, MB, GB, TB, KiB, MiB,
            GiB, TiB.
    """
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected a byte count such as 80GB or 85899345920")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(f"{key}={value!r}: expected a byte count such as 80GB, 80GiB or 85899345920 "
                              f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not math.isfinite(n) or n < 0:
        raise ConfigError(f"{key}={value!r}: must be a finite, non-negative byte count")
    return int(n)


@dataclass
class OffloadConfig:
    """Heterogeneous memory: which part of the train state lives in host memory (Colossal-AI's
    Gemini placement and ``cpu_offload``; :mod:`jaxcolossal.memory.placement`, docs/offload.md).

    ``placement_policy``: ``static`` (the fractions below, as given) or ``auto`` (the fractions that
    fit ``device_memory_limit`` with the least host↔device traffic, Gemini's
    ``ChunkManager.optimize_chunk_config``). ``offload_optim_frac``: the fraction of the optimizer
    state (Adam m, v and the fp32 master copy), by bytes, that lives in pinned host memory.
    ``offload_param_frac`` (ZeRO-3 only): the fraction of the compute parameters kept in host
    memory between steps. ``optimizer_device``: where the offloaded optimizer state is updated:
    ``device`` (moved in, updated, moved out) or ``host`` (on the CPU with ``compute_on``, as
    Colossal-AI's CPU Adam). ``activations``: ``host`` saves the layer projections to host memory
    instead of device memory (``model.remat=offload``). ``device_memory_limit``: the device bytes a
    run may plan for (``"80GB"``; ``""``: the device's reported capacity × 0.9, none on the CPU).
    ``host_memory_limit``: the pinned host memory one process (node) may use for the offloaded
    state (``""``: unchecked); ``devices_per_host``: the devices that share it in ``--dry-run``
    (a real run uses its local device count). ``nvme_path``: ZeRO-Infinity's NVMe tier: a folder
    (a fast local disk) where the offloaded optimizer state lives instead of host memory, read and
    written leaf by leaf inside each step (:mod:`jaxcolossal.train.nvme`); needs
    ``optimizer_device=device``."""

    placement_policy: Literal["static", "auto"] = "static"
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    optimizer_device: Literal["device", "host"] = "device"
    activations: Literal["none", "host"] = "none"
    device_memory_limit: Bytes = ""
    host_memory_limit: Bytes = ""
    devices_per_host: int = 8
    nvme_path: str = ""


@dataclass
class Config:
    """The whole run: one object, validated before anything is compiled."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def to_dict(self) -> dict:
        """The config as nested plain dicts (YAML-serialisable)."""
        return dataclasses.asdict(self)


def yaml_list(values) -> str:
    """``[False, True, 'auto']`` as a user writes it: ``[false, true, auto]``."""
    return "[" + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values) + "]"


def gib(x: float) -> str:
    """Bytes in the unit that shows them: ``141.00 GiB``, ``27.41 MiB``, ``1.00 KiB``, ``12 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"
