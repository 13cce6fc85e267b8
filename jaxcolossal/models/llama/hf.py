"""The LLaMA family's Hugging Face format: ``LlamaForCausalLM``, and the mixtures of experts on
LLaMA's attention (``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``: :mod:`jaxcolossal.models.llama.hf_moe`).

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
``[heads, head_dim]`` split of ``q_proj``/``k_proj``, exactly as
:func:`jaxcolossal.models.layers.rope.apply_rope` does (the permutation in HF's
``convert_llama_weights_to_hf.py`` converts *Meta's* interleaved layout).

The folder-level reading and writing (safetensors, ``config.json``, vocabulary padding) is
:mod:`jaxcolossal.models.hf_io`'s, for every family.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.llama import hf_moe

ARCHITECTURES = {"llama": "LlamaForCausalLM", **hf_moe.FLAVOURS}
"""Hugging Face ``model_type`` -> architecture class, for every form this family reads."""

INIT_FROM_KEYS = ("rms_norm_eps", "rope_theta", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "qk_norm", "norm_topk_prob", "router_scoring", "attention_head_dim")
"""Beyond the shared sizes, the model keys that must equal the checkpoint's for ``model.init_from``."""


def config_from_hf(hf: dict, kind: str) -> ModelConfig:
    """A :class:`ModelConfig` from a ``config.json`` dict whose ``model_type`` is ``kind`` (a key of
    :data:`ARCHITECTURES`).

    LLaMA reads ``num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads,
    intermediate_size, max_position_embeddings, vocab_size, tie_word_embeddings, rms_norm_eps,
    rope_theta`` (top level, or ``rope_parameters.rope_theta`` as transformers 5 writes it),
    ``initializer_range``; the mixtures of experts add :func:`hf_moe.config_from_hf`'s keys.

    Raises:
        ConfigError: rope scaling, attention or MLP biases, an activation other than silu,
            ``head_dim != hidden_size / heads`` (dense LLaMA).
    """
    if kind in hf_moe.FLAVOURS:  # LLaMA's attention with a mixture of experts
        cfg = config_from_hf({**hf, "model_type": "llama", "head_dim": None, "intermediate_size":
                              hf.get("intermediate_size") or hf.get("moe_intermediate_size")}, "llama")
        return dataclasses.replace(cfg, **hf_moe.config_from_hf(hf, kind, {}))
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
    return ModelConfig(
        type="llama", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        initializer_range=float(hf.get("initializer_range", 0.02)))


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict that ``transformers`` reads back as ``cfg`` (the inverse of
    :func:`config_from_hf`), without the dtype keys that :func:`jaxcolossal.models.hf_io.config_to_hf` adds.

    Raises:
        ConfigError: a dense model with a key LLaMA's config has none for (:func:`hf_moe.flavour`).
    """
    if cfg.moe:
        return hf_moe.config_to_hf(cfg, config_to_hf(dataclasses.replace(cfg, num_experts=0, qk_norm=False)))
    hf_moe.flavour(cfg)  # a dense model: refuses what LLaMA has no key for
    return {
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


def params_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    """``(params, used keys)``: the LLaMA params dict (fp32 numpy, unpadded vocabulary) read through
    ``get(key) -> np.ndarray`` and ``has(key) -> bool`` by the key mapping of the module doc."""
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


def params_to_hf(params: dict, cfg: ModelConfig) -> dict:
    """``{Hugging Face key: np.ndarray}`` of a LLaMA params dict (numpy, unpadded vocabulary), by
    the key mapping of the module doc; tied embeddings are written once."""
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
