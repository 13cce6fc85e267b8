"""The config's schema: one dataclass per section, with Colossal-AI's key names.

``model``, ``training``, ``parallel``, ``precision``, plus ``data``, ``checkpoint``, ``logging`` and
``offload``. Each field's type is what :mod:`jaxcolossal.config.load` checks a YAML value against;
:mod:`jaxcolossal.config.checks` checks their ranges and combinations. Each field's documentation is
the string right after it (an attribute docstring: what it does, its unit, its allowed values, the
keys it interacts with); every field must have one, and docs/config.md and ``scripts/train.py
--help`` are built from them (:mod:`jaxcolossal.config.reference`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from jaxcolossal.errors import ConfigError

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b")
"""The projections a LoRA adapter can sit on (PEFT's ``q_proj`` ... ``down_proj``; multi-head latent
attention's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``). A family has some of
them: :attr:`ModelConfig.lora_target_choices`."""


@dataclass
class LoraConfig:
    """LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), as Hugging
    Face PEFT's ``LoraConfig``: each target projection ``W`` gains ``(alpha / rank) · B A`` with
    ``A [rank, in]`` and ``B [out, rank]`` (B starts at zero, so the model starts unchanged). The
    base weights are frozen in the compute dtype; only the adapters are trained, so the fp32
    master copy, the gradients and the optimizer state (and ZeRO's sharding of them) cover only
    them. The ``llama``, ``gemma``, ``gpt_oss`` and ``deepseek`` families
    (:attr:`ModelConfig.lora_target_choices` lists the projections each has)."""

    rank: int = 0
    """The adapters' rank ``r``, an integer >= 0; 0 (the default) turns LoRA off, and then the other
    ``model.lora`` keys must keep their defaults. LoRA does not run with
    ``parallel.gradient_compression`` or an offloaded state (``offload.offload_optim_frac``,
    ``offload_param_frac``, ``placement_policy=auto``, ``nvme_path``) yet; with a mixture of experts
    (``model.num_experts``) it adapts the attention projections only (targets among ``q, k, v, o``;
    DeepSeek's among its multi-head latent attention's, ``model.lora.targets``)."""
    alpha: float = 16.0
    """The adapters' scale numerator, a float > 0: their product is multiplied by ``alpha / rank``
    (PEFT's ``lora_alpha``). ``model.lora.init_from`` replaces it with the adapter's own."""
    dropout: float = 0.0
    """The dropout probability on the adapters' input in training, in [0, 1) (PEFT's
    ``lora_dropout``); its masks are drawn from ``training.seed``, the step and the microbatch. Not
    yet with pipeline parallelism, nor with ZeRO-3's prefetching layer scan (``parallel.overlap``
    with ``model.remat=full``) or its low-precision weight gathers (``parallel.communication_dtype``)."""
    targets: str = "q,v"
    """The projections that get adapters: comma-separated, or ``all`` (every one the family has); the
    default ``q,v`` is PEFT's for LLaMA. LLaMA-like families (``llama``, ``gemma``, ``gpt_oss``): any
    of ``q, k, v, o, gate, up, down`` (with a mixture of experts ``q, k, v, o`` only). DeepSeek's
    multi-head latent attention (``model.type=deepseek``, every layer, dense or MoE): ``q_a``
    (``q_a_proj``), ``q_b`` (``q_b_proj``) or, without a q latent (``model.q_lora_rank=0``), ``q``
    (``q_proj``); ``kv_a`` (``kv_a_proj_with_mqa``: one adapter over the latent and the rotary key),
    ``kv_b`` (``kv_b_proj``: one over the keys and the values), ``o`` (``o_proj``); ``all`` is those.
    ``model.lora.init_from`` replaces it with the adapter's own."""
    init_from: str = ""
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) to continue
    training from; its rank, alpha, dropout and targets replace these (``model.lora.rank`` must
    still be > 0). ``""`` (the default): fresh adapters."""

    @property
    def enabled(self) -> bool:
        """True when ``rank > 0``."""
        return self.rank > 0

    @property
    def target_list(self) -> tuple[str, ...]:
        """``targets`` as a tuple in :data:`LORA_TARGETS` order (``all``: every one of
        :data:`LORA_TARGETS`; :attr:`ModelConfig.lora_targets` is ``all`` for one family)."""
        named = {t.strip() for t in self.targets.split(",") if t.strip()}
        if named == {"all"}:
            return LORA_TARGETS
        return tuple(t for t in LORA_TARGETS if t in named)

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of the adapters' product (PEFT's ``scaling``)."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class RopeConfig:
    """RoPE's scaling (Hugging Face's ``rope_scaling`` / ``rope_parameters``), as transformers'
    ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` computes it (:mod:`jaxcolossal.models.layers.rope`).
    Read from a checkpoint's ``config.json`` by ``model.init_from`` and ``--to-jax``; each type uses
    the keys its docstring names and ignores the others."""

    type: Literal["default", "linear", "dynamic", "yarn", "longrope", "llama3"] = "default"
    """The scaling type: ``default`` (plain RoPE), ``linear`` (positions divided by ``factor``),
    ``dynamic`` (NTK: the base grows with the sequence past ``model.max_position_embeddings``, which
    ``training.seq_len`` may then exceed),
    ``yarn`` (DeepSeek-V3, GPT-OSS, Qwen long context), ``longrope`` (Phi-3, Phi-4-mini) or
    ``llama3`` (Llama 3.1 / 3.2 / 3.3)."""
    factor: float = 1.0
    """The context extension factor, >= 0 (``linear``, ``dynamic``, ``yarn``, ``llama3``; ``longrope``'s
    attention factor). 0 with ``yarn``/``longrope``: ``max_position_embeddings /
    original_max_position_embeddings``, as transformers derives it."""
    original_max_position_embeddings: int = 0
    """The pre-training context, in tokens, >= 0 (``yarn``, ``longrope``, ``llama3``; 8192 for Llama
    3.1). Must be > 0 for those types."""
    low_freq_factor: float = 1.0
    """``llama3``: wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    divided by ``factor``, > 0."""
    high_freq_factor: float = 4.0
    """``llama3``: wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are
    kept; between the two, a smooth ramp. Must exceed ``low_freq_factor``."""
    beta_fast: float = 32.0
    """``yarn``: the rotations that bound extrapolation in the linear ramp, > 0."""
    beta_slow: float = 1.0
    """``yarn``: the rotations that bound interpolation in the linear ramp, > 0."""
    mscale: float = 0.0
    """``yarn``: with ``mscale_all_dim``, the attention factor is ``m(factor, mscale) /
    m(factor, mscale_all_dim)``, ``m(s, c) = 0.1·c·ln(s) + 1`` (DeepSeek-V3), >= 0; 0: ``m(factor, 1)``."""
    mscale_all_dim: float = 0.0
    """``yarn``: see ``mscale``, >= 0. DeepSeek-V3's attention also multiplies its softmax scale by
    ``m(factor, mscale_all_dim)²``."""
    attention_factor: float = 0.0
    """``yarn``/``longrope``: the factor on cos and sin (so on q·k squared), >= 0; 0: derived as
    transformers derives it."""
    truncate: bool = True
    """``yarn``: round the correction range outwards to whole dimensions (transformers' default)."""
    short_factor: str = ""
    """``longrope``: the per-dimension factors up to ``original_max_position_embeddings`` tokens,
    comma-separated (a YAML list is accepted), one per rotated dimension pair."""
    long_factor: str = ""
    """``longrope``: the per-dimension factors beyond ``original_max_position_embeddings`` tokens,
    comma-separated (a YAML list is accepted)."""
    partial_rotary_factor: float = 1.0
    """The share of each head's dimensions that RoPE turns, in (0, 1] (Phi-4-mini 0.75): the first
    ``int(head_dim × partial_rotary_factor)``; the rest pass unrotated."""

    @property
    def short_factors(self) -> tuple[float, ...]:
        """``short_factor`` as numbers."""
        return tuple(float(v) for v in self.short_factor.split(",") if v.strip())

    @property
    def long_factors(self) -> tuple[float, ...]:
        """``long_factor`` as numbers."""
        return tuple(float(v) for v in self.long_factor.split(",") if v.strip())


@dataclass
class ModelConfig:
    """The model: its family and shape (names follow Hugging Face's ``LlamaConfig`` and
    ``GPT2Config``), its kernels and activation checkpointing, the LoRA adapters (``lora``) and the
    mixture of experts (``num_experts > 0``; :mod:`jaxcolossal.models.layers.moe`): each layer after
    the first ``first_k_dense`` replaces its MLP by ``num_experts`` routed SwiGLU experts, each
    token going to ``num_experts_per_tok`` of them, plus ``num_shared_experts`` experts every token
    passes through (DeepSeek-MoE).
    """

    type: Literal["llama", "gpt2", "gemma", "deepseek", "gpt_oss"] = "llama"
    """The model family: ``llama``, ``gpt2``, ``gemma``, ``deepseek`` or ``gpt_oss`` (docs/models.md).
    ``llama``: RMSNorm, RoPE, a SwiGLU MLP, grouped-query attention, and as flags Qwen2/2.5, Qwen3,
    Mistral, Phi-3, OLMo-2 and the mixtures of experts Mixtral and Qwen3-MoE. ``gemma``: Gemma 2 and 3's
    block (sandwich norms, GeGLU, local and global layers). ``deepseek``: DeepSeek-V3's multi-head
    latent attention and MoE. ``gpt_oss``: GPT-OSS (attention sinks, clamped SwiGLU experts). ``gpt2``: LayerNorm, learned position
    embeddings, a GELU MLP, no grouped-query attention (``num_key_value_heads`` must equal
    ``num_attention_heads``). Must equal the checkpoint's with ``model.init_from``."""
    num_layers: int = 4
    """The decoder layers (transformer blocks), >= 1. With pipeline parallelism it must be divisible
    by ``parallel.pipeline_parallel_size × parallel.num_model_chunks``; with a mixture of experts
    the first ``first_k_dense`` of them stay dense."""
    hidden_size: int = 128
    """The model width ``d`` (the embedding and residual stream's size), >= 1. Must be divisible by
    ``num_attention_heads`` and, under ZeRO (``parallel.zero_stage > 0``), by the ZeRO group
    (``parallel.data_parallel_size / parallel.expert_parallel_size``)."""
    num_attention_heads: int = 4
    """The query heads per layer, >= 1. Must divide ``hidden_size``, be divisible by
    ``num_key_value_heads`` and by ``parallel.tensor_parallel_size`` (with
    ``parallel.sequence_parallelism_mode=all_to_all`` by ``sequence_parallel_size ×
    tensor_parallel_size``)."""
    num_key_value_heads: int = 2
    """The key/value heads per layer, >= 1. Grouped-query attention: each serves ``num_attention_heads /
    num_key_value_heads`` query heads; equal to ``num_attention_heads`` it is multi-head attention,
    which ``type=gpt2`` requires. Must divide ``num_attention_heads`` and be divisible by
    ``parallel.tensor_parallel_size`` (with ``parallel.sequence_parallelism_mode=all_to_all`` by ``sp ×
    tp``)."""
    intermediate_size: int = 384
    """The MLP's hidden width, >= 1 (LLaMA's SwiGLU gate and up projections, GPT-2's ``n_inner``);
    also each routed expert's when ``moe_intermediate_size`` is 0. Must be divisible by
    ``parallel.tensor_parallel_size``."""
    max_position_embeddings: int = 512
    """The longest sequence the model takes, in tokens: ``training.seq_len`` may not exceed it.
    GPT-2 learns one position embedding per position (its ``n_positions``); LLaMA's RoPE has no
    table, so there it is only the bound (and the Hugging Face config's value)."""
    vocab_size: int = 256
    """The tokenizer's vocabulary size, in token ids (the byte tokenizer has 256); a run refuses a
    ``data.tokenizer`` with more ids. The embedding may be padded internally to a multiple of
    ``vocab_pad_multiple × parallel.tensor_parallel_size``; the padding never reaches the user:
    padded logits are masked and exports strip it."""
    tie_word_embeddings: bool = False
    """``true``: the LM head is the transposed input embedding (one ``[vocab, hidden]`` matrix);
    ``false``: a separate ``lm_head`` matrix. Shapes the saved state, so a resumed checkpoint and
    ``model.init_from`` must agree."""
    num_labels: int = 0
    """The head, 0 or 1. 0 (the default): the causal language model's head (``lm_head``, or the tied
    embedding). 1: a reward model's score head in its place, transformers' ``*ForSequenceClassification``
    with ``num_labels=1`` (:mod:`jaxcolossal.models.score_head`): ``score [hidden_size, 1]`` read at
    each row's last non-pad token, no ``lm_head`` held or trained. Set by ``training.objective=reward``
    when a YAML or override leaves it 0, read as 1 from a sequence-classification checkpoint, and
    refused with any other objective. With ``model.init_from`` a causal LM's checkpoint gets a fresh
    score drawn from normal(0, ``initializer_range``) (as transformers does); a sequence-classification
    one's ``score.weight`` is loaded."""
    rms_norm_eps: float = 1e-5
    """The epsilon added to the mean square in every RMSNorm of ``type=llama`` and ``type=gemma`` (the
    layers', the final one, and ``qk_norm``'s), > 0."""
    layer_norm_eps: float = 1e-5
    """The epsilon added to the variance in every LayerNorm of ``type=gpt2`` (Hugging Face's
    ``layer_norm_epsilon``), > 0."""
    rope_theta: float = 10000.0
    """RoPE's base θ (``type=llama``; ``type=gemma``: of the global layers when ``rope_local_theta`` is
    set), > 0: the dimension pair ``i`` of a head of size ``q`` turns by ``position · θ^(−2i/q)`` radians."""
    initializer_range: float = 0.02
    """The standard deviation of a fresh model's normal weight initialisation, > 0. The weight matrices
    and embeddings are drawn from normal(0, initializer_range), the residual output projections' with it
    divided by ``sqrt(2 · num_layers)`` (GPT-2, Megatron); norm scales start at one, GPT-2's biases at
    zero. Unused for the weights that ``model.init_from`` loads."""
    vocab_pad_multiple: int = 1
    """The embedding's and LM head's vocabulary dimension is padded up to a multiple of
    ``vocab_pad_multiple × parallel.tensor_parallel_size`` rows (Colossal-AI pads to 64·tp); 1: only
    to a multiple of tp. Padded rows are zero, never looked up, and their logits are masked."""
    remat: Literal["none", "save_qkv_proj", "selective", "dots", "full", "offload"] = "none"
    """The activation-checkpointing policy of each layer (:mod:`jaxcolossal.parallel.layer_scan`):
    what the backward pass keeps from the forward, the rest being recomputed. ``none``: everything;
    ``save_qkv_proj``: the q/k/v projections' outputs; ``selective``: every projection's output
    (q/k/v, attention out, MLP gate/up/down); ``dots``: every matmul without batch dims; ``full``:
    only the layer input; ``offload``: what ``selective`` keeps, in pinned host memory
    (``offload.activations=host`` sets it). ZeRO-3's weight prefetch (``parallel.overlap``) needs
    ``full``."""
    attention_impl: Literal["xla", "cudnn", "flash"] = "xla"
    """The attention kernel: ``xla``, ``cudnn`` or ``flash``. ``xla``: an einsum with an fp32 softmax,
    runs everywhere. ``cudnn``: ``jax.nn.dot_product_attention``'s cuDNN kernel (GPUs, bf16/fp16); runs
    as ``xla`` inside a pipeline; not with ``data.packing_mask``. ``flash``: the Pallas flash-attention
    kernels (Triton on GPUs, the Pallas interpreter elsewhere), memory linear in the sequence length,
    with sliding windows, sinks and ``query_pre_attn_scalar`` (not the soft-cap, nor multi-head latent
    attention); not with pipeline parallelism. ``parallel.sequence_parallelism_mode=ring_attn`` needs
    ``xla``."""
    embedding_impl: Literal["gather", "one_hot"] = "gather"
    """How the input embedding looks tokens up with the vocabulary split over tp: ``gather`` or
    ``one_hot``. ``gather``: Megatron's masked gather, then one all-reduce over
    ``parallel.tensor_parallel_size``. ``one_hot``: a one-hot matmul, ``2·tokens·vocab·hidden/tp``
    FLOPs, kept for comparison."""
    loss_chunk_tokens: int = 1024
    """The tokens per device in one chunk of the fused LM head + cross-entropy, >= 0; 0 materializes the
    logits of all tokens. A chunk's fp32 logits take ``loss_chunk_tokens × vocab/tp × 4`` bytes
    (:func:`jaxcolossal.models.layers.vocab.lm_head_loss`)."""
    loss_chunk_vocab: int = 8192
    """The vocabulary columns per device in one chunk of the LM head + cross-entropy (and of the
    per-token log-probs), >= 0; 0: a device's whole vocabulary shard in one chunk. Each token chunk
    folds its vocab chunks into an online log-sum-exp, so one chunk's fp32 logits take
    ``loss_chunk_tokens × loss_chunk_vocab × 4`` bytes, forward and backward; a divisor of
    ``vocab/tp`` near this size is taken when there is one (128256: 16 chunks of 8016)
    (:func:`jaxcolossal.models.layers.logprobs.token_logprobs`)."""
    init_from: str = ""
    """A local Hugging Face model folder (``config.json`` + safetensors) whose weights initialise the
    run (fine-tuning); ``""`` (the default): a fresh initialisation from ``training.seed``. The model
    section must describe the same model (``type``, the sizes, ``tie_word_embeddings`` and the
    family's own keys, such as ``rms_norm_eps`` and ``rope_theta``), checked before any weight is
    read; ``data.tokenizer=auto`` takes the folder's ``tokenizer.json``. ``~`` and ``$VAR`` are
    expanded."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The LoRA adapters (:class:`LoraConfig`; ``model.lora.rank=0``: none)."""
    qk_norm: bool = False
    """``true``: an RMSNorm over each head of q and k before RoPE (Qwen3, ``type=llama``; Gemma 3,
    ``type=gemma``, whose export is then ``Gemma3ForCausalLM``)."""
    attention_head_dim: int = 0
    """The size of one attention head, in elements, >= 0; 0: ``hidden_size / num_attention_heads``
    (Qwen3 sets its own). The head size must be even (RoPE turns pairs of dimensions)."""
    hf_model_type: str = ""
    """The Hugging Face ``model_type`` this model was read from (``llama``, ``qwen2``, ``qwen3``,
    ``mistral``, ``phi3``, ``olmo2``, ``mixtral``, ``gemma3_text``, ...): the architecture ``--to-hf``
    writes back. ``""``: the family's plain one (LLaMA, or Mixtral/Qwen3-MoE by the MoE keys)."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """RoPE's scaling type and parameters (:class:`RopeConfig`; default: plain RoPE)."""
    rope_local_theta: float = 0.0
    """The RoPE base of the sliding-window layers, >= 0 (Gemma 3's ``rope_local_base_freq``, plain RoPE
    there); 0: ``rope_theta`` for every layer."""
    attention_bias: Literal["none", "qkv", "all"] = "none"
    """Biases on the attention projections: ``none``; ``qkv`` on q, k and v (Qwen2/2.5); ``all`` on q,
    k, v and the output (Hugging Face LLaMA's ``attention_bias: true``, GPT-OSS)."""
    mlp_bias: bool = False
    """``true``: biases on the MLP's gate, up and down projections (Hugging Face LLaMA's ``mlp_bias``)."""
    sliding_window: int = 0
    """Sliding-window attention, in tokens, >= 0: a query attends to itself and the ``sliding_window −
    1`` tokens before it (Hugging Face's convention), on the layers ``layer_types`` marks sliding (all,
    when it is empty). 0: every layer attends to the whole causal prefix. Needs
    ``model.attention_impl`` ``xla`` or ``flash`` and no ring attention (``parallel.sequence_parallelism_mode``)."""
    layer_types: str = ""
    """Each layer's attention, comma-separated, one per layer (a YAML list is accepted):
    ``sliding_attention`` or ``full_attention`` (Hugging Face's ``layer_types``: Gemma 2/3, GPT-OSS,
    Qwen2 with ``max_window_layers``). ``""``: every layer sliding when ``sliding_window > 0``, else
    full. Layers that differ are refused with pipeline parallelism."""
    qk_norm_scope: Literal["head", "projection"] = "head"
    """With ``qk_norm``: ``head``, an RMSNorm over each head of q and k (Qwen3, Gemma 3), or
    ``projection``, over the whole q and k projections (OLMo-2)."""
    norm_position: Literal["pre", "post"] = "pre"
    """Where the layer norms sit: ``pre`` (LLaMA: ``x + f(norm(x))``) or ``post`` (OLMo-2: ``x +
    norm(f(x))``, the norms after attention and after the MLP, none before)."""
    query_pre_attn_scalar: float = 0.0
    """The attention's softmax scale is ``query_pre_attn_scalar^-1/2``, >= 0 (Gemma 2/3); 0: the head
    size's, ``head_dim^-1/2``."""
    attn_logit_softcapping: float = 0.0
    """Gemma 2's attention soft-cap, >= 0: scores become ``c · tanh(scores / c)`` before the softmax;
    0: none."""
    final_logit_softcapping: float = 0.0
    """Gemma 2's final soft-cap, >= 0: logits become ``c · tanh(logits / c)``; 0: none."""
    attention_sinks: bool = False
    """``true``: a learned logit per head joins each query's softmax and takes probability mass
    without a value (GPT-OSS's sinks). Needs ``model.attention_impl`` ``xla`` or ``flash``."""
    swiglu_limit: float = 0.0
    """GPT-OSS's clamped SwiGLU, >= 0: the gate is clamped above at the limit, the up projection to
    ``[−limit, limit]``; 0: the plain SwiGLU."""
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3, ``type=deepseek``): the rank of q's compression,
    >= 0; 0: q is projected from the hidden state directly."""
    kv_lora_rank: int = 0
    """Multi-head latent attention: the rank of the compressed key/value latent (what the KV cache
    holds, besides the shared rotary key), >= 0."""
    qk_nope_head_dim: int = 0
    """Multi-head latent attention: each head's query/key dimensions without RoPE, >= 0."""
    qk_rope_head_dim: int = 0
    """Multi-head latent attention: each head's query/key dimensions with RoPE (the key's shared by
    all heads), >= 0."""
    v_head_dim: int = 0
    """Multi-head latent attention: each head's value dimensions, >= 0."""
    n_group: int = 0
    """Group-limited routing (DeepSeek-V3), >= 0: the experts are split in ``n_group`` groups and a
    token's experts come from its ``topk_group`` best groups; 0 or 1: no grouping."""
    topk_group: int = 0
    """Group-limited routing: the groups a token's experts come from, 1 to ``n_group``."""
    routed_scaling_factor: float = 1.0
    """The routed experts' output is multiplied by it, > 0 (DeepSeek-V3's 2.5)."""
    router_score_correction: bool = False
    """``true``: a per-expert bias (DeepSeek-V3's ``e_score_correction_bias``) is added to the
    scores to choose the experts, not to weight them."""
    router_bias: bool = False
    """``true``: the router projection has a bias (GPT-OSS)."""
    expert_bias: bool = False
    """``true``: the routed experts' projections have biases (GPT-OSS)."""
    num_experts: int = 0
    """The routed experts of each mixture-of-experts layer, >= 0; 0 (the default): dense MLPs. A
    mixture of experts needs ``type`` llama, deepseek or gpt_oss; ``parallel.expert_parallel_size`` must
    divide it, and the other expert keys (and ``expert_parallel_size > 1``) need it. Not yet with
    sequence parallelism, gradient compression, a ``parallel.communication_dtype`` other than fp32 or
    offload; LoRA on the attention projections only; DPO and GRPO add no router loss (TRL's default,
    ``output_router_logits`` off); in a pipeline only with ``parallel.tensor_parallel_size=1``, ``first_k_dense=0``, no fp16
    and the ``1f1b`` or ``interleaved`` schedule."""
    num_experts_per_tok: int = 2
    """``k``: the routed experts each token goes to (the top k of the router's scores), from 1 to
    ``num_experts``."""
    moe_intermediate_size: int = 0
    """One routed expert's SwiGLU width, >= 0; 0: ``intermediate_size``."""
    num_shared_experts: int = 0
    """The experts every token passes through besides its routed ones (DeepSeek-MoE), >= 0: one dense
    SwiGLU MLP of ``num_shared_experts ×`` the expert width; 0: none."""
    first_k_dense: int = 0
    """The first layers that keep a dense MLP (DeepSeek-MoE), >= 0 and < ``num_layers``. Must be 0
    with pipeline parallelism (for now)."""
    router_scoring: Literal["softmax", "sigmoid"] = "softmax"
    """How the router scores the experts from its fp32 logits: ``softmax`` (Mixtral, Qwen3-MoE) or
    ``sigmoid`` (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """``true``: the chosen experts' weights are renormalised to sum to one (Mixtral; Qwen3-MoE as its
    config says)."""
    router_aux_loss_coef: float = 0.001
    """The weight of the load-balancing loss in the training loss, >= 0. The loss is Switch/GShard's ``E
    · Σ_e f_e · P_e``, with ``f_e`` the expert's slots per token and ``P_e`` its mean routing
    probability, over the MoE layers as ``router_aux_loss_form`` says."""
    router_aux_loss_form: Literal["pooled", "per_layer"] = "pooled"
    """How the load-balancing loss combines the MoE layers. ``pooled`` (the default; Hugging Face's
    ``load_balancing_loss_func`` for Mixtral and Qwen3-MoE): ``f_e`` and ``P_e`` are means over all
    the tokens of all the MoE layers, then one ``E · Σ_e f_e · P_e``. ``per_layer`` (jaxcolossal
    before issue 45): the loss of each layer, averaged over the layers. They are equal with one MoE
    layer; with more they differ (one product of means against a mean of products)."""
    router_z_loss_coef: float = 0.0
    """The weight of the router z-loss in the training loss, >= 0; 0 (the default): none. The loss is
    ST-MoE's mean squared log-sum-exp of the router logits, averaged over the MoE layers."""
    capacity_factor: float = 0.0
    """The experts' capacity, >= 0; 0 (the default): dropless. 0 sorts the tokens by expert (grouped
    matmuls); > 0 gives each expert ``ceil(capacity_factor · tokens · k / E)`` slots per device and
    drops the tokens beyond them (GShard, Switch)."""

    @property
    def moe(self) -> bool:
        """True when the layers' MLPs are mixtures of experts (``num_experts > 0``)."""
        return self.num_experts > 0

    @property
    def expert_size(self) -> int:
        """One routed expert's intermediate size (``moe_intermediate_size``, else ``intermediate_size``)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_layers(self) -> int:
        """The layers with a mixture of experts (all but the first ``first_k_dense``); 0 when dense."""
        return self.num_layers - self.first_k_dense if self.moe else 0

    @property
    def head_dim(self) -> int:
        """``attention_head_dim`` when set (Qwen3 decouples it), else ``hidden_size / num_attention_heads``."""
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_dims(self) -> tuple[int, int]:
        """``(q·k dims, value dims)`` of one attention head: ``qk_nope_head_dim + qk_rope_head_dim`` and
        ``v_head_dim`` for multi-head latent attention (``type=deepseek``), else ``head_dim`` both."""
        if self.type == "deepseek":
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's ``sliding_attention`` or ``full_attention`` (``layer_types``, else every layer
        sliding when ``sliding_window > 0``, else full)."""
        named = tuple(v.strip() for v in self.layer_types.split(",") if v.strip())
        if named:
            return named
        return ("sliding_attention" if self.sliding_window else "full_attention",) * self.num_layers

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window in tokens (0: the whole causal prefix)."""
        return tuple(self.sliding_window if k == "sliding_attention" else 0 for k in self.layer_kinds)

    @property
    def lora_target_choices(self) -> tuple[str, ...]:
        """The LoRA targets this model has (:data:`LORA_TARGETS` order): multi-head latent attention's
        (``type=deepseek``: ``q_a, q_b`` or, without a q latent, ``q``; ``kv_a, kv_b, o``), a mixture of
        experts' attention (``q, k, v, o``), else every LLaMA projection."""
        if self.type == "deepseek":
            named = ("o", "q_a", "q_b") if self.q_lora_rank else ("q", "o")
            return tuple(t for t in LORA_TARGETS if t in named + ("kv_a", "kv_b"))
        return ("q", "k", "v", "o") if self.moe else ("q", "k", "v", "o", "gate", "up", "down")

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """``lora.targets`` resolved for this model: the named ones (:data:`LORA_TARGETS` order), or
        for ``all`` every one of :attr:`lora_target_choices`."""
        every = {t.strip() for t in self.lora.targets.split(",") if t.strip()} == {"all"}
        return self.lora_target_choices if every else self.lora.target_list

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q·k: ``query_pre_attn_scalar^-1/2``, else ``head_dim^-1/2``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


@dataclass
class TrainingConfig:
    """The optimisation: the batch and sequence length, AdamW with clipping and its warmup + cosine
    schedule (:mod:`jaxcolossal.train.optimizer`), evaluation, resuming, non-finite steps and the
    text sampled at the end of the run."""

    batch_size: int = 16
    """The global batch, in sequences per optimizer step (over all data-parallel ranks and
    accumulation steps), >= 1. Must be divisible by ``gradient_accumulation_steps``, and each
    microbatch (``batch_size / gradient_accumulation_steps``) by the data-parallel size; with
    pipeline parallelism by ``data_parallel_size × parallel.num_microbatches``. Replaced by
    ``micro_batch_size × gradient_accumulation_steps × data_parallel_size`` when
    ``micro_batch_size`` > 0."""
    objective: Literal["sft", "dpo", "grpo", "reward"] = "sft"
    """What the train step minimises (:mod:`jaxcolossal.train.objective`): ``sft`` (the default), the
    next-token cross-entropy over the (masked-in) tokens, pre-training and supervised fine-tuning;
    ``dpo``, Direct Preference Optimization on preference pairs (``data.format=preference``; the
    ``posttrain`` section; docs/posttraining.md); ``grpo``, Group Relative Policy Optimization with
    rewards on completions sampled from the policy itself (``data.format=prompts``; the ``posttrain``
    section); ``reward``, a reward model (a scalar score head, ``model.num_labels=1``) trained on
    preference pairs (``data.format=preference``) as TRL's ``RewardTrainer`` trains it. Post-training is an objective on the same state, sharding, step and loop, not a second
    trainer. With ``dpo`` and ``reward``, ``batch_size`` counts sequences (two per pair) and each data shard's
    microbatch must hold whole pairs (an even number of rows); with ``grpo`` it counts completions,
    ``posttrain.num_generations`` per prompt (it must divide ``batch_size``)."""
    micro_batch_size: int = 0
    """Colossal-AI's per-rank micro batch, in sequences, >= 0; 0 (the default): use ``batch_size``. When
    > 0 it defines the global batch instead: ``batch_size = micro_batch_size ×
    gradient_accumulation_steps × dp`` (``dp``: the resolved ``parallel.data_parallel_size``), set when
    the config is validated against a device count."""
    seq_len: int = 128
    """The tokens per training sequence, >= 1 (text windows hold ``seq_len + 1`` tokens: the inputs
    and the shifted targets; chat conversations are cut to it). At most
    ``model.max_position_embeddings``; divisible by ``tensor_parallel_size`` under
    ``parallel.sequence_parallelism_mode=split_gather``, by ``sequence_parallel_size`` under
    ``all_to_all`` and by ``2 · sequence_parallel_size`` under ``ring_attn``."""
    gradient_accumulation_steps: int = 1
    """The microbatches per optimizer step, >= 1: the global batch is split into this many and their
    gradients are summed before one update. With pipeline parallelism the pipeline microbatches
    replace it: it is ``parallel.num_microbatches``'s default, and the two may not disagree."""
    learning_rate: float = 3e-3
    """The schedule's peak learning rate, > 0: a linear warmup over ``warmup_steps``, then a cosine
    decay to ``learning_rate × min_learning_rate_ratio`` at the last step (``max_steps``)."""
    min_learning_rate_ratio: float = 0.1
    """The learning rate at the end of the cosine decay as a fraction of ``learning_rate``, in
    [0, 1]."""
    max_steps: int = 300
    """The optimizer steps of the whole run, >= 1, counting the steps before a resume (a resumed run
    trains from the checkpoint's step to ``max_steps``); the cosine decay ends there."""
    warmup_steps: int = 30
    """The steps of linear learning-rate warmup, >= 0; 0: none (the first step runs at the peak). Step
    ``s`` (0-based) runs at ``learning_rate · (s + 1) / warmup_steps``, the peak reached at step
    ``warmup_steps − 1``."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, >= 0 (scaled by the learning rate, as ``optax.adamw``), on
    weight matrices and embeddings, not on norm scales or biases."""
    adam_beta1: float = 0.9
    """Adam's first-moment (momentum) decay β₁, in [0, 1); also the shards' momentum under
    ``parallel.momentum_correction``."""
    adam_beta2: float = 0.95
    """Adam's second-moment decay β₂, in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam's ε, > 0, added to the square root of the second moment in the update's denominator."""
    adam_freeze_step: int = 0
    """1-bit Adam's freeze step, >= 0: after that many optimizer steps Adam's second moment stops
    changing; 0 (the default): never. As DeepSpeed's ``OnebitAdam(freeze_step)`` (Tang et al., 2021;
    :func:`jaxcolossal.train.optimizer.scale_by_adam_frozen_variance`). Top-k's error feedback needs it:
    set it to ``parallel.compression_warmup_steps`` (docs/communication.md). Needs ``optimizer=adamw``
    and an optimizer state in device memory (no ``offload.offload_optim_frac``,
    ``placement_policy=auto`` or ``nvme_path``)."""
    max_grad_norm: float = 1.0
    """The global L2 norm the gradients are clipped to before the update (over all parameters, each
    counted once), >= 0; 0: no clipping."""
    seed: int = 1024
    """The run's random seed, in [0, 2³² − 1]. It draws a fresh model's parameters, the order of the
    training batches (a pure function of the seed and the step, so a resume continues it), LoRA's
    dropout masks and the end-of-run sample."""
    eval_every: int = 100
    """The steps between validation-loss evaluations, >= 0; 0: only at the start and the end. With
    ``checkpoint.dir`` each evaluation also saves a checkpoint (a candidate for the best)."""
    eval_batches: int = 8
    """The batches of each evaluation, >= 1, each of ``batch_size / gradient_accumulation_steps``
    sequences. They are the same for the whole run: from the held-out split (``data.val_fraction``), or
    from the training data when that split is too short."""
    resume: Literal[False, True, "auto"] = False
    """Whether to restore from ``checkpoint.dir``: ``false``, ``true`` or ``auto``. ``false`` starts
    fresh (and refuses a ``checkpoint.dir`` that already holds checkpoints unless
    ``checkpoint.overwrite``); ``true`` restores the newest restorable step and fails when there is
    none; ``auto`` restores when there is one and starts fresh otherwise. ``true`` and ``auto`` need
    ``checkpoint.dir``."""
    nonfinite_policy: Literal["stop", "skip"] = "stop"
    """What a step whose loss or gradient norm is NaN/inf does: ``stop`` or ``skip``. In every precision
    its update is never applied; ``stop`` ends the run with an error at once, ``skip`` skips the step
    and stops after ``precision.max_consecutive_skips`` in a row. fp16 overflows follow the loss scaler
    instead (skip, back off, stop at ``precision.min_scale``)."""
    optimizer: Literal["adamw", "fused_adamw"] = "adamw"
    """The AdamW implementation: ``adamw`` or ``fused_adamw``. ``adamw`` is ``optax.adamw``;
    ``fused_adamw`` (:func:`jaxcolossal.optim.fused_adamw`, Colossal-AI's HybridAdam) runs a fused
    update kernel on each device's shard of the optimizer state. ``adam_freeze_step`` needs ``adamw``; a
    resumed checkpoint must have the same."""
    sample_tokens: int = 200
    """The tokens generated from ``sample_prompt`` at the end of the run, >= 0 (with a context of at
    most ``min(seq_len, 2048)`` tokens); 0: no sample."""
    sample_prompt: str = ""
    """The prompt of the end-of-run sample. ``""`` (the default) means ``"def "`` for text corpora,
    and for ``data.format=chat`` the first held-out conversation up to its response, rendered by
    the chat template; with chat a prompt you give is the user's turn, and the sample ends at the
    end-of-text token."""


SIMULATED_DEVICES = "(simulated CPU devices) run scripts/train.py with --devices {n}"
"""How :meth:`ParallelConfig.resolve` advises running on ``{n}`` devices by default."""


def fitting_overrides(sizes: dict[str, int], num_devices: int) -> str:
    """The overrides (``parallel.KEY=VALUE``, space-separated, as scripts/train.py takes them) that
    make ``sizes`` (parallel size name -> size, one of them possibly ``-1``) fit ``num_devices``:
    each size that does not divide the devices left by the sizes before it is lowered to its
    greatest common divisor with them; a ``-1`` is left out (it takes what is left)."""
    left, changes = num_devices, []
    for k, v in sizes.items():
        if v == -1:
            continue
        fit = math.gcd(v, left)
        if fit != v:
            changes.append(f"parallel.{k}={fit}")
        left //= fit
    return " ".join(changes)


@dataclass
class ParallelConfig:
    """The device mesh, the ZeRO stage, the pipeline and the data-parallel communication
    (docs/zero.md, docs/pipeline.md, docs/communication.md, docs/long_context.md, docs/moe.md).

    The mesh has six axes, outermost first: ``(pp, dp, fsdp, ep, sp, tp)``
    (:data:`jaxcolossal.parallel.mesh.MESH_AXES`). ``pp`` is ``pipeline_parallel_size``, ``sp``
    ``sequence_parallel_size``, ``tp`` ``tensor_parallel_size``; the data-parallel group of
    ``data_parallel_size`` is ``dp × fsdp × ep``, with ``ep`` (``expert_parallel_size``) carved out of
    it and ZeRO (``zero_stage > 0``) sharding over the rest (``fsdp``; ``dp`` when ZeRO is off).
    ``-1`` in a size means "the remaining devices"; ``data_parallel_size × tensor_parallel_size ×
    pipeline_parallel_size × sequence_parallel_size`` must equal the device count (:meth:`resolve`).
    """

    data_parallel_size: int = -1
    """The data-parallel group's size ``dp × fsdp × ep``, >= 1 or ``-1`` (the default: the devices the
    other sizes leave). With ``zero_stage > 0`` ZeRO shards over the whole group (``fsdp`` = the
    group, ``dp = 1``); with ``zero_stage == 0`` it is plain DDP (``dp`` = the group). The batch is
    split over it; ``expert_parallel_size`` must divide it."""
    tensor_parallel_size: int = 1
    """Megatron tensor parallelism over the mesh axis ``tp``, >= 1 or ``-1``: the attention heads,
    the MLP and the vocabulary are split over it. Must divide ``model.num_attention_heads``,
    ``num_key_value_heads`` and ``intermediate_size``; ``sequence_parallelism_mode=split_gather``
    needs it > 1; ``gradient_compression`` needs 1."""
    pipeline_parallel_size: int = 1
    """The pipeline stages on the mesh axis ``pp`` (outermost), >= 1 or ``-1``: the decoder layers are
    split into this many stages, and ``model.num_layers`` must be divisible by it ×
    ``num_model_chunks``. With > 1 the pipeline microbatches (``num_microbatches``) replace gradient
    accumulation. Not yet with ``gradient_compression``, a ``communication_dtype`` other than fp32,
    ``sequence_parallelism_mode=all_to_all``, ``offload.offload_param_frac``,
    ``model.attention_impl=flash``, ``data.packing_mask``, ``data.format=chat`` or LoRA dropout;
    a mixture of experts has its own limits there (``model.num_experts``)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """The ZeRO stage, 0 to 3: what is sharded over the data-parallel group (the mesh axis ``fsdp``). 0
    nothing (DDP), 1 the optimizer state (with the fp32 master copy), 2 also the gradients, 3 also the
    parameters (FSDP). With experts split over ``expert_parallel_size`` the dense part's state is
    sharded over the whole data group and the experts' over ``data_parallel_size /
    expert_parallel_size`` (in a pipeline both over the latter). With ``zero_stage > 0``
    ``model.hidden_size`` must be divisible by that smaller group; ``gradient_compression`` needs 0 or 1,
    ``offload.offload_param_frac`` needs 3."""
    num_microbatches: int = 0
    """The pipeline microbatches per step ``m`` (with ``pipeline_parallel_size > 1``), >= 0: each
    data-parallel shard's batch is split into ``m``. 0: ``training.gradient_accumulation_steps`` when
    that is > 1, else ``2 × pipeline_parallel_size``. With ``num_model_chunks > 1`` it must be a
    multiple of ``pipeline_parallel_size``."""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """The pipeline schedule: ``gpipe``, ``1f1b`` or ``interleaved`` (docs/pipeline.md). ``gpipe``:
    forward ticks and autodiff's backward, the residuals of all microbatches live at once; with
    ``num_model_chunks > 1`` the circular pipeline. ``1f1b``: one forward and one backward per tick from
    stashed stage inputs, memory independent of ``num_microbatches``; one chunk per device.
    ``interleaved``: 1F1B over ``num_model_chunks >= 2`` virtual stages per device."""
    num_model_chunks: int = 1
    """The virtual stages (model chunks) per device ``v``, >= 1: >= 2 for ``interleaved``, 1 for
    ``1f1b``; ``gpipe`` accepts any (``v > 1``: the circular pipeline). ``model.num_layers`` must be
    divisible by ``pipeline_parallel_size × v``."""
    gradient_compression: Literal["none", "topk", "powersgd"] = "none"
    """How the data-parallel gradient is sent: ``none``, ``topk`` or ``powersgd``. ``none``: a dense
    reduction. ``topk``: each shard sends only the ``compression_ratio`` fraction of its gradient's
    elements largest in magnitude (values and int32 indices, all-gathered; every rank sums them densely;
    Lin et al., 2018, Deep Gradient Compression). ``powersgd``: each weight matrix's gradient is sent as
    rank-``powersgd_rank`` factors (Vogels et al., 2019). Data-parallel traffic only; needs
    ``zero_stage`` <= 1, no tensor, pipeline or sequence parallelism and ``communication_dtype=fp32``
    (for now); not with LoRA or a mixture of experts."""
    compression_ratio: float = 0.01
    """``gradient_compression=topk``: the fraction of each shard's gradient elements sent per step,
    in (0, 1]."""
    powersgd_rank: int = 4
    """``gradient_compression=powersgd``: the rank of the factors each weight matrix's gradient is
    sent as, >= 1."""
    compression_warmup_steps: int = 0
    """The first steps, >= 0, whose gradients are reduced densely before compression starts
    (PyTorch's ``start_powerSGD_iter``, DGC's warm-up); 0: compress from the first step.
    ``training.adam_freeze_step`` goes with it (docs/communication.md)."""
    error_feedback: bool = True
    """``true`` (the default): what a shard did not send is added to its next step's gradient. The
    unsent part is a per-shard fp32 residual in the train state, saved in checkpoints; for
    ``gradient_compression`` ``topk`` and ``powersgd``. ``momentum_correction`` needs it."""
    momentum_correction: bool = False
    """DGC's momentum correction (Lin et al., 2018, §3.2), default off. Each shard keeps its own
    momentum ``u = β₁·u + (1 − β₁)·g`` (``training.adam_beta1``; starting from 1/N of Adam's at the
    first compressed step) and sends the top-k of ``residual + u``. From then on the optimizer takes
    what arrives as its first moment (no second momentum on top); at ratio 1 this is exactly Adam. DGC's
    momentum factor masking is left out (docs/communication.md). A second per-shard fp32 buffer in the
    train state. Needs ``gradient_compression=topk`` with ``error_feedback`` and
    ``training.adam_freeze_step > 0``."""
    communication_dtype: Literal["fp32", "bf16", "fp8"] = "fp32"
    """The dtype the data-parallel gradient reduction moves: ``fp32`` (the default), ``bf16`` or ``fp8``
    (e4m3, per-tensor scale). The reduction is an all-to-all and a local fp32 sum, then an all-gather
    where every rank needs the whole sum (ZeRO++'s qgZ, Colossal-AI's ``fp8_communication``). Under
    ZeRO-3 it is also the dtype each layer's weights are all-gathered in where it is narrower than the
    compute dtype (ZeRO++'s qwZ; the backward is straight-through). Any ZeRO stage and tensor
    parallelism; not with pipeline or sequence parallelism or ``gradient_compression``
    (:mod:`jaxcolossal.parallel.compression`)."""
    overlap: bool = True
    """Overlap communication with compute (default true; Colossal-AI's ``overlap_communication``). It
    sets XLA's GPU flags for the latency-hiding scheduler and collective pipelining, and under ZeRO-3
    while-loop double buffering, before the backend starts (:mod:`jaxcolossal.runtime.xla_flags`; GPUs
    only, only the flags the jaxlib accepts). Under ZeRO-3 with ``model.remat=full`` (and fp32
    communication, no parameter offload) the layer scan also gathers layer i+1's weights before layer i
    runs, forward and backward (:func:`jaxcolossal.parallel.layer_scan.prefetched_scan`): one more
    layer's weights held per device. Under Megatron-SP (``split_gather``) it runs the projections as TP
    collective matmuls (:mod:`jaxcolossal.parallel.collective_matmul`) for sequences of at least
    ``collective_matmul_min_seq`` tokens."""
    collective_matmul_min_seq: int = 0
    """The shortest ``training.seq_len``, in tokens, >= 0, whose projections run as TP collective
    matmuls; 0 (the default): every length. Only under ``sequence_parallelism_mode=split_gather`` with
    ``overlap`` (no GPU has measured where it starts to pay)."""
    bucket_size_mb: float = 0.0
    """XLA's combine threshold for collectives, in MiB, >= 0; 0: XLA's defaults. Like Colossal-AI's
    ``reduce_bucket_size_in_m``: small all-reduces, all-gathers and reduce-scatters are combined into
    one up to this size (GPU flags, :mod:`jaxcolossal.runtime.xla_flags`)."""
    heartbeat_timeout_s: int = 0
    """Seconds without a heartbeat after which ``jax.distributed``'s coordination service declares a
    process dead and fails the others (``jax.distributed.initialize(heartbeat_timeout_seconds=...)``),
    >= 0; 0 (the default): the collective timeout (``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT``, default 300)
    capped at jax's own 100. Lower it so that a dead host ends the job sooner and a launcher
    (``python -m jaxcolossal.run --max-restarts``, docs/fault_tolerance.md) restarts it; multi-process
    runs only (read by scripts/train.py's ``launch_from_env``)."""
    nccl_abort_on_error: bool = False
    """Let a failed NCCL collective abort and return an error instead of hanging (default false): XLA's
    ``--xla_gpu_nccl_terminate_on_error=false``, ``--xla_gpu_nccl_async_execution=true`` and
    ``--xla_gpu_nccl_blocking_communicators=false`` as the train step's compile options, on a mesh of
    GPUs only (none on other platforms; a flag you set in ``XLA_FLAGS`` wins;
    :data:`jaxcolossal.runtime.xla_flags.NCCL_ABORT_OPTIONS`). The process then exits with the error,
    and a launcher with restarts starts the group again (docs/fault_tolerance.md)."""
    sequence_parallel_size: int = 1
    """The mesh axis ``sp``, >= 1 or ``-1``: the sequence of every activation is split over it (context
    parallelism). Above 1 it needs ``sequence_parallelism_mode`` ``all_to_all`` or ``ring_attn``
    (``split_gather`` needs 1). Not with ``gradient_compression`` or a ``communication_dtype`` other
    than fp32."""
    sequence_parallelism_mode: Literal["none", "split_gather", "all_to_all", "ring_attn"] = "none"
    """The sequence parallelism mode: ``none``, ``split_gather``, ``all_to_all`` or ``ring_attn``
    (Colossal-AI's modes; :mod:`jaxcolossal.parallel.sequence`). ``split_gather``: Megatron-SP, the
    residual stream's sequence split over the ``tp`` group; needs ``tensor_parallel_size`` > 1 and
    ``sequence_parallel_size`` 1. ``all_to_all``: DeepSpeed-Ulysses, q/k/v swapped from sequence- to
    head-sharded around attention; not with pipeline parallelism. ``ring_attn``: ring attention, k/v
    blocks passed around the ``sp`` ring in zig-zag order; needs ``model.attention_impl=xla``.
    ``training.seq_len`` must split accordingly."""
    expert_parallel_size: int = 1
    """The mesh axis ``ep`` (Colossal-AI's ``ep_size``), >= 1: a mixture of experts' routed experts are
    split over it. It is carved out of the data-parallel group and must divide ``data_parallel_size``
    and ``model.num_experts``; the batch is split over it as over the rest of the group, and tokens go
    to their experts' devices and back by all-to-all (:mod:`jaxcolossal.parallel.expert`). ZeRO shards
    the state over the rest of the data group (``data_parallel_size / expert_parallel_size``). Above 1
    it needs ``model.num_experts``."""

    def resolve(self, num_devices: int, other_count: str = SIMULATED_DEVICES) -> "ParallelConfig":
        """Return a copy with ``-1`` filled so that dp·sp·tp·pp == ``num_devices``.

        ``other_count`` is the advice for running on as many devices as the sizes multiply to, with
        ``{n}`` for that count (the default: scripts/train.py's ``--devices`` for simulated CPU devices;
        ``--compile-for`` passes its own).

        Raises:
            ConfigError: if the sizes cannot multiply to ``num_devices``, naming the overrides that
                fit the devices (:func:`fitting_overrides`).
        """
        sizes = {
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "sequence_parallel_size": self.sequence_parallel_size,
        }
        unknown = [k for k, v in sizes.items() if v == -1]
        for k, v in sizes.items():
            if v != -1 and v < 1:
                raise ConfigError(f"parallel.{k}={v}: must be a positive integer or -1 (the remaining devices)")
        if len(unknown) > 1:
            raise ConfigError(f"parallel: at most one of {sorted(sizes)} may be -1, got -1 for {unknown}")
        known = math.prod(v for v in sizes.values() if v != -1)
        if unknown:
            if num_devices % known:
                given = " × ".join(f"{k}={v}" for k, v in sizes.items() if v not in (-1, 1)) or "1"
                divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
                raise ConfigError(
                    f"parallel.{unknown[0]}=-1: the other sizes ({given}) multiply to {known}, "
                    f"which does not divide the {num_devices} devices; their product must be one of "
                    f"{divisors}: set {fitting_overrides(sizes, num_devices)}")
            sizes[unknown[0]] = num_devices // known
        product = math.prod(sizes.values())
        if product != num_devices:
            sp = sizes["sequence_parallel_size"]
            raise ConfigError(
                "parallel: data_parallel_size × tensor_parallel_size × pipeline_parallel_size"
                + (" × sequence_parallel_size" if sp != 1 else "") + " = "
                f"{sizes['data_parallel_size']}×{sizes['tensor_parallel_size']}×"
                f"{sizes['pipeline_parallel_size']}" + (f"×{sp}" if sp != 1 else "")
                + f" = {product}, but there are {num_devices} devices; set "
                + f"parallel.data_parallel_size=-1 {fitting_overrides(dict(sizes, data_parallel_size=-1), num_devices)}"
                .strip()
                + f" to use them all, or {other_count.format(n=product)}")
        return dataclasses.replace(self, **sizes)


@dataclass
class PrecisionConfig:
    """Mixed precision. Neither ``bf16`` nor ``fp16``: fp32 everywhere. fp16's dynamic loss scaling
    has Colossal-AI's ``DynamicGradScaler`` semantics and defaults (:mod:`jaxcolossal.optim.loss_scale`):
    an overflowing step is skipped on every device."""

    bf16: bool = False
    """bf16 compute with fp32 master weights and an fp32 gradient reduction (unless
    ``parallel.communication_dtype``); exclusive with ``fp16``."""
    fp16: bool = False
    """fp16 compute with fp32 master weights, an fp32 gradient reduction (unless
    ``parallel.communication_dtype``) and dynamic loss scaling (the keys below); exclusive with
    ``bf16``."""
    fp8: bool = False
    """FP8 projections on top of ``bf16``, which it needs. The layers' projections (q, k, v, o and the
    MLP's) multiply in FP8, Transformer Engine's recipe with current per-tensor scaling: activations and
    weights in e4m3, gradients in e5m2, each tensor scaled by its own amax in the step that uses it
    (:func:`jaxcolossal.models.layers.linear.project_fp8`). Master weights, optimizer state, the
    embedding, the LM head and attention stay as in bf16. On GPUs with FP8 tensor cores (Hopper,
    Blackwell) XLA turns each into an FP8 GEMM; elsewhere the numerics are emulated."""
    fp16_opt_level: Literal["O1", "O2"] = "O2"
    """Colossal-AI's fp16 level, ``O1`` or ``O2``: accepted so that its configs load, and read by
    nothing; fp16 always runs as ``precision.fp16`` says (fp16 compute, fp32 master weights)."""
    initial_scale: float = 2.0**16
    """fp16: the loss scale at the start, > 0."""
    growth_factor: float = 2.0
    """fp16: the factor, >= 1, the loss scale grows by after ``growth_interval`` overflow-free steps
    in a row (up to ``max_scale``)."""
    backoff_factor: float = 0.5
    """fp16: the factor, in (0, 1], the loss scale shrinks by on an overflow once ``hysteresis`` is
    reached (down to ``min_scale``)."""
    growth_interval: int = 1000
    """fp16: the overflow-free steps in a row, >= 1, after which the loss scale grows by
    ``growth_factor``."""
    hysteresis: int = 2
    """fp16: the overflows, >= 1, that back the loss scale off: from the ``hysteresis``-th overflow
    since the scale last grew (or since the start) on, each overflow multiplies it by
    ``backoff_factor``; the earlier ones only skip their step."""
    min_scale: float = 1.0
    """fp16: the smallest loss scale, > 0 and <= ``max_scale``; the run stops when
    ``max_consecutive_skips`` steps in a row overflow with the scale at it."""
    max_scale: float = 2.0**32
    """fp16: the largest loss scale, > 0."""
    max_consecutive_skips: int = 20
    """The non-finite steps in a row, >= 1, after which the run stops: with
    ``training.nonfinite_policy=skip``, and in fp16 when they overflow with the loss scale at
    ``min_scale``."""

    @property
    def mode(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass
class DataConfig:
    """The training text (docs/data.md): the files, their format, the tokenizer, the held-out split
    and the pre-tokenization cache."""

    corpus: str = "stdlib"
    """The files to read: ``stdlib`` (the running Python's standard-library sources) or comma-separated
    globs (``**`` matches nested folders). For ``format=datasets`` a folder written by ``datasets``'
    ``save_to_disk``. Every ``format`` but ``text`` needs files, not ``stdlib``. ``~`` and ``$VAR`` are
    expanded."""
    format: Literal["text", "jsonl", "parquet", "datasets", "chat", "preference", "prompts"] = "text"
    """How the files are read: ``text``, ``jsonl``, ``parquet``, ``datasets`` or ``chat``. ``text``:
    pre-training, documents joined into one stream and cut into random windows (``.jsonl`` files read as
    JSON lines by their suffix). ``jsonl``: every file is JSON lines. ``parquet``: column ``text_key``,
    with ``pyarrow``. ``datasets``: ``corpus`` is a ``datasets`` ``save_to_disk`` folder. ``chat``:
    instruction fine-tuning, JSON lines of ``messages`` or ``prompt``/``response``, one conversation per
    row, loss on the responses only (:mod:`jaxcolossal.data.chat`); not with pipeline parallelism.
    ``preference``: DPO's pairs (``training.objective=dpo``), JSON lines of ``prompt``/``chosen``/``rejected``
    as plain text or chat messages, loss on the responses only (:mod:`jaxcolossal.data.preference`).
    ``prompts``: GRPO's prompts (``training.objective=grpo``), JSON lines of ``prompt`` (plain text) with
    an optional ``answer`` that the reward functions receive (:mod:`jaxcolossal.data.prompts`)."""
    text_key: str = "text"
    """The JSON field (``.jsonl`` lines) or the column (``parquet``, ``datasets``) that holds each
    document's text."""
    tokenizer: str = "auto"
    """The tokenizer: ``byte``, the path of a local tokenizer, or ``auto`` (the default). ``byte``: one
    token per byte, 256 ids. A path: a folder with a Hugging Face ``tokenizer.json`` or a SentencePiece
    ``tokenizer.model``, or that file. ``auto``: the ``tokenizer.json`` in ``model.init_from`` when that
    folder has one, else ``byte``. ``model.vocab_size`` must cover its ids. ``~`` and ``$VAR`` are
    expanded."""
    val_fraction: float = 0.05
    """The share of the data held out for the validation loss, from the end, in [0, 1): the last
    tokens of the stream (``chat``: the last conversations, at least one). 0: none held out (the
    evaluations then read the training data)."""
    max_corpus_bytes: int = 0
    """A cap on a pre-training corpus, >= 0: the stream is cut to this many tokens (bytes with the
    byte tokenizer) and reading stops once it has them; 0: all of it. Not used by ``format=chat``."""
    cache_dir: str = "~/.cache/jaxcolossal/tokens"
    """Where a pre-training corpus's token stream is cached after its first tokenization; ``""``
    tokenizes at every start. Later runs memory-map it (:mod:`jaxcolossal.data.cache`; the key covers
    the files, the tokenizer, ``text_key`` and ``max_corpus_bytes``). ``~`` and ``$VAR`` are
    expanded."""
    packing_mask: bool = False
    """``true``: keep the documents that share a window apart. Such windows get segment ids and
    per-document positions, so attention does not cross a document boundary and positions restart, and
    the target that crosses one is not trained on (:func:`jaxcolossal.data.loader.packing_fields`).
    Pre-training formats only; needs ``model.attention_impl`` ``xla`` or ``flash``, and no pipeline
    parallelism."""
    skip_long_examples: bool = False
    """``format=chat`` and ``preference`` only. ``false`` (the default): a conversation with no response token left within
    ``training.seq_len`` tokens (its prompt alone fills the window) stops the run, naming its file and
    line. ``true``: such conversations are dropped, and the log says how many and where (the first few
    ``file:line``); the others are kept as they are, in the same order. A conversation whose response is
    only partly cut is kept either way (counted as cut)."""


@dataclass
class PosttrainConfig:
    """Post-training objectives (:mod:`jaxcolossal.train.objective`): preference optimisation
    (``training.objective=dpo``) as TRL's ``DPOTrainer`` defines it, and GRPO
    (``training.objective=grpo``) as TRL's ``GRPOTrainer`` does (trl 1.16); the key names are TRL's."""

    beta: AutoFloat = "auto"
    """``auto`` (the default): TRL 1.16's default of the run's objective, 0.1 for DPO (``DPOConfig``)
    and 0.0 for GRPO (``GRPOConfig``). DPO's β (IPO's τ), > 0: how far the policy may move from the
    reference; the rewards are ``β·(log π - log π_ref)`` of each response. GRPO: the KL penalty's
    weight, >= 0; 0 keeps no reference model at all."""
    loss_type: str = "auto"
    """``auto`` (the default): ``sigmoid`` for DPO, ``dapo`` for GRPO (TRL's defaults). DPO (TRL 1.16's
    ``loss_type`` list): one or several comma-separated names (or a YAML list) of ``sigmoid``, ``hinge``,
    ``ipo``, ``exo_pair``, ``nca_pair``, ``robust``, ``bco_pair``, ``sppo_hard``, ``aot``, ``aot_unpaired``,
    ``apo_zero``, ``apo_down``, ``discopop``, ``sft``, ``sigmoid_norm``, each computed as TRL's
    ``DPOTrainer._compute_loss`` does (docs/posttraining.md has their formulas) and summed with
    ``loss_weights`` (MPO: ``sigmoid,bco_pair,sft``). GRPO, one of TRL 1.16's eight
    (docs/posttraining.md): ``grpo``, each completion's mean, then the mean over completions; ``bnpo``,
    each microbatch's mean over its completion tokens, then the mean over the microbatches; ``dapo``,
    the mean over all the step's completion tokens; ``dr_grpo``, the sum divided by ``completions ×
    max_completion_length``; ``cispo``, the clipped, detached ratio times the advantage times the
    log-prob (ScaleRL/MiniMax-M1), averaged like ``dapo``; ``sapo``, a sigmoid-softened ratio (per-sign
    temperatures ``sapo_temperature_pos``/``_neg``), averaged like ``grpo``; ``luspo``, each completion's
    summed loss averaged over completions; ``vespo``, a gamma weight of the sequence ratio times the
    advantage times the log-prob, averaged like ``dapo``."""
    label_smoothing: float = 0.0
    """DPO: TRL's ``label_smoothing`` ε in ``[0, 1)``, read only by ``robust`` (the share of flipped
    labels, < 0.5), ``exo_pair`` (EXO's ε, > 0: the paper's 1e-3), ``aot`` and ``aot_unpaired``; set with
    none of them in ``loss_type`` it is refused. ``sigmoid`` has no label smoothing (conservative DPO
    was TRL's ``sigmoid`` before 1.0)."""
    loss_weights: str = ""
    """DPO: TRL's ``loss_weights``, comma-separated numbers (or a YAML list), one per ``loss_type`` name:
    the loss is the weighted sum of each type's mean over pairs; ``""`` (the default): 1 each."""
    discopop_tau: float = 0.05
    """DPO: DiscoPOP's τ (TRL's ``discopop_tau``), > 0: the temperature of the log-ratio modulation of
    ``loss_type=discopop`` (the paper's 0.05, TRL's default); refused away from 0.05 without ``discopop``."""
    reference: Literal["frozen", "lora_base"] = "frozen"
    """The reference policy: ``frozen``, a copy of the initial params in the compute dtype, sharded like
    the policy and saved with the checkpoints; ``lora_base`` (needs ``model.lora``), the base model
    without the adapters, so no second copy of the weights is held. GRPO holds one only when
    ``beta > 0``."""
    ref_model: str = ""
    """The reference model (TRL's ``ref_model``) of DPO, and of GRPO with ``beta > 0``: ``""`` (the
    default, TRL's None): the initial policy; else a Hugging Face folder (read as ``model.init_from`` is)
    or a run's ``checkpoint.dir`` (its newest step's weights, the fp32 master in bf16/fp16 runs, a LoRA
    run's adapters merged in), whose architecture and vocabulary must be the policy's. Its weights are
    the frozen copy (``reference=frozen``; under LoRA too: then a second set of weights is held),
    sharded like the policy, or with ``precompute_ref_log_probs`` only read by the pass before training."""
    precompute_ref_log_probs: bool = False
    """DPO: TRL's ``precompute_ref_log_probs``. ``true``: one pass before training computes every
    training and held-out pair's reference sequence log-probs (under the run's mesh and ZeRO stage), and
    the steps read them instead of a reference forward; the reference weights are then not held in the
    train state nor checkpointed. The values (2 fp32 per pair) are stored in ``<checkpoint.dir>/ref_logps/``
    and read back, not recomputed, when the run resumes; without ``checkpoint.dir`` they stay in memory.
    Under LoRA the pass runs the base without the adapters (TRL's adapter-off pass)."""
    num_generations: int = 8
    """GRPO: completions sampled per prompt (the group), >= 2; it must divide ``training.batch_size``
    (completions per step), so each step draws ``batch_size / num_generations`` prompts."""
    max_completion_length: int = 512
    """GRPO: tokens sampled per completion at most, >= 1 (TRL's default 512; ``dr_grpo``'s divisor). A row
    holds a prompt of up to ``training.seq_len + 1 - max_completion_length`` tokens (left-padded) and its
    completion, so ``training.seq_len`` must exceed it."""
    temperature: float = 1.0
    """GRPO: the sampling temperature of the rollouts, > 0 (TRL's default 1.0); the policy's, the old
    and the reference log-probs (and the ``entropy`` metric) are those of ``logits / temperature``, as
    TRL computes them."""
    top_k: int = 0
    """GRPO: sample among the ``top_k`` most likely tokens, >= 0; 0: all."""
    top_p: float = 1.0
    """GRPO: nucleus sampling's probability mass, in (0, 1]; 1: all."""
    epsilon: float = 0.2
    """GRPO: the policy ratio's lower clip, ``1 - epsilon`` (TRL's ``epsilon``), in (0, 1)."""
    epsilon_high: float = 0.0
    """GRPO: the ratio's upper clip, ``1 + epsilon_high`` (DAPO's clip-higher, e.g. 0.28), >= 0; 0 (the
    default, TRL's None): ``epsilon``. With ``loss_type=cispo`` it is the ratio's cap itself (ScaleRL's
    ε_max, e.g. 5.0), as in TRL."""
    use_bias_correction_kl: bool = True
    """GRPO (``beta > 0``): the k3 KL estimator is multiplied by the importance ratio ``π/π_old`` (TRL
    1.16's default), which makes it unbiased for completions sampled by an older policy; false: the
    plain k3 estimator."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """GRPO: the importance ratio per token (``token``, the default) or one per completion, the
    exponential of the mean per-token log-ratio (``sequence``: GSPO, Zheng et al., 2025)."""
    delta: float = 0.0
    """GRPO: two-sided clipping (Kimi/INTELLECT-2): the unclipped ratio is capped at ``delta`` (> 1 + ε_high
    is sensible) for the clipped losses (grpo, bnpo, dr_grpo, dapo, luspo); 0 (the default, TRL's None): off."""
    top_entropy_quantile: float = 1.0
    """GRPO: train only on the completion tokens whose entropy is in this top share of each microbatch's
    (Wang et al., 2025, "Beyond the 80/20 rule"), in (0, 1]; 1 (the default): all tokens."""
    sapo_temperature_pos: float = 1.0
    """GRPO ``loss_type=sapo``: the soft gate's temperature for positive advantages, > 0 (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """GRPO ``loss_type=sapo``: the soft gate's temperature for non-positive advantages, > 0 (TRL's default)."""
    vespo_k_pos: float = 2.0
    """GRPO ``loss_type=vespo``: the gamma weight's shape ``k`` for non-negative advantages (TRL's default)."""
    vespo_lambda_pos: float = 3.0
    """GRPO ``loss_type=vespo``: the gamma weight's rate ``λ`` for non-negative advantages (TRL's default)."""
    vespo_k_neg: float = 3.0
    """GRPO ``loss_type=vespo``: the gamma weight's shape ``k`` for negative advantages (TRL's default)."""
    vespo_lambda_neg: float = 2.0
    """GRPO ``loss_type=vespo``: the gamma weight's rate ``λ`` for negative advantages (TRL's default)."""
    dynamic_sampling: bool = False
    """GRPO: DAPO's dynamic sampling (Yu et al., 2025; verl's ``filter_groups``, OpenRLHF, NeMo-RL,
    ColossalChat): groups whose rewards are all equal (zero standard deviation: no signal) are dropped
    and more prompts are sampled, a generation batch at a time, until the generation batch is full of
    groups with a signal (at most ``max_sampling_rounds`` rounds; short of it the last dropped groups fill
    it, with advantage 0). TRL has no such option. The ``sampling/*`` metrics count the rounds, the
    groups dropped and the groups filled."""
    max_sampling_rounds: int = 10
    """GRPO ``dynamic_sampling``: generation rounds per rollout at most, >= 1 (verl's ``max_num_gen_batches``)."""
    advantage: Literal["group", "rloo"] = "group"
    """GRPO: the advantage and the loss around it. ``group`` (the default): ``GRPOTrainer``'s, each reward
    less its group's mean (scaled by ``scale_rewards``), the loss of ``loss_type``. ``rloo``: TRL's
    ``RLOOTrainer`` (Ahmadian et al., 2024): with ``beta > 0`` each reward first less ``β·Σ(log π_old -
    log π_ref)`` over its completion (the KL in the reward, first order), then less the mean of the other
    completions of its group (the leave-one-out baseline); the loss is PPO's clipped objective on each
    completion's summed log-ratio, averaged over completions; ``beta: auto`` is then RLOOConfig's 0.05."""
    normalize_advantages: bool = False
    """GRPO ``advantage=rloo`` (TRL's ``RLOOConfig.normalize_advantages``): the advantages are normalised
    to mean 0 and standard deviation 1 over the generation batch (``+ 1e-4``)."""
    num_iterations: int = 1
    """GRPO's μ, >= 1: optimizer steps on each batch of rollouts. With μ > 1 the log-probs of the
    policy that sampled them are computed once and kept (``old_per_token_logps``); the rollouts are
    drawn again every μ steps."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """GRPO: the advantage ``r - mean(group)`` is divided by the group's standard deviation
    (``group``, the default), the whole batch's (``batch``), or not at all (``none``, Dr. GRPO); plus
    1e-4, as TRL does."""
    reward_funcs: str = "exact_match"
    """GRPO: comma-separated reward functions, each listed once, summed with ``reward_weights``. Built
    in: ``exact_match`` (1 when the completion's final answer, the text after the last ``####`` or in
    the last ``\\boxed{}``, else its first line, equals the row's ``answer``; the prompt rows need an
    ``answer``), ``format`` (1 when the completion matches ``format_pattern``). A user's own:
    ``model:PATH``, a reward model: a one-label ``*ForSequenceClassification`` folder (what ``--to-hf`` writes
    of a ``training.objective=reward`` run) scoring ``prompt + completion`` on the training mesh, as TRL
    scores a reward model (its tokenizer, else the run's). ``module:function`` (looked for on ``sys.path``,
    then in the current folder), called with keywords
    as TRL 1.16 calls one: ``fn(prompts=..., completions=..., completion_ids=[[int]], <every other field
    of the prompt rows>=[...], trainer_state=..., log_extra=..., log_metric=...) -> [float | None]``
    (chat prompts: message lists in, completions ``[{"role": "assistant", "content": str}]``); its
    signature is checked when the config loads."""
    reward_weights: str = ""
    """GRPO: comma-separated weights of ``reward_funcs``, one each; ``""`` (the default): 1 each."""
    format_pattern: str = r"^.*####\s*\S+"
    """GRPO: the regular expression the ``format`` reward matches the completion against
    (``re.search`` with ``re.DOTALL``)."""
    mask_truncated_completions: bool = False
    """GRPO: completions that hit ``max_completion_length`` without an end-of-text token are left out
    of the loss (TRL's ``mask_truncated_completions``, DAPO's overlong filtering). Needs an end-of-text
    id (the tokenizer's or ``model.init_from``'s): without one every completion would be left out."""
    steps_per_generation: int = 0
    """GRPO (TRL's ``steps_per_generation``): microbatches that one generation of completions feeds, >= 0;
    0 (TRL's None): ``training.gradient_accumulation_steps``, one optimizer step per generation. A
    multiple ``k`` of the accumulation steps makes one rollout of ``k × batch_size`` completions feed ``k``
    optimizer steps (each ``num_iterations`` times), off-policy after the first, so the sampling
    policy's log-probs are kept as with ``num_iterations > 1``. Not with ``generation_batch_size``."""
    generation_batch_size: int = 0
    """GRPO (TRL's ``generation_batch_size``): completions sampled per generation, >= 0; 0: ``batch_size ×
    steps_per_generation / gradient_accumulation_steps``. A multiple of ``training.batch_size``."""
    rollout_slots: int = 0
    """GRPO: the sampler's cache rows, >= 0; 0 (the default): the whole generation as one static batch
    (every row decodes until the longest ends); fewer: refill, each slot taking the next queued prompt as
    soon as its row ends (continuous batching over the static cache: docs/generate.md), rounded up to a
    multiple of the decode layout's data shards. Greedy completions are the same either way; sampled ones
    are other draws of the same distribution."""
    rollout_layout: Literal["decode", "training"] = "decode"
    """GRPO: the params' layout for the rollout's sampler. ``decode`` (the default): once per rollout the
    policy's compute params (LoRA's adapters with them) are resharded from the training layout into a
    decode layout on the same devices, split over ``rollout_tp`` only and whole over the data axes, so
    the decode loop holds no parameter collective (verl's 3D-HybridEngine, NeMo-RL's refit);
    ``training``: decode on the params as training lays them out (ZeRO-3 gathers every layer at every
    token; no second copy of the weights)."""
    rollout_tp: int = 0
    """GRPO: the decode layout's tensor-parallel size, >= 0; 0 (the default): a host's devices, capped
    by the kv heads (the largest size that divides the devices, the heads, the kv heads and spares a
    data shard for every rollout row group). It must divide the number of devices and the heads."""
    center_rewards_coefficient: float = 0.0
    """Reward models (TRL's ``RewardConfig.center_rewards_coefficient``), >= 0: the weight of the
    auxiliary ``mean((r_chosen + r_rejected)^2)`` term that keeps the rewards centred on zero
    (Eisenstein et al., 2023, recommend 0.01); 0 (the default, TRL's None): off."""
    log_completions: bool = False
    """GRPO: at each logged step (``logging.log_every``), print the first completions of the newest
    rollout (4: the first group's) with their prompt, each reward function's value, the weighted reward
    and the advantage; with ``logging.wandb`` also a W&B table ``completions`` (TRL's ``log_completions``)."""


GRPO_ONLY_KEYS = ("num_generations", "max_completion_length", "temperature", "top_k", "top_p", "epsilon",
                  "epsilon_high", "num_iterations", "scale_rewards", "reward_funcs", "reward_weights",
                  "format_pattern", "mask_truncated_completions", "log_completions", "rollout_layout",
                  "rollout_tp", "steps_per_generation", "generation_batch_size", "rollout_slots",
                  "use_bias_correction_kl", "importance_sampling_level", "delta", "top_entropy_quantile",
                  "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                  "vespo_lambda_neg", "advantage", "normalize_advantages", "dynamic_sampling",
                  "max_sampling_rounds")
"""The ``posttrain`` keys only GRPO reads (their docs start with "GRPO"); set away from their defaults
in a DPO run they are refused."""
DPO_ONLY_KEYS = ("label_smoothing", "loss_weights", "discopop_tau", "precompute_ref_log_probs")
"""The ``posttrain`` keys only DPO reads (their docs start with "DPO:"); refused in a GRPO run when set."""
REWARD_ONLY_KEYS = ("center_rewards_coefficient",)
"""The ``posttrain`` keys only reward-model training reads; refused in a DPO or GRPO run when set."""


@dataclass
class CheckpointConfig:
    """Orbax checkpoints (:mod:`jaxcolossal.checkpoint`): the whole train state and the run's config,
    written asynchronously, one folder per saved step."""

    dir: str = ""
    """The checkpoint folder; ``""`` (the default): no checkpoints. ``training.resume`` ``true`` and
    ``auto`` need it; a fresh run into a folder that already holds checkpoints is refused unless
    ``overwrite``. ``~`` and ``$VAR`` are expanded."""
    save_every: int = 0
    """Also save every this many steps, >= 0; 0: no periodic saves. Whatever its value, with ``dir`` set
    the loop saves at each evaluation (every ``training.eval_every`` steps, a candidate for the best
    checkpoint) and at the end (after the final evaluation); a run stopped by SIGTERM or Ctrl-C saves
    its current step (during start-up, before the first step: nothing), one stopped on a non-finite
    loss its last finite step."""
    max_to_keep: int = 3
    """The most recent saved steps kept, >= 1; the step with the lowest finite validation loss is kept
    besides."""
    overwrite: bool = False
    """``true``: a fresh run (``training.resume=false``) into a ``dir`` that already holds checkpoints
    deletes them first; without it such a run is refused before anything compiles."""
    local_every: int = 0
    """Emergency (local) checkpoints every this many steps, >= 0; 0 (the default): none. Each process
    writes the shards it holds of the whole train state to ``local_dir`` in a background thread,
    plus a replica of them into the next process's folder, keeping the newest 2
    (:mod:`jaxcolossal.train.emergency`, docs/fault_tolerance.md). ``training.resume`` restores the
    newest step every process has when it is newer than the newest persistent checkpoint and the
    layout (process count, mesh) is the same. Needs ``dir``."""
    local_dir: str = ""
    """The emergency checkpoints' folder (a fast local disk); ``""`` (the default):
    ``<tmp>/jaxcolossal-local/<name of dir>-<hash of dir's absolute path>`` (``<tmp>``: ``$TMPDIR`` or
    ``/tmp``). Process ``r`` writes ``rank<r>/`` and the replica ``rank<r+1 mod n>/replica_of_rank<r>/``,
    so on several nodes it must be a path every process can write. ``~`` and ``$VAR`` are expanded. A
    folder that cannot be created is refused before anything compiles; a write that fails during the
    run is logged and training goes on. Each copy's ``shards.bin`` carries a checksum, verified at
    restore: a damaged copy is passed over for the replica, then an older step, then the persistent
    checkpoint."""


@dataclass
class FaultToleranceConfig:
    """Hang detection, goodput and stragglers (docs/fault_tolerance.md); the emergency checkpoints
    are ``checkpoint.local_every``."""

    hang_timeout_s: float = 180.0
    """The hang watchdog (:mod:`jaxcolossal.runtime.watchdog`): a process where no training step
    finishes within ``max(hang_timeout_s, hang_factor × the median step time)`` seconds dumps every
    thread's stack to its log and exits with code 75; >= 0, 0: off. Armed after the first step (the
    start-up and the first compile are covered by ``$JAXCOLOSSAL_COLLECTIVE_TIMEOUT``, 300 s)."""
    hang_factor: float = 10.0
    """The hang limit's multiple of the median step time (of the latest 50 steps), > 0."""
    straggler_factor: float = 1.5
    """A rank whose step time (or data-loading time) per step is above this multiple of the other
    ranks' median, and above it by more than the floor (``straggler_min_share``, ``straggler_min_s``),
    at ``straggler_checks`` logged steps in a row, is named in a warning; >= 1. The times are gathered
    at each ``logging.log_every`` step."""
    straggler_min_share: float = 0.05
    """The straggler floor's share of the step time: a rank is a straggler only when it is above the
    others' median by more than ``max(straggler_min_share × the step time, straggler_min_s)``; in
    [0, 1]."""
    straggler_min_s: float = 0.01
    """The straggler floor in seconds (see ``straggler_min_share``), >= 0."""
    straggler_checks: int = 3
    """How many logged steps in a row a rank must be a straggler before it is named (once per such
    run of logged steps), >= 1."""
    goodput: bool = True
    """Record the run's time by category in ``<logging.run_dir>/goodput.jsonl`` (process 0; the
    attempts of a restarted job append to it) and report the goodput at the end of the run."""


class StepRange(str):
    """A range of training steps in the config: ``"3-5"`` (steps 3, 4 and 5), ``"4"`` or ``4`` (step
    4 alone), a YAML list of consecutive steps (``[3, 4, 5]``); ``""`` means "none".
    :func:`parse_step_range` reads it."""


def parse_step_range(value: Any, key: str = "value") -> tuple[int, int] | None:
    """``"3-5"`` -> (3, 5), ``4``/``"4"`` -> (4, 4), ``[3, 4, 5]`` -> (3, 5); ``""``/``None`` -> None.
    Steps count from 1, as the log numbers them (step N is the N-th optimizer step).

    Raises:
        ConfigError: not one step >= 1 or one range ``A-B`` with 1 <= A <= B (a list: not consecutive).
    """
    if value is None or value == "":
        return None
    example = f"e.g. {key}=3-5 (steps 3 to 5) or {key}=4"
    if isinstance(value, list):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
                and list(value) == list(range(value[0], value[0] + len(value))):
            first, last = value[0], value[-1]
        else:
            raise ConfigError(f"{key}={value!r}: a list must hold consecutive steps (one trace covers one range); "
                              f"{example}")
    elif isinstance(value, int) and not isinstance(value, bool):
        first = last = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(value))
        if not m:
            raise ConfigError(f"{key}={value!r}: expected a step or a range of steps, {example}")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    if first < 1 or last < first:
        raise ConfigError(f"{key}={value!r}: steps count from 1 and a range A-B needs A <= B; {example}")
    return first, last


@dataclass
class LoggingConfig:
    """Where the run's metrics, log and profiles go, and how often (process 0 writes them)."""

    run_dir: str = "runs/default"
    """The run's output folder. It gets ``metrics.jsonl`` (one strict-JSON object per logged step and
    per evaluation; runs that share the folder append to it, each after a ``run_start`` record with
    its run id), ``train.log`` (each run after a line naming its id) and, with ``tensorboard``,
    ``tensorboard/<run id>/``; with ``wandb``, ``wandb/``; with ``profile_steps``, ``profile/<run id>/``.
    ``~`` and ``$VAR`` are expanded."""
    log_every: int = 10
    """The steps between logged metrics (``metrics.jsonl``, the log, TensorBoard, W&B), >= 1; the last
    step is always logged."""
    progress_bar: bool = True
    """Show a progress bar (tqdm) with the loss, tokens/s, the model FLOP/s per device (three
    significant digits, in GFLOPS below 1 TFLOPS) and, on GPUs whose peak is known, the MFU, when
    stderr is a terminal. When it is not (a file, a pipe: SLURM, nohup, ``> log``) or with ``false``,
    the log gets one plain line per ``log_every`` steps instead (step, loss, lr, grad norm, tokens/s,
    FLOP/s, MFU); ``train.log`` gets those lines in every case."""
    tensorboard: bool = False
    """``true``: also write every logged scalar as TensorBoard events to ``<run_dir>/tensorboard/<run id>``,
    one TensorBoard run per run (:class:`jaxcolossal.metrics.MetricsWriter`; needs the ``tensorboardX``
    package)."""
    wandb: bool = False
    """``true``: also log every logged scalar to Weights & Biases, with the same names and steps as
    TensorBoard (``train/loss``, ``eval/val_loss``, ...) and the run's config, from process 0 only.
    Needs the ``wandb`` package (``pip install wandb``; a run without it is refused before it
    compiles). W&B keeps its files in ``<run_dir>/wandb/``; the W&B run id is the run's id."""
    wandb_project: str = ""
    """The W&B project; ``""`` (the default): ``$WANDB_PROJECT`` when set, else ``jaxcolossal``. The
    entity (user or team) is W&B's default, or ``$WANDB_ENTITY``."""
    wandb_run_name: str = ""
    """The W&B run's display name; ``""`` (the default): the run id (``metrics.jsonl``'s ``run``, the
    TensorBoard folder's name)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """``auto`` (the default): W&B's own choice, ``$WANDB_MODE`` or ``wandb offline``'s setting, else
    ``online``, as a script calling ``wandb.init()`` gets. ``online``: streamed to the W&B server
    (needs ``wandb login`` or ``$WANDB_API_KEY``; a run that cannot log in is refused before it
    compiles). ``offline``: written to ``<run_dir>/wandb/offline-run-*`` only, for machines with no
    network; upload later with ``wandb sync <that folder>``. ``disabled``: nothing is logged."""
    profile_steps: StepRange = ""
    """A ``jax.profiler`` trace of these training steps: ``"3-5"`` (steps 3 to 5), ``4``, or ``""``
    (the default: none). Written by process 0 to ``<run_dir>/profile/<run id>/plugins/profile/<timestamp>/``
    (``*.xplane.pb`` for TensorBoard's profile plugin and xprof, ``*.trace.json.gz`` for Perfetto); the
    device work of the steps before is waited for first, and the last step's before the trace stops.
    The range must end by ``training.max_steps``; a resumed run traces the part it runs. The traced
    steps run slower, and their throughput in the log with them."""


class AutoFloat(str):
    """A number in the config, or ``auto`` (kept as the string ``"auto"``; a number is kept as a
    float): the objective's own default, resolved by a function of the config in
    :mod:`jaxcolossal.config.derived` (e.g. ``posttrain_beta``)."""


class Bytes(str):
    """A byte count in the config: an integer, or a string with a unit (``"80GB"``, ``"1.5GiB"``,
    ``"512MB"``); ``""`` means "not given". :func:`parse_bytes` reads it."""


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: Any, key: str = "value") -> int:
    """``"80GB"`` -> 80·10⁹, ``"1GiB"`` -> 2³⁰, ``4096`` -> 4096; ``""``/``None`` -> 0 (not given).

    Raises:
        ConfigError: not a non-negative number with one of the units B, KB, MB, GB, TB, KiB, MiB,
            GiB, TiB.
    """
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected a byte count such as 80GB or 85899345920")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(f"{key}={value!r}: expected a byte count such as 80GB, 80GiB or 85899345920 "
                              f"(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not math.isfinite(n) or n < 0:
        raise ConfigError(f"{key}={value!r}: must be a finite, non-negative byte count")
    return int(n)


@dataclass
class OffloadConfig:
    """Heterogeneous memory: which part of the train state lives in host memory or on NVMe
    (Colossal-AI's Gemini placement and ``cpu_offload``, ZeRO-Infinity's NVMe tier;
    :mod:`jaxcolossal.memory.placement`, docs/offload.md), and the memory a run may plan for."""

    placement_policy: Literal["static", "auto"] = "static"
    """How the offloaded fractions are chosen: ``static`` or ``auto``. ``static``:
    ``offload_optim_frac`` and ``offload_param_frac`` as given. ``auto``: the fractions that fit
    ``device_memory_limit`` with the least host↔device traffic (Gemini's
    ``ChunkManager.optimize_chunk_config``); leave both fractions at 0."""
    offload_optim_frac: float = 0.0
    """The fraction, by bytes, in [0, 1], of the optimizer state (Adam m, v and the fp32 master copy)
    that lives in pinned host memory (on NVMe with ``nvme_path``)."""
    offload_param_frac: float = 0.0
    """The fraction, in [0, 1], of the compute parameters kept in host memory between steps; needs
    ``parallel.zero_stage=3`` and no pipeline parallelism."""
    optimizer_device: Literal["device", "host"] = "device"
    """Where the offloaded optimizer state is updated: ``device`` (moved in, updated, moved out) or
    ``host`` (on the CPU with ``compute_on``, as Colossal-AI's CPU Adam). ``nvme_path`` needs
    ``device``."""
    activations: Literal["none", "host"] = "none"
    """Where the layer projections saved for the backward live: ``none`` (device memory) or ``host``
    (pinned host memory). ``host`` sets ``model.remat=offload`` and is refused with a ``model.remat``
    other than ``none`` or ``offload``."""
    device_memory_limit: Bytes = ""
    """The device memory a run may plan for, per device: bytes, or a number with a unit (``"80GB"``,
    ``"1.5GiB"``); ``""``: the device's reported capacity × 0.9 (the CPU reports none: no check). A
    run whose plan needs more is refused before it compiles; ``placement_policy=auto`` fits it."""
    host_memory_limit: Bytes = ""
    """The pinned host memory one process (node) may use for the offloaded state: bytes, or a number
    with a unit (``"2TB"``); ``""``: unchecked."""
    devices_per_host: int = 8
    """The devices that share one host's memory (``host_memory_limit``) in ``--dry-run``, >= 1; a real
    run uses its local device count."""
    nvme_path: str = ""
    """ZeRO-Infinity's NVMe tier: a folder (a fast local disk) for the offloaded optimizer state;
    ``""``: none. The state that ``offload_optim_frac`` (or ``placement_policy=auto``) offloads lives
    there instead of host memory, read and written leaf by leaf inside each step
    (:mod:`jaxcolossal.train.nvme`); needs ``optimizer_device=device``. ``~`` and ``$VAR`` are
    expanded."""


@dataclass
class Config:
    """The whole run: one object, validated before anything is compiled."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model: its family, shape, kernels, LoRA and mixture of experts."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The optimisation: batch, sequence length, AdamW and its schedule, evaluation, resuming."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The device mesh, ZeRO, the pipeline, sequence and expert parallelism, and communication."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision (bf16, fp16 with loss scaling, FP8) and the non-finite step limit."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training text: files, format, tokenizer, held-out split and cache."""
    posttrain: PosttrainConfig = field(default_factory=PosttrainConfig)
    """Preference optimisation (``training.objective=dpo``): β, the loss variant and the reference model."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Orbax checkpoints: where, how often, how many."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Hang detection, goodput and stragglers."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics, the log file, the progress bar and TensorBoard."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Host-memory and NVMe offload of the train state, and the memory budgets."""
    source: ClassVar[str | None] = None
    """Not a key: the YAML file :func:`jaxcolossal.config.load_config` read, as an absolute path (None:
    the defaults or a dict), named in the run's ``run_start`` record."""

    def to_dict(self) -> dict:
        """The config as nested plain dicts (YAML-serialisable)."""
        return dataclasses.asdict(self)


def yaml_list(values) -> str:
    """``[False, True, 'auto']`` as a user writes it: ``[false, true, auto]``."""
    return "[" + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values) + "]"


def gib(x: float) -> str:
    """Bytes in the unit that shows them: ``141.00 GiB``, ``27.41 MiB``, ``1.00 KiB``, ``12 B``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"
