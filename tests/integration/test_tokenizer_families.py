"""Token ids equal transformers' tokenizer for the families that ship one (LLaMA 3.1/3.2, Qwen2.5,
Qwen3, Mistral, Gemma 2/3, Phi-3, Phi-4-mini, OLMo-2, DeepSeek-V3, GPT-OSS): small folders shaped like
the real ones (tests/tokenizer_families.py; the real chat templates where trl ships them). A prompt's
ids (``encode_prompt``) equal ``AutoTokenizer(folder)(text).input_ids`` (the BOS the post-processor
adds included); a conversation rendered with the folder's chat template, and its ids, equal
``apply_chat_template``'s, with and without the generation prompt; GRPO's prompt rows are tokenized as
TRL's ``GRPOTrainer`` tokenizes them; corpus documents still get no special token."""

import json
import os

import numpy as np
import pytest
import tokenizer_families  # tests/: the tokenizer folders of the families

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")

from jaxcolossal.data import get_tokenizer  # noqa: E402
from jaxcolossal.data.chat import generation_prompt, render_chat  # noqa: E402
from jaxcolossal.data.prompts import load_prompts  # noqa: E402
from jaxcolossal.errors import DataError  # noqa: E402

FAMILIES = sorted(tokenizer_families.FAMILIES)
TEXTS = ["Hello world", "  What is 12 + 30?\nThe answer: 42.", "Café naïve ß æ 中文 😀", "x",
         "It's <|im_start|>user and [INST] inside"]
CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "user", "content": "Hello there"}],
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hello! How are you?"},
     {"role": "user", "content": "fine, thank you"}],
    [{"role": "user", "content": "What is 7 * 6?"}, {"role": "assistant", "content": "The answer is 42."}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: (str(root / name), tokenizer_families.build(name, root / name)) for name in FAMILIES}


def _ids(x):
    """transformers 5's ``apply_chat_template(tokenize=True)`` returns a BatchEncoding; 4.x a list."""
    return list(x["input_ids"] if hasattr(x, "keys") else x)


@pytest.mark.parametrize("name", FAMILIES)
def test_prompt_ids_equal_transformers(folders, name):
    folder, _ = folders[name]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    tok = get_tokenizer(folder)
    bos = tokenizer_families.FAMILIES[name].bos
    for text in TEXTS:
        ids = tok.encode_prompt(text).tolist()
        assert ids == hf(text).input_ids, text
        plain = tok.encode(text).tolist()  # corpus documents: no special token, as before
        assert ids == ([hf.convert_tokens_to_ids(bos)] + plain if bos else plain), text
        assert tok.decode(plain) == text or name in ("mistral", "phi3")  # SentencePiece may drop the lead spaces


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_rendering_and_ids_equal_apply_chat_template(folders, name):
    folder, info = folders[name]
    assert info["template"]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    tok = get_tokenizer(folder)
    rendered = 0
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            try:
                want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            except Exception as e:  # the template refuses it (Gemma: no system role): ours refuses it too
                with pytest.raises(DataError, match=str(e)):
                    render_chat(msgs, tok, gen)
                continue
            text = render_chat(msgs, tok, gen)
            assert text == want
            assert tok.encode(text).tolist() == _ids(hf.apply_chat_template(msgs, tokenize=True,
                                                                            add_generation_prompt=gen))
            if gen:
                assert generation_prompt(msgs, tok) == want
            rendered += 1
    assert rendered >= 6


class _Data:
    skip_long_examples = False

    def __init__(self, corpus):
        self.corpus = corpus


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3", "mistral", "gpt_oss"])
def test_grpo_prompts_are_tokenized_as_trl_does(folders, tmp_path, name):
    """TRL 1.16's ``GRPOTrainer``: a string prompt is ``processing_class(text=prompt)`` (special tokens
    added: LLaMA 3's BOS), chat messages are ``apply_chat_template(..., add_generation_prompt=True,
    tokenize=True)``."""
    folder, _ = folders[name]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "What is 12 + 30?", "answer": 42}) + "\n"
                                      + json.dumps({"prompt": chat}) + "\n")
    data = load_prompts(_Data(str(tmp_path / "p.jsonl")), get_tokenizer(folder), max_tokens=2000)
    assert data.tokens[0] == hf("What is 12 + 30?").input_ids
    assert data.tokens[1] == _ids(hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True))
    assert data.texts[1] == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_chat_template_file_wins_and_legacy_special_tokens_map(folders, tmp_path):
    """``chat_template.jinja`` beside the tokenizer wins over ``tokenizer_config.json``'s (as transformers
    reads them); a config without ``added_tokens_decoder`` takes the special tokens' texts from a
    legacy ``special_tokens_map.json``."""
    folder, _ = folders["llama3"]
    for f in ("tokenizer.json", "config.json"):
        with open(os.path.join(folder, f), encoding="utf-8") as src:
            (tmp_path / f).write_text(src.read(), encoding="utf-8")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eot_id|>",
           "chat_template": "CONFIG {{ messages[0]['content'] }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<|begin_of_text|>", "lstrip": False}, "eos_token": "<|end_of_text|>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}FILE {{ messages[0]['content'] }}{{ eos_token }}")
    msgs = [{"role": "user", "content": "hi"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    want = hf.apply_chat_template(msgs, tokenize=False)
    assert want == "<|begin_of_text|>FILE hi<|end_of_text|>"
    assert render_chat(msgs, get_tokenizer(str(tmp_path))) == want


@pytest.mark.parametrize("flags", [{"add_bos_token": True}, {"add_bos_token": True, "add_eos_token": True}, {}],
                         ids=["bos", "bos+eos", "none"])
def test_sentencepiece_prompt_ids_equal_transformers(tmp_path, flags):
    """A ``tokenizer.model`` alone (LLaMA-1/2's form): transformers converts it and adds BOS/EOS as
    ``tokenizer_config.json``'s ``add_bos_token``/``add_eos_token`` say (default: neither); so do we."""
    (tmp_path / "train.txt").write_text("\n".join(f"def function_{i}(x):\n    return x * {i}" for i in range(300)))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "train.txt"),
                                             model_prefix=str(tmp_path / "tokenizer"), vocab_size=150, model_type="bpe",
                                             eos_id=2, bos_id=1, unk_id=0, minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **flags}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = get_tokenizer(str(tmp_path))
    for text in ("def function_3(x):", "return x"):
        assert tok.encode_prompt(text).tolist() == hf(text).input_ids
        assert (tok.encode_prompt(text)[0] == 1) == bool(flags) and tok.encode(text)[0] != 1


def test_byte_tokenizer_prompt_is_its_bytes():
    tok = get_tokenizer("byte")
    np.testing.assert_array_equal(tok.encode_prompt("hi"), tok.encode("hi"))
