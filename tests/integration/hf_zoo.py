"""Tiny models of every Hugging Face architecture we read, created by transformers with the real
model's distinctive keys on (RoPE scaling type, explicit head_dim, biases, norms, windows, tying),
shrunk in size only: 2 layers (or as many as the layer pattern needs), hidden 32, vocabulary 100.

Where a real value would not show in 16 tokens (Llama 3.1's ``original_max_position_embeddings`` of
8192, Mistral v0.1's 4096-token window) the tiny model keeps the key and its type with a context
small enough that it changes the logits; each entry says so.

``initializer_range`` 0.15 makes the logits decisive; norm scales and biases (which transformers
initialises to constants) are perturbed by 0.1·N(0, 1) so that a wrong mapping of any of them shows.
Import after ``pytest.importorskip("torch")``.
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 100
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.15, bos_token_id=0,
            eos_token_id=1, pad_token_id=None, attn_implementation="eager")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
"""Llama 3.2's own ``rope_scaling`` (1B/3B), as its config.json has it."""

ZOO: dict[str, tuple[str, dict]] = {
    # Llama 3.2 1B/3B: rope llama3 (factor 32) with theta 500000, tied; its 8192-token original context
    # shrunk to 8 so that the scaled low frequencies turn within 16 tokens
    "llama3.2": ("LlamaConfig", dict(rope_theta=500000.0, tie_word_embeddings=True, head_dim=8,
                                     rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8})),
    # HF LLaMA's own flags: q/k/v/o and MLP biases, an explicit head_dim that differs from hidden / heads
    "llama-bias-headdim": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, head_dim=16)),
    "llama-linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # dynamic NTK: max_position_embeddings 8 so that 16 tokens grow the base
    "llama-dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                          max_position_embeddings=8)),
    "llama-yarn": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32,
                                                     "beta_slow": 1, "original_max_position_embeddings": 16})),
    # Qwen2.5-0.5B/1.5B: q/k/v biases (o without), tied; the window off (use_sliding_window false)
    "qwen2.5": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    # Qwen2 with its sliding window on from layer max_window_layers (2 of 3 layers full)
    "qwen2-window": ("Qwen2Config", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                         max_window_layers=1)),
    # Qwen3-0.6B: per-head q/k RMSNorm, head_dim 128 where hidden / heads is 64 (here 16 for 8), tied
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True, rope_theta=1000000.0)),
    # Mistral-Nemo: head_dim 128 with hidden 5120 / 32 heads (here 16 for 8), no window
    "mistral-nemo": ("MistralConfig", dict(head_dim=16, sliding_window=None, rope_theta=1000000.0)),
    # Mistral v0.1's sliding window (4096 there, 4 here)
    "mistral-window": ("MistralConfig", dict(sliding_window=4)),
    # Mixtral with an explicit head_dim (the raw reshape error of issue 50)
    "mixtral": ("MixtralConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                      rope_theta=1000000.0)),
    # Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary 0.75, LongRoPE (original 4096 there, 8
    # here: 16 tokens take the long factors), tied
    "phi4-mini": ("Phi3Config", dict(partial_rotary_factor=0.75, tie_word_embeddings=True, pad_token_id=VOCAB - 1,
                                     original_max_position_embeddings=8,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5],
                                                   "long_factor": [1.0, 3.0, 9.0]})),
    # Phi-3-mini-4k: its sliding window (2047 there, 4 here)
    "phi3-window": ("Phi3Config", dict(sliding_window=4, pad_token_id=VOCAB - 1)),  # a pad id in the vocabulary, as Phi-3 has
    # OLMo-2: norms after attention and after the MLP, q/k RMSNorm over the whole projection
    "olmo2": ("Olmo2Config", dict(pad_token_id=None, rope_theta=500000.0)),
    # DeepSeek-V3 (671B): MLA with a q latent (1536 there, 24 here), the kv latent (512, 16), per head 128
    # nope + 64 rope query/key dims and 128 value dims (16 + 8, 12: v != q), DeepSeek's interleaved rotary
    # layout; yarn factor 40 with mscale = mscale_all_dim = 1 (the softmax scale x mscale^2), its 4096-token
    # original context shrunk to 4 so that the interpolated frequencies turn within 16 tokens; 256 routed
    # experts in 8 groups, top-4 groups, top-8 (8 in 4 groups, top-2 groups, top-3), sigmoid scores with the
    # score-correction bias (perturbed by build()), routed_scaling_factor 2.5, 1 shared expert, the first 3
    # of 61 layers dense (1 of 3 here)
    "deepseek-v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        rope_scaling={"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                      "beta_slow": 1, "original_max_position_embeddings": 4}, max_position_embeddings=160)),
    # DeepSeek-V2-Lite's shape on V3's code: no q latent (q_lora_rank null: a plain q_proj), 64 routed experts
    # in one group (8 here), top-6 (top-2), 2 shared experts, weights not renormalised, routed_scaling_factor
    # 1, yarn mscale = mscale_all_dim = 0.707, the first layer dense, tied embeddings (our flag, not V2-Lite's)
    "deepseek-v2-lite": ("DeepseekV3Config", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        first_k_dense_replace=1, norm_topk_prob=False, tie_word_embeddings=True,
        rope_scaling={"type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                      "beta_slow": 1, "original_max_position_embeddings": 4}, max_position_embeddings=160)),
    # Gemma-2-2B: sliding and global layers alternating (Gemma2Config's own pattern), attention soft-cap 50
    # and final soft-cap 30, GeGLU, sandwich norms, tied; query_pre_attn_scalar 256 = its head_dim there, 12
    # here where head_dim is 16 so that the scale shows; its 4096-token window 4 here
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    tie_word_embeddings=True)),
    # Gemma-3-4B text: 5 local layers to 1 global (6 layers: both kinds), q/k norms, local RoPE base 10000 and
    # global 1000000 with the 4B+ models' linear scaling (factor 8) on the global layers only, no soft-caps,
    # query_pre_attn_scalar 256 there (= head_dim), 12 here; its 1024-token window 4 here; tied
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}},
                                        tie_word_embeddings=True)),
    # GPT-OSS-20B: sinks, q/k/v/o biases, sliding / full layers alternating (window 128 there, 4 here), yarn
    # (factor 32, beta 32/1, untruncated) over theta 150000 with its 4096-token original context shrunk to 64
    # so that the ramp moves into the frequencies 16 tokens turn, head_dim 64 with hidden 2880 / 64 heads (16
    # for 4 here), a biased router over 32 experts top-4 (4 top-2 here), biased experts with the clamped SwiGLU;
    # swiglu_limit 7 there, 0.5 here: with initializer 0.15 the gate and up values stay within ±2, so the
    # real limit would never clamp (test_gpt_oss.py checks that both clamps bite)
    "gpt-oss": ("GptOssConfig", dict(num_hidden_layers=4, head_dim=16, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"] * 2,
                                     rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 64},
                                     num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
                                     swiglu_limit=0.5, initial_context_length=64, router_aux_loss_coef=0.9)),
}
"""name -> (transformers config class, the keys beyond :data:`BASE`)."""


def build(name: str, seed: int = 0, **overrides) -> "transformers.PreTrainedModel":
    """The tiny ``name`` model of :data:`ZOO` (fp32, eval mode), its weights from ``seed``; ``overrides``:
    config keys set over the entry's (``vocab_size=256`` for byte tokens)."""
    cls, keys = ZOO[name]
    cfg = getattr(transformers, cls)(**{**BASE, **keys, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # constants (norm scales, biases, sinks) perturbed so that their mapping shows
        for pname, p in model.named_parameters():
            if p.ndim == 1 or "norm" in pname or "bias" in pname:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for pname, b in model.named_buffers():  # DeepSeek-V3's e_score_correction_bias: a buffer, zero at init
            if pname.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()


def logits(model, tokens) -> "numpy.ndarray":  # noqa: F821
    """transformers' fp32 logits ``[b, t, V]`` of int ``tokens [b, t]``."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens).long()).logits.float().numpy()
