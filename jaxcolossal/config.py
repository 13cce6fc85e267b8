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
import math
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
    remat: Literal["none", "full", "dots"] = "none"
    attention_impl: Literal["xla", "cudnn"] = "xla"
    init_from: str = ""

    @property
    def head_dim(self) -> int:
        """``hidden_size / num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads


@dataclass
class TrainingConfig:
    """Optimisation schedule. ``batch_size`` is global (sequences per optimizer step).

    ``micro_batch_size`` (Colossal-AI's per-rank micro batch), when > 0, defines the global
    batch instead: ``batch_size = micro_batch_size × gradient_accumulation_steps × dp``, set
    when the config is validated against a device count.
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
    max_grad_norm: float = 1.0
    seed: int = 1024
    eval_every: int = 100
    eval_batches: int = 8
    resume: bool = False
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
    """

    data_parallel_size: int = -1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    zero_stage: Literal[0, 1, 2, 3] = 0
    num_microbatches: int = 0
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    num_model_chunks: int = 1

    def resolve(self, num_devices: int) -> "ParallelConfig":
        """Return a copy with ``-1`` filled so that dp·tp·pp == ``num_devices``.

        Raises:
            ConfigError: if the sizes cannot multiply to ``num_devices``.
        """
        sizes = {
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
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
                raise ConfigError(
                    f"parallel.{unknown[0]}=-1: the other sizes multiply to {known}, "
                    f"which does not divide the {num_devices} devices; choose sizes whose product divides "
                    f"{num_devices} (e.g. parallel.tensor_parallel_size=1 on a single device)")
            sizes[unknown[0]] = num_devices // known
        product = math.prod(sizes.values())
        if product != num_devices:
            raise ConfigError(
                "parallel: data_parallel_size × tensor_parallel_size × pipeline_parallel_size = "
                f"{sizes['data_parallel_size']}×{sizes['tensor_parallel_size']}×"
                f"{sizes['pipeline_parallel_size']} = {product}, but there are {num_devices} devices")
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
    or comma-separated globs of ``.txt``/``.jsonl`` files."""

    corpus: str = "stdlib"
    text_key: str = "text"
    tokenizer: Literal["byte"] = "byte"
    val_fraction: float = 0.05
    max_corpus_bytes: int = 0


@dataclass
class CheckpointConfig:
    """Orbax checkpoints under ``dir`` every ``save_every`` steps (0: only at the end)."""

    dir: str = ""
    save_every: int = 0
    max_to_keep: int = 3


@dataclass
class LoggingConfig:
    """Where ``metrics.jsonl`` and the log file go; ``log_every`` in steps."""

    run_dir: str = "runs/default"
    log_every: int = 10
    progress_bar: bool = True


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

    def to_dict(self) -> dict:
        """The config as nested plain dicts (YAML-serialisable)."""
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a dataclass field annotation; ints are accepted for floats."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed or type(value) is not type(allowed[0]):
            raise ConfigError(f"{path}={value!r}: allowed values are {list(allowed)}")
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
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r}: expected a number")
        return float(value)
    if annotation is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r}: expected a string")
        return value
    raise TypeError(f"unsupported annotation {annotation} for {path}")


def _build(cls: type, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(repr(prefix + '.' + k if prefix else k) for k in unknown)} "
            f"in {where}; allowed keys: {sorted(fields)}")
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
    (``3`` → int, ``1e-4`` → float, ``true`` → bool)."""
    parsed = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        key, text = item.split("=", 1)
        value = yaml.safe_load(text) if text else ""
        if isinstance(value, str) and _looks_float(value):
            value = float(value)
        parsed.append((key.strip(), value))
    return parsed


def _looks_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def config_from_dict(raw: dict, overrides: list[str] | None = None) -> Config:
    """Build and validate a :class:`Config` from a nested dict plus overrides.

    Raises:
        ConfigError: unknown keys, wrong types, or impossible combinations.
    """
    raw = yaml.safe_load(yaml.safe_dump(raw or {}))  # deep copy, plain types
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply overrides.

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ConfigError: see :func:`config_from_dict`.
    """
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        raw = yaml.safe_load(path.read_text()) or {}
    return config_from_dict(raw, overrides)


# ----------------------------------------------------------------------------- validation


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Reject impossible combinations before anything is compiled.

    With ``num_devices`` also resolves the mesh and checks every divisibility that the
    sharding needs (heads by tp, hidden size by the ZeRO group, batch by the data group).

    Raises:
        ConfigError: naming the key(s) and the allowed values.
    """
    m, t, p, pr = cfg.model, cfg.training, cfg.parallel, cfg.precision
    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads,
        "model.num_key_value_heads": m.num_key_value_heads,
        "model.intermediate_size": m.intermediate_size, "model.vocab_size": m.vocab_size,
        "model.max_position_embeddings": m.max_position_embeddings,
        "model.vocab_pad_multiple": m.vocab_pad_multiple,
        "training.batch_size": t.batch_size, "training.seq_len": t.seq_len,
        "training.gradient_accumulation_steps": t.gradient_accumulation_steps,
        "training.max_steps": t.max_steps,
    }
    for k, v in positive.items():
        if v < 1:
            raise ConfigError(f"{k}={v}: must be >= 1")
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
    if t.micro_batch_size < 0:
        raise ConfigError(f"training.micro_batch_size={t.micro_batch_size}: must be >= 0 (0: use batch_size)")
    if t.micro_batch_size == 0 and t.batch_size % t.gradient_accumulation_steps:
        raise ConfigError(
            f"training.batch_size={t.batch_size} (global) is not divisible by "
            f"training.gradient_accumulation_steps={t.gradient_accumulation_steps}")
    if t.warmup_steps < 0:
        raise ConfigError(f"training.warmup_steps={t.warmup_steps}: must be >= 0")
    if pr.bf16 and pr.fp16:
        raise ConfigError("precision: bf16 and fp16 are both true; choose one (neither means fp32)")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction}: must be in [0, 1)")
    if p.num_model_chunks < 1:
        raise ConfigError(f"parallel.num_model_chunks={p.num_model_chunks}: must be >= 1")
    for k in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
        v = getattr(p, k)
        if v != -1 and v < 1:
            raise ConfigError(f"parallel.{k}={v}: must be a positive integer or -1 (the remaining devices)")
    tp = p.tensor_parallel_size
    if tp != -1:
        _check_tp(m, tp)
    if p.pipeline_parallel_size != -1:
        _check_pipeline(cfg, p.pipeline_parallel_size)
    if num_devices is not None:
        rp = p.resolve(num_devices)
        _check_tp(m, rp.tensor_parallel_size)
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
    if p.num_microbatches < 0:
        raise ConfigError(f"parallel.num_microbatches={p.num_microbatches}: must be >= 0 (0: the default)")
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
