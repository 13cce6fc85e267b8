"""Preference data for DPO: JSON lines of a prompt with a chosen and a rejected response.

``training.objective=dpo`` reads ``data.corpus`` (JSON-lines globs), one preference pair per line,
in either of the two forms of TRL's ``DPOTrainer`` datasets:

* plain text (TRL's "standard" form): ``{"prompt": str, "chosen": str, "rejected": str}``. The
  row is ``encode(prompt) + encode(response)`` and, when the tokenizer has one, its end-of-text
  id, as TRL's ``DPOTrainer`` tokenizes prompt and completion separately and appends eos.
* chat messages (TRL's "conversational" form): ``{"prompt": [messages], "chosen": [messages],
  "rejected": [messages]}`` (``prompt`` may also be a string: one user turn), where the responses
  are assistant turns. The conversation is rendered through the tokenizer's chat template, or the
  plain ``"<role>: <content>\\n"`` form, exactly as ``data.format=chat`` renders it
  (:func:`jaxcolossal.data.chat.render_segments`).

Each response becomes one row of ``seq_len + 1`` tokens, cut to fit and padded with the end-of-text
id (0 for the byte tokenizer). The loss mask is 1 on the targets that are response tokens (the
closing end-of-text included) and 0 on the prompt (assistant turns inside the prompt too) and on the
padding. A line that is not a pair (a missing or non-string ``chosen``/``rejected``, a malformed
message) raises :class:`jaxcolossal.errors.DataError` naming the file and line, before anything is
compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxcolossal.config import Config
from jaxcolossal.errors import DataError
from jaxcolossal.runtime.dist_logger import get_dist_logger

from .chat import ROLES, _chat_template, render_segments
from .corpus import TEXT_SAMPLE_PROMPT, held_out_cut, iter_json_lines, resolve_files
from .loader import PairLoader
from .tokenizer import get_tokenizer

__all__ = ["PreferenceData", "load_preferences", "pair_rows", "preference_batches"]


@dataclass
class PreferenceData:
    """Rendered preference pairs (``N`` of them).

    ``chosen``/``rejected``: int32 ``[N, seq_len + 1]`` rows; ``chosen_masks``/``rejected_masks``:
    float32 ``[N, seq_len]`` loss masks aligned with the targets ``rows[:, 1:]`` (1 = a response
    token); ``truncated``: responses cut to fit; ``files``: files read; ``skipped``: the
    ``file:line`` of pairs dropped by ``data.skip_long_examples``; ``chosen_lengths``/``rejected_lengths``:
    int32 ``[N]``, each row's tokens before its padding (prompt + response + eos, at most ``seq_len + 1``:
    TRL's ``attention_mask`` sum), or None: read off the masks (:meth:`row_lengths`)."""

    chosen: np.ndarray
    rejected: np.ndarray
    chosen_masks: np.ndarray
    rejected_masks: np.ndarray
    truncated: int = 0
    files: int = 0
    skipped: list = field(default_factory=list)
    chosen_lengths: np.ndarray | None = None
    rejected_lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.chosen)

    def split(self, val_fraction: float) -> tuple["PreferenceData", "PreferenceData"]:
        """The last ``ceil(N · val_fraction)`` pairs (at least one when ``val_fraction > 0`` and
        N > 1) are the held-out split; the rest train."""
        n, cut = len(self), held_out_cut(len(self), val_fraction)

        def part(s):
            lengths = {k: None if v is None else v[s] for k, v in (("chosen_lengths", self.chosen_lengths),
                                                                    ("rejected_lengths", self.rejected_lengths))}
            return PreferenceData(self.chosen[s], self.rejected[s], self.chosen_masks[s], self.rejected_masks[s],
                                  self.truncated, self.files, **lengths)
        return part(slice(0, cut)), part(slice(cut, n))

    def rows(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows int32 [2P, seq_len + 1], masks float32 [2P, seq_len])`` of the pairs ``pairs``
        (int ``[P]``), interleaved by :func:`pair_rows`."""
        return (pair_rows(self.chosen[pairs], self.rejected[pairs]),
                pair_rows(self.chosen_masks[pairs], self.rejected_masks[pairs]))

    def row_lengths(self, pairs: np.ndarray) -> np.ndarray:
        """int64 ``[2P]``: the tokens of each row of :meth:`rows` before its padding (what TRL's
        ``num_tokens`` counts). Without recorded lengths: one past the last response target, or the whole
        row when no target is trained (the response ends the row as :mod:`.preference` renders it)."""
        def read(lengths, masks):
            if lengths is not None:
                return np.asarray(lengths, np.int64)[pairs]
            m = np.asarray(masks)[pairs] > 0
            last = np.where(m.any(1), m.shape[1] - 1 - np.argmax(m[:, ::-1], 1), m.shape[1] - 1)
            return last.astype(np.int64) + 2
        return pair_rows(read(self.chosen_lengths, self.chosen_masks), read(self.rejected_lengths, self.rejected_masks))


def pair_rows(chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """``[2P, ...]`` from ``chosen``/``rejected`` ``[P, ...]``: row ``2i`` is pair ``i``'s chosen
    response, row ``2i + 1`` its rejected one. Interleaved rather than TRL's ``[chosen; rejected]``
    halves so that any split of the batch into data shards and microbatches of an even number of
    rows keeps each pair on one device (the DPO loss needs both of a pair's log-probs)."""
    out = np.empty((2 * len(chosen),) + chosen.shape[1:], chosen.dtype)
    out[0::2], out[1::2] = chosen, rejected
    return out


def _messages(value, where: str, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {name!r} must be a string or a non-empty list of {{role, content}} messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {name}[{i}] must be {{'role': one of {list(ROLES)}, 'content': a string}}, "
                            f"got {str(m)[:80]}")
    return value


def parse_pair(record, where: str) -> tuple[str, object, object, object]:
    """``(form, prompt, chosen, rejected)`` of one JSON line: ``form`` ``"text"`` (three strings) or
    ``"chat"`` (message lists; a string prompt becomes one user turn).

    Raises:
        DataError: not an object, ``chosen`` or ``rejected`` missing, or of the wrong type (named
            with ``where``, the file and line).
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with 'prompt', 'chosen' and 'rejected', got "
                        f"{type(record).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise DataError(f"{where}: the preference pair has no {' or '.join(repr(k) for k in missing)}")
    prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str) and isinstance(prompt, str):
        return "text", prompt, chosen, rejected
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise DataError(f"{where}: 'prompt', 'chosen' and 'rejected' must be all strings or all message lists "
                        f"(a string prompt is allowed with message responses)")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, where, "prompt")
    chosen, rejected = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
    for name, resp in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in resp):
            raise DataError(f"{where}: {name!r} has no assistant turn, so nothing to train on")
    return "chat", prompt, chosen, rejected


def _response_segments(prompt: list[dict], response: list[dict], template, eos_text: str) -> list:
    """The rendered conversation ``prompt + response`` as ``[(text, trained)]``, trained only on the
    response's assistant turns: each run of trained segments is one assistant turn, and the runs of
    the prompt's own assistant turns are masked out."""
    segments = render_segments(prompt + response, template, eos_text)
    in_prompt = sum(m["role"] == "assistant" for m in prompt)
    out, run, prev = [], 0, False
    for text, trained in segments:
        if trained and not prev:
            run += 1
        prev = trained
        out.append((text, trained and run > in_prompt))
    return out


class _Renderer:
    """One tokenizer's rows: the text form (TRL's prompt + completion + eos) or the chat form."""

    def __init__(self, tokenizer, seq_len: int):
        self.tok, self.seq_len = tokenizer, seq_len
        self.template = _chat_template(tokenizer)
        self.eos = getattr(tokenizer, "eos_id", None)
        self.pad = 0 if self.eos is None else self.eos
        self.eos_text = tokenizer.decode([self.eos]) if (self.eos is not None and self.template is None) else ""

    def segments(self, form: str, prompt, response) -> list:
        if form == "chat":
            return _response_segments(prompt, response, self.template, self.eos_text)
        return [(prompt, False), (response, True)]

    def row(self, segments, form: str) -> tuple[np.ndarray, np.ndarray, bool, int]:
        """``(tokens int32 [seq_len + 1], mask float32 [seq_len], cut, tokens before the padding)``."""
        ids = [self.tok.encode(text).astype(np.int64) for text, _ in segments]
        flags = [np.full(len(i), t, np.float32) for i, (_, t) in zip(ids, segments)]
        if form == "text" and self.eos is not None:  # TRL appends eos to the completion
            ids.append(np.array([self.eos], np.int64))
            flags.append(np.ones(1, np.float32))
        tokens, trained = np.concatenate(ids), np.concatenate(flags)
        n = self.seq_len + 1
        cut = len(tokens) > n
        tokens, trained = tokens[:n], trained[:n]
        row = np.full(n, self.pad, np.int32)
        row[: len(tokens)] = tokens
        m = np.zeros(n, np.float32)
        m[: len(trained)] = trained
        return row, m[1:], cut, len(tokens)


def _refuse_identical(out: dict, corpus: str, seq_len: int) -> None:
    """Refuse pairs that are all ``chosen == rejected`` within ``seq_len`` (the same tokens and mask):
    the DPO loss is then log 2 with a zero gradient at every step, so the run would train nothing.

    Raises:
        DataError: every pair's two rows are equal."""
    same = sum(np.array_equal(c, r) and np.array_equal(cm, rm) for c, r, cm, rm in
               zip(out["chosen"], out["rejected"], out["chosen_masks"], out["rejected_masks"]))
    if same == len(out["chosen"]):
        raise DataError(f"data.corpus={corpus!r}: in all {same} preference pairs the chosen response equals the "
                        f"rejected one (within training.seq_len={seq_len} tokens), so DPO has nothing to learn; "
                        "each pair needs a preferred and a different dispreferred response")


def load_preferences(data_cfg, tokenizer, seq_len: int) -> PreferenceData:
    """Read ``data_cfg.corpus`` (JSON-lines globs) as preference pairs and render them (module doc).

    A pair one of whose responses has no token left within ``seq_len`` is an error, or with
    ``data_cfg.skip_long_examples`` is dropped and its ``file:line`` listed in ``skipped``.

    Raises:
        FileNotFoundError: no file matches.
        DataError: a line that does not parse or is not a pair (file and line named), a response
            cut off entirely by ``seq_len`` (unless ``skip_long_examples``), no pairs at all, or
            pairs whose chosen and rejected responses are all the same (:func:`_refuse_identical`).
    """
    r = _Renderer(tokenizer, seq_len)
    out = {"chosen": [], "rejected": [], "chosen_masks": [], "rejected_masks": [], "chosen_lengths": [],
           "rejected_lengths": []}
    truncated, skipped = 0, []
    files = resolve_files(data_cfg.corpus)
    for path in files:
        for where, record in iter_json_lines(path):
            form, prompt, chosen, rejected = parse_pair(record, where)
            rows = {name: r.row(r.segments(form, prompt, resp), form)
                    for name, resp in (("chosen", chosen), ("rejected", rejected))}
            empty = [name for name, (_, m, _, _) in rows.items() if not m.any()]
            if empty:
                if getattr(data_cfg, "skip_long_examples", False):
                    skipped.append(where)
                    continue
                raise DataError(f"{where}: no {' or '.join(empty)} response token is left within "
                                f"training.seq_len={seq_len}; raise seq_len, shorten the prompt, or set "
                                "data.skip_long_examples=true to drop such pairs")
            for name, (row, m, cut, length) in rows.items():
                out[name].append(row)
                out[name + "_masks"].append(m)
                out[name + "_lengths"].append(np.int32(length))
                truncated += cut
    if not out["chosen"]:
        raise DataError(f"data.corpus={data_cfg.corpus!r} holds no preference pairs"
                        + (f" ({len(skipped)} dropped by data.skip_long_examples)" if skipped else ""))
    _refuse_identical(out, data_cfg.corpus, seq_len)
    return PreferenceData(**{k: np.stack(v) for k, v in out.items()}, truncated=truncated, files=len(files),
                          skipped=skipped)


def preference_batches(cfg: Config, mesh: Any, spec: Any, eval_bs: int) -> tuple[PairLoader, list, str]:
    """``data.format=preference`` (DPO): ``(loader, evaluation batches, sample prompt)``: pairs drawn per
    step (:class:`jaxcolossal.data.loader.PairLoader` on ``mesh`` with the batch ``spec``), the
    held-out pairs as ``training.eval_batches`` fixed batches of ``eval_bs`` rows; says how many pairs
    were loaded, cut and held out.

    Raises:
        DataError: a line that is not a preference pair (:func:`load_preferences`).
    """
    t = cfg.training
    data = load_preferences(cfg.data, get_tokenizer(cfg.data.tokenizer), t.seq_len)
    train_part, val_part = data.split(cfg.data.val_fraction)
    get_dist_logger().info(
        f"data.format=preference: {len(data)} pairs from {data.files} file(s): {len(train_part)} to train, "
        f"{len(val_part)} held out (data.val_fraction={cfg.data.val_fraction:g}); {data.truncated} responses "
        f"cut to training.seq_len={t.seq_len} tokens" + (f"; {len(data.skipped)} pairs dropped by "
                                                            "data.skip_long_examples" if data.skipped else ""),
        ranks=[0])
    loader = PairLoader(train_part, t.batch_size, t.seed, mesh=mesh, batch_spec=spec)
    held = val_part if len(val_part) else train_part
    rows, masks = held.rows(np.arange(len(held)))
    return loader, loader.eval_batches(rows, masks, eval_bs, t.eval_batches), t.sample_prompt or TEXT_SAMPLE_PROMPT
