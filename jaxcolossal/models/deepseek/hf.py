"""The DeepSeek family's Hugging Face format: ``DeepseekV3ForCausalLM`` (``model_type: deepseek_v3``),
in and out, as transformers' ``models/deepseek_v3`` reads it.

Key mapping of layer ``i`` (torch ``Linear`` weights are ``[out, in]``; h heads, q = nope + rope)::

    self_attn.q_a_proj.weight            [r_q, d]             wq_a [d, r_q]
    self_attn.q_a_layernorm.weight       [r_q]                q_norm
    self_attn.q_b_proj.weight            [h*q, r_q]           wq_b [r_q, h, q]     (rope rows de-interleaved)
    self_attn.q_proj.weight              [h*q, d]             wq [d, h, q]          q_lora_rank null
    self_attn.kv_a_proj_with_mqa.weight  [r_kv + r, d]        wkv_a [d, r_kv] | wk_rope [d, r] (de-interleaved)
    self_attn.kv_a_layernorm.weight      [r_kv]               kv_norm
    self_attn.kv_b_proj.weight           [h*(nope+v), r_kv]   wk_b [r_kv, h, nope] | wv_b [r_kv, h, v]
    self_attn.o_proj.weight              [d, h*v]             wo [h, v, d]
    input_layernorm / post_attention_layernorm                attn_norm / mlp_norm
    mlp.{gate,up,down}_proj.weight                            w_gate / w_up / w_down     i < first_k_dense_replace
    mlp.gate.weight                      [E, d]               router [d, E]
    mlp.gate.e_score_correction_bias     [E]                  router_score_bias [E]
    mlp.experts.{e}.{gate,up,down}_proj.weight                moe_w_gate / moe_w_up [E, d, f], moe_w_down [E, f, d]
    mlp.shared_experts.{gate,up,down}_proj.weight             shared_w_gate / shared_w_up [d, f_s], shared_w_down

The first ``first_k_dense_replace`` layers are ``dense_layers``, the rest ``layers``. DeepSeek lays
each rotary part out in interleaved pairs (``rope_interleave: true``, transformers'
``apply_rotary_pos_emb_interleave``); the rows of ``q_b_proj``/``q_proj``'s rotary part and of
``kv_a_proj_with_mqa``'s rotary key are permuted (evens, then odds) on import so that the model's
rotate-half RoPE computes the same, and back on export, which always writes the interleaved layout.

Every ``config.json`` key that changes transformers' math is read or refused in one line naming it.
Read and not refused because transformers ignores them too: ``aux_loss_alpha``/``seq_aux``
(DeepSeek's balance loss: transformers' loss has none, so ``router_aux_loss_coef`` is 0),
``ep_size``, ``pretraining_tp``, ``num_nextn_predict_layers`` (the multi-token-prediction modules,
whose weights in ``model.layers.{num_hidden_layers}...`` are skipped, as transformers skips them).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.hf_config import refuse, refuse_dropout, refuse_set, rope_from_hf, rope_to_hf

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM"}
"""Hugging Face ``model_type`` -> architecture class, for the forms this family reads."""

INIT_FROM_KEYS = ("rms_norm_eps", "rope_theta", "rope", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "num_shared_experts", "first_k_dense", "n_group", "topk_group", "routed_scaling_factor",
                  "router_score_correction", "norm_topk_prob", "router_scoring")
"""Beyond the shared sizes, the model keys that must equal the checkpoint's for ``model.init_from``."""

HF_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
               "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True}
"""``DeepseekV3Config``'s defaults, for the keys a hand-written ``config.json`` may leave out."""

_MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight", "shared_head.norm.weight",
              "shared_head.head.weight")
"""The multi-token-prediction module's own weights (besides a decoder layer's), in DeepSeek-V3's checkpoints."""


def _refusals(hf: dict, kind: str) -> None:
    """The keys transformers' DeepSeek-V3 honours (or DeepSeek's own code would) that this family does not.

    Raises: ConfigError naming the key."""
    refuse_dropout(hf, kind)
    if hf.get("hidden_act", "silu") != "silu":
        refuse(kind, "hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU) is implemented in this family")
    refuse_set(hf, kind, ("attention_bias",), "biases on q_a_proj / kv_a_proj_with_mqa / o_proj are not implemented here")
    refuse_set(hf, kind, ("quantization_config",), "quantized (FP8 block-scaled) weights are not read here: dequantize "
               "the checkpoint to bf16 first")
    if hf.get("rope_interleave") is False:
        refuse(kind, "rope_interleave", False, "only DeepSeek's interleaved rotary layout (true) is read here")
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
        if hf.get(key, want) != want:
            refuse(kind, key, hf[key], f"only {want!r} is implemented here (DeepSeek-V3's, which transformers runs)")
    if (hf.get("num_key_value_heads") or hf["num_attention_heads"]) != hf["num_attention_heads"]:
        refuse(kind, "num_key_value_heads", hf["num_key_value_heads"], "multi-head latent attention expands one "
               "key/value per query head: it must equal num_attention_heads")
    groups, experts = hf.get("n_group") or 1, hf["n_routed_experts"]
    if groups > 1 and (experts % groups or experts // groups < 2):
        refuse(kind, "n_group", groups, f"the {experts} routed experts must split into groups of at least 2")


def _moe_fields(hf: dict) -> dict:
    """The mixture-of-experts fields of a config whose layers from ``first_k_dense_replace`` on are MoE."""
    return dict(num_experts=int(hf["n_routed_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]), num_shared_experts=int(hf["n_shared_experts"]),
                first_k_dense=int(hf["first_k_dense_replace"] or 0), router_scoring="sigmoid",
                norm_topk_prob=bool(hf["norm_topk_prob"]), routed_scaling_factor=float(hf["routed_scaling_factor"]),
                n_group=int(hf["n_group"] or 1), topk_group=int(hf["topk_group"] or 1), router_score_correction=True,
                router_aux_loss_coef=0.0)  # transformers' DeepSeek-V3 loss has no load-balancing term


def config_from_hf(hf: dict, kind: str) -> ModelConfig:
    """A :class:`ModelConfig` (``type=deepseek``) from a ``config.json`` dict of ``model_type`` ``kind``.

    Reads the sizes, ``rms_norm_eps``, ``initializer_range``, ``tie_word_embeddings``, RoPE (``rope_scaling``
    + ``rope_theta`` or ``rope_parameters``: yarn with ``mscale``/``mscale_all_dim``), MLA's ``q_lora_rank``
    (null: a plain ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
    and the mixture of experts: ``first_k_dense_replace`` (all layers dense when it reaches
    ``num_hidden_layers``), ``n_routed_experts``, ``n_shared_experts``, ``moe_intermediate_size``,
    ``num_experts_per_tok``, ``n_group``, ``topk_group``, ``routed_scaling_factor``, ``norm_topk_prob``;
    missing keys take ``DeepseekV3Config``'s defaults (:data:`HF_DEFAULTS`).

    Raises:
        ConfigError: a key that changes the math and is not implemented (:func:`_refusals`).
    """
    hf = {**HF_DEFAULTS, **hf}
    _refusals(hf, kind)
    rope, theta = rope_from_hf(hf, kind)
    fields = dict(
        type="deepseek", hf_model_type=kind, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], max_position_embeddings=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        rms_norm_eps=float(hf["rms_norm_eps"]), rope_theta=theta, rope=rope,
        initializer_range=float(hf["initializer_range"]), q_lora_rank=int(hf["q_lora_rank"] or 0),
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]))
    if (hf["first_k_dense_replace"] or 0) < hf["num_hidden_layers"]:
        fields.update(_moe_fields(hf))
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict that transformers reads back as ``cfg`` (the inverse of
    :func:`config_from_hf`), without the dtype keys :func:`jaxcolossal.models.hf_io.config_to_hf` adds. A
    dense model is written with ``first_k_dense_replace = num_hidden_layers``; a model without the
    score-correction bias with a zero one; no multi-token-prediction module.

    Raises:
        ConfigError: a softmax router (transformers' DeepSeek-V3 scores with a sigmoid).
    """
    if cfg.moe and cfg.router_scoring != "sigmoid":
        raise ConfigError("model.router_scoring=softmax: the Hugging Face DeepseekV3ForCausalLM scores its experts "
                          "with a sigmoid (set model.router_scoring=sigmoid)")
    out = {"architectures": [ARCHITECTURES["deepseek_v3"]], "model_type": "deepseek_v3",
           "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
           "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
           "intermediate_size": cfg.intermediate_size, "max_position_embeddings": cfg.max_position_embeddings,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
           "rms_norm_eps": cfg.rms_norm_eps, "initializer_range": cfg.initializer_range, **rope_to_hf(cfg),
           "rope_interleave": True, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
           "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
           "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
           "v_head_dim": cfg.v_head_dim, "num_nextn_predict_layers": 0, "topk_method": "noaux_tc",
           "scoring_func": "sigmoid"}
    if not cfg.moe:  # every layer dense; the MoE keys are unused
        return {**out, "first_k_dense_replace": cfg.num_layers, "n_routed_experts": 1, "n_shared_experts": 0,
                "num_experts_per_tok": 1, "moe_intermediate_size": cfg.intermediate_size, "n_group": 1,
                "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True}
    return {**out, "first_k_dense_replace": cfg.first_k_dense, "n_routed_experts": cfg.num_experts,
            "n_shared_experts": cfg.num_shared_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.expert_size, "n_group": max(cfg.n_group, 1),
            "topk_group": cfg.topk_group if cfg.n_group > 1 else 1, "norm_topk_prob": cfg.norm_topk_prob,
            "routed_scaling_factor": cfg.routed_scaling_factor}


def _deinterleave(r: int) -> np.ndarray:
    """The permutation of ``r`` rotary rows from DeepSeek's interleaved pairs to rotate-half: evens, then odds."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def _heads_from_hf(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """A query projection's ``[h*q, in]`` (``q_b_proj``, ``q_proj``, or a LoRA B ``[h*q, r]``) as ``[in, h,
    q]``, the rotary rows of each head de-interleaved."""
    nope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    perm = np.concatenate([np.arange(nope), nope + _deinterleave(r)])
    return w.reshape(cfg.num_attention_heads, nope + r, -1)[:, perm].transpose(2, 0, 1)


def _heads_to_hf(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The inverse of :func:`_heads_from_hf`: ``[in, h, q]`` -> ``[h*q, in]``, the rotary rows interleaved."""
    nope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    back = np.argsort(np.concatenate([np.arange(nope), nope + _deinterleave(r)]))
    return w.transpose(1, 2, 0)[:, back].reshape(cfg.num_attention_heads * (nope + r), -1)


def _kv_a_from_hf(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``kv_a_proj_with_mqa``'s ``[r_kv + r, in]`` (or its LoRA B ``[r_kv + r, rank]``) as the latent's
    ``[in, r_kv]`` and the rotary key's ``[in, r]``, de-interleaved."""
    rkv = cfg.kv_lora_rank
    return w[:rkv].T, w[rkv:][_deinterleave(cfg.qk_rope_head_dim)].T


def _kv_a_to_hf(latent: np.ndarray, k_rope: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The inverse of :func:`_kv_a_from_hf`: ``[in, r_kv]`` and ``[in, r]`` -> ``[r_kv + r, in]``."""
    return np.concatenate([latent.T, k_rope.T[np.argsort(_deinterleave(cfg.qk_rope_head_dim))]])


def _kv_b_from_hf(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``kv_b_proj``'s ``[h*(nope+v), in]`` (or its LoRA B) as the keys' ``[in, h, nope]`` and the values'
    ``[in, h, v]``."""
    nope = cfg.qk_nope_head_dim
    w = w.reshape(cfg.num_attention_heads, nope + cfg.v_head_dim, -1)
    return w[:, :nope].transpose(2, 0, 1), w[:, nope:].transpose(2, 0, 1)


def _kv_b_to_hf(k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_kv_b_from_hf`: ``[in, h, nope]`` and ``[in, h, v]`` -> ``[h*(nope+v), in]``."""
    kv = np.concatenate([k, v], axis=-1)  # [in, h, nope + v]
    return kv.transpose(1, 2, 0).reshape(-1, kv.shape[0])


def lora_b_from_hf(name: str, b: np.ndarray, cfg: ModelConfig) -> dict:
    """One layer's LoRA B of the Hugging Face module whose adapter sits on weight ``name``
    (:data:`jaxcolossal.models.layers.lora.WEIGHTS`), PEFT's ``[out_features, rank]``, as this family's B
    parts ``{weight: [rank, *out]}``: the query heads' rotary rows de-interleaved, ``kv_a_proj_with_mqa``'s
    rows split into ``wkv_a`` and ``wk_rope``, ``kv_b_proj``'s into ``wk_b`` and ``wv_b`` (as the weights:
    the module doc)."""
    if name in ("wq", "wq_b"):
        return {name: _heads_from_hf(b, cfg)}
    if name == "wkv_a":
        return dict(zip(("wkv_a", "wk_rope"), _kv_a_from_hf(b, cfg)))
    if name == "wk_b":
        return dict(zip(("wk_b", "wv_b"), _kv_b_from_hf(b, cfg)))
    return {name: b.T}  # q_a_proj, o_proj: one output dimension


def lora_b_to_hf(name: str, parts: dict, cfg: ModelConfig) -> np.ndarray:
    """The inverse of :func:`lora_b_from_hf`: B parts ``{weight: [rank, *out]}`` -> ``[out_features, rank]``."""
    if name in ("wq", "wq_b"):
        return _heads_to_hf(parts[name], cfg)
    if name == "wkv_a":
        return _kv_a_to_hf(parts["wkv_a"], parts["wk_rope"], cfg)
    if name == "wk_b":
        return _kv_b_to_hf(parts["wk_b"], parts["wv_b"])
    return parts[name].T


def _attention_from_hf(g: Callable, cfg: ModelConfig, i: int) -> dict:
    """Layer ``i``'s norms and MLA weights (module doc), the rotary rows de-interleaved."""
    a, d, h = f"model.layers.{i}.self_attn.", cfg.hidden_size, cfg.num_attention_heads
    out = {"attn_norm": g(f"model.layers.{i}.input_layernorm.weight"),
           "mlp_norm": g(f"model.layers.{i}.post_attention_layernorm.weight")}
    if cfg.q_lora_rank:
        out.update(wq_a=g(a + "q_a_proj.weight").T, q_norm=g(a + "q_a_layernorm.weight"),
                   wq_b=_heads_from_hf(g(a + "q_b_proj.weight"), cfg))
    else:
        out["wq"] = _heads_from_hf(g(a + "q_proj.weight"), cfg)
    wkv_a, wk_rope = _kv_a_from_hf(g(a + "kv_a_proj_with_mqa.weight"), cfg)
    wk_b, wv_b = _kv_b_from_hf(g(a + "kv_b_proj.weight"), cfg)
    out.update(wkv_a=wkv_a, wk_rope=wk_rope, kv_norm=g(a + "kv_a_layernorm.weight"), wk_b=wk_b, wv_b=wv_b,
               wo=g(a + "o_proj.weight").T.reshape(h, cfg.v_head_dim, d))
    return out


def _mlp_from_hf(g: Callable, cfg: ModelConfig, i: int, experts: bool) -> dict:
    """Layer ``i``'s dense SwiGLU, or its router (with the score-correction bias), experts and shared experts."""
    m = f"model.layers.{i}.mlp."
    if not experts:
        return {"w_gate": g(m + "gate_proj.weight").T, "w_up": g(m + "up_proj.weight").T,
                "w_down": g(m + "down_proj.weight").T}
    out = {"router": g(m + "gate.weight").T}
    if cfg.router_score_correction:
        out["router_score_bias"] = g(m + "gate.e_score_correction_bias")
    for ours, theirs in (("moe_w_gate", "gate_proj"), ("moe_w_up", "up_proj"), ("moe_w_down", "down_proj")):
        out[ours] = np.stack([g(f"{m}experts.{e}.{theirs}.weight").T for e in range(cfg.num_experts)])
    if cfg.num_shared_experts:
        out.update(shared_w_gate=g(m + "shared_experts.gate_proj.weight").T,
                   shared_w_up=g(m + "shared_experts.up_proj.weight").T,
                   shared_w_down=g(m + "shared_experts.down_proj.weight").T)
    return out


def _stack(layers: list[dict]) -> dict:
    return {k: np.stack([lp[k] for lp in layers]) for k in layers[0]}


def _mtp_keys(has: Callable, cfg: ModelConfig) -> set:
    """The weights of the multi-token-prediction modules after the last layer (``model.layers.{L + j}``:
    their own :data:`_MTP_NAMES` and a decoder layer's), which transformers does not load either."""
    found, j = set(), cfg.num_layers
    layer = [f"self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
                                               "kv_a_layernorm", "kv_b_proj", "o_proj")]
    layer += ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
              "mlp.gate.e_score_correction_bias"]
    layer += [f"mlp.{s}{w}_proj.weight" for s in ["shared_experts.", ""] + [f"experts.{e}." for e in
                                                                             range(cfg.num_experts)]
              for w in ("gate", "up", "down")]
    while has(f"model.layers.{j}.eh_proj.weight"):
        found |= {k for k in (f"model.layers.{j}.{n}" for n in _MTP_NAMES + tuple(layer)) if has(k)}
        j += 1
    return found


def params_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    """``(params, used keys)``: the DeepSeek params dict (fp32 numpy, unpadded vocabulary) read through
    ``get(key) -> np.ndarray`` and ``has(key) -> bool`` by the module doc's mapping; the
    multi-token-prediction weights count as used (skipped)."""
    used = set()

    def g(key):
        used.add(key)
        return get(key)

    k = cfg.first_k_dense if cfg.moe else 0
    layers = [{**_attention_from_hf(g, cfg, i), **_mlp_from_hf(g, cfg, i, cfg.moe and i >= k)}
              for i in range(cfg.num_layers)]
    out = {"embed_tokens": g("model.embed_tokens.weight"), "layers": _stack(layers[k:]),
           "final_norm": g("model.norm.weight")}
    if k:
        out["dense_layers"] = _stack(layers[:k])
    if not cfg.tie_word_embeddings:
        out["lm_head"] = g("lm_head.weight").T
    elif has("lm_head.weight"):
        used.add("lm_head.weight")  # a tied copy
    return out, used | _mtp_keys(has, cfg)


def _layer_to_hf(lp: dict, cfg: ModelConfig, i: int, j: int) -> dict:
    """Layer ``i`` (index ``j`` of its stack ``lp``) under Hugging Face's names, the rotary rows interleaved."""
    p, a, d = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", cfg.hidden_size

    out = {p + "input_layernorm.weight": lp["attn_norm"][j], p + "post_attention_layernorm.weight": lp["mlp_norm"][j]}
    if "wq_a" in lp:
        out.update({a + "q_a_proj.weight": lp["wq_a"][j].T, a + "q_a_layernorm.weight": lp["q_norm"][j],
                    a + "q_b_proj.weight": _heads_to_hf(lp["wq_b"][j], cfg)})
    else:
        out[a + "q_proj.weight"] = _heads_to_hf(lp["wq"][j], cfg)
    out.update({a + "kv_a_proj_with_mqa.weight": _kv_a_to_hf(lp["wkv_a"][j], lp["wk_rope"][j], cfg),
                a + "kv_a_layernorm.weight": lp["kv_norm"][j],
                a + "kv_b_proj.weight": _kv_b_to_hf(lp["wk_b"][j], lp["wv_b"][j]),
                a + "o_proj.weight": lp["wo"][j].reshape(-1, d).T})
    return {**out, **_mlp_to_hf(lp, cfg, i, j)}


def _mlp_to_hf(lp: dict, cfg: ModelConfig, i: int, j: int) -> dict:
    """Layer ``i``'s MLP (index ``j`` of its stack) under Hugging Face's names."""
    m = f"model.layers.{i}.mlp."
    if "router" not in lp:
        return {m + "gate_proj.weight": lp["w_gate"][j].T, m + "up_proj.weight": lp["w_up"][j].T,
                m + "down_proj.weight": lp["w_down"][j].T}
    bias = lp["router_score_bias"][j] if "router_score_bias" in lp else np.zeros((cfg.num_experts,), np.float32)
    out = {m + "gate.weight": lp["router"][j].T, m + "gate.e_score_correction_bias": bias}
    for e in range(cfg.num_experts):
        out.update({f"{m}experts.{e}.gate_proj.weight": lp["moe_w_gate"][j, e].T,
                    f"{m}experts.{e}.up_proj.weight": lp["moe_w_up"][j, e].T,
                    f"{m}experts.{e}.down_proj.weight": lp["moe_w_down"][j, e].T})
    if "shared_w_gate" in lp:
        out.update({m + "shared_experts.gate_proj.weight": lp["shared_w_gate"][j].T,
                    m + "shared_experts.up_proj.weight": lp["shared_w_up"][j].T,
                    m + "shared_experts.down_proj.weight": lp["shared_w_down"][j].T})
    return out


def params_to_hf(params: dict, cfg: ModelConfig) -> dict:
    """The Hugging Face tensors (fp32 numpy, torch's ``[out, in]``) of ``params`` (unpadded vocabulary)."""
    k = cfg.first_k_dense if "dense_layers" in params else 0
    out = {"model.embed_tokens.weight": params["embed_tokens"], "model.norm.weight": params["final_norm"]}
    for i in range(cfg.num_layers):
        stack, j = (params["dense_layers"], i) if i < k else (params["layers"], i - k)
        out.update(_layer_to_hf(stack, cfg, i, j))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    return out
