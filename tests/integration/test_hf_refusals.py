"""A ``config.json`` key that an architecture uses and this project does not implement is refused in one
line naming it, before any weight is read; never silently dropped (issue 50's refusals).

Each case is a real architecture's config with one such key set as the real model (or a variant of it)
sets it; one of them goes through ``scripts/convert_hf.py --to-jax`` to show the command line's exit 2.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from jaxcolossal.config import ConfigError, LoraConfig
from jaxcolossal.models.hf_io import config_from_hf
from jaxcolossal.models.peft import load_adapters, save_adapters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100,
         "max_position_embeddings": 64}

REFUSED = {  # case -> (config.json, the key the one-line refusal must name)
    # Gemma 4-style proportional RoPE: a type of transformers' ROPE_INIT_FUNCTIONS not implemented here
    "rope-proportional": ({**LLAMA, "rope_scaling": {"rope_type": "proportional", "factor": 1.0}},
                          "rope_scaling.rope_type='proportional'"),
    "llama-gelu": ({**LLAMA, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    "llama-attention-dropout": ({**LLAMA, "attention_dropout": 0.1}, "attention_dropout=0.1"),
    "phi3-resid-dropout": ({**LLAMA, "model_type": "phi3", "resid_pdrop": 0.1}, "resid_pdrop=0.1"),
    "qwen2-mlp-bias": ({**LLAMA, "model_type": "qwen2", "mlp_bias": True}, "mlp_bias=True"),
    "mixtral-router-jitter": ({**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
                               "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    "qwen3-moe-dense-layers": ({**LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "mlp_only_layers": [0]}, "mlp_only_layers"),
    # the published gpt-oss-20b/120b checkpoints: MXFP4 experts (a bf16 copy reads)
    "gpt-oss-mxfp4": ({**LLAMA, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_local_experts": 4,
                       "num_experts_per_tok": 2, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
                       ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}},
                      "quantization_config={'quant_method': 'mxfp4'}"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unimplemented_key_is_refused_in_one_line_naming_it(case):
    hf, key = REFUSED[case]
    with pytest.raises(ConfigError) as e:
        config_from_hf(hf)
    message = str(e.value)
    assert key in message and "\n" not in message, message


def test_the_command_line_refuses_with_exit_2_before_reading_weights(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(REFUSED["rope-proportional"][0]))
    out = subprocess.run([sys.executable, f"{ROOT}/scripts/convert_hf.py", "--to-jax", str(tmp_path / "hf"),
                          str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "rope_scaling.rope_type='proportional'" in lines[0], out.stderr
    assert not (tmp_path / "out").exists()


def test_peft_adapters_of_phi3s_fused_projections_are_refused_with_the_merged_export_named(tmp_path):
    """Phi-3's qkv_proj / gate_up_proj hold one PEFT adapter each; the separate q, k, v adapters trained here
    cannot be written as one, so the adapter export and ``model.lora.init_from`` are refused in one line."""
    cfg = dataclasses.replace(config_from_hf({**LLAMA, "model_type": "phi3"}), lora=LoraConfig(rank=4))
    for call in (lambda: save_adapters(tmp_path / "a", cfg, {"layers": {}}), lambda: load_adapters(tmp_path, cfg)):
        with pytest.raises(ConfigError, match="fused qkv_proj and gate_up_proj .* --merge-lora") as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "a").exists()
