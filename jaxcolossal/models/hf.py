"""Hugging Face interoperability: configs and safetensors weights for LLaMA and GPT-2.

Reads and writes LOCAL Hugging Face model directories (nothing is downloaded)::

    config.json
    generation_config.json                    written by save_hf when special-token ids are given
    model.safetensors                         one file, or
    model.safetensors.index.json              {"metadata": {"total_size"}, "weight_map": {key: file}}
    model-00001-of-0000N.safetensors ...

* :func:`load_hf` ``(path, tp) -> (ModelConfig, params)``: the params dict of
  :mod:`jaxcolossal.models.llama` / :mod:`jaxcolossal.models.gpt2`, fp32 numpy, the vocabulary
  padded for ``tp`` with zero rows.
* :func:`save_hf` ``(path, cfg, params, special_tokens=None)``: the inverse; the padding is
  stripped, the result loads in ``transformers`` (``LlamaForCausalLM`` / ``GPT2LMHeadModel``) with
  no missing or unexpected keys; ``special_tokens`` (bos/eos/pad ids) go into ``config.json`` and
  ``generation_config.json``.
* :func:`config_from_hf` / :func:`config_to_hf`: ``config.json`` dict <-> :class:`ModelConfig`;
  :func:`read_special_tokens`: the bos/eos/pad ids a directory names.
* :func:`init_params_from` ``(cfg_model, tp)``: the weights behind ``model.init_from`` (fine-tuning).

Key mapping, LLaMA (torch ``Linear`` weights are ``[out, in]``; L layers, i a layer)::

    model.embed_tokens.weight                 [V, d]      embed_tokens [v, d]
    model.layers.i.input_layernorm.weight     [d]         layers.attn_norm [L, d]
    model.layers.i.self_attn.q_proj.weight    [h*q, d]    layers.wq [L, d, h, q]
    model.layers.i.self_attn.k_proj.weight    [k*q, d]    layers.wk [L, d, k, q]
    model.layers.i.self_attn.v_proj.weight    [k*q, d]    layers.wv [L, d, k, q]
    model.layers.i.self_attn.o_proj.weight    [d, h*q]    layers.wo [L, h, q, d]
    model.layers.i.post_attention_layernorm.weight [d]    layers.mlp_norm [L, d]
    model.layers.i.mlp.gate_proj.weight       [f, d]      layers.w_gate [L, d, f]
    model.layers.i.mlp.up_proj.weight         [f, d]      layers.w_up [L, d, f]
    model.layers.i.mlp.down_proj.weight       [d, f]      layers.w_down [L, f, d]
    model.norm.weight                         [d]         final_norm [d]
    lm_head.weight                            [V, d]      lm_head [d, v]   (absent when tied)

No q/k permutation is needed: HF's LLaMA applies rotate-half RoPE to the natural
``[heads, head_dim]`` split of ``q_proj``/``k_proj``, exactly as ``llama.apply_rope`` does (the
permutation in HF's ``convert_llama_weights_to_hf.py`` converts *Meta's* interleaved layout).

Key mapping, GPT-2 (``Conv1D`` weights are ``[in, out]``; the ``transformer.`` prefix is optional
on reading, as in the original OpenAI checkpoints, and always written)::

    transformer.wte.weight                    [V, d]      wte [v, d]
    transformer.wpe.weight                    [P, d]      wpe [P, d]
    transformer.h.i.ln_1.weight / .bias       [d]         layers.attn_norm / attn_norm_bias [L, d]
    transformer.h.i.attn.c_attn.weight        [d, 3d]     layers.wq / wk / wv [L, d, h, q] (q|k|v columns)
    transformer.h.i.attn.c_attn.bias          [3d]        layers.bq / bk / bv [L, h, q]
    transformer.h.i.attn.c_proj.weight / .bias [d, d] [d] layers.wo [L, h, q, d] / bo [L, d]
    transformer.h.i.ln_2.weight / .bias       [d]         layers.mlp_norm / mlp_norm_bias [L, d]
    transformer.h.i.mlp.c_fc.weight / .bias   [d, f] [f]  layers.w_fc [L, d, f] / b_fc [L, f]
    transformer.h.i.mlp.c_proj.weight / .bias [f, d] [d]  layers.w_proj [L, f, d] / b_proj [L, d]
    transformer.ln_f.weight / .bias           [d]         final_norm / final_norm_bias [d]
    lm_head.weight                            [V, d]      lm_head [d, v]   (only when untied)

Weights are read with the ``safetensors`` package's numpy API (bf16 tensors, which numpy
cannot represent, are read from the file's raw bytes) and always returned as float32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models import get_family, hf_moe

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")

# Buffers that some checkpoints carry and that are not parameters.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


# ----------------------------------------------------------------------------- configs


def _hf_type(hf: dict) -> str:
    """``llama``, ``gpt2``, or a mixture of experts of the LLaMA family (``mixtral``, ``qwen3_moe``)."""
    known = {**ARCHITECTURES, **hf_moe.FLAVOURS}
    mt = hf.get("model_type")
    if mt in known:
        return mt
    for arch in hf.get("architectures") or []:
        for t, a in known.items():
            if arch == a:
                return t
    raise ConfigError(f"Hugging Face config: model_type={mt!r}, architectures={hf.get('architectures')}: "
                      f"supported are {sorted(known)} ({sorted(known.values())})")


def config_from_hf(hf: dict, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dict.

    LLaMA reads ``num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
    intermediate_size, max_position_embeddings, vocab_size, tie_word_embeddings, rms_norm_eps,
    rope_theta`` (top level, or ``rope_parameters.rope_theta`` as transformers 5 writes it),
    ``initializer_range``. GPT-2 reads ``n_layer, n_embd, n_head, n_inner`` (None: 4·n_embd),
    ``n_positions, vocab_size, layer_norm_epsilon, tie_word_embeddings, initializer_range``.
    ``overrides`` (e.g. ``vocab_pad_multiple=64``, ``remat="full"``) are set on the result.

    Raises:
        ConfigError: an unsupported architecture or feature (LLaMA: rope scaling, attention or
            MLP biases, an activation other than silu, ``head_dim != hidden_size / heads``;
            GPT-2: an activation other than the tanh GELU, unscaled or layer-scaled attention,
            cross-attention).
    """
    t = _hf_type(hf)
    if t in hf_moe.FLAVOURS:  # LLaMA's attention with a mixture of experts
        cfg = config_from_hf({**hf, "model_type": "llama", "head_dim": None, "intermediate_size":
                              hf.get("intermediate_size") or hf.get("moe_intermediate_size")})
        return dataclasses.replace(cfg, **hf_moe.config_from_hf(hf, t, {}), **overrides)
    if t == "llama":
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if scaling or rope_type != "default":
            raise ConfigError(f"Hugging Face LLaMA config: rope scaling {scaling or rope} is not supported "
                              "(only the default RoPE)")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ConfigError(f"Hugging Face LLaMA config: {flag}=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"Hugging Face LLaMA config: hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
        heads = hf["num_attention_heads"]
        hd = hf.get("head_dim")
        if hd is not None and hd != hf["hidden_size"] // heads:
            raise ConfigError(f"Hugging Face LLaMA config: head_dim={hd} differs from hidden_size / "
                              f"num_attention_heads = {hf['hidden_size'] // heads}; not supported")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        cfg = ModelConfig(
            type="llama", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            initializer_range=float(hf.get("initializer_range", 0.02)))
    else:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"Hugging Face GPT-2 config: activation_function={act!r}; only the tanh GELU "
                              "('gelu_new', 'gelu_pytorch_tanh') is supported")
        if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
            raise ConfigError("Hugging Face GPT-2 config: only scale_attn_weights=true with "
                              "scale_attn_by_inverse_layer_idx=false is supported")
        if hf.get("add_cross_attention", False):
            raise ConfigError("Hugging Face GPT-2 config: add_cross_attention=true is not supported")
        d, heads = hf["n_embd"], hf["n_head"]
        cfg = ModelConfig(
            type="gpt2", num_layers=hf["n_layer"], hidden_size=d, num_attention_heads=heads,
            num_key_value_heads=heads, intermediate_size=hf.get("n_inner") or 4 * d,
            max_position_embeddings=hf.get("n_positions", 1024), vocab_size=hf["vocab_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            initializer_range=float(hf.get("initializer_range", 0.02)))
    return dataclasses.replace(cfg, **overrides)


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict (``architectures``, ``model_type``, sizes, eps, ``dtype`` float32)
    that ``transformers`` reads back as ``cfg`` (the inverse of :func:`config_from_hf`).

    Raises:
        ConfigError: an unknown ``cfg.type``.
    """
    if cfg.type == "llama" and cfg.moe:
        return hf_moe.config_to_hf(cfg, config_to_hf(dataclasses.replace(cfg, num_experts=0, qk_norm=False)))
    if cfg.type == "llama":
        hf_moe.flavour(cfg)  # a dense model: refuses what LLaMA has no key for
        out = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_word_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,  # transformers < 5
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # transformers >= 5
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "initializer_range": cfg.initializer_range,
        }
    elif cfg.type == "gpt2":
        out = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_layer": cfg.num_layers, "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads,
            "n_inner": cfg.intermediate_size, "n_positions": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
            "layer_norm_epsilon": cfg.layer_norm_eps, "activation_function": "gelu_new",
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "initializer_range": cfg.initializer_range,
        }
        if cfg.vocab_size <= 50256:  # GPT2Config's default bos/eos id 50256 is outside this vocabulary
            out.update(bos_token_id=None, eos_token_id=None)
    else:
        raise ConfigError(f"model.type={cfg.type!r}: Hugging Face export supports {sorted(ARCHITECTURES)}")
    out.update(dtype="float32", torch_dtype="float32")
    return out


def read_hf_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a local HF model directory, as a dict.

    Raises:
        FileNotFoundError: ``path`` or its ``config.json`` does not exist.
    """
    f = Path(path) / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{str(f)!r} does not exist (a local Hugging Face model directory is needed)")
    return json.loads(f.read_text())


def read_special_tokens(path: str | os.PathLike) -> dict:
    """The ``bos_token_id``/``eos_token_id``/``pad_token_id`` a local HF model directory names:
    each from ``generation_config.json`` (what ``generate()`` uses), else from ``config.json``;
    keys that neither file sets (or sets to null) are left out, so a directory without ids, or
    without either file, gives ``{}``.
    """
    out: dict = {}
    for name in ("config.json", GENERATION_CONFIG):  # the second wins
        f = Path(path) / name
        if f.is_file():
            d = json.loads(f.read_text())
            out.update({k: d[k] for k in SPECIAL_TOKENS if d.get(k) is not None})
    return out


# ----------------------------------------------------------------------------- safetensors I/O


def _raw_tensor(file: str, key: str) -> np.ndarray:
    """A bf16 tensor read from the file's bytes (numpy has no bfloat16), as float32."""
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    info = header[key]
    if info["dtype"] != "BF16":
        raise TypeError(f"{file}: tensor {key!r} has dtype {info['dtype']}, which numpy cannot read")
    s, e = info["data_offsets"]
    raw = np.fromfile(file, dtype="<u2", count=(e - s) // 2, offset=8 + n + s)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def read_safetensors(path: str | os.PathLike) -> tuple[list[str], Callable[[str], np.ndarray]]:
    """``(keys, get)`` over the weights of a local HF directory: ``get(key)`` returns the tensor
    as a float32 numpy array. Reads ``model.safetensors.index.json`` (sharded) when present,
    else ``model.safetensors``.

    Raises:
        FileNotFoundError: neither file exists (``pytorch_model.bin`` is not read).
    """

    path = Path(path)
    index = path / SAFE_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (path / SAFE_SINGLE).exists():
        with safe_open(str(path / SAFE_SINGLE), framework="np") as f:
            weight_map = {k: SAFE_SINGLE for k in f.keys()}
    else:
        raise FileNotFoundError(f"{str(path)!r} has neither {SAFE_INDEX} nor {SAFE_SINGLE} "
                                "(save the model with save_pretrained(safe_serialization=True))")

    def get(key: str) -> np.ndarray:
        file = str(path / weight_map[key])
        with safe_open(file, framework="np") as f:
            try:
                x = f.get_tensor(key)
            except TypeError:  # bfloat16
                return _raw_tensor(file, key)
        return np.asarray(x, dtype=np.float32)

    return list(weight_map), get


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: expected bytes or a size like '5GB', '200MiB'")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base ** power)


def save_shared(tensors: dict[str, np.ndarray], file: str | os.PathLike) -> None:
    """``safetensors.numpy.save_file`` with transformers' ``{"format": "pt"}`` metadata, readable by
    others as any file this process writes (the process's umask; safetensors' temporary file would
    leave it at 0600, unreadable to the rest of a team sharing the export)."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``tensors`` to ``path`` as ``model.safetensors`` or, when larger than
    ``max_shard_size`` (bytes, or ``"5GB"``, ``"200MiB"``: HF's units), as
    ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``.
    Earlier ``model*.safetensors`` files and index in ``path`` are removed first. Each file
    carries the metadata ``{"format": "pt"}`` that transformers expects. Returns the file names.
    """

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in list(path.glob("model*.safetensors")) + [path / SAFE_INDEX]:
        if old.exists():
            old.unlink()
    limit = _parse_size(max_shard_size)
    shards, cur, cur_bytes = [], {}, 0
    for k, v in tensors.items():
        if cur and cur_bytes + v.nbytes > limit:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[k] = np.ascontiguousarray(v)
        cur_bytes += v.nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_shared(shards[0], path / SAFE_SINGLE)
        return [SAFE_SINGLE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_shared(shard, path / name)
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = int(sum(v.nbytes for v in tensors.values()))
    (path / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
    return names


# ----------------------------------------------------------------------------- key mapping


def _llama_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    L, d, h, k, q = (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.head_dim)
    used = set()

    def g(key):
        used.add(key)
        return get(key)

    def stack(fmt, fn):
        return np.stack([fn(g(fmt.format(i=i))) for i in range(L)])

    p = "model.layers.{i}."
    layers = {
        "attn_norm": stack(p + "input_layernorm.weight", lambda w: w),
        "wq": stack(p + "self_attn.q_proj.weight", lambda w: w.T.reshape(d, h, q)),
        "wk": stack(p + "self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, q)),
        "wv": stack(p + "self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, q)),
        "wo": stack(p + "self_attn.o_proj.weight", lambda w: w.T.reshape(h, q, d)),
        "mlp_norm": stack(p + "post_attention_layernorm.weight", lambda w: w),
    }
    if cfg.moe:  # Mixtral / Qwen3-MoE: the router and the experts (and Qwen3's q/k norms)
        layers.update(hf_moe.mlp_from_hf(g, cfg, L))
    else:
        layers.update(w_gate=stack(p + "mlp.gate_proj.weight", lambda w: w.T),
                      w_up=stack(p + "mlp.up_proj.weight", lambda w: w.T),
                      w_down=stack(p + "mlp.down_proj.weight", lambda w: w.T))
    out = {"embed_tokens": g("model.embed_tokens.weight"), "layers": layers, "final_norm": g("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = g("lm_head.weight").T
    elif has("lm_head.weight"):
        used.add("lm_head.weight")  # a tied copy
    return out, used


def _llama_to_hf(params: dict, cfg: ModelConfig) -> dict:
    L, d = cfg.num_layers, cfg.hidden_size
    lp = params["layers"]
    out = {"model.embed_tokens.weight": params["embed_tokens"]}
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = lp["attn_norm"][i]
        out[p + "self_attn.q_proj.weight"] = lp["wq"][i].reshape(d, -1).T
        out[p + "self_attn.k_proj.weight"] = lp["wk"][i].reshape(d, -1).T
        out[p + "self_attn.v_proj.weight"] = lp["wv"][i].reshape(d, -1).T
        out[p + "self_attn.o_proj.weight"] = lp["wo"][i].reshape(-1, d).T
        out[p + "post_attention_layernorm.weight"] = lp["mlp_norm"][i]
        if cfg.moe:
            out.update(hf_moe.mlp_to_hf(lp, cfg, i))
            continue
        out[p + "mlp.gate_proj.weight"] = lp["w_gate"][i].T
        out[p + "mlp.up_proj.weight"] = lp["w_up"][i].T
        out[p + "mlp.down_proj.weight"] = lp["w_down"][i].T
    out["model.norm.weight"] = params["final_norm"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    return out


def _gpt2_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    L, d, h, q = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    pre = "transformer." if has("transformer.wte.weight") else ""
    used = set()

    def g(key):
        used.add(pre + key)
        return get(pre + key)

    def stack(fmt, fn=lambda w: w):
        return np.stack([fn(g(fmt.format(i=i))) for i in range(L)])

    p = "h.{i}."
    qkv_w = stack(p + "attn.c_attn.weight", lambda w: w.reshape(d, 3, h, q))  # [L, d, 3, h, q]
    qkv_b = stack(p + "attn.c_attn.bias", lambda b: b.reshape(3, h, q))  # [L, 3, h, q]
    layers = {
        "attn_norm": stack(p + "ln_1.weight"), "attn_norm_bias": stack(p + "ln_1.bias"),
        "wq": qkv_w[:, :, 0], "wk": qkv_w[:, :, 1], "wv": qkv_w[:, :, 2],
        "bq": qkv_b[:, 0], "bk": qkv_b[:, 1], "bv": qkv_b[:, 2],
        "wo": stack(p + "attn.c_proj.weight", lambda w: w.reshape(h, q, d)),
        "bo": stack(p + "attn.c_proj.bias"),
        "mlp_norm": stack(p + "ln_2.weight"), "mlp_norm_bias": stack(p + "ln_2.bias"),
        "w_fc": stack(p + "mlp.c_fc.weight"), "b_fc": stack(p + "mlp.c_fc.bias"),
        "w_proj": stack(p + "mlp.c_proj.weight"), "b_proj": stack(p + "mlp.c_proj.bias"),
    }
    out = {"wte": g("wte.weight"), "wpe": g("wpe.weight"), "layers": layers,
           "final_norm": g("ln_f.weight"), "final_norm_bias": g("ln_f.bias")}
    if not cfg.tie_word_embeddings:
        used.add("lm_head.weight")
        out["lm_head"] = get("lm_head.weight").T
    elif has("lm_head.weight"):
        used.add("lm_head.weight")
    return out, used


def _gpt2_to_hf(params: dict, cfg: ModelConfig) -> dict:
    d = cfg.hidden_size
    lp = params["layers"]
    t = "transformer."
    out = {t + "wte.weight": params["wte"], t + "wpe.weight": params["wpe"]}
    for i in range(cfg.num_layers):
        p = f"{t}h.{i}."
        out[p + "ln_1.weight"] = lp["attn_norm"][i]
        out[p + "ln_1.bias"] = lp["attn_norm_bias"][i]
        out[p + "attn.c_attn.weight"] = np.concatenate(
            [lp[n][i].reshape(d, d) for n in ("wq", "wk", "wv")], axis=1)
        out[p + "attn.c_attn.bias"] = np.concatenate([lp[n][i].reshape(d) for n in ("bq", "bk", "bv")])
        out[p + "attn.c_proj.weight"] = lp["wo"][i].reshape(d, d)
        out[p + "attn.c_proj.bias"] = lp["bo"][i]
        out[p + "ln_2.weight"] = lp["mlp_norm"][i]
        out[p + "ln_2.bias"] = lp["mlp_norm_bias"][i]
        out[p + "mlp.c_fc.weight"] = lp["w_fc"][i]
        out[p + "mlp.c_fc.bias"] = lp["b_fc"][i]
        out[p + "mlp.c_proj.weight"] = lp["w_proj"][i]
        out[p + "mlp.c_proj.bias"] = lp["b_proj"][i]
    out[t + "ln_f.weight"] = params["final_norm"]
    out[t + "ln_f.bias"] = params["final_norm_bias"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    return out


_FROM = {"llama": _llama_from_hf, "gpt2": _gpt2_from_hf}
_TO = {"llama": _llama_to_hf, "gpt2": _gpt2_to_hf}
_EMBED = {"llama": "embed_tokens", "gpt2": "wte"}


def _pad_vocab(params: dict, cfg: ModelConfig, vocab: int) -> dict:
    emb = _EMBED[cfg.type]
    extra = vocab - cfg.vocab_size
    if extra:
        params[emb] = np.pad(params[emb], ((0, extra), (0, 0)))
        if "lm_head" in params:
            params["lm_head"] = np.pad(params["lm_head"], ((0, 0), (0, extra)))
    return params


# ----------------------------------------------------------------------------- public API


def load_hf(path: str | os.PathLike, tp: int = 1, **overrides: Any) -> tuple[ModelConfig, dict]:
    """Import a local Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``); nothing is downloaded.
        tp: tensor-parallel size: the vocabulary is padded with zero rows (and zero ``lm_head``
            columns) to ``padded_vocab_size(cfg, tp)``; the padded logits are masked.
        overrides: :class:`ModelConfig` fields to set on the imported config
            (``vocab_pad_multiple=64``, ``remat="full"``, ...).

    Returns:
        ``(cfg, params)``: the config, and the params dict of the family's
        ``param_shapes_and_axes`` (module doc of :mod:`jaxcolossal.models.hf` for the key
        mapping) as float32 numpy arrays; ``jax.device_put``/``init_state(params=...)`` shard it.

    Raises:
        FileNotFoundError: no ``config.json`` or no safetensors weights.
        ConfigError: an unsupported architecture or feature (:func:`config_from_hf`).
        KeyError: a weight that the architecture needs is missing from the checkpoint.
        ValueError: the checkpoint has weights this mapping does not use, or a weight has the
            wrong shape (both mean the checkpoint is not the architecture its config names).
    """

    cfg = config_from_hf(read_hf_config(path), **overrides)
    keys, get = read_safetensors(path)
    keyset = set(keys)

    def checked_get(key):
        if key not in keyset:
            raise KeyError(f"{str(path)!r}: weight {key!r} is missing from the checkpoint")
        return get(key)

    params, used = _FROM[cfg.type](checked_get, keyset.__contains__, cfg)
    unused = sorted(k for k in keyset - used if not _IGNORED.search(k))
    if unused:
        raise ValueError(f"{str(path)!r}: the checkpoint has weights that a {ARCHITECTURES[cfg.type]} of this "
                         f"config does not use: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    family = get_family(cfg)
    vocab = family.padded_vocab_size(cfg, tp)
    params = _pad_vocab(params, cfg, vocab)
    want = family.param_shapes_and_axes(cfg, vocab)
    for name, (shape, _) in [*((n, sa) for n, sa in want.items() if n != "layers"),
                             *((f"layers.{n}", sa) for n, sa in want["layers"].items())]:
        got = params["layers"][name[len("layers."):]] if name.startswith("layers.") else params[name]
        if tuple(got.shape) != tuple(shape):
            raise ValueError(f"{str(path)!r}: {name} has shape {tuple(got.shape)}, the config implies {tuple(shape)}")
    return cfg, params


def check_special_tokens(special_tokens: dict, vocab_size: int) -> dict:
    """``special_tokens`` checked against a vocabulary of ``vocab_size`` entries: keys among
    ``bos_token_id, eos_token_id, pad_token_id``, values an id in ``[0, vocab_size)``, a list of
    such ids (several end tokens, as LLaMA-3's ``generation_config.json`` has), or None.
    Returns a copy with plain ``int`` ids.

    Raises:
        ConfigError: an unknown key, or an id that is not an integer or lies outside the vocabulary.
    """
    out = {}
    for key, value in special_tokens.items():
        if key not in SPECIAL_TOKENS:
            raise ConfigError(f"special token {key!r}: expected one of {', '.join(SPECIAL_TOKENS)}")
        if value is None:
            out[key] = None
            continue
        many = isinstance(value, (list, tuple))
        ids = list(value) if many else [value]
        if not ids or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
            raise ConfigError(f"{key}={value!r}: expected a token id (an integer), a list of them, or None")
        for i in ids:
            if not 0 <= int(i) < vocab_size:
                raise ConfigError(f"{key}={int(i)} lies outside the model's vocabulary (model.vocab_size="
                                  f"{vocab_size}: ids 0..{vocab_size - 1})")
        out[key] = [int(i) for i in ids] if many else int(value)
    return out


def save_hf(path: str | os.PathLike, cfg: ModelConfig, params: Any, max_shard_size: int | str = "5GB",
            special_tokens: dict | None = None) -> list[str]:
    """Export ``params`` as a Hugging Face model directory that ``transformers`` loads
    (``AutoModelForCausalLM.from_pretrained(path)``) with no missing or unexpected keys.

    Args:
        path: output directory (created); earlier ``model*.safetensors`` files in it are removed.
        cfg: the model config (``type`` llama or gpt2).
        params: the params dict (jax or numpy arrays, any float dtype, fully addressable from
            this process, e.g. ``state.params`` or ``state.master``); written as float32.
            Vocabulary padding is removed: rows/columns beyond ``cfg.vocab_size`` are dropped.
        max_shard_size: bytes or HF-style ``"5GB"``/``"200MiB"``; a larger model is written as
            shards plus ``model.safetensors.index.json``.
        special_tokens: ``{"bos_token_id": int | None, "eos_token_id": ..., "pad_token_id": ...}``
            (any of the keys; :func:`check_special_tokens`): written into ``config.json`` (None as
            ``null``), and the ids that are set into ``generation_config.json`` as
            ``transformers.GenerationConfig.save_pretrained`` writes it (``"_from_model_config":
            true``), so that ``generate()`` stops at ``eos_token_id``. None: ``config.json`` carries
            only :func:`config_to_hf`'s ids (``transformers`` assumes its own defaults for the
            rest) and no ``generation_config.json`` is written.

    Writes ``config.json`` (:func:`config_to_hf`, plus the ids), the safetensors file(s) (module
    doc for the key names; tied embeddings are written once, as HF does) and, when ids are set,
    ``generation_config.json``; an earlier ``generation_config.json`` in ``path`` is removed
    otherwise. Returns the weight file names.

    Raises:
        ConfigError: an unknown ``cfg.type``; a special-token id outside ``[0, cfg.vocab_size)``
            or an unknown key in ``special_tokens`` (nothing is written then).
    """

    if cfg.type not in _TO:
        raise ConfigError(f"model.type={cfg.type!r}: Hugging Face export supports {sorted(_TO)}")
    ids = check_special_tokens(special_tokens, cfg.vocab_size) if special_tokens is not None else None
    p = jax.tree.map(lambda x: np.asarray(jax.device_get(x), dtype=np.float32), params)
    emb = _EMBED[cfg.type]
    p[emb] = p[emb][: cfg.vocab_size]
    if "lm_head" in p:
        p["lm_head"] = p["lm_head"][:, : cfg.vocab_size]
    tensors = _TO[cfg.type](p, cfg)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config_to_hf(cfg), **(ids or {})}, indent=2) + "\n")
    generation = {k: v for k, v in (ids or {}).items() if v is not None}
    if generation:
        (path / GENERATION_CONFIG).write_text(
            json.dumps({"_from_model_config": True, **dict(sorted(generation.items()))}, indent=2) + "\n")
    elif (path / GENERATION_CONFIG).exists():
        (path / GENERATION_CONFIG).unlink()
    return write_safetensors(path, tensors, max_shard_size)


# Fields that must agree between the YAML and the HF config for ``model.init_from``.
_MATCH = ("type", "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "vocab_size", "tie_word_embeddings")
_MATCH_FAMILY = {"llama": ("rms_norm_eps", "rope_theta", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "qk_norm", "norm_topk_prob", "router_scoring", "attention_head_dim"),
                 "gpt2": ("max_position_embeddings", "layer_norm_eps")}


def check_init_from(cfg_model: ModelConfig) -> None:
    """Check ``model.init_from`` before anything compiles: the directory and its ``config.json``
    exist and describe the model of the YAML (the keys listed in :func:`init_params_from`).

    Raises:
        ConfigError: a missing directory or config (naming the key), an unsupported HF config,
            or sizes that differ (every mismatched key with both values).
    """
    path = cfg_model.init_from
    try:
        hf = config_from_hf(read_hf_config(path))
    except FileNotFoundError as e:
        raise ConfigError(f"model.init_from={path!r}: {e}") from None
    keys = _MATCH + _MATCH_FAMILY.get(hf.type, ())
    bad = []
    for k in keys:
        a, b = getattr(cfg_model, k), getattr(hf, k)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if not same:
            bad.append(f"model.{k}={a!r} (the Hugging Face config has {b!r})")
    if bad:
        raise ConfigError(f"model.init_from={path!r}: the model section does not match the checkpoint: "
                          + "; ".join(bad))


def init_params_from(cfg_model: ModelConfig, tp: int = 1) -> dict | None:
    """The initial params for ``model.init_from`` (fine-tuning from Hugging Face weights).

    Returns ``None`` when ``cfg_model.init_from`` is empty; else :func:`load_hf` of that
    directory, padded with ``cfg_model.vocab_pad_multiple`` and ``tp`` (fp32 numpy, for
    ``init_state(plan, tx, params=...)``).

    The YAML must describe the same model: ``type, num_layers, hidden_size, num_attention_heads,
    num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings`` and, for llama,
    ``rms_norm_eps, rope_theta``, for gpt2 ``max_position_embeddings, layer_norm_eps`` must equal
    the HF config's (checked by :func:`check_init_from` before any weight is read).

    Raises:
        ConfigError: see :func:`check_init_from`.
        FileNotFoundError: no weights in the directory.
    """
    if not cfg_model.init_from:
        return None
    check_init_from(cfg_model)
    _, params = load_hf(cfg_model.init_from, tp, vocab_pad_multiple=cfg_model.vocab_pad_multiple)
    return params
