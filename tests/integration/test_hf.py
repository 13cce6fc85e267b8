"""Hugging Face interoperability: tiny random LLaMA / GPT-2 built with ``transformers``, imported
with ``load_hf`` and exported with ``save_hf``; logits must match transformers' (fp32, eager
attention) within 1e-4, and transformers must load the exports with no missing or unexpected keys.
Also: GPT-2 trains under ZeRO-3 + TP on 8 simulated devices like on one device, and
``model.init_from`` starts the main job from HF weights. ``scripts/convert_hf.py`` carries the
special-token ids (``config.json``, ``generation_config.json``) and the tokenizer files, so that
``generate()`` on an export stops at the end-of-text token."""

import dataclasses
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from jaxcolossal.checkpoint import CheckpointManager  # noqa: E402
from jaxcolossal.config import ConfigError, ModelConfig, config_from_dict, load_config  # noqa: E402
from jaxcolossal.data import eval_batches, get_tokenizer, load_splits  # noqa: E402
from jaxcolossal.models import get_family, gpt2  # noqa: E402
from jaxcolossal.models.hf_io import config_from_hf, init_params_from, load_hf, read_special_tokens, save_hf  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.train.loop import train  # noqa: E402
from jaxcolossal.train.optimizer import build_optimizer  # noqa: E402
from jaxcolossal.train.state import init_state, make_plan  # noqa: E402
from jaxcolossal.train.step import make_train_step  # noqa: E402

TOL = 1e-4
VOCAB = 100  # not a multiple of 64: exercises the padding
SCRIPTS = pathlib.Path(__file__).parents[2] / "scripts"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conv = _script("convert_hf")
train_tokenizer = _script("train_tokenizer")


def _randomize(model, seed=0):
    """HF's init gives near-zero logits; perturb every parameter (norm scales around 1) so that a
    wrong mapping of any of them shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            n = torch.randn(p.shape, generator=g)
            if "norm" in name or ".ln_" in name:
                p.copy_(n * 0.1 + 1.0 if name.endswith("weight") else n * 0.1)
            else:
                p.copy_(n * (0.1 if p.ndim == 1 else 0.2))
    return model.eval()


def hf_llama(tie: bool, vocab: int = VOCAB, **ids):
    """``ids``: special-token ids (default bos 0, eos 1, no pad)."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=tie, attn_implementation="eager", **{"bos_token_id": 0, "eos_token_id": 1, **ids})
    return _randomize(transformers.LlamaForCausalLM(cfg))


def hf_gpt2(tie: bool = True, vocab: int = VOCAB, layers: int = 2):
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=32, tie_word_embeddings=tie,
        bos_token_id=0, eos_token_id=1, attn_implementation="eager")
    return _randomize(transformers.GPT2LMHeadModel(cfg), seed=1)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def jax_logits(cfg, params, tokens):
    return np.asarray(get_family(cfg).forward(params, jnp.asarray(tokens), cfg))


def tokens_for(vocab=VOCAB, b=2, t=16, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


def reload(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, attn_implementation="eager")
    return model.eval(), info


def assert_clean(info):
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])


def maxdiff(a, b):
    d = float(np.max(np.abs(a - b)))
    print(f"max |logit diff| = {d:.2e}")
    return d


CASES = {
    "llama-gqa-untied": lambda: hf_llama(tie=False),
    "llama-gqa-tied": lambda: hf_llama(tie=True),
    "gpt2-tied": lambda: hf_gpt2(tie=True),
    "gpt2-untied": lambda: hf_gpt2(tie=False),
}


@pytest.mark.parametrize("case,sharded", [(c, False) for c in CASES] + [("llama-gqa-untied", True),
                                                                         ("gpt2-tied", True)],
                         ids=[*CASES, "llama-gqa-untied-sharded", "gpt2-tied-sharded"])
def test_import_export_logits_match(case, sharded, tmp_path):
    model = CASES[case]()
    shard = "20KB" if sharded else "5GB"
    model.save_pretrained(tmp_path / "hf", max_shard_size=shard)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == sharded
    tokens = tokens_for()
    want = hf_logits(model, tokens)

    cfg, params = load_hf(tmp_path / "hf")
    assert cfg.type == case.split("-")[0] and cfg.vocab_size == VOCAB
    assert cfg.tie_word_embeddings == case.endswith("-tied") and ("lm_head" in params) != cfg.tie_word_embeddings
    assert maxdiff(jax_logits(cfg, params, tokens), want) < TOL

    files = save_hf(tmp_path / "out", cfg, params, max_shard_size=shard)
    assert (len(files) > 1) == sharded
    back, info = reload(tmp_path / "out")
    assert_clean(info)
    assert maxdiff(hf_logits(back, tokens), want) < TOL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_vocab_padding_removed_on_export(family, tmp_path):
    model = hf_llama(tie=False) if family == "llama" else hf_gpt2(tie=True)
    model.save_pretrained(tmp_path / "hf")
    tokens = tokens_for(seed=3)
    want = hf_logits(model, tokens)
    cfg, params = load_hf(tmp_path / "hf", tp=2, vocab_pad_multiple=64)
    emb = params["embed_tokens" if family == "llama" else "wte"]
    assert emb.shape[0] == 128 and not emb[VOCAB:].any()
    got = jax_logits(cfg, params, tokens)
    assert got.shape[-1] == 128 and np.all(got[..., VOCAB:] == -1e30)
    assert maxdiff(got[..., :VOCAB], want) < TOL

    save_hf(tmp_path / "out", cfg, params)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == VOCAB
    back, info = reload(tmp_path / "out")
    assert_clean(info)
    assert back.get_input_embeddings().weight.shape[0] == VOCAB
    assert maxdiff(hf_logits(back, tokens), want) < TOL


def test_convert_script_round_trip(tmp_path):
    model = hf_gpt2()
    model.save_pretrained(tmp_path / "hf")
    assert conv.main(["--to-jax", str(tmp_path / "hf"), str(tmp_path / "jax"), "--tp", "2",
                      "--vocab-pad-multiple", "64"]) == 0
    assert conv.main(["--to-hf", str(tmp_path / "jax"), str(tmp_path / "out")]) == 0
    back, info = reload(tmp_path / "out")
    assert_clean(info)
    tokens = tokens_for(seed=5)
    assert maxdiff(hf_logits(back, tokens), hf_logits(model, tokens)) < TOL


def test_to_jax_writes_fine_tuning_training_defaults(tmp_path):
    """Issue 45 item 1: ``--to-jax``'s model.yaml loads with ``load_config`` and carries full-SFT
    defaults, not the schema's byte-level pre-training ones: learning rate 2e-5, no weight decay, a
    warmup and cosine decay to 0, seq_len = min(max_position_embeddings, 2048); its comment names
    LoRA's rates. A model with a longer context gets 2048."""
    hf_llama(tie=False).save_pretrained(tmp_path / "hf")  # max_position_embeddings 64
    assert conv.main(["--to-jax", str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    t = load_config(str(tmp_path / "jax" / "model.yaml")).training
    assert (t.learning_rate, t.weight_decay, t.seq_len, t.min_learning_rate_ratio) == (2e-5, 0.0, 64, 0.0)
    assert 0 < t.warmup_steps <= 0.05 * t.max_steps
    text = (tmp_path / "jax" / "model.yaml").read_text()
    assert "LoRA" in text and "training.learning_rate=1e-4" in text
    long = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    assert conv.fine_tuning_training(config_from_hf(long.to_dict()))["seq_len"] == 2048


def test_bf16_checkpoint_reads_as_fp32(tmp_path):
    model = hf_llama(tie=False)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    _, params = load_hf(tmp_path / "hf")
    ref = model.model.embed_tokens.weight.detach().float().numpy()
    assert params["embed_tokens"].dtype == np.float32
    np.testing.assert_array_equal(params["embed_tokens"], ref)
    q0 = model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(params["layers"]["wq"][0], q0.T.reshape(32, 4, 8))


def test_config_errors(tmp_path):
    bad = ModelConfig(type="gpt2", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        gpt2.param_shapes_and_axes(bad, 256)
    with pytest.raises(ConfigError, match="rope_scaling.rope_type='proportional': supported types are"):
        config_from_hf({"model_type": "llama", "rope_scaling": {"type": "proportional", "factor": 2.0},
                        "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
                        "intermediate_size": 8, "vocab_size": 10})
    with pytest.raises(ConfigError, match="supported are"):
        config_from_hf({"model_type": "bert"})
    hf_gpt2().save_pretrained(tmp_path / "hf")
    assert init_params_from(ModelConfig()) is None
    mism = ModelConfig(type="gpt2", num_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=128, max_position_embeddings=32, vocab_size=VOCAB,
                       tie_word_embeddings=True, layer_norm_eps=1e-5, init_from=str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"model\.num_layers=3 \(the Hugging Face config has 2\)"):
        init_params_from(mism)


# ----------------------------------------------------------------------------- special tokens and tokenizer files

IDS = {"bos_token_id": 3, "eos_token_id": 5, "pad_token_id": 4}  # none of them LLaMA's defaults (1, 2)


def ids_of(path, name="config.json"):
    d = json.loads((pathlib.Path(path) / name).read_text())
    return {k: d.get(k) for k in IDS}


def eos_llama(eos=IDS["eos_token_id"]):
    """A LLaMA whose next token is ``eos`` after any prompt: every weight zero except the first
    embedding column (so the residual stream is e0 at every position), the final norm (1) and
    ``lm_head[eos, 0]``, which makes the eos logit about 57 and every other logit 0."""
    model = hf_llama(tie=False, **IDS)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[eos, 0] = 10.0
    return model


def generated(path):
    model, info = reload(path)
    assert_clean(info)
    prompt = torch.tensor([[3, 10, 11, 12]])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    return out[0].tolist()


def make_tokenizer(tmp_path, extra=("<s>", "<pad>")):
    """A byte-level BPE trained by scripts/train_tokenizer.py (eos ``</s>`` = 0) with ``extra``
    special tokens appended, named as bos (the ``{"content": ...}`` form) and pad (a string)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the answer to {i} plus {i} is {2 * i}.\n" for i in range(200)))
    out = tmp_path / "tok"
    train_tokenizer.train(str(corpus), 300, str(out), chat_template=True)
    if extra:
        tk = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")).backend_tokenizer
        tk.add_special_tokens(list(extra))
        tk.save(str(out / "tokenizer.json"))
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg.update(bos_token={"__type": "AddedToken", "content": extra[0], "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False, "special": True}, pad_token=extra[1])
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def test_special_token_ids_survive_to_jax_and_back(tmp_path):
    hf_llama(tie=False, **IDS).save_pretrained(tmp_path / "hf")
    assert conv.main(["--to-jax", str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    assert ids_of(tmp_path / "jax", "generation_config.json") == IDS  # copied for the way back
    assert conv.main(["--to-hf", str(tmp_path / "jax"), str(tmp_path / "out")]) == 0
    assert ids_of(tmp_path / "out") == IDS
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen == {"_from_model_config": True, **IDS}
    loaded = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (3, 5, 4)
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # ids only: there is no tokenizer to copy


def test_generation_stops_at_eos_only_with_the_ids(tmp_path, capsys):
    eos_llama().save_pretrained(tmp_path / "hf")
    assert conv.main(["--to-jax", str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    assert conv.main(["--to-hf", str(tmp_path / "jax"), str(tmp_path / "out")]) == 0
    with_ids = generated(tmp_path / "out")
    print("with ids:", with_ids)
    assert with_ids == [3, 10, 11, 12, 5]  # stopped at the first eos

    (tmp_path / "jax" / "generation_config.json").unlink()  # as a byte-tokenizer run: no ids anywhere
    assert conv.main(["--to-hf", str(tmp_path / "jax"), str(tmp_path / "none")]) == 0
    assert "will not stop by itself; pass --tokenizer DIR" in capsys.readouterr().out
    assert ids_of(tmp_path / "none") == dict.fromkeys(IDS)  # null, not transformers' LLaMA defaults
    assert not (tmp_path / "none" / "generation_config.json").exists()
    without = generated(tmp_path / "none")
    print("without ids:", without)
    assert without == [3, 10, 11, 12] + [5] * 20  # the same weights run on to max_new_tokens

    cfg, params = load_hf(tmp_path / "hf")
    save_hf(tmp_path / "none", cfg, params, special_tokens=IDS)  # an earlier export gets the ids
    assert generated(tmp_path / "none") == with_ids
    save_hf(tmp_path / "none", cfg, params)  # and loses them again: no stale generation_config.json
    assert not (tmp_path / "none" / "generation_config.json").exists()


def test_tokenizer_flag_copies_the_files_and_sets_its_ids(tmp_path, capsys):
    tok = make_tokenizer(tmp_path)
    t = get_tokenizer(str(tok))
    bos, pad = t.vocab_size - 2, t.vocab_size - 1
    hf_llama(tie=True, vocab=t.vocab_size).save_pretrained(tmp_path / "hf")  # its own ids: bos 0, eos 1
    assert conv.main(["--to-jax", str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    assert conv.main(["--to-hf", str(tmp_path / "jax"), str(tmp_path / "out"), "--tokenizer", str(tok)]) == 0
    assert f"copied tokenizer.json, tokenizer_config.json from {tok}" in capsys.readouterr().out
    want = {"bos_token_id": bos, "eos_token_id": 0, "pad_token_id": pad}  # the tokenizer wins over the HF config
    assert ids_of(tmp_path / "out") == want and ids_of(tmp_path / "out", "generation_config.json") == want
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (tok / f).read_bytes()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (hf_tok.eos_token_id, hf_tok.bos_token_id, hf_tok.pad_token_id) == (0, bos, pad)
    ids = hf_tok("the answer to 7", add_special_tokens=False)["input_ids"]
    assert list(ids) == t.encode("the answer to 7").tolist() and hf_tok.decode(ids) == "the answer to 7"
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).config.eos_token_id == 0


def test_checkpoint_export_finds_the_run_tokenizer_or_the_init_from_ids(tmp_path, capsys):
    tok = make_tokenizer(tmp_path, extra=())  # eos only: pad falls back to eos, bos stays unset
    vocab = get_tokenizer(str(tok)).vocab_size
    hf_llama(tie=True, vocab=vocab, **IDS).save_pretrained(tmp_path / "hf")
    cfg, params = load_hf(tmp_path / "hf", tp=2, vocab_pad_multiple=64)
    for name, data, init_from in [("run_tok", {"tokenizer": str(tok)}, ""),
                                  ("init", {"tokenizer": "byte"}, str(tmp_path / "hf"))]:
        ckpt = CheckpointManager(str(tmp_path / name), async_save=False, config={
            "model": {**dataclasses.asdict(cfg), "init_from": init_from}, "data": data})
        ckpt.save(1, {"params": jax.tree.map(jnp.asarray, params)})
        ckpt.close()
    assert conv.main(["--to-hf", str(tmp_path / "run_tok"), str(tmp_path / "a")]) == 0
    assert f"using the run's tokenizer {tok} (data.tokenizer)" in capsys.readouterr().out
    assert ids_of(tmp_path / "a") == {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0}
    assert (tmp_path / "a" / "tokenizer.json").exists()
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a")).eos_token == "</s>"
    assert conv.main(["--to-hf", str(tmp_path / "init"), str(tmp_path / "b")]) == 0
    assert f"special tokens from {tmp_path / 'hf'}" in capsys.readouterr().out
    assert ids_of(tmp_path / "b") == IDS == read_special_tokens(tmp_path / "b")
    assert not (tmp_path / "b" / "tokenizer.json").exists()


def test_special_token_outside_the_vocabulary_is_an_error(tmp_path, capsys):
    tok = make_tokenizer(tmp_path)  # about 300 tokens; its bos and pad lie beyond the model's 100
    hf_llama(tie=False).save_pretrained(tmp_path / "hf")
    assert conv.main(["--to-jax", str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    capsys.readouterr()
    assert conv.main(["--to-hf", str(tmp_path / "jax"), str(tmp_path / "out"), "--tokenizer", str(tok)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: bos_token_id=") and "model.vocab_size=100" in err, err
    assert not (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out" / "tokenizer.json").exists()
    cfg, params = load_hf(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"eos_token_id=100 lies outside the model's vocabulary"):
        save_hf(tmp_path / "x", cfg, params, special_tokens={"eos_token_id": 100})
    with pytest.raises(ConfigError, match="special token 'eos_id'"):
        save_hf(tmp_path / "x", cfg, params, special_tokens={"eos_id": 1})
    assert conv.main(["--to-hf", str(tmp_path / "jax"), str(tmp_path / "out"), "--tokenizer",
                      str(tmp_path / "nowhere")]) == 2
    assert "no tokenizer.json or tokenizer.model there" in capsys.readouterr().err


# ----------------------------------------------------------------------------- ZeRO and training

GPT2_MODEL = dict(type="gpt2", num_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=32, vocab_size=256, tie_word_embeddings=True)


def _cfg(model, parallel, **training):
    t = dict(batch_size=8, seq_len=16, learning_rate=3e-3, warmup_steps=1, max_steps=3, **training)
    return config_from_dict({"model": model, "training": t, "parallel": parallel})


def test_gpt2_biases_sharded_by_zero3_over_8_devices():
    """Biases with no ``embed`` dim fall back to the first unsharded divisible dim (here ``layers``)."""
    cfg = _cfg({**GPT2_MODEL, "num_layers": 8}, {"data_parallel_size": 8, "zero_stage": 3})
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    specs = plan.specs.params
    for name, spec in list(specs.items()) + list(specs["layers"].items()):
        if name != "layers":
            assert "fsdp" in tuple(spec), (name, spec)
    assert tuple(specs["layers"]["bq"]) == ("fsdp", "tp", None)
    assert tuple(specs["layers"]["b_fc"]) == ("fsdp", "tp")


def test_gpt2_zero3_fc_bias_when_layers_not_divisible():
    """b_fc [L=2, f]: no free dim divides 8, so ZeRO splits the tp-mapped mlp dim over (tp, fsdp)."""
    cfg = _cfg({**GPT2_MODEL, "num_layers": 2}, {"data_parallel_size": 8, "zero_stage": 3})
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    assert tuple(plan.specs.params["layers"]["b_fc"]) == (None, ("tp", "fsdp"))


def test_gpt2_trains_zero3_tp_matches_single_device(tmp_path):
    hf_gpt2(vocab=256, layers=4).save_pretrained(tmp_path / "hf")
    _, params0 = load_hf(tmp_path / "hf", tp=2)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (8, 17)).astype(np.int32) for _ in range(3)]

    def run(parallel, devices):
        cfg = _cfg(GPT2_MODEL, parallel)
        plan = make_plan(cfg, make_mesh(cfg.parallel, devices))
        tx = build_optimizer(cfg.training)
        state = init_state(plan, tx, params=params0)
        step = make_train_step(plan, tx)
        losses = []
        for b in batches:
            batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in (("inputs", b[:, :-1]), ("targets", b[:, 1:]))}
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        return np.array(losses)

    one = run({"data_parallel_size": 1}, jax.devices()[:1])
    many = run({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 3}, jax.devices())
    print("losses single", one, "zero3 x tp2", many)
    assert one[-1] < one[0]
    np.testing.assert_allclose(many, one, rtol=1e-5)


def test_init_from_starts_main_job_from_hf_weights(tmp_path):
    hf = hf_gpt2(vocab=256, layers=4)
    hf.save_pretrained(tmp_path / "hf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    model = {**GPT2_MODEL, "init_from": str(tmp_path / "hf")}
    cfg = config_from_dict({
        "model": model,
        "training": dict(batch_size=8, seq_len=16, max_steps=1, learning_rate=1e-9, eval_every=0, eval_batches=2,
                         sample_tokens=0),
        "parallel": {"data_parallel_size": -1, "tensor_parallel_size": 2, "zero_stage": 1},
        "data": {"corpus": str(corpus)},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    })
    out = train(cfg)
    # the first validation loss is transformers' loss on the same batches
    _, val = load_splits(cfg.data)
    hf_losses = []
    for x, y in eval_batches(val, 8, 16, 2):
        logits = torch.from_numpy(hf_logits(hf, x))
        hf_losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256),
                                                                torch.from_numpy(y).long().reshape(-1))))
    print(f"val loss at start {out['val_loss_start']:.6f}, transformers {np.mean(hf_losses):.6f}")
    assert abs(out["val_loss_start"] - np.mean(hf_losses)) < TOL
    # the one step ran at lr 1e-9 (Adam moves each weight by about lr), so the state still holds the imported weights
    _, imported = load_hf(tmp_path / "hf")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, atol=1e-6), out["state"].params,
                 imported)
