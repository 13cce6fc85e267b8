"""GRPO's reward functions: the built-ins and a user's own, weighted and summed.

A reward function is called as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls one, with keywords
only (:data:`jaxcolossal.config.reward_funcs.REWARD_KEYWORDS`)::

    fn(prompts=[...], completions=[...], completion_ids=[[int]], <field>=[...] for every other field
       of the prompt rows, trainer_state=TrainerState, log_extra=fn, log_metric=fn) -> [float | None]

one value per completion (``None`` or NaN: not scored by this function; a completion no function
scores gets advantage 0, as in TRL). ``prompts`` are the rows' prompts as given (a string, or chat
messages); ``completions`` the decoded texts, or for a chat prompt the message list
``[{"role": "assistant", "content": text}]``, as TRL passes them. ``trainer_state`` has TRL's
``global_step`` (optimizer steps done) and ``max_steps``; ``log_metric(name, value)`` adds a scalar
to the step's metrics (the mean of the step's calls); ``log_extra(column, values)`` is accepted and
kept for the step (:attr:`RewardSet.extra`), not shown yet. Built in:

* ``exact_match``: 1.0 when the completion's final answer equals the row's ``answer``, else 0.0. The
  final answer is the text after the last ``####`` (GSM8K's marker), else the content of the last
  ``\\boxed{...}``, else the completion's first line; both sides are compared stripped, without
  thousands commas, and as numbers when both are numbers (``"12.0"`` equals ``12``).
* ``format``: 1.0 when ``re.search(posttrain.format_pattern, completion, re.DOTALL)`` matches, else 0.0.

A function that raises, returns the wrong number of values, or a value that is not a number (a
string) stops the run with a :class:`~jaxcolossal.errors.RewardError`: one line naming the function
and the step, the function's own traceback below it.
"""
from __future__ import annotations

import re
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from jaxcolossal.config import ConfigError
from jaxcolossal.config.reward_funcs import (
    BUILTIN_REWARDS,
    MODEL_REWARD,
    import_reward,
    reward_signature_problem,
    reward_specs,
    shown_signature,
)
from jaxcolossal.errors import RewardError

__all__ = ["RewardSet", "TrainerState", "completion_text", "exact_match", "final_answer", "format_reward",
           "make_rewards"]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def completion_text(completion: Any) -> str:
    """A completion's text: a string as it is; a chat completion (a list of ``{"role", "content"}``
    messages) its messages' contents joined."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


def final_answer(completion: Any) -> str:
    """The answer a completion (text or messages) gives (module docstring): after the last ``####``,
    else the last ``\\boxed{}``, else its first line; stripped, thousands commas removed."""
    completion = completion_text(completion)
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


def exact_match(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None,
                **kwargs) -> list[float | None]:
    """1.0 where the completion's :func:`final_answer` equals the row's ``answer``, else 0.0;
    ``None`` for a row without an answer."""
    answer = answer if answer is not None else [None] * len(completions)
    return [None if a is None else float(_same(final_answer(c), a)) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> Callable:
    """The ``format`` reward for ``pattern``: 1.0 where ``re.search(pattern, completion, re.DOTALL)``
    matches the completion's text (:func:`completion_text`), else 0.0."""
    rx = re.compile(pattern, re.DOTALL)

    def fmt(prompts, completions, **kwargs):
        return [float(rx.search(completion_text(c)) is not None) for c in completions]
    return fmt


@dataclass
class TrainerState:
    """What a reward function reads of TRL's ``trainer_state`` (transformers' ``TrainerState``):
    ``global_step``, the optimizer steps done before this rollout; ``max_steps``, the run's."""

    global_step: int = 0
    max_steps: int = 0


def _user_traceback(e: BaseException) -> str:
    """The traceback of ``e`` from the reward function's frame on (ours left out)."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(e), e, tb)).rstrip()


def _values(name: str, vals: Any, n: int, where: str) -> list[float]:
    """A function's returned ``vals`` as ``n`` floats (NaN for ``None``).

    Raises:
        RewardError: not a sequence of ``n`` values, or a value that is not a number."""
    if isinstance(vals, (str, bytes, dict)) or not hasattr(vals, "__len__"):
        raise RewardError(f"reward function {name} returned a {type(vals).__name__} at {where}: a reward function "
                          f"returns a list of {n} floats (None where it does not apply), one per completion")
    if len(vals) != n:
        raise RewardError(f"reward function {name} returned {len(vals)} values for {n} completions at {where}: "
                          "it must return one per completion (None where it does not apply)")
    out = []
    for i, v in enumerate(vals):
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            out.append(np.nan if v is None else float(v))
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name} returned a {type(v).__name__} ({str(v)[:40]!r}) for "
                              f"completion {i} at {where}: a reward is a float, or None where the function does "
                              "not apply") from None
    return out


@dataclass
class RewardSet:
    """The run's reward functions: ``names`` (as configured), ``fns`` and ``weights``; ``metrics``
    (what the functions passed to ``log_metric`` during the last :meth:`score`, averaged) and
    ``extra`` (their ``log_extra`` columns)."""

    names: list[str]
    fns: list[Callable]
    weights: np.ndarray
    metrics: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def check_fields(self, fields: Sequence[str]) -> None:
        """Refuse, before anything compiles, a user function that cannot be called with the prompt
        rows' ``fields`` as keywords (:func:`~jaxcolossal.config.reward_funcs.reward_signature_problem`).

        Raises:
            ConfigError: one line naming the function and what it lacks."""
        for name, fn in zip(self.names, self.fns):
            builtin = name in BUILTIN_REWARDS or name.startswith(MODEL_REWARD)
            problem = "" if builtin else reward_signature_problem(fn, list(fields))
            if problem:
                raise ConfigError(f"posttrain.reward_funcs: {name}{shown_signature(fn)} {problem}")

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]],
              fields: dict[str, list], where: str, state: TrainerState | None = None) -> np.ndarray:
        """fp32 ``[n, F]``: each function's rewards of the ``n`` completions, NaN where one returned
        ``None`` (or NaN). ``fields``: each row field's ``n`` values, passed as keywords; ``where``:
        the step, as the error names it (e.g. ``"step 3"``).

        Raises:
            RewardError: a function that raised (its traceback in ``detail``), returned the wrong
                number of values, or a value that is not a number; naming it and ``where``.
        """
        logged, self.extra = defaultdict(list), {}
        kwargs = dict(fields, trainer_state=state or TrainerState(),
                      log_extra=lambda c, v: self.extra.setdefault(c, []).extend(v),
                      log_metric=lambda k, v: logged[k].append(float(v)))
        out = np.full((len(completions), len(self.fns)), np.nan, np.float32)
        for j, (name, fn) in enumerate(zip(self.names, self.fns)):
            try:
                vals = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            except Exception as e:
                raise RewardError(f"reward function {name} raised at {where}: {type(e).__name__}: {e}".splitlines()[0],
                                  detail=_user_traceback(e)) from e
            out[:, j] = _values(name, vals, len(completions), where)
        self.metrics = {k: float(np.mean(v)) for k, v in logged.items()}
        return out

    def total(self, per_func: np.ndarray) -> np.ndarray:
        """fp32 ``[n]``: the weighted sum over the functions, NaN-skipping; NaN where none scored
        (TRL's ``nansum`` with unscorable rows kept NaN)."""
        total = np.nansum(per_func * self.weights[None, :], axis=1)
        return np.where(np.all(np.isnan(per_func), axis=1), np.nan, total).astype(np.float32)


def make_rewards(funcs: str, weights: str, format_pattern: str, model_reward: Callable | None = None) -> RewardSet:
    """The :class:`RewardSet` of ``posttrain.reward_funcs``/``reward_weights``; ``model_reward(path)`` builds
    a ``model:PATH`` entry's function (the rollout's: :class:`jaxcolossal.posttrain.reward_model.ModelReward`
    on its mesh).

    Raises:
        ConfigError: as :func:`jaxcolossal.config.reward_funcs.reward_specs`; a ``model:`` entry without
            ``model_reward``.
    """
    specs = reward_specs(funcs, weights)
    builtins: dict[str, Callable] = {"exact_match": exact_match, "format": format_reward(format_pattern)}
    assert set(builtins) == set(BUILTIN_REWARDS)

    def build(name: str) -> Callable:
        if name.startswith(MODEL_REWARD):
            if model_reward is None:
                raise ConfigError(f"posttrain.reward_funcs: {name} needs the rollout's mesh to score on")
            return model_reward(name[len(MODEL_REWARD):])
        return builtins[name] if name in builtins else import_reward(name)

    fns = [build(n) for n, _ in specs]
    return RewardSet([n for n, _ in specs], fns, np.asarray([w for _, w in specs], np.float32))
