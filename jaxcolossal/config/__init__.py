"""Configuration: the schema (dataclasses), loading (YAML and ``key=value`` overrides),
validation, the pure functions of a config that later stages share, and the reference of every
key (:func:`field_docs`, read from the attribute docstrings beside the schema's fields).

The sections and key names follow Colossal-AI's config vocabulary (``model``, ``training``,
``parallel``, ``precision``, plus ``data``, ``checkpoint``, ``logging`` and ``offload``). Every
check here runs before anything is compiled: unknown keys, wrong types and impossible
combinations raise :class:`ConfigError`, whose message names the key and the allowed values.

Example::

    cfg = load_config("configs/llama_tiny.yaml", overrides=["parallel.zero_stage=3"])
    cfg.parallel.resolve(num_devices=8)   # fills -1 sizes, checks the product
"""

from jaxcolossal.config.checks import validate
from jaxcolossal.config.derived import (
                                        BYTES_PER_PARAM,
                                        COMPUTE_DTYPES,
                                        FP8_RECIPE,
                                        WIRE_BYTES,
                                        attention_kernel,
                                        double_buffers_loops,
                                        pipeline_microbatches,
                                        precision_label,
                                        prefetches_weights,
                                        reduces_layerwise,
                                        weight_gather_dtype,
)
from jaxcolossal.config.load import (
                                        ALIASES,
                                        PATH_KEYS,
                                        all_keys,
                                        config_from_dict,
                                        expand_path,
                                        expand_paths,
                                        load_config,
                                        parse_overrides,
)
from jaxcolossal.config.ranges import RANGES, Range, check_ranges
from jaxcolossal.config.reference import config_help, config_reference_markdown, field_docs
from jaxcolossal.config.restart import keep_global_batch, resume_on_restart
from jaxcolossal.config.schema import (
                                        Bytes,
                                        CheckpointConfig,
                                        Config,
                                        DataConfig,
                                        FaultToleranceConfig,
                                        LoggingConfig,
                                        LoraConfig,
                                        ModelConfig,
                                        OffloadConfig,
                                        ParallelConfig,
                                        PosttrainConfig,
                                        PrecisionConfig,
                                        RopeConfig,
                                        StepRange,
                                        TrainingConfig,
                                        gib,
                                        parse_bytes,
                                        parse_step_range,
)
from jaxcolossal.errors import ConfigError

__all__ = [
    "ALIASES", "BYTES_PER_PARAM", "COMPUTE_DTYPES", "FP8_RECIPE", "PATH_KEYS", "RANGES", "WIRE_BYTES", "Bytes", "CheckpointConfig",
    "attention_kernel", "config_help", "config_reference_markdown", "double_buffers_loops", "field_docs",
    "Config", "ConfigError", "DataConfig", "FaultToleranceConfig", "LoggingConfig", "LoraConfig", "RopeConfig", "ModelConfig", "OffloadConfig", "ParallelConfig", "PosttrainConfig",
    "PrecisionConfig", "Range", "TrainingConfig", "all_keys", "check_ranges", "config_from_dict", "expand_path",
    "expand_paths", "gib", "load_config", "parse_bytes", "parse_overrides", "parse_step_range", "StepRange", "pipeline_microbatches", "precision_label",
    "prefetches_weights",
    "reduces_layerwise", "validate", "weight_gather_dtype", "keep_global_batch", "resume_on_restart",
]
