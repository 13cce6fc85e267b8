"""Preference pairs for a reward model (``training.objective=reward``, ``data.format=preference``): the
rows of :mod:`.preference` (``prompt + response + eos``, interleaved chosen/rejected, padded with the
end-of-text id, or 0 without one) and each pair's ``margin``, as TRL 1.16's ``RewardTrainer`` reads its
datasets (``DataCollatorForPreference``: a ``margin`` column when the examples have one).

A line's optional ``margin`` is a number; either every pair has one or none does (TRL's collator reads
the column when its first example has it, and fails on a row without). Without margins the batch's
``margin`` is zero, which is the same loss as TRL's margin-free branch (``-logsigmoid(r_c - r_r - 0)``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from jaxcolossal.config import Config
from jaxcolossal.errors import DataError
from jaxcolossal.runtime.dist_logger import get_dist_logger

from .corpus import TEXT_SAMPLE_PROMPT, held_out_cut, iter_json_lines, resolve_files
from .loader import PairLoader
from .preference import load_preferences, pair_rows
from .tokenizer import get_tokenizer

__all__ = ["MarginPairLoader", "pad_token_id", "pair_margins", "reward_batches"]


@functools.lru_cache(maxsize=8)
def pad_token_id(tokenizer: str) -> int:
    """The id the preference rows are padded with for ``data.tokenizer`` ``tokenizer``: its end-of-text id,
    or 0 when it has none (the byte tokenizer), as :mod:`.preference` pads; the reward model's
    ``pad_token_id`` (its score is read at the last token that is not it)."""
    eos = getattr(get_tokenizer(tokenizer), "eos_id", None)
    return 0 if eos is None else int(eos)


def pair_margins(data_cfg, skipped: list) -> np.ndarray | None:
    """float32 ``[N]``: the ``margin`` of each pair :func:`.preference.load_preferences` kept (the lines
    of ``data_cfg.corpus`` in its order, less the ``file:line`` entries of ``skipped``), or None when no
    line has one.

    Raises:
        DataError: a margin that is not a finite number, or margins on some lines only (the first such
            line named).
    """
    dropped, out, missing = set(skipped), [], None
    for path in resolve_files(data_cfg.corpus):
        for where, record in iter_json_lines(path):
            if where in dropped:
                continue
            m = record.get("margin") if isinstance(record, dict) else None
            if m is None:
                missing = missing or where
                out.append(None)
                continue
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
                raise DataError(f"{where}: 'margin' must be a finite number, got {m!r}")
            out.append(float(m))
    if all(m is None for m in out):
        return None
    if missing:
        raise DataError(f"{missing}: this pair has no 'margin' while others have one; give every pair a margin "
                        "or none (TRL's RewardTrainer reads the column from all rows)")
    return np.asarray(out, np.float32)


class MarginPairLoader(PairLoader):
    """:class:`.loader.PairLoader` whose batches also hold ``margin``: float32 ``[B, t]``, each row its
    pair's margin broadcast over the row (a ``[B, t]`` batch field splits into data shards and
    microbatches as the tokens do; the objective reads column 0).

    ``margins``: float32 ``[N]``, one per pair of ``pairs``.
    """

    def __init__(self, pairs, margins: np.ndarray, batch_size: int, seed: int, mesh=None, batch_spec=None,
                 process_index=None, process_count=None, start_step: int = 0):
        super().__init__(pairs, batch_size, seed, mesh=mesh, batch_spec=batch_spec, process_index=process_index,
                         process_count=process_count, start_step=start_step)
        self.row_margins = pair_rows(np.asarray(margins, np.float32), np.asarray(margins, np.float32))  # [2N]

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of step ``step``: the pair loader's, and ``margin`` float32 ``[b, t]``."""
        out = super().local_batch(step)
        idx = self.row_index(step)
        out["margin"] = np.ascontiguousarray(np.broadcast_to(self.row_margins[idx][:, None], out["inputs"].shape))
        return out

    def margin_eval_batches(self, rows, masks, margins, batch_size: int, num_batches: int) -> list[tuple]:
        """Fixed evaluation batches ``(inputs, targets, loss_mask, margin)`` of interleaved pair ``rows``
        (``[2P, seq_len + 1]``), their ``masks`` and the pairs' ``margins [P]``, placed like training batches."""
        base = self.eval_batches(rows, masks, batch_size, num_batches)
        n = batch_size * num_batches
        per_row = pair_rows(margins, margins)[np.arange(n) % len(rows)]
        t = rows.shape[1] - 1
        return [(*b, self.to_global(np.broadcast_to(per_row[i * batch_size:(i + 1) * batch_size, None],
                                                    (batch_size, t)).copy()))
                for i, b in enumerate(base)]


def reward_batches(cfg: Config, mesh: Any, spec: Any, eval_bs: int) -> tuple[MarginPairLoader, list, str]:
    """A reward model's ``data.format=preference``: ``(loader, evaluation batches, sample prompt)`` as
    :func:`.preference.preference_batches` gives them, each batch with the pairs' ``margin`` (zero
    without one); says how many pairs were loaded, held out and carry margins.

    Raises:
        DataError: a line that is not a preference pair (:func:`.preference.load_preferences`), or a bad
            margin (:func:`pair_margins`).
    """
    t = cfg.training
    data = load_preferences(cfg.data, get_tokenizer(cfg.data.tokenizer), t.seq_len)
    margins = pair_margins(cfg.data, data.skipped)
    has_margin = margins is not None
    margins = margins if has_margin else np.zeros(len(data), np.float32)
    cut = held_out_cut(len(data), cfg.data.val_fraction)
    train_part, val_part = data.split(cfg.data.val_fraction)
    get_dist_logger().info(
        f"data.format=preference (reward model): {len(data)} pairs from {data.files} file(s): {len(train_part)} to "
        f"train, {len(val_part)} held out (data.val_fraction={cfg.data.val_fraction:g}); {data.truncated} responses "
        f"cut to training.seq_len={t.seq_len} tokens; " + ("each with its margin" if has_margin else "no margins"),
        ranks=[0])
    loader = MarginPairLoader(train_part, margins[:cut], t.batch_size, t.seed, mesh=mesh, batch_spec=spec)
    held, held_m = (val_part, margins[cut:]) if len(val_part) else (train_part, margins[:cut])
    rows, masks = held.rows(np.arange(len(held)))
    evals = loader.margin_eval_batches(rows, masks, held_m, eval_bs, t.eval_batches)
    return loader, evals, t.sample_prompt or TEXT_SAMPLE_PROMPT
