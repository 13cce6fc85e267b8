"""Gemma beyond the zoo's transformers-made models (tests/integration/test_hf_architectures.py):

* Gemma 3 4B/12B/27B ship as the multimodal ``Gemma3ForConditionalGeneration``: its language model is
  read from the ``text_config`` and the ``language_model`` weights (the vision tower left unused), its
  logits on text equal transformers' (within 1e-5 of max |logit|, fp32, on one device and on tp 2 ×
  fsdp 4 ZeRO-3), and it exports as a text-only ``Gemma3ForCausalLM`` that loads clean with equal
  logits. The tiny model has the 4B's text keys (the zoo's ``gemma3`` entry: 5 local layers to 1
  global, linear RoPE factor 8 on the global ones, q/k norms) and a one-layer SigLIP tower.
* A model trained here from scratch (``configs/gemma_tiny.yaml``'s Gemma 3 style; a Gemma 2 style with
  both soft-caps) exports as the architecture its keys name, which transformers loads clean with
  logits equal to ours on 40 tokens (past the windows).
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_zoo import BASE, VOCAB, ZOO, logits  # noqa: E402
from test_hf_architectures import rel_err, sharded_logits, tokens  # noqa: E402

from jaxcolossal.config import config_from_dict, load_config  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf, save_hf  # noqa: E402

REL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    text = {**{k: v for k, v in BASE.items() if k != "attn_implementation"}, **ZOO["gemma3"][1]}
    cfg = transformers.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4,
                                    image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as hf_zoo.build: the (1 + w) norm scales away from zero
        for name, p in model.named_parameters():
            if "language_model" in name and (p.ndim == 1 or "norm" in name):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    path = tmp_path_factory.mktemp("gemma3_multimodal")
    model.save_pretrained(path)
    return model.eval(), path


def test_text_logits_equal_transformers(saved):
    model, path = saved
    cfg, params = load_hf(path)
    assert (cfg.type, cfg.hf_model_type, cfg.rope.type, cfg.rope_local_theta) == ("gemma", "gemma3", "linear", 1e4)
    x = tokens(b=4)
    want = logits(model, x)
    one = rel_err(np.asarray(get_family(cfg).forward(params, jnp.asarray(x), cfg)), want)
    cfg2, params2 = load_hf(path, tp=2)
    sharded = rel_err(sharded_logits(cfg2, params2, x, {"data_parallel_size": 4, "tensor_parallel_size": 2,
                                                        "zero_stage": 3}), want)
    print(f"gemma3 multimodal's text: 1 device {one:.2e}, tp2 x fsdp4 ZeRO-3 {sharded:.2e}")
    assert one < REL and sharded < REL


def test_exports_the_text_model(saved, tmp_path):
    model, path = saved
    cfg, params = load_hf(path)
    save_hf(tmp_path / "out", cfg, params)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True, attn_implementation="eager")
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])
    assert type(back).__name__ == "Gemma3ForCausalLM"
    x = tokens()
    assert rel_err(logits(back.eval(), x), logits(model, x)) < REL


GEMMA2_STYLE = dict(type="gemma", num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=12,
                    layer_types="sliding_attention,full_attention,sliding_attention,full_attention",
                    attn_logit_softcapping=50.0, final_logit_softcapping=3.0, initializer_range=0.15)


@pytest.mark.parametrize("style", ["gemma_tiny.yaml", "gemma2"])
def test_a_fresh_model_exports_with_equal_logits(style, tmp_path):
    cfg = (load_config(f"{ROOT}/configs/gemma_tiny.yaml") if style != "gemma2" else
           config_from_dict({"model": GEMMA2_STYLE})).model
    family = get_family(cfg)
    params = family.init_params(cfg, jax.random.key(0))
    layers = {n: a + 0.1 * jax.random.normal(jax.random.key(i), a.shape) if n.endswith("norm") else a
              for i, (n, a) in enumerate(params["layers"].items())}  # (1 + w) away from 1
    params = {**params, "layers": layers}
    save_hf(tmp_path, cfg, params)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True,
                                                                   attn_implementation="eager")
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])
    assert type(back).__name__ == {"gemma2": "Gemma2ForCausalLM"}.get(style, "Gemma3ForCausalLM")
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    want = logits(back.eval(), x)
    err = float(np.max(np.abs(np.asarray(family.forward(params, jnp.asarray(x), cfg))[..., :cfg.vocab_size] - want))
                / np.max(np.abs(want)))
    print(f"{style}: exported {type(back).__name__}, {err:.2e}")
    assert err < REL
