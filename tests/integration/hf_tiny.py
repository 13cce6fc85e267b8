"""A tiny LLaMA built by transformers for the TRL parity tests (DPO, GRPO): 2 layers, hidden 32, 4 heads
over 2 kv heads, fp32, eager attention, its weights spread from HF's near-flat init so the logits are
not uniform; and a LLaMA-3-style folder (tokenizer, eos list) with transformers' greedy rows for the
generation tests (:func:`llama3_folder`, :func:`hf_greedy_rows`). Import it after
``pytest.importorskip("torch")``."""
import json
import os

import tokenizer_families  # tests/: the tokenizer folders of the families
import torch
import transformers


def tiny_llama(seed: int, vocab: int) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # HF's init gives near-flat logits; spread them
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "norm" in name else 0.2))
    return model


LLAMA3_PROMPTS = ["Hello world", "What is 12 + 30? The answer is", "x", "Once upon a time there was a little robot who"]
"""Prompts of mixed token lengths for :func:`llama3_folder`'s model."""


def hf_greedy_rows(path: str, prompts: list[str], new_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """transformers at its defaults on the folder: ``(prompt ids, rows)``: each prompt's ids
    (``AutoTokenizer(path)(prompt)``, BOS first) and its greedy completion from
    ``model.generate(**tok(prompts, padding=True, padding_side="left", return_tensors="pt"),
    do_sample=False, max_new_tokens=new_tokens)``, cut after the first token of the
    ``generation_config.json`` eos list (the pads after it dropped)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    batch = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=new_tokens)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return [tok(p).input_ids for p in prompts], rows


def _stops(rows: list[list[int]], eos: set, new_tokens: int) -> list[int]:
    return [next((i + 1 for i, t in enumerate(r) if t in eos), new_tokens) for r in rows]


def llama3_folder(path: str, new_tokens: int, seed: int = 0) -> list[int]:
    """A tiny ``LlamaForCausalLM`` (``initializer_range`` 0.15: decisive logits) saved with
    ``save_pretrained`` into ``path`` with a LLaMA-3-style tokenizer (tests/tokenizer_families.py's
    ``llama3``: BOS by the post-processor, the real chat template; its ``<|finetune_right_pad_id|>``
    named the pad token so that transformers can pad the batch) and a ``generation_config.json`` whose
    ``eos_token_id`` is a list: the three real end tokens and two tokens that greedy decoding of
    :data:`LLAMA3_PROMPTS` produces, chosen so that some rows end mid-way and at least one runs to
    ``new_tokens``. Returns that list."""
    tokenizer_families.build("llama3", path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        tok_cfg = json.load(f)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(dict(tok_cfg, pad_token="<|finetune_right_pad_id|>"), f)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    real_eos = [tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.15, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   attn_implementation="eager", bos_token_id=tok.bos_token_id, eos_token_id=real_eos,
                                   pad_token_id=tok.pad_token_id)
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(path)
    _, rows = hf_greedy_rows(path, LLAMA3_PROMPTS, new_tokens)
    eos = _pick_eos(rows, real_eos, new_tokens)
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    with open(gen_path, "w") as f:
        json.dump(dict(gen, eos_token_id=eos), f)
    return eos


def _pick_eos(rows: list[list[int]], real_eos: list[int], new_tokens: int) -> list[int]:
    """The real end ids and two generated tokens such that as many rows as can end mid-way (none at its
    first token), at different steps, and at least one row meets none of them (runs to ``new_tokens``).
    Raises AssertionError when no pair leaves such a row (another seed is needed)."""
    best, score = None, (0, 0)
    for a in sorted({t for r in rows for t in r[1: new_tokens - 2]}):
        for b in sorted({t for r in rows for t in r[1: new_tokens - 2]} - {a}):
            eos = real_eos + [a, b]
            stops = _stops(rows, set(eos), new_tokens)
            full = [not any(t in eos for t in r) for r in rows]
            early = [n for n in stops if n < new_tokens - 1]
            if any(full) and min(stops) >= 2 and (len(early), len(set(early))) > score:
                best, score = eos, (len(early), len(set(early)))
    assert best is not None, "no generated tokens end some rows but not all; use another seed"
    return best
