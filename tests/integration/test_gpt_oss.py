"""GPT-OSS beyond the zoo-wide checks of test_hf_architectures.py (tests/integration/hf_zoo.py's ``gpt-oss``):

* logits under expert parallelism (ep 2 × tp 2 ZeRO-1, ep 4 ZeRO-3, and the capacity path with a capacity
  that drops nothing) within 1e-5 of max |logit| of transformers';
* every parameter's gradient under ep 2 × tp 2 ZeRO-2 and ep 4 ZeRO-3 (capacity path) within 1e-5 of the
  one device's (the experts' and router's biases, the sinks);
* the zoo model's clamped SwiGLU clamps (some gate values above the limit, some up values beyond ±limit,
  in every layer), so the logits tests cover the clamp;
* the loss with ``output_router_logits`` (transformers' cross-entropy + coef × its load-balancing loss over
  the biased router logits) equals ours, and without it the coefficient reads as 0;
* a config.json that omits keys reads as ``GptOssConfig``'s defaults; the keys GPT-OSS cannot run with are
  refused in one line naming them (MXFP4 ``quantization_config``, ``swiglu_alpha``, ``experts_per_token``),
  and so are the exports and layouts it cannot carry;
* the planner counts gpt-oss-20b and -120b as OpenAI's model card does (20.91 B / 3.61 B active, 116.83 B /
  5.13 B: the active count without the input embedding), and a sliding layer's attention FLOPs by its window;
* a pipeline (ep 2 × pp 2, every layer sliding) equals the same microbatches without one;
* LoRA on the attention's q, k, v, o equals its merged weights;
* the shared experts' biases and clamp in the blocked (CPU) grouped matmuls equal ``ragged_dot``'s, and
  the capacity path's equal the dropless one's.
"""
import dataclasses
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_zoo import BASE, ZOO, build, logits  # noqa: E402
from test_hf_architectures import REL, rel_err, sharded_logits, tokens  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from tiny import run_steps, tiny_config  # noqa: E402

from jaxcolossal.config import ConfigError, config_from_dict, load_config  # noqa: E402
from jaxcolossal.metrics import attended_keys, flops_per_token, param_count  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import config_from_hf, config_to_hf, load_hf  # noqa: E402
from jaxcolossal.models.layers import lora  # noqa: E402
from jaxcolossal.parallel import expert  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.plan.dry_run import dry_run  # noqa: E402
from jaxcolossal.train.state import make_plan  # noqa: E402

NAME = "gpt-oss"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build(NAME)
    path = tmp_path_factory.mktemp(NAME)
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("parallel,capacity", [
    ({"data_parallel_size": 4, "expert_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1}, 0.0),
    ({"data_parallel_size": 8, "expert_parallel_size": 4, "zero_stage": 3}, 0.0),
    ({"data_parallel_size": 4, "expert_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1}, 4.0),
], ids=["ep2_tp2_zero1", "ep4_zero3", "ep2_tp2_capacity"])
def test_logits_under_expert_parallelism(saved, parallel, capacity):
    """Capacity 4: each expert takes 4·T·k/E = 2T slots per device, all T·k of them: nothing dropped."""
    model, path = saved
    cfg, params = load_hf(path, tp=parallel.get("tensor_parallel_size", 1))
    cfg = dataclasses.replace(cfg, capacity_factor=capacity)
    x = tokens(b=8)
    err = rel_err(sharded_logits(cfg, params, x, parallel), logits(model, x))
    print(f"{NAME} {parallel} capacity {capacity}: {err:.2e}")
    assert err < REL


def test_the_zoo_models_swiglu_clamps_in_every_layer(saved):
    """The experts' gate (above the limit) and up (beyond ±limit) values of every token, in each layer."""
    model, _ = saved
    seen = []

    def hook(mod, inp, out):
        gate_up = torch.einsum("td,edf->tef", inp[0], mod.gate_up_proj) + mod.gate_up_proj_bias
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        seen.append([float((gate > mod.limit).float().mean()), float((up.abs() > mod.limit).float().mean())])

    handles = [layer.mlp.experts.register_forward_hook(hook) for layer in model.model.layers]
    try:
        logits(model, tokens())
    finally:
        for h in handles:
            h.remove()
    share = np.asarray(seen)
    print(f"{NAME}: share of gate > limit, |up| > limit per layer: {share.round(2).tolist()}")
    assert len(share) == ZOO[NAME][1]["num_hidden_layers"]
    assert np.all((share > 0.05) & (share < 0.95)), share


def test_loss_with_router_logits_equals_transformers(tmp_path):
    """transformers' loss with ``output_router_logits`` (cross-entropy + 0.9 × the pooled load-balancing loss
    over the biased router's softmax), against ours from the same folder; without it the coefficient is 0."""
    model = build(NAME, output_router_logits=True)
    model.save_pretrained(tmp_path)
    cfg, params = load_hf(tmp_path)
    assert cfg.router_aux_loss_coef == pytest.approx(0.9)
    x = tokens(b=2)
    with torch.no_grad():
        out = model(torch.as_tensor(x).long(), labels=torch.as_tensor(x).long())
    targets = np.concatenate([x[:, 1:], x[:, :1]], axis=1)
    mask = np.ones_like(x, np.float32)
    mask[:, -1] = 0
    loss, stats = get_family(cfg).loss_and_stats(params, jnp.asarray(x), jnp.asarray(targets), cfg,
                                                 mask=jnp.asarray(mask))
    ours = float(loss) / mask.sum()
    print(f"{NAME}: loss with the aux term {float(out.loss):.6f} (transformers) {ours:.6f} (ours); aux "
          f"{float(out.aux_loss):.6f} / {float(stats['moe_aux_loss']):.6f}")
    assert float(stats["moe_aux_loss"]) == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert ours == pytest.approx(float(out.loss), rel=1e-5)
    plain = json.loads((tmp_path / "config.json").read_text())
    assert config_from_hf({**plain, "output_router_logits": False}).router_aux_loss_coef == 0.0
    assert config_to_hf(cfg)["output_router_logits"] is True


def test_a_config_without_the_defaults_reads_as_gpt_oss_config_fills_them():
    """Only the sizes in config.json: head_dim 64, window 128, alternating layers, yarn (factor 32 over
    4096, theta 150000), swiglu_limit 7, top-4, ..., as ``GptOssConfig`` fills them in."""
    sizes = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    full = transformers.GptOssConfig(**{k: v for k, v in sizes.items() if k != "model_type"}).to_dict()
    ours, theirs = config_from_hf(sizes), config_from_hf(full)
    assert ours == theirs
    assert (ours.head_dim, ours.sliding_window, ours.rope.type, ours.rope_theta, ours.swiglu_limit) == (
        64, 128, "yarn", 150000.0, 7.0)
    assert ours.layer_kinds == ("sliding_attention", "full_attention") * 2


@pytest.mark.parametrize("key,value,named", [
    ("quantization_config", {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}, "quantization_config"),
    ("swiglu_alpha", 1.5, "swiglu_alpha"),
    ("experts_per_token", 3, "experts_per_token"),
    ("attention_dropout", 0.1, "attention_dropout"),
    ("swiglu_limit", 0.0, "swiglu_limit"),
])
def test_config_keys_that_change_the_math_are_refused_by_name(key, value, named):
    hf = {**transformers.GptOssConfig(**{k: v for k, v in BASE.items() if k != "attn_implementation"}).to_dict(),
          key: value}
    with pytest.raises(ConfigError, match=named) as e:
        config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_exports_and_layouts_gpt_oss_cannot_carry_are_refused():
    cfg = config_from_hf(transformers.GptOssConfig(**{k: v for k, v in BASE.items()
                                                      if k != "attn_implementation"}).to_dict())
    for field, value in (("router_bias", False), ("attention_sinks", False), ("swiglu_limit", 0.0),
                         ("norm_topk_prob", False)):
        with pytest.raises(ConfigError, match=f"model.{field}="):
            config_to_hf(dataclasses.replace(cfg, **{field: value}))
    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "lora"} | {"layer_types": "", "sliding_window": 0}
    for extra, named in (({"model": {"attention_impl": "cudnn"}}, "attention_sinks"),
                         ({"parallel": {"sequence_parallel_size": 2, "sequence_parallelism_mode": "all_to_all"}},
                          "attention_sinks")):
        raw = {"model": {**model, **extra.get("model", {})}, "parallel": extra.get("parallel", {}),
               "training": {"batch_size": 8, "seq_len": 16}}
        with pytest.raises(ConfigError, match=named):
            config_from_dict(raw)  # validated
    with pytest.raises(ConfigError, match="num_experts"):
        get_family(cfg).param_shapes_and_axes(dataclasses.replace(cfg, num_experts=0), cfg.vocab_size)


def _expert_weights(seed=0, e=4, d=16, f=24):
    ks = jax.random.split(jax.random.key(seed), 6)
    shapes = [(e, d, f), (e, d, f), (e, f, d), (e, f), (e, f), (e, d)]
    return [0.5 * jax.random.normal(k, s) for k, s in zip(ks, shapes)]


@pytest.mark.parametrize("limit", [0.0, 0.7])
def test_blocked_experts_with_biases_and_clamp_equal_ragged_dot(limit):
    """The output and the gradients of x, the weights and the biases, rows past the groups zero."""
    x = jax.random.normal(jax.random.key(5), (300, 16))
    wg, wu, wd, bg, bu, _ = _expert_weights()
    sizes = jnp.asarray([100, 0, 120, 50], jnp.int32)

    def run(blocked):
        return lambda x, w: expert._experts_grouped(x, sizes, *w[:3], blocked=blocked, bg=w[3], bu=w[4], limit=limit)
    w = [wg, wu, wd, bg, bu]
    np.testing.assert_allclose(run(True)(x, w), run(False)(x, w), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(run(True)(x, w))[270:]) and not np.any(np.asarray(run(False)(x, w))[270:])
    grads = [jax.grad(lambda x, w, b=b: jnp.sum(run(b)(x, w) ** 2), argnums=(0, 1))(x, w) for b in (True, False)]
    for a, b in zip(*map(jax.tree.leaves, grads)):  # to 1e-5 of the largest (sums of squares: cancellations)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))


def test_capacity_path_with_biases_equals_dropless_and_drops_the_bias_with_the_slot():
    x = jax.random.normal(jax.random.key(7), (64, 16))
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(jax.random.normal(jax.random.key(8), (64, 4))), 2)
    wg, wu, wd, bg, bu, bd = _expert_weights()
    y0, _ = expert.routed_experts(x, top_i, top_w, wg, wu, wd, 0.0, biases=(bg, bu, bd), swiglu_limit=0.7)
    y8, d8 = expert.routed_experts(x, top_i, top_w, wg, wu, wd, 8.0, biases=(bg, bu, bd), swiglu_limit=0.7)
    assert float(d8) == 0
    np.testing.assert_allclose(y8, y0, rtol=1e-5, atol=1e-6)
    # a dropped slot contributes nothing, its down bias included: capacity 0.01 keeps 1 slot per expert
    y, dropped = expert.routed_experts(x, top_i, top_w, wg, wu, wd, 0.01, biases=(bg, bu, bd), swiglu_limit=0.7)
    assert float(dropped) == 64 * 2 - 4
    assert np.count_nonzero(np.abs(np.asarray(y)).sum(axis=1)) <= 4


GPT_OSS_TINY = dict(type="gpt_oss", num_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    attention_bias="all", attention_sinks=True, router_bias=True, expert_bias=True, swiglu_limit=1.0,
                    sliding_window=8, router_aux_loss_coef=0.01, initializer_range=0.1)
"""A fresh GPT-OSS on tests/tiny.py's sizes: every layer sliding (a pipeline runs one layer kind), limit 1."""


def _gradients(parallel: dict, model: dict, params=None) -> tuple[dict, dict]:
    """``(params, the gradient of the summed loss)`` of a fresh :data:`GPT_OSS_TINY` (key 0) under ``parallel``'s
    training layout, on a fixed batch of 16 × 32 tokens (fp32, numpy)."""
    cfg = tiny_config(parallel, model=model)
    n = cfg.parallel.data_parallel_size * cfg.parallel.tensor_parallel_size
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:n]))
    if params is None:
        params = jax.device_get(plan.family.init_params(cfg.model, jax.random.key(0), plan.mesh_shape["tp"]))
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(plan.mesh, s)), params, plan.specs.params)
    x = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (16, 33)).astype(np.int32)
    grad = jax.jit(jax.grad(lambda p, a, b: plan.family.loss_sum(p, a, b, cfg.model, plan.sharder, True)))
    return params, jax.device_get(grad(placed, *(jax.device_put(a, plan.batch_sharding) for a in (x[:, :-1], x[:, 1:]))))


@pytest.mark.parametrize("parallel,capacity", [
    ({"data_parallel_size": 4, "tensor_parallel_size": 2, "expert_parallel_size": 2, "zero_stage": 2}, 0.0),
    ({"data_parallel_size": 8, "expert_parallel_size": 4, "zero_stage": 3}, 4.0),
], ids=["ep2_tp2_zero2", "ep4_zero3_capacity"])
def test_gradients_under_expert_parallelism_equal_one_device(parallel, capacity):
    """Every leaf's gradient (the load-balancing loss on) within 1e-5 of its largest element of the one
    device's: the experts' biases (the down bias added once after the tp sum, gathered whole on every
    device; gate and up split with the experts' f over tp), the router bias and the sinks (with the heads).
    (Trained steps drift apart sooner: a token whose top-2 is near a tie may switch experts.)"""
    model = {**GPT_OSS_TINY, "capacity_factor": capacity}
    params, want = _gradients({"data_parallel_size": 1}, model)
    _, got = _gradients(parallel, model, params)
    worst = {}
    for name, g in want["layers"].items():
        worst[name] = float(np.max(np.abs(got["layers"][name] - g)) / np.max(np.abs(g)))
    print(f"{parallel} capacity {capacity}: worst leaf {max(worst, key=worst.get)} {max(worst.values()):.1e}")
    assert max(worst.values()) < 1e-5, worst


def test_expert_parallel_in_a_pipeline_equals_the_same_microbatches_without_one():
    """ep 2 × pp 2 (1F1B, ZeRO-1, 4 microbatches) against the same data group and microbatches without a
    pipeline (the experts' down biases gathered over the pipeline's manual ep axis): gradient norm to rtol
    1e-5, params within 1e-4 (test_moe.py's bounds)."""
    ref = tiny_config({"data_parallel_size": 4, "expert_parallel_size": 2, "zero_stage": 1}, model=GPT_OSS_TINY,
                      training={"gradient_accumulation_steps": 4})
    s1, m1, _ = run_steps(ref, jax.devices()[:4], steps=3)
    par = {"data_parallel_size": 4, "expert_parallel_size": 2, "pipeline_parallel_size": 2, "num_microbatches": 4,
           "pipeline_schedule": "1f1b", "zero_stage": 1}
    s8, m8, plan = run_steps(tiny_config(par, model=GPT_OSS_TINY), steps=3)
    assert plan.mesh_shape["pp"] == 2 and plan.mesh_shape["ep"] == 2
    np.testing.assert_allclose([m["grad_norm"] for m in m8], [m["grad_norm"] for m in m1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(s8.params)), jax.tree.leaves(jax.device_get(s1.params))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("config,total,active", [
    ("bench/gpt_oss_20b.yaml", "20,914,757,184 (20.91 B)", "3.61 B"),
    ("bench/gpt_oss_120b.yaml", "116,829,156,672 (116.83 B)", "5.13 B"),
    ("gpt_oss_tiny.yaml", "2,644,656 (0.00 B)", "0.00 B"),
])
def test_dry_run_counts_gpt_oss_as_published(config, total, active):
    overrides = ["parallel.data_parallel_size=4"] if "tiny" in config else []  # the tiny one resolves -1 by --devices
    cfg = load_config(os.path.join(ROOT, "configs", config), overrides)
    text = dry_run(cfg)
    assert f"parameters {total}" in text and f"({active} without the input embedding)" in text, text
    # 6N+attn: the full layers' keys t/2, the sliding ones' their window's (128 of 4096: 126.0)
    m, t = cfg.model, cfg.training.seq_len
    keys = sum(t / 2 if w == 0 else np.mean(np.minimum(np.arange(1, t + 1), w)) for w in m.layer_windows)
    want = 6 * param_count(m)["matmul"] + 12 * keys * m.num_attention_heads * m.head_dim
    assert flops_per_token(m, t)["6N+attn"] == pytest.approx(want, rel=1e-12)
    assert attended_keys(0, t) == attended_keys(t, t) == t / 2


def test_lora_on_the_attention_equals_its_merged_weights():
    """LoRA on GPT-OSS's q, k, v and o (what a mixture of experts adapts), B drawn non-zero: the adapted
    forward equals the forward of the merged weights ``W + (alpha/rank)·A B`` (PEFT's merge_and_unload)."""
    cfg = tiny_config(model={**GPT_OSS_TINY, "lora": {"rank": 4, "targets": "q,k,v,o"}}).model
    family = get_family(cfg)
    params = family.init_params(cfg, jax.random.key(0))
    shapes = jax.tree.map(lambda sa: sa[0], lora.adapter_shapes_and_axes(cfg.lora, family.param_shapes_and_axes(
        cfg, cfg.vocab_size)["layers"]), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
    adapters = lora.init_adapters(cfg.lora, shapes, jax.random.key(1))
    adapters = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape), adapters)
    assert sorted(adapters["layers"]) == sorted(f"w{n}{s}" for n in "qkvo" for s in ("_lora_a", "_lora_b"))
    x = jnp.asarray(tokens(b=2, t=16))
    adapted = family.forward(lora.merge(params, adapters), x, cfg)
    merged = family.forward(lora.merged_weights(lora.merge(params, adapters), cfg.lora), x, cfg)
    plain = family.forward(params, x, cfg)
    assert float(jnp.max(jnp.abs(adapted - plain))) > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(adapted, merged, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(merged))))
