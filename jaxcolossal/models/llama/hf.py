"""The LLaMA family's Hugging Face format: ``LlamaForCausalLM`` and the architectures that are LLaMA
plus flags in transformers' own code: ``MistralForCausalLM`` (sliding window), ``Qwen2ForCausalLM``
(q/k/v biases), ``Qwen3ForCausalLM`` (per-head q/k RMSNorm), ``Phi3ForCausalLM`` (fused projections,
partial rotary, LongRoPE), ``Olmo2ForCausalLM`` (post-norms, q/k norm over the whole projection), and
the mixtures of experts on LLaMA's attention (``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``:
:mod:`jaxcolossal.models.llama.hf_moe`).

Key mapping (torch ``Linear`` weights are ``[out, in]``; L layers, i a layer)::

    model.embed_tokens.weight                 [V, d]      embed_tokens [v, d]
    model.layers.i.input_layernorm.weight     [d]         layers.attn_norm [L, d]   (OLMo-2: post_attention_layernorm)
    model.layers.i.self_attn.q_proj.weight    [h*q, d]    layers.wq [L, d, h, q]    (+ .bias: layers.bq [L, h, q])
    model.layers.i.self_attn.k_proj.weight    [k*q, d]    layers.wk [L, d, k, q]    (+ .bias: layers.bk)
    model.layers.i.self_attn.v_proj.weight    [k*q, d]    layers.wv [L, d, k, q]    (+ .bias: layers.bv)
    model.layers.i.self_attn.o_proj.weight    [d, h*q]    layers.wo [L, h, q, d]    (+ .bias: layers.bo [L, d])
    model.layers.i.self_attn.q_norm.weight    [q]/[h*q]   layers.q_norm [L, q] / [L, h, q]  (Qwen3 / OLMo-2; k_norm alike)
    model.layers.i.post_attention_layernorm.weight [d]    layers.mlp_norm [L, d]    (OLMo-2: post_feedforward_layernorm)
    model.layers.i.mlp.gate_proj.weight       [f, d]      layers.w_gate [L, d, f]   (+ .bias: layers.b_gate)
    model.layers.i.mlp.up_proj.weight         [f, d]      layers.w_up [L, d, f]     (+ .bias: layers.b_up)
    model.layers.i.mlp.down_proj.weight       [d, f]      layers.w_down [L, f, d]   (+ .bias: layers.b_down)
    model.norm.weight                         [d]         final_norm [d]
    lm_head.weight                            [V, d]      lm_head [d, v]   (absent when tied)

Phi-3 fuses ``self_attn.qkv_proj`` (q, then k, then v rows) and ``mlp.gate_up_proj`` (gate rows, then
up): split on import, fused on export. No q/k permutation is needed: HF applies rotate-half RoPE
to the natural ``[heads, head_dim]`` split, as :func:`jaxcolossal.models.layers.rope.apply_rope` does.

Every ``config.json`` key that changes the math is read or refused in one line naming it
(:mod:`jaxcolossal.models.hf_config`); the folder-level I/O is :mod:`jaxcolossal.models.hf_io`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.hf_config import (
    head_dim_from_hf,
    layer_types_from_hf,
    refuse,
    refuse_dropout,
    refuse_set,
    rope_from_hf,
    rope_to_hf,
)
from jaxcolossal.models.llama import hf_moe

DENSE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
"""The dense architectures of the family, by ``model_type``."""

ARCHITECTURES = {**DENSE, **hf_moe.FLAVOURS}
"""Hugging Face ``model_type`` -> architecture class, for every form this family reads."""

INIT_FROM_KEYS = ("rms_norm_eps", "rope_theta", "rope", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "qk_norm", "qk_norm_scope", "norm_position", "norm_topk_prob", "router_scoring", "attention_head_dim",
                  "attention_bias", "mlp_bias", "sliding_window", "layer_types")
"""Beyond the shared sizes, the model keys that must equal the checkpoint's for ``model.init_from``."""

_FLAGS = {"qwen2": {"attention_bias": "qkv"}, "qwen3": {"qk_norm": True},
          "olmo2": {"qk_norm": True, "qk_norm_scope": "projection", "norm_position": "post"}}
"""The fields each architecture fixes (transformers' code, not its config)."""

_QWEN_WINDOWS = ("qwen2", "qwen3", "qwen3_moe")
"""Architectures whose window is on only with ``use_sliding_window`` and from layer ``max_window_layers`` on."""

ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                       "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "rope", "attention_head_dim",
                       "attention_bias", "mlp_bias", "sliding_window", "layer_types", "qk_norm", "qk_norm_scope",
                       "norm_position", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
"""What an export must carry: ``config_from_hf(config_to_hf(cfg))`` equals ``cfg`` in these fields."""


def config_from_hf(hf: dict, kind: str) -> ModelConfig:
    """A :class:`ModelConfig` from a ``config.json`` dict whose ``model_type`` is ``kind`` (a key of
    :data:`ARCHITECTURES`).

    Reads ``num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, intermediate_size,
    max_position_embeddings, vocab_size, tie_word_embeddings, rms_norm_eps, initializer_range, head_dim``,
    RoPE (``rope_scaling``/``rope_theta`` or ``rope_parameters``: every type of
    :data:`jaxcolossal.models.hf_config.ROPE_TYPES`), ``attention_bias``, ``mlp_bias`` (LLaMA),
    ``sliding_window`` (Mistral, Phi-3, Mixtral: every layer; Qwen: with ``use_sliding_window``, from
    ``max_window_layers`` or ``layer_types``), ``partial_rotary_factor`` (Phi-3), and the mixtures of
    experts' keys (:func:`hf_moe.config_from_hf`).

    Raises:
        ConfigError: a key that changes the math and is not implemented (named): a non-zero dropout, an
            activation other than silu, a RoPE type outside the supported ones, ``mlp_bias`` outside LLaMA.
    """
    refuse_dropout(hf, kind)
    if hf.get("hidden_act", "silu") != "silu":
        refuse(kind, "hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU) is implemented in this family")
    if kind != "llama":
        refuse_set(hf, kind, ("mlp_bias",), "transformers' own code has no MLP bias here")
    if kind == "phi3":
        hf = {"original_max_position_embeddings": 4096, **hf}  # Phi3Config's default, which its RoPE reads
    rope, theta = rope_from_hf(hf, kind, aliases={"su": "longrope", "yarn": "longrope"} if kind == "phi3" else None)
    fields = dict(
        type="llama", hf_model_type=kind, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        intermediate_size=hf.get("intermediate_size") or hf.get("moe_intermediate_size"),
        max_position_embeddings=hf.get("max_position_embeddings", 2048), vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope=rope,
        initializer_range=float(hf.get("initializer_range", 0.02)), attention_head_dim=head_dim_from_hf(hf),
        attention_bias="all" if hf.get("attention_bias") else "none", mlp_bias=bool(hf.get("mlp_bias", False)),
        **_windows(hf, kind))
    cfg = ModelConfig(**{**fields, **_FLAGS.get(kind, {})})
    if kind in hf_moe.FLAVOURS:  # LLaMA's attention with a mixture of experts
        cfg = dataclasses.replace(cfg, **hf_moe.config_from_hf(hf, kind, {}))
    return cfg


def _windows(hf: dict, kind: str) -> dict:
    """``sliding_window`` and ``layer_types`` of a config (none for LLaMA and OLMo-2, which have no window)."""
    window = hf.get("sliding_window")
    if kind in ("llama", "olmo2") or not window or (kind in _QWEN_WINDOWS and not hf.get("use_sliding_window")):
        return {}
    start = hf.get("max_window_layers", 0) if kind in _QWEN_WINDOWS else 0
    kinds = layer_types_from_hf(hf, hf["num_hidden_layers"], start)
    if kinds and all(k == "full_attention" for k in kinds.split(",")):
        return {}
    return {"sliding_window": int(window), "layer_types": kinds}


def architecture(cfg: ModelConfig) -> str:
    """The ``model_type`` an export writes: ``model.hf_model_type`` when set, else the one whose
    transformers code has ``cfg``'s flags (Qwen2 for q/k/v biases, Qwen3 for per-head q/k norms,
    OLMo-2 for post-norms, Mistral for a sliding window, Mixtral/Qwen3-MoE for experts), else LLaMA."""
    if cfg.hf_model_type:
        return cfg.hf_model_type
    if cfg.moe:
        return hf_moe.flavour(cfg)
    if cfg.norm_position == "post":
        return "olmo2"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.attention_bias == "qkv":
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict that ``transformers`` reads back as ``cfg`` (the inverse of
    :func:`config_from_hf`), without the dtype keys that :func:`jaxcolossal.models.hf_io.config_to_hf` adds.

    Raises:
        ConfigError: a model whose flags the target architecture (:func:`architecture`) cannot express,
            naming the fields that would not survive the round trip.
    """
    kind = architecture(cfg)
    out = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "num_hidden_layers": cfg.num_layers,
           "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "intermediate_size": cfg.intermediate_size, "max_position_embeddings": cfg.max_position_embeddings,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
           "rms_norm_eps": cfg.rms_norm_eps, **rope_to_hf(cfg), "hidden_act": "silu",
           "initializer_range": cfg.initializer_range, "attention_dropout": 0.0,
           "attention_bias": cfg.attention_bias == "all", **_windows_to_hf(cfg, kind)}
    if kind == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if kind == "phi3":
        out.update(partial_rotary_factor=cfg.rope.partial_rotary_factor, resid_pdrop=0.0, embd_pdrop=0.0,
                   original_max_position_embeddings=cfg.rope.original_max_position_embeddings or cfg.max_position_embeddings)
        out.pop("attention_bias")
    if kind in hf_moe.FLAVOURS:
        out = hf_moe.config_to_hf(cfg, out)
    _check_round_trip(cfg, out, kind)
    return out


def _windows_to_hf(cfg: ModelConfig, kind: str) -> dict:
    """The window keys of ``kind``'s config for ``cfg``'s ``sliding_window``/``layer_types``."""
    if kind in ("llama", "olmo2"):
        return {}
    if kind in _QWEN_WINDOWS:
        kinds = list(cfg.layer_kinds)
        first = kinds.index("sliding_attention") if "sliding_attention" in kinds else len(kinds)
        return {"use_sliding_window": bool(cfg.sliding_window), "sliding_window": cfg.sliding_window or None,
                "max_window_layers": first, "layer_types": kinds}
    return {"sliding_window": cfg.sliding_window or None}


def _check_round_trip(cfg: ModelConfig, out: dict, kind: str) -> None:
    """Refuse an export that ``kind``'s config cannot carry: the fields of :data:`ARCHITECTURE_FIELDS`
    that :func:`config_from_hf` would read back differently."""
    back = config_from_hf(out, kind)
    lost = [f"model.{f}={getattr(cfg, f)!r}" for f in ARCHITECTURE_FIELDS
            if _normal(f, getattr(back, f), back) != _normal(f, getattr(cfg, f), cfg)]
    if lost:
        raise ConfigError(f"{', '.join(lost)}: the Hugging Face {ARCHITECTURES[kind]} config has no key for it "
                          "(set model.hf_model_type to an architecture that has, or keep the default)")


def _normal(field: str, value, cfg: ModelConfig):
    """A field's value as the round trip compares it (``layer_types`` by the layers' kinds)."""
    return cfg.layer_kinds if field == "layer_types" else value


def params_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    """``(params, used keys)``: the LLaMA params dict (fp32 numpy, unpadded vocabulary) read through
    ``get(key) -> np.ndarray`` and ``has(key) -> bool`` by the key mapping of the module doc."""
    used = set()

    def g(key):
        used.add(key)
        return get(key)

    layers = _attention_from_hf(g, cfg)
    if cfg.moe:  # Mixtral / Qwen3-MoE: the router and the experts
        layers.update(hf_moe.mlp_from_hf(g, cfg, cfg.num_layers))
    else:
        layers.update(_mlp_from_hf(g, cfg))
    out = {"embed_tokens": g("model.embed_tokens.weight"), "layers": layers, "final_norm": g("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = g("lm_head.weight").T
    elif has("lm_head.weight"):
        used.add("lm_head.weight")  # a tied copy
    return out, used


def _norm_keys(cfg: ModelConfig) -> tuple[str, str]:
    """The HF names of ``attn_norm`` and ``mlp_norm`` (OLMo-2's sit after attention and after the MLP)."""
    if cfg.norm_position == "post":
        return "post_attention_layernorm", "post_feedforward_layernorm"
    return "input_layernorm", "post_attention_layernorm"


def _attention_from_hf(g: Callable, cfg: ModelConfig) -> dict:
    """The norms, q/k/v/o projections (Phi-3's fused ``qkv_proj`` split), biases and q/k norms, stacked."""
    L, d, h, k, q = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    p = "model.layers.{i}."
    attn_norm, mlp_norm = _norm_keys(cfg)

    def stack(fmt, fn=lambda w: w):
        return np.stack([fn(g(fmt.format(i=i))) for i in range(L)])

    if cfg.hf_model_type == "phi3":
        qkv = stack(p + "self_attn.qkv_proj.weight")
        wq, wk, wv = np.split(qkv, [h * q, h * q + k * q], axis=1)
    else:
        wq, wk, wv = (stack(p + f"self_attn.{n}_proj.weight") for n in "qkv")
    out = {"attn_norm": stack(p + attn_norm + ".weight"), "mlp_norm": stack(p + mlp_norm + ".weight"),
           "wq": wq.transpose(0, 2, 1).reshape(L, d, h, q), "wk": wk.transpose(0, 2, 1).reshape(L, d, k, q),
           "wv": wv.transpose(0, 2, 1).reshape(L, d, k, q),
           "wo": stack(p + "self_attn.o_proj.weight", lambda w: w.T.reshape(h, q, d))}
    if cfg.attention_bias != "none":
        out.update(bq=stack(p + "self_attn.q_proj.bias", lambda b: b.reshape(h, q)),
                   bk=stack(p + "self_attn.k_proj.bias", lambda b: b.reshape(k, q)),
                   bv=stack(p + "self_attn.v_proj.bias", lambda b: b.reshape(k, q)))
    if cfg.attention_bias == "all":
        out["bo"] = stack(p + "self_attn.o_proj.bias")
    if cfg.qk_norm:
        shape = {"q_norm": (h, q), "k_norm": (k, q)} if cfg.qk_norm_scope == "projection" else {}
        for n in ("q_norm", "k_norm"):
            out[n] = stack(p + f"self_attn.{n}.weight", lambda w, s=shape.get(n): w.reshape(s) if s else w)
    return out


def _mlp_from_hf(g: Callable, cfg: ModelConfig) -> dict:
    """The dense SwiGLU (Phi-3's fused ``gate_up_proj`` split: gate rows first) and its biases, stacked."""
    L, f = cfg.num_layers, cfg.intermediate_size
    p = "model.layers.{i}.mlp."

    def stack(fmt, fn=lambda w: w):
        return np.stack([fn(g(fmt.format(i=i))) for i in range(L)])

    if cfg.hf_model_type == "phi3":
        gate, up = np.split(stack(p + "gate_up_proj.weight"), [f], axis=1)
    else:
        gate, up = stack(p + "gate_proj.weight"), stack(p + "up_proj.weight")
    out = {"w_gate": gate.transpose(0, 2, 1), "w_up": up.transpose(0, 2, 1),
           "w_down": stack(p + "down_proj.weight", lambda w: w.T)}
    if cfg.mlp_bias:
        out.update(b_gate=stack(p + "gate_proj.bias"), b_up=stack(p + "up_proj.bias"), b_down=stack(p + "down_proj.bias"))
    return out


def params_to_hf(params: dict, cfg: ModelConfig) -> dict:
    """``{Hugging Face key: np.ndarray}`` of a LLaMA params dict (numpy, unpadded vocabulary), by
    the key mapping of the module doc; tied embeddings are written once."""
    lp = params["layers"]
    out = {"model.embed_tokens.weight": params["embed_tokens"]}
    for i in range(cfg.num_layers):
        out.update(_layer_to_hf(lp, cfg, i))
    out["model.norm.weight"] = params["final_norm"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    return out


def _layer_to_hf(lp: dict, cfg: ModelConfig, i: int) -> dict:
    """Layer ``i``'s tensors under Hugging Face's names (Phi-3's projections fused)."""
    d, p = cfg.hidden_size, f"model.layers.{i}."
    attn_norm, mlp_norm = _norm_keys(cfg)
    q, k, v = (lp[n][i].reshape(d, -1).T for n in ("wq", "wk", "wv"))
    out = {p + attn_norm + ".weight": lp["attn_norm"][i], p + mlp_norm + ".weight": lp["mlp_norm"][i],
           p + "self_attn.o_proj.weight": lp["wo"][i].reshape(-1, d).T}
    if cfg.hf_model_type == "phi3":
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate([q, k, v])
    else:
        out.update({p + f"self_attn.{n}_proj.weight": w for n, w in zip("qkv", (q, k, v))})
    for name, key in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
        if name in lp:
            out[p + f"self_attn.{key}.bias"] = lp[name][i].reshape(-1)
    if "bo" in lp:
        out[p + "self_attn.o_proj.bias"] = lp["bo"][i]
    for n in ("q_norm", "k_norm"):
        if n in lp:
            out[p + f"self_attn.{n}.weight"] = lp[n][i].reshape(-1)
    if cfg.moe:
        return {**out, **hf_moe.mlp_to_hf(lp, cfg, i)}
    gate, up, down = lp["w_gate"][i].T, lp["w_up"][i].T, lp["w_down"][i].T
    if cfg.hf_model_type == "phi3":
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate([gate, up])
    else:
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
    out[p + "mlp.down_proj.weight"] = down
    for name, key in (("b_gate", "gate_proj"), ("b_up", "up_proj"), ("b_down", "down_proj")):
        if name in lp:
            out[p + f"mlp.{key}.bias"] = lp[name][i]
    return out
