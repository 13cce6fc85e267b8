"""LoRA adapters in Hugging Face PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``
(PEFT's ``save_pretrained`` of a ``LoraConfig`` on a ``LlamaForCausalLM``, ``DeepseekV3ForCausalLM``, ...),
out and in.

Keys and shapes, Hugging Face layer ``i`` and a target's module ``m`` (``self_attn.q_proj``,
``mlp.down_proj``, ``self_attn.kv_b_proj``, ... :data:`jaxcolossal.models.layers.lora.HF_MODULES`)::

    base_model.model.model.layers.{i}.{m}.lora_A.weight   [r, in_features]    <- wq_lora_a[i] [d, r] transposed
    base_model.model.model.layers.{i}.{m}.lora_B.weight   [out_features, r]   <- wq_lora_b[i] [r, h, q] flattened, transposed

with the projections' feature orders of :mod:`jaxcolossal.models.hf_io` (``q_proj``'s outputs as
``[heads, head_dim]``, ``o_proj``'s inputs likewise; a family whose module rows differ from its
weights' flattened outputs converts B as it converts the weights: ``Family.lora_b_to_hf`` /
``lora_b_from_hf``, DeepSeek's interleaved rotary rows and fused ``kv_a_proj_with_mqa`` /
``kv_b_proj``). Every stacked-layer group is written at its Hugging Face layers: a mixture of
experts' first dense layers (``dense_layers``) are layers ``0 .. first_k_dense - 1``, ``layers`` the
rest. ``peft.PeftModel.from_pretrained`` loads the folder onto the base ``transformers`` model with the
same logits (tested to 1e-5 of the largest).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
from safetensors import safe_open

from jaxcolossal.config import ConfigError, LoraConfig, ModelConfig
from jaxcolossal.models import get_family
from jaxcolossal.models.hf_io import raw_tensor, save_shared
from jaxcolossal.models.layers.lora import HF_MODULES, SUFFIX_A, SUFFIX_B, WEIGHTS, adapter_shapes_and_axes, fused

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
_MODULE_TO_TARGET = {m.rsplit(".", 1)[-1]: t for t, m in HF_MODULES.items()}  # q_proj -> q


def peft_config(lora: LoraConfig, base_model: str = "", targets: tuple[str, ...] | None = None) -> dict:
    """The ``adapter_config.json`` of ``lora`` (PEFT's ``LoraConfig`` fields, ``CAUSAL_LM``) on ``targets``
    (default ``lora.target_list``; :attr:`jaxcolossal.config.ModelConfig.lora_targets` for a model)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": [HF_MODULES[t].rsplit(".", 1)[-1] for t in (targets or lora.target_list)],
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
            "inference_mode": True}


FUSED = {"phi3": "Phi-3's fused qkv_proj and gate_up_proj"}
"""Architectures whose Hugging Face modules fuse projections that the adapters keep apart: a PEFT adapter
there is one low-rank pair per fused module, which separate q/k/v (gate/up) pairs are not."""


def check_peft_format(cfg: ModelConfig, what: str) -> None:
    """Refuse PEFT adapter files for an architecture of :data:`FUSED`, in one line naming the way out.

    Raises: ConfigError."""
    if cfg.hf_model_type in FUSED:
        raise ConfigError(f"{what}: {FUSED[cfg.hf_model_type]} hold one PEFT adapter each, not one per projection as "
                          "trained here: export the merged model (convert_hf.py --to-hf ... --merge-lora)")


def _hf_layers(cfg: ModelConfig) -> list[tuple[str, int]]:
    """``[(stacked-layer group, its first Hugging Face layer)]``: a mixture of experts' first dense layers
    (``dense_layers``, layers ``0 .. first_k_dense - 1``) when it has them, then ``layers``."""
    k = cfg.first_k_dense if cfg.moe else 0
    return ([("dense_layers", 0)] if k else []) + [("layers", k)]


def save_adapters(path: str | os.PathLike, cfg: ModelConfig, adapters: Any, base_model: str = "") -> list[str]:
    """Write ``adapters`` (``{group: {name: [L, ...]}}``, any float dtype, host or device arrays) as a
    PEFT folder at ``path``: fp32 tensors, PEFT's key names, every group at its Hugging Face layers.
    Returns the files written.

    Raises:
        ConfigError: an architecture whose modules fuse the adapted projections (:func:`check_peft_format`)."""
    check_peft_format(cfg, "PEFT adapters")
    os.makedirs(path, exist_ok=True)
    to_hf, r, tensors = get_family(cfg).lora_b_to_hf, cfg.lora.rank, {}
    for target in cfg.lora_targets:
        name, module = WEIGHTS[target], HF_MODULES[target]
        for group, first in _hf_layers(cfg):
            a = np.asarray(adapters[group][name + SUFFIX_A], np.float32)
            bs = {n: np.asarray(adapters[group][n + SUFFIX_B], np.float32) for n in fused(name)}
            for j in range(a.shape[0]):
                key = f"{PREFIX}{first + j}.{module}"
                parts = {n: b[j] for n, b in bs.items()}
                tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, r).T)
                b = to_hf(name, parts, cfg) if to_hf else parts[name].reshape(r, -1).T
                tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b)
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(cfg.lora, base_model, cfg.lora_targets), f, indent=2)
    save_shared(tensors, os.path.join(path, ADAPTER_WEIGHTS))
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def read_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """``model.lora`` settings from a PEFT folder's ``adapter_config.json`` (rank, alpha, dropout,
    targets; ``init_from`` = ``path``).

    Raises:
        ConfigError: no such file, not a LoRA adapter, or a PEFT feature this model does not have
            (DoRA, rsLoRA, biases, ``layers_to_transform``, a module that is no projection adapted here:
            :data:`jaxcolossal.models.layers.lora.HF_MODULES`).
    """
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise ConfigError(f"model.lora.init_from={str(path)!r}: no {ADAPTER_CONFIG} there (a PEFT adapter folder)")
    with open(file) as f:
        pc = json.load(f)
    unsupported = {"peft_type": pc.get("peft_type", "LORA") != "LORA", "use_dora": bool(pc.get("use_dora")),
                   "use_rslora": bool(pc.get("use_rslora")), "bias": pc.get("bias", "none") != "none",
                   "layers_to_transform": pc.get("layers_to_transform") is not None,
                   "modules_to_save": bool(pc.get("modules_to_save"))}
    bad = [k for k, v in unsupported.items() if v]
    modules = pc.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else modules
    unknown = [m for m in modules if m.rsplit(".", 1)[-1] not in _MODULE_TO_TARGET]
    if bad or unknown:
        unknown_line = f"target module(s) {unknown} are not projections adapted here ({sorted(_MODULE_TO_TARGET)})"
        raise ConfigError(f"model.lora.init_from={str(path)!r}: " + "; ".join(
            [f"{k}={pc[k]!r} is not supported" for k in bad] + [unknown_line] * bool(unknown)))
    targets = sorted({_MODULE_TO_TARGET[m.rsplit(".", 1)[-1]] for m in modules}, key=list(HF_MODULES).index)
    return LoraConfig(rank=int(pc["r"]), alpha=float(pc.get("lora_alpha", 8)), dropout=float(pc.get("lora_dropout", 0.0)),
                      targets=",".join(targets), init_from=str(path))


def _tensor(f, file: str, key: str) -> np.ndarray:
    try:
        return np.asarray(f.get_tensor(key), np.float32)
    except TypeError:  # bfloat16, which numpy cannot hold
        return raw_tensor(file, key)


def _read(path: str | os.PathLike) -> dict:
    """Every tensor of a PEFT folder's safetensors file, fp32 numpy.

    Raises: ConfigError: no such file."""
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise ConfigError(f"model.lora.init_from={str(path)!r}: no {ADAPTER_WEIGHTS} there")
    with safe_open(file, framework="np") as f:
        return {k: _tensor(f, file, k) for k in f.keys()}


def load_adapters(path: str | os.PathLike, cfg: ModelConfig) -> dict:
    """fp32 numpy adapters ``{group: {name: [L, ...]}}`` from a PEFT folder, in the layout of
    :func:`jaxcolossal.models.layers.lora.adapter_shapes_and_axes` for ``cfg`` (whose ``lora`` must be the
    folder's, :func:`read_adapter_config`), each Hugging Face layer into its stacked-layer group.

    Raises:
        ConfigError: a module this model does not have (``k_proj`` on DeepSeek's latent attention), a
            tensor missing or of the wrong shape (an adapter of another model), or an architecture whose
            modules fuse the adapted projections (:func:`check_peft_format`).
    """
    where = f"model.lora.init_from={str(path)!r}"
    check_peft_format(cfg, where)
    absent = [HF_MODULES[t].rsplit(".", 1)[-1] for t in cfg.lora_targets if t not in cfg.lora_target_choices]
    if absent:
        raise ConfigError(f"{where}: target module(s) {absent} are not in model.type={cfg.type} (its: "
                          f"{', '.join(HF_MODULES[t].rsplit('.', 1)[-1] for t in cfg.lora_target_choices)})")
    tensors, family, r = _read(path), get_family(cfg), cfg.lora.rank
    table = adapter_shapes_and_axes(cfg.lora, family.param_shapes_and_axes(cfg, cfg.vocab_size), cfg.lora_targets)
    out = {}
    for target in cfg.lora_targets:
        name, module = WEIGHTS[target], HF_MODULES[target]
        for group, first in _hf_layers(cfg):
            shapes = {n: table[group][n][0] for n in table[group]}
            want_a = (r, math.prod(shapes[name + SUFFIX_A][1:-1]))
            want_b = (sum(math.prod(shapes[n + SUFFIX_B][2:]) for n in fused(name)), r)
            a_rows, b_rows = [], []
            for i in range(first, first + shapes[name + SUFFIX_A][0]):
                key = f"{PREFIX}{i}.{module}"
                a, b = (tensors.get(f"{key}.{part}.weight") for part in ("lora_A", "lora_B"))
                if a is None or b is None:
                    raise ConfigError(f"{where}: {key}.{'lora_A' if a is None else 'lora_B'}.weight is missing")
                if a.shape != want_a or b.shape != want_b:
                    raise ConfigError(f"{where}: {key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this "
                                      f"model needs {want_a} and {want_b}")
                a_rows.append(a.T.reshape(*shapes[name + SUFFIX_A][1:]))
                b_rows.append(family.lora_b_from_hf(name, b, cfg) if family.lora_b_from_hf
                              else {name: b.T.reshape(shapes[name + SUFFIX_B][1:])})
            out.setdefault(group, {})[name + SUFFIX_A] = np.stack(a_rows).astype(np.float32)
            for n in fused(name):
                out[group][n + SUFFIX_B] = np.stack([parts[n] for parts in b_rows]).astype(np.float32)
    return out
