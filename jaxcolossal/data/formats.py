"""Every ``data.format`` as a plug-in, in one registry (:data:`FORMATS`): the function that loads
it into a training loader, its fixed evaluation batches and the end-of-run sample's prompt, and
how the sample is encoded. The training loop asks :func:`data_format` and never names a format.

A format is one function in its own file, ``batches(cfg, mesh, spec, eval_bs) -> (loader,
evaluation batches, sample prompt)``, and one line here. ``mesh``/``spec``: where the batches are
placed (the mesh and the data group's ``PartitionSpec``); ``eval_bs``: an evaluation batch's rows
(the training microbatch's). ``loader``: an object whose ``batch(step)`` returns the step's batch
dict (``inputs``/``targets`` int32 ``[B, t]`` and the optional ``loss_mask``, ``segment_ids``,
``positions``), or the data an on-policy objective samples its batches from (its ``loader``
hook: :meth:`jaxcolossal.posttrain.grpo.Grpo.loader`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from jaxcolossal.config import Config

from .chat import chat_batches
from .preference import preference_batches
from .pretraining import pretraining_batches
from .prompts import prompt_batches

Batches = Callable[[Config, Any, Any, int], tuple[Any, list, str]]


@dataclass(frozen=True)
class DataFormat:
    """One ``data.format``: its loading function and how the end-of-run sample treats it."""

    name: str
    """``data.format``'s value."""
    batches: Batches
    """``(cfg, mesh, spec, eval_bs) -> (loader, evaluation batches, sample prompt)`` (module docstring)."""
    sample_ends_at_eos: bool = False
    """The end-of-run sample stops at the first end-of-text id (a chat or prompt-tuned model's turn ends there)."""
    sample_as_prompt: bool = False
    """The sample's prompt is encoded as the format's prompts are (``encode_prompt``: the tokenizer's
    BOS), not as text (``encode``: no special tokens)."""


FORMATS: dict[str, DataFormat] = {f.name: f for f in (
    DataFormat("text", pretraining_batches),      # jaxcolossal/data/pretraining.py
    DataFormat("jsonl", pretraining_batches),
    DataFormat("parquet", pretraining_batches),
    DataFormat("datasets", pretraining_batches),
    DataFormat("chat", chat_batches, sample_ends_at_eos=True),  # jaxcolossal/data/chat.py
    DataFormat("preference", preference_batches),  # jaxcolossal/data/preference.py
    DataFormat("prompts", prompt_batches, sample_ends_at_eos=True, sample_as_prompt=True),  # data/prompts.py
)}
"""Every ``data.format`` by name, one line each."""


def data_format(cfg: Config) -> DataFormat:
    """The :class:`DataFormat` of ``cfg.data.format`` (:data:`FORMATS`).

    Raises:
        KeyError: a format no line registers (the config's schema allows none).
    """
    return FORMATS[cfg.data.format]
