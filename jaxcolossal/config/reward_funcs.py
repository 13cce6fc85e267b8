"""GRPO's reward functions as the config names them (``posttrain.reward_funcs``): imported when the
config loads, and their signatures checked against the keywords they will be called with, so that a
function that cannot be called is refused in one line before anything compiles.

A reward function is called as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls one, with keywords
only: ``fn(prompts=..., completions=..., completion_ids=..., <every other field of the prompt rows>,
trainer_state=..., log_extra=..., log_metric=...)`` (:data:`REWARD_KEYWORDS`). It must take each of
them by name or through ``**kwargs``; a parameter without a default must be one of them (a field the
rows do not have is refused when the data is read: :func:`reward_signature_problem` with the rows'
fields).

A ``module:function`` whose module is not importable from ``sys.path`` is looked for in the current
folder too (where ``python scripts/train.py`` was started; ``python -m`` and ``PYTHONPATH=.`` put it
on the path, a script does not), which stays on ``sys.path`` afterwards, at its end.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Callable, Iterable

from jaxcolossal.errors import ConfigError

__all__ = ["BUILTIN_REWARDS", "MODEL_REWARD", "REWARD_KEYWORDS", "import_reward", "reward_signature_problem", "reward_specs",
           "shown_signature"]

BUILTIN_REWARDS = ("exact_match", "format")
"""The reward functions ``posttrain.reward_funcs`` names without a module
(:mod:`jaxcolossal.posttrain.rewards`)."""

MODEL_REWARD = "model:"
"""The prefix of a reward model in ``posttrain.reward_funcs``: ``model:PATH``, a one-label
``*ForSequenceClassification`` folder (:mod:`jaxcolossal.posttrain.reward_model`)."""

REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""The keywords every reward function is called with (TRL 1.16's), besides the prompt rows' fields."""


def _import_module(module: str, spec: str):
    """``importlib.import_module(module)``, retried with the current folder at the end of ``sys.path``
    when the module (its top-level package) is not found on the path as it is.

    Raises:
        ConfigError: the module cannot be imported (or raised while importing), in one line.
    """
    try:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            cwd = os.getcwd()
            if e.name != module.split(".")[0] or cwd in sys.path or "" in sys.path:
                raise
            sys.path.append(cwd)  # a script's sys.path[0] is its own folder, not the one it was started in
            return importlib.import_module(module)
    except Exception as e:  # the user's module raised while importing: say which and why, in one line
        raise ConfigError(f"posttrain.reward_funcs: cannot import {module!r} for {spec!r} (searched sys.path and "
                          f"the current folder {os.getcwd()}): {type(e).__name__}: {e}".splitlines()[0]) from None


def _check_model_folder(path: str) -> None:
    """A reward model's folder exists with a ``config.json``.

    Raises:
        ConfigError: it does not, in one line."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"posttrain.reward_funcs: {MODEL_REWARD}{path}: no config.json there (a Hugging Face "
                          "*ForSequenceClassification folder, e.g. what --to-hf writes of a reward run)")


def import_reward(spec: str) -> Callable:
    """A user's reward function from ``module:function`` (imported now; the module is looked for on
    ``sys.path``, then in the current folder), its signature checked against :data:`REWARD_KEYWORDS`.

    Raises:
        ConfigError: not ``module:function``, a module that cannot be imported, no callable of that
            name, or a signature that cannot take the keywords (:func:`reward_signature_problem`).
    """
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"posttrain.reward_funcs: {spec!r} is neither a built-in reward ("
                          f"{', '.join(BUILTIN_REWARDS)}) nor module:function")
    fn = getattr(_import_module(module, spec), name, None)
    if not callable(fn):
        raise ConfigError(f"posttrain.reward_funcs: module {module!r} has no function {name!r}")
    problem = reward_signature_problem(fn)
    if problem:
        raise ConfigError(f"posttrain.reward_funcs: {spec}{shown_signature(fn)} {problem}")
    return fn


def shown_signature(fn: Callable) -> str:
    """``fn``'s parameters as written, e.g. ``(completions, solution, **kw)``; ``""`` without a signature."""
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""


def reward_signature_problem(fn: Callable, fields: Iterable[str] | None = None) -> str:
    """What keeps ``fn`` from being called with :data:`REWARD_KEYWORDS` plus ``fields`` (the prompt
    rows' other fields) as keywords, in words (``""``: nothing). With ``fields=None`` (the config
    alone, before the data is read) a parameter without a default that is not one of the keywords
    is not yet a problem (it may be a field). A callable without a signature (a builtin) passes.

    Returns:
        str: e.g. ``"does not take the keywords trainer_state, log_extra, log_metric that every reward
        function is called with (TRL's contract): add **kwargs to its parameters"``.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ""
    keywords = list(REWARD_KEYWORDS) + list(fields or ())
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        return (f"takes {', '.join(positional_only)} by position only: reward functions are called with keywords "
                "only; drop the '/' from its parameters")
    if fields is not None:
        needed = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name not in keywords]
        if needed:
            have = ", ".join(fields) if fields else "none"
            return (f"needs {', '.join(map(repr, needed))}, which no prompt row of data.corpus has (the rows' "
                    f"other fields: {have}); add it to the rows or give the parameter a default")
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return ""
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    fixed = [k for k in REWARD_KEYWORDS if k not in named]
    if fixed:
        return (f"does not take the keyword{'s' if len(fixed) > 1 else ''} {', '.join(fixed)} that every reward "
                "function is called with (TRL's contract): add **kwargs to its parameters")
    extra = [k for k in (fields or ()) if k not in named]
    if extra:
        return (f"does not take the keyword{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}, "
                f"{'fields' if len(extra) > 1 else 'a field'} of the prompt rows passed to every reward function (as "
                "TRL passes a dataset's columns): add **kwargs to its parameters")
    return ""


def reward_specs(funcs: str, weights: str) -> list[tuple[str, float]]:
    """``posttrain.reward_funcs``/``reward_weights`` as ``[(name or module:function, weight)]``; user
    functions are imported and their signatures checked (:func:`import_reward`) so that a missing or
    uncallable one is refused now.

    Raises:
        ConfigError: no function, one listed twice (by name, or two names of one function), a weight
            count that differs, a weight that is not a number, or :func:`import_reward`'s.
    """
    names = [f.strip() for f in funcs.split(",") if f.strip()]
    if not names:
        raise ConfigError("posttrain.reward_funcs is empty: name at least one, e.g. exact_match")
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice:
        raise ConfigError(f"posttrain.reward_funcs={funcs!r} lists {twice} twice: each function is scored once; "
                          f"list it once and set its weight in posttrain.reward_weights instead")
    ws = [w.strip() for w in weights.split(",") if w.strip()] if weights.strip() else ["1"] * len(names)
    if len(ws) != len(names):
        raise ConfigError(f"posttrain.reward_weights has {len(ws)} weights for {len(names)} reward_funcs "
                          f"({', '.join(names)}): give one each, or none")
    try:
        values = [float(w) for w in ws]
    except ValueError:
        raise ConfigError(f"posttrain.reward_weights={weights!r}: expected comma-separated numbers") from None
    seen: dict[int, str] = {}
    for n in names:
        if n.startswith(MODEL_REWARD):  # a reward model folder: loaded by the rollout (posttrain/reward_model.py)
            _check_model_folder(n[len(MODEL_REWARD):])
        elif n not in BUILTIN_REWARDS:
            fn = import_reward(n)
            if id(fn) in seen:
                raise ConfigError(f"posttrain.reward_funcs: {seen[id(fn)]} and {n} are the same function: list it "
                                  "once and set its weight in posttrain.reward_weights instead")
            seen[id(fn)] = n
    return list(zip(names, values))
