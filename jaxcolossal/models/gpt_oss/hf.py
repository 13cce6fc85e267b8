"""The GPT-OSS family's Hugging Face format: ``GptOssForCausalLM`` (``model_type: gpt_oss``; transformers'
``models/gpt_oss``), read and written.

Key mapping (torch ``Linear`` weights are ``[out, in]``; the experts' fused tensors are stored ``[in, out]``;
L layers, i a layer, E experts of size f)::

    model.embed_tokens.weight                       [V, d]       embed_tokens [v, d]
    model.layers.i.input_layernorm.weight           [d]          layers.attn_norm [L, d]
    model.layers.i.self_attn.q_proj.weight / .bias  [h*q, d]     layers.wq [L, d, h, q] / bq [L, h, q]
    model.layers.i.self_attn.k_proj / v_proj        [k*q, d]     layers.wk, wv [L, d, k, q] / bk, bv [L, k, q]
    model.layers.i.self_attn.o_proj.weight / .bias  [d, h*q]     layers.wo [L, h, q, d] / bo [L, d]
    model.layers.i.self_attn.sinks                  [h]          layers.sinks [L, h]
    model.layers.i.post_attention_layernorm.weight  [d]          layers.mlp_norm [L, d]
    model.layers.i.mlp.router.weight / .bias        [E, d] / [E] layers.router [L, d, E] / router_bias [L, E]
    model.layers.i.mlp.experts.gate_up_proj         [E, d, 2f]   layers.moe_w_gate = [..., ::2], moe_w_up = [..., 1::2]
    model.layers.i.mlp.experts.gate_up_proj_bias    [E, 2f]      layers.moe_gate_bias = [:, ::2], moe_up_bias [:, 1::2]
    model.layers.i.mlp.experts.down_proj            [E, f, d]    layers.moe_w_down [L, E, f, d]
    model.layers.i.mlp.experts.down_proj_bias       [E, d]       layers.moe_down_bias [L, E, d]
    model.norm.weight                               [d]          final_norm [d]
    lm_head.weight                                  [V, d]       lm_head [d, v]   (absent when tied)

The gate and up projections are interleaved along the fused dimension (transformers'
``GptOssExperts._apply_gate``: ``gate, up = gate_up[..., ::2], gate_up[..., 1::2]``): split on import,
interleaved again on export.

Every ``config.json`` key that changes the math is read or refused in one line naming it
(:mod:`jaxcolossal.models.hf_config`). Keys transformers' GPT-OSS does not read (``hidden_act``: its
experts' activation is fixed; ``initial_context_length``, ``experts_per_token``: OpenAI's own names)
change nothing; ``experts_per_token`` is refused when it disagrees with ``num_experts_per_tok``.
The published checkpoints ship MXFP4 experts (``quantization_config``), refused: they need a bf16 copy.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.hf_config import (
    head_dim_from_hf,
    layer_types_from_hf,
    refuse,
    refuse_dropout,
    rope_from_hf,
    rope_to_hf,
)

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
"""Hugging Face ``model_type`` -> architecture class."""

INIT_FROM_KEYS = ("rms_norm_eps", "rope_theta", "rope", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "attention_head_dim", "attention_bias", "sliding_window", "layer_types", "attention_sinks",
                  "swiglu_limit", "router_bias", "expert_bias")
"""Beyond the shared sizes, the model keys that must equal the checkpoint's for ``model.init_from``."""

DEFAULTS = {"num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128,
            "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
            "attention_bias": True, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001,
            "output_router_logits": False, "initializer_range": 0.02, "max_position_embeddings": 131072}
"""transformers' ``GptOssConfig`` defaults of the keys that change the math (a ``config.json`` may omit them)."""

DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
"""``GptOssConfig``'s RoPE when the config names none (``rope_parameters`` and ``rope_scaling`` both unset)."""

ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "expert_size",
                       "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "rope", "attention_head_dim",
                       "attention_bias", "sliding_window", "layer_types", "num_experts", "num_experts_per_tok",
                       "norm_topk_prob", "router_scoring", "num_shared_experts", "first_k_dense",
                       "attention_sinks", "swiglu_limit", "router_bias", "expert_bias", "router_aux_loss_coef")
"""What an export must carry: ``config_from_hf(config_to_hf(cfg))`` equals ``cfg`` in these fields."""


def _refuse_unsupported(hf: dict, kind: str) -> None:
    """The keys of a GPT-OSS ``config.json`` that change the math and are not implemented here."""
    if hf.get("quantization_config"):
        q = hf["quantization_config"]
        refuse(kind, "quantization_config", {"quant_method": q.get("quant_method")} if isinstance(q, dict) else q,
               "quantized (MXFP4) expert weights are not read here: load a bf16 copy (transformers: from_pretrained("
               "..., quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained)")
    refuse_dropout(hf, kind)
    if float(hf["swiglu_alpha"]) != DEFAULTS["swiglu_alpha"]:
        refuse(kind, "swiglu_alpha", hf["swiglu_alpha"], "only GPT-OSS's 1.702 is implemented")
    if float(hf["swiglu_limit"]) <= 0:
        refuse(kind, "swiglu_limit", hf["swiglu_limit"], "the clamp needs a limit > 0 (GPT-OSS's is 7.0)")
    per_token = hf.get("experts_per_token")
    if per_token is not None and per_token != hf["num_experts_per_tok"]:
        refuse(kind, "experts_per_token", per_token, f"differs from num_experts_per_tok={hf['num_experts_per_tok']}, "
               "which transformers uses: make them equal")


def config_from_hf(hf: dict, kind: str) -> ModelConfig:
    """A :class:`ModelConfig` from a GPT-OSS ``config.json`` dict (``kind``: ``gpt_oss``), missing keys at
    ``GptOssConfig``'s defaults (:data:`DEFAULTS`, :data:`DEFAULT_ROPE`).

    Reads ``num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size`` (each expert's), ``max_position_embeddings, vocab_size, tie_word_embeddings,
    rms_norm_eps, initializer_range``, RoPE (``rope_scaling`` + ``rope_theta`` or ``rope_parameters``;
    yarn with its ``factor``, ``beta_fast``, ``beta_slow``, ``original_max_position_embeddings``,
    ``truncate``), ``attention_bias``, ``sliding_window``, ``layer_types``, ``num_local_experts``,
    ``num_experts_per_tok``, ``swiglu_limit``, and ``router_aux_loss_coef`` only when
    ``output_router_logits`` is true (transformers' loss adds the load-balancing term only then; else
    ``model.router_aux_loss_coef`` is 0). Sinks, the router bias and the experts' biases are always there.

    Raises:
        ConfigError: a key that changes the math and is not implemented (named, :func:`_refuse_unsupported`):
            ``quantization_config`` (MXFP4), a non-zero dropout, ``swiglu_alpha`` other than 1.702, a
            ``swiglu_limit`` <= 0, ``experts_per_token`` unequal to ``num_experts_per_tok``, a RoPE type
            outside the supported ones.
    """
    hf = {**DEFAULTS, **hf}
    _refuse_unsupported(hf, kind)
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf = {**hf, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": hf["rope_theta"]}}
    rope, theta = rope_from_hf(hf, kind)
    layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return ModelConfig(
        type="gpt_oss", hf_model_type=kind, num_layers=layers, hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], max_position_embeddings=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        rms_norm_eps=float(hf["rms_norm_eps"]), rope_theta=theta, rope=rope,
        initializer_range=float(hf["initializer_range"]), attention_head_dim=head_dim_from_hf(hf),
        attention_bias="all" if hf["attention_bias"] else "none", sliding_window=int(hf["sliding_window"] or 0),
        layer_types=layer_types_from_hf({"layer_types": kinds}, layers), attention_sinks=True,
        num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        router_scoring="softmax", norm_topk_prob=True, router_bias=True, expert_bias=True,
        swiglu_limit=float(hf["swiglu_limit"]), router_aux_loss_form="pooled",
        router_aux_loss_coef=float(hf["router_aux_loss_coef"]) if hf["output_router_logits"] else 0.0)


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict that transformers reads back as ``cfg`` (the inverse of
    :func:`config_from_hf`), without the dtype keys :func:`jaxcolossal.models.hf_io.config_to_hf` adds.
    ``output_router_logits`` is true when ``model.router_aux_loss_coef`` > 0, so that transformers'
    loss carries the same load-balancing term.

    Raises:
        ConfigError: a model ``GptOssConfig`` cannot express (no sinks, router or expert biases, no clamp,
            shared experts, dense first layers, sigmoid scores, unnormalised top-k, an expert size other
            than ``intermediate_size``), naming the fields.
    """
    out = {"architectures": [ARCHITECTURES["gpt_oss"]], "model_type": "gpt_oss", "num_hidden_layers": cfg.num_layers,
           "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "intermediate_size": cfg.expert_size, "max_position_embeddings": cfg.max_position_embeddings,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
           "rms_norm_eps": cfg.rms_norm_eps, **rope_to_hf(cfg), "initializer_range": cfg.initializer_range,
           "attention_dropout": 0.0, "attention_bias": cfg.attention_bias == "all", "hidden_act": "silu",
           "sliding_window": cfg.sliding_window or None, "layer_types": list(cfg.layer_kinds),
           "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
           "experts_per_token": cfg.num_experts_per_tok, "swiglu_limit": cfg.swiglu_limit,
           "swiglu_alpha": DEFAULTS["swiglu_alpha"], "router_aux_loss_coef": cfg.router_aux_loss_coef,
           "output_router_logits": cfg.router_aux_loss_coef > 0}
    _check_round_trip(cfg, out)
    return out


def _check_round_trip(cfg: ModelConfig, out: dict) -> None:
    """Refuse an export that ``GptOssConfig`` cannot carry: the fields of :data:`ARCHITECTURE_FIELDS`
    that :func:`config_from_hf` would read back differently."""
    if cfg.swiglu_limit <= 0:
        raise ConfigError(f"model.swiglu_limit={cfg.swiglu_limit!r}: GptOssForCausalLM always clamps its SwiGLU "
                          "(swiglu_limit > 0; GPT-OSS's is 7.0)")
    try:
        back = config_from_hf(out, "gpt_oss")
    except ConfigError as e:
        raise ConfigError(f"{e} (exporting model.type=gpt_oss)") from None
    lost = [f"model.{f}={getattr(cfg, f)!r}" for f in ARCHITECTURE_FIELDS if _normal(f, back) != _normal(f, cfg)]
    if lost:
        raise ConfigError(f"{', '.join(lost)}: the Hugging Face GptOssForCausalLM config has no key for it "
                          "(GPT-OSS has sinks, router and expert biases, a swiglu_limit > 0 and one expert size)")


def _normal(field: str, cfg: ModelConfig):
    """A field's value as the round trip compares it (``layer_types`` by the layers' kinds)."""
    return cfg.layer_kinds if field == "layer_types" else getattr(cfg, field)


def params_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    """``(params, used keys)``: the GPT-OSS params dict (fp32 numpy, unpadded vocabulary) read through
    ``get(key) -> np.ndarray`` and ``has(key) -> bool`` by the key mapping of the module doc."""
    used = set()

    def g(key):
        used.add(key)
        return get(key)

    L = cfg.num_layers

    def stack(name, fn=lambda w: w):
        return np.stack([fn(g(f"model.layers.{i}.{name}")) for i in range(L)])

    layers = {**_attention_from_hf(stack, cfg), **_experts_from_hf(stack)}
    out = {"embed_tokens": g("model.embed_tokens.weight"), "layers": layers, "final_norm": g("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = g("lm_head.weight").T
    elif has("lm_head.weight"):
        used.add("lm_head.weight")  # a tied copy
    return out, used


def _attention_from_hf(stack: Callable, cfg: ModelConfig) -> dict:
    """The norms, q/k/v/o projections, their biases and the sinks, stacked over the layers."""
    d, h, k, q = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"attn_norm": stack("input_layernorm.weight"), "mlp_norm": stack("post_attention_layernorm.weight"),
           "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(d, h, q)),
           "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, q)),
           "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, q)),
           "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(h, q, d)),
           "sinks": stack("self_attn.sinks")}
    if cfg.attention_bias == "all":
        out.update(bq=stack("self_attn.q_proj.bias", lambda b: b.reshape(h, q)),
                   bk=stack("self_attn.k_proj.bias", lambda b: b.reshape(k, q)),
                   bv=stack("self_attn.v_proj.bias", lambda b: b.reshape(k, q)), bo=stack("self_attn.o_proj.bias"))
    return out


def _experts_from_hf(stack: Callable) -> dict:
    """The router and the experts, the fused interleaved gate/up split (gate the even columns)."""
    gate_up, gate_up_bias = stack("mlp.experts.gate_up_proj"), stack("mlp.experts.gate_up_proj_bias")
    return {"router": stack("mlp.router.weight", lambda w: w.T), "router_bias": stack("mlp.router.bias"),
            "moe_w_gate": gate_up[..., ::2], "moe_w_up": gate_up[..., 1::2],
            "moe_gate_bias": gate_up_bias[..., ::2], "moe_up_bias": gate_up_bias[..., 1::2],
            "moe_w_down": stack("mlp.experts.down_proj"), "moe_down_bias": stack("mlp.experts.down_proj_bias")}


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``[..., 2f]`` with ``gate`` in the even and ``up`` in the odd places of the last dim."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def params_to_hf(params: dict, cfg: ModelConfig) -> dict:
    """``{Hugging Face key: np.ndarray}`` of a GPT-OSS params dict (numpy, unpadded vocabulary), by the
    key mapping of the module doc; tied embeddings are written once."""
    lp, d = params["layers"], cfg.hidden_size
    out = {"model.embed_tokens.weight": params["embed_tokens"], "model.norm.weight": params["final_norm"]}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": lp["attn_norm"][i], p + "post_attention_layernorm.weight":
                    lp["mlp_norm"][i], p + "self_attn.o_proj.weight": lp["wo"][i].reshape(-1, d).T,
                    p + "self_attn.sinks": lp["sinks"][i], p + "mlp.router.weight": lp["router"][i].T,
                    p + "mlp.router.bias": lp["router_bias"][i],
                    p + "mlp.experts.gate_up_proj": _interleave(lp["moe_w_gate"][i], lp["moe_w_up"][i]),
                    p + "mlp.experts.gate_up_proj_bias": _interleave(lp["moe_gate_bias"][i], lp["moe_up_bias"][i]),
                    p + "mlp.experts.down_proj": lp["moe_w_down"][i],
                    p + "mlp.experts.down_proj_bias": lp["moe_down_bias"][i]})
        out.update({p + f"self_attn.{n}_proj.weight": lp[f"w{n}"][i].reshape(d, -1).T for n in "qkv"})
        if "bq" in lp:
            out.update({p + f"self_attn.{n}_proj.bias": lp[f"b{n}"][i].reshape(-1) for n in "qkvo"})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    return out


__all__ = ["ARCHITECTURES", "INIT_FROM_KEYS", "config_from_hf", "config_to_hf", "params_from_hf",
           "params_to_hf"]
