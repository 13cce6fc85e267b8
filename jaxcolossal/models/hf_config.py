"""The ``config.json`` keys that every family reads the same way: RoPE's scaling (transformers 4's
``rope_scaling`` + ``rope_theta``, or transformers 5's ``rope_parameters``), the head size, the layers'
attention kinds, and the keys that change the math and are refused in one line naming them.

Used by each family's ``hf`` module (:mod:`jaxcolossal.models.llama.hf`, ...); imports no family.
"""

from __future__ import annotations

from typing import Any

from jaxcolossal.config import ConfigError, ModelConfig, RopeConfig

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
"""The RoPE scaling types read (transformers' ``ROPE_INIT_FUNCTIONS`` less ``proportional``)."""

_ROPE_FLOATS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim", "attention_factor")
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "mlp_dropout")
"""Dropout probabilities a checkpoint may set: training here runs without dropout, so a non-zero one is refused."""


def refuse(kind: str, key: str, value: Any, why: str = "not implemented here") -> None:
    """Raise the one-line refusal of a ``config.json`` key. Raises: ConfigError, always."""
    raise ConfigError(f"Hugging Face {kind} config: {key}={value!r}: {why}")


def refuse_set(hf: dict, kind: str, keys: tuple[str, ...], why: str = "not implemented here") -> None:
    """Refuse any of ``keys`` that ``hf`` sets to a true value (a non-zero number, a non-empty list, true).

    Raises: ConfigError naming the first such key."""
    for key in keys:
        if hf.get(key):
            refuse(kind, key, hf[key], why)


def refuse_dropout(hf: dict, kind: str) -> None:
    """Refuse a non-zero dropout (:data:`DROPOUT_KEYS`): training here has none, so it would differ."""
    refuse_set(hf, kind, DROPOUT_KEYS, "dropout is not implemented here (set it to 0.0 to train without it)")


def head_dim_from_hf(hf: dict) -> int:
    """``head_dim`` when the config names one that differs from ``hidden_size / num_attention_heads``,
    else 0 (:attr:`jaxcolossal.config.ModelConfig.attention_head_dim`'s default)."""
    hd = hf.get("head_dim")
    if hd is None or hf["hidden_size"] % hf["num_attention_heads"] == 0 and hd == hf["hidden_size"] // hf[
            "num_attention_heads"]:
        return 0
    return int(hd)


def _rope_dict(hf: dict, layer_kind: str | None) -> dict:
    """The RoPE dict of ``hf``: ``rope_parameters`` (transformers 5; per layer kind when nested), over
    ``rope_scaling`` (transformers 4), with ``rope_theta``/``partial_rotary_factor`` from the top level."""
    params = hf.get("rope_parameters") or {}
    if layer_kind is not None and isinstance(params.get(layer_kind), dict):
        params = params[layer_kind]
    elif any(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(v for v in params.values() if isinstance(v, dict))
    out = {**(hf.get("rope_scaling") or {}), **params}
    out.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("partial_rotary_factor") is not None:
        out.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return out


def rope_from_hf(hf: dict, kind: str, layer_kind: str | None = None, aliases: dict | None = None
                 ) -> tuple[RopeConfig, float]:
    """``(RopeConfig, rope_theta)`` of a ``config.json`` dict, as transformers'
    ``standardize_rope_params`` reads it: ``original_max_position_embeddings`` from the top level when
    the config has one there (Phi-3), else from the RoPE dict, else ``max_position_embeddings``.

    ``layer_kind``: the entry of a per-layer-kind ``rope_parameters`` (Gemma 3); ``aliases``: old type
    names of this architecture (Phi-3's ``su`` and ``yarn`` are its ``longrope``).

    Raises:
        ConfigError: a RoPE type that is not one of :data:`ROPE_TYPES` (named with its key).
    """
    d = _rope_dict(hf, layer_kind)
    kind_name = d.get("rope_type") or d.get("type") or "default"
    kind_name = (aliases or {}).get(kind_name, kind_name)
    if kind_name not in ROPE_TYPES:
        refuse(kind, "rope_scaling.rope_type", kind_name, f"supported types are {', '.join(ROPE_TYPES)}")
    fields: dict[str, Any] = {"type": kind_name}
    for key in _ROPE_FLOATS:
        if d.get(key) is not None:
            fields[key] = float(d[key])
    if kind_name in ("yarn", "longrope") and d.get("factor") is None:
        fields["factor"] = 0.0  # derived from max_position_embeddings, as transformers does
    if kind_name in ("yarn", "longrope", "llama3"):
        fields["original_max_position_embeddings"] = int(hf.get("original_max_position_embeddings") or d.get(
            "original_max_position_embeddings") or hf["max_position_embeddings"])
    if d.get("truncate") is not None:
        fields["truncate"] = bool(d["truncate"])
    if kind_name == "longrope":
        fields["short_factor"] = ",".join(repr(float(v)) for v in d["short_factor"])
        fields["long_factor"] = ",".join(repr(float(v)) for v in d["long_factor"])
    if d.get("partial_rotary_factor") is not None:
        fields["partial_rotary_factor"] = float(d["partial_rotary_factor"])
    return RopeConfig(**fields), float(d["rope_theta"])


def rope_to_hf(cfg: ModelConfig) -> dict:
    """The RoPE keys of a ``config.json`` that transformers 4 and 5 both read back as ``cfg``'s:
    ``rope_theta``, ``rope_scaling`` (``None`` for plain RoPE) and ``rope_parameters``."""
    r = cfg.rope
    params: dict[str, Any] = {"rope_type": r.type, "rope_theta": cfg.rope_theta}
    if r.type in ("linear", "dynamic", "llama3") or (r.type in ("yarn", "longrope") and r.factor):
        params["factor"] = r.factor
    if r.type in ("yarn", "longrope", "llama3"):
        params["original_max_position_embeddings"] = r.original_max_position_embeddings
    if r.type == "llama3":
        params.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type == "yarn":
        params.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        params.update({k: getattr(r, k) for k in ("mscale", "mscale_all_dim") if getattr(r, k)})
    if r.type in ("yarn", "longrope") and r.attention_factor:
        params["attention_factor"] = r.attention_factor
    if r.type == "longrope":
        params.update(short_factor=list(r.short_factors), long_factor=list(r.long_factors))
    if r.partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = r.partial_rotary_factor
    scaling = None if r.type == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def layer_types_from_hf(hf: dict, num_layers: int, sliding_from: int | None = None) -> str:
    """``model.layer_types`` of a config: its ``layer_types`` list when it has one (transformers 5
    writes it), else the layers from ``sliding_from`` on sliding when the config has a window (Qwen2's
    ``max_window_layers``), else ``""`` (every layer alike)."""
    if hf.get("layer_types"):
        return ",".join(hf["layer_types"])
    if sliding_from is None:
        return ""
    kinds = ["sliding_attention" if i >= sliding_from else "full_attention" for i in range(num_layers)]
    return "" if len(set(kinds)) == 1 and kinds[0] == "sliding_attention" else ",".join(kinds)


def layer_types_to_hf(cfg: ModelConfig) -> list[str]:
    """Each layer's attention kind, as ``config.json``'s ``layer_types``."""
    return list(cfg.layer_kinds)
