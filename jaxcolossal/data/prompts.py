"""Prompts for GRPO: JSON lines of a prompt and the fields its reward functions read (e.g. an ``answer``).

``training.objective=grpo`` with ``data.format=prompts`` reads ``data.corpus`` (JSON-lines globs), one
prompt per line, as TRL's ``GRPOTrainer`` datasets hold them:

* ``{"prompt": str, ...}``: the prompt's text is encoded as TRL's ``GRPOTrainer`` encodes it,
  ``processing_class(text=prompt)``: with the special tokens the tokenizer adds to a prompt
  (``encode_prompt``: LLaMA 3's ``<|begin_of_text|>`` first; no end-of-text id: the completion
  continues it).
* ``{"prompt": [messages], ...}``: chat messages, rendered with the tokenizer's chat template (or the
  plain ``"<role>: <content>\\n"`` form) and its generation prompt, as ``data.format=chat`` renders it,
  and encoded without added special tokens (the template writes ``bos_token``): TRL's
  ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``.

Every other field of a row (``answer``, ``solution``, any JSON value) is kept and passed to the reward
functions as a keyword of that name, one value per completion, as TRL passes a dataset's extra columns
(:mod:`jaxcolossal.posttrain.rewards`); a row without a field another row has gets ``None`` there, as
a ``datasets`` table holds it. TRL drops the fields ``completion`` and ``completion_ids``, and so do
we; a field named like one of the other keywords (``prompts``, ``completions``, ``trainer_state``,
``log_extra``, ``log_metric``) is refused.

A prompt longer than ``max_tokens`` (``training.seq_len + 1 - posttrain.max_completion_length``) is
cut to its last ``max_tokens`` tokens and counted, or with ``data.skip_long_examples`` dropped. A
line without a ``prompt`` raises :class:`jaxcolossal.errors.DataError` naming the file and line,
before anything is compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxcolossal.config import Config
from jaxcolossal.config.derived import grpo_prompt_length
from jaxcolossal.config.reward_funcs import REWARD_KEYWORDS
from jaxcolossal.errors import DataError
from jaxcolossal.runtime.dist_logger import get_dist_logger

from .chat import generation_prompt
from .corpus import TEXT_SAMPLE_PROMPT, held_out_cut, iter_json_lines, resolve_files
from .tokenizer import get_tokenizer

__all__ = ["PromptData", "load_prompts", "prompt_batch"]


DROPPED_FIELDS = ("prompt", "completion", "completion_ids")
"""Fields of a prompt row that are not passed to the reward functions (TRL's ``_calculate_rewards``)."""


@dataclass
class PromptData:
    """``N`` prompts: ``texts`` (as rendered and encoded), ``tokens`` (int lists, at most
    ``max_tokens`` each), ``prompts`` (each row's ``prompt`` as given: a string or chat messages, as the
    reward functions see it), ``fields`` (each row's other fields, a dict); ``truncated``: prompts cut
    to fit; ``files``: files read; ``skipped``: the ``file:line`` of prompts dropped."""

    texts: list[str]
    tokens: list[list[int]]
    prompts: list[Any] = field(default_factory=list)
    fields: list[dict] = field(default_factory=list)
    truncated: int = 0
    files: int = 0
    skipped: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def columns(self) -> list[str]:
        """Every field name of the rows besides the prompt, in first-seen order."""
        return list(dict.fromkeys(k for f in self.fields for k in f))

    def column(self, name: str, idx) -> list[Any]:
        """Field ``name`` of rows ``idx`` (``None`` where a row lacks it)."""
        return [self.fields[i].get(name) for i in idx]

    def is_chat(self, i: int) -> bool:
        """Whether row ``i``'s prompt is chat messages (its completions are then message lists)."""
        return isinstance(self.prompts[i], list)

    def split(self, val_fraction: float) -> tuple["PromptData", "PromptData"]:
        """The last ``ceil(N · val_fraction)`` prompts (at least one when ``val_fraction > 0`` and
        N > 1) are held out; the rest train."""
        n, cut = len(self), held_out_cut(len(self), val_fraction)

        def part(s):
            return PromptData(self.texts[s], self.tokens[s], self.prompts[s], self.fields[s], self.truncated,
                              self.files)
        return part(slice(0, cut)), part(slice(cut, n))


def _fields(record: dict, where: str) -> dict:
    """The row's fields passed to the reward functions (all but :data:`DROPPED_FIELDS`).

    Raises:
        DataError: a field named like one of the reward functions' own keywords."""
    clash = [k for k in record if k in REWARD_KEYWORDS and k not in DROPPED_FIELDS]
    if clash:
        raise DataError(f"{where}: the field {clash[0]!r} has the name of a keyword every reward function is "
                        f"called with ({', '.join(REWARD_KEYWORDS)}); rename it")
    return {k: v for k, v in record.items() if k not in DROPPED_FIELDS}


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
        DataError: no files, a line without a prompt, a field named like a reward keyword
            (:func:`_fields`), or no prompt left after ``skip_long_examples``.
    """
    files = resolve_files(data_cfg.corpus)
    if not files:
        raise DataError(f"data.corpus={data_cfg.corpus!r} matches no file")
    out = PromptData([], [], files=len(files))
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
            out.prompts.append(record["prompt"])
            out.fields.append(_fields(record, where))
    if not out.texts and out.skipped:
        raise DataError(f"data.corpus={data_cfg.corpus!r}: no prompt of at most {max_tokens} tokens "
                        f"(data.skip_long_examples dropped all {len(out.skipped)}); raise training.seq_len or set "
                        "data.skip_long_examples=false to keep their last tokens")
    if not out.texts:
        raise DataError(f"data.corpus={data_cfg.corpus!r}: the file(s) ({', '.join(files[:3])}"
                        f"{', ...' if len(files) > 3 else ''}) hold no prompt row: add JSON lines with a 'prompt'")
    return out


def prompt_batch(data: PromptData, step: int, num_prompts: int, seed: int) -> np.ndarray:
    """The prompts of rollout ``step``: int ``[num_prompts]`` indices drawn by
    ``np.random.default_rng([seed, step])`` (a pure function of the step, so a resume continues it)."""
    return np.random.default_rng([seed, step]).integers(0, len(data), num_prompts)


# ----------------------------------------------------------------------------- the prompts format


@dataclass
class PromptSplit:
    """``data.format=prompts`` loaded (:func:`prompt_batches`): the prompts to train on, those held
    out for the held-out reward, and the tokenizer that encoded them; an on-policy objective samples
    its batches from them (:meth:`jaxcolossal.posttrain.grpo.Grpo.loader`)."""

    train: PromptData
    held: PromptData
    tokenizer: Any


def prompt_length_hint(cfg: Config, longest: int) -> str | None:
    """GRPO's hint when ``training.seq_len`` pads the prompts to at least twice the ``longest`` one's
    tokens (``--config OUT/model.yaml`` gives seq_len 512 to 5-token prompts): the seq_len the data
    needs, the longest prompt + ``max_completion_length`` - 1 (a row holds the prompt and the
    completion but the completion's last token); None otherwise."""
    t, po = cfg.training, cfg.posttrain
    width = grpo_prompt_length(cfg)
    if not longest or width < 2 * longest:
        return None
    return (f"GRPO pads every prompt to {width} tokens (training.seq_len={t.seq_len} + 1 - "
            f"posttrain.max_completion_length={po.max_completion_length}) and the longest is {longest}: "
            f"training.seq_len={longest + po.max_completion_length - 1} fits this data (the longest prompt + "
            "max_completion_length - 1), and every step's rollout and update shrink with it")


def prompt_batches(cfg: Config, mesh: Any, spec: Any, eval_bs: int) -> tuple[PromptSplit, list, str]:
    """``data.format=prompts``: ``(split, [], sample prompt)``: the prompts cut to
    :func:`jaxcolossal.config.derived.grpo_prompt_length` tokens and split (:class:`PromptSplit`); no
    fixed evaluation batches (the held-out reward samples its own); says how many prompts were loaded,
    cut and held out, and warns when ``training.seq_len`` is far longer than the prompts need
    (:func:`prompt_length_hint`). ``mesh``, ``spec``, ``eval_bs`` are unused (the rollouts place
    their batches).

    Raises:
        DataError: a line without a ``prompt`` (:func:`load_prompts`).
    """
    t = cfg.training
    tok = get_tokenizer(cfg.data.tokenizer)
    width = grpo_prompt_length(cfg)
    data = load_prompts(cfg.data, tok, width)
    train_part, val_part = data.split(cfg.data.val_fraction)
    get_dist_logger().info(
        f"data.format=prompts: {len(data)} prompts from {data.files} file(s): {len(train_part)} to train, "
        f"{len(val_part)} held out (data.val_fraction={cfg.data.val_fraction:g}); {data.truncated} cut to "
        f"{width} tokens (training.seq_len + 1 - posttrain.max_completion_length)"
        + (f"; {len(data.skipped)} dropped by data.skip_long_examples" if data.skipped else ""), ranks=[0])
    if hint := prompt_length_hint(cfg, max((len(x) for x in data.tokens), default=0)):
        get_dist_logger().warning(hint, ranks=[0])
    return PromptSplit(train_part, val_part, tok), [], t.sample_prompt or TEXT_SAMPLE_PROMPT
