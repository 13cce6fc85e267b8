"""Greedy parity with Hugging Face transformers: a tiny random LLaMA, a tiny Mixtral and a GPT-2 saved by
transformers, loaded with ``load_hf``; our KV-cached sampler's greedy tokens equal
``generate(do_sample=False)``'s token for token (fp32, eager attention), for a batch of prompts of
different lengths, left-padded on the HF side with an ``attention_mask`` and a ``pad_token_id``,
stopping per row at eos; and a LLaMA-3-style folder (its tokenizer's BOS, an eos list) from text."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_tiny  # noqa: E402  (tests/integration: the tiny transformers models; after torch's importorskip)
from jaxcolossal.data import get_tokenizer  # noqa: E402
from jaxcolossal.generate import generate, pad_prompts  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf, read_special_tokens  # noqa: E402

VOCAB = 100
PAD = 0
PROMPTS = [[5, 9, 13, 2, 7, 30, 41, 17, 3], [3, 8], [60, 61, 62, 63, 64], [22]]
NEW = 12


def _randomize(model):
    """HF's init gives near-flat logits (ties); perturb every parameter, norm scales around 1."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            n = torch.randn(p.shape, generator=g)
            p.copy_(n * 0.1 + 1.0 if "norm" in name else n * (0.1 if p.ndim == 1 else 0.2))
    return model.eval()


def _hf_greedy(model, prompts, eos):
    tokens, mask = pad_prompts(prompts, PAD)
    with torch.no_grad():
        out = model.generate(torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
                             do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos)
    # a row ends at its eos (pads after it); one without eos runs to the end of the batch's output
    return [row[: row.index(eos) + 1] if eos in row else row for row in out[:, tokens.shape[1]:].tolist()]


def _check(tmp_path, model):
    model.save_pretrained(str(tmp_path / "hf"))
    cfg, params = load_hf(tmp_path / "hf")
    eos = 1
    for _ in range(2):  # the second time with an eos that the rows meet at different steps
        want = _hf_greedy(model, PROMPTS, eos)
        got = generate(get_family(cfg), cfg, params, PROMPTS, NEW, eos_id=eos, pad_id=PAD).rows()
        assert got == want, f"eos {eos}"
        longest = max(want, key=len)
        eos = longest[len(longest) // 2]
    assert len({len(r) for r in want}) > 1  # rows stopped at different steps


def test_llama_greedy_equals_transformers_generate(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0,
        tie_word_embeddings=False, attn_implementation="eager", bos_token_id=2, eos_token_id=1,
        pad_token_id=PAD)
    _check(tmp_path, _randomize(transformers.LlamaForCausalLM(cfg)))


def test_mixtral_greedy_equals_transformers_generate(tmp_path):
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        attn_implementation="eager", bos_token_id=2, eos_token_id=1, pad_token_id=PAD)
    _check(tmp_path, _randomize(transformers.MixtralForCausalLM(cfg)))


def test_gpt2_greedy_equals_transformers_generate(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  attn_implementation="eager", bos_token_id=2, eos_token_id=1, pad_token_id=PAD)
    _check(tmp_path, _randomize(transformers.GPT2LMHeadModel(cfg)))


def test_llama3_folder_with_an_eos_list_equals_transformers_generate(tmp_path):
    """A tiny LLaMA saved by transformers with a LLaMA-3-style tokenizer (BOS by its post-processor) and a
    ``generation_config.json`` eos LIST (the three real end tokens and two that greedy decoding meets
    mid-way in some rows): prompts tokenized by ``encode_prompt`` are transformers' ids (BOS first), and
    the batched greedy tokens equal ``model.generate(**tok(prompts, padding=True, padding_side="left"),
    do_sample=False)``'s, each row ending at the first id of the list."""
    path = str(tmp_path / "llama3")
    eos = hf_tiny.llama3_folder(path, NEW)
    want_ids, want = hf_tiny.hf_greedy_rows(path, hf_tiny.LLAMA3_PROMPTS, NEW)
    assert read_special_tokens(path)["eos_token_id"] == eos and len(eos) == 5
    tok = get_tokenizer(path)
    ids = [tok.encode_prompt(p).tolist() for p in hf_tiny.LLAMA3_PROMPTS]
    assert ids == want_ids and all(i[0] == tok._tok.token_to_id("<|begin_of_text|>") for i in ids)
    cfg, params = load_hf(path)
    got = generate(get_family(cfg), cfg, params, ids, NEW, eos_id=eos).rows()
    assert got == want
    lengths = sorted(len(r) for r in got)
    assert lengths[0] < NEW - 1 and lengths[-1] == NEW and len(set(lengths)) >= 3  # rows end at different steps
