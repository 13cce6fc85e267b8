"""Instruction fine-tuning data: chat JSON lines rendered to fixed windows with a loss mask.

``data.format=chat`` reads JSON lines, one conversation per line, in either of two forms:

* ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``
* ``{"prompt": "...", "response": "..."}`` (one user turn and one assistant turn)

Each conversation becomes one row of ``seq_len + 1`` tokens: the rendered text, cut at
``seq_len + 1`` tokens (counted and reported), padded with the tokenizer's end-of-text id (0 for
the byte tokenizer). A conversation whose responses all fall beyond ``seq_len`` is refused, or
dropped and counted with ``data.skip_long_examples``. The loss mask is 1 exactly on the targets
that are assistant tokens (including the end-of-text that closes each assistant turn, so the
model learns to stop), 0 on system/user turns, role headers and padding: only the responses are
trained on.

Rendering: a tokenizer folder with a chat template (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``) is rendered with it as ``transformers``'
``apply_chat_template`` renders it (a sandboxed ``jinja2`` environment with its options, ``tojson``,
``raise_exception``, ``strftime_now``, and the special tokens' texts), segment by segment: the text
up to each assistant turn (``add_generation_prompt=True``) is the prompt and what the turn adds is
the response. The text is encoded without added special tokens (the template writes ``bos_token``
itself), as transformers encodes it. Otherwise a plain template is used: ``"<role>: <content>\\n"``
per turn, with the assistant's ``"assistant: "`` header masked out and its content plus
end-of-text in.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np

from jaxcolossal.config import Config
from jaxcolossal.errors import DataError, TokenizerError
from jaxcolossal.runtime.dist_logger import get_dist_logger

from .corpus import held_out_cut, iter_json_lines, resolve_files
from .loader import ExampleLoader
from .tokenizer import get_tokenizer

__all__ = ["ChatData", "chat_batches", "chat_renderer", "chat_template_source", "generation_prompt", "load_chat",
           "render_chat",
           "render_segments", "special_token_strings"]

ROLES = ("system", "user", "assistant")


@dataclass
class ChatData:
    """Rendered conversations. ``examples`` int32 ``[N, seq_len + 1]``; ``masks`` float32
    ``[N, seq_len]`` aligned with the targets ``examples[:, 1:]``; ``truncated``: rows cut to fit;
    ``prompts``: each conversation's rendered text before its first response (what a model is
    asked to continue: the chat template's generation prompt included); ``files``: how many
    files were read; ``skipped``: the ``file:line`` of each conversation dropped because no
    response token was left within ``seq_len`` (``data.skip_long_examples``), in file order."""

    examples: np.ndarray
    masks: np.ndarray
    truncated: int
    prompts: list = field(default_factory=list)
    files: int = 0
    skipped: list = field(default_factory=list)

    def split(self, val_fraction: float) -> tuple["ChatData", "ChatData"]:
        """The last ``ceil(N · val_fraction)`` rows (at least one when ``val_fraction > 0`` and
        N > 1) are the validation split; the rest train."""
        cut = held_out_cut(len(self.examples), val_fraction)
        return (ChatData(self.examples[:cut], self.masks[:cut], self.truncated, self.prompts[:cut], self.files,
                         self.skipped),
                ChatData(self.examples[cut:], self.masks[cut:], 0, self.prompts[cut:], self.files))


def _conversation(record, where: str) -> list[dict]:
    if isinstance(record, dict) and "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}] must be {{'role': one of {list(ROLES)}, "
                                 f"'content': a string}}, got {str(m)[:80]}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: the conversation has no assistant turn, so nothing to train on")
        return msgs
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    raise DataError(f"{where}: expected {{'messages': [...]}} or {{'prompt': str, 'response': str}}")


CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""The chat template's own file beside the tokenizer (transformers >= 4.50 saves it there); when present
it wins over ``tokenizer_config.json``'s ``chat_template``, as transformers reads them."""

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers passes to a chat template (``special_tokens_map``)."""


def _tokenizer_folder(tokenizer) -> str | None:
    """The folder of a file-backed tokenizer (Hugging Face or SentencePiece), else None."""
    name = getattr(tokenizer, "name", None)
    if not isinstance(name, str) or not hasattr(tokenizer, "encode_batch"):
        return None
    return name if os.path.isdir(name) else os.path.dirname(os.path.abspath(name))


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        out = json.load(f)
    return out if isinstance(out, dict) else {}


def chat_template_source(folder: str) -> str | None:
    """The Jinja text of the chat template in a tokenizer ``folder``: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}`` of
    which the ``default`` one is taken), else None."""
    path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    tmpl = _read_json(os.path.join(folder, "tokenizer_config.json")).get("chat_template")
    if isinstance(tmpl, list):
        tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tmpl if isinstance(tmpl, str) else None


def special_token_strings(folder: str) -> dict[str, str]:
    """The special tokens' texts a chat template sees, as transformers 5 passes them: the named ones
    (``bos_token``, ``eos_token``, ...) and a model's own ``*_token`` keys of ``tokenizer_config.json``
    (a string or an ``{"content": ...}`` object), those of a legacy ``special_tokens_map.json`` taking
    over when the config has no ``added_tokens_decoder``; unset ones are left out."""
    cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    values = {k: v for k, v in cfg.items() if k.endswith("_token") and (k in SPECIAL_TOKEN_NAMES or isinstance(v, str))}
    if "added_tokens_decoder" not in cfg:
        legacy = _read_json(os.path.join(folder, "special_tokens_map.json"))
        values.update({k: v for k, v in legacy.items() if k in SPECIAL_TOKEN_NAMES})
    values = {k: v.get("content") if isinstance(v, dict) else v for k, v in values.items()}
    return {k: v for k, v in values.items() if isinstance(v, str)}


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (assistant-mask markers of training
    templates): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` (no HTML escaping, unlike Jinja's own)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    """The sandboxed Jinja environment transformers renders chat templates in: its options,
    extensions, ``tojson`` filter and globals (``raise_exception``, ``strftime_now``, ``dict``)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=dict,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


def _chat_template(tokenizer):
    """``render(messages, add_generation_prompt) -> str`` with the tokenizer folder's chat template
    (:func:`chat_template_source`), rendered as ``transformers``' ``apply_chat_template(...,
    tokenize=False)`` renders it (``tools`` and ``documents`` None, the special tokens' texts); None
    for a tokenizer without one. The render raises :class:`DataError` when the template refuses the
    conversation (``raise_exception``, e.g. Gemma's "System role not supported")."""
    folder = _tokenizer_folder(tokenizer)
    source = chat_template_source(folder) if folder else None
    if source is None:
        return None
    try:
        template = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"{folder}: the chat template is not valid Jinja: {e}") from None
    specials = special_token_strings(folder)

    def render(messages, add_generation_prompt):
        try:
            return template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **specials)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"the chat template of {folder} refuses the conversation: {e}") from None
    return render


def render_chat(messages: list[dict], tokenizer, add_generation_prompt: bool = False) -> str:
    """``messages`` rendered by the tokenizer's chat template, the text ``transformers``'
    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` gives; encode it
    with ``tokenizer.encode`` (no special tokens added: the template writes ``bos_token`` itself).

    Raises:
        TokenizerError: the tokenizer has no chat template.
        DataError: the template refuses the conversation."""
    return chat_renderer(tokenizer)(messages, add_generation_prompt)


def chat_renderer(tokenizer):
    """``render(messages, add_generation_prompt) -> str``: :func:`render_chat` with the template parsed once.

    Raises:
        TokenizerError: the tokenizer has no chat template."""
    template = _chat_template(tokenizer)
    if template is None:
        raise TokenizerError(f"{getattr(tokenizer, 'name', tokenizer)!r} has no chat template (chat_template.jinja "
                             "or tokenizer_config.json's chat_template)")
    return template


def render_segments(messages: list[dict], template=None, eos_text: str = "") -> list[tuple[str, bool]]:
    """``[(text, trained)]`` whose concatenation is the rendered conversation; ``trained`` marks
    the assistant responses. ``template(messages, add_generation_prompt)`` renders with a chat
    template; ``None`` uses the plain ``"<role>: <content>\\n"`` form (module docstring)."""
    if template is None:
        out = []
        for m in messages:
            if m["role"] == "assistant":
                out += [("assistant: ", False), (m["content"] + "\n", True)]
                if eos_text:
                    out.append((eos_text, True))
            else:
                out.append((f"{m['role']}: {m['content']}\n", False))
        return out
    out, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = template(messages[:i], True)
        full = template(messages[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise TokenizerError("the chat template does not render conversations as growing prefixes; "
                             "use a tokenizer without chat_template for the plain format")
        out += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    tail = template(messages, False)[len(done):]
    if tail:
        out.append((tail, False))
    return out


def generation_prompt(messages: list[dict], tokenizer) -> str:
    """The text a model continues to answer ``messages`` (system/user turns): the tokenizer's chat
    template with ``add_generation_prompt=True`` when it has one, else the plain form's turns and
    ``"assistant: "`` (module docstring)."""
    template = _chat_template(tokenizer)
    if template is not None:
        return template(messages, True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def _render_row(segments, tokenizer, seq_len: int) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """``(tokens, trained, prompt_len, cut)`` of one conversation's segments: the token ids and
    their 0/1 trained flags, cut to ``seq_len + 1`` tokens (``cut``: whether they were), and the
    number of tokens before the first trained one (all of them when none is trained)."""
    ids = [tokenizer.encode(text).astype(np.int64) for text, _ in segments]
    flags = [np.full(len(i), trained, np.float32) for i, (_, trained) in zip(ids, segments)]
    tokens, trained = np.concatenate(ids), np.concatenate(flags)
    prompt_len = int(np.argmax(trained > 0)) if trained.any() else len(tokens)
    cut = len(tokens) > seq_len + 1
    if cut:
        tokens, trained = tokens[: seq_len + 1], trained[: seq_len + 1]
    return tokens, trained, prompt_len, cut


def load_chat(data_cfg, tokenizer, seq_len: int) -> ChatData:
    """Read ``data_cfg.corpus`` (JSON-lines globs) as conversations and render them (module doc).

    A conversation with no response token left within ``seq_len`` tokens is an error, or, with
    ``data_cfg.skip_long_examples`` true, is dropped and its ``file:line`` listed in
    :attr:`ChatData.skipped` (the rows kept are the same, in the same order, either way).

    Returns:
        :class:`ChatData` with one row per conversation kept.

    Raises:
        FileNotFoundError: no file matches.
        ValueError: a line that does not parse or is not a conversation (file and line named),
            an empty corpus (or one whose conversations were all dropped), or a conversation whose
            responses are all cut off by ``seq_len`` unless ``skip_long_examples``.
    """
    template = _chat_template(tokenizer)
    eos = getattr(tokenizer, "eos_id", None)
    pad = 0 if eos is None else eos
    eos_text = tokenizer.decode([eos]) if (eos is not None and template is None) else ""
    rows, masks, prompts, truncated, skipped = [], [], [], 0, []
    files = resolve_files(data_cfg.corpus)
    for path in files:
        for where, record in iter_json_lines(path):
            segments = render_segments(_conversation(record, where), template, eos_text)
            tokens, trained, prompt_len, cut = _render_row(segments, tokenizer, seq_len)
            if not trained[1:].any():
                if data_cfg.skip_long_examples:
                    skipped.append(where)
                    continue
                raise DataError(f"{where}: no response token is left within training.seq_len={seq_len} "
                                 f"(the text before the first response takes {prompt_len} tokens); raise seq_len, "
                                 "shorten the prompt, or set data.skip_long_examples=true to drop such conversations")
            truncated += cut
            first = next((i for i, (_, t) in enumerate(segments) if t), len(segments))
            prompts.append("".join(text for text, _ in segments[:first]))
            row = np.full(seq_len + 1, pad, np.int32)
            row[: len(tokens)] = tokens
            m = np.zeros(seq_len + 1, np.float32)
            m[: len(trained)] = trained
            rows.append(row)
            masks.append(m[1:])  # target j is token j + 1
    if not rows:
        dropped = f" ({len(skipped)} dropped by data.skip_long_examples: none fits training.seq_len={seq_len})" \
            if skipped else ""
        raise DataError(f"data.corpus={data_cfg.corpus!r} holds no conversations{dropped}")
    return ChatData(np.stack(rows), np.stack(masks), truncated, prompts, len(files), skipped)


# ----------------------------------------------------------------------------- the chat format

SKIPPED_SHOWN = 5
"""How many ``file:line`` locations of conversations dropped by ``data.skip_long_examples`` the log
line names (the count covers them all)."""


def chat_batches(cfg: Config, mesh: Any, spec: Any, eval_bs: int) -> tuple[ExampleLoader, list, str]:
    """``data.format=chat``: ``(loader, evaluation batches, sample prompt)``: conversations with a loss
    mask on the responses (:class:`jaxcolossal.data.loader.ExampleLoader` on ``mesh`` with the batch
    ``spec``), ``training.eval_batches`` fixed batches of ``eval_bs`` held-out rows; says how many
    conversations were loaded, cut and held out. The sample's prompt is ``training.sample_prompt`` as
    a user turn, else the first held-out conversation's text before its response (the chat
    template's generation prompt included).

    Raises:
        DataError: a line that is not a conversation (:func:`load_chat`).
    """
    t = cfg.training
    tok = get_tokenizer(cfg.data.tokenizer)
    chat = load_chat(cfg.data, tok, t.seq_len)
    train_part, val_part = chat.split(cfg.data.val_fraction)
    log = get_dist_logger()
    log.info(f"data.format=chat: {len(chat.examples)} conversations from {chat.files} file(s): "
             f"{len(train_part.examples)} to train, {len(val_part.examples)} held out for validation "
             f"(data.val_fraction={cfg.data.val_fraction:g}); {chat.truncated} cut to training.seq_len={t.seq_len} "
             "tokens", ranks=[0])
    if chat.truncated:
        log.warning(f"data.format=chat: {chat.truncated} of {len(chat.examples)} conversations were cut to "
                    f"training.seq_len={t.seq_len} tokens", ranks=[0])
    if chat.skipped:
        first = ", ".join(chat.skipped[:SKIPPED_SHOWN]) + (", ..." if len(chat.skipped) > SKIPPED_SHOWN else "")
        log.warning(f"data.skip_long_examples: dropped {len(chat.skipped)} conversation(s) with no response token "
                    f"within training.seq_len={t.seq_len} ({first})", ranks=[0])
    loader = ExampleLoader(train_part.examples, train_part.masks, t.batch_size, t.seed, mesh=mesh, batch_spec=spec)
    held = val_part if len(val_part.examples) else train_part
    prompt = generation_prompt([{"role": "user", "content": t.sample_prompt}], tok) if t.sample_prompt \
        else held.prompts[0]
    return loader, loader.eval_batches(held.examples, held.masks, eval_bs, t.eval_batches), prompt
