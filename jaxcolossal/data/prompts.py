"""Prompts for GRPO: JSON lines of a prompt and, optionally, the answer its reward checks against.

``training.objective=grpo`` with ``data.format=prompts`` reads ``data.corpus`` (JSON-lines globs), one
prompt per line, as TRL's ``GRPOTrainer`` datasets hold them:

* ``{"prompt": str, "answer": ...}``: the prompt's text is encoded as TRL's ``GRPOTrainer`` encodes
  it, ``processing_class(text=prompt)``: with the special tokens the tokenizer adds to a prompt
  (``encode_prompt``: LLaMA 3's ``<|begin_of_text|>`` first; no end-of-text id: the completion
  continues it); ``answer`` (any JSON value, optional) is passed to the reward functions as their
  ``answer`` argument (TRL passes a dataset's extra columns the same way).
* ``{"prompt": [messages], ...}``: chat messages, rendered with the tokenizer's chat template (or the
  plain ``"<role>: <content>\\n"`` form) and its generation prompt, as ``data.format=chat`` renders them,
  and encoded without added special tokens (the template writes ``bos_token``): TRL's
  ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``.

A prompt longer than ``max_tokens`` (``training.seq_len + 1 - posttrain.max_completion_length``) is
cut to its last ``max_tokens`` tokens and counted, or with ``data.skip_long_examples`` dropped. A
line without a ``prompt`` raises :class:`jaxcolossal.errors.DataError` naming the file and line,
before anything is compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxcolossal.errors import DataError

from .chat import generation_prompt
from .corpus import held_out_cut, iter_json_lines, resolve_files

__all__ = ["PromptData", "load_prompts", "prompt_batch"]


@dataclass
class PromptData:
    """``N`` prompts: ``texts`` (as the reward functions see them), ``tokens`` (int lists, at most
    ``max_tokens`` each), ``answers`` (the rows' ``answer``, ``None`` where absent); ``truncated``:
    prompts cut to fit; ``files``: files read; ``skipped``: the ``file:line`` of prompts dropped."""

    texts: list[str]
    tokens: list[list[int]]
    answers: list[Any]
    truncated: int = 0
    files: int = 0
    skipped: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    def split(self, val_fraction: float) -> tuple["PromptData", "PromptData"]:
        """The last ``ceil(N · val_fraction)`` prompts (at least one when ``val_fraction > 0`` and
        N > 1) are held out; the rest train."""
        n, cut = len(self), held_out_cut(len(self), val_fraction)

        def part(s):
            return PromptData(self.texts[s], self.tokens[s], self.answers[s], self.truncated, self.files)
        return part(slice(0, cut)), part(slice(cut, n))


def _prompt_text(record: Any, where: str, tokenizer) -> tuple[str, list[int]]:
    """The prompt's text and ids: a string as it is, encoded as a prompt (``encode_prompt``: the
    tokenizer's BOS); chat messages through the chat template, encoded as they render."""
    if not isinstance(record, dict) or "prompt" not in record:
        raise DataError(f"{where}: a GRPO prompt row needs a 'prompt' (a string or chat messages)")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return prompt, [int(i) for i in tokenizer.encode_prompt(prompt)]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        text = generation_prompt(prompt, tokenizer)
        return text, [int(i) for i in tokenizer.encode(text)]
    raise DataError(f"{where}: 'prompt' must be a string or a list of {{'role', 'content'}} messages")


def load_prompts(data_cfg, tokenizer, max_tokens: int) -> PromptData:
    """Read every prompt of ``data_cfg.corpus`` (module docstring).

    Raises:
        DataError: no files, a line without a prompt, or no prompt left after ``skip_long_examples``.
    """
    files = resolve_files(data_cfg.corpus)
    if not files:
        raise DataError(f"data.corpus={data_cfg.corpus!r} matches no file")
    out = PromptData([], [], [], files=len(files))
    for path in files:
        for where, record in iter_json_lines(path):
            text, ids = _prompt_text(record, where, tokenizer)
            if len(ids) > max_tokens:
                if data_cfg.skip_long_examples:
                    out.skipped.append(where)
                    continue
                ids, out.truncated = ids[-max_tokens:], out.truncated + 1
            if not ids:
                raise DataError(f"{where}: the prompt encodes to no token")
            out.texts.append(text)
            out.tokens.append(ids)
            out.answers.append(record.get("answer"))
    if not out.texts:
        raise DataError(f"data.corpus={data_cfg.corpus!r}: no prompt of at most {max_tokens} tokens "
                        "(data.skip_long_examples dropped them all)")
    return out


def prompt_batch(data: PromptData, step: int, num_prompts: int, seed: int) -> np.ndarray:
    """The prompts of rollout ``step``: int ``[num_prompts]`` indices drawn by
    ``np.random.default_rng([seed, step])`` (a pure function of the step, so a resume continues it)."""
    return np.random.default_rng([seed, step]).integers(0, len(data), num_prompts)
