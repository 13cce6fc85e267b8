"""Small tokenizer folders shaped like the real ones of the families that ship a tokenizer, for the
token-equality tests against transformers (there is no network to download the real ones).

Each folder has what the real checkpoint's has, with a small vocabulary trained here by the
``tokenizers`` library on :data:`CORPUS`:

* ``tokenizer.json``: the family's normalizer, pre-tokenizer (its split regex), model options (byte
  fallback, ``ignore_merges``), post-processor (the BOS it adds, or none) and decoder; its special
  tokens under their real names (ids differ: the vocabulary is small).
* ``tokenizer_config.json``: the real ``tokenizer_class``, special tokens, ``add_bos_token`` and
  ``added_tokens_decoder``; the chat template here or in ``chat_template.jinja``.
* ``config.json`` with the real ``model_type`` (transformers 5 picks the tokenizer class by it) and
  ``generation_config.json`` with the real eos list where the model has one.

The chat templates are the real ones where the installed ``trl`` ships a copy (``trl/chat_templates``:
LLaMA 3.1/3.2, Qwen2.5, Qwen3, Gemma, Gemma 3, Phi-3, DeepSeek-V3, GPT-OSS; read from there, not copied
here); Mistral v0.3, Phi-4-mini and OLMo-2 have none there and get a template of their documented
shape (:data:`SHAPED_TEMPLATES`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "Once upon a time there was a little robot who liked to count: 1, 2, 3, 12, 345, 6789.",
    "def add(a, b):\n    return a + b\n\nprint(add(3, 4))  # 7",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! It's here, isn't it? We'll see.",
    "Café, naïve, façade and jalapeño are words with accents; ß and æ too.",
    "Hello world! Hello there. How are you today? I am fine, thank you.",
    "What is 12 + 30? The answer is 42.\nWhat is 7 * 6? Also 42.",
    "   leading spaces,\ttabs\tand\n\nnewlines\r\n matter to tokenizers.",
    "You are a helpful assistant. Answer the question briefly and correctly.",
]

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
"""The tiktoken cl100k split (LLaMA 3, OLMo-2)."""
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
               r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
"""The o200k split (GPT-OSS's harmony tokenizer, Phi-4-mini)."""
DEEPSEEK_SPLITS = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                   r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                   r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SHAPED_TEMPLATES = {
    # Mistral-7B-Instruct-v0.3's form: [INST] ... [/INST] around each user turn, the system message
    # before the last user turn, eos after each answer; bos first.
    "mistral": (
        "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
        "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
        "{{- bos_token }}{%- for message in loop_messages %}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/"
        "user/assistant/...') }}{%- endif %}"
        "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
        "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
        "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
        "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
        "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an "
        "initial optional system message!') }}{%- endif %}{%- endfor %}"),
    # Phi-4-mini-instruct's form: <|role|>content<|end|> per turn, then <|assistant|> or eos.
    "phi4mini": (
        "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
        "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
        "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
        "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"),
    # OLMo-2-Instruct's (Tulu 3) form: bos, <|role|>\n turns (plain text, not special tokens), eos after answers.
    "olmo2": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
        "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
        "{% if not loop.last %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
        "{% else %}{{ '<|assistant|>\\n' + message['content'] + eos_token }}{% endif %}{% endif %}"
        "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"),
}


@dataclass(frozen=True)
class Spec:
    """One family's tokenizer folder: ``style`` ``byte`` (byte-level BPE) or ``sp`` (SentencePiece-like
    BPE over ``▁`` with byte fallback); ``front``: special tokens at the start of the vocabulary
    (SentencePiece's ``<unk>``, ``<s>``, ...); ``added``: special tokens after it; ``plain_added``:
    added tokens that are not special (Qwen3's ``<think>``); ``bos``: the token the post-processor
    puts first (None: none); ``config``: the ``tokenizer_config.json`` keys besides the added tokens;
    ``template``: a file of ``trl/chat_templates`` or a key of :data:`SHAPED_TEMPLATES`;
    ``template_file``: the template in ``chat_template.jinja`` rather than in the config;
    ``eos``: ``generation_config.json``'s ``eos_token_id`` as token names (a list where the model's is)."""

    model_type: str
    style: str
    split: tuple = ()
    normalizer: str = ""
    front: tuple = ()
    added: tuple = ()
    plain_added: tuple = ()
    bos: str | None = None
    config: dict = field(default_factory=dict)
    template: str = ""
    template_file: bool = False
    eos: tuple = ()


FAMILIES = {
    "llama3": Spec(
        "llama", "byte", (LLAMA3_SPLIT,),
        added=("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
               "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"),
        bos="<|begin_of_text|>", template="llama3_1.jinja",
        config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
                "model_input_names": ["input_ids", "attention_mask"]},
        eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "llama3_2": Spec(
        "llama", "byte", (LLAMA3_SPLIT,),
        added=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
               "<|eot_id|>", "<|python_tag|>"),
        bos="<|begin_of_text|>", template="llama3_2.jinja", template_file=True,
        config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>", "pad_token": "<|finetune_right_pad_id|>"},
        eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    "qwen2_5": Spec(
        "qwen2", "byte", (QWEN_SPLIT,), normalizer="NFC",
        added=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<tool_call>", "</tool_call>"),
        template="qwen2_5.jinja",
        config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "split_special_tokens": False,
                "add_prefix_space": False},
        eos=("<|im_end|>", "<|endoftext|>")),
    "qwen3": Spec(
        "qwen3", "byte", (QWEN_SPLIT,), normalizer="NFC",
        added=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>"),
        plain_added=("<tool_call>", "</tool_call>", "<think>", "</think>"),
        template="qwen3.jinja", template_file=True,
        config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "split_special_tokens": False,
                "add_prefix_space": False},
        eos=("<|im_end|>", "<|endoftext|>")),
    "mistral": Spec(
        "mistral", "sp", normalizer="metaspace_first",
        front=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"),
        bos="<s>", template="mistral",
        config={"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
                "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
                "spaces_between_special_tokens": False}),
    "gemma2": Spec(
        "gemma2", "sp", normalizer="replace_space",
        front=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"), added=("<start_of_turn>", "<end_of_turn>"),
        bos="<bos>", template="gemma.jinja",
        config={"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
                "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
        eos=("<eos>", "<end_of_turn>")),
    "gemma3": Spec(
        "gemma3_text", "sp", normalizer="replace_space",
        front=("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"),
        added=("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        bos="<bos>", template="gemma3.jinja", template_file=True,
        config={"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
                "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        eos=("<eos>", "<end_of_turn>")),
    "phi3": Spec(
        "phi3", "sp", normalizer="legacy_prepend", front=("<unk>", "<s>", "</s>"),
        added=("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>", "<|user|>"),
        bos="<s>", template="phi3.jinja",
        config={"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False, "legacy": False,
                "bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"},
        eos=("<|end|>", "<|endoftext|>")),
    "phi4mini": Spec(
        "phi3", "byte", (O200K_SPLIT,),
        added=("<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>", "<|tool|>", "<|/tool|>"),
        template="phi4mini",
        config={"tokenizer_class": "GPT2Tokenizer", "add_bos_token": False, "add_eos_token": False,
                "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>"},
        eos=("<|endoftext|>", "<|end|>")),
    "olmo2": Spec(
        "olmo2", "byte", (LLAMA3_SPLIT,), added=("<|endoftext|>", "<|pad|>"), template="olmo2",
        config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                "pad_token": "<|pad|>", "unk_token": "<|endoftext|>"},
        eos=("<|endoftext|>",)),
    "deepseek_v3": Spec(
        "deepseek_v3", "byte", DEEPSEEK_SPLITS,
        front=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"),
        added=("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
               "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
               "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"),
        bos="<｜begin▁of▁sentence｜>", template="deepseekv3.jinja",
        config={"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
                "legacy": True,
                "bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>", "lstrip": False,
                              "normalized": True, "rstrip": False, "single_word": False},
                "eos_token": {"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>", "lstrip": False,
                              "normalized": True, "rstrip": False, "single_word": False},
                "pad_token": None, "unk_token": None},
        eos=("<｜end▁of▁sentence｜>",)),
    "gpt_oss": Spec(
        "gpt_oss", "byte", (O200K_SPLIT,),
        added=("<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
               "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
               "<|call|>"),
        template="gptoss.jinja", template_file=True,
        config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
        eos=("<|return|>", "<|endoftext|>", "<|call|>")),
}


def trl_template(name: str) -> str | None:
    """A chat template file the installed ``trl`` ships (its copies of the models' own), else None."""
    try:
        import trl  # optional: the TRL parity tests' package; its chat_templates hold the models' originals
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pre_tokenizer(spec: Spec):
    if spec.style == "sp":
        if spec.normalizer == "metaspace_first":
            return pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        return None
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in spec.split]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                                      use_regex=False)])


def _normalizer(spec: Spec):
    return {"NFC": normalizers.NFC(),
            "replace_space": normalizers.Replace(" ", "▁"),
            "legacy_prepend": normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
            }.get(spec.normalizer)


def _decoder(spec: Spec):
    if spec.style == "byte":
        return decoders.ByteLevel()
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if spec.normalizer != "replace_space":  # LLaMA-style: the prefix space of the first word is stripped
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def _train(spec: Spec, vocab_size: int) -> Tokenizer:
    """The BPE of ``spec``'s pipeline trained on :data:`CORPUS` (``front`` tokens first)."""
    if spec.style == "byte":
        tok = Tokenizer(models.BPE(ignore_merges=spec.model_type == "llama"))
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in spec.front else None, byte_fallback=True,
                                   fuse_unk=True))
        alphabet = sorted({c for line in CORPUS for c in line.replace(" ", "▁")} | {"▁"})
    tok.normalizer = _normalizer(spec)
    tok.pre_tokenizer = _pre_tokenizer(spec)
    tok.decoder = _decoder(spec)
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.front),
                                                            initial_alphabet=alphabet, show_progress=False))
    if spec.style == "sp":  # SentencePiece's byte-fallback pieces <0x00>..<0xFF> right after the front tokens
        data = json.loads(tok.to_str())
        vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
        front, rest = vocab[: len(spec.front)], vocab[len(spec.front):]
        names = [k for k, _ in front] + [f"<0x{b:02X}>" for b in range(256)] + [k for k, _ in rest]
        data["model"]["vocab"] = {k: i for i, k in enumerate(names)}
        for t in data["added_tokens"]:
            t["id"] = data["model"]["vocab"][t["content"]]
        tok = Tokenizer.from_str(json.dumps(data))
    return tok


def _finish(tok: Tokenizer, spec: Spec) -> None:
    """Added tokens after the vocabulary, and the post-processor."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.added])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain_added])
    template = []
    if spec.bos is not None:
        bos = (spec.bos, tok.token_to_id(spec.bos))
        template = [processors.TemplateProcessing(single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos}:1 $B:1",
                                                  special_tokens=[bos])]
    if spec.style == "byte":
        tok.post_processor = processors.Sequence(
            [processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)] + template)
    elif template:
        tok.post_processor = template[0]


def _added_tokens_decoder(tok: Tokenizer) -> dict:
    data = json.loads(tok.to_str())
    return {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in data["added_tokens"]}


def build(name: str, folder, vocab_size: int = 400) -> dict:
    """Write family ``name``'s tokenizer folder (module docstring) into ``folder``; returns
    ``{"template": bool, "eos": [ids]}`` (whether a chat template was written; the generation eos ids)."""
    spec = FAMILIES[name]
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    tok = _train(spec, vocab_size)
    _finish(tok, spec)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = dict(spec.config, added_tokens_decoder=_added_tokens_decoder(tok), model_max_length=131072)
    source = SHAPED_TEMPLATES.get(spec.template) or trl_template(spec.template)
    if source is not None and spec.template_file:
        with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(source)
    elif source is not None:
        cfg["chat_template"] = source
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
    eos = [tok.token_to_id(t) for t in spec.eos]
    bos = tok.token_to_id(spec.bos) if spec.bos else None
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": spec.model_type, "vocab_size": tok.get_vocab_size(), "bos_token_id": bos,
                   "eos_token_id": eos[0] if eos else None, "pad_token_id": None}, f)
    if eos:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": eos if len(eos) > 1 else eos[0]}, f)
    return {"template": source is not None, "eos": eos}
