"""GRPO's reward functions: the built-ins and a user's own, weighted and summed.

A reward function is called as TRL's ``GRPOTrainer`` calls one: ``fn(prompts=[str], completions=[str],
completion_ids=[[int]], answer=[...]) -> [float | None]``, one value per completion (``None``: not
scored by this function; a completion no function scores gets advantage 0, as in TRL). Built in:

* ``exact_match``: 1.0 when the completion's final answer equals the row's ``answer``, else 0.0. The
  final answer is the text after the last ``####`` (GSM8K's marker), else the content of the last
  ``\\boxed{...}``, else the completion's first line; both sides are compared stripped, without
  thousands commas, and as numbers when both are numbers (``"12.0"`` equals ``12``).
* ``format``: 1.0 when ``re.search(posttrain.format_pattern, completion, re.DOTALL)`` matches, else 0.0.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from jaxcolossal.config.derived import BUILTIN_REWARDS, import_reward, reward_specs

__all__ = ["RewardSet", "exact_match", "final_answer", "format_reward", "make_rewards"]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_answer(completion: str) -> str:
    """The answer a completion gives (module docstring): after the last ``####``, else the last
    ``\\boxed{}``, else its first line; stripped, thousands commas removed."""
    if "####" in completion:
        ans = completion.rsplit("####", 1)[1]
    else:
        boxed = _BOXED.findall(completion)
        ans = boxed[-1] if boxed else completion.strip().split("\n", 1)[0]
    return ans.strip().replace(",", "")


def _same(given: str, expected: Any) -> bool:
    want = str(expected).strip().replace(",", "")
    try:
        return float(given) == float(want)
    except ValueError:
        return given == want


def exact_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any] | None = None,
                **kwargs) -> list[float | None]:
    """1.0 where the completion's :func:`final_answer` equals the row's ``answer``, else 0.0;
    ``None`` for a row without an answer."""
    answer = answer if answer is not None else [None] * len(completions)
    return [None if a is None else float(_same(final_answer(c), a)) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> Callable:
    """The ``format`` reward for ``pattern``: 1.0 where ``re.search(pattern, completion, re.DOTALL)``
    matches, else 0.0."""
    rx = re.compile(pattern, re.DOTALL)

    def fmt(prompts, completions, **kwargs):
        return [float(rx.search(c) is not None) for c in completions]
    return fmt


@dataclass
class RewardSet:
    """The run's reward functions: ``names`` (as configured), ``fns`` and ``weights``."""

    names: list[str]
    fns: list[Callable]
    weights: np.ndarray

    def score(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
              answers: list[Any]) -> np.ndarray:
        """fp32 ``[n, F]``: each function's rewards of the ``n`` completions, NaN where one returned
        ``None``.

        Raises:
            ValueError: a function that returned the wrong number of values, naming it.
        """
        out = np.full((len(completions), len(self.fns)), np.nan, np.float32)
        for j, (name, fn) in enumerate(zip(self.names, self.fns)):
            vals = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answers)
            if len(vals) != len(completions):
                raise ValueError(f"reward function {name} returned {len(vals)} values for {len(completions)} "
                                 "completions")
            out[:, j] = [np.nan if v is None else float(v) for v in vals]
        return out

    def total(self, per_func: np.ndarray) -> np.ndarray:
        """fp32 ``[n]``: the weighted sum over the functions, NaN-skipping; NaN where none scored
        (TRL's ``nansum`` with unscorable rows kept NaN)."""
        total = np.nansum(per_func * self.weights[None, :], axis=1)
        return np.where(np.all(np.isnan(per_func), axis=1), np.nan, total).astype(np.float32)


def make_rewards(funcs: str, weights: str, format_pattern: str) -> RewardSet:
    """The :class:`RewardSet` of ``posttrain.reward_funcs``/``reward_weights``.

    Raises:
        ConfigError: as :func:`jaxcolossal.config.derived.reward_specs`.
    """
    specs = reward_specs(funcs, weights)
    builtins: dict[str, Callable] = {"exact_match": exact_match, "format": format_reward(format_pattern)}
    assert set(builtins) == set(BUILTIN_REWARDS)
    fns = [builtins[n] if n in builtins else import_reward(n) for n, _ in specs]
    return RewardSet([n for n, _ in specs], fns, np.asarray([w for _, w in specs], np.float32))
