"""LoRA adapters in Hugging Face PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``
(PEFT's ``save_pretrained`` of a ``LoraConfig`` on a ``LlamaForCausalLM``), out and in.

Keys and shapes, layer ``i`` and a target's module ``m`` (``self_attn.q_proj``, ``mlp.down_proj``,
... :data:`jaxcolossal.models.layers.lora.HF_MODULES`)::

    base_model.model.model.layers.{i}.{m}.lora_A.weight   [r, in_features]    <- wq_lora_a[i] [d, r] transposed
    base_model.model.model.layers.{i}.{m}.lora_B.weight   [out_features, r]   <- wq_lora_b[i] [r, h, q] flattened, transposed

with the projections' feature orders of :mod:`jaxcolossal.models.hf_io` (``q_proj``'s outputs as
``[heads, head_dim]``, ``o_proj``'s inputs likewise). ``peft.PeftModel.from_pretrained`` loads the
folder onto the base ``transformers`` model with the same logits (tested to 1e-4).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from safetensors import safe_open

from jaxcolossal.config import ConfigError, LoraConfig, ModelConfig
from jaxcolossal.models.hf_io import raw_tensor, save_shared
from jaxcolossal.models.layers.lora import HF_MODULES, SUFFIX_A, SUFFIX_B, WEIGHTS

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
_MODULE_TO_TARGET = {m.rsplit(".", 1)[-1]: t for t, m in HF_MODULES.items()}  # q_proj -> q


def peft_config(lora: LoraConfig, base_model: str = "") -> dict:
    """The ``adapter_config.json`` of ``lora`` (PEFT's ``LoraConfig`` fields, ``CAUSAL_LM``)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": [HF_MODULES[t].rsplit(".", 1)[-1] for t in lora.target_list],
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


def save_adapters(path: str | os.PathLike, cfg: ModelConfig, adapters: Any, base_model: str = "") -> list[str]:
    """Write ``adapters`` (``{"layers": {name: [L, ...]}}``, any float dtype, host or device
    arrays) as a PEFT folder at ``path``: fp32 tensors, PEFT's key names. Returns the files written.

    Raises:
        ConfigError: an architecture whose modules fuse the adapted projections (:func:`check_peft_format`)."""
    check_peft_format(cfg, "PEFT adapters")
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for target in cfg.lora.target_list:
        name, module = WEIGHTS[target], HF_MODULES[target]
        a = np.asarray(adapters["layers"][name + SUFFIX_A], np.float32)
        b = np.asarray(adapters["layers"][name + SUFFIX_B], np.float32)
        for i in range(cfg.num_layers):
            key = f"{PREFIX}{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, cfg.lora.rank).T)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(cfg.lora.rank, -1).T)
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(cfg.lora, base_model), f, indent=2)
    save_shared(tensors, os.path.join(path, ADAPTER_WEIGHTS))
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def read_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """``model.lora`` settings from a PEFT folder's ``adapter_config.json`` (rank, alpha, dropout,
    targets; ``init_from`` = ``path``).

    Raises:
        ConfigError: no such file, not a LoRA adapter, or a PEFT feature this model does not have
            (DoRA, rsLoRA, biases, ``layers_to_transform``, a module that is not a LLaMA projection).
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
        raise ConfigError(f"model.lora.init_from={str(path)!r}: " + "; ".join(
            [f"{k}={pc[k]!r} is not supported" for k in bad] + [f"target module(s) {unknown} are not LLaMA "
                                                                 f"projections ({sorted(_MODULE_TO_TARGET)})"] * bool(unknown)))
    targets = sorted({_MODULE_TO_TARGET[m.rsplit(".", 1)[-1]] for m in modules}, key=list(HF_MODULES).index)
    return LoraConfig(rank=int(pc["r"]), alpha=float(pc.get("lora_alpha", 8)), dropout=float(pc.get("lora_dropout", 0.0)),
                      targets=",".join(targets), init_from=str(path))


def _tensor(f, file: str, key: str) -> np.ndarray:
    try:
        return np.asarray(f.get_tensor(key), np.float32)
    except TypeError:  # bfloat16, which numpy cannot hold
        return raw_tensor(file, key)


def load_adapters(path: str | os.PathLike, cfg: ModelConfig) -> dict:
    """fp32 numpy adapters ``{"layers": {name: [L, ...]}}`` from a PEFT folder, in the layout of
    :func:`jaxcolossal.models.layers.lora.adapter_shapes_and_axes` for ``cfg`` (whose ``lora`` must be the
    folder's, :func:`read_adapter_config`).

    Raises:
        ConfigError: a tensor missing or of the wrong shape (an adapter of another model), or an
            architecture whose modules fuse the adapted projections (:func:`check_peft_format`).
    """
    check_peft_format(cfg, f"model.lora.init_from={str(path)!r}")
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise ConfigError(f"model.lora.init_from={str(path)!r}: no {ADAPTER_WEIGHTS} there")
    with safe_open(file, framework="np") as f:
        tensors = {k: _tensor(f, file, k) for k in f.keys()}
    present, get, r, out = set(tensors), tensors.__getitem__, cfg.lora.rank, {}
    shapes = {"wq": (cfg.num_attention_heads, cfg.head_dim), "wk": (cfg.num_key_value_heads, cfg.head_dim),
              "wv": (cfg.num_key_value_heads, cfg.head_dim), "wo": (cfg.hidden_size,),
              "w_gate": (cfg.intermediate_size,), "w_up": (cfg.intermediate_size,), "w_down": (cfg.hidden_size,)}
    ins = {"wq": (cfg.hidden_size,), "wk": (cfg.hidden_size,), "wv": (cfg.hidden_size,),
           "wo": (cfg.num_attention_heads, cfg.head_dim), "w_gate": (cfg.hidden_size,), "w_up": (cfg.hidden_size,),
           "w_down": (cfg.intermediate_size,)}
    for target in cfg.lora.target_list:
        name, module = WEIGHTS[target], HF_MODULES[target]
        a_rows, b_rows = [], []
        for i in range(cfg.num_layers):
            key = f"{PREFIX}{i}.{module}"
            for part in ("lora_A", "lora_B"):
                if f"{key}.{part}.weight" not in present:
                    raise ConfigError(f"model.lora.init_from={str(path)!r}: {key}.{part}.weight is missing")
            a, b = get(f"{key}.lora_A.weight"), get(f"{key}.lora_B.weight")
            want_a, want_b = (r, int(np.prod(ins[name]))), (int(np.prod(shapes[name])), r)
            if a.shape != want_a or b.shape != want_b:
                raise ConfigError(f"model.lora.init_from={str(path)!r}: {key} has lora_A {tuple(a.shape)} and lora_B "
                                  f"{tuple(b.shape)}; this model needs {want_a} and {want_b}")
            a_rows.append(a.T.reshape(*ins[name], r))
            b_rows.append(b.T.reshape(r, *shapes[name]))
        out[name + SUFFIX_A] = np.stack(a_rows).astype(np.float32)
        out[name + SUFFIX_B] = np.stack(b_rows).astype(np.float32)
    return {"layers": out}
