"""Hugging Face's mixture-of-experts LLaMA variants, in and out: ``MixtralForCausalLM`` and
``Qwen3MoeForCausalLM`` (:mod:`jaxcolossal.models.hf_io` calls these for their configs and MLP weights;
the attention's keys are LLaMA's).

Layer ``i``'s MoE weights (``E`` experts of size ``f``)::

    Mixtral                                          Qwen3-MoE                               jaxcolossal
    block_sparse_moe.gate.weight        [E, d]       mlp.gate.weight             [E, d]      router     [L, d, E]
    block_sparse_moe.experts.{e}.w1     [f, d]       mlp.experts.{e}.gate_proj   [f, d]      moe_w_gate [L, E, d, f]
    block_sparse_moe.experts.{e}.w3     [f, d]       mlp.experts.{e}.up_proj     [f, d]      moe_w_up   [L, E, d, f]
    block_sparse_moe.experts.{e}.w2     [d, f]       mlp.experts.{e}.down_proj   [d, f]      moe_w_down [L, E, f, d]
                                                     self_attn.q_norm / k_norm   [q]         q_norm / k_norm [L, q]

Mixtral's router is softmax, top-k, renormalised; Qwen3-MoE's renormalises when its config's
``norm_topk_prob`` says so. DeepSeek-style settings (shared experts, dense first layers, sigmoid
scores) have no such architecture here and are refused on export.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxcolossal.config import ConfigError, ModelConfig

FLAVOURS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_EXPERT_KEYS = {"mixtral": ("block_sparse_moe.", "gate.weight", "w1", "w3", "w2"),
                "qwen3_moe": ("mlp.", "gate.weight", "gate_proj", "up_proj", "down_proj")}


def flavour(cfg: ModelConfig) -> str | None:
    """The Hugging Face architecture of a LLaMA-family config: ``mixtral``, ``qwen3_moe``, or
    ``None`` for a dense LLaMA.

    Raises:
        ConfigError: a mixture of experts with no such architecture (shared experts, dense first
            layers, sigmoid scores, a capacity factor).
    """
    if not cfg.moe:
        return None
    odd = {"num_shared_experts": cfg.num_shared_experts, "first_k_dense": cfg.first_k_dense,
           "router_scoring": cfg.router_scoring != "softmax"}
    bad = [f"model.{k}" for k, v in odd.items() if v]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: no Hugging Face architecture here has it (Mixtral and Qwen3-MoE do not)")
    if cfg.qk_norm:
        return "qwen3_moe"
    if not cfg.norm_topk_prob or cfg.moe_intermediate_size not in (0, cfg.intermediate_size):
        raise ConfigError("a Mixtral export needs model.norm_topk_prob=true and the experts' size equal to "
                          "model.intermediate_size (Qwen3-MoE, which has both, also has model.qk_norm=true)")
    return "mixtral"


def config_from_hf(hf: dict, kind: str, base: dict) -> dict:
    """The MoE keys of a :class:`ModelConfig` from a Mixtral or Qwen3-MoE ``config.json`` (``base``:
    the LLaMA keys already read).

    Raises:
        ConfigError: router jitter, or (Qwen3-MoE) dense layers among the MoE ones.
    """
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"Hugging Face {kind} config: router_jitter_noise={hf['router_jitter_noise']} is not supported")
    out = {**base, "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
           "router_aux_loss_form": "pooled",  # transformers' load_balancing_loss_func, whatever the default
           "num_experts_per_tok": int(hf["num_experts_per_tok"])}
    if kind == "mixtral":
        return {**out, "num_experts": int(hf["num_local_experts"]), "norm_topk_prob": True}
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError("Hugging Face qwen3_moe config: mlp_only_layers / decoder_sparse_step (dense layers among "
                          "the MoE ones) are not supported")
    experts = hf.get("num_experts") or hf["num_local_experts"]  # transformers 5 writes the latter
    return {**out, "num_experts": int(experts), "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "qk_norm": True}


def config_to_hf(cfg: ModelConfig, base: dict) -> dict:
    """``base`` (the LLaMA ``config.json``) turned into ``cfg``'s MoE architecture's."""
    kind = flavour(cfg)
    out = {**base, "architectures": [FLAVOURS[kind]], "model_type": kind,
           "num_experts_per_tok": cfg.num_experts_per_tok, "router_aux_loss_coef": cfg.router_aux_loss_coef,
           "output_router_logits": False}
    out.pop("mlp_bias", None)
    if kind == "mixtral":
        out.pop("attention_bias", None)
        return {**out, "num_local_experts": cfg.num_experts, "router_jitter_noise": 0.0}
    return {**out, "num_experts": cfg.num_experts, "num_local_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_size,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}


def mlp_from_hf(g: Callable[[str], np.ndarray], cfg: ModelConfig, layers: int) -> dict:
    """The MoE layers' leaves (router, experts, q/k norms), stacked over ``layers``, read by ``g``."""
    kind = flavour(cfg)
    pre, router, w1, w3, w2 = _EXPERT_KEYS[kind]
    E = cfg.num_experts

    def experts(name, fn):
        return np.stack([np.stack([fn(g(f"model.layers.{i}.{pre}experts.{e}.{name}.weight")) for e in range(E)])
                         for i in range(layers)])

    out = {"router": np.stack([g(f"model.layers.{i}.{pre}{router}").T for i in range(layers)]),
           "moe_w_gate": experts(w1, lambda w: w.T), "moe_w_up": experts(w3, lambda w: w.T),
           "moe_w_down": experts(w2, lambda w: w.T)}
    return out


def mlp_to_hf(lp: dict, cfg: ModelConfig, i: int) -> dict[str, Any]:
    """Layer ``i``'s MoE tensors under Hugging Face's names."""
    pre, router, w1, w3, w2 = _EXPERT_KEYS[flavour(cfg)]
    p = f"model.layers.{i}."
    out = {p + pre + router: lp["router"][i].T}
    for e in range(cfg.num_experts):
        q = f"{p}{pre}experts.{e}."
        out.update({q + w1 + ".weight": lp["moe_w_gate"][i, e].T, q + w3 + ".weight": lp["moe_w_up"][i, e].T,
                    q + w2 + ".weight": lp["moe_w_down"][i, e].T})
    return out
