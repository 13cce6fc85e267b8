"""The pre-training formats, ``data.format`` ``text``, ``jsonl``, ``parquet`` and ``datasets``:
random windows of one token stream (:func:`jaxcolossal.data.corpus.load_splits` reads each format
into it), and fixed evaluation windows of the validation split."""

from __future__ import annotations

from typing import Any

from jaxcolossal.config import Config

from .corpus import TEXT_SAMPLE_PROMPT, load_splits
from .loader import DataLoader, eval_batches


def pretraining_batches(cfg: Config, mesh: Any, spec: Any, eval_bs: int) -> tuple[DataLoader, list, str]:
    """``(loader, evaluation batches, sample prompt)``: windows of ``training.seq_len`` tokens of the
    training split (:class:`jaxcolossal.data.loader.DataLoader` on ``mesh`` with the batch ``spec``;
    with ``data.packing_mask`` also segment ids and positions, targets across a document start masked),
    and ``training.eval_batches`` fixed batches of ``eval_bs`` windows of the validation split (of
    the training split when the validation split is shorter than one window); the sample's prompt
    is ``training.sample_prompt``, else :data:`jaxcolossal.data.corpus.TEXT_SAMPLE_PROMPT`.

    Raises:
        DataError, DependencyError: as :func:`jaxcolossal.data.corpus.load_splits`.
    """
    t = cfg.training
    if cfg.data.packing_mask:  # documents' starts too: segment ids, positions, cross-document targets masked
        (train_tokens, train_docs), (val_tokens, val_docs) = load_splits(cfg.data, with_docs=True)
    else:
        (train_tokens, val_tokens), train_docs, val_docs = load_splits(cfg.data), None, None
    loader = DataLoader(train_tokens, t.batch_size, t.seq_len, t.seed, mesh=mesh, batch_spec=spec, doc_starts=train_docs)
    use_val = len(val_tokens) > t.seq_len + 1
    evals = [tuple(loader.to_global(a) for a in batch)
             for batch in eval_batches(val_tokens if use_val else train_tokens, eval_bs, t.seq_len, t.eval_batches,
                                       doc_starts=val_docs if use_val else train_docs)]
    return loader, evals, t.sample_prompt or TEXT_SAMPLE_PROMPT
