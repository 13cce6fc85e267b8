"""The GPT-2 family's Hugging Face format: ``GPT2LMHeadModel``.

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

The folder-level reading and writing (safetensors, ``config.json``, vocabulary padding) is
:mod:`jaxcolossal.models.hf_io`'s, for every family.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxcolossal.config import ConfigError, ModelConfig

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel"}
"""Hugging Face ``model_type`` -> architecture class."""

INIT_FROM_KEYS = ("max_position_embeddings", "layer_norm_eps")
"""Beyond the shared sizes, the model keys that must equal the checkpoint's for ``model.init_from``."""


def config_from_hf(hf: dict, kind: str = "gpt2") -> ModelConfig:
    """A :class:`ModelConfig` from a GPT-2 ``config.json`` dict: ``n_layer, n_embd, n_head, n_inner``
    (None: 4·n_embd), ``n_positions, vocab_size, layer_norm_epsilon, tie_word_embeddings,
    initializer_range``.

    Raises:
        ConfigError: an activation other than the tanh GELU, unscaled or layer-scaled attention,
            cross-attention.
    """
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
    return ModelConfig(
        type="gpt2", num_layers=hf["n_layer"], hidden_size=d, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=hf.get("n_inner") or 4 * d,
        max_position_embeddings=hf.get("n_positions", 1024), vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        initializer_range=float(hf.get("initializer_range", 0.02)))


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict that ``transformers`` reads back as ``cfg`` (the inverse of
    :func:`config_from_hf`), without the dtype keys that :func:`jaxcolossal.models.hf_io.config_to_hf` adds."""
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
    return out


def params_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    """``(params, used keys)``: the GPT-2 params dict (fp32 numpy, unpadded vocabulary) read through
    ``get(key) -> np.ndarray`` and ``has(key) -> bool`` by the key mapping of the module doc."""
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


def params_to_hf(params: dict, cfg: ModelConfig) -> dict:
    """``{Hugging Face key: np.ndarray}`` of a GPT-2 params dict (numpy, unpadded vocabulary), by
    the key mapping of the module doc; tied embeddings are written once."""
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
