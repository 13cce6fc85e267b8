"""The errors a user can cause, one small kind each, with the exit status the command line gives it.

A traceback from ``scripts/train.py`` means a bug; every input a user can get wrong raises one of
these instead, and :func:`exit_status` (the one place the CLI consults) turns it into one line on
stderr and its documented exit code:

============================  ====  ================================================================
kind                          exit  for
============================  ====  ================================================================
:class:`ConfigError`          2     a key, a value or a combination the run cannot take; a
                                    checkpoint folder that does not fit ``training.resume``
:class:`CheckpointMismatchError` 2  a checkpoint of another model size, optimizer or precision
:class:`DependencyError`      2     an optional package the config needs is missing
:class:`DataError`            3     a data file that is missing, unreadable or malformed
:class:`TokenizerError`       3     a tokenizer file that cannot be loaded
:class:`CheckpointError`      3     a checkpoint that cannot be written or restored
:class:`StoppedError`         3     training stopped on purpose: NaN/inf under ``nonfinite_policy``
:class:`RewardError`          2     a GRPO reward function that raised, returned the wrong count or
                                    strings, or left a whole step without a reward; its one line
                                    names the function and the step, the function's own traceback
                                    follows it (``detail``)
============================  ====  ================================================================
"""

from __future__ import annotations


class UserError(Exception):
    """An error the user's input or run caused (not a bug). ``label`` starts its one line and
    ``exit_code`` is what the command line returns; ``detail`` (``""`` for most kinds): lines printed
    below that one line, e.g. the traceback of a user's own reward function."""

    label = "error"
    exit_code = 1
    detail = ""


class ConfigError(UserError, ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""

    label = "config error"
    exit_code = 2


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The config file given does not exist."""


class DataError(UserError, ValueError):
    """A data file is missing, unreadable, or holds what its format does not allow (the message
    names the file, and the line where there is one)."""

    label = "data error"
    exit_code = 3


class TokenizerError(DataError):
    """A tokenizer file or folder that cannot be loaded."""

    label = "tokenizer error"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written, or that does not restore."""

    label = "checkpoint error"
    exit_code = 3


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint, or none that restores, in the folder."""


class CheckpointMismatchError(CheckpointError):
    """The saved state's structure differs from the run's (model size, optimizer or precision): a
    config that does not fit ``training.resume``, so a config error."""

    label = "config error"
    exit_code = 2


class DependencyError(UserError, ImportError):
    """An optional package that the config needs is not installed (the message says which)."""

    label = "error"
    exit_code = 2


class StoppedError(UserError):
    """Training stopped by its own policy (a NaN or inf step under ``training.nonfinite_policy=stop``)."""

    label = "error"
    exit_code = 3


class RewardError(UserError):
    """A GRPO reward function (``posttrain.reward_funcs``) failed during the run: it raised, returned
    the wrong number of values or something that is not a number, or every function left every
    completion of a step without a reward. The message names the function and the step; ``detail``
    holds the function's own traceback (its frames only). The same function fails the same way at
    every start, so its exit status is a config error's (never restarted by the launcher)."""

    label = "reward error"
    exit_code = 2

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def exit_status(error: BaseException) -> tuple[str, int] | None:
    """``(text, exit code)`` for a user error: one line, then the error's ``detail`` lines when it has
    any (a reward function's own traceback); ``None`` for anything else (a bug: let it raise). A
    missing config or corpus file (``FileNotFoundError``) counts as a data error."""
    if isinstance(error, UserError):
        line = f"{error.label}: {error}"
        return (f"{line}\n{error.detail.rstrip()}" if error.detail else line), error.exit_code
    if isinstance(error, FileNotFoundError):
        return f"{DataError.label}: {error}", DataError.exit_code
    return None
