"""The Gemma family's Hugging Face format: ``Gemma2ForCausalLM`` (``model_type: gemma2``) and the text-only
``Gemma3ForCausalLM`` (``gemma3_text``); and the language model of the multimodal
``Gemma3ForConditionalGeneration`` (``gemma3``: Gemma 3 4B, 12B, 27B), read from its ``text_config`` and
its ``language_model`` weights (the vision tower and projector are left unused:
:data:`jaxcolossal.models.hf_io._TOWERS`), and exported as the text-only ``Gemma3ForCausalLM``.

Key mapping (torch ``Linear`` weights are ``[out, in]``; L layers, i a layer)::

    model.embed_tokens.weight                       [V, d]     embed_tokens [v, d]
    model.layers.i.input_layernorm.weight           [d]        layers.attn_norm [L, d]
    model.layers.i.self_attn.q_proj.weight          [h*q, d]   layers.wq [L, d, h, q]
    model.layers.i.self_attn.k_proj.weight          [k*q, d]   layers.wk [L, d, k, q]   (v_proj alike: wv)
    model.layers.i.self_attn.o_proj.weight          [d, h*q]   layers.wo [L, h, q, d]
    model.layers.i.self_attn.q_norm.weight          [q]        layers.q_norm [L, q]     (Gemma 3; k_norm alike)
    model.layers.i.post_attention_layernorm.weight  [d]        layers.attn_post_norm [L, d]
    model.layers.i.pre_feedforward_layernorm.weight [d]        layers.mlp_norm [L, d]
    model.layers.i.post_feedforward_layernorm.weight [d]       layers.mlp_post_norm [L, d]
    model.layers.i.mlp.gate_proj.weight             [f, d]     layers.w_gate [L, d, f]  (up_proj alike: w_up)
    model.layers.i.mlp.down_proj.weight             [d, f]     layers.w_down [L, f, d]
    model.norm.weight                               [d]        final_norm [d]
    lm_head.weight                                  [V, d]     lm_head [d, v]  (absent when tied, as in every Gemma)

A ``Gemma3ForConditionalGeneration`` checkpoint holds the same tensors under ``language_model.model.``
(transformers 4, and 5's saved form) or ``model.language_model.`` instead of ``model.``.

The norm weights are stored as transformers stores them (``w`` of ``1 + w``). Every ``config.json``
key that changes the math is read or refused in one line naming it (:mod:`jaxcolossal.models.hf_config`);
a key the config leaves out takes transformers' default (:data:`DEFAULTS`: Gemma 2's soft-caps 50 and
30, a 4096-token window, ``head_dim`` and ``query_pre_attn_scalar`` 256, ...).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.hf_config import (
    head_dim_from_hf,
    refuse,
    refuse_dropout,
    refuse_set,
    rope_from_hf,
    rope_to_hf,
)

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "gemma3": "Gemma3ForConditionalGeneration"}
"""Hugging Face ``model_type`` -> architecture class (``gemma3``: its language model is read, and exported
as ``gemma3_text``)."""

TEXT_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
"""Where the text model's tensors sit: a causal LM's ``model.``, a ``Gemma3ForConditionalGeneration``'s
``language_model.model.`` (transformers 4's names, which 5 still saves) or ``model.language_model.``."""

INIT_FROM_KEYS = ("rms_norm_eps", "rope_theta", "rope", "rope_local_theta", "attention_head_dim", "qk_norm",
                  "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping")
"""Beyond the shared sizes, the model keys that must equal the checkpoint's for ``model.init_from``."""

_COMMON = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
               initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
               query_pre_attn_scalar=256, sliding_window=4096)
DEFAULTS = {"gemma2": {**_COMMON, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
                       "attn_logit_softcapping": 50.0, "sliding_window_pattern": 2},
            "gemma3_text": {**_COMMON, "vocab_size": 262208, "max_position_embeddings": 131072,
                            "final_logit_softcapping": None, "attn_logit_softcapping": None,
                            "sliding_window_pattern": 6}}
"""transformers' ``Gemma2Config``/``Gemma3TextConfig`` defaults of the keys read here: what a
``config.json`` that leaves a key out means (``sliding_window_pattern``: every n-th layer global,
the layer pattern of a config without ``layer_types``)."""

GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
"""Gemma 3's default RoPE bases of its global and local layers (``Gemma3TextConfig.default_theta``)."""

ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                       "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "rope", "rope_local_theta",
                       "attention_head_dim", "qk_norm", "sliding_window", "layer_types", "query_pre_attn_scalar",
                       "attn_logit_softcapping", "final_logit_softcapping")
"""What an export must carry: ``config_from_hf(config_to_hf(cfg))`` equals ``cfg`` in these fields."""


def _refusals(hf: dict, kind: str) -> None:
    """The keys of a Gemma config that change the math and are not implemented, refused by name."""
    refuse_dropout(hf, kind)
    if hf["hidden_activation"] != "gelu_pytorch_tanh":
        refuse(kind, "hidden_activation", hf["hidden_activation"], "only 'gelu_pytorch_tanh' (Gemma's GeGLU) is "
               "implemented in this family")
    refuse_set(hf, kind, ("attention_bias",), "Gemma's projections have no bias here")
    refuse_set(hf, kind, ("use_bidirectional_attention",), "bidirectional attention (an encoder) is not "
               "implemented; this family is causal")
    if hf.get("partial_rotary_factor") not in (None, 1, 1.0):
        refuse(kind, "partial_rotary_factor", hf["partial_rotary_factor"], "Gemma rotates whole heads here")
    if kind == "gemma3_text":
        refuse_set(hf, kind, ("attn_logit_softcapping",), "transformers' Gemma 3 attention does not apply it "
                   "(set it to null)")


def _layer_types(hf: dict) -> list[str]:
    """Each layer's kind: ``layer_types``, else every ``sliding_window_pattern``-th layer global."""
    n = hf["num_hidden_layers"]
    return list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % hf["sliding_window_pattern"] else
                                          "full_attention" for i in range(n)])


def _gemma3_rope(hf: dict, kind: str) -> dict:
    """``model.rope``, ``rope_theta`` and ``rope_local_theta`` of a Gemma 3 config, as
    ``Gemma3TextConfig.convert_rope_params_to_dict`` reads them: transformers 5's per-layer-kind
    ``rope_parameters``, or transformers 4's ``rope_scaling`` (the global layers'), ``rope_theta`` and
    ``rope_local_base_freq``. The local layers must use plain RoPE, or the global layers' own RoPE
    (then ``rope_local_theta`` is 0).

    Raises:
        ConfigError: a local RoPE scaling that differs from the global one, named."""
    params = hf.get("rope_parameters") or {}
    if not any(isinstance(v, dict) for v in params.values()):  # a flat dict or none: the global layers'
        params = {"full_attention": dict(params)} if params else {}
    full = {"rope_type": "default", **(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    local = {"rope_type": "default", **(params.get("sliding_attention") or {})}
    full.setdefault("rope_theta", hf.get("rope_theta", GEMMA3_THETA["full_attention"]))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", GEMMA3_THETA["sliding_attention"]))
    nested = {**hf, "rope_scaling": None, "rope_parameters": {"full_attention": full, "sliding_attention": local}}
    rope, theta = rope_from_hf(nested, kind, layer_kind="full_attention")
    local_rope, local_theta = rope_from_hf(nested, kind, layer_kind="sliding_attention")
    if (local_rope, local_theta) == (rope, theta):
        return {"rope": rope, "rope_theta": theta, "rope_local_theta": 0.0}
    if local_rope.type != "default":
        refuse(kind, "rope_parameters.sliding_attention.rope_type", local_rope.type, "the local layers take plain "
               "RoPE or the global layers' own here")
    return {"rope": rope, "rope_theta": theta, "rope_local_theta": local_theta}


def _capping(hf: dict, key: str) -> float:
    """A soft-cap of the config: its value, 0 for null (none)."""
    return 0.0 if hf[key] is None else float(hf[key])


def _text_config(hf: dict, kind: str) -> dict:
    """The ``text_config`` of a ``Gemma3ForConditionalGeneration`` config, with the top level's
    ``tie_word_embeddings`` (which ties its LM head) when it sets one.

    Raises:
        ConfigError: no ``text_config``, or one that is not Gemma 3's (named)."""
    text = dict(hf.get("text_config") or {})
    if text.get("model_type", "gemma3_text") != "gemma3_text" or not text:
        refuse(kind, "text_config", text.get("model_type"), "expected Gemma 3's text model (model_type gemma3_text)")
    if hf.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def config_from_hf(hf: dict, kind: str) -> ModelConfig:
    """A :class:`ModelConfig` (``type=gemma``) from a ``config.json`` dict whose ``model_type`` is ``kind``.

    Reads the sizes, ``head_dim``, ``rms_norm_eps``, ``initializer_range``, ``tie_word_embeddings``,
    RoPE (Gemma 2: ``rope_parameters`` or ``rope_scaling``/``rope_theta``; Gemma 3 per layer kind:
    :func:`_gemma3_rope`), ``layer_types`` (else ``sliding_window_pattern``), ``sliding_window``,
    ``query_pre_attn_scalar``, ``attn_logit_softcapping`` (Gemma 2), ``final_logit_softcapping``;
    Gemma 3 has q/k norms (``qk_norm``). A key left out takes transformers' default (:data:`DEFAULTS`).
    ``gemma3`` (multimodal): its ``text_config`` (:func:`_text_config`), read as ``gemma3_text``.

    Raises:
        ConfigError: a key that changes the math and is not implemented, named (:func:`_refusals`; a
            ``sliding_window`` of null with sliding layers).
    """
    source, kind = kind, "gemma3_text" if kind == "gemma3" else kind
    if source == "gemma3":
        hf = _text_config(hf, source)
    hf = {**DEFAULTS[kind], **{k: v for k, v in hf.items() if v is not None or k in (
        "final_logit_softcapping", "attn_logit_softcapping", "sliding_window")}}
    _refusals(hf, kind)
    kinds = _layer_types(hf)
    sliding = "sliding_attention" in kinds
    if sliding and not hf["sliding_window"]:
        refuse(kind, "sliding_window", hf["sliding_window"], "the layers marked sliding_attention need a window")
    if kind == "gemma3_text":
        rope = _gemma3_rope(hf, kind)
    else:
        r, theta = rope_from_hf(hf, kind)
        rope = {"rope": r, "rope_theta": theta}
    return ModelConfig(
        type="gemma", hf_model_type=source, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
        intermediate_size=hf["intermediate_size"], max_position_embeddings=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        rms_norm_eps=float(hf["rms_norm_eps"]), initializer_range=float(hf["initializer_range"]),
        attention_head_dim=head_dim_from_hf(hf), qk_norm=kind == "gemma3_text",
        sliding_window=int(hf["sliding_window"]) if sliding else 0, layer_types=",".join(kinds) if sliding else "",
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        attn_logit_softcapping=_capping(hf, "attn_logit_softcapping"),
        final_logit_softcapping=_capping(hf, "final_logit_softcapping"), **rope)


def architecture(cfg: ModelConfig) -> str:
    """The ``model_type`` an export writes: ``model.hf_model_type`` when set (the text-only ``gemma3_text``
    for a multimodal ``gemma3``), else Gemma 3's text model for q/k norms, else Gemma 2."""
    if cfg.hf_model_type == "gemma3":
        return "gemma3_text"
    return cfg.hf_model_type or ("gemma3_text" if cfg.qk_norm else "gemma2")


def _rope_to_hf(cfg: ModelConfig, kind: str) -> dict:
    """The RoPE keys of ``kind``'s config: Gemma 2's as every family writes them; Gemma 3's per layer kind
    (``rope_parameters``) and in transformers 4's form (``rope_scaling``, ``rope_theta``, ``rope_local_base_freq``)."""
    keys = rope_to_hf(cfg)
    if kind != "gemma3_text":
        return keys
    full = keys["rope_parameters"]
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta} if cfg.rope_local_theta else dict(full)
    return {**keys, "rope_local_base_freq": local["rope_theta"],
            "rope_parameters": {"full_attention": full, "sliding_attention": local}}


def config_to_hf(cfg: ModelConfig) -> dict:
    """The ``config.json`` dict that ``transformers`` reads back as ``cfg`` (the inverse of
    :func:`config_from_hf`), without the dtype keys that :func:`jaxcolossal.models.hf_io.config_to_hf` adds.

    Raises:
        ConfigError: a model the target architecture (:func:`architecture`) cannot express, naming the
            fields that would not survive the round trip.
    """
    kind = architecture(cfg)
    out = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "num_hidden_layers": cfg.num_layers,
           "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
           "intermediate_size": cfg.intermediate_size, "max_position_embeddings": cfg.max_position_embeddings,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_word_embeddings,
           "rms_norm_eps": cfg.rms_norm_eps, **_rope_to_hf(cfg, kind), "hidden_activation": "gelu_pytorch_tanh",
           "initializer_range": cfg.initializer_range, "attention_dropout": 0.0, "attention_bias": False,
           "query_pre_attn_scalar": _whole(cfg.query_pre_attn_scalar or cfg.head_dim),
           "sliding_window": cfg.sliding_window or None, "layer_types": list(cfg.layer_kinds),
           "final_logit_softcapping": cfg.final_logit_softcapping or None,
           "attn_logit_softcapping": cfg.attn_logit_softcapping or None, "use_bidirectional_attention": False}
    if kind == "gemma3_text" and not cfg.attn_logit_softcapping:
        out.pop("attn_logit_softcapping")  # null, transformers' own: its Gemma 3 has no attention soft-cap
    _check_round_trip(cfg, out, kind)
    return out


def _whole(x: float) -> int | float:
    """``x`` as an int when it is one (transformers' strict Gemma configs type ``query_pre_attn_scalar`` int)."""
    return int(x) if float(x).is_integer() else x


def _check_round_trip(cfg: ModelConfig, out: dict, kind: str) -> None:
    """Refuse an export that ``kind``'s config cannot carry: the fields of :data:`ARCHITECTURE_FIELDS`
    that :func:`config_from_hf` would read back differently (it raises first on a refused key)."""
    back = config_from_hf(out, kind)
    lost = [f"model.{f}={getattr(cfg, f)!r}" for f in ARCHITECTURE_FIELDS
            if _normal(f, getattr(back, f), back) != _normal(f, getattr(cfg, f), cfg)]
    if lost:
        raise ConfigError(f"{', '.join(lost)}: the Hugging Face {ARCHITECTURES[kind]} config has no key for it "
                          "(set model.hf_model_type to an architecture that has, or keep the default)")


def _normal(field: str, value, cfg: ModelConfig):
    """A field's value as the round trip compares it (``layer_types`` by the layers' kinds, and the
    window only where a layer slides)."""
    if field == "layer_types":
        return cfg.layer_kinds
    if field == "sliding_window":
        return value if "sliding_attention" in cfg.layer_kinds else 0
    if field == "query_pre_attn_scalar":
        return value or cfg.head_dim
    return value


def params_from_hf(get: Callable, has: Callable, cfg: ModelConfig) -> tuple[dict, set]:
    """``(params, used keys)``: the Gemma params dict (fp32 numpy, unpadded vocabulary) read through
    ``get(key) -> np.ndarray`` and ``has(key) -> bool`` by the key mapping of the module doc (under the
    first of :data:`TEXT_PREFIXES` that holds the embedding)."""
    used = set()
    L, d, h, k, q = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    base = next((b for b in TEXT_PREFIXES if has(b + "embed_tokens.weight")), "model.")

    def g(key):
        used.add(key)
        return get(key)

    def stack(key, fn=lambda w: w):
        return np.stack([fn(g(f"{base}layers.{i}.{key}")) for i in range(L)])

    layers = {name: stack(key + ".weight") for name, key in _NORM_KEYS.items()}
    layers.update(wq=stack("self_attn.q_proj.weight", lambda w: w.T.reshape(d, h, q)),
                  wk=stack("self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, q)),
                  wv=stack("self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, q)),
                  wo=stack("self_attn.o_proj.weight", lambda w: w.T.reshape(h, q, d)),
                  w_gate=stack("mlp.gate_proj.weight", lambda w: w.T), w_up=stack("mlp.up_proj.weight", lambda w: w.T),
                  w_down=stack("mlp.down_proj.weight", lambda w: w.T))
    if cfg.qk_norm:
        layers.update(q_norm=stack("self_attn.q_norm.weight"), k_norm=stack("self_attn.k_norm.weight"))
    out = {"embed_tokens": g(base + "embed_tokens.weight"), "layers": layers, "final_norm": g(base + "norm.weight")}
    head = next((key for key in ("lm_head.weight", "language_model.lm_head.weight") if has(key)), "lm_head.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head"] = g(head).T
    elif has(head):
        used.add(head)  # a tied copy
    return out, used


_NORM_KEYS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
              "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
"""The four norms of a block -> their Hugging Face module names."""


def params_to_hf(params: dict, cfg: ModelConfig) -> dict:
    """``{Hugging Face key: np.ndarray}`` of a Gemma params dict (numpy, unpadded vocabulary), by the key
    mapping of the module doc; tied embeddings are written once."""
    lp, d = params["layers"], cfg.hidden_size
    out = {"model.embed_tokens.weight": params["embed_tokens"]}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + key + ".weight": lp[name][i] for name, key in _NORM_KEYS.items()})
        out.update({p + f"self_attn.{n}_proj.weight": lp[f"w{n}"][i].reshape(d, -1).T for n in "qkv"})
        out[p + "self_attn.o_proj.weight"] = lp["wo"][i].reshape(-1, d).T
        out.update({p + f"mlp.{n}_proj.weight": lp[f"w_{n}"][i].T for n in ("gate", "up", "down")})
        if cfg.qk_norm:
            out.update({p + f"self_attn.{n}.weight": lp[n][i] for n in ("q_norm", "k_norm")})
    out["model.norm.weight"] = params["final_norm"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    return out
