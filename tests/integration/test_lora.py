"""LoRA (``model.lora``): the base frozen in the compute dtype and only the adapters trained (so the
optimizer state is the adapters'), one device equal to ZeRO-2 dp4 × tp2, a bit-exact resume,
Hugging Face PEFT's format out and in (``peft`` loads the adapters onto the ``transformers`` model
with the same logits; the merged export equals it), chat SFT from Hugging Face weights, and bad
input refused before anything compiles."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import assert_params_match, random_batches, resumed_and_uninterrupted, run_steps, setup, tiny_config

from jaxcolossal.aot import hlo
from jaxcolossal.config import ConfigError, LoraConfig, gib, load_config
from jaxcolossal.metrics import flops_per_token
from jaxcolossal.models import llama
from jaxcolossal.models.hf_io import load_hf, save_hf, save_shared
from jaxcolossal.models.layers.lora import (DROPOUT_KEY, adapter_shapes_and_axes, merge, merged_weights,
                                            with_dropout_keys)
from jaxcolossal.models.peft import load_adapters, read_adapter_config, save_adapters
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.plan.dry_run import dry_run
from jaxcolossal.train.loop import train
from jaxcolossal.train.report import memory_report
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs/llama_tiny.yaml")


def _lora(parallel, targets="all", precision=None):
    return tiny_config(parallel, precision, model={"lora": {"rank": 8, "targets": targets}})


@pytest.mark.parametrize("overrides, match", [
    (["model.lora.rank=8", "model.lora.targets=q,x"], "unknown target.s. x; allowed: comma-separated q, k, v, o"),
    (["model.lora.rank=-1"], r"model.lora.rank=-1: must be >= 0"),
    (["model.lora.targets=q,k"], "model.lora.rank=0 turns LoRA off, but model.lora.targets is set"),
    (["model.lora.rank=8", "model.lora.alpha=0"], r"model.lora.alpha=0.0: must be > 0"),
    (["model.lora.rank=8", "model.type=gpt2"],
     "LoRA is implemented for model.type llama, gemma, gpt_oss, deepseek, not .gpt2."),
    (["model.lora.rank=8", "model.lora.targets=q,kv_b"],
     "kv_b is not a projection of model.type=llama .a LLaMA-like model.: allowed: comma-separated q, k, v, o, gate, "
     "up, down, or all"),
    (["model.lora.rank=8", "model.lora.dropout=0.1", "parallel.pipeline_parallel_size=2"],
     "the pipeline carries no dropout keys yet"),
])
def test_bad_lora_settings_are_refused_when_loading(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, overrides)


def test_lora_starts_as_the_base_and_trains_only_the_adapters():
    """B starts at zero (the adapted model's loss is the base's); after 3 steps the frozen base is
    bit-for-bit the initial one and every adapter moved; the optimizer state of rank 8 on q and v of
    the main job's model is over 50x smaller than full fine-tuning's, measured from the arrays."""
    _, base, _ = run_steps(tiny_config({"data_parallel_size": 1}), jax.devices()[:1], steps=1)
    state, m, plan = run_steps(_lora({"data_parallel_size": 1}), jax.devices()[:1], steps=3)
    assert m[0]["loss"] == pytest.approx(base[0]["loss"], rel=1e-6)
    fresh = init_state(plan, build_optimizer(plan.cfg.training, plan), key=jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.frozen), jax.device_get(fresh.frozen))
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(state.params)),
                                                        jax.tree.leaves(jax.device_get(fresh.params))))

    for precision in ("fp32", "bf16"):
        cfg = load_config(TINY, ["model.lora.rank=8", "parallel.data_parallel_size=1", "parallel.tensor_parallel_size=1",
                                 *(["precision.bf16=true"] if precision == "bf16" else [])])
        plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
        st = init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(0))
        _, report = memory_report(plan, st)
        ratio = report["full_finetune_optimizer"] / report["measured"]["optimizer"]
        assert ratio >= 50, (precision, ratio)
        assert st.frozen["layers"]["wq"].dtype == plan.compute_dtype


def test_lora_one_device_equals_zero2_dp4_tp2():
    """fp32, 3 steps, rank 8 on every projection: the loss and gradient norm to rtol 1e-5, the adapters
    as :func:`tiny.assert_params_match` (nearly all elements to 1e-6, all within 0.1·lr)."""
    s1, m1, _ = run_steps(_lora({"data_parallel_size": 1}), jax.devices()[:1], steps=3)
    s8, m8, plan = run_steps(_lora({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2}), steps=3)
    assert plan.mesh_shape["tp"] == 2 and plan.data_size == 4
    np.testing.assert_allclose([m["loss"] for m in m8], [m["loss"] for m in m1], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in m8], [m["grad_norm"] for m in m1], rtol=1e-5)
    assert_params_match(jax.device_get(s8.params), jax.device_get(s1.params))
    # an adapter is sharded as its base projection: B of q on tp (heads), A of o on tp, ZeRO-2's moments on fsdp
    mu = s8.opt_state[1][0].mu["layers"]
    assert "tp" in str(mu["wq_lora_b"].sharding.spec) and "tp" in str(mu["wo_lora_a"].sharding.spec)
    assert all("fsdp" in str(a.sharding.spec) for a in jax.tree.leaves(mu))


def test_lora_zero3_bf16_runs_like_one_device():
    """ZeRO-3 shards the frozen base over fsdp as it shards params; bf16, 2 steps: loss to rtol 1e-3."""
    _, m1, _ = run_steps(_lora({"data_parallel_size": 1}, "q,v", "bf16"), jax.devices()[:1], steps=2)
    s8, m8, _ = run_steps(_lora({"zero_stage": 3}, "q,v", "bf16"), steps=2)
    assert "fsdp" in str(s8.frozen["layers"]["wq"].sharding.spec)
    np.testing.assert_allclose([m["loss"] for m in m8], [m["loss"] for m in m1], rtol=1e-3)


def test_lora_resume_is_bit_exact(tmp_path):
    full, resumed, losses = resumed_and_uninterrupted(tmp_path, ["model.lora.rank=4", "model.lora.targets=q,k,v,o,down"])
    assert losses[0] == losses[1] and len(losses[0]) == 6
    for part in ("params", "opt_state", "frozen"):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(getattr(full["state"], part)),
                     jax.device_get(getattr(resumed["state"], part)))
    assert os.path.isfile(tmp_path / "a" / "run" / "adapter" / "adapter_model.safetensors")


# ----------------------------------------------------------------------------- Hugging Face PEFT


def _hf_llama(path, vocab=100):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager"))
    with torch.no_grad():  # HF's init gives near-zero logits: perturb so a wrong mapping shows
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(path))
    return model.eval()


def test_peft_loads_our_adapters_with_the_same_logits(tmp_path):
    """Adapters with random A and B on every projection, saved in PEFT's format: ``peft`` loads them
    onto the ``transformers`` model and its logits equal ours to 1e-4; read back, they are bit-exact;
    the merged weights through ``transformers`` give the same logits as well."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    base_model = _hf_llama(tmp_path / "hf")
    cfg, base = load_hf(tmp_path / "hf")
    cfg.lora = LoraConfig(rank=4, alpha=8.0, targets="all")
    table = adapter_shapes_and_axes(cfg.lora, llama.param_shapes_and_axes(cfg, cfg.vocab_size)["layers"])
    keys = iter(jax.random.split(jax.random.key(1), 64))
    adapters = {"layers": {n: 0.1 * np.asarray(jax.random.normal(next(keys), sa[0])) for n, sa in table["layers"].items()}}
    save_adapters(tmp_path / "adapter", cfg, adapters)
    back = load_adapters(tmp_path / "adapter", dataclasses.replace(cfg, lora=read_adapter_config(tmp_path / "adapter")))
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(lambda a: a.astype(np.float32), adapters))

    tokens = np.random.default_rng(0).integers(0, 100, (2, 16))
    ours = np.asarray(llama.forward(merge(jax.tree.map(jnp.asarray, base), jax.tree.map(jnp.asarray, adapters)),
                                    jnp.asarray(tokens), cfg))[..., :100]
    model = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert np.abs(ours - np.asarray(llama.forward(jax.tree.map(jnp.asarray, base), jnp.asarray(tokens), cfg))[..., :100]).max() > 1e-2

    save_hf(tmp_path / "merged", cfg, merged_weights(merge(base, adapters), cfg.lora))
    import transformers  # optional: transformers (the test extra)
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="eager").eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.tensor(tokens)).logits.numpy(), theirs, atol=1e-4, rtol=0)
    assert read_adapter_config(tmp_path / "adapter").target_list == ("q", "k", "v", "o", "gate", "up", "down")


def test_chat_sft_with_lora_from_hugging_face(tmp_path):
    """``model.init_from=HF_DIR model.lora.rank=8`` on chat lines: the response loss falls; the run
    writes PEFT adapters that ``peft`` loads; ``convert_hf.py --to-hf`` exports the same adapters from
    the checkpoint and ``--merge-lora`` a full model with equal logits; a second run continues from
    the adapters (``model.lora.init_from``) at the first run's validation loss."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers  # optional: transformers (the test extra)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import convert_hf  # heavy: from scripts/, put on sys.path by this test only
    import train_tokenizer  # heavy: from scripts/, put on sys.path by this test only
    from test_chat_sft import _write_chat  # heavy: another test module and its imports, for this test only

    corpus = _write_chat(tmp_path / "chat.jsonl", n=96)
    hf = tmp_path / "hf"
    vocab = train_tokenizer.train(str(corpus), 300, str(hf), chat_template=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(str(hf))
    assert convert_hf.main(["--to-jax", str(hf), str(tmp_path / "out")]) == 0
    common = [f"model.init_from={hf}", f"data.tokenizer={hf}", "data.format=chat", f"data.corpus={corpus}",
              "data.val_fraction=0.1", "training.seq_len=48", "training.batch_size=16", "training.warmup_steps=3",
              "training.learning_rate=1e-2", "training.eval_every=0", "training.eval_batches=2", "training.sample_tokens=0",
              "logging.log_every=1", "logging.progress_bar=false", "model.lora.rank=8", "model.lora.targets=all"]
    out = train(load_config(str(tmp_path / "out" / "model.yaml"), common + [
        "training.max_steps=30", f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt"]))
    assert out["val_loss_end"] < out["val_loss_start"] - 0.5, (out["val_loss_start"], out["val_loss_end"])

    tokens = torch.tensor(np.random.default_rng(0).integers(0, vocab, (2, 16)))
    base = transformers.LlamaForCausalLM.from_pretrained(str(hf), attn_implementation="eager").eval()
    with torch.no_grad():
        tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "run" / "adapter")).eval()(tokens).logits.numpy()
    assert convert_hf.main(["--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "peft")]) == 0
    assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert convert_hf.main(["--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="eager").eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(tokens).logits.numpy(), tuned, atol=1e-4, rtol=0)

    again = train(load_config(str(tmp_path / "out" / "model.yaml"), common + [
        "training.max_steps=1", f"model.lora.init_from={tmp_path}/run/adapter", f"logging.run_dir={tmp_path}/run2"]))
    assert again["val_loss_start"] == pytest.approx(out["val_loss_end"], rel=1e-5)


def test_lora_dropout_is_a_function_of_the_seed_and_step():
    """``model.lora.dropout``: a training step drops the adapters' inputs (the first step's gradient
    differs from the run without dropout), the same on one device and on ZeRO-2 dp4 × tp2 up to the
    split of the keys over the data shards; the evaluation runs without it (the loss of step 1,
    taken before any update, equals the dropout-free one since B starts at zero)."""
    def cfg(par, p):
        return tiny_config(par, model={"lora": {"rank": 8, "targets": "q,v,down", "dropout": p}})
    _, plain, _ = run_steps(cfg({"data_parallel_size": 1}, 0.0), jax.devices()[:1], steps=2)
    a, drop, _ = run_steps(cfg({"data_parallel_size": 1}, 0.3), jax.devices()[:1], steps=2)
    b, again, _ = run_steps(cfg({"data_parallel_size": 1}, 0.3), jax.devices()[:1], steps=2)
    assert drop[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)  # B = 0: dropout cannot change the loss yet
    assert abs(drop[0]["grad_norm"] - plain[0]["grad_norm"]) > 1e-4 * plain[0]["grad_norm"]
    assert drop == again  # a pure function of training.seed and the step
    _, sharded, _ = run_steps(cfg({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2}, 0.3), steps=2)
    assert all(np.isfinite(m["loss"]) for m in sharded)
    with pytest.raises(ConfigError, match="model.lora.dropout=0.1: ZeRO-3's prefetching layer scan"):
        load_config(TINY, ["model.lora.rank=8", "model.lora.dropout=0.1", "parallel.zero_stage=3", "model.remat=full"])


def test_dry_run_counts_the_frozen_base_and_the_adapters_state():
    """``--dry-run`` of a LoRA config: the per-device params (frozen base + adapters), gradients and
    optimizer state equal those measured from the arrays of the built state."""
    cfg = load_config(TINY, ["model.lora.rank=8", "model.lora.targets=q,v,up"])
    text = dry_run(cfg, num_devices=8)
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()))
    _, report = memory_report(plan, init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(0)))
    got = report["measured"]
    assert f"per-device model state: params {gib(got['params'] + got['frozen'])}, grads {gib(got['grads'])}, " in text
    predicted = float(text.split("optimizer ")[1].split(" KiB")[0]) * 1024
    assert predicted == pytest.approx(got["optimizer"], rel=1e-3)  # the arrays add Adam's step counters
    assert "LoRA       rank 8 on q, v, up" in text


@pytest.mark.parametrize("parallel", [
    {"data_parallel_size": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1},
    {"data_parallel_size": 2, "pipeline_parallel_size": 4, "zero_stage": 3, "pipeline_schedule": "gpipe"},
    {"data_parallel_size": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3,
     "pipeline_schedule": "interleaved", "num_model_chunks": 2, "num_microbatches": 4},
], ids=["1f1b_tp2_zero1", "gpipe_pp4_zero3", "interleaved_tp2_zero3"])
def test_lora_in_a_pipeline_equals_one_device(parallel):
    """The frozen base staged as the params are, the adapters trained through every schedule: fp32,
    4 layers, 3 steps, loss and grad norm to rtol 1e-5; the adapters: 99% of the elements to 1e-6,
    all within 0.1·lr. (A's gradient is exactly zero at step 1, since B starts at zero, and stays
    tiny for a few elements after it: Adam's ``m/√v`` turns the pipeline's other fp32 summation order
    of such an element into up to ~6% of lr; the dense tolerance of ``assert_params_match`` is 2%.)"""
    model = {"lora": {"rank": 8, "targets": "all"}, "num_layers": 4}
    s1, m1, _ = run_steps(tiny_config({"data_parallel_size": 1}, model=model), jax.devices()[:1], steps=3)
    s8, m8, _ = run_steps(tiny_config(parallel, model=model), steps=3)
    np.testing.assert_allclose([m["loss"] for m in m8], [m["loss"] for m in m1], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in m8], [m["grad_norm"] for m in m1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(s8.params)), jax.tree.leaves(jax.device_get(s1.params))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert (np.abs(a - b) > 1e-6 + 1e-5 * np.abs(b)).mean() <= 1e-2
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_lora_on_a_mixture_with_dense_first_layers_adapts_both_stacks():
    """A LLaMA-family mixture of experts whose first layer is dense (``dense_layers``): ``all`` is the attention
    of both stacks; random adapters give the logits of their merged weights, and those of the dense stack
    count (without them the logits differ); a training forward with dropout draws keys for both stacks."""
    cfg = tiny_config(model={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                             "first_k_dense": 1, "lora": {"rank": 4, "targets": "all", "dropout": 0.1}}).model
    assert cfg.lora_targets == ("q", "k", "v", "o")
    table = adapter_shapes_and_axes(cfg.lora, llama.param_shapes_and_axes(cfg, cfg.vocab_size), cfg.lora_targets)
    assert sorted(table) == ["dense_layers", "layers"] and table["dense_layers"]["wq_lora_a"][0][0] == 1
    keys = iter(jax.random.split(jax.random.key(1), 64))
    adapters = {g: {n: 0.1 * jax.random.normal(next(keys), sa[0]) for n, sa in t.items()} for g, t in table.items()}
    base, x = llama.init_params(cfg, jax.random.key(0)), jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)))
    adapted = llama.forward(merge(base, adapters), x, cfg)
    np.testing.assert_allclose(llama.forward(merged_weights(merge(base, adapters), cfg.lora), x, cfg), adapted,
                               atol=1e-5 * float(jnp.abs(adapted).max()), rtol=0)
    without_dense = llama.forward(merge(base, {"layers": adapters["layers"]}), x, cfg)
    assert float(jnp.abs(without_dense - adapted).max()) > 1e-3 * float(jnp.abs(adapted).max())
    keyed = with_dropout_keys(merge(base, adapters), cfg.lora, jax.random.key(2))
    assert [keyed[g][DROPOUT_KEY].shape for g in ("dense_layers", "layers")] == [(1,), (1,)]
    dropped = llama.hidden_states(merge(base, adapters), x, cfg, dropout_key=jax.random.key(2))
    assert dropped.shape == (2, 16, cfg.hidden_size) and bool(jnp.isfinite(dropped).all())


@pytest.mark.parametrize("targets", ["all", "q,v"])
def test_lora_flops_are_4n_plus_6n_adapters(targets):
    """The compiled step's matmul FLOPs (:func:`jaxcolossal.aot.hlo.dot_flops`) drop from full training's
    by exactly what :func:`jaxcolossal.metrics.flops_per_token` says: the frozen weights lose their
    weight-gradient matmuls (6N -> 4N), the adapters add 6 FLOPs per parameter and token."""
    def compiled_and_formula(model):
        cfg = tiny_config({"data_parallel_size": 1}, model=model)
        plan, _, state, step = setup(cfg, jax.devices()[:1])
        x = random_batches(cfg, 1)[0]
        batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                 "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        tokens = cfg.training.batch_size * cfg.training.seq_len
        return (hlo.dot_flops(step.lower(state, batch).compile().as_text())["flops"],
                flops_per_token(cfg.model, cfg.training.seq_len)["6N+attn"] * tokens)
    full, lora = compiled_and_formula({}), compiled_and_formula({"lora": {"rank": 8, "targets": targets}})
    assert lora[0] - full[0] == lora[1] - full[1]


def test_exported_weights_are_readable_like_any_file_written(tmp_path):
    """safetensors writes through a 0600 temporary file; the exports get the process's usual mode."""
    save_shared({"w": np.zeros((2, 2), np.float32)}, tmp_path / "w.safetensors")
    (tmp_path / "plain.txt").write_text("x")
    assert os.stat(tmp_path / "w.safetensors").st_mode & 0o777 == os.stat(tmp_path / "plain.txt").st_mode & 0o777
