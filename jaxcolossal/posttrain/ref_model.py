"""``posttrain.ref_model``: another model as the reference of DPO (and of GRPO with ``beta > 0``), TRL 1.16's
``ref_model`` argument of ``DPOTrainer``/``GRPOTrainer``.

The folder is either a Hugging Face model (``config.json`` + safetensors, read as ``model.init_from`` is:
:func:`jaxcolossal.models.hf_io.load_hf`) or one of our runs' ``checkpoint.dir`` (its newest step: the fp32
master weights of a bf16/fp16 run, a LoRA run's adapters merged into its base, as ``scripts/convert_hf.py``
exports it). Its architecture and vocabulary must be the policy's (:func:`check_ref_model`, before anything
compiles); its weights become the train state's frozen reference copy
(:func:`jaxcolossal.train.state.init_state`'s ``reference``), or with ``posttrain.precompute_ref_log_probs``
are read by the pass before training only.
"""

from __future__ import annotations

import os

import numpy as np

from jaxcolossal.checkpoint import CheckpointManager, step_dirs
from jaxcolossal.config import Config, ConfigError, ModelConfig, config_from_dict
from jaxcolossal.models.hf_io import config_from_hf, load_hf, model_mismatches, read_hf_config, repad_vocab
from jaxcolossal.models.layers.lora import merged_weights


def ref_model_kind(path: str) -> str:
    """``"hf"`` (a folder with ``config.json``) or ``"checkpoint"`` (a ``checkpoint.dir`` with steps).

    Raises:
        ConfigError: neither (one line naming ``posttrain.ref_model``)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    if os.path.isdir(path) and step_dirs(path):
        return "checkpoint"
    raise ConfigError(f"posttrain.ref_model={path!r} is neither a Hugging Face folder (config.json + safetensors) "
                      "nor a checkpoint.dir holding checkpoint steps")


def _checkpoint_model(path: str) -> tuple[ModelConfig, int]:
    """``(model section, step)`` of the newest step of the checkpoint folder ``path``, from its saved config."""
    ckpt = CheckpointManager(path)
    try:
        step = ckpt.latest_step()
        saved = ckpt.saved_config(step).get("model")
    finally:
        ckpt.close()
    if not saved:
        raise ConfigError(f"posttrain.ref_model={path!r}: checkpoint step {step} carries no saved config, so its "
                          "architecture can not be checked; export it with scripts/convert_hf.py and name that folder")
    cfg = config_from_dict({"model": {**saved, "init_from": ""}, "training": {"seq_len": 1}}).model
    return cfg, step


def ref_model_config(path: str) -> ModelConfig:
    """The model section of the reference folder ``path`` (:func:`ref_model_kind`'s two kinds)."""
    if ref_model_kind(path) == "hf":
        return config_from_hf(read_hf_config(path))
    return _checkpoint_model(path)[0]


def check_ref_model(cfg: Config) -> None:
    """``posttrain.ref_model`` against the policy (``cfg.model``), before anything compiles: a folder of
    one of the two kinds whose architecture keys and vocabulary equal the policy's
    (:func:`jaxcolossal.models.hf_io.model_mismatches`).

    Raises:
        ConfigError: one line, every mismatched key with both values."""
    path = cfg.posttrain.ref_model
    bad = model_mismatches(cfg.model, ref_model_config(path), "the reference")
    if bad:
        raise ConfigError(f"posttrain.ref_model={path!r} is not the policy's architecture and vocabulary: "
                          + "; ".join(bad))


def load_ref_model(cfg: Config, tp: int = 1) -> dict:
    """The reference's weights as a pure dict of fp32 numpy arrays in the layout of the policy's params
    (``param_layout(cfg.model, tp)``: the vocabulary padded for ``model.vocab_pad_multiple`` and ``tp``),
    for :func:`jaxcolossal.train.state.init_state`'s ``reference`` (which casts and shards them).

    Raises:
        ConfigError: :func:`check_ref_model`'s refusals."""
    check_ref_model(cfg)
    path = cfg.posttrain.ref_model
    if ref_model_kind(path) == "hf":
        _, params = load_hf(path, tp, vocab_pad_multiple=cfg.model.vocab_pad_multiple)
        return params
    model, _ = _checkpoint_model(path)
    ckpt = CheckpointManager(path)
    try:
        params, _ = ckpt.restore_params()
    finally:
        ckpt.close()
    if model.lora.enabled:  # W + (alpha/rank)·A·B, as PEFT's merge_and_unload
        params = merged_weights(params, model.lora)
    params = _as_fp32(params)
    return repad_vocab(params, cfg.model, tp)


def _as_fp32(tree):
    if isinstance(tree, dict):
        return {k: _as_fp32(v) for k, v in tree.items()}
    return np.asarray(tree, np.float32)
