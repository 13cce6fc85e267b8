"""Checks of the model section's architecture keys (docs/models.md): which family implements which
key, RoPE's scaling parameters, the layers' attention kinds and what sliding windows run with.

Every key that changes the math is either implemented by ``model.type``'s family or refused here in
one line naming it: a Hugging Face feature is never silently dropped.
"""

from __future__ import annotations

from jaxcolossal.config.schema import Config, ModelConfig, RopeConfig
from jaxcolossal.errors import ConfigError

FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "llama": ("attention_bias", "mlp_bias", "sliding_window", "layer_types", "qk_norm_scope", "norm_position"),
    "gemma": ("sliding_window", "layer_types", "rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcapping",
              "final_logit_softcapping"),
    "deepseek": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                 "topk_group", "routed_scaling_factor", "router_score_correction"),
    "gpt_oss": ("attention_bias", "sliding_window", "layer_types", "attention_sinks", "swiglu_limit", "router_bias",
                "expert_bias"),
    "gpt2": (),
}
"""The architecture keys each family implements; any other of :data:`ARCHITECTURE_KEYS` must keep its default."""

ARCHITECTURE_KEYS = tuple(sorted({k for keys in FAMILY_KEYS.values() for k in keys}))
"""Every family-specific key of the model section."""

LAYER_KINDS = ("sliding_attention", "full_attention")
"""The values of ``model.layer_types`` (Hugging Face's names)."""

FACTOR_TYPES = ("yarn", "longrope", "llama3")
"""RoPE types that need ``model.rope.original_max_position_embeddings``."""


def check_architecture(cfg: Config) -> None:
    """Refuse, in one line naming the key, an architecture key that ``model.type`` does not implement,
    RoPE parameters that do not fit their type, malformed ``layer_types``, and sliding windows, Gemma's
    softmax scale and soft-cap with a kernel or parallelism that ignores them.

    Raises:
        ConfigError: naming the key and the value that works.
    """
    m = cfg.model
    _check_family_keys(m)
    if m.rope != RopeConfig() and m.type == "gpt2":
        raise ConfigError("model.rope: the gpt2 family has learned positions, not RoPE (keep model.rope's defaults)")
    _check_rope(m)
    _check_layer_kinds(cfg)
    _check_attention_options(cfg)
    _check_sinks(cfg)
    if m.type == "deepseek":
        _check_mla(cfg)
        _check_router_groups(m)


def _check_family_keys(m: ModelConfig) -> None:
    """An architecture key away from its default on a family that does not implement it."""
    default = ModelConfig()
    own = FAMILY_KEYS.get(m.type, ())
    for key in ARCHITECTURE_KEYS:
        if key not in own and getattr(m, key) != getattr(default, key):
            users = [f for f, keys in FAMILY_KEYS.items() if key in keys]
            raise ConfigError(f"model.{key}={getattr(m, key)!r} is not implemented by model.type={m.type!r} "
                              f"(only by {', '.join(users)}): keep its default")
    if m.qk_norm_scope == "projection" and not m.qk_norm:
        raise ConfigError("model.qk_norm_scope=projection needs model.qk_norm=true (OLMo-2's q/k norm)")


def _check_rope(m: ModelConfig) -> None:
    """RoPE's scaling parameters against their type and the head size."""
    r = m.rope
    if not 0 < r.partial_rotary_factor <= 1:
        raise ConfigError(f"model.rope.partial_rotary_factor={r.partial_rotary_factor:g}: must be in (0, 1]")
    head = m.qk_rope_head_dim if m.type == "deepseek" else m.head_dim
    dim = int(head * r.partial_rotary_factor)
    if dim % 2 or dim == 0:
        raise ConfigError(f"model.rope: the rotated part of a head, {dim} dimensions, must be even and > 0")
    if r.type in FACTOR_TYPES and r.original_max_position_embeddings <= 0:
        raise ConfigError(f"model.rope.type={r.type} needs model.rope.original_max_position_embeddings > 0 (the "
                          "pre-training context, e.g. 8192 for Llama 3.1)")
    if r.type in ("linear", "dynamic", "llama3") and r.factor <= 0:
        raise ConfigError(f"model.rope.type={r.type} needs model.rope.factor > 0 (got {r.factor:g})")
    if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
        raise ConfigError(f"model.rope.high_freq_factor={r.high_freq_factor:g} must exceed "
                          f"model.rope.low_freq_factor={r.low_freq_factor:g}")
    if r.type == "longrope":
        for key, got in (("short_factor", r.short_factors), ("long_factor", r.long_factors)):
            if len(got) != dim // 2:
                raise ConfigError(f"model.rope.{key} has {len(got)} factors; longrope needs one per rotated pair "
                                  f"of a head: {dim // 2}")
    elif r.short_factor or r.long_factor:
        raise ConfigError(f"model.rope.short_factor/long_factor are longrope's: model.rope.type={r.type} ignores "
                          "them (remove them or set model.rope.type=longrope)")


def _check_attention_options(cfg: Config) -> None:
    """Gemma's softmax scale (``query_pre_attn_scalar``) and attention soft-cap with the kernels and the
    sequence-parallel modes that apply them: XLA's attention (and Ulysses', Megatron-SP's around it), the flash
    kernels (the scale, not the soft-cap); not cuDNN nor ring attention's online softmax."""
    m, p = cfg.model, cfg.parallel
    key = next((k for k in ("attn_logit_softcapping", "query_pre_attn_scalar") if getattr(m, k)), None)
    if key is None:
        return
    if m.attention_impl == "cudnn" or (m.attention_impl == "flash" and key == "attn_logit_softcapping"):
        raise ConfigError(f"model.{key}={getattr(m, key):g}: the {m.attention_impl} kernel has no "
                          + ("soft-cap here: set model.attention_impl=xla" if key == "attn_logit_softcapping"
                             else "softmax scale here: set model.attention_impl=xla or flash"))
    if p.sequence_parallelism_mode == "ring_attn":
        raise ConfigError(f"model.{key}={getattr(m, key):g}: ring attention's online softmax has no softmax scale or "
                          "soft-cap here: use parallel.sequence_parallelism_mode=all_to_all or split_gather")


def _check_layer_kinds(cfg: Config) -> None:
    """``layer_types``' length and names; sliding windows with the kernels and layouts that apply them."""
    m, p = cfg.model, cfg.parallel
    kinds = m.layer_kinds
    if m.layer_types:
        bad = sorted(set(kinds) - set(LAYER_KINDS))
        if bad:
            raise ConfigError(f"model.layer_types: unknown kind(s) {', '.join(bad)}; allowed: {', '.join(LAYER_KINDS)}")
        if len(kinds) != m.num_layers:
            raise ConfigError(f"model.layer_types names {len(kinds)} layers; model.num_layers={m.num_layers}")
        if "sliding_attention" in kinds and not m.sliding_window:
            raise ConfigError("model.layer_types has sliding_attention layers but model.sliding_window=0: set the "
                              "window (in tokens)")
    if not any(m.layer_windows):
        return
    if m.attention_impl == "cudnn":
        raise ConfigError(f"model.sliding_window={m.sliding_window}: the cudnn kernel has no sliding window here: set "
                          "model.attention_impl=xla or flash")
    if p.sequence_parallelism_mode == "ring_attn":
        raise ConfigError(f"model.sliding_window={m.sliding_window}: ring attention has no sliding window here: use "
                          "parallel.sequence_parallelism_mode=all_to_all or split_gather")
    if len(set(kinds)) > 1 and p.pipeline_parallel_size != 1:
        raise ConfigError("model.layer_types mixes sliding and full layers, which a pipeline stage's shared layer "
                          "does not run yet: set parallel.pipeline_parallel_size=1")


def _check_sinks(cfg: Config) -> None:
    """Attention sinks (GPT-OSS) with the kernels and sequence-parallel forms that have no sink logit."""
    m, mode = cfg.model, cfg.parallel.sequence_parallelism_mode
    if not m.attention_sinks:
        return
    if m.attention_impl == "cudnn":
        raise ConfigError("model.attention_sinks=true: the cudnn kernel has no sink logit here: set "
                          "model.attention_impl=xla or flash")
    if mode in ("all_to_all", "ring_attn"):
        raise ConfigError(f"model.attention_sinks=true: parallel.sequence_parallelism_mode={mode} has no sink logit "
                          "here: use split_gather or none")


def _check_mla(cfg: Config) -> None:
    """DeepSeek's multi-head latent attention: its sizes, one key/value per query head, and the kernels
    and layouts it runs with (the einsum attention, no ring attention). A pipeline is refused with the
    first dense layers by the mixture of experts' own check (a second stack of layers)."""
    m, p = cfg.model, cfg.parallel
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(m, key)}: model.type=deepseek needs it > 0 (DeepSeek-V3: "
                              "kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)")
    for key, why in (("qk_norm", "MLA normalises its latents, not q and k"),
                     ("attention_head_dim", "MLA's heads are sized by qk_nope/qk_rope/v_head_dim")):
        if getattr(m, key):
            raise ConfigError(f"model.{key}={getattr(m, key)!r} is not implemented by model.type=deepseek ({why}): "
                              "keep its default")
    if m.num_key_value_heads != m.num_attention_heads:
        raise ConfigError(f"model.num_key_value_heads={m.num_key_value_heads}: multi-head latent attention expands "
                          f"one key/value per query head: set it to model.num_attention_heads={m.num_attention_heads}")
    if m.attention_impl != "xla":
        raise ConfigError(f"model.attention_impl={m.attention_impl}: multi-head latent attention (value heads of "
                          f"{m.v_head_dim} against query/key heads of {m.qk_nope_head_dim + m.qk_rope_head_dim}, its own "
                          "softmax scale) runs with model.attention_impl=xla")
    if p.sequence_parallelism_mode == "ring_attn":
        raise ConfigError("parallel.sequence_parallelism_mode=ring_attn: multi-head latent attention has no ring "
                          "attention here (use all_to_all or split_gather)")


def _check_router_groups(m: ModelConfig) -> None:
    """DeepSeek-V3's group-limited routing: whole groups of at least two experts, and enough experts in the
    chosen groups for the top-k."""
    if m.n_group <= 1:
        return
    e, g = m.num_experts, m.n_group
    if e % g or e // g < 2:
        raise ConfigError(f"model.n_group={g}: the {e} routed experts (model.num_experts) must split into groups of "
                          "at least 2 (a group scores by its two best experts)")
    if not 1 <= m.topk_group <= g or m.topk_group * (e // g) < m.num_experts_per_tok:
        raise ConfigError(f"model.topk_group={m.topk_group}: must be in 1..model.n_group={g} and its groups must hold "
                          f"model.num_experts_per_tok={m.num_experts_per_tok} experts ({e // g} per group)")
