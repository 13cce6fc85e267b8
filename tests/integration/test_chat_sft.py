"""Instruction fine-tuning (``data.format=chat``): conversations rendered with a loss mask on the
responses only (plain template and a tokenizer's Jinja chat template), errors that name the file
and line, and the main job fine-tuning on a chat file."""

import json
import logging
import os
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.data import ExampleLoader, get_tokenizer
from jaxcolossal.data.chat import chat_batches, generation_prompt, load_chat
from jaxcolossal.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _write_chat(path, n=64):
    with open(path, "w") as f:
        for i in range(n):
            if i % 2:
                rec = {"prompt": f"add {i} and {i}", "response": f"{2 * i}"}
            else:
                rec = {"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": f"double {i}"},
                                    {"role": "assistant", "content": f"{2 * i}"}]}
            f.write(json.dumps(rec) + "\n")
    return path


class _Data:
    def __init__(self, corpus, skip_long_examples=False):
        self.corpus = str(corpus)
        self.skip_long_examples = skip_long_examples


def _trained_text(tok, chat, row):
    ex, m = chat.examples[row], chat.masks[row]
    return tok.decode(ex[1:][m > 0])


def test_plain_template_masks_the_responses_only(tmp_path):
    tok = get_tokenizer("byte")
    chat = load_chat(_Data(_write_chat(tmp_path / "c.jsonl")), tok, seq_len=48)
    assert chat.examples.shape == (64, 49) and chat.masks.shape == (64, 48) and chat.truncated == 0
    assert _trained_text(tok, chat, 0) == "0\n" and _trained_text(tok, chat, 3) == "6\n"
    prompt = tok.decode(chat.examples[3][: int(np.argmax(chat.masks[3])) + 1])
    assert prompt == "user: add 3 and 3\nassistant: "


def test_chat_template_of_the_tokenizer(tmp_path):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["double 12 is 24"] * 10, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": TEMPLATE}))
    tok = get_tokenizer(str(tmp_path))
    chat = load_chat(_Data(_write_chat(tmp_path / "c.jsonl")), tok, seq_len=64)
    assert _trained_text(tok, chat, 6) == "12</s>"  # the response and the eos that ends it
    first = int(np.argmax(chat.masks[6]))
    assert tok.decode(chat.examples[6][: first + 1]) == "<|system|>be brief<|user|>double 6<|assistant|>"
    assert np.all(chat.examples[6][len(tok.encode("<|system|>be brief<|user|>double 6<|assistant|>12</s>")):] == 0)


@pytest.mark.parametrize("line,match", [
    ("{not json", r"c.jsonl:2: invalid JSON line"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), r"c.jsonl:2: the conversation has no assistant"),
    (json.dumps({"messages": [{"role": "bot", "content": "hi"}]}), r"c.jsonl:2: messages\[0\] must be"),
    (json.dumps({"text": "hi"}), r"c.jsonl:2: expected \{'messages'"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, match):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_chat(_Data(p), get_tokenizer("byte"), seq_len=32)


def test_prompt_longer_than_the_window_is_an_error(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"prompt": "x" * 100, "response": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: no response token is left within training.seq_len=16"
                                          r".*set data.skip_long_examples=true to drop such conversations"):
        load_chat(_Data(p), get_tokenizer("byte"), seq_len=16)


def _with_long_rows(path, long_lines=(3, 7, 8)):
    """The conversations of :func:`_write_chat` with over-long ones inserted at the given 1-based
    lines (a prompt of 100 bytes, so no response fits 48 tokens); returns the path."""
    short = open(_write_chat(path.with_suffix(".short"))).read().splitlines()
    lines = []
    for line in short:
        while len(lines) + 1 in long_lines:
            lines.append(json.dumps({"prompt": "x" * 100, "response": "y"}))
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_skip_long_examples_drops_and_names_them(tmp_path):
    """``data.skip_long_examples``: the over-long conversations are dropped and listed by file:line,
    the others are the same rows, in the same order, as a corpus without them."""
    p = _with_long_rows(tmp_path / "a.jsonl")
    tok = get_tokenizer("byte")
    with pytest.raises(ValueError, match=r"a.jsonl:3: no response token"):
        load_chat(_Data(p), tok, seq_len=48)
    chat = load_chat(_Data(p, skip_long_examples=True), tok, seq_len=48)
    assert [w.rsplit("/", 1)[-1] for w in chat.skipped] == ["a.jsonl:3", "a.jsonl:7", "a.jsonl:8"]
    clean = load_chat(_Data(tmp_path / "a.short"), tok, seq_len=48)
    np.testing.assert_array_equal(chat.examples, clean.examples)
    np.testing.assert_array_equal(chat.masks, clean.masks)
    assert chat.prompts == clean.prompts and chat.truncated == clean.truncated == 0
    kept = load_chat(_Data(tmp_path / "a.short", skip_long_examples=True), tok, seq_len=48)  # nothing to drop
    np.testing.assert_array_equal(kept.examples, clean.examples)
    assert kept.skipped == [] and kept.prompts == clean.prompts


def test_skip_long_examples_logs_the_count_and_first_places(tmp_path, caplog):
    p = _with_long_rows(tmp_path / "a.jsonl", long_lines=range(1, 9))
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), [
        "training.seq_len=48", "data.format=chat", f"data.corpus={p}", "data.skip_long_examples=true"])
    log = logging.getLogger("jaxcolossal")  # it does not propagate once the run's logger is set up
    log.addHandler(caplog.handler)
    try:
        chat_batches(cfg, None, None, 4)
    finally:
        log.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "skip_long_examples" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].endswith("data.skip_long_examples: dropped 8 conversation(s) with no response token within "
                             f"training.seq_len=48 ({p}:1, {p}:2, {p}:3, {p}:4, {p}:5, ...)")
    with pytest.raises(ConfigError, match="data.skip_long_examples=true applies to data.format=chat, not text"):
        load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), ["data.skip_long_examples=true"])


def test_example_loader_is_a_pure_function_of_the_step(tmp_path):
    chat = load_chat(_Data(_write_chat(tmp_path / "c.jsonl")), get_tokenizer("byte"), seq_len=48)
    a = ExampleLoader(chat.examples, chat.masks, 8, seed=3, process_index=0, process_count=1)
    b = ExampleLoader(chat.examples, chat.masks, 8, seed=3, process_index=0, process_count=1)
    for k in ("inputs", "targets", "loss_mask"):
        np.testing.assert_array_equal(a.batch(5)[k], b.batch(5)[k])
    assert not np.array_equal(a.batch(5)["inputs"], a.batch(6)["inputs"])
    halves = [ExampleLoader(chat.examples, chat.masks, 8, seed=3, process_index=i, process_count=2).batch(5)
              for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["loss_mask"] for h in halves]), a.batch(5)["loss_mask"])


def test_chat_needs_a_corpus():
    with pytest.raises(ConfigError, match="data.format=chat needs data.corpus"):
        load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), ["data.format=chat"])


def test_main_job_fine_tunes_on_chat(tmp_path):
    """The response loss falls; the log counts the conversations loaded, cut and held out; the
    end-of-run sample continues the first held-out conversation's prompt, not a text prompt."""
    corpus = _write_chat(tmp_path / "c.jsonl", n=128)
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), [
        "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=48",
        "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=6", "logging.progress_bar=false",
        "training.eval_every=0", "training.max_steps=40", "training.warmup_steps=4", "data.format=chat",
        f"data.corpus={corpus}", "data.val_fraction=0.1", f"logging.run_dir={tmp_path}/run"])
    out = train(cfg)
    # the loss is over response tokens only (a few digits and a newline): it falls well below uniform
    assert out["val_loss_end"] < out["val_loss_start"] - 1.0
    log = open(tmp_path / "run" / "train.log").read()
    assert ("data.format=chat: 128 conversations from 1 file(s): 115 to train, 13 held out for validation "
            "(data.val_fraction=0.1); 0 cut to training.seq_len=48 tokens") in log
    assert out["sample"].startswith("user: add 115 and 115\nassistant: ")  # conversation 115: the first held out
    assert len(out["sample"]) > len("user: add 115 and 115\nassistant: ")


def test_a_given_sample_prompt_is_the_users_turn():
    assert generation_prompt([{"role": "user", "content": "double 4"}], get_tokenizer("byte")) == \
        "user: double 4\nassistant: "


def test_sft_from_hugging_face_matches_transformers(tmp_path):
    """A tiny LLaMA saved by ``transformers`` and a tokenizer trained by scripts/train_tokenizer.py,
    converted and fine-tuned on chat lines (``model.init_from``, the tokenizer's chat template):
    the first step's loss equals ``transformers``' loss on the same batch with the same mask
    (labels -100 off the responses; rtol 1e-4), and the response loss falls."""
    import torch  # optional: torch (the test extra)
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: transformers (the test extra)

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import convert_hf  # heavy: from scripts/, put on sys.path by this test only
    import train_tokenizer  # heavy: from scripts/, put on sys.path by this test only

    corpus = _write_chat(tmp_path / "chat.jsonl", n=96)
    hf = tmp_path / "hf"
    vocab = train_tokenizer.train(str(corpus), 300, str(hf), chat_template=True)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(str(hf))
    assert convert_hf.main(["--to-jax", str(hf), str(tmp_path / "out")]) == 0
    cfg = load_config(str(tmp_path / "out" / "model.yaml"), [
        f"model.init_from={hf}", f"data.tokenizer={hf}", "data.format=chat", f"data.corpus={corpus}",
        "data.val_fraction=0.1", "training.seq_len=48", "training.batch_size=16", "training.max_steps=30",
        "training.warmup_steps=3", "training.learning_rate=3e-3", "training.eval_every=0", "training.eval_batches=2",
        "training.sample_tokens=0", "logging.log_every=1", "logging.progress_bar=false",
        f"logging.run_dir={tmp_path}/run"])
    out = train(cfg)
    first = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in line][0]
    assert first["step"] == 1

    # the batch of step 0, as the loader drew it, through transformers
    chat, _ = load_chat(cfg.data, get_tokenizer(str(hf)), 48).split(0.1)
    batch = ExampleLoader(chat.examples, chat.masks, 16, cfg.training.seed, process_index=0, process_count=1).batch(0)
    ids = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    labels = ids.copy()
    labels[:, 1:][batch["loss_mask"] == 0] = -100
    model = LlamaForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = model(input_ids=torch.tensor(ids, dtype=torch.long), labels=torch.tensor(labels, dtype=torch.long)).loss
    np.testing.assert_allclose(first["loss"], float(hf_loss), rtol=1e-4)
    assert out["val_loss_end"] < out["val_loss_start"] - 0.5
