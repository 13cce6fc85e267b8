"""The DeepSeek family beyond the zoo's shared tests (test_hf_architectures.py, test_hf_training_parity.py):

* every ``config.json`` key it does not implement, and every YAML setting MLA does not run with, is
  refused in one line naming it;
* the multi-token-prediction weights a DeepSeek-V3 checkpoint carries after its last layer are skipped,
  as transformers skips them;
* the KV cache holds the latent and the rotary key, not per-head keys and values, and a prefill through
  it gives the forward's logits;
* the config survives an export (``config_from_hf(config_to_hf(cfg))``), the YAML's and the zoo's;
* the real DeepSeek-V3 shape (configs/bench/deepseek_v3.yaml) counts 671 B parameters, 37.5 B active;
* sequence parallelism over MLA's heads (Ulysses, Megatron-SP) gives transformers' logits (a dense
  DeepSeek: a mixture of experts refuses sequence parallelism for now);
* in a pipeline (2 stages, the experts over ep 2; and dense) training equals the single device's.
"""
import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_zoo import build, logits  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_hf_architectures import REL, rel_err, sharded_logits, tokens  # noqa: E402
from tiny import assert_params_match  # noqa: E402

from jaxcolossal.config import ConfigError, config_from_dict, load_config  # noqa: E402
from jaxcolossal.metrics import param_count  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import config_from_hf, config_to_hf, load_hf  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.train.optimizer import build_optimizer  # noqa: E402
from jaxcolossal.train.state import init_state, make_plan  # noqa: E402
from jaxcolossal.train.step import make_train_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """The zoo's DeepSeek-V3, saved: ``(transformers model, folder)``."""
    model = build("deepseek-v3")
    path = tmp_path_factory.mktemp("deepseek-v3")
    model.save_pretrained(path)
    return model, path


HF_REFUSED = [("topk_method", "greedy"), ("scoring_func", "softmax"), ("moe_layer_freq", 2), ("rope_interleave", False),
              ("attention_bias", True), ("quantization_config", {"quant_method": "fp8"}), ("num_key_value_heads", 2),
              ("n_group", 3), ("hidden_act", "gelu"), ("attention_dropout", 0.1)]


@pytest.mark.parametrize("key,value", HF_REFUSED, ids=[k for k, _ in HF_REFUSED])
def test_config_json_keys_it_does_not_implement_are_refused_by_name(v3, key, value):
    hf = {**v3[0].config.to_dict(), key: value}
    with pytest.raises(ConfigError, match=rf"deepseek_v3 config: {key}=") as e:
        config_from_hf(hf)
    assert "\n" not in str(e.value)


YAML_REFUSED = [(["model.attention_impl=flash"], "model.attention_impl=flash"),
                (["parallel.sequence_parallelism_mode=ring_attn", "parallel.sequence_parallel_size=2",
                  "model.num_experts=0", "model.num_experts_per_tok=2", "model.moe_intermediate_size=0",
                  "model.num_shared_experts=0", "model.first_k_dense=0", "model.n_group=0", "model.topk_group=0",
                  "model.router_scoring=softmax", "model.router_score_correction=false",
                  "model.routed_scaling_factor=1.0", "parallel.expert_parallel_size=1"], "ring_attn"),
                (["model.num_key_value_heads=2"], "model.num_key_value_heads=2"),
                (["model.n_group=3"], "model.n_group=3"),
                (["model.topk_group=1", "model.num_experts_per_tok=3"], "model.topk_group=1"),
                (["model.kv_lora_rank=0"], "model.kv_lora_rank=0"),
                (["model.qk_norm=true"], "model.qk_norm=True"),
                (["model.lora.rank=4", "model.lora.targets=q_a,k"], "model.lora.targets='q_a,k'")]


@pytest.mark.parametrize("overrides,named", YAML_REFUSED, ids=[n for _, n in YAML_REFUSED])
def test_yaml_settings_mla_does_not_run_with_are_refused_by_name(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(os.path.join(ROOT, "configs/deepseek_tiny.yaml"), overrides)


def test_multi_token_prediction_weights_are_skipped(v3, tmp_path):
    """A real checkpoint's MTP module (model.layers.61 of DeepSeek-V3: its own projections and norms and a
    whole MoE decoder layer) loads as transformers loads it: skipped."""
    model, path = v3
    tensors = load_file(str(path / "model.safetensors"))
    L = model.config.num_hidden_layers
    extra = {k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}."): v for k, v in tensors.items()
             if k.startswith(f"model.layers.{L - 1}.")}
    extra.update({f"model.layers.{L}.{n}": np.ones((4, 4), np.float32) for n in
                  ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")})
    (tmp_path / "mtp").mkdir()
    save_file({**tensors, **extra}, str(tmp_path / "mtp" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "mtp" / "config.json").write_text((path / "config.json").read_text())
    _, want = load_hf(path)
    _, got = load_hf(tmp_path / "mtp")
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_the_cache_holds_the_latent_and_a_prefill_equals_the_forward(v3):
    _, path = v3
    cfg, params = load_hf(path)
    family = get_family(cfg)
    x = jnp.asarray(tokens(b=2, t=16))
    cache = family.init_cache(cfg, 2, 20)
    assert {n: {k: a.shape for k, a in c.items()} for n, c in cache.items()} == {
        "dense_layers": {"latent": (1, 2, 20, cfg.kv_lora_rank), "k_rope": (1, 2, 20, cfg.qk_rope_head_dim)},
        "layers": {"latent": (2, 2, 20, cfg.kv_lora_rank), "k_rope": (2, 2, 20, cfg.qk_rope_head_dim)}}
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    valid = jnp.zeros((2, 20), bool).at[:, :16].set(True)
    got, cache = family.forward_cached(params, x, cache, jnp.int32(0), positions, valid, cfg)
    want = family.forward(params, x, cfg)
    assert rel_err(np.asarray(got)[..., :cfg.vocab_size], np.asarray(want)[..., :cfg.vocab_size]) < REL
    assert float(jnp.abs(cache["layers"]["latent"][:, :, 16:]).max()) == 0  # the slots not written stay empty


def test_the_config_survives_an_export(v3):
    cfg, _ = load_hf(v3[1])
    yaml = load_config(os.path.join(ROOT, "configs/deepseek_tiny.yaml")).model
    lite = config_from_hf(build("deepseek-v2-lite").config.to_dict())
    dense = dataclasses.replace(yaml, num_experts=0, moe_intermediate_size=0, num_shared_experts=0, first_k_dense=0,
                                n_group=0, topk_group=0, router_scoring="softmax", router_score_correction=False,
                                routed_scaling_factor=1.0, router_aux_loss_coef=0.001)
    for m in (cfg, lite, dataclasses.replace(yaml, hf_model_type="deepseek_v3"), dense):
        back = config_from_hf(config_to_hf(m))
        if not m.moe:  # the MoE keys of a dense model are not architecture
            back = dataclasses.replace(back, router_aux_loss_coef=m.router_aux_loss_coef, router_scoring=m.router_scoring)
        assert dataclasses.replace(back, hf_model_type=m.hf_model_type) == m


def test_the_real_shape_counts_671b_parameters_37b_active():
    n = param_count(load_config(os.path.join(ROOT, "configs/bench/deepseek_v3.yaml")).model)
    assert round(n["total"] / 1e9) == 671 and round(n["active"] / 1e9, 1) == 37.6


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The zoo's DeepSeek-V3 with every layer dense (first_k_dense_replace = num_hidden_layers)."""
    model = build("deepseek-v3", first_k_dense_replace=3)
    path = tmp_path_factory.mktemp("deepseek-dense")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("parallel", [
    {"data_parallel_size": 2, "sequence_parallel_size": 2, "sequence_parallelism_mode": "all_to_all",
     "tensor_parallel_size": 2},
    {"data_parallel_size": 4, "sequence_parallelism_mode": "split_gather", "tensor_parallel_size": 2}],
    ids=["ulysses_sp2_tp2", "megatron_sp_tp2"])
def test_sequence_parallel_logits_equal_transformers(dense, parallel):
    model, path = dense
    cfg, params = load_hf(path, tp=2)
    assert not cfg.moe
    x = tokens(b=4)
    err = rel_err(sharded_logits(cfg, params, x, parallel), logits(model, x))
    print(f"dense deepseek {parallel}: {err:.2e}")
    assert err < REL


PIPE_MODEL = dict(type="deepseek", num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=64, q_lora_rank=16, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
PIPE_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, n_group=2,
                topk_group=1, router_scoring="sigmoid", router_score_correction=True, routed_scaling_factor=2.5,
                router_aux_loss_coef=0.0)
PIPE_TRAINING = dict(batch_size=16, seq_len=32, learning_rate=1e-3, warmup_steps=1, max_steps=10)


def _train(model: dict, parallel: dict, devices, steps: int = 3):
    """``steps`` steps on fixed random tokens: (params on the host, the losses)."""
    cfg = config_from_dict({"model": model, "training": PIPE_TRAINING, "parallel": parallel})
    plan = make_plan(cfg, make_mesh(cfg.parallel, devices))
    tx = build_optimizer(cfg.training)
    state, step = init_state(plan, tx, key=jax.random.key(0)), make_train_step(plan, tx)
    rng, losses = np.random.default_rng(0), []
    for _ in range(steps):
        x = rng.integers(0, cfg.model.vocab_size, (16, 33)).astype(np.int32)
        state, m = step(state, {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                                "targets": jax.device_put(x[:, 1:], plan.batch_sharding)})
        losses.append(float(m["loss"]))
    return jax.device_get(state.params), losses


@pytest.mark.parametrize("experts", [True, False], ids=["moe_ep2", "dense"])
def test_a_pipeline_trains_as_one_device(experts):
    model = {**PIPE_MODEL, **(PIPE_MOE if experts else {})}
    want_params, want = _train(model, {"data_parallel_size": 1}, jax.devices()[:1])
    parallel = {"data_parallel_size": -1, "pipeline_parallel_size": 2, "pipeline_schedule": "1f1b",
                **({"expert_parallel_size": 2} if experts else {})}
    params, got = _train(model, parallel, jax.devices())
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_params_match(params, want_params)
