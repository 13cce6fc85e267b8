"""Mixture of experts (``model.num_experts``) and expert parallelism (``parallel.expert_parallel_size``):
every ep layout equals one device (fp32, 3 steps, dropless), dropless equals a capacity factor that
drops nothing, a capacity factor of 1 on a skewed router drops what a hand count says, Mixtral and
Qwen3-MoE from and to Hugging Face (logits against transformers to 1e-4, the round trip bit-exact),
the load-balancing loss in both forms (``pooled`` equal to transformers' ``load_balancing_loss_func``,
and a Mixtral trained 8 steps as transformers + torch train it), and bad input refused before
anything compiles."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import assert_params_match, random_batches, run_steps, setup, tiny_config

from jaxcolossal.aot import hlo
from jaxcolossal.config import ConfigError, ModelConfig, config_from_dict, load_config, validate
from jaxcolossal.models import llama
from jaxcolossal.models.hf_io import load_hf, read_safetensors, save_hf
from jaxcolossal.models.layers import moe
from jaxcolossal.parallel import expert
from jaxcolossal.parallel.expert import routed_experts
from jaxcolossal.plan.collectives import collective_bytes
from jaxcolossal.plan.dry_run import dry_run
from jaxcolossal.train.loop import train
from jaxcolossal.train.optimizer import lr_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs/llama_tiny.yaml")
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


def _moe(parallel, **model):
    return tiny_config(parallel, model={**MOE, **model})


@pytest.mark.parametrize("parallel", [
    {"data_parallel_size": 8, "expert_parallel_size": 2, "zero_stage": 1},
    {"data_parallel_size": 8, "expert_parallel_size": 4, "zero_stage": 1},
    {"data_parallel_size": 8, "expert_parallel_size": 8, "zero_stage": 0},
    {"data_parallel_size": 8, "expert_parallel_size": 2, "zero_stage": 2},
    {"data_parallel_size": 4, "tensor_parallel_size": 2, "expert_parallel_size": 2, "zero_stage": 1},
    {"data_parallel_size": 8, "expert_parallel_size": 4, "zero_stage": 3},
    {"data_parallel_size": 8, "expert_parallel_size": 8, "zero_stage": 1},
], ids=["ep2", "ep4", "ep8", "ep2_zero2", "ep2_tp2", "ep4_zero3", "ep8_zero1"])
def test_expert_parallel_equals_one_device(parallel):
    """Dropless, fp32, 3 steps (the load-balancing loss on, coefficient 0.01): loss and gradient norm
    to rtol 1e-5, params as :func:`tiny.assert_params_match`, the router's load per expert equal."""
    s1, m1, _ = run_steps(_moe({"data_parallel_size": 1}, router_aux_loss_coef=0.01), jax.devices()[:1], steps=3)
    s8, m8, plan = run_steps(_moe(parallel, router_aux_loss_coef=0.01), steps=3)
    assert plan.mesh_shape["ep"] == parallel["expert_parallel_size"]
    np.testing.assert_allclose([m["loss"] for m in m8], [m["loss"] for m in m1], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in m8], [m["grad_norm"] for m in m1], rtol=1e-5)
    np.testing.assert_allclose(m8[-1]["expert_load"], m1[-1]["expert_load"], atol=1e-6)
    assert_params_match(jax.device_get(s8.params), jax.device_get(s1.params))
    assert "ep" in str(s8.params["layers"]["moe_w_gate"].sharding.spec)
    if parallel["zero_stage"]:  # ZeRO: the dense state over the whole data group, the experts' over it less ep
        dense, expert = plan.specs.opt["layers"]["wq"], plan.specs.opt["layers"]["moe_w_gate"]
        assert ("fsdp", "ep") in tuple(dense), dense
        assert tuple(expert).count("ep") == 1 and ("fsdp", "ep") not in tuple(expert), expert


def _routing(seed=0, t=64, d=16, e=8, f=32, skew=False):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (t, d))
    logits = jax.random.normal(ks[1], (t, e)) + (jnp.arange(e) == 0) * 4.0 * skew
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(logits), 2)
    w = [0.2 * jax.random.normal(k, s) for k, s in zip(ks[2:], [(e, d, f), (e, d, f), (e, f, d)])]
    return x, top_i, top_w, w


@pytest.mark.parametrize("sizes", [(300, 0, 500, 200), (0, 0, 0, 0), (1100, 0, 0, 0), (1, 63, 64, 65)],
                         ids=["mixed", "empty", "one_group", "block_edges"])
def test_blocked_grouped_matmul_equals_ragged_dot(sizes):
    """CPU's dropless form (MegaBlocks' blocks, :func:`expert._experts_blocked`) against
    ``ragged_dot``'s: the output and the gradients of x and the three weights, fp32, rows past the
    groups zero."""
    ks = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(ks[0], (1100, 16))
    w = [0.3 * jax.random.normal(k, s) for k, s in zip(ks[1:], [(4, 16, 24), (4, 16, 24), (4, 24, 16)])]
    sizes = jnp.asarray(sizes, jnp.int32)

    def loss(blocked):
        return lambda x, w: jnp.sum(expert._experts_grouped(x, sizes, *w, blocked=blocked) ** 2)
    np.testing.assert_allclose(expert._experts_blocked(x, sizes, *w), expert._experts_grouped(x, sizes, *w),
                               rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(expert._experts_blocked(x, sizes, *w))[int(sizes.sum()):])
    for a, b in zip(jax.tree.leaves(jax.grad(loss(True), argnums=(0, 1))(x, w)),
                    jax.tree.leaves(jax.grad(loss(False), argnums=(0, 1))(x, w))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_dropless_equals_a_capacity_that_drops_nothing():
    x, top_i, top_w, w = _routing()
    y0, d0 = routed_experts(x, top_i, top_w, *w, 0.0)
    y8, d8 = routed_experts(x, top_i, top_w, *w, 8.0)  # C = 8·64·2/8 = 128 ≥ 64 tokens: nothing dropped
    assert float(d0) == 0 and float(d8) == 0
    np.testing.assert_allclose(np.asarray(y8), np.asarray(y0), rtol=1e-5, atol=1e-6)


def test_capacity_one_drops_what_a_hand_count_says():
    """A router skewed to expert 0: capacity 1.0 gives each expert C = 64·2/8 = 16 places; the
    slots past an expert's first 16 (in token order) are dropped and contribute nothing."""
    x, top_i, top_w, w = _routing(skew=True)
    y, dropped = routed_experts(x, top_i, top_w, *w, 1.0)
    counts = np.bincount(np.asarray(top_i).reshape(-1), minlength=8)
    assert float(dropped) == float(np.maximum(counts - 16, 0).sum()) > 0
    # the tokens whose every slot was kept equal the dropless result; a token with a dropped slot does not
    flat = np.asarray(top_i).reshape(-1)
    seen, kept = {}, np.ones(flat.size, bool)
    for i, e in enumerate(flat):
        seen[e] = seen.get(e, 0) + 1
        kept[i] = seen[e] <= 16
    whole = kept.reshape(-1, 2).all(axis=1)
    y0, _ = routed_experts(x, top_i, top_w, *w, 0.0)
    np.testing.assert_allclose(np.asarray(y)[whole], np.asarray(y0)[whole], rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(y)[~whole], np.asarray(y0)[~whole])


def test_dropped_share_is_reported_as_a_metric():
    _, m, _ = run_steps(_moe({"data_parallel_size": 1}, capacity_factor=0.5), jax.devices()[:1], steps=1)
    assert 0.3 < m[0]["moe_dropped_share"] < 0.9 and m[0]["expert_load"].shape == (8,)
    _, m, _ = run_steps(_moe({"data_parallel_size": 1}), jax.devices()[:1], steps=1)
    assert m[0]["moe_dropped_share"] == 0 and m[0]["expert_load"].sum() == pytest.approx(1.0)


def test_deepseek_style_layers_train_like_one_device():
    """Shared experts, the first layer dense, sigmoid scores, the z-loss: ep 2 × ZeRO-2 equals one device."""
    kw = dict(num_shared_experts=1, first_k_dense=1, router_scoring="sigmoid", router_z_loss_coef=0.001)
    s1, m1, p1 = run_steps(_moe({"data_parallel_size": 1}, **kw), jax.devices()[:1], steps=2)
    assert set(p1.param_shapes) >= {"dense_layers", "layers"} and "shared_w_gate" in p1.param_shapes["layers"]
    s8, m8, _ = run_steps(_moe({"data_parallel_size": 8, "expert_parallel_size": 2, "zero_stage": 2}, **kw), steps=2)
    np.testing.assert_allclose([m["loss"] for m in m8], [m["loss"] for m in m1], rtol=1e-5)
    assert m1[0]["moe_z_loss"] > 0
    assert_params_match(jax.device_get(s8.params), jax.device_get(s1.params))


@pytest.mark.parametrize("overrides, match", [
    (["model.num_experts=4", "model.num_experts_per_tok=6"], "num_experts_per_tok=6 is more than model.num_experts=4"),
    (["model.num_experts=6", "parallel.expert_parallel_size=4"], "expert_parallel_size=4 does not divide model.num_experts=6"),
    (["model.num_experts=8", "model.router_scoring=top1"], "model.router_scoring='top1': allowed values are"),
    (["model.num_experts=8", "model.type=gpt2"], "the gpt2 family has no mixture-of-experts layer"),
    (["parallel.expert_parallel_size=2"], "needs a mixture of experts: set model.num_experts"),
    (["model.router_aux_loss_form=per_layer"], "model.router_aux_loss_form needs a mixture of experts"),
    (["model.num_experts=8", "model.router_aux_loss_form=mean"], "model.router_aux_loss_form='mean': allowed values"),
    (["model.num_experts=8", "parallel.pipeline_parallel_size=2", "parallel.tensor_parallel_size=2"],
     "a mixture of experts in a pipeline needs parallel.tensor_parallel_size=1"),
])
def test_bad_moe_settings_are_refused_when_loading(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, overrides)


def test_expert_parallel_must_divide_the_data_group():
    cfg = load_config(TINY, ["model.num_experts=8", "parallel.expert_parallel_size=8", "parallel.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="expert_parallel_size=8 does not divide data_parallel_size=4"):
        validate(cfg, num_devices=8)


# ----------------------------------------------------------------------------- Hugging Face


def _randomized(model, torch):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hugging_face_moe_logits_and_round_trip(tmp_path, kind):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    common = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, attn_implementation="eager")
    if kind == "mixtral":
        hf_cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                             norm_topk_prob=True, head_dim=16, **common)
        model = transformers.Qwen3MoeForCausalLM(hf_cfg)
    _randomized(model, torch).save_pretrained(str(tmp_path / "hf"))
    cfg, params = load_hf(tmp_path / "hf")
    assert cfg.moe and cfg.qk_norm == (kind == "qwen3_moe")
    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
    ours = np.asarray(llama.forward(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens), cfg))[..., :100]
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    save_hf(tmp_path / "out", cfg, params)
    keys_in, get_in = read_safetensors(tmp_path / "hf")
    keys_out, get_out = read_safetensors(tmp_path / "out")
    assert sorted(keys_in) == sorted(keys_out)
    for k in keys_in:
        np.testing.assert_array_equal(get_out(k), get_in(k))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    assert type(back).__name__ == type(model).__name__


def test_router_losses_follow_their_formulas():
    cfg = ModelConfig(num_experts=4, num_experts_per_tok=1, hidden_size=8, num_attention_heads=2,
                      num_key_value_heads=2, router_aux_loss_coef=0.0)
    x = jax.random.normal(jax.random.key(0), (32, 8))
    w = jax.random.normal(jax.random.key(1), (8, 4))
    top_i, _, stats = moe.route(x, w, cfg)
    p = jax.nn.softmax(x @ w)
    f = np.bincount(np.asarray(top_i).reshape(-1), minlength=4) / 32
    assert float(stats["moe_aux_loss"]) == pytest.approx(4 * float(np.sum(f * np.asarray(p.mean(0)))), rel=1e-5)
    assert float(stats["moe_z_loss"]) == pytest.approx(float(jnp.mean(jax.nn.logsumexp(x @ w, -1) ** 2)), rel=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_load_balancing_loss_forms_against_transformers(k):
    """Three layers' router statistics summed as the layer scan sums them, then
    :func:`moe.finish`: ``pooled`` equals transformers' ``load_balancing_loss_func`` (Mixtral's and
    Qwen3-MoE's, the same function) on those layers' gate logits; ``per_layer`` is the mean of the
    layers' own losses (jaxcolossal's form before issue 45); with one layer the two are equal."""
    torch = pytest.importorskip("torch")
    hf_mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    hf_qwen = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    cfg = ModelConfig(num_experts=4, num_experts_per_tok=k, hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                      num_layers=3)
    keys = jax.random.split(jax.random.key(0), 6)
    xs = [jax.random.normal(keys[i], (32, 8)) for i in range(3)]
    ws = [jax.random.normal(keys[3 + i], (8, 4)) for i in range(3)]
    per = [moe.route(x, w, cfg)[2] for x, w in zip(xs, ws)]
    summed = jax.tree.map(lambda *a: sum(a), *per)
    pooled = float(moe.finish(summed, cfg)["moe_aux_loss"])
    logits = tuple(torch.tensor(np.asarray(jnp.einsum("td,de->te", x, w))) for x, w in zip(xs, ws))
    for hf in (hf_mixtral, hf_qwen):
        assert pooled == pytest.approx(float(hf.load_balancing_loss_func(logits, 4, k)), rel=1e-6)
    per_layer = float(moe.finish(summed, dataclasses.replace(cfg, router_aux_loss_form="per_layer"))["moe_aux_loss"])
    assert per_layer == pytest.approx(np.mean([float(s["moe_aux_loss"]) for s in per]), rel=1e-6)
    assert abs(per_layer - pooled) > 1e-3 * pooled  # a real difference on these routers
    one = dataclasses.replace(cfg, num_layers=1)
    assert float(moe.finish(per[0], one)["moe_aux_loss"]) == pytest.approx(
        float(moe.finish(per[0], dataclasses.replace(one, router_aux_loss_form="per_layer"))["moe_aux_loss"]), rel=1e-6)
    assert float(moe.finish(per[0], one)["moe_aux_loss"]) == pytest.approx(
        float(hf_mixtral.load_balancing_loss_func(logits[:1], 4, k)), rel=1e-6)


@pytest.mark.parametrize("overrides", [[], ["model.capacity_factor=1.25"], ["model.remat=full", "precision.bf16=true"],
                                       ["parallel.expert_parallel_size=4", "parallel.tensor_parallel_size=1"]],
                         ids=["dropless", "capacity", "remat_bf16", "ep4"])
def test_all_to_all_bytes_equal_the_planners(overrides):
    """The compiled step's all-to-alls (per step, bytes each device sends) against the planner's
    :func:`jaxcolossal.plan.collectives.collective_bytes` for ``configs/mixtral_tiny.yaml``: within 5%."""
    cfg = load_config(os.path.join(ROOT, "configs/mixtral_tiny.yaml"), overrides + ["model.num_layers=2"])
    plan, _, state, step = setup(cfg)
    x = random_batches(cfg, 1)[0]
    batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
             "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
    got = hlo.collective_totals(step.lower(state, batch).compile().as_text())["all-to-all"]["sent"]
    assert collective_bytes(cfg, 8, backend="cpu")["all-to-all"] == pytest.approx(got, rel=0.05)


def test_mixtral_from_hugging_face_trains_and_exports(tmp_path):
    """``convert_hf.py --to-jax`` of a Mixtral saved by transformers, then the main job from it
    (``model.init_from``) with the experts over ep 2; ``--to-hf`` of the checkpoint loads back into
    ``MixtralForCausalLM``, whose logits equal ours on the exported weights (1e-4)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import convert_hf  # heavy: from scripts/, put on sys.path by this test only

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)).save_pretrained(str(hf))
    assert convert_hf.main(["--to-jax", str(hf), str(tmp_path / "out")]) == 0
    cfg = load_config(str(tmp_path / "out" / "model.yaml"), [
        f"model.init_from={hf}", "data.tokenizer=byte", "data.max_corpus_bytes=200000", "training.seq_len=32",
        "training.batch_size=16", "training.max_steps=3", "training.warmup_steps=1", "training.eval_every=0",
        "training.eval_batches=1", "training.sample_tokens=0", "logging.log_every=1", "logging.progress_bar=false",
        "parallel.expert_parallel_size=2", "parallel.zero_stage=2", "model.router_aux_loss_coef=0",
        f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt", f"data.cache_dir={tmp_path}/cache"])
    assert cfg.model.router_aux_loss_form == "pooled"  # Hugging Face's load-balancing loss, written in model.yaml
    with open(tmp_path / "out" / "model.yaml") as f:
        assert "router_aux_loss_form: pooled" in f.read()
    out = train(cfg)
    assert out["plan"].mesh_shape["ep"] == 2
    assert convert_hf.main(["--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
    assert type(back).__name__ == "MixtralForCausalLM"
    # the exported weights are the trained ones: their loss on a batch equals ours after training
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
    c2, p2 = load_hf(tmp_path / "back")
    ours = np.asarray(llama.forward(jax.tree.map(jnp.asarray, p2), jnp.asarray(tokens), c2))[..., :256]
    with torch.no_grad():
        np.testing.assert_allclose(back.eval()(torch.tensor(tokens)).logits.numpy(), ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize("parallel, form", [
    ({"pipeline_schedule": "1f1b", "zero_stage": 1}, "per_layer"),
    ({"pipeline_schedule": "interleaved", "num_model_chunks": 2, "zero_stage": 2}, "pooled"),
    ({"pipeline_schedule": "1f1b", "zero_stage": 1, "expert_parallel_size": 1}, "pooled"),
], ids=["1f1b_zero1_per_layer", "interleaved_zero2_pooled", "1f1b_ep1"])
def test_expert_parallel_in_a_pipeline_equals_the_same_microbatches_without_one(parallel, form):
    """ep 2 × pp 2 (fsdp 2), 4 microbatches, the load-balancing and z losses on, against the same
    data group and microbatches without a pipeline (4 devices, accumulation 4: the router losses
    are per microbatch in both): gradient norm to rtol 1e-5, params 99% to 1e-6 and all within
    0.1·lr (Adam's near-zero gradients). The pooled load-balancing loss crosses the stages in the
    activations' stream (over the 4 layers of 2 stages × 2 chunks; with its gradient left out the
    gradient norm is off by 2e-4). The pipelined loss metric is the cross-entropy alone: it is
    below the other's by the router losses (here 0.02-0.03 nats)."""
    model = {**MOE, "num_layers": 4, "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.001,
             "router_aux_loss_form": form}
    ep = parallel.get("expert_parallel_size", 2)  # ep 1: the experts whole on every device of a stage
    ref = tiny_config({"data_parallel_size": 4, "expert_parallel_size": ep, "zero_stage": 1}, model=model,
                      training={"gradient_accumulation_steps": 4})
    s1, m1, _ = run_steps(ref, jax.devices()[:4], steps=3)
    par = {"data_parallel_size": 4, "expert_parallel_size": 2, "pipeline_parallel_size": 2, "num_microbatches": 4,
           **parallel}
    s8, m8, plan = run_steps(tiny_config(par, model=model), steps=3)
    assert plan.mesh_shape["pp"] == 2 and plan.mesh_shape["ep"] == ep
    np.testing.assert_allclose([m["grad_norm"] for m in m8], [m["grad_norm"] for m in m1], rtol=1e-5)
    assert all(0.01 < a["loss"] - b["loss"] < 0.05 for a, b in zip(m1, m8))
    for a, b in zip(jax.tree.leaves(jax.device_get(s8.params)), jax.tree.leaves(jax.device_get(s1.params))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert (np.abs(a - b) > 1e-6 + 1e-5 * np.abs(b)).mean() <= 1e-2
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_dry_run_counts_mixtral_8x7b_as_published():
    """Mixtral-8x7B's shape: 46.7 B parameters, 12.9 B active per token (Jiang et al., 2024), one
    expert per device and layer over ep 8."""
    text = dry_run(load_config(os.path.join(ROOT, "configs/mixtral_8x7b.yaml")))
    assert "parameters 46,702,792,704 (46.70 B); 12,879,925,248 (12.88 B) active per token" in text
    assert "experts    8 of width 14336, top-2, in 32 layers (dropless); ep 8: 1 per device and layer" in text
    # ZeRO-1 with ep 8 = the data group: the dense part's optimizer state split 8 ways (Colossal-AI's MoE plugin)
    assert "zero_stage 1 (the dense part's state over the data group fsdp × ep = 8, the experts' over fsdp 1)" in text
    assert "optimizer 65.24 GiB" in text  # 80.94 GiB with the dense part's state held whole


# ----------------------------------------------------------------------------- the load-balancing loss


def _hf_tiny_mixtral(path, transformers, torch, coef):
    """A 2-layer Mixtral saved by transformers, its weights drawn N(0, 0.1) (so that the router is
    far from uniform), returned in train mode."""
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        router_aux_loss_coef=coef, attn_implementation="eager"))
    _randomized(model, torch).save_pretrained(str(path))
    return model.train()


def _torch_adamw(model, t, torch):
    """torch's AdamW as the step's optax one: the same betas, eps and decay, none on the norms."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not n.endswith("norm.weight")], "weight_decay": t.weight_decay},
              {"params": [p for n, p in named if n.endswith("norm.weight")], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def test_mixtral_trains_as_transformers_does_with_its_load_balancing_loss(tmp_path):
    """A tiny Mixtral saved by transformers, trained 8 steps (fp32, AdamW with warmup, cosine decay,
    weight decay and clipping) by jaxcolossal from ``model.init_from`` and by torch on
    ``MixtralForCausalLM(..., output_router_logits=True).loss`` (cross-entropy + ``router_aux_loss_coef``
    × transformers' ``load_balancing_loss_func``, coefficient 0.1): per-step loss and final weights
    agree to 1e-4 (observed: loss ≤ 1.4e-6, weights ≤ 3.3e-5, the largest on Adam's near-zero
    gradients). With ``router_aux_loss_form=per_layer`` the losses are off by up to 0.03 (1.05% of
    the auxiliary loss at step 0: 2.0915 against HF's 2.0697)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _hf_tiny_mixtral(tmp_path / "hf", transformers, torch, coef=0.1)
    cfg_m, _ = load_hf(tmp_path / "hf")
    assert cfg_m.router_aux_loss_form == "pooled"
    training = {"batch_size": 4, "seq_len": 32, "learning_rate": 3e-3, "warmup_steps": 2, "max_steps": 8,
                "weight_decay": 0.1, "max_grad_norm": 1.0}
    cfg = config_from_dict({"model": {**dataclasses.asdict(cfg_m), "init_from": str(tmp_path / "hf")},
                            "training": training, "parallel": {"data_parallel_size": 1}})
    plan, tx, state, step = setup(cfg, jax.devices()[:1])
    sched, opt = lr_schedule(cfg.training), _torch_adamw(model, cfg.training, torch)
    ours, theirs = [], []
    for i, x in enumerate(random_batches(cfg, 8)):
        batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                 "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        state, m = step(state, batch)
        ours.append(float(m["loss"]))
        for g in opt.param_groups:
            g["lr"] = float(sched(i))
        opt.zero_grad()
        inputs, targets = (torch.tensor(np.ascontiguousarray(a), dtype=torch.long) for a in (x[:, :-1], x[:, 1:]))
        loss = model(inputs, labels=targets, shift_labels=targets, output_router_logits=True).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_grad_norm)
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    model.save_pretrained(str(tmp_path / "trained"))
    _, want = load_hf(tmp_path / "trained")
    got = jax.device_get(state.params)
    jax.tree_util.tree_map_with_path(lambda p, a, b: np.testing.assert_allclose(
        np.asarray(a), b, rtol=0, atol=1e-4, err_msg=jax.tree_util.keystr(p)), got, want)
    print("parity: max loss diff", np.abs(np.subtract(ours, theirs)).max(), "max weight diff",
          max(np.abs(np.asarray(a) - b).max() for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
