"""The ids that end a generated row: one end-of-text id or several (LLaMA 3.1's
``generation_config.json`` names ``eos_token_id: [128001, 128008, 128009]``: ``<|end_of_text|>``,
``<|eom_id|>``, ``<|eot_id|>``), as transformers' ``generate`` takes them: a row ends at the first token
that is any of them."""

from __future__ import annotations

import numbers
from typing import Sequence, Union

from jaxcolossal.models.hf_io import read_special_tokens

EosIds = Union[int, Sequence[int], None]
"""An end-of-text id, a list of them, or None (no row ends early)."""


def eos_ids(eos: EosIds) -> tuple[int, ...]:
    """``eos`` as a tuple of distinct ids in their first order (``()`` for None or an empty list).

    Raises:
        ValueError: an id that is not a non-negative int (a bool, a float, a string, a negative
            number), or a list nested deeper than one level.
    """
    if eos is None:
        return ()
    items = eos.tolist() if hasattr(eos, "tolist") else eos  # numpy ints and arrays too
    if isinstance(items, numbers.Integral) and not isinstance(items, bool):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"eos_id must be an int, a list of ints or None, got {eos!r}")
    out: list[int] = []
    for i in items:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or int(i) < 0:
            raise ValueError(f"eos_id must be an int, a list of ints or None; {i!r} in {eos!r} is not an id >= 0")
        if int(i) not in out:
            out.append(int(i))
    return tuple(out)


def run_eos_ids(tokenizer, model_dir: str | None = None) -> tuple[int, ...]:
    """The ids that end a completion of a run: the tokenizer's ``eos_id`` (when it has one), then the
    ids that ``model_dir``'s ``generation_config.json`` (else ``config.json``) names as
    ``eos_token_id`` (an int or a list; :func:`jaxcolossal.models.hf_io.read_special_tokens`), when
    ``model_dir`` is given (a run's ``model.init_from``: the Hugging Face folder it fine-tunes).

    Raises:
        ValueError: a folder whose ``eos_token_id`` is not an id or a list of ids (:func:`eos_ids`).
    """
    own = getattr(tokenizer, "eos_id", None)
    folder = read_special_tokens(model_dir).get("eos_token_id") if model_dir else None
    return eos_ids(([] if own is None else [own]) + list(eos_ids(folder)))
