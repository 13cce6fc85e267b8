"""GRPO's decode layout (posttrain.rollout_layout=decode, jaxcolossal.parallel.decode_layout): the policy's
params resharded once per rollout into a tp-only layout on the same 8 simulated devices give the same
rollouts and the same steps as sampling on the training layout (ZeRO-2 dp 4 × tp 2, ZeRO-3 over 8, LoRA),
the reshard is the identity on the values, the decode loop holds no all-gather, and a bad rollout_tp
is refused in one line before anything compiles."""
import jax
import numpy as np
import pytest
from test_grpo_pipeline import grpo_pp_config
from test_grpo_train import GRPO_JOB, ROOT, grpo_config, run_grpo
from tiny import TINY_MODEL, setup

from jaxcolossal.aot import hlo
from jaxcolossal.config import ConfigError, config_from_dict, load_config
from jaxcolossal.config.checks import validate
from jaxcolossal.config.derived import rollout_tp
from jaxcolossal.generate import Sampling, make_generator
from jaxcolossal.parallel.decode_layout import decode_mesh, make_reshard
from jaxcolossal.parallel.mesh import entry_axes

LAYOUTS = {"zero2_dp4_tp2": {"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2},
           "zero3_x8": {"data_parallel_size": 8, "zero_stage": 3}}


def _same_rollouts_and_steps(cfg_decode, cfg_training, devices=None, steps=4):
    """Both runs' rollout batches token-equal, their log-probs, losses, gradient norms and params within 1e-5."""
    s_d, r_d = run_grpo(cfg_decode, devices, steps)
    s_t, r_t = run_grpo(cfg_training, devices, steps)
    for (hd, md), (ht, mt) in zip(r_d, r_t):
        for k in ("inputs", "targets", "loss_mask", "advantages"):
            np.testing.assert_array_equal(hd[k], ht[k], err_msg=k)
        for k in ("old_logps", "ref_logps"):
            np.testing.assert_allclose(hd[k], ht[k], rtol=1e-5, atol=1e-5, err_msg=k)
        for k in ("loss", "grad_norm", "kl", "reward"):
            np.testing.assert_allclose(md[k], mt[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(jax.device_get(s_d.params)), jax.tree.leaves(jax.device_get(s_t.params))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    return r_d


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rollout_tp", [0, 1])
def test_the_decode_layout_gives_todays_rollouts_and_steps(layout, rollout_tp):
    """rollout_tp 0 (a host's devices capped by the 2 kv heads: tp 2) and 1 (tp 1, the rows over all 8)."""
    decode = grpo_config(LAYOUTS[layout], {"rollout_tp": rollout_tp})
    training = grpo_config(LAYOUTS[layout], {"rollout_layout": "training"})
    out = _same_rollouts_and_steps(decode, training)
    assert 0 < out[0][1]["reward"]


def test_lora_grpo_on_the_decode_layout_equals_the_training_layout():
    """LoRA (the base as the reference), bf16, ZeRO-3 over dp 2 × tp 2 on 4 devices, decoding at tp 1."""
    def cfg(posttrain):
        return config_from_dict({
            "model": {**TINY_MODEL, "vocab_size": 256, "lora": {"rank": 4}},
            "training": {"batch_size": 16, "seq_len": 12, "learning_rate": 1e-2, "warmup_steps": 1, "max_steps": 10,
                         "objective": "grpo"},
            "data": {"format": "prompts", "corpus": f"{ROOT}/configs/data/arith_prompts.jsonl", "tokenizer": "byte"},
            "posttrain": {"num_generations": 4, "max_completion_length": 4, "beta": 0.04, "reference": "lora_base",
                          "reward_funcs": "format", "format_pattern": r"\d", **posttrain},
            "precision": {"bf16": True},
            "parallel": {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}})
    _same_rollouts_and_steps(cfg({"rollout_tp": 1}), cfg({"rollout_layout": "training"}), jax.devices()[:4], 3)


def test_the_reshard_keeps_the_values_and_leaves_only_tp():
    """ZeRO-3 over fsdp 4 × tp 2 into decode tp 2 × dp 4: every leaf equal, split over tp at most (whole over
    the data axes); the decode mesh is the same devices in the same order."""
    cfg = grpo_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 3})
    plan, _, state, _ = setup(cfg)
    dmesh = decode_mesh(plan.mesh, 2)
    assert dict(dmesh.shape) == {"pp": 1, "dp": 4, "fsdp": 1, "ep": 1, "sp": 1, "tp": 2}
    assert list(dmesh.devices.flat) == list(plan.mesh.devices.flat)
    reshard, specs = make_reshard(state.params, dmesh)
    out = reshard(state.params)
    assert any("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state.params))
    for a, b, s in zip(jax.tree.leaves(out), jax.tree.leaves(state.params), jax.tree.leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        assert a.sharding.mesh is dmesh and a.sharding.spec == s
        assert all(a == "tp" for e in s for a in entry_axes(e))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_reshard_of_a_pipeline_keeps_the_values():
    """A pipeline's layers (over pp 2 × dp 2 × tp 2) resharded a layer at a time into decode tp 2 × dp 4:
    every leaf equal, none left over pp."""
    cfg = grpo_pp_config({"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 2})
    plan, _, state, _ = setup(cfg)
    dmesh = decode_mesh(plan.mesh, 2)
    reshard, specs = make_reshard(state.params, dmesh)
    out = reshard(state.params)
    assert any("pp" in str(x.sharding.spec) for x in jax.tree.leaves(state.params["layers"]))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(state.params)):
        assert a.sharding.mesh is dmesh and "pp" not in str(a.sharding.spec)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_decode_loop_gathers_no_weights():
    """The sampler compiled on the decode layout (ZeRO-3 over 8 resharded to tp 2 × dp 4): the decode loop
    (the program's while loop without a known trip count) holds no all-gather; on the training layout it
    gathers every layer's weights."""
    cfg = grpo_config({"data_parallel_size": 8, "zero_stage": 3})
    plan, _, state, _ = setup(cfg)
    dmesh = decode_mesh(plan.mesh, 2)
    reshard, specs = make_reshard(state.params, dmesh)

    def loop_gathers(mesh, params):
        fn = make_generator(plan.family, cfg.model, 4, Sampling(greedy=True), eos_id=1, mesh=mesh,
                            param_specs=jax.tree.map(lambda x: x.sharding.spec, params))
        tokens = np.ones((16, 9), np.int32)
        text = fn.lower(params, tokens, tokens.astype(bool), jax.random.key(0)).compile().as_text()
        per_step = hlo.decode_loop_collectives(text)
        return per_step.get("all-gather", {}).get("bytes", 0)

    assert loop_gathers(dmesh, reshard(state.params)) == 0
    assert loop_gathers(plan.mesh, state.params) > 0


@pytest.mark.parametrize("override, message", [
    (["posttrain.rollout_tp=3"], "posttrain.rollout_tp=3 does not split 8 devices"),
    (["posttrain.rollout_tp=-1"], "posttrain.rollout_tp"),
    (["posttrain.rollout_layout=fast"], "posttrain.rollout_layout"),
])
def test_bad_rollout_settings_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        validate(load_config(f"{ROOT}/configs/llama_tiny.yaml", GRPO_JOB + override), 8)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, devices, overrides, want", [
    ("llama3_8b", 8, [], 8),  # a host's 8 devices, the 8 kv heads
    ("llama3_8b", 8, ["posttrain.rollout_tp=2"], 2),  # as set
    ("gpt_oss_120b", 32, ["parallel.data_parallel_size=32"], 4),  # ep 8 kept: tp × 8 divides 32
])
def test_the_default_rollout_tp(name, devices, overrides, want):
    cfg = load_config(f"{ROOT}/configs/bench/{name}.yaml", ["training.objective=grpo", "data.format=prompts",
                      f"data.corpus={ROOT}/configs/data/arith_prompts.jsonl", "training.micro_batch_size=0",
                      "posttrain.num_generations=2", "model.attention_impl=xla"] + overrides)
    assert rollout_tp(cfg, devices, 8) == want


def test_experts_under_zero3_with_ep_reshard_to_whole_dense_weights_and_decode_the_same():
    """A mixture of experts under ZeRO-3 with ep 2 over 8 devices (the dense weights split over fsdp 4 × ep
    2): the decode layout keeps the experts over ep and the dense weights whole (no ``ep`` left on them, as
    ZeRO put it there), and its rollouts and steps equal the training layout's (scripts/bench_rollout.py
    counts the decode step's collectives on the Mixtral-8x7B shape)."""
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "router_aux_loss_coef": 0.0}

    def cfg(posttrain):
        return config_from_dict({
            "model": {**TINY_MODEL, "vocab_size": 256, **moe},
            "training": {"batch_size": 16, "seq_len": 12, "learning_rate": 1e-3, "warmup_steps": 1, "max_steps": 10,
                         "objective": "grpo"},
            "data": {"format": "prompts", "corpus": f"{ROOT}/configs/data/arith_prompts.jsonl", "tokenizer": "byte"},
            "posttrain": {"num_generations": 4, "max_completion_length": 4, "beta": 0.04, "reward_funcs": "format",
                          "format_pattern": r"\d", "rollout_tp": 1, **posttrain},
            "parallel": {"data_parallel_size": 8, "expert_parallel_size": 2, "zero_stage": 3}})
    plan, _, state, _ = setup(cfg({}))
    dmesh = decode_mesh(plan.mesh, 1)
    _, specs = make_reshard(state.params, dmesh)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    split = {jax.tree_util.keystr(p): {a for e in s for a in entry_axes(e) if dmesh.shape[a] > 1} for p, s in flat}
    assert any("ep" in str(x.sharding.spec) for x in jax.tree.leaves(state.params) if x.ndim == 2)  # ZeRO's dense ep
    assert {k for k, axes in split.items() if axes} == {k for k in split if "moe_w_" in k}, split
    assert all(axes == {"ep"} for axes in split.values() if axes), split
    _same_rollouts_and_steps(cfg({}), cfg({"rollout_layout": "training"}), steps=2)
