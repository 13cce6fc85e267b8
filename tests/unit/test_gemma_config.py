"""The Gemma family's configs (jaxcolossal/models/gemma/hf.py, config/architecture.py): a Gemma 3
``config.json`` in transformers 4's form (``rope_scaling``, ``rope_local_base_freq``,
``sliding_window_pattern``) reads as its transformers 5 form does, and so does the ``text_config`` of the
multimodal ``Gemma3ForConditionalGeneration``; keys a config leaves out take
transformers' defaults; every key that changes the math and is not implemented is refused in one line
naming it; an export reads back as the model it came from; and the kernels and sequence-parallel
modes that would ignore Gemma's softmax scale or soft-caps are refused by name."""

import dataclasses

import pytest

from jaxcolossal.config import ConfigError, config_from_dict
from jaxcolossal.models.hf_io import config_from_hf, config_to_hf

SIZES = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=64)

GEMMA3_TF4 = dict(SIZES, model_type="gemma3_text", num_hidden_layers=6, rope_theta=1000000.0,
                  rope_local_base_freq=10000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=4, sliding_window_pattern=6,
                  query_pre_attn_scalar=12, final_logit_softcapping=None, attn_logit_softcapping=None)
"""Gemma-3-4B's text config as transformers 4 wrote it, shrunk."""

GEMMA3_TF5 = dict(SIZES, model_type="gemma3_text", num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=12,
                  layer_types=["sliding_attention"] * 5 + ["full_attention"],
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
"""The same model as transformers 5 writes it."""

GEMMA2 = dict(SIZES, model_type="gemma2", num_hidden_layers=4, query_pre_attn_scalar=12, sliding_window=4)


def test_gemma3_transformers4_config_reads_as_transformers5():
    old, new = config_from_hf(GEMMA3_TF4), config_from_hf(GEMMA3_TF5)
    assert old == new
    assert (new.type, new.qk_norm, new.rope.type, new.rope.factor, new.rope_theta, new.rope_local_theta) == (
        "gemma", True, "linear", 8.0, 1e6, 1e4)
    assert new.layer_windows == (4, 4, 4, 4, 4, 0) and new.attention_scale == 12 ** -0.5
    assert (new.attn_logit_softcapping, new.final_logit_softcapping) == (0.0, 0.0)


def test_multimodal_gemma3_reads_its_text_config_and_exports_the_text_model():
    """Gemma-3-4B's ``Gemma3ForConditionalGeneration`` config (transformers 4: the text_config holds only
    what differs from Gemma3TextConfig's defaults) reads as the text model; an export is ``gemma3_text``."""
    text = {k: v for k, v in GEMMA3_TF4.items() if k not in ("model_type", "rope_theta", "rope_local_base_freq",
                                                              "sliding_window_pattern")}
    cfg = config_from_hf({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                          "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
                          "mm_tokens_per_image": 256})
    assert dataclasses.replace(cfg, hf_model_type="gemma3_text") == config_from_hf(GEMMA3_TF4)
    out = config_to_hf(cfg)
    assert (out["model_type"], out["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert config_from_hf(out) == dataclasses.replace(cfg, hf_model_type="gemma3_text")


def test_missing_keys_take_transformers_defaults():
    """Gemma2Config's soft-caps 50 and 30 when the keys are absent, none when null; head_dim and
    query_pre_attn_scalar 256; layers alternating sliding and global; Gemma 3's default bases."""
    cfg = config_from_hf(GEMMA2)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.layer_windows == (4, 0, 4, 0) and cfg.rope_local_theta == 0.0
    off = config_from_hf({**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (off.attn_logit_softcapping, off.final_logit_softcapping) == (0.0, 0.0)
    bare = {k: v for k, v in GEMMA2.items() if k not in ("head_dim", "query_pre_attn_scalar")}
    assert (config_from_hf(bare).head_dim, config_from_hf(bare).query_pre_attn_scalar) == (256, 256.0)
    g3 = config_from_hf({k: v for k, v in GEMMA3_TF4.items() if k not in ("rope_theta", "rope_local_base_freq")})
    assert (g3.rope_theta, g3.rope_local_theta) == (1e6, 1e4)


@pytest.mark.parametrize("keys, match", [
    ({"model_type": "gemma3", "text_config": {}}, "text_config=None: expected Gemma 3's text model"),
    ({"model_type": "gemma3", "text_config": {"model_type": "llama"}}, "text_config='llama': expected Gemma 3's"),
    ({"attention_bias": True}, "attention_bias=True: Gemma's projections have no bias"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True: bidirectional attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu': only 'gelu_pytorch_tanh'"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1: dropout is not implemented"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5: Gemma rotates whole heads"),
    ({"sliding_window": None}, "sliding_window=None: the layers marked sliding_attention need a window"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: transformers' "
                                                                    "Gemma 3 attention does not apply it"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
])
def test_unimplemented_keys_are_refused_by_name(keys, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf({**GEMMA2, **keys})


@pytest.mark.parametrize("hf", [GEMMA2, GEMMA3_TF5, {**GEMMA3_TF5, "rope_parameters": {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4},
    "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}}}], ids=["gemma2", "gemma3",
                                                                                           "gemma3-one-rope"])
def test_export_reads_back_as_the_model(hf):
    cfg = config_from_hf(hf)
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_an_export_its_architecture_cannot_carry_is_refused():
    cfg = dataclasses.replace(config_from_hf(GEMMA2), rope_local_theta=5000.0)  # Gemma 2 has one RoPE
    with pytest.raises(ConfigError, match="model.rope_local_theta=5000.0: the Hugging Face Gemma2ForCausalLM config"):
        config_to_hf(cfg)


def _run(model: dict, parallel: dict):
    base = {"type": "gemma", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "tie_word_embeddings": True}
    return config_from_dict({"model": {**base, **model}, "parallel": parallel,
                             "training": {"batch_size": 8, "seq_len": 32}})


@pytest.mark.parametrize("model, parallel, match", [
    ({"attn_logit_softcapping": 50.0}, {"data_parallel_size": 4, "sequence_parallel_size": 2,
                                        "sequence_parallelism_mode": "ring_attn"},
     "attn_logit_softcapping=50: ring attention's online softmax has no softmax scale or soft-cap"),
    ({"query_pre_attn_scalar": 256.0}, {"data_parallel_size": 8}, None),
    ({"query_pre_attn_scalar": 256.0, "attention_impl": "cudnn"}, {"data_parallel_size": 8},
     "query_pre_attn_scalar=256: the cudnn kernel has no softmax scale here"),
    ({"query_pre_attn_scalar": 256.0, "sliding_window": 4, "attention_impl": "flash"}, {"data_parallel_size": 8}, None),
    ({"attn_logit_softcapping": 50.0, "attention_impl": "flash"}, {"data_parallel_size": 8},
     "attn_logit_softcapping=50: the flash kernel has no soft-cap here"),
    ({"sliding_window": 4, "layer_types": "sliding_attention,full_attention,sliding_attention,full_attention"},
     {"data_parallel_size": 4, "pipeline_parallel_size": 2}, "mixes sliding and full layers"),
    ({"query_pre_attn_scalar": 256.0, "attn_logit_softcapping": 50.0, "sliding_window": 4},
     {"data_parallel_size": 4, "sequence_parallel_size": 2, "sequence_parallelism_mode": "all_to_all"}, None),
    ({"lora": {"rank": 4, "targets": "q,v,gate"}}, {"data_parallel_size": 8}, None),
])
def test_what_runs_with_gemma(model, parallel, match):
    """Ring attention and cuDNN would drop the scale and caps, flash the soft-cap: refused by name; flash with
    the scale and a window, Ulysses, LoRA run; mixed local and global layers are refused in a pipeline."""
    if match is None:
        _run(model, parallel)
        return
    with pytest.raises(ConfigError, match=match):
        _run(model, parallel)
