"""LoRA on DeepSeek's multi-head latent attention (``model.lora`` with ``model.type=deepseek``), checked against
Hugging Face PEFT on the zoo's tiny models saved by transformers (tests/integration/hf_zoo.py), fp32:

* our adapters, random and non-zero on every MLA target (``q_a, q_b, kv_a, kv_b, o``; ``q`` without a q
  latent) of the dense first layer and the MoE layers, written in PEFT's format: ``peft.PeftModel.
  from_pretrained`` on the transformers model gives our logits within 1e-5 of the largest; they read back
  bit-exact; the merged model (``convert_hf.py --to-hf --merge-lora``) loads in transformers with no
  missing key and the same logits; the KV-cached prefill (``kv_b_proj`` absorbed) gives them too;
* adapters that PEFT itself creates and saves (``get_peft_model``) load into ours with equal logits;
* batched greedy generation with the adapters (the cached decode path, merged per layer) is token-equal
  to the PEFT model's ``generate`` and to our merged model's;
* a LoRA run's checkpoint exports (``convert_hf.py --to-hf``) the adapters PEFT loads and, merged, a
  transformers model with the PEFT model's logits;
* a LoRA training step on tp 2 x fsdp 4 (ZeRO-3) equals one device's, on a mixture of experts with a
  dense first layer;
* LoRA's dropout reaches both stacks in training;
* targets the family does not have are refused in one line.
"""
import dataclasses
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_zoo import VOCAB, build, logits  # noqa: E402
from safetensors import numpy as safetensors_numpy  # noqa: E402
from test_hf_architectures import REL, rel_err, tokens  # noqa: E402
from tiny import assert_params_match, run_steps  # noqa: E402

from jaxcolossal.config import ConfigError, LoraConfig, config_from_dict, load_config  # noqa: E402
from jaxcolossal.generate import generate  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf, save_hf  # noqa: E402
from jaxcolossal.models.layers.lora import adapter_shapes_and_axes, merge, merged_weights  # noqa: E402
from jaxcolossal.models.peft import load_adapters, read_adapter_config, save_adapters  # noqa: E402
from jaxcolossal.train.loop import train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LORA = LoraConfig(rank=4, alpha=8.0, targets="all")


def _random_adapters(cfg, seed=1):
    """Adapters of ``cfg.lora`` on every stacked-layer group, A and B drawn from 0.1·N(0, 1) (numpy fp32)."""
    table = adapter_shapes_and_axes(cfg.lora, get_family(cfg).param_shapes_and_axes(cfg, cfg.vocab_size),
                                    cfg.lora_targets)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return {g: {n: 0.1 * np.asarray(jax.random.normal(next(keys), sa[0])) for n, sa in t.items()}
            for g, t in table.items()}


def _ours(cfg, params, adapters, x):
    p = merge(jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, adapters))
    return np.asarray(get_family(cfg).forward(p, jnp.asarray(x), cfg))[..., :VOCAB]


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_our_adapters_give_peft_logits(name, tmp_path):
    model = build(name)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf")
    cfg = dataclasses.replace(cfg, lora=LORA)
    assert cfg.lora_targets == (("o", "q_a", "q_b", "kv_a", "kv_b") if cfg.q_lora_rank else ("q", "o", "kv_a", "kv_b"))
    adapters = _random_adapters(cfg)
    assert sorted(adapters) == ["dense_layers", "layers"]
    assert {"wkv_a_lora_a", "wkv_a_lora_b", "wk_rope_lora_b", "wk_b_lora_a", "wk_b_lora_b", "wv_b_lora_b"} <= set(
        adapters["layers"]) and "wk_rope_lora_a" not in adapters["layers"]  # one A per fused module
    save_adapters(tmp_path / "adapter", cfg, adapters)
    back = load_adapters(tmp_path / "adapter", dataclasses.replace(cfg, lora=read_adapter_config(tmp_path / "adapter")))
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(lambda a: a.astype(np.float32), adapters))

    x = tokens()
    ours = _ours(cfg, params, adapters, x)
    theirs = logits(peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval(), x)
    err = rel_err(ours, theirs)
    print(f"{name} LoRA on {', '.join(cfg.lora_targets)}: ours vs PEFT {err:.2e}")
    assert err < REL
    assert rel_err(_ours(cfg, params, {}, x), theirs) > 0.1  # the adapters move the logits

    family = get_family(cfg)
    p = merge(jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, adapters))
    cache = family.init_cache(cfg, 2, 16)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    cached, _ = family.forward_cached(p, jnp.asarray(x), cache, jnp.int32(0), positions, jnp.ones((2, 16), bool), cfg)
    assert rel_err(np.asarray(cached), theirs) < REL

    save_hf(tmp_path / "merged", cfg, jax.device_get(merged_weights(p, cfg.lora)))
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert rel_err(logits(merged.eval(), x), theirs) < REL


PEFT_MODULES = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def test_adapters_saved_by_peft_load_with_equal_logits(tmp_path):
    """``get_peft_model`` with PEFT's own initialisation, B made non-zero, ``save_pretrained``: our reading of
    the folder gives the PEFT model's logits."""
    build("deepseek-v3").save_pretrained(tmp_path / "hf")
    model = peft.get_peft_model(build("deepseek-v3"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_MODULES))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(tmp_path / "adapter"))
    x = tokens()
    theirs = logits(model.eval(), x)

    cfg, params = load_hf(tmp_path / "hf")
    cfg = dataclasses.replace(cfg, lora=read_adapter_config(tmp_path / "adapter"))
    assert cfg.lora_targets == ("o", "q_a", "q_b", "kv_a", "kv_b") and cfg.lora.scale == 2.0
    err = rel_err(_ours(cfg, params, load_adapters(tmp_path / "adapter", cfg), x), theirs)
    print(f"PEFT-saved adapters on {PEFT_MODULES}: ours vs PEFT {err:.2e}")
    assert err < REL
    with pytest.raises(ConfigError, match=r"target module\(s\) \['k_proj'\] are not in model.type=deepseek") as e:
        load_adapters(tmp_path / "adapter", dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets="k,o")))
    assert "\n" not in str(e.value)


def test_greedy_generation_with_adapters_equals_peft_and_the_merged_model(tmp_path):
    """Left-padded prompts of 3, 7 and 12 tokens, 10 new tokens: the cached decode path (``kv_b_proj`` absorbed
    into the queries and the output, the adapters merged per layer) with the adapters, our merged model and
    the PEFT model's ``generate`` agree token for token."""
    model = build("deepseek-v3")
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf")
    cfg = dataclasses.replace(cfg, lora=LORA)
    adapters = _random_adapters(cfg)
    save_adapters(tmp_path / "adapter", cfg, adapters)
    family, p = get_family(cfg), merge(params, adapters)
    prompts = [list(tokens(1, n, seed=n)[0]) for n in (3, 7, 12)]
    ours = generate(family, cfg, p, prompts, 10).tokens
    merged = generate(family, dataclasses.replace(cfg, lora=LoraConfig()), jax.device_get(merged_weights(p, cfg.lora)),
                      prompts, 10).tokens
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(q)) + q for q in prompts])
    mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    tuned = peft.PeftModel.from_pretrained(reference, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        out = tuned.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                             min_new_tokens=10, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(ours, out[:, width:].numpy())
    np.testing.assert_array_equal(merged, ours)


MOE_MODEL = dict(type="deepseek", num_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=128, max_position_embeddings=64, q_lora_rank=16, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, num_shared_experts=1, n_group=2, topk_group=1, first_k_dense=1,
                 router_scoring="sigmoid", router_score_correction=True, routed_scaling_factor=2.5,
                 router_aux_loss_coef=0.0, lora={"rank": 4, "targets": "all"})
TRAINING = dict(batch_size=16, seq_len=32, learning_rate=1e-3, warmup_steps=1, max_steps=10)


def test_lora_tp2_fsdp4_zero3_equals_one_device():
    """3 fp32 steps of LoRA on every MLA target of a mixture of experts with a dense first layer: loss and
    gradient norm to rtol 1e-5, the adapters of both stacks as :func:`tiny.assert_params_match`."""
    def cfg(parallel):
        return config_from_dict({"model": MOE_MODEL, "training": TRAINING, "parallel": parallel})
    s1, m1, _ = run_steps(cfg({"data_parallel_size": 1}), jax.devices()[:1], steps=3)
    s8, m8, plan = run_steps(cfg({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 3}), steps=3)
    assert plan.mesh_shape["tp"] == 2 and plan.data_size == 4 and sorted(s8.params) == ["dense_layers", "layers"]
    np.testing.assert_allclose([m["loss"] for m in m8], [m["loss"] for m in m1], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in m8], [m["grad_norm"] for m in m1], rtol=1e-5)
    assert_params_match(jax.device_get(s8.params), jax.device_get(s1.params))
    assert "tp" in str(s8.params["layers"]["wk_b_lora_b"].sharding.spec)  # B of kv_b_proj: its heads on tp
    assert "fsdp" in str(s8.frozen["dense_layers"]["wkv_a"].sharding.spec)  # ZeRO-3 shards the frozen base


def test_a_lora_run_exports_peft_adapters_and_the_merged_model(tmp_path):
    """``model.init_from`` of the zoo's DeepSeek-V3 with ``model.lora.targets=all``, 2 steps with a checkpoint:
    ``convert_hf.py --to-hf`` writes the trained adapters (both stacks, from the checkpoint) as PEFT files that
    ``peft`` loads, equal to those the run wrote itself, and ``--merge-lora`` a full model with the PEFT
    model's logits."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import convert_hf  # heavy: from scripts/, put on sys.path by this test only

    hf = tmp_path / "hf"
    build("deepseek-v3", vocab_size=256).save_pretrained(hf)
    assert convert_hf.main(["--to-jax", str(hf), str(tmp_path / "out")]) == 0
    train(load_config(str(tmp_path / "out" / "model.yaml"), [
        f"model.init_from={hf}", "model.lora.rank=4", "model.lora.targets=all", "data.corpus=stdlib",
        "data.tokenizer=byte", "data.max_corpus_bytes=100000", f"data.cache_dir={tmp_path}/cache",
        "training.seq_len=16", "training.batch_size=8", "training.max_steps=2", "training.learning_rate=1e-2",
        "training.warmup_steps=1", "training.eval_every=0", "training.sample_tokens=0", "logging.progress_bar=false",
        f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt"]))
    assert convert_hf.main(["--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "peft")]) == 0
    assert convert_hf.main(["--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merge-lora"]) == 0
    ours, run = (safetensors_numpy.load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("peft", "run/adapter"))
    assert sorted(ours) == sorted(run) and len(ours) == 3 * 5 * 2  # 3 layers (1 dense), 5 modules, A and B
    jax.tree.map(np.testing.assert_array_equal, ours, run)

    x = tokens()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf), attn_implementation="eager")
    tuned = logits(peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval(), x)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="eager")
    scale = np.abs(tuned).max()
    assert np.abs(logits(merged.eval(), x) - tuned).max() < REL * scale
    assert np.abs(logits(build("deepseek-v3", vocab_size=256), x) - tuned).max() > 1e-4 * scale  # trained adapters


def test_dropout_drops_the_adapters_input_in_both_stacks():
    """``model.lora.dropout``: a training forward (a dropout key) differs from the evaluation forward once B is
    non-zero, draws one key per layer of each stack, and dropping nothing (dropout 0) changes nothing."""
    cfg = config_from_dict({"model": {**MOE_MODEL, "lora": {"rank": 4, "targets": "all", "dropout": 0.3}},
                            "training": TRAINING}).model
    family, adapters = get_family(cfg), jax.tree.map(jnp.asarray, _random_adapters(cfg))
    base, x, key = family.init_params(cfg, jax.random.key(0)), jnp.asarray(tokens(b=2, t=8)), jax.random.key(3)
    for group in ("dense_layers", "layers"):  # the adapters of one stack only: its dropout shows
        p = merge(base, {group: adapters[group]})
        plain = family.hidden_states(p, x, cfg)
        dropped = family.hidden_states(p, x, cfg, dropout_key=key)
        assert float(jnp.abs(dropped - plain).max()) > 1e-3 * float(jnp.abs(plain).max()), group
    no_drop = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, dropout=0.0))
    np.testing.assert_array_equal(family.hidden_states(p, x, no_drop, dropout_key=key), plain)


@pytest.mark.parametrize("overrides,match", [
    (["model.lora.targets=q,k,o"], r"model.lora.targets='q,k,o': q, k are not projections of model.type=deepseek "
                                   r"\(multi-head latent attention with a q latent\): allowed: comma-separated o, q_a, "
                                   r"q_b, kv_a, kv_b, or all$"),
    ([], r"q, v are not projections .* \(the default q,v is LLaMA's\)$"),
    (["model.lora.targets=q_a", "model.q_lora_rank=0"], r"q_a is not a projection .* without a q latent.*q, o, kv_a"),
])
def test_targets_the_family_lacks_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(os.path.join(ROOT, "configs/deepseek_tiny.yaml"), ["model.lora.rank=4", *overrides])
    assert "\n" not in str(e.value)
