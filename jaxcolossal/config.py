"""Configuration: dataclasses, YAML loading with ``key=value`` overrides, validation.

The sections and key names follow Colossal-AI's config vocabulary (``model``, ``training``,
``parallel``, ``precision``, plus ``data``, ``checkpoint`` and ``logging``). Every check here
runs before anything is compiled: unknown keys, wrong types and impossible combinations raise
:class:`ConfigError`, whose message names the key and the allowed values.

Example::

    cfg = load_config("configs/llama_tiny.yaml", overrides=["parallel.zero_stage=3"])
    cfg.parallel.resolve(num_devices=8)   # fills -1 sizes, checks the product
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""


@dataclass
class ModelConfig:
    """LLaMA/GPT-2 shape. Names follow Hugging Face ``LlamaConfig``.

    ``init_from``: a local Hugging Face model directory (``config.json`` + safetensors) whose
    weights initialise the run.

    ``remat``: the activation-checkpointing policy of each layer, from least to most recompute:
    ``none``, ``selective`` (keeps every projection's output), ``save_qkv_proj``, ``dots``,
    ``full`` (:mod:`jaxcolossal.models.remat`); ``offload`` keeps what ``selective`` keeps, in host
    memory (``offload.activations=host`` sets it).

    ``loss_chunk_tokens``: tokens per device in one chunk of the fused LM head + cross-entropy
    (:func:`jaxcolossal.models.vocab.lm_head_loss`): a chunk's fp32 logits take
    ``loss_chunk_tokens × vocab/tp × 4`` bytes; 0 materializes the logits of all tokens.
    ``embedding_impl``: with the vocabulary split over tp, ``gather`` (Megatron's masked gather)
    or ``one_hot`` (a one-hot matmul, ``2·tokens·vocab·hidden/tp`` FLOPs; for comparison).

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

    @property
    def head_dim(self) -> int:
        """``hidden_size / num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads


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
    sample_prompt: str = "def "


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
    parallelism or gradient compression (:mod:`jaxcolossal.train.compression`).

    ``overlap`` (default true; Colossal-AI's ``overlap_communication``) and ``bucket_size_mb``
    (``reduce_bucket_size_in_m``; 0: XLA's default) set XLA's GPU flags for the latency-hiding
    scheduler, collective pipelining and combine thresholds before the backend starts
    (:mod:`jaxcolossal.xla_flags`; only on GPUs, only the flags the jaxlib accepts). Under ZeRO-3
    with ``model.remat=full`` (and fp32 communication, no param offload) ``overlap`` also makes the
    layer scan gather layer i+1's weights before layer i runs, forward and backward
    (:func:`jaxcolossal.models.remat.prefetched_scan`): one more layer's weights held per device.
    Under Megatron-SP (``split_gather``) ``overlap`` runs the projections as TP collective matmuls
    (:mod:`jaxcolossal.collective_matmul`) for sequences of at least ``collective_matmul_min_seq``
    tokens (default 0: all; no GPU has measured where it starts to pay).

    Sequence (context) parallelism, Colossal-AI's ``HybridParallelPlugin`` modes
    (:mod:`jaxcolossal.sequence`): ``sequence_parallel_size`` is the mesh axis ``sp`` (the
    sequence of every activation is split over it) and ``sequence_parallelism_mode`` is
    ``none``, ``split_gather`` (Megatron-SP: the residual stream's sequence split over the ``tp``
    group; needs ``tensor_parallel_size`` > 1 and ``sequence_parallel_size`` 1), ``all_to_all``
    (DeepSpeed-Ulysses: q/k/v swapped from sequence- to head-sharded around attention) or
    ``ring_attn`` (ring attention: k/v blocks passed around the ``sp`` ring, zig-zag order).
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
    (Colossal-AI's DynamicGradScaler defaults)."""

    bf16: bool = False
    fp16: bool = False
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
    Gemini placement and ``cpu_offload``; :mod:`jaxcolossal.placement`, docs/offload.md).

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


# ----------------------------------------------------------------------------- value ranges


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``lo``/``hi`` bounds (closed unless ``*_open``), plus
    ``special`` values outside them with the meaning given in ``note``. NaN and ±inf are never
    accepted."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    special: tuple = ()
    note: str = ""

    def contains(self, v: float) -> bool:
        """True when ``v`` is finite and inside the bounds, or one of ``special``."""
        if v in self.special:
            return True
        if not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def describe(self, what: str = "must be") -> str:
        """The bounds in words, e.g. ``must be > 0`` or ``must be in [0, 1)``."""
        if self.hi == math.inf:
            text = f"{what} {'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            text = (f"{what} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.hi_open else ']'}")
        return text + (f" ({self.note})" if self.note else "")


_POS = Range(1)                      # a count or a size: 1, 2, ...
_NONNEG = Range(0)
_GT0 = Range(0, lo_open=True)        # a strictly positive real
_MESH = Range(1, special=(-1,), note="or -1: the remaining devices")
_BETA = Range(0, 1, hi_open=True)

RANGES: dict[str, Range] = {
    "model.num_layers": _POS, "model.hidden_size": _POS, "model.num_attention_heads": _POS,
    "model.num_key_value_heads": _POS, "model.intermediate_size": _POS,
    "model.max_position_embeddings": _POS, "model.vocab_size": _POS, "model.vocab_pad_multiple": _POS,
    "model.rms_norm_eps": _GT0, "model.layer_norm_eps": _GT0, "model.rope_theta": _GT0,
    "model.initializer_range": _GT0,
    "model.loss_chunk_tokens": Range(0, note="0: materialize the logits of all tokens"),
    "training.batch_size": _POS, "training.micro_batch_size": Range(0, note="0: use batch_size"),
    "training.seq_len": _POS, "training.gradient_accumulation_steps": _POS,
    "training.learning_rate": _GT0, "training.min_learning_rate_ratio": Range(0, 1),
    "training.max_steps": _POS, "training.warmup_steps": _NONNEG, "training.weight_decay": _NONNEG,
    "training.adam_beta1": _BETA, "training.adam_beta2": _BETA, "training.adam_eps": _GT0,
    "training.adam_freeze_step": Range(0, note="0: never; else Adam's variance is frozen after that many steps"),
    "training.max_grad_norm": Range(0, note="0: no clipping"), "training.seed": Range(0, 2**32 - 1),
    "training.eval_every": Range(0, note="0: only at the start and the end"),
    "training.eval_batches": _POS, "training.sample_tokens": Range(0, note="0: no sample"),
    "parallel.data_parallel_size": _MESH, "parallel.tensor_parallel_size": _MESH,
    "parallel.pipeline_parallel_size": _MESH, "parallel.sequence_parallel_size": _MESH,
    "parallel.num_microbatches": Range(0, note="0: the default"), "parallel.num_model_chunks": _POS,
    "parallel.compression_ratio": Range(0, 1, lo_open=True), "parallel.powersgd_rank": _POS,
    "parallel.collective_matmul_min_seq": Range(0, note="0: every sequence length"),
    "parallel.compression_warmup_steps": Range(0, note="0: compress from the first step"),
    "parallel.bucket_size_mb": Range(0, note="0: XLA's default thresholds"),
    "precision.initial_scale": _GT0, "precision.growth_factor": Range(1),
    "precision.backoff_factor": Range(0, 1, lo_open=True), "precision.growth_interval": _POS,
    "precision.hysteresis": _POS, "precision.min_scale": _GT0, "precision.max_scale": _GT0,
    "precision.max_consecutive_skips": _POS,
    "data.val_fraction": Range(0, 1, hi_open=True), "data.max_corpus_bytes": Range(0, note="0: all of it"),
    "checkpoint.save_every": Range(0, note="0: only at evaluations and the end"), "checkpoint.max_to_keep": _POS,
    "logging.log_every": _POS,
    "offload.offload_optim_frac": Range(0, 1), "offload.offload_param_frac": Range(0, 1),
    "offload.devices_per_host": _POS,
}
"""Every numeric (int or float) key and the values it accepts, checked by :func:`validate`."""

PATH_KEYS = ("model.init_from", "data.corpus", "data.tokenizer", "data.cache_dir", "checkpoint.dir",
             "logging.run_dir", "offload.nvme_path")
"""Keys holding file-system paths: ``~`` and ``$VAR``/``${VAR}`` are expanded in :func:`expand_paths`."""


# ----------------------------------------------------------------------------- loading


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a dataclass field annotation; ints are accepted for floats, and so
    are strings that spell a number (PyYAML reads ``1e-4``, without a dot, as a string)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"{path}={value!r}: allowed values are {_yaml_list(allowed)}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r}: expected true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r}: expected an integer")
        return value
    if annotation is float:
        if isinstance(value, str) and _looks_float(value):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r}: expected a number")
        return float(value)
    if annotation is Bytes:
        parse_bytes(value, path)
        return "" if value is None else str(value)
    if annotation is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r}: expected a string")
        return value
    raise TypeError(f"unsupported annotation {annotation} for {path}")


def _yaml_list(values) -> str:
    """``[False, True, 'auto']`` as a user writes it: ``[false, true, auto]``."""
    return "[" + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values) + "]"


def all_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config (``model.num_layers``, ...), in declaration order."""
    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        out += all_keys(hints[f.name], path) if dataclasses.is_dataclass(hints[f.name]) else [path]
    return out


ALIASES = {
    "tp": "parallel.tensor_parallel_size", "tp_size": "parallel.tensor_parallel_size",
    "pp": "parallel.pipeline_parallel_size", "pp_size": "parallel.pipeline_parallel_size",
    "dp": "parallel.data_parallel_size", "dp_size": "parallel.data_parallel_size",
    "sp": "parallel.sequence_parallel_size", "sp_size": "parallel.sequence_parallel_size",
    "context_parallel_size": "parallel.sequence_parallel_size", "ici_context_parallelism": "parallel.sequence_parallel_size",
    "zero": "parallel.zero_stage", "stage": "parallel.zero_stage", "lr": "training.learning_rate",
    "microbatch_size": "training.micro_batch_size", "grad_accum": "training.gradient_accumulation_steps",
    "accumulation_steps": "training.gradient_accumulation_steps", "max_norm": "training.max_grad_norm",
    "clip_grad": "training.max_grad_norm", "steps": "training.max_steps",
    "remat_policy": "model.remat", "gradient_checkpointing": "model.remat",
    "num_vocab_tiling": "model.loss_chunk_tokens", "loss_chunk_size": "model.loss_chunk_tokens",
    "cpu_offload": "offload.offload_optim_frac", "offload_optimizer": "offload.offload_optim_frac",
    "memory_limit": "offload.device_memory_limit", "nvme_offload_dir": "offload.nvme_path",
    "text_field": "data.text_key", "dataset_text_field": "data.text_key", "tensorboard_dir": "logging.tensorboard",
}
"""Names used by Colossal-AI, DeepSpeed or MaxText for our keys, for the "did you mean" hint."""


def _did_you_mean(key: str) -> str:
    """``; did you mean 'parallel.zero_stage'?`` for a misspelt or misplaced key, else ``""``:
    the same name in another section first, then the closest spelling."""
    keys = all_keys()
    leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}
    leaf = key.rsplit(".", 1)[-1]
    guess = [ALIASES[leaf]] if leaf in ALIASES else difflib.get_close_matches(key, keys, n=1, cutoff=0.75) or \
        [leaves[g] for g in difflib.get_close_matches(leaf, list(leaves), n=1)]
    return f"; did you mean {guess[0]!r}?" if guess else ""


def _build(cls: type, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        full = [prefix + "." + k if prefix else k for k in unknown]
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in full)} "
            f"in {where}{_did_you_mean(str(full[0]))}; allowed keys: {sorted(fields)}")
    kwargs = {}
    for name, value in raw.items():
        path = f"{prefix}.{name}" if prefix else name
        ann = hints[name]
        if dataclasses.is_dataclass(ann):
            kwargs[name] = _build(ann, value or {}, path)
        else:
            kwargs[name] = _coerce(path, value, ann)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """Parse ``section.key=value`` strings; values are read as YAML scalars
    (``3`` → int, ``true`` → bool; ``1e-4`` becomes a float where the key is a number)."""
    parsed = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_problem(e)})") from None
        parsed.append((key.strip(), value))
    return parsed


def _yaml_problem(e: Exception) -> str:
    """PyYAML's error in one line: what is wrong, and where (line and column, 1-based)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or e}{where}"


def _looks_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


_UNSET_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_path(key: str, value: str) -> str:
    """``~`` and ``$VAR``/``${VAR}`` expanded in one path (or comma-separated globs for
    ``data.corpus``; ``stdlib`` stays as it is).

    Raises:
        ConfigError: naming the key, when a variable in the path is not set.
    """
    parts = value.split(",") if key == "data.corpus" else [value]
    out = []
    for part in parts:
        part = part.strip() if key == "data.corpus" else part
        expanded = os.path.expandvars(os.path.expanduser(part))
        unset = _UNSET_VAR.search(expanded)
        if unset:
            raise ConfigError(f"{key}={value!r}: the environment variable {unset.group(1).strip('{}')} is not set")
        out.append(expanded)
    return ",".join(out)


def expand_paths(cfg: "Config") -> None:
    """Expand every key of :data:`PATH_KEYS` in place (the one place where paths are expanded)."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        obj = getattr(cfg, section)
        setattr(obj, name, expand_path(key, getattr(obj, name)))


def config_from_dict(raw: dict, overrides: list[str] | None = None) -> Config:
    """Build and validate a :class:`Config` from a nested dict plus overrides.

    Raises:
        ConfigError: unknown keys, wrong types, or impossible combinations.
    """
    raw = yaml.safe_load(yaml.safe_dump(raw or {}))  # deep copy, plain types
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    cfg = _build(Config, raw, "")
    expand_paths(cfg)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply overrides.

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ConfigError: the file is not valid YAML (line and column), or see :func:`config_from_dict`.
    """
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from None
    return config_from_dict(raw, overrides)


# ----------------------------------------------------------------------------- validation


def check_ranges(cfg: Config) -> None:
    """Check every key of :data:`RANGES` (NaN and ±inf are refused everywhere).

    Raises:
        ConfigError: ``section.key=value: must be ...``.
    """
    for key, rng in RANGES.items():
        section, name = key.split(".")
        v = getattr(getattr(cfg, section), name)
        if not rng.contains(v):
            raise ConfigError(f"{key}={v!r}: {rng.describe('must be' if math.isfinite(v) else 'must be a finite number')}")


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Reject impossible combinations before anything is compiled.

    With ``num_devices`` also resolves the mesh and checks every divisibility that the
    sharding needs (heads by tp, hidden size by the ZeRO group, batch by the data group).

    Raises:
        ConfigError: naming the key(s) and the allowed values.
    """
    m, t, p, pr = cfg.model, cfg.training, cfg.parallel, cfg.precision
    check_ranges(cfg)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_key_value_heads={m.num_key_value_heads} (grouped-query attention)")
    if m.head_dim % 2:
        raise ConfigError(f"head_dim = hidden_size / num_attention_heads = {m.head_dim} must be even for RoPE")
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"training.seq_len={t.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    if t.micro_batch_size == 0 and t.batch_size % t.gradient_accumulation_steps:
        raise ConfigError(
            f"training.batch_size={t.batch_size} (global) is not divisible by "
            f"training.gradient_accumulation_steps={t.gradient_accumulation_steps}")
    if pr.bf16 and pr.fp16:
        raise ConfigError("precision: bf16 and fp16 are both true; choose one (neither means fp32)")
    if pr.min_scale > pr.max_scale:
        raise ConfigError(f"precision.min_scale={pr.min_scale:g} is above precision.max_scale={pr.max_scale:g}")
    if cfg.data.tokenizer == "auto":  # resolved here, once: everything after sees a concrete tokenizer
        init = cfg.model.init_from
        cfg.data.tokenizer = init if init and os.path.isfile(os.path.join(init, "tokenizer.json")) else "byte"
    tok = cfg.data.tokenizer
    if tok != "byte" and not (os.path.isfile(tok) or any(os.path.isfile(os.path.join(tok, f))
                                                         for f in ("tokenizer.json", "tokenizer.model"))):
        raise ConfigError(f"data.tokenizer={tok!r}: expected 'byte' or a tokenizer folder holding tokenizer.json "
                          "(Hugging Face) or tokenizer.model (SentencePiece), or that file; "
                          + ("the folder has no tokenizer.json" if os.path.isdir(tok) else "no such file or folder"))
    if cfg.data.format == "chat" and cfg.data.corpus == "stdlib":
        raise ConfigError("data.format=chat needs data.corpus: JSON-lines files of conversations "
                          "({'messages': [...]} or {'prompt', 'response'} per line)")
    if cfg.data.packing_mask and cfg.data.format == "chat":
        raise ConfigError("data.packing_mask=true applies to the pre-training formats, not data.format=chat "
                          "(a chat row holds one conversation)")
    if cfg.data.format in ("parquet", "datasets", "jsonl") and cfg.data.corpus == "stdlib":
        raise ConfigError(f"data.format={cfg.data.format} needs data.corpus: the files (or, for datasets, "
                          "the saved folder) to read")
    if m.attention_impl == "flash" and p.pipeline_parallel_size not in (1,):
        raise ConfigError("model.attention_impl=flash is not supported with pipeline parallelism yet (the Pallas "
                          "kernel inside the pipeline's shard_map): use xla"
                          + ("" if p.sequence_parallelism_mode == "ring_attn" else " or cudnn")
                          + ", or pipeline_parallel_size=1")
    if cfg.data.packing_mask and m.attention_impl == "cudnn":
        raise ConfigError("data.packing_mask=true needs model.attention_impl xla or flash (segment ids), not 'cudnn'")
    if cfg.data.packing_mask and p.pipeline_parallel_size not in (1,):
        raise ConfigError("data.packing_mask=true is not supported with pipeline parallelism yet: "
                          "set parallel.pipeline_parallel_size=1")
    if cfg.data.format == "chat" and p.pipeline_parallel_size not in (1,):
        raise ConfigError("data.format=chat (a loss mask) is not supported with pipeline parallelism yet: "
                          "set parallel.pipeline_parallel_size=1")
    if t.resume is not False and not cfg.checkpoint.dir:
        raise ConfigError(f"training.resume={_yaml_list([t.resume])[1:-1]} needs checkpoint.dir (the folder to "
                          "resume from)")
    _check_offload(cfg)
    _check_compression(p)
    _check_freeze(cfg)
    _check_momentum_correction(cfg)
    _check_sequence(cfg, p)
    tp = p.tensor_parallel_size
    if tp != -1:
        _check_tp(m, tp)
    if p.pipeline_parallel_size != -1:
        _check_pipeline(cfg, p.pipeline_parallel_size)
    if num_devices is not None:
        rp = p.resolve(num_devices)
        _check_tp(m, rp.tensor_parallel_size)
        _check_sequence(cfg, rp)
        dp = rp.data_parallel_size
        if t.micro_batch_size:
            t.batch_size = t.micro_batch_size * t.gradient_accumulation_steps * dp
        micro = t.batch_size // t.gradient_accumulation_steps
        if micro % dp:
            raise ConfigError(
                f"the microbatch of training.batch_size / gradient_accumulation_steps = {micro} sequences "
                f"is not divisible by the data-parallel size {dp}")
        if rp.pipeline_parallel_size > 1:
            _check_pipeline(cfg, rp.pipeline_parallel_size)
            mb = pipeline_microbatches(cfg, rp.pipeline_parallel_size)
            if t.batch_size % (dp * mb):
                raise ConfigError(
                    f"training.batch_size={t.batch_size} does not split into parallel.num_microbatches={mb} "
                    f"pipeline microbatches per data-parallel shard (data_parallel_size={dp}): "
                    f"it must be divisible by {dp} × {mb} = {dp * mb}")
        if p.zero_stage > 0 and m.hidden_size % dp:
            raise ConfigError(
                f"parallel.zero_stage={p.zero_stage} shards the hidden dimension over the data-parallel "
                f"group: model.hidden_size={m.hidden_size} is not divisible by data_parallel_size={dp}")


def _check_sequence(cfg: Config, p: ParallelConfig) -> None:
    """Sequence parallelism against the model and the other sizes (:mod:`jaxcolossal.sequence`).
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
    :class:`ParallelConfig`; the ratio's and rank's ranges are in :data:`RANGES`)."""
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


def pipeline_microbatches(cfg: Config, pp: int) -> int:
    """Pipeline microbatches per step for ``pp`` stages (see docs/pipeline.md).

    With pipeline parallelism the pipeline microbatches *replace* gradient accumulation: the
    batch of a step is split into ``m`` microbatches that flow through the stages. ``m`` is
    ``parallel.num_microbatches`` when set, else ``training.gradient_accumulation_steps`` when
    that is above 1, else ``2 · pp``.
    """
    p, t = cfg.parallel, cfg.training
    if p.num_microbatches > 0:
        return p.num_microbatches
    if t.gradient_accumulation_steps > 1:
        return t.gradient_accumulation_steps
    return 2 * pp


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
