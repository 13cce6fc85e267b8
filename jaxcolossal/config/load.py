"""Loading a config: YAML files and ``section.key=value`` overrides, with a "did you mean" for a
misspelt key, path expansion, and validation (:func:`jaxcolossal.config.checks.validate`).

Example::

    cfg = load_config("configs/llama_tiny.yaml", overrides=["parallel.zero_stage=3"])
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxcolossal.config.checks import validate
from jaxcolossal.config.schema import AutoFloat, Bytes, Config, StepRange, parse_bytes, parse_step_range, yaml_list
from jaxcolossal.errors import ConfigError, ConfigFileNotFoundError

PATH_KEYS = ("model.init_from", "data.corpus", "data.tokenizer", "data.cache_dir", "checkpoint.dir",
             "checkpoint.local_dir", "logging.run_dir", "offload.nvme_path")
"""Keys holding file-system paths: ``~`` and ``$VAR``/``${VAR}`` are expanded in :func:`expand_paths`."""


NUMBER_LIST_KEYS = ("posttrain.reward_weights", "posttrain.loss_weights", "model.rope.short_factor",
                    "model.rope.long_factor")
"""String keys that hold comma-separated numbers: a YAML number or list is taken as that string."""

NAME_LIST_KEYS = ("model.layer_types", "posttrain.loss_type")
"""String keys that hold comma-separated names: a YAML list of strings is taken as that string."""


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a dataclass field annotation; ints are accepted for floats, and so
    are strings that spell a number (PyYAML reads ``1e-4``, without a dot, as a string)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"{path}={value!r}: allowed values are {yaml_list(allowed)}")
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
    if annotation is AutoFloat:  # "auto", or a number kept as a float
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
                isinstance(value, str) and not _looks_float(value)):
            raise ConfigError(f"{path}={value!r}: expected a number or auto")
        return float(value)
    if annotation is Bytes:
        parse_bytes(value, path)
        return "" if value is None else str(value)
    if annotation is StepRange:  # kept as "A-B", "A" or "" (none)
        steps = parse_step_range(value, path)
        return "" if steps is None else str(steps[0]) if steps[0] == steps[1] else f"{steps[0]}-{steps[1]}"
    if annotation is str:
        if value is None:
            return ""
        if path in NUMBER_LIST_KEYS and isinstance(value, (int, float, list)) and not isinstance(value, bool):
            return ",".join(str(v) for v in (value if isinstance(value, list) else [value]))
        if path in NAME_LIST_KEYS and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return ",".join(value)
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r}: expected a string")
        return value
    raise TypeError(f"unsupported annotation {annotation} for {path}")


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
    "use_wandb": "logging.wandb", "enable_wandb": "logging.wandb", "project": "logging.wandb_project",
    "profiler_steps": "logging.profile_steps", "enable_profiling": "logging.profile_steps",
    "profile": "logging.profile_steps",
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
    _derive_head(cfg, raw)
    validate(cfg)
    return cfg


def _derive_head(cfg: Config, raw: dict) -> None:
    """``model.num_labels`` 1 (the score head) for ``training.objective=reward`` when the YAML and the
    overrides leave it unset (an explicit value is checked, not replaced)."""
    if cfg.training.objective == "reward" and "num_labels" not in (raw.get("model") or {}):
        cfg.model.num_labels = 1


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply overrides.

    Raises:
        ConfigFileNotFoundError: the YAML file does not exist (a ``ConfigError`` and a ``FileNotFoundError``).
        ConfigError: the file is not valid YAML (line and column), or see :func:`config_from_dict`.
    """
    raw = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigFileNotFoundError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from None
    cfg = config_from_dict(raw, overrides)
    if path is not None:
        cfg.source = str(path.resolve())
    return cfg
